"""`specbuild compile --backend tensorrt-llm` end to end on the CLI (no TensorRT-LLM here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from tiny import make_tiny_hf


def specbuild(*args):
    return subprocess.run([sys.executable, "-m", "specbuild.cli", *args], capture_output=True, text=True, timeout=120)


def test_compile_writes_trtllm_part_and_build_script(tmp_path):
    target = make_tiny_hf(str(tmp_path / "t"), heads=4, kv_heads=2, head_dim=32)
    draft = make_tiny_hf(str(tmp_path / "d"), heads=4, kv_heads=2, layers=1, seed=4, head_dim=32)
    out = str(tmp_path / "b")
    r = specbuild("compile", "--target", target, "--draft", draft, "--out", out, "--backend", "tensorrt-llm",
                  "--max-draft-len", "5")
    assert r.returncode == 0, r.stderr
    assert "trtllm/build.sh" in r.stderr and "engines not built here (import tensorrt_llm failed" in r.stderr
    meta = json.load(open(os.path.join(out, "bundle.json")))
    assert meta["backend"] == "tensorrt-llm"
    for role in ("target", "draft"):
        ckpt = os.path.join(out, "trtllm", "checkpoints", role)
        assert sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors")) == ["rank0.safetensors"]
        assert json.load(open(os.path.join(ckpt, "config.json")))["dtype"] == "float16"
    script = open(os.path.join(out, "trtllm", "build.sh")).read()
    assert "--speculative_decoding_mode draft_tokens_external --max_draft_len 5" in script
    # the torch roles are written too, so the same bundle also runs on the torch backend
    r = specbuild("generate", out, "--prompt", "the", "--max-tokens", "3", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 3


def test_invalid_tp_names_the_valid_values(tmp_path):
    target = make_tiny_hf(str(tmp_path / "t"), heads=4, kv_heads=2, head_dim=32)
    r = specbuild("compile", "--target", target, "--out", str(tmp_path / "b"), "--backend", "tensorrt-llm", "--tp", "3")
    assert r.returncode == 2
    assert "valid tp sizes: 1, 2, 4" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "b")


def test_gather_generation_logits_flag(tmp_path):
    target = make_tiny_hf(str(tmp_path / "t"), heads=4, kv_heads=2, head_dim=32)
    draft = make_tiny_hf(str(tmp_path / "d"), heads=4, kv_heads=2, layers=1, seed=4, head_dim=32)
    out = str(tmp_path / "b")
    r = specbuild("compile", "--target", target, "--draft", draft, "--out", out, "--backend", "tensorrt-llm",
                  "--trtllm-gather-generation-logits")
    assert r.returncode == 0, r.stderr
    meta = json.load(open(os.path.join(out, "trtllm", "trtllm.json")))
    assert meta["gather_generation_logits"] is True
    for role in ("target", "draft"):  # both engines: the target verifies with them, the draft returns them
        assert meta["build_commands"][role].count("--gather_generation_logits") == 1, role
    script = [line for line in open(os.path.join(out, "trtllm", "build.sh")) if line.startswith("trtllm-build")]
    assert len(script) == 2 and all(line.rstrip().endswith("--gather_generation_logits") for line in script)
    r = specbuild("inspect", out)
    assert r.returncode == 0, r.stderr
    assert "tensorrt-llm mode=draft_tokens_external" in r.stdout
    assert "gather_generation_logits=yes: sampled requests speculate" in r.stdout
    info = json.loads(specbuild("inspect", out, "--json").stdout)
    assert info["trtllm"]["gather_generation_logits"] is True
    assert info["trtllm"]["roles"]["draft"] == {"tp": 1, "pp": 1, "engine_built": False}
    assert info["guarantees"]["tensorrt-llm"]["methods"]["draft"]["sampled"] == "lossless"

    # off by default: no flag in the commands, and inspect says how to get it
    plain = str(tmp_path / "p")
    assert specbuild("compile", "--target", target, "--draft", draft, "--out", plain, "--backend",
                     "tensorrt-llm").returncode == 0
    meta = json.load(open(os.path.join(plain, "trtllm", "trtllm.json")))
    assert meta["gather_generation_logits"] is False
    assert not any("--gather_generation_logits" in argv for argv in meta["build_commands"].values())
    r = specbuild("inspect", plain)
    assert "gather_generation_logits=no: sampled requests cannot speculate (recompile with " \
           "--trtllm-gather-generation-logits)" in r.stdout
    assert json.loads(specbuild("inspect", plain, "--json").stdout)["guarantees"]["tensorrt-llm"]["methods"][
        "draft"]["sampled"] == "refused"


def test_gather_generation_logits_needs_trtllm_and_a_draft(tmp_path):
    target = make_tiny_hf(str(tmp_path / "t"), heads=4, kv_heads=2, head_dim=32)
    for extra, message in ((("--backend", "torch"), "needs --backend tensorrt-llm"),
                           (("--backend", "tensorrt-llm"), "needs --draft")):
        out = tmp_path / "b"
        r = specbuild("compile", "--target", target, "--out", str(out), *extra, "--trtllm-gather-generation-logits")
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not out.exists()


def test_compile_refuses_what_a_gpu_would_refuse(tmp_path):
    """Issue 17: a float32 draft/target bundle, or one at --tp 2, exits 2 with the reason and the
    flag, before anything is written."""
    target = make_tiny_hf(str(tmp_path / "t"), heads=4, kv_heads=2, head_dim=32)
    for extra, message in ((("--trtllm-dtype", "float32"), "use --trtllm-dtype bfloat16 or float16"),
                           (("--tp", "2"), "use --tp 1 --pp 1")):
        out = tmp_path / "b"
        r = specbuild("compile", "--target", target, "--draft", target, "--out", str(out), "--backend",
                      "tensorrt-llm", *extra)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not out.exists()


def _doc_compile_examples() -> list[list[str]]:
    """The `specbuild compile ... --backend tensorrt-llm` examples of README.md and docs/*.md
    (continuation lines joined, comments dropped), as argv after `specbuild`."""
    import glob
    import shlex

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = []
    for path in [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md"))):
        lines = open(path).read().splitlines()
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            if line.startswith("specbuild compile "):
                text = line
                while text.split("#")[0].rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text.split("#")[0].rstrip()[:-1] + " " + lines[i].strip()
                argv = shlex.split(text, comments=True)[1:]
                if "tensorrt-llm" in argv:
                    out.append(argv)
            i += 1
    return out


@pytest.mark.integration
def test_documented_tensorrt_llm_compile_examples_are_accepted(tmp_path, smollm2_gguf):
    """Issue 31 row 1: the README's `compile --target smollm2-135m --draft smollm2-135m --backend
    tensorrt-llm` (SmolLM2: 9 query heads over 3 KV heads) was refused for an XQA rule that
    draft/target engines never meet; every documented TensorRT-LLM compile example runs."""
    examples = _doc_compile_examples()
    assert any("--draft" in argv for argv in examples), examples  # the README's draft/target example is found
    for n, argv in enumerate(examples):
        out = str(tmp_path / f"b{n}")
        argv = list(argv)
        argv[argv.index("--out") + 1] = out
        r = specbuild(*argv)
        assert r.returncode == 0, (argv, r.stderr[-2000:])
        meta = json.load(open(os.path.join(out, "trtllm", "trtllm.json")))
        if "--draft" in argv:
            assert meta["mode"] == "draft_tokens_external"
            assert "--use_paged_context_fmha" in meta["build_commands"]["target"]
        shutil.rmtree(out)  # ~2 GB each
