"""SmolLM2-135M read from its GGUF by specbuild (dequantised, q/k rows unpermuted, compiled
into a bundle) gives transformers' logits, where transformers reads the same GGUF with its
own loader (its own dequantisation and its own reverse permutation)."""

from __future__ import annotations

import os

import pytest
import torch

from specbuild.formats.gguf import unpermute_rows
from specbuild.bundle import read_model_config
from specbuild.engine.engine import load_weights
from specbuild.model.decoder import Decoder, ForwardBatch, reference_forward

PROMPT = ("The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four "
          "papers that changed physics; the third one")
TOL = 1e-4


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows (rotate-half pairs interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_heads,head_dim,cols", [(9, 64, 5), (3, 64, 1), (4, 8, 3)])
def test_unpermute_inverts_llama_cpp_permute(n_heads, head_dim, cols):
    w = torch.randn(n_heads * head_dim, cols)
    permuted = llama_cpp_permute(w, n_heads)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rows(permuted, n_heads), w)


@pytest.fixture(scope="module")
def transformers_gguf_model(smollm2_gguf):
    """transformers' model with weights from its own GGUF loader (what
    `from_pretrained(dir, gguf_file=name)` runs, without its `accelerate` requirement)."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(os.path.dirname(smollm2_gguf),
                                                     gguf_file=os.path.basename(smollm2_gguf))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(smollm2_gguf, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"} and config.tie_word_embeddings
    return model.eval()


@pytest.fixture(scope="module")
def smollm2_native(smollm2_bundle):
    from tokenizers import Tokenizer

    target = os.path.join(smollm2_bundle, "target")
    config = read_model_config(target)
    weights = load_weights(target, "cpu")
    tokenizer = Tokenizer.from_file(os.path.join(smollm2_bundle, "tokenizer.json"))
    return config, weights, tokenizer


@pytest.mark.integration
def test_smollm2_gguf_logits_match_transformers(transformers_gguf_model, smollm2_native):
    config, weights, tokenizer = smollm2_native
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    ids = torch.tensor(tokenizer.encode(PROMPT).ids)
    assert 25 <= len(ids) <= 40
    with torch.no_grad():
        ref = transformers_gguf_model(ids.unsqueeze(0)).logits[0].float()  # [T, vocab]
    assert ref.std() > 1.0

    decoder = Decoder(config, weights, max_seq_len=64)
    cache = decoder.new_cache(num_blocks=8, block_size=16)
    cache.add(1)
    t = len(ids)
    cache.reserve(1, t)
    slots = cache.slots(1, 0, t)
    batch = ForwardBatch(ids, torch.arange(t), slots, slots, torch.ones(t, t, dtype=torch.bool).tril(),
                         torch.arange(t))
    paged = decoder.forward(batch, cache).logits
    diff = (paged - ref).abs().max().item()
    assert diff <= TOL, f"paged decoder vs transformers GGUF: max abs diff {diff:.3g}"
    assert torch.equal(paged.argmax(-1), ref.argmax(-1))

    plain = reference_forward(config, weights, ids)
    diff = (plain - ref).abs().max().item()
    assert diff <= TOL, f"reference_forward vs transformers GGUF: max abs diff {diff:.3g}"
