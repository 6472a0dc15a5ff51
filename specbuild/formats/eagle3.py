"""The EAGLE-3 draft checkpoint layout (SafeAILab/EAGLE), as vLLM, SGLang and TensorRT-LLM's
PyTorch backend load it. No runtime here: names, shapes, config keys, the id maps.

A directory with `config.json` and `model.safetensors`:

config.json (a Llama config for one decoder layer) -- keys the loaders read:
  architectures ["LlamaForCausalLMEagle3"], model_type "llama", hidden_size,
  intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
  num_hidden_layers 1, rms_norm_eps, rope_theta, rope_scaling, max_position_embeddings,
  hidden_act "silu", vocab_size (the target's), draft_vocab_size (N, the reduced output
  vocabulary), target_hidden_size (the fc input is 3 x this), tie_word_embeddings false,
  torch_dtype, and eagle_config {"use_aux_hidden_state": true,
  "eagle_aux_hidden_state_layer_ids": [low, mid, high]} (the target layers whose input
  residual stream is taken; the loaders default to (2, L // 2, L - 3) without it).

model.safetensors (no "model." prefix):
  fc.weight                                  [H, 3 * H_target]  the concatenated features -> H
  midlayer.hidden_norm.weight                [H]   RMSNorm of the (projected) hidden input
  midlayer.input_layernorm.weight            [H]   RMSNorm of the token embedding
  midlayer.self_attn.{q,k,v}_proj.weight     [heads * D or kv * D, 2 * H] on cat(embed, hidden)
  midlayer.self_attn.o_proj.weight           [H, heads * D]
  midlayer.post_attention_layernorm.weight   [H]
  midlayer.mlp.{gate,up}_proj.weight         [I, H];  midlayer.mlp.down_proj.weight [H, I]
  norm.weight                                [H]
  lm_head.weight                             [N, H]  over the draft vocabulary
  d2t                                        [N] int64: target id of draft id d is d + d2t[d]
  t2d                                        [V] bool: which target ids the draft can emit
  embed_tokens.weight                        optional [V, H]: absent = the target's embedding

The layer (vLLM llama_eagle3, SGLang llama_eagle3, EAGLE cnets): residual = hidden;
x = attn(cat(input_layernorm(embed), hidden_norm(hidden))); residual = residual + x;
x = mlp(post_attention_layernorm(residual)); out = residual + x (fed back as the next
step's hidden); logits = lm_head(norm(out)).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from specbuild.errors import CheckpointError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_NAMES = ("hidden_norm.weight", "input_layernorm.weight", "self_attn.q_proj.weight",
               "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
               "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight")
REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", *(f"midlayer.{n}" for n in LAYER_NAMES))


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The loaders' default target layers when the config names none: (2, L // 2, L - 3)
    (clamped into [0, L) for targets under 5 layers, e.g. tiny test models)."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


def d2t_from_ids(draft_ids: torch.Tensor) -> torch.Tensor:
    """[N] target ids of the draft vocabulary -> the offsets d2t (target = d + d2t[d])."""
    return (draft_ids.to(torch.int64) - torch.arange(draft_ids.numel(), dtype=torch.int64,
                                                     device=draft_ids.device)).contiguous()


def ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    return (torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t.to(torch.int64)).contiguous()


def t2d_from_ids(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=draft_ids.device)
    t2d[draft_ids.to(torch.int64)] = True
    return t2d


def read_eagle3(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, tensors) of an EAGLE-3 directory; CheckpointError names what is wrong."""
    from safetensors.torch import load_file

    cfg_path, w_path = os.path.join(path, CONFIG), os.path.join(path, WEIGHTS)
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path!r} is not an EAGLE-3 checkpoint: no {CONFIG}")
    if not os.path.isfile(w_path):
        bins = [f for f in os.listdir(path) if f.endswith(".bin")]
        hint = f" (found {bins[0]}: convert it to safetensors first)" if bins else ""
        raise CheckpointError(f"{path!r} has no {WEIGHTS}{hint}")
    with open(cfg_path) as f:
        config = json.load(f)
    tensors = load_file(w_path)
    missing = [n for n in REQUIRED if n not in tensors]
    if missing:
        raise CheckpointError(f"EAGLE-3 checkpoint {path!r} lacks {missing[:3]} (has {sorted(tensors)[:6]} ...)")
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(f"EAGLE-3 checkpoint {path!r} has num_hidden_layers="
                              f"{config.get('num_hidden_layers')}; only one draft layer is supported")
    h = int(config["hidden_size"])
    th = int(config.get("target_hidden_size") or h)
    if tuple(tensors["fc.weight"].shape) != (h, 3 * th):
        raise CheckpointError(f"fc.weight is {tuple(tensors['fc.weight'].shape)}, expected ({h}, {3 * th}) "
                              "(three target layers of hidden size target_hidden_size)")
    n = int(config.get("draft_vocab_size") or config["vocab_size"])
    if tensors["lm_head.weight"].shape[0] != n:
        raise CheckpointError(f"lm_head.weight has {tensors['lm_head.weight'].shape[0]} rows but "
                              f"draft_vocab_size is {n}")
    if "d2t" in tensors:
        ids = ids_from_d2t(tensors["d2t"])
        if ids.numel() != n or int(ids.min()) < 0 or int(ids.max()) >= int(config["vocab_size"]):
            raise CheckpointError(f"d2t maps draft ids outside [0, {config['vocab_size']}) or has "
                                  f"{ids.numel()} entries for draft_vocab_size {n}")
    elif n != int(config["vocab_size"]):
        raise CheckpointError(f"draft_vocab_size {n} < vocab_size {config['vocab_size']} but there is no d2t map")
    return config, tensors


def aux_layers_of(config: dict[str, Any], target_layers: int) -> tuple[int, ...]:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(int(i) for i in ids) if ids else default_aux_layers(target_layers)
    if len(layers) != 3 or not all(0 <= i < target_layers for i in layers):
        raise CheckpointError(f"EAGLE-3 aux layers {layers} must be three layer ids in [0, {target_layers})")
    return layers


def write_eagle3(path: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[str]:
    """Write config.json and model.safetensors (names sorted, so the bytes depend only on
    the contents). Returns the files written."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, os.path.join(path, WEIGHTS),
              metadata={"format": "pt"})
    return [CONFIG, WEIGHTS]


def make_config(*, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                rms_norm_eps: float, rope_theta: float, rope_scaling: dict | None, vocab_size: int,
                draft_vocab_size: int, max_position_embeddings: int, aux_layers: tuple[int, ...],
                torch_dtype: str = "float32", target_hidden_size: int | None = None) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta, "rope_scaling": rope_scaling,
        "max_position_embeddings": max_position_embeddings, "hidden_act": "silu", "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size, "target_hidden_size": target_hidden_size or hidden_size,
        "tie_word_embeddings": False, "torch_dtype": torch_dtype, "bias": False,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(aux_layers)},
    }
