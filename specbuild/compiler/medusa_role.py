"""Medusa heads into a bundle, and back out for other tools.

Accepted inputs (a file, or a directory holding one of them):

- FasterDecoding/Medusa: `medusa_lm_head.safetensors` (or `.pt`, read weights-only) with
  `{h}.{l}.linear.weight` [H, H], `{h}.{l}.linear.bias` [H], `{h}.{num_layers}.weight`
  [V, H] (the head's lm_head); a `medusa_head.` / `medusa_heads.` prefix is accepted;
- TensorRT-LLM names: `medusa_heads.{h}.medusa_layers.{l}.linear.weight|bias` and
  `medusa_heads.{h}.lm_head.weight` (a tp = 1 `rank0.safetensors` works too: the base
  model's tensors in it are skipped); an lm_head padded with zero rows to a multiple of tp
  is cut back to the target's vocabulary;
- specbuild's own `train-medusa` output, which omits the lm_head of heads that share the
  target's (config.json `shared_lm_head: true`).

In the bundle (`medusa/`, see speculation/medusa_heads.py) an lm_head equal to the target's
(after rounding both to the coarser dtype) is not stored: bundle.json's medusa role
records `shares: {"{h}.{L}.weight": "target/lm_head"}` (`target/embed` when tied).
`export_medusa` writes standalone heads with their own lm_head copies.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch

from specbuild.bundle import ModelConfig, read_meta, read_model_config, write_meta
from specbuild.errors import CheckpointError
from specbuild.speculation.tree import TreeSpec, load_tree
from specbuild.speculation.medusa_heads import CONFIG_FILE, HEADS_FILE, MEDUSA_ROLE, TREE_FILE

DEFAULT_TREE = "mc_sim_7b_top10"  # depth 3; chain_<heads> when there are fewer heads
FD_FILE = "medusa_lm_head.safetensors"
TRT_FILE = "medusa_heads.safetensors"
_FILES = (FD_FILE, HEADS_FILE, TRT_FILE, "medusa_lm_head.pt", "rank0.safetensors", "model.safetensors")

_FD_LINEAR = re.compile(r"^(?:medusa_heads?\.)?(\d+)\.(\d+)\.linear\.(weight|bias)$")
_FD_LM = re.compile(r"^(?:medusa_heads?\.)?(\d+)\.(\d+)\.weight$")
_TRT_LINEAR = re.compile(r"^medusa_heads\.(\d+)\.medusa_layers\.(\d+)\.linear\.(weight|bias)$")
_TRT_LM = re.compile(r"^medusa_heads\.(\d+)\.lm_head\.weight$")
_BASE_MODEL = re.compile(r"^(transformer\.|lm_head\.|model\.)")


@dataclass
class MedusaWeights:
    """Heads in FasterDecoding names; `lm_heads` only for heads with their own lm_head."""

    layers: dict[str, torch.Tensor]  # {h}.{l}.linear.weight|bias
    lm_heads: dict[int, torch.Tensor]  # head -> [V, H]; missing = shares the target's
    num_heads: int
    num_layers: int
    layout: str  # "fasterdecoding" | "tensorrt-llm"
    source: str = ""
    config: dict = field(default_factory=dict)  # the source's config.json, if any

    def tensors(self, shared_lm_head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """FasterDecoding dict; heads without their own lm_head get `shared_lm_head`."""
        out = dict(self.layers)
        for h in range(self.num_heads):
            lm = self.lm_heads.get(h, shared_lm_head)
            if lm is not None:
                out[f"{h}.{self.num_layers}.weight"] = lm
        return out


# ---- reading -----------------------------------------------------------------------------
def read_heads_file(src: str) -> tuple[dict[str, torch.Tensor], dict, str]:
    """(tensors, config.json of the source or {}, the file read)."""
    path, config = src, {}
    if os.path.isdir(src):
        found = next((os.path.join(src, f) for f in _FILES if os.path.isfile(os.path.join(src, f))), None)
        if found is None:
            raise CheckpointError(f"Medusa heads directory {src!r} holds none of {', '.join(_FILES)}")
        path = found
        cfg_path = os.path.join(src, "config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                config = json.load(f)
    elif not os.path.isfile(src):
        raise CheckpointError(f"Medusa heads {src!r} do not exist")
    if path.endswith(".pt") or path.endswith(".bin"):
        tensors = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(tensors, dict):
            raise CheckpointError(f"{path!r} does not hold a state dict")
    else:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(path)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"Medusa heads {path!r} are not a readable safetensors file: {err}") from err
    return tensors, config, path


def parse_heads(tensors: dict[str, torch.Tensor], source: str = "", config: dict | None = None) -> MedusaWeights:
    """Name parsing for both layouts; every head 0..n-1 and layer 0..L-1 must be present."""
    config = config or {}
    layers: dict[tuple[int, int, str], torch.Tensor] = {}
    lm: dict[int, torch.Tensor] = {}
    fd_lm: dict[tuple[int, int], torch.Tensor] = {}
    layouts = set()
    for name, t in tensors.items():
        if m := _TRT_LINEAR.match(name):
            layouts.add("tensorrt-llm")
            layers[(int(m[1]), int(m[2]), m[3])] = t
        elif m := _TRT_LM.match(name):
            layouts.add("tensorrt-llm")
            lm[int(m[1])] = t
        elif m := _FD_LINEAR.match(name):
            layouts.add("fasterdecoding")
            layers[(int(m[1]), int(m[2]), m[3])] = t
        elif m := _FD_LM.match(name):
            layouts.add("fasterdecoding")
            fd_lm[(int(m[1]), int(m[2]))] = t
        elif _BASE_MODEL.match(name):
            continue  # a full checkpoint's base model: not ours to read
        else:
            raise CheckpointError(f"{source}: tensor {name!r} is neither a FasterDecoding Medusa name "
                                  "('{h}.{l}.linear.weight', '{h}.{L}.weight') nor a TensorRT-LLM one "
                                  "('medusa_heads.{h}.medusa_layers.{l}.linear.weight', "
                                  "'medusa_heads.{h}.lm_head.weight')")
    if len(layouts) > 1:
        raise CheckpointError(f"{source}: mixes FasterDecoding and TensorRT-LLM Medusa names")
    heads_seen = {h for h, _, _ in layers} | set(lm) | {h for h, _ in fd_lm}
    if not heads_seen:
        raise CheckpointError(f"{source}: holds no Medusa head tensors")
    num_heads = max(heads_seen) + 1
    if layers:
        num_layers = max(l for _, l, _ in layers) + 1
    else:  # zero residual layers: only `{h}.0.weight` lm_heads
        num_layers = 0
    if "medusa_num_layers" in config and int(config["medusa_num_layers"]) != num_layers:
        raise CheckpointError(f"{source}: config.json says medusa_num_layers={config['medusa_num_layers']} "
                              f"but the tensors hold {num_layers}")
    for (h, l), t in fd_lm.items():
        if l != num_layers:
            raise CheckpointError(f"{source}: tensor '{h}.{l}.weight' is not a head's lm_head "
                                  f"(with {num_layers} layers it would be '{h}.{num_layers}.weight')")
        lm[h] = t
    out: dict[str, torch.Tensor] = {}
    for h in range(num_heads):
        for l in range(num_layers):
            for kind in ("weight", "bias"):
                t = layers.get((h, l, kind))
                if t is None:
                    raise CheckpointError(f"{source}: Medusa head {h} layer {l} lacks its linear.{kind} "
                                          f"(heads 0..{num_heads - 1}, layers 0..{num_layers - 1} expected)")
                out[f"{h}.{l}.linear.{kind}"] = t
    if "medusa_num_heads" in config and int(config["medusa_num_heads"]) != num_heads:
        raise CheckpointError(f"{source}: config.json says medusa_num_heads={config['medusa_num_heads']} "
                              f"but the tensors hold {num_heads} heads")
    return MedusaWeights(out, lm, num_heads, num_layers, layouts.pop(), source, config)


def read_medusa(src: str) -> MedusaWeights:
    tensors, config, path = read_heads_file(src)
    return parse_heads(tensors, path, config)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal after rounding both to the coarser of their dtypes (an fp16 copy of an fp32
    lm_head is still the target's)."""
    if a.shape != b.shape:
        return False
    coarse = a.dtype if torch.finfo(a.dtype).eps >= torch.finfo(b.dtype).eps else b.dtype
    return torch.equal(a.to(coarse), b.to(coarse))


