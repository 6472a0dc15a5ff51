"""A trained specbuild draft (train-draft's output) in a bundle, and out of it again.

Bundle layout of such a draft role (`<bundle>/draft/`): `model.json` (vocab_size = the
target's, untied), `weights.safetensors` (its layers and final norm only), and
`vocab_map.safetensors` ({"vocab_map": [N] int64 target ids}). The role entry in
bundle.json records `shares` ({"embed": "target/embed", "lm_head": "target/embed"}: the
draft's embedding is the target's tensor, its output rows are the target's output rows at
vocab_map) and `vocab_map` (the file, relative to the bundle). The engine assembles the
weights at load (engine.shared_draft_weights); nothing is stored twice.

The directory train-draft writes (a "specbuild draft", which `compile --draft DIR`
recognises) is defined here, beside its only reader, so that train/ depends on compiler/
and not the reverse: `draft.json` (FORMAT, the draft's ModelConfig, shares, sizes, the
target's tokenizer fingerprint), `weights.safetensors`, `vocab_map.safetensors`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from specbuild.bundle import ModelConfig, read_meta, read_model_config, tokenizer_fingerprint, write_model_config
from specbuild.errors import CheckpointError, SpecbuildError

FORMAT = "specbuild-draft-v1"
DRAFT_JSON = "draft.json"
WEIGHTS = "weights.safetensors"
VOCAB_MAP = "vocab_map.safetensors"


def is_draft_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DRAFT_JSON))


def read_draft_dir(path: str) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor]:
    """(draft.json, own weights, vocab_map [N]) of a train-draft output."""
    from safetensors.torch import load_file

    with open(os.path.join(path, DRAFT_JSON)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise SpecbuildError(f"{path!r}: draft.json format {meta.get('format')!r} is not {FORMAT!r}")
    return meta, load_file(os.path.join(path, WEIGHTS)), load_file(os.path.join(path, VOCAB_MAP))["vocab_map"]


def write_draft_role(bundle_dir: str, src: str, target_config: ModelConfig, target_tokenizer_json: str,
                     target_tied: bool, dtype: str) -> dict[str, Any]:
    """Copy a train-draft directory into <bundle>/draft (weights cast to dtype) after
    checking that it was trained for this target; returns the role entry."""
    from safetensors.torch import save_file

    meta, weights, vocab_map = read_draft_dir(src)
    fp = tokenizer_fingerprint(target_tokenizer_json)
    if meta.get("target_tokenizer_fingerprint") != fp:
        raise CheckpointError(f"draft {src!r} was trained for a target with another tokenizer "
                              f"({meta.get('target_tokenizer_fingerprint')} != {fp})")
    config = ModelConfig.from_json({**meta["config"], "dtype": dtype})
    if config.hidden_size != target_config.hidden_size or config.vocab_size != target_config.vocab_size:
        raise CheckpointError(f"draft {src!r} has hidden {config.hidden_size} / vocab {config.vocab_size}; the target "
                              f"has {target_config.hidden_size} / {target_config.vocab_size}: it shares the target's "
                              "embedding, so both must match")
    if int(vocab_map.max()) >= target_config.vocab_size or vocab_map.numel() != meta["draft_vocab"]:
        raise CheckpointError(f"draft {src!r}: vocab_map does not fit the target's vocabulary")
    role_dir = os.path.join(bundle_dir, "draft")
    write_model_config(role_dir, config)
    cast = {k: v.to(getattr(torch, config.dtype)).contiguous() for k, v in weights.items()}
    save_file(cast, os.path.join(role_dir, WEIGHTS), metadata={"format": "specbuild-runtime-v1"})
    save_file({"vocab_map": vocab_map.to(torch.int64).contiguous()}, os.path.join(role_dir, VOCAB_MAP))
    head = "embed" if target_tied else "lm_head"
    return {"path": "draft", "source": os.path.abspath(src), "source_format": FORMAT, "dtype": dtype,
            "bytes": sum(t.numel() * t.element_size() for t in cast.values()),
            "tokenizer_fingerprint": fp, "shares": {"embed": "target/embed", "lm_head": f"target/{head}"},
            "vocab_map": f"draft/{VOCAB_MAP}", "draft_vocab": int(vocab_map.numel())}


def export_draft(bundle_dir: str, out_dir: str) -> dict[str, Any]:
    """BUNDLE's draft as a standalone Hugging Face Llama directory: the shared embedding
    copied, a full-vocabulary lm_head whose rows outside the vocab_map are ZERO (their
    logit is 0, not -inf: other tools see a full-vocabulary model; `vocab_map.json` beside
    it lists the draft's own tokens). Returns {"files": [...], "draft_vocab": N}."""
    from safetensors.torch import load_file, save_file

    from specbuild.model.qlinear import as_dense
    from specbuild.engine.engine import load_weights

    meta = read_meta(bundle_dir)
    role = meta.roles.get("draft")
    if role is None:
        raise SpecbuildError(f"bundle {bundle_dir!r} has no draft role")
    draft_dir = os.path.join(bundle_dir, role["path"])
    config = read_model_config(draft_dir)
    weights = {k: as_dense(v).float() for k, v in load_weights(draft_dir, "cpu").items()}
    target_w = load_weights(os.path.join(bundle_dir, meta.roles["target"]["path"]), "cpu")
    vocab_map = None
    if role.get("vocab_map"):
        vocab_map = load_file(os.path.join(bundle_dir, role["vocab_map"]))["vocab_map"]
    for name, ref in (role.get("shares") or {}).items():
        weights.setdefault(name, as_dense(target_w[ref.split("/", 1)[1]]).float())
    if vocab_map is not None and weights["lm_head"].shape[0] != config.vocab_size:
        raise SpecbuildError("draft lm_head does not match its vocab_map")
    if vocab_map is not None:
        full = torch.zeros(config.vocab_size, config.hidden_size)
        full[vocab_map] = weights["lm_head"][vocab_map]
        weights["lm_head"] = full
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    hf = {"model.embed_tokens.weight": weights["embed"], "model.norm.weight": weights["norm"],
          "lm_head.weight": weights.get("lm_head", weights["embed"])}
    for i in range(c.num_layers):
        p, r = f"model.layers.{i}.", f"layers.{i}."
        qw, kw, vw = weights[r + "qkv"].split([q, kv, kv])
        gate, up = weights[r + "gate_up"].chunk(2)
        hf.update({p + "input_layernorm.weight": weights[r + "attn_norm"], p + "self_attn.q_proj.weight": qw,
                   p + "self_attn.k_proj.weight": kw, p + "self_attn.v_proj.weight": vw,
                   p + "self_attn.o_proj.weight": weights[r + "o"],
                   p + "post_attention_layernorm.weight": weights[r + "mlp_norm"],
                   p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                   p + "mlp.down_proj.weight": weights[r + "down"]})
        if r + "qkv_bias" in weights:
            qb, kb, vb = weights[r + "qkv_bias"].split([q, kv, kv])
            hf.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                       p + "self_attn.v_proj.bias": vb})
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    hf_config = {"architectures": ["LlamaForCausalLM" if c.architecture == "llama" else "Qwen2ForCausalLM"],
                 "model_type": c.architecture, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
                 "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
                 "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
                 "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
                 "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False,
                 "attention_bias": c.attn_bias, "torch_dtype": "float32",
                 **{k: v for k, v in (("bos_token_id", meta.special_tokens.get("bos_token_id")),
                                      ("eos_token_id", meta.special_tokens.get("eos_token_id"))) if v is not None}}
    files = ["model.safetensors", "config.json", "tokenizer.json"]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    with open(os.path.join(bundle_dir, "tokenizer.json")) as src:
        tokenizer_json = src.read()
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as dst:
        dst.write(tokenizer_json)
    tok_cfg = {"chat_template": meta.special_tokens.get("chat_template"), "add_bos_token":
               bool(meta.special_tokens.get("add_bos_token"))}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2)
    files.append("tokenizer_config.json")
    if vocab_map is not None:
        with open(os.path.join(out_dir, "vocab_map.json"), "w") as f:
            json.dump({"vocab_map": vocab_map.tolist(), "outside_rows": "zero (logit 0)"}, f)
        files.append("vocab_map.json")
    return {"files": [os.path.join(out_dir, f) for f in files],
            "draft_vocab": int(vocab_map.numel()) if vocab_map is not None else c.vocab_size}


def resolve_drafter(src: str | None) -> str | None:
    """A shipped drafter preset name (build.checkpoints.DRAFTER_PRESETS) -> its package
    directory; anything else unchanged."""
    from specbuild.formats.checkpoints import resolve_source

    if src is None or os.path.exists(src):
        return src
    return resolve_source(src)

