"""The request record's parts and their writers (engine/sequence.py): an AST scan of specbuild/.

Each part declares its fields in its own __init__ (not counted as a write); a field is then
written by one owner. A write is
an assignment (plain, augmented, annotated, in a tuple, or into an item: `x.f[k] = v`) or an
in-place call (`x.f.append(...)`, ...) whose target is `<base>.f`, where base is the part
itself (`self` in its class) or an expression that names a sequence or its part (`seq`,
`s`, `it.seq`, `h.seq`, `....tally`, ...).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import specbuild

ROOT = Path(specbuild.__file__).parent
SEQUENCE = ROOT / "engine" / "sequence.py"
MUTATORS = {"append", "extend", "insert", "pop", "clear", "update", "setdefault", "remove", "sort"}
# how the code base names a Sequence (or its statistics part) where it writes one
SEQ_NAMES = {"seq", "s", "src", "source", "sequence", "first", "second"}
MAX_FIELDS = 15
# Sequence itself is still over MAX_FIELDS: the token state with the parts (tally, spec_state,
# handle) and what the engine decides at submit (constraint, content type, gamma policy, the
# prompt source). The bound only goes down.
SEQUENCE_MAX_FIELDS = 26


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
        return base.attr in ("seq", "tally")
    if isinstance(base, ast.Subscript):  # item[0] of a backlog (seq, tokens, ...)
        return isinstance(base.value, ast.Name) and base.value.id == "item"
    return False


def writers(fields: list[str], owner: str) -> dict[str, set[str]]:
    """field -> the writers ("module:Class", or "module" outside a class) of each field; the
    owner's __init__ declares its fields, which is no write."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = path.relative_to(ROOT.parent).as_posix()
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


def test_statistics_have_one_writer():
    """SeqStats' fields are written only by its own methods (on_pass: the step's and the
    TensorRT-LLM backends' Verdicts; on_tokens, on_admit, ...)."""
    fields = declared_fields("SeqStats")
    assert {"target_passes", "verify_passes", "drafted", "accepted", "gammas", "t_first"} <= set(fields)
    assert len(fields) <= MAX_FIELDS, fields
    found = writers(fields, "SeqStats")
    assert {f: w for f, w in found.items() if w != {"specbuild/engine/sequence.py:SeqStats"}} == {}


def test_statistics_are_not_sequence_fields():
    """The statistics live in the part only: no Sequence field repeats one."""
    assert not set(declared_fields("SeqStats")) & set(declared_fields("Sequence"))


def test_sequence_fields_have_one_writer_each():
    """Every Sequence field has at most one writer besides its declaration: its own methods
    (append_tokens, set_cached, abort, score_prompt, ...), or the one module that owns it (the
    step its logprobs, the scheduler its KV budget, the engine what it decides at submit)."""
    fields = declared_fields("Sequence")
    assert len(fields) <= SEQUENCE_MAX_FIELDS, fields
    found = writers(fields, "Sequence")
    assert {f: w for f, w in found.items() if len(w) > 1} == {}


def test_num_cached_has_one_writer():
    """The cached length is written by Sequence.set_cached alone (the step's commit, the
    scheduler's prefix adoption, shared prompts and repairs call it)."""
    assert "num_cached" in declared_fields("Sequence")
    assert writers(["num_cached"], "Sequence") == {"num_cached": {"specbuild/engine/sequence.py:Sequence"}}