def check_heads(heads: MedusaWeights, config: ModelConfig,
                target_lm_head: torch.Tensor) -> tuple[MedusaWeights, list[int]]:
    """Shapes against the target (hidden, vocab); returns the heads with padded lm_heads cut
    back and lm_heads equal to `target_lm_head` [V, H] removed, plus the sharing heads."""
    hidden, vocab = config.hidden_size, config.vocab_size
    src = heads.source or "Medusa heads"
    for name, t in heads.layers.items():
        shape = (hidden, hidden) if name.endswith("weight") else (hidden,)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{src}: {name} has shape {tuple(t.shape)}, but the target's hidden size "
                                  f"{hidden} needs {shape}")
    own: dict[int, torch.Tensor] = {}
    shared: list[int] = []
    for h in range(heads.num_heads):
        lm = heads.lm_heads.get(h)
        if lm is None:
            if heads.config.get("shared_lm_head") is not True:
                lm_name = (f"'{h}.{heads.num_layers}.weight'" if heads.layout == "fasterdecoding"
                           else f"'medusa_heads.{h}.lm_head.weight'")
                raise CheckpointError(f"{src}: Medusa head {h} has no lm_head ({lm_name}) and its "
                                      "config.json does not say shared_lm_head: true")
            shared.append(h)
            continue
        if lm.dim() != 2 or lm.shape[1] != hidden or lm.shape[0] < vocab:
            raise CheckpointError(f"{src}: Medusa head {h} lm_head has shape {tuple(lm.shape)}, but the "
                                  f"target needs ({vocab}, {hidden})")
        if lm.shape[0] > vocab:  # TensorRT-LLM pads the vocabulary with zero rows to a multiple of tp
            if lm[vocab:].count_nonzero():
                raise CheckpointError(f"{src}: Medusa head {h} lm_head has {lm.shape[0]} rows, the target "
                                      f"vocabulary {vocab}, and the extra rows are not zero padding")
            lm = lm[:vocab]
        if _same_tensor(lm, target_lm_head):
            shared.append(h)
        else:
            own[h] = lm
    return MedusaWeights(heads.layers, own, heads.num_heads, heads.num_layers, heads.layout,
                         heads.source, heads.config), shared


