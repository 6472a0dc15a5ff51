"""The house stays layered: every import between specbuild modules (those inside functions
included) points down the chain, and the module graph has no cycle. Plus `ruff check`.

Ranks (lower may not import higher):
    0 bundle, errors, formats      the contract and foreign formats
    1 model                        math that knows no request
    2 sampling                     params, warping, acceptance rules
    3 speculation                  what to draft
    4 engine                       the torch step loop
    5 backends                     the request-level interface
    5 telemetry                    the store the engine's event sink feeds (beside backends; neither imports the other)
    6 mpi, serve                   MPI and front ends (neither imports the other)
    7 cli                          click only

Beside the chain: compiler and train may import ranks 0-4 (nothing at or above backends);
train may import compiler, never the reverse. bench may import anything but cli and serve.
`data` is package data and is imported by nobody as code.
"""

from __future__ import annotations

import ast
import re
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "specbuild")

RANK = {"bundle": 0, "errors": 0, "formats": 0, "model": 1, "sampling": 2, "speculation": 3,
        "engine": 4, "backends": 5, "telemetry": 5, "mpi": 6, "serve": 6, "cli": 7}
PEERS = [{"mpi", "serve"}, {"backends", "telemetry"}]  # same rank, neither imports the other
# Rooms beside the chain: the highest chain rank they may import, and which side rooms.
SIDE = {"compiler": (4, set()), "train": (4, {"compiler"}), "bench": (6, {"compiler", "train"})}
# bench's 6 admits mpi; serve (also 6) is excluded by name below.
SIDE_FORBIDDEN = {"bench": {"serve", "cli"}}
# Package-level modules that any room may import (no code of their own to speak of).
NEUTRAL = {"", "__main__"}


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def room_of(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def source_files() -> list[str]:
    out = []
    for dirpath, _, files in os.walk(PKG):
        out += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    return sorted(out)


MODULES = {module_name(p): p for p in source_files()}


def resolve(target: str) -> str | None:
    """The specbuild module an import name refers to (the longest existing prefix)."""
    parts = target.split(".")
    while parts:
        name = ".".join(parts)
        if name in MODULES:
            return name
        parts.pop()
    return None


def imports_of(path: str) -> list[tuple[int, str]]:
    """(line, module) for every specbuild import in the file, at any depth of the tree."""
    mod = module_name(path)
    is_pkg = path.endswith("__init__.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "specbuild":
                    out.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] != "specbuild":
                continue
            # `from specbuild.x import y` may name a submodule y
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                out.append((node.lineno, sub if sub in MODULES else name))
    resolved = []
    for line, target in out:
        r = resolve(target)
        if r is not None and r != mod:
            resolved.append((line, r))
    return resolved


GRAPH = {mod: imports_of(path) for mod, path in MODULES.items()}


def allowed(src_room: str, dst_room: str) -> bool:
    if dst_room in NEUTRAL or src_room in NEUTRAL or src_room == dst_room:
        return True
    if dst_room == "data":
        return False
    if src_room == "data":
        return False
    if src_room in SIDE:
        top, sides = SIDE[src_room]
        if dst_room in SIDE_FORBIDDEN.get(src_room, set()):
            return False
        if dst_room in SIDE:
            return dst_room in sides
        return RANK[dst_room] <= top
    if dst_room in SIDE:  # the chain uses no side room, except the CLI that drives them all
        return src_room == "cli"
    if any(src_room in peers and dst_room in peers for peers in PEERS):
        return False
    return RANK[dst_room] <= RANK[src_room]


def test_every_room_is_known():
    rooms = {room_of(m) for m in MODULES} - NEUTRAL - {"data"}
    unknown = rooms - set(RANK) - set(SIDE)
    assert not unknown, f"rooms without a rank in tests/test_layers.py: {sorted(unknown)}"


def test_rule_rejects_what_it_should():
    # the rule itself, on made-up edges: a test that cannot fail proves nothing
    assert not allowed("model", "engine")
    assert not allowed("backends", "mpi")
    assert not allowed("serve", "mpi")
    assert not allowed("compiler", "backends")
    assert not allowed("compiler", "train")
    assert allowed("train", "compiler")
    assert not allowed("bench", "serve") and not allowed("bench", "cli")
    assert allowed("bench", "mpi") and allowed("cli", "bench")
    assert not allowed("engine", "compiler")
    assert allowed("engine", "bundle") and allowed("formats", "errors")


def test_imports_point_down():
    bad = []
    for mod, edges in GRAPH.items():
        for line, dst in edges:
            if not allowed(room_of(mod), room_of(dst)):
                rel = os.path.relpath(MODULES[mod], ROOT)
                bad.append(f"{rel}:{line}: {mod} ({room_of(mod) or 'specbuild'}) imports "
                           f"{dst} ({room_of(dst)})")
    assert not bad, "imports that point up the chain:\n" + "\n".join(sorted(set(bad)))


def find_cycles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for _, nxt in it:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_cycles():
    g = {"a": [(1, "b")], "b": [(2, "c")], "c": [(3, "a")], "d": [(4, "a")]}
    assert find_cycles(g) == [["a", "b", "c"]]
    assert find_cycles({"a": [(1, "b")], "b": []}) == []


def test_no_import_cycles():
    cycles = find_cycles(GRAPH)
    lines = []
    for comp in cycles:
        members = set(comp)
        for mod in comp:
            for line, dst in GRAPH[mod]:
                if dst in members:
                    lines.append(f"  {os.path.relpath(MODULES[mod], ROOT)}:{line}: {mod} -> {dst}")
    lines = sorted(set(lines))
    assert not cycles, ("import cycles among specbuild modules: "
                        + "; ".join(" <-> ".join(c) for c in cycles) + "\n" + "\n".join(lines))


def test_ruff_check_passes():
    ruff = shutil.which("ruff") or shutil.which("ruff", path=os.path.dirname(sys.executable))
    if ruff is None:
        pytest.skip("ruff is not installed (pip install ruff)")
    proc = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def repo_python_files() -> list[str] | None:
    """The repository's Python files as git sees them (tracked, plus untracked ones git does
    not ignore, which ruff lints too); None outside a git checkout."""
    git = shutil.which("git")
    if git is None or not os.path.exists(os.path.join(ROOT, ".git")):
        return None
    proc = subprocess.run([git, "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py"], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return sorted({p for p in proc.stdout.split() if os.path.isfile(os.path.join(ROOT, p))})


# ---- paths named in docstrings and comments ------------------------------------------------
# A path token: segments of word characters, dots and dashes joined by '/', not preceded by
# another path character (so `NVIDIA/TensorRT-LLM/docs/...` is one foreign token, not `docs/...`).
PATH_TOKEN = re.compile(r"(?<![\w./-])((?:\.\./)*(?:[A-Za-z_][\w.-]*/)+[\w.*-]*\w)")
REPO_ROOTS = ("specbuild", "tests", "scripts", "docs")  # top-level folders: paths from the repository root
FORMER_ROOMS = {"build": "compiler", "runtime": "engine (and model, speculation, mpi)"}  # see CHANGELOG.md


def path_problem(token: str) -> str | None:
    """Why a path named in prose does not name a file of this repository (None: it does, or it is
    not a repository path).

    - `specbuild/...`, `tests/...`, `scripts/...`, `docs/...`: relative to the repository root; must
      exist (a glob must match; a trailing `.name` may be an attribute of a module: `x/y.attr`).
    - `<room>/file.py` or `<room>/module.attr` where room is a folder of specbuild/: relative to
      specbuild/. Other slashed words (`K/V`, `draft/target`, `train/eval`) are not paths.
    - a former room (`build/`, `runtime/`) or a path outside the repository (`../`, `shared/`) is
      always a problem.
    """
    import glob

    if token.startswith("../") or token.split("/")[0] == "shared":
        return "names a path outside the repository"
    first = token.split("/")[0]
    if first in FORMER_ROOMS and token.endswith(".py"):
        return f"specbuild/{first}/ no longer exists (its modules moved to {FORMER_ROOMS[first]})"

    def exists(rel: str) -> bool:
        full = os.path.join(ROOT, rel)
        if any(c in rel for c in "*?["):
            return bool(glob.glob(full))
        if os.path.exists(full) or os.path.exists(full + ".py"):
            return True
        head, dot, _attr = rel.rpartition(".")  # module.attribute
        return bool(dot) and "/" not in _attr and (os.path.isfile(os.path.join(ROOT, head + ".py"))
                                                     or os.path.isdir(os.path.join(ROOT, head)))

    if first in REPO_ROOTS:
        return None if exists(token) else "does not exist"
    if os.path.isdir(os.path.join(PKG, first)) and first != "__pycache__":
        last = token.rsplit("/", 1)[1]
        if "." not in last:  # `train/eval`, `engine/config`: words, not files
            return None
        return None if exists(os.path.join("specbuild", token)) else "does not exist under specbuild/"
    return None


def prose_of(path: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file, every comment of a shell script."""
    import io
    import tokenize

    with open(path, encoding="utf-8") as f:
        src = f.read()
    if path.endswith(".sh"):
        return [(i, ln.split("#", 1)[1]) for i, ln in enumerate(src.splitlines(), 1) if "#" in ln]
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src, filename=path)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc))
    return out


def test_path_problem_rules():
    assert path_problem("specbuild/mpi/minedraft.py") is None
    assert path_problem("tests/helpers/tiny.py") is None
    assert path_problem("specbuild/data/drafters/*/MODEL_CARD.md") is None
    assert path_problem("model/decoder.py") is None  # room-relative
    assert path_problem("formats/trtllm_support.engine_path_problem") is None  # module.attribute
    assert path_problem("K/V") is None and path_problem("train/eval") is None
    assert path_problem("NVIDIA/TensorRT-LLM") is None
    assert path_problem("tests/tiny.py") == "does not exist"
    assert path_problem("model/nothing_here.py") == "does not exist under specbuild/"
    assert "no longer exists" in path_problem("build/draft_role.py")
    assert "outside" in path_problem("../shared/DESIGN.md")
    assert "outside" in path_problem("shared/reference/tensorrt-llm.md")
    found = [m.group(1) for m in PATH_TOKEN.finditer("see NVIDIA/TensorRT-LLM/docs/x.md and `tests/tiny.py`.")]
    assert found == ["NVIDIA/TensorRT-LLM/docs/x.md", "tests/tiny.py"]


def test_paths_named_in_docstrings_and_comments_exist():
    files = repo_python_files()
    if files is None:
        files = [os.path.relpath(p, ROOT) for p in source_files()]
    scripts = os.path.join(ROOT, "scripts")
    files += sorted(os.path.join("scripts", f) for f in os.listdir(scripts) if f.endswith(".sh"))
    bad = []
    for rel in files:
        for line, text in prose_of(os.path.join(ROOT, rel)):
            for m in PATH_TOKEN.finditer(text):
                why = path_problem(m.group(1).rstrip("."))
                if why:
                    bad.append(f"  {rel}:{line + text.count(chr(10), 0, m.start())}: {m.group(1)}: {why}")
    assert not bad, "docstrings and comments name paths that are not in the repository:\n" + "\n".join(bad)


def test_paths_named_in_documents_exist():
    """The README's and docs/'s prose names only paths that exist (links are navigation, checked
    by whoever renders them; CHANGELOG.md names old paths on purpose)."""
    docs = os.path.join(ROOT, "docs")
    pages = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(docs) if f.endswith(".md")) \
        if os.path.isdir(docs) else ["README.md"]
    link = re.compile(r"\[[^\]]*\]\([^)]*\)")
    bad = []
    for rel in pages:
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                for m in PATH_TOKEN.finditer(link.sub("", line)):
                    why = path_problem(m.group(1).rstrip("."))
                    if why:
                        bad.append(f"  {rel}:{line_no}: {m.group(1)}: {why}")
    assert not bad, "documents name paths that are not in the repository:\n" + "\n".join(bad)
