"""formats/hf_export.py: a Checkpoint written back as a Hugging Face directory (what TensorRT-LLM's
LLM API loads) reads back to the same config, tensors and special tokens, and transformers
computes the same logits from it."""

from __future__ import annotations

import pytest
import torch
from tiny import hf_logits, make_tiny_hf

from specbuild.formats.checkpoints import read_hf_dir
from specbuild.formats.hf_export import write_hf_dir


@pytest.mark.parametrize("arch, tie", [("llama", False), ("qwen2", True)])
def test_round_trip(tmp_path, arch, tie):
    src = make_tiny_hf(str(tmp_path / "src"), arch=arch, tie=tie, head_dim=32, seed=3)
    original = read_hf_dir(src)
    out = write_hf_dir(original, str(tmp_path / "out"), dtype="float32")
    back = read_hf_dir(out)
    assert back.config == original.config and back.special == original.special
    assert sorted(back.tensors) == sorted(original.tensors)
    assert all(torch.equal(back.tensors[n], original.tensors[n]) for n in original.tensors)
    ids = [5, 9, 77, 3, 120]
    assert (hf_logits(out, ids) - hf_logits(src, ids)).abs().max().item() == 0.0
    half = read_hf_dir(write_hf_dir(original, str(tmp_path / "bf16"), dtype="bfloat16"))
    assert half.tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'int4'"):
        write_hf_dir(original, str(tmp_path / "x"), dtype="int4")
