"""The one form every checkpoint reader produces and every writer starts from.

A `Checkpoint` holds the model config, the tensors under Hugging Face names
(`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`, ...; no
`lm_head.weight` when embeddings are tied), and the tokenizer as HF `tokenizers` JSON.
The readers (checkpoints.py for HF directories, gguf.py for GGUF files) import this module;
it imports neither, so the readers do not import each other in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specbuild.bundle import ModelConfig
from specbuild.errors import CheckpointError


@dataclass
class Checkpoint:
    """A model as read from disk, in Hugging Face tensor names (float32 or source dtype)."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF names -> tensor
    tokenizer_json: str  # HF `tokenizers` JSON
    special: dict[str, Any] = field(default_factory=dict)  # bos/eos ids, chat_template, add_bos
    source: str = ""
    source_format: str = ""  # "hf" | "gguf"
    quant_types: dict[str, str] = field(default_factory=dict)  # HF name -> source quant type


def hf_names(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensor names and shapes a checkpoint of this config must hold."""
    h, d = config.hidden_size, config.head_dim
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (config.num_heads * d, h)
        out[p + "self_attn.k_proj.weight"] = (config.num_kv_heads * d, h)
        out[p + "self_attn.v_proj.weight"] = (config.num_kv_heads * d, h)
        out[p + "self_attn.o_proj.weight"] = (h, config.num_heads * d)
        out[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        out[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        out[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
        if config.attn_bias:
            out[p + "self_attn.q_proj.bias"] = (config.num_heads * d,)
            out[p + "self_attn.k_proj.bias"] = (config.num_kv_heads * d,)
            out[p + "self_attn.v_proj.bias"] = (config.num_kv_heads * d,)
    return out


def check_tensors(ckpt: Checkpoint) -> None:
    """Every expected tensor present with the expected shape, or a CheckpointError naming it."""
    for name, shape in hf_names(ckpt.config).items():
        t = ckpt.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{ckpt.source}: tensor {name!r} is missing")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{ckpt.source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")


def to_runtime_layout(ckpt: Checkpoint, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF names -> the runtime layout of bundle.py (q/k/v and gate/up fused), cast to dtype."""
    c, t = ckpt.config, ckpt.tensors
    out = {"embed": t["model.embed_tokens.weight"], "norm": t["model.norm.weight"]}
    if not c.tie_word_embeddings:
        out["lm_head"] = t["lm_head.weight"]
    for i in range(c.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        r = f"layers.{i}."
        out[r + "attn_norm"] = t[p + "input_layernorm.weight"]
        out[r + "qkv"] = torch.cat([t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"]])
        if c.attn_bias:
            out[r + "qkv_bias"] = torch.cat([t[a + "q_proj.bias"], t[a + "k_proj.bias"], t[a + "v_proj.bias"]])
        out[r + "o"] = t[a + "o_proj.weight"]
        out[r + "mlp_norm"] = t[p + "post_attention_layernorm.weight"]
        out[r + "gate_up"] = torch.cat([t[m + "gate_proj.weight"], t[m + "up_proj.weight"]])
        out[r + "down"] = t[m + "down_proj.weight"]
    return {k: v.to(dtype).contiguous() for k, v in out.items()}
