"""`specbuild compile --backend tensorrt-llm` end to end on the CLI (no TensorRT-LLM here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tiny import make_tiny_hf


def specbuild(*args):
    return subprocess.run([sys.executable, "-m", "specbuild.cli", *args], capture_output=True, text=True, timeout=120)


def test_compile_writes_trtllm_part_and_build_script(tmp_path):
    target = make_tiny_hf(str(tmp_path / "t"), heads=4, kv_heads=2)
    draft = make_tiny_hf(str(tmp_path / "d"), heads=4, kv_heads=2, layers=1, seed=4)
    out = str(tmp_path / "b")
    r = specbuild("compile", "--target", target, "--draft", draft, "--out", out, "--backend", "tensorrt-llm",
                  "--tp", "2", "--max-draft-len", "5")
    assert r.returncode == 0, r.stderr
    assert "trtllm/build.sh" in r.stderr
    meta = json.load(open(os.path.join(out, "bundle.json")))
    assert meta["backend"] == "tensorrt-llm"
    for role in ("target", "draft"):
        ckpt = os.path.join(out, "trtllm", "checkpoints", role)
        assert sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors")) == ["rank0.safetensors",
                                                                                     "rank1.safetensors"]
        assert json.load(open(os.path.join(ckpt, "config.json")))["mapping"]["tp_size"] == 2
    script = open(os.path.join(out, "trtllm", "build.sh")).read()
    assert "--speculative_decoding_mode draft_tokens_external --max_draft_len 5" in script
    # the torch roles are written too, so the same bundle also runs on the torch backend
    r = specbuild("generate", out, "--prompt", "the", "--max-tokens", "3", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 3


def test_invalid_tp_names_the_valid_values(tmp_path):
    target = make_tiny_hf(str(tmp_path / "t"), heads=4, kv_heads=2)
    r = specbuild("compile", "--target", target, "--out", str(tmp_path / "b"), "--backend", "tensorrt-llm", "--tp", "3")
    assert r.returncode == 2
    assert "valid tp sizes: 1, 2, 4" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "b")
