"""Issue 53 row 5, the build side: float32 engines without paged context FMHA (context FMHA has
float16/bfloat16 kernels only), the speculative XQA kernels' head sizes for Medusa, and the
executor binding's max_tokens passed by keyword (the stand-in declares it keyword-only)."""

from __future__ import annotations

import json
import os
import types

import pytest
from tiny import make_tiny_hf

from specbuild.compiler.trtllm_build import build_commands, write_trtllm_bundle_part
from specbuild.formats.checkpoints import read_hf_dir
from specbuild.formats.trtllm_support import kernel_problems, xqa_head_size_note


def test_float32_engines_get_no_paged_context_fmha(tmp_path):
    args = dict(target_checkpoint="c/t", target_engine="e/t", max_batch_size=4, max_seq_len=64)
    assert "--use_paged_context_fmha" not in build_commands(**args, dtype="float32")["target"]
    for dtype in ("float16", "bfloat16", None):  # None: not known to the caller, as before
        assert build_commands(**args, dtype=dtype)["target"][-2:] == ["--use_paged_context_fmha", "enable"]
    target = read_hf_dir(make_tiny_hf(str(tmp_path / "t"), head_dim=32))
    meta = write_trtllm_bundle_part(str(tmp_path / "f32"), target, dtype="float32", max_batch_size=2, max_seq_len=64)
    assert "--use_paged_context_fmha" not in meta["build_commands"]["target"]
    (note,) = meta["notes"]
    assert note.startswith("--trtllm-dtype float32: engines are built without --use_paged_context_fmha enable")
    assert "bfloat16 or float16" in note
    script = open(os.path.join(str(tmp_path / "f32"), "trtllm", "build.sh")).read()
    assert "use_paged_context_fmha" not in script
    meta = write_trtllm_bundle_part(str(tmp_path / "bf16"), target, dtype="bfloat16", max_batch_size=2,
                                    max_seq_len=64)
    assert meta["notes"] == [] and "--use_paged_context_fmha" in meta["build_commands"]["target"]
    assert json.load(open(os.path.join(str(tmp_path / "bf16"), "trtllm", "trtllm.json")))["notes"] == []


def test_executor_runs_an_engine_without_paged_context_fmha_without_block_reuse(monkeypatch):
    """check_engine_limits reads the flag from the engine's config.json; the executor then turns KV
    block reuse off for that engine, which older releases would refuse with reuse on."""
    from specbuild.backends.tensorrt_llm import TrtllmEngine
    from trtllm_stub import stub_module

    engine = TrtllmEngine.__new__(TrtllmEngine)
    engine._trt, engine.config, engine.max_batch_size = stub_module(), types.SimpleNamespace(kv_cache_tokens=None), 2
    made = []
    monkeypatch.setattr(engine._trt, "Executor", lambda path, kind, cfg: made.append(cfg) or cfg)
    engine._make_executor("e/t", None, medusa=False, reuse=False)
    engine._make_executor("e/t", None, medusa=False)
    assert [c.kv_cache_config.enable_block_reuse for c in made] == [False, True]


def test_medusa_head_sizes(tmp_path):
    """Medusa's speculative XQA kernels take head sizes that are multiples of 16 up to 256 (the JIT
    rule): 104 has a masked-MHA kernel but none of those, so it is refused for Medusa and not for
    draft/target; a size that passes gets the note that the precompiled set was not read."""
    cfg = types.SimpleNamespace(head_dim=104, num_heads=4, num_kv_heads=4)
    (problem,) = kernel_problems(cfg, role="target", mode="medusa", dtype="bfloat16")
    assert "head size 104" in problem and "multiples of 16 up to 256" in problem and "--draft" in problem
    assert kernel_problems(cfg, role="target", mode="draft_tokens_external", dtype="bfloat16") == []
    ok = types.SimpleNamespace(head_dim=64, num_heads=4, num_kv_heads=4)
    assert kernel_problems(ok, role="target", mode="medusa", dtype="bfloat16") == []
    assert "head size 64" in xqa_head_size_note(ok, "medusa") and xqa_head_size_note(ok, "draft_tokens_external") is None


def test_request_max_tokens_by_keyword():
    """The stand-in binding takes max_tokens keyword-only; the adapter's call works with it."""
    from trtllm_stub import stub_module

    m = stub_module()
    with pytest.raises(TypeError):
        m.Request([1, 2], 5)
    assert m.Request([1, 2], max_tokens=5).max_tokens == 5
