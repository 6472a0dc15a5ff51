"""scripts/ keeps entry points only (issue 54): the helpers the scripts share live in
scripts/_common.py or come from the library, and every script imports without running."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
COMMON = "_common.py"
# helpers that have one home (scripts/_common.py or the library), by the names they went by
HELPER = re.compile(r"^(pct|percentiles?|quantiles?|sse_\w*|\w*_sse_events|tiny_\w+|make_tiny\w*|build_tiny\w*|cpu_info|lscpu"
                    r"|load_prompts|held_out_\w+|get_json|stream_chat|stop_process_group)$")


def script_files() -> list[str]:
    return sorted(f for f in os.listdir(SCRIPTS) if f.endswith(".py"))


def parse(name: str) -> ast.Module:
    with open(os.path.join(SCRIPTS, name), encoding="utf-8") as f:
        return ast.parse(f.read(), name)


def functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """Every function the module defines, nested ones included, methods left out."""
    methods = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in c.body}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(n) not in methods]


def reimplementations(tree: ast.Module) -> list[str]:
    """What only scripts/_common.py may do: open HTTP connections, parse server-sent events, run
    lscpu, write tiny random checkpoints."""
    found = []
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name in ("HTTPConnection", "make_tiny_hf"):
            found.append(f"line {node.lineno}: {name}")
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            text = node.value.decode(errors="replace") if isinstance(node.value, bytes) else node.value
            if text == "lscpu" or text.startswith("data:"):
                found.append(f"line {node.lineno}: {text!r}")
    return found


def test_shared_helpers_are_defined_once():
    common = {f.name for f in functions(parse(COMMON))}
    assert {"send", "get", "post", "sse_events", "tiny_bundle", "cpu_info"} <= common
    bad = []
    for name in script_files():
        if name == COMMON:
            continue
        tree = parse(name)
        top = {id(n) for n in tree.body}
        for f in functions(tree):  # _common's names at the top level; the helper kinds anywhere
            if (f.name in common and id(f) in top) or HELPER.match(f.name):
                bad.append(f"scripts/{name}:{f.lineno}: defines {f.name}() again")
        bad += [f"scripts/{name}: {what}" for what in reimplementations(tree)]
    assert not bad, ("helpers re-implemented in scripts/ (use scripts/_common.py or the library: "
                     "specbuild.bench.served.pct, specbench.held_out_questions):\n  " + "\n  ".join(bad))


def test_the_check_finds_a_copy():
    copy = ast.parse("import http.client\n"
                     "def pct(v, q):\n    return sorted(v)[int(q * (len(v) - 1))]\n"
                     "def fetch(port):\n    c = http.client.HTTPConnection('127.0.0.1', port)\n"
                     "    return [line[5:] for line in c.getresponse() if line.startswith(b'data:')]\n")
    assert [f.name for f in functions(copy) if HELPER.match(f.name)] == ["pct"]
    assert [w.split(": ")[1] for w in reimplementations(copy)] == ["HTTPConnection", "'data:'"]


def test_every_script_is_guarded_and_imports():
    unguarded = []
    for name in script_files():
        tree = parse(name)
        guarded = any(isinstance(n, ast.If) and "__name__" in ast.unparse(n.test) and "__main__" in ast.unparse(n.test)
                      for n in tree.body)
        if not guarded and name != COMMON:
            unguarded.append(name)
    assert not unguarded, f"scripts without an `if __name__ == \"__main__\":` guard: {unguarded}"
    # one fresh interpreter imports them all (not as __main__): none may fail or run its main
    code = ("import importlib.util, json, os, sys, traceback\n"
            f"sys.path.insert(0, {SCRIPTS!r}); sys.argv = ['imported']\n"
            "failed = {}\n"
            "for name in json.loads(os.environ['SCRIPTS_TO_IMPORT']):\n"
            "    try:\n"
            f"        spec = importlib.util.spec_from_file_location('script_' + name[:-3], os.path.join({SCRIPTS!r}, name))\n"
            "        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
            "        spec.loader.exec_module(module)\n"
            "    except BaseException as e:\n"
            "        failed[name] = f'{type(e).__name__}: {e}'[:300]\n"
            "print(json.dumps(failed))\n")
    env = {**os.environ, "SCRIPTS_TO_IMPORT": json.dumps(script_files())}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failed, f"scripts that do not import: {failed}"


def test_suffix_cost_replays_a_copy_heavy_stream():
    """scripts/suffix_cost.py drives the suffix drafter through a stand-in sequence: the stand-in
    must carry what the drafter reads (it once lacked spec.dynamic and died on its first draft).
    A stream that repeats its prompt is drafted and followed for several tokens a pass."""
    sys.path.insert(0, SCRIPTS)
    try:
        import suffix_cost
    finally:
        sys.path.remove(SCRIPTS)
    prompt = [(7 * i) % 50 + 1 for i in range(120)]
    times, tokens_per_pass = suffix_cost.replay_ours([(prompt, prompt[30:])], 8)
    assert times and tokens_per_pass > 2.0, tokens_per_pass
