"""llama.cpp as an optional peer of the benchmarks (bench/formats.LlamaCppPeer)."""

import os
import sys

import pytest

from specbuild.bench import formats as F

def test_missing_llama_cpp_is_named_with_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    why = F.llama_cpp_missing()
    assert "llama-cpp-python is not installed" in why and "pip install llama-cpp-python" in why
    assert F.llama_cpp_row("/nonexistent.gguf", 1, "hi", 4, 1) is None


@pytest.mark.integration
def test_llama_cpp_peer_on_the_default_gguf(smollm2_gguf):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional peer)")
    assert F.llama_cpp_missing() is None
    # n_batch from the probe: a batched eval dies (SIGILL/SIGSEGV, the AMX kernels) on the Xeons
    # here, so a fixed n_batch would take the whole test process down with it
    peer = F.LlamaCppPeer(smollm2_gguf, threads=1, n_ctx=256)
    assert peer.n_batch in (1, 64)
    # the GGUF's tensors: less than the file (which also holds the vocabulary), most of it
    assert 0.8 * os.path.getsize(smollm2_gguf) < peer.weight_bytes < os.path.getsize(smollm2_gguf)
    prompt = peer.tokenize("The capital of France is")
    assert peer.decode_ms(prompt, 4) > 0 and peer.llm.n_tokens == len(prompt) + 4
    costs = peer.width_costs(prompt, (1, 5), repeats=2)
    assert set(costs) == {1, 5} and all(v > 0 for v in costs.values())
    assert peer.llm.n_tokens == len(prompt)  # cut back to the context after every try
