"""The request record's parts and their writers (engine/sequence.py): an AST scan of specbuild/.

`Sequence` holds the token state and its parts: `ending` (Ending: the text and what ends the
output), `scoring` (Scoring: the logprobs), `admission` (Admission: what the engine decided at
submit and the scheduler at admission), `tally` (SeqStats: the statistics), `spec_state` and
`handle`. Each record declares its fields in its own __init__ (not counted as a write); a
field is then written by one owner. A write is an assignment (plain, augmented, annotated, in
a tuple, or into an item: `x.f[k] = v`) or an in-place call (`x.f.append(...)`, ...) whose
target is `<base>.f`, where base is the record itself (`self` in its class) or an expression
that names a sequence or its part (`seq`, `s`, `it.seq`, `h.seq`, `....tally`,
`seq.admission`, ...).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import specbuild

ROOT = Path(specbuild.__file__).parent
SEQUENCE = ROOT / "engine" / "sequence.py"
MUTATORS = {"append", "extend", "insert", "pop", "clear", "update", "setdefault", "remove", "sort"}
# how the code base names a Sequence (or one of its parts) where it writes one
SEQ_NAMES = {"seq", "s", "src", "source", "sequence", "first", "second"}
PARTS = {"ending": "Ending", "scoring": "Scoring", "admission": "Admission", "tally": "SeqStats"}
# fields per record, Sequence included (issue 54: "at most ~15 fields each"); the bound only goes down
MAX_FIELDS = 15
OWN = "specbuild/engine/sequence.py:{}"
ENGINE = "specbuild/engine/engine.py:Engine"
SCHEDULER = "specbuild/engine/scheduler.py:Scheduler"


def declared_fields(cls: str) -> list[str]:
    """`self.<name>` assigned in the class's __init__ (its fields)."""
    tree = ast.parse(SEQUENCE.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    names: list[str] = []
    for target in _targets(init):
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            if target.attr not in names:
                names.append(target.attr)
    return names


def _targets(tree: ast.AST):
    """Every written expression under tree: assignment targets (tuples unpacked, `x[k] = v`
    as x) and the receivers of in-place calls."""
    for n in ast.walk(tree):
        found: list[ast.expr] = []
        if isinstance(n, ast.Assign):
            found = list(n.targets)
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            found = [n.target]
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS:
            found = [n.func.value]
        while found:
            t = found.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                found.extend(t.elts)
            elif isinstance(t, ast.Subscript):
                found.append(t.value)
            elif isinstance(t, ast.Starred):
                found.append(t.value)
            else:
                yield t


def _names_sequence(base: ast.expr) -> bool:
    if isinstance(base, ast.Name):
        return base.id in SEQ_NAMES
    if isinstance(base, ast.Attribute):
        return base.attr == "seq" or base.attr in PARTS
    if isinstance(base, ast.Subscript):  # item[0] of a backlog (seq, tokens, ...)
        return isinstance(base.value, ast.Name) and base.value.id == "item"
    return False


def sources() -> list[tuple[str, ast.Module]]:
    """(module, parsed tree) of every module under specbuild/."""
    return [(path.relative_to(ROOT.parent).as_posix(), ast.parse(path.read_text())) for path in sorted(ROOT.rglob("*.py"))]


def writers(fields: list[str], owner: str, modules: list[tuple[str, ast.Module]] | None = None) -> dict[str, set[str]]:
    """field -> the writers ("module:Class", or "module" outside a class) of each field; the
    owner's __init__ declares its fields, which is no write."""
    found: dict[str, set[str]] = defaultdict(set)
    for module, tree in sources() if modules is None else modules:
        for cls in [None, *[n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]]:
            scope = tree if cls is None else cls
            nested = {id(t) for c in ast.walk(scope) if isinstance(c, ast.ClassDef) and c is not scope
                      for t in _targets(c)}
            if cls is not None and cls.name == owner:
                nested |= {id(t) for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"
                           for t in _targets(f)}
            for t in _targets(scope):
                if id(t) in nested or not isinstance(t, ast.Attribute) or t.attr not in fields:
                    continue
                base = t.value
                own = isinstance(base, ast.Name) and base.id == "self" and cls is not None and cls.name == owner
                if own or _names_sequence(base):
                    found[t.attr].add(f"{module}:{cls.name}" if cls is not None else module)
    return found


def test_sequence_is_its_token_state_and_parts():
    """Sequence's own fields: the token state, with the parts; what moved into a part is no
    Sequence field any more (front ends read `text`, `content_type`, `constraint` through
    read-only properties)."""
    fields = declared_fields("Sequence")
    assert len(fields) <= MAX_FIELDS, fields
    assert set(PARTS) | {"spec_state", "handle"} <= set(fields)
    for cls in PARTS.values():
        assert not set(declared_fields(cls)) & set(fields), cls


@pytest.mark.parametrize("cls", ["Sequence", *PARTS.values()])
def test_each_field_has_one_writer(cls):
    """Every field of Sequence and of each part has at most one writer besides its declaration:
    its own class's methods, or the one module that owns it."""
    fields = declared_fields(cls)
    assert len(fields) <= MAX_FIELDS, (cls, fields)
    found = writers(fields, cls)
    assert {f: w for f, w in found.items() if len(w) > 1} == {}


@pytest.mark.parametrize("cls", ["SeqStats", "Ending", "Scoring"])
def test_parts_written_by_their_own_methods_only(cls):
    """The statistics (on_pass: the step's and the TensorRT-LLM backends' Verdicts; on_tokens,
    on_admit, ...), the text (Ending.push and flush, from append_tokens) and the logprobs
    (Scoring.add and score_prompt: the step, share_prefills) are written by their part alone."""
    found = writers(declared_fields(cls), cls)
    assert {f: w for f, w in found.items() if w != {OWN.format(cls)}} == {}


def test_statistics_fields():
    assert {"target_passes", "verify_passes", "drafted", "accepted", "gammas", "t_first"} <= set(
        declared_fields("SeqStats"))


def test_admission_fields_have_their_owners():
    """What the engine decides at submit is written by the engine; the KV budget and the
    prompt source (cleared once used or gone) by the scheduler."""
    assert writers(declared_fields("Admission"), "Admission") == {
        "constraint": {ENGINE}, "content_type": {ENGINE}, "content_type_source": {ENGINE},
        "gamma_policy": {ENGINE}, "budget_blocks": {SCHEDULER}, "prefill_source": {SCHEDULER}}


def test_num_cached_has_one_writer():
    """The cached length is written by Sequence.set_cached alone (the step's commit, the
    scheduler's prefix adoption, shared prompts and repairs call it)."""
    assert "num_cached" in declared_fields("Sequence")
    assert writers(["num_cached"], "Sequence") == {"num_cached": {OWN.format("Sequence")}}


def test_a_second_writer_is_found():
    """The scan sees a write through a part's path from another module (the check above would
    then fail): a step writing the text, a front end the KV budget."""
    extra = ast.parse("class Step:\n"
                      "    def finish(self, it):\n"
                      "        it.seq.ending.text += 'x'\n"
                      "        it.seq.admission.budget_blocks = 0\n"
                      "        it.seq.scoring.logprobs.append(None)\n")
    modules = [*sources(), ("specbuild/elsewhere.py", extra)]
    assert writers(["text"], "Ending", modules) == {"text": {OWN.format("Ending"), "specbuild/elsewhere.py:Step"}}
    assert writers(["budget_blocks"], "Admission", modules) == {
        "budget_blocks": {SCHEDULER, "specbuild/elsewhere.py:Step"}}
    assert writers(["logprobs"], "Scoring", modules) == {"logprobs": {OWN.format("Scoring"), "specbuild/elsewhere.py:Step"}}
