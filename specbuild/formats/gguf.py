"""GGUF files -> `Checkpoint` (tensors dequantised to float32, HF names, HF tokenizer).

llama.cpp's converter permutes the rows of q and k (it stores RoPE's rotate-half pairs
interleaved); HF names expect the original order, so `unpermute_rows` undoes it. Qwen2
GGUFs are stored unpermuted.
"""

from __future__ import annotations

import numpy as np
import torch

from specbuild.bundle import ModelConfig
from specbuild.errors import CheckpointError
from specbuild.formats.layout import Checkpoint, check_tensors

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
RAW_KEPT = ("Q4_1", "Q8_0")  # quantized types whose raw blocks compiler/quantize.py can carry

LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def field_value(reader, key: str, default=None):
    """A scalar or string metadata value, or default when absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. w: [n_heads * head_dim, ...] -> same shape."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return (
        w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def gguf_config(reader, path: str) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )

    def req(key: str):
        v = field_value(reader, f"{arch}.{key}")
        if v is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return v

    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    kv_heads = int(field_value(reader, f"{arch}.attention.head_count_kv", heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = field_value(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else None)
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise CheckpointError(
            f"{path}: GGUF with rope_freqs (llama3 rope scaling) is not supported yet; "
            "compile from the Hugging Face directory instead"
        )
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", hidden // heads))
    return ModelConfig(
        architecture=ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=None,
        max_position_embeddings=int(field_value(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attn_bias=arch == "qwen2",
    )


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}"
    return None


def dequantize_tensor(t) -> torch.Tensor:
    """One GGUF tensor -> float32 torch tensor in (out, in) order (numpy's row-major)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = t.data
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        arr = np.asarray(data)
        if t.tensor_type == GGMLQuantizationType.BF16:
            arr = dequantize(arr, t.tensor_type)
        arr = arr.astype(np.float32)
    else:
        arr = dequantize(data, t.tensor_type)
    shape = tuple(int(s) for s in reversed(t.shape))
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(shape).copy())


def read_gguf(path: str) -> Checkpoint:
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path, "r")
    except Exception as e:  # the gguf package raises bare ValueError/struct errors on bad files
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from None
    config = gguf_config(reader, path)
    from specbuild.formats.gguf_tokenizer import tokenizer_from_gguf

    tokenizer_json, special = tokenizer_from_gguf(reader)
    tensors: dict[str, torch.Tensor] = {}
    quant_types: dict[str, str] = {}
    raw_quant: dict[str, tuple[str, torch.Tensor, tuple[int, ...]]] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = dequantize_tensor(t)
        # Q4_1/Q8_0 blocks run along the input dim, so rows are independent and the q/k
        # unpermutation applies to the raw rows [out, bytes per row] as to the values.
        raw = torch.from_numpy(np.array(t.data)) if t.tensor_type.name in RAW_KEPT else None
        heads = {"q_proj.weight": config.num_heads, "k_proj.weight": config.num_kv_heads}.get(name.split(".", 4)[-1])
        if config.architecture == "llama" and heads is not None:
            w = unpermute_rows(w, heads)
            raw = unpermute_rows(raw, heads) if raw is not None else None
        tensors[name] = w
        quant_types[name] = t.tensor_type.name
        if raw is not None:
            raw_quant[name] = (t.tensor_type.name, raw.contiguous(), tuple(w.shape))
    ckpt = Checkpoint(
        config, tensors, tokenizer_json, special, source=path, source_format="gguf", quant_types=quant_types
    )
    ckpt.raw_quant = raw_quant  # HF name -> (GGUF type, raw rows [out, bytes per row] uint8, shape)
    check_tensors(ckpt)
    return ckpt
