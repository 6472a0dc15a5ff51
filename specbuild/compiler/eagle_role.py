"""EAGLE-3 heads into a bundle (`compile --eagle DIR`) and back out (`export-eagle`).

The input is an EAGLE-3 checkpoint directory (formats/eagle3.py: what vLLM, SGLang and
TensorRT-LLM's PyTorch backend load; `train-eagle` writes the same layout). In the bundle
(`eagle/`): `config.json` (the EAGLE-3 config, aux layers resolved), `weights.safetensors`
(the EAGLE-3 tensors cast to the bundle's dtype, d2t/t2d as they are, no embedding).
bundle.json's eagle role records `shares: {"embed": "target/embed"}`, `aux_layers` and
`draft_vocab`; a checkpoint's own `embed_tokens.weight` is dropped (the target's is used).
"""

from __future__ import annotations

import json
import os

import torch

from specbuild.bundle import ModelConfig
from specbuild.errors import CheckpointError
from specbuild.formats import eagle3

from specbuild.speculation.eagle_head import CONFIG, ROLE, WEIGHTS  # the role's layout, read at run time there


def check_against_target(config: dict, target: ModelConfig) -> tuple[int, ...]:
    """The head's aux layers, after checking its sizes against the target (names the value)."""
    th = int(config.get("target_hidden_size") or config["hidden_size"])
    if th != target.hidden_size:
        raise CheckpointError(f"EAGLE-3 head reads hidden size {th} but the target's is {target.hidden_size}")
    if int(config["hidden_size"]) != target.hidden_size:
        raise CheckpointError(f"EAGLE-3 head hidden_size {config['hidden_size']} differs from the target's "
                              f"{target.hidden_size} (it shares the target's embedding)")
    if int(config["vocab_size"]) != target.vocab_size:
        raise CheckpointError(f"EAGLE-3 head vocab_size {config['vocab_size']} != target vocab_size "
                              f"{target.vocab_size}")
    return eagle3.aux_layers_of(config, target.num_layers)


def write_eagle_role(bundle_tmp: str, src: str, target: ModelConfig, dtype: str) -> dict:
    from safetensors.torch import save_file

    config, tensors = eagle3.read_eagle3(src)
    aux = check_against_target(config, target)
    tdtype = getattr(torch, dtype)
    out = {}
    for name, t in tensors.items():
        if name == "embed_tokens.weight":
            continue
        out[name] = t.to(tdtype).contiguous() if t.is_floating_point() else t.contiguous()
    n = out["lm_head.weight"].shape[0]
    if "d2t" not in out:  # a full-vocabulary head
        out["d2t"] = torch.zeros(n, dtype=torch.int64)
    role_dir = os.path.join(bundle_tmp, ROLE)
    os.makedirs(role_dir, exist_ok=True)
    save_file(out, os.path.join(role_dir, WEIGHTS))
    config = {**config, "eagle_config": {**(config.get("eagle_config") or {}), "use_aux_hidden_state": True,
                                         "eagle_aux_hidden_state_layer_ids": list(aux)}}
    with open(os.path.join(role_dir, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return {"path": ROLE, "source": os.path.abspath(src), "source_format": "eagle3", "dtype": dtype,
            "bytes": sum(t.numel() * t.element_size() for t in out.values()),
            "shares": {"embed": "target/embed"}, "aux_layers": list(aux), "draft_vocab": int(n)}


def export_eagle(bundle_dir: str, out_dir: str) -> list[str]:
    """The bundle's head as a standalone EAGLE-3 directory (no embedding: the loaders take
    the target's), t2d rebuilt from d2t."""

    from specbuild.bundle import read_meta

    meta = read_meta(bundle_dir)
    if ROLE not in meta.roles:
        raise CheckpointError(f"bundle {bundle_dir!r} has no eagle role (compile it with --eagle DIR)")
    return write_standalone(os.path.join(bundle_dir, meta.roles[ROLE]["path"]), out_dir)


def write_standalone(role_dir: str, out_dir: str, dtype: str | None = None) -> list[str]:
    """The eagle role in `role_dir` as a standalone EAGLE-3 directory (formats/eagle3.py's layout:
    config.json + model.safetensors, t2d rebuilt from d2t), floating tensors cast to `dtype` where
    given (the TensorRT-LLM copy takes the engines' dtype, and its config says so)."""
    from safetensors.torch import load_file

    with open(os.path.join(role_dir, CONFIG)) as f:
        config = json.load(f)
    w = load_file(os.path.join(role_dir, WEIGHTS))
    if dtype is not None:
        w = {k: t.to(getattr(torch, dtype)) if t.is_floating_point() else t for k, t in w.items()}
        config = {**config, "torch_dtype": dtype}
    w["t2d"] = eagle3.t2d_from_ids(eagle3.ids_from_d2t(w["d2t"]), int(config["vocab_size"]))
    return eagle3.write_eagle3(out_dir, config, w)