def check_tree_depth(tree: TreeSpec, num_heads: int) -> None:
    if tree.max_depth > num_heads:
        raise CheckpointError(
            f"tree {tree.name or ''} has depth {tree.max_depth} but the Medusa heads guess only "
            f"{num_heads} tokens ahead ({num_heads} heads): choose a tree of depth <= {num_heads} "
            f"(e.g. chain_{num_heads}) or train more heads")


def default_tree(num_heads: int) -> TreeSpec:
    tree = load_tree(DEFAULT_TREE)
    return tree if tree.max_depth <= num_heads else TreeSpec.chain(num_heads)


# ---- the bundle's medusa role ------------------------------------------------------------------
def _target_tensor(bundle_dir: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    path = os.path.join(bundle_dir, "target", "weights.safetensors")
    if not os.path.isfile(path):
        raise CheckpointError(f"{bundle_dir!r} has no target/weights.safetensors: write the target first")
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_medusa_role(bundle_dir: str, heads: str | MedusaWeights, tree: str | TreeSpec | None = None,
                      progress=None) -> dict:
    """Write `<bundle_dir>/medusa/` (heads.safetensors, config.json, tree.json) next to an
    already written `<bundle_dir>/target/`, and return the role entry for bundle.json
    (`roles["medusa"]`). Checks shapes against the target and the tree depth against the
    head count; heads whose lm_head equals the target's are stored without it (`shares`).
    Does not touch bundle.json: see `add_medusa` for an existing bundle."""
    from safetensors.torch import save_file

    say = progress or (lambda msg: None)
    weights = heads if isinstance(heads, MedusaWeights) else read_medusa(heads)
    config = read_model_config(os.path.join(bundle_dir, "target"))
    share_ref = "target/embed" if config.tie_word_embeddings else "target/lm_head"
    target_lm = _target_tensor(bundle_dir, share_ref.split("/")[1])
    weights, shared = check_heads(weights, config, target_lm)
    if tree is None and isinstance(weights.config.get("specbuild_tree"), (str, list)):
        tree = weights.config["specbuild_tree"]  # the tree the heads' trainer chose by measurement
        tree = TreeSpec.from_paths(tree, "heads' tree") if isinstance(tree, list) else tree
    spec = default_tree(weights.num_heads) if tree is None else load_tree(tree, allow_files=True)
    check_tree_depth(spec, weights.num_heads)
    dtype = target_lm.dtype
    role_dir = os.path.join(bundle_dir, MEDUSA_ROLE)
    os.makedirs(role_dir, exist_ok=True)
    tensors = {n: t.to(dtype).contiguous().clone() for n, t in weights.tensors(None).items()}
    save_file(tensors, os.path.join(role_dir, HEADS_FILE), metadata={"format": "specbuild-medusa-v1"})
    with open(os.path.join(role_dir, CONFIG_FILE), "w") as f:
        json.dump({"medusa_num_heads": weights.num_heads, "medusa_num_layers": weights.num_layers,
                   "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                   "dtype": _dtype_name(dtype), "source_layout": weights.layout}, f, indent=2)
        f.write("\n")
    with open(os.path.join(role_dir, TREE_FILE), "w") as f:
        f.write(spec.to_json() + "\n")
    shares = {f"{h}.{weights.num_layers}.weight": share_ref for h in shared}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    say(f"wrote medusa ({weights.num_heads} heads x {weights.num_layers} layers, {nbytes / 1e6:.1f} MB"
        f"{f', lm_head shared with the target by {len(shared)} heads' if shared else ''}; tree "
        f"{spec.name or 'custom'}: {spec.num_drafts} nodes, depth {spec.max_depth})")
    return {
        "path": MEDUSA_ROLE,
        "kind": "medusa",
        "source": os.path.abspath(weights.source) if weights.source else "",
        "source_layout": weights.layout,
        "num_heads": weights.num_heads,
        "num_layers": weights.num_layers,
        "tree": spec.name,
        "tree_nodes": spec.num_drafts,
        "dtype": _dtype_name(dtype),
        "bytes": nbytes,
        "shares": shares,
    }


def add_medusa(bundle_dir: str, heads: str | MedusaWeights, tree: str | TreeSpec | None = None,
               progress=None) -> dict:
    """Add (or replace) the Medusa role of an existing bundle and update bundle.json: the
    role entry, `limits.max_draft_len` raised to the tree's node count if lower, and the
    default speculation set to medusa with this tree. Returns the role entry."""
    import dataclasses

    meta = read_meta(bundle_dir)
    entry = write_medusa_role(bundle_dir, heads, tree, progress)
    entry["tokenizer_fingerprint"] = meta.tokenizer_fingerprint
    limits = meta.limits
    if limits.max_draft_len < entry["tree_nodes"]:
        limits = dataclasses.replace(limits, max_draft_len=entry["tree_nodes"])
    roles = {**meta.roles, MEDUSA_ROLE: entry}
    # tree None = the bundle's tree (medusa/tree.json), whatever its name
    spec = {**meta.default_speculation, "method": "medusa", "tree": None}
    write_meta(bundle_dir, dataclasses.replace(meta, roles=roles, limits=limits, default_speculation=spec))
    return entry


# ---- export ----------------------------------------------------------------------------------
def bundle_heads(bundle_dir: str) -> tuple[MedusaWeights, TreeSpec, ModelConfig]:
    """The bundle's heads with every shared lm_head resolved into a real tensor."""
    from safetensors.torch import load_file

    meta = read_meta(bundle_dir)
    entry = meta.roles.get(MEDUSA_ROLE)
    if entry is None:
        raise CheckpointError(f"bundle {bundle_dir!r} has no Medusa heads (compile with --medusa HEADS)")
    role_dir = os.path.join(bundle_dir, entry.get("path", MEDUSA_ROLE))
    tensors = load_file(os.path.join(role_dir, HEADS_FILE))
    for name, ref in entry.get("shares", {}).items():
        role, _, tname = ref.partition("/")
        if role != "target":
            raise CheckpointError(f"Medusa role shares {ref!r}: only target tensors can be shared")
        tensors[name] = _target_tensor(bundle_dir, tname)
    weights = parse_heads(tensors, os.path.join(role_dir, HEADS_FILE))
    config = read_model_config(os.path.join(bundle_dir, meta.roles["target"]["path"]))
    return weights, load_tree(os.path.join(role_dir, TREE_FILE), allow_files=True), config


EXPORT_FORMATS = ("fasterdecoding", "tensorrt-llm")


def export_medusa(bundle_dir: str, fmt: str = "fasterdecoding", out_dir: str = "medusa_heads") -> list[str]:
    """Write standalone heads (each with its own lm_head copy) for other tools.

    fasterdecoding: `medusa_lm_head.safetensors` ({h}.{l}.linear.*, {h}.{L}.weight) and a
    config.json with medusa_num_heads / medusa_num_layers (FasterDecoding's MedusaConfig);
    tensorrt-llm: `medusa_heads.safetensors` (medusa_heads.{h}.medusa_layers.{l}.linear.*,
    medusa_heads.{h}.lm_head.weight; tp = 1, unpadded) and a config.json with
    num_medusa_heads / num_medusa_layers / max_draft_len. Both get tree.json. Returns the paths."""
    from safetensors.torch import save_file

    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"--format {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}")
    weights, tree, config = bundle_heads(bundle_dir)
    fd = weights.tensors(None)
    n, layers = weights.num_heads, weights.num_layers
    os.makedirs(out_dir, exist_ok=True)
    common = {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
              "medusa_choices": [list(p) for p in tree.paths]}
    if fmt == "fasterdecoding":
        tensors = fd
        file_name = FD_FILE
        cfg = {"medusa_num_heads": n, "medusa_num_layers": layers,
               "base_model_name_or_path": read_meta(bundle_dir).roles["target"].get("source", ""), **common}
    else:
        tensors = {}
        for h in range(n):
            for l in range(layers):
                for kind in ("weight", "bias"):
                    tensors[f"medusa_heads.{h}.medusa_layers.{l}.linear.{kind}"] = fd[f"{h}.{l}.linear.{kind}"]
            tensors[f"medusa_heads.{h}.lm_head.weight"] = fd[f"{h}.{layers}.weight"]
        file_name = TRT_FILE
        cfg = {"num_medusa_heads": n, "num_medusa_layers": layers, "max_draft_len": tree.num_drafts, **common}
    # clone: safetensors refuses tensors that share storage, and copies are the point here
    tensors = {k: v.contiguous().clone() for k, v in tensors.items()}
    paths = [os.path.join(out_dir, file_name), os.path.join(out_dir, "config.json"),
             os.path.join(out_dir, TREE_FILE)]
    save_file(tensors, paths[0], metadata={"format": "pt"})
    with open(paths[1], "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(paths[2], "w") as f:
        f.write(tree.to_json() + "\n")
    return paths
