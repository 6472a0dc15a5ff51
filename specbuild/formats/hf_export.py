"""Write a `Checkpoint` back out as a Hugging Face model directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json).

What reads it: TensorRT-LLM's LLM API on the PyTorch backend, which loads Hugging Face
directories only (`LLM(model=<dir>)`; no checkpoint conversion, see
NVIDIA/TensorRT-LLM/docs/source/legacy/tensorrt-backend-removal.md), so a bundle compiled
with `--backend tensorrt-llm` carries its target (and draft) in this form under trtllm/hf/.
The config keys are the ones transformers' LlamaConfig / Qwen2Config take, and `read_hf_dir`
reads the directory back to the same ModelConfig, tensors and special tokens (tested).
"""

from __future__ import annotations

import json
import os

import torch

from specbuild.formats.checkpoints import Checkpoint

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def hf_config(ckpt: Checkpoint, dtype: str) -> dict:
    c, sp = ckpt.config, ckpt.special
    qwen = c.architecture == "qwen2"
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": dtype, "bos_token_id": sp.get("bos_token_id"), "eos_token_id": sp.get("eos_token_id"),
    }
    if not qwen:
        cfg["attention_bias"] = c.attn_bias
        cfg["mlp_bias"] = False
    return cfg


def write_hf_dir(ckpt: Checkpoint, out_dir: str, dtype: str = "bfloat16") -> str:
    """Write ckpt as a Hugging Face directory at out_dir (weights cast to dtype); returns out_dir."""
    from safetensors.torch import save_file

    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(ckpt, dtype), f, indent=2)
    tensors = {n: t.to(_DTYPES[dtype]).contiguous().clone() for n, t in ckpt.tensors.items()
               if not (ckpt.config.tie_word_embeddings and n == "lm_head.weight")}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        f.write(ckpt.tokenizer_json)
    sp = ckpt.special
    names = {t["id"]: t["content"] for t in json.loads(ckpt.tokenizer_json).get("added_tokens", [])}
    tok_cfg = {"bos_token": names.get(sp.get("bos_token_id")), "eos_token": names.get(sp.get("eos_token_id")),
               "add_bos_token": bool(sp.get("add_bos_token", False)), "chat_template": sp.get("chat_template"),
               "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2)
    eos_ids = list(sp.get("eos_token_ids") or ([] if sp.get("eos_token_id") is None else [sp["eos_token_id"]]))
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": sp.get("bos_token_id"), "eos_token_id": eos_ids or None}, f, indent=2)
    return out_dir
