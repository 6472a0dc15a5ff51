"""Medusa heads at run time, and their loader from a bundle's `medusa/` role.

A Medusa head h turns the target's final-normed hidden state (the one that feeds the
target's lm_head) into logits for a token further ahead:

    x = hidden
    for each of the head's num_layers residual blocks:  x = x + silu(linear(x))
    logits_h = lm_head_h(x)          # the head's own lm_head, or the target's (shared)

Weights use FasterDecoding's names (`{h}.{l}.linear.weight` [hidden, hidden],
`{h}.{l}.linear.bias` [hidden], `{h}.{num_layers}.weight` [vocab, hidden]); a head whose
lm_head is shared with the target has no `{h}.{num_layers}.weight` here and gets the
target's tensor instead (the bundle's `shares`).

Position convention (FasterDecoding's `generate_candidates`): with the hidden state of
the row at position t (whose lm_head logits give token t + 1), head h guesses token
t + 2 + h. In specbuild's tree step the root (node 0) is the last token of the sequence,
already chosen by the target, i.e. token t + 1; so head h fills the nodes of depth h + 1.

Bundle layout (written by `specbuild.compiler.medusa_role`):

    medusa/heads.safetensors   the tensors above (shared lm_heads omitted)
    medusa/config.json         medusa_num_heads, medusa_num_layers, hidden_size, vocab_size
    medusa/tree.json           the bundle's default token tree (TreeSpec.to_json)
    bundle.json roles.medusa   {"path": "medusa", "shares": {"0.1.weight": "target/lm_head", ...}}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specbuild.bundle import read_meta
from specbuild.errors import BundleError
from specbuild.speculation.tree import TreeSpec, load_tree

MEDUSA_ROLE = "medusa"
HEADS_FILE = "heads.safetensors"
CONFIG_FILE = "config.json"
TREE_FILE = "tree.json"


def head_names(num_heads: int, num_layers: int) -> list[str]:
    """Every FasterDecoding tensor name of `num_heads` heads (lm_heads included)."""
    names = []
    for h in range(num_heads):
        for l in range(num_layers):
            names += [f"{h}.{l}.linear.weight", f"{h}.{l}.linear.bias"]
        names.append(f"{h}.{num_layers}.weight")
    return names


class MedusaHeads:
    """Inference-only Medusa heads. `forward(hidden [B, hidden]) -> logits [B, heads, vocab]`.

    weights: FasterDecoding names. A head without `{h}.{num_layers}.weight` uses
    `shared_lm_head` [vocab, hidden] (the target's lm_head, or its embedding when tied).
    """

    def __init__(self, weights: dict[str, torch.Tensor], num_heads: int, num_layers: int,
                 shared_lm_head: torch.Tensor | None = None) -> None:
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"num_heads={num_heads} must be >= 1 and num_layers={num_layers} >= 0")
        self.num_heads, self.num_layers = num_heads, num_layers
        lm_heads: list[torch.Tensor] = []
        for h in range(num_heads):
            own = weights.get(f"{h}.{num_layers}.weight")
            if own is None and shared_lm_head is None:
                raise BundleError(f"Medusa head {h} has no lm_head ('{h}.{num_layers}.weight') "
                                  "and no shared lm_head was given")
            lm_heads.append(own if own is not None else shared_lm_head)
        self.vocab_size, self.hidden_size = lm_heads[0].shape
        self.dtype = lm_heads[0].dtype
        self.device = lm_heads[0].device
        # per layer: weights of all heads stacked, so one batched matmul serves every head
        self.layer_w = [torch.stack([weights[f"{h}.{l}.linear.weight"] for h in range(num_heads)])
                        .to(self.device, self.dtype) for l in range(num_layers)]  # [heads, H, H]
        self.layer_b = [torch.stack([weights[f"{h}.{l}.linear.bias"] for h in range(num_heads)])
                        .to(self.device, self.dtype) for l in range(num_layers)]  # [heads, H]
        for w in self.layer_w:
            if tuple(w.shape[1:]) != (self.hidden_size, self.hidden_size):
                raise BundleError(f"Medusa linear weights have shape {tuple(w.shape[1:])}, "
                                  f"expected {(self.hidden_size, self.hidden_size)}")
        converted: dict[int, torch.Tensor] = {}  # a tensor shared by several heads is cast once
        for t in lm_heads:
            converted.setdefault(id(t), t.to(self.device, self.dtype))
        self.lm_heads = [converted[id(t)] for t in lm_heads]
        self.all_shared = len(converted) == 1

    @torch.inference_mode()
    def hidden_out(self, hidden: torch.Tensor, num: int) -> torch.Tensor:  # [B, num, H]
        """The residual blocks of heads 0..num-1 on hidden [B, H]."""
        x = hidden.to(self.device, self.dtype).unsqueeze(1).expand(-1, num, -1)
        for w, b in zip(self.layer_w, self.layer_b):
            x = x + F.silu(torch.einsum("bhi,hoi->bho", x, w[:num]) + b[:num])
        return x

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden: [B, H], the target's final-normed hidden states. Returns logits
        [B, num_heads, vocab] float32 of heads 0..num_heads-1 (default: all)."""
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden has shape {tuple(hidden.shape)}, expected [batch, {self.hidden_size}]")
        num = self.num_heads if num_heads is None else num_heads
        if not 1 <= num <= self.num_heads:
            raise ValueError(f"num_heads={num} is outside [1, {self.num_heads}]")
        x = self.hidden_out(hidden, num)  # [B, num, H]
        b = x.shape[0]
        if self.all_shared:
            logits = F.linear(x.reshape(b * num, -1), self.lm_heads[0])
            return logits.view(b, num, -1).float()
        return torch.stack([F.linear(x[:, h], self.lm_heads[h]) for h in range(num)], 1).float()

    __call__ = forward


def reference_medusa_logits(weights: dict[str, torch.Tensor], num_heads: int, num_layers: int,
                            shared_lm_head: torch.Tensor | None,
                            hidden: torch.Tensor) -> torch.Tensor:  # [B, heads, vocab] float64
    """Plain per-row, per-head loop in float64: the yardstick for `MedusaHeads.forward`."""
    rows = []
    for row in hidden.double():
        per_head = []
        for h in range(num_heads):
            x = row
            for l in range(num_layers):
                w, b = weights[f"{h}.{l}.linear.weight"].double(), weights[f"{h}.{l}.linear.bias"].double()
                x = x + F.silu(w @ x + b)
            lm = weights.get(f"{h}.{num_layers}.weight", shared_lm_head)
            per_head.append(lm.double() @ x)
        rows.append(torch.stack(per_head))
    return torch.stack(rows)


# ---- loading from a bundle -------------------------------------------------------------------
@dataclass(frozen=True)
class MedusaRole:
    heads: MedusaHeads
    tree: TreeSpec  # the bundle's default tree
    num_heads: int
    num_layers: int
    shares: dict  # head tensor name -> "target/<runtime name>"


def resolve_share(ref: str, target_weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """"target/lm_head" -> the target's tensor of that runtime name."""
    role, _, name = ref.partition("/")
    if role != "target" or name not in target_weights:
        raise BundleError(f"Medusa role shares {ref!r}, which is not a target tensor "
                          f"(have: {', '.join(sorted(k for k in target_weights if '.' not in k))})")
    return target_weights[name]


def load_medusa(bundle_dir: str, target_weights: dict[str, torch.Tensor],
                device: str | torch.device | None = None) -> MedusaRole:
    """Load `<bundle>/medusa/` with its shared tensors taken from `target_weights` (the
    target's runtime-layout weights, e.g. `engine.model.w`; shared tensors are not copied)."""
    from safetensors.torch import load_file

    meta = read_meta(bundle_dir)
    entry = meta.roles.get(MEDUSA_ROLE)
    if entry is None:
        raise BundleError(f"bundle {bundle_dir!r} has no Medusa heads (compile with --medusa HEADS)")
    role_dir = os.path.join(bundle_dir, entry.get("path", MEDUSA_ROLE))
    for f in (HEADS_FILE, CONFIG_FILE, TREE_FILE):
        if not os.path.isfile(os.path.join(role_dir, f)):
            raise BundleError(f"Medusa role {role_dir!r} lacks {f}; recompile the bundle")
    with open(os.path.join(role_dir, CONFIG_FILE)) as f:
        cfg = json.load(f)
    num_heads, num_layers = int(cfg["medusa_num_heads"]), int(cfg["medusa_num_layers"])
    any_target = next(iter(target_weights.values()))
    dev = torch.device(device) if device is not None else any_target.device
    weights = load_file(os.path.join(role_dir, HEADS_FILE), device=str(dev))
    shares = dict(entry.get("shares", {}))
    for name, ref in shares.items():  # the target's own tensor object: nothing is copied
        weights[name] = resolve_share(ref, target_weights)
    heads = MedusaHeads(weights, num_heads, num_layers, None)
    tree = load_tree(os.path.join(role_dir, TREE_FILE), allow_files=True)
    if tree.max_depth > num_heads:
        raise BundleError(f"bundle tree {tree.name!r} has depth {tree.max_depth} but there are only "
                          f"{num_heads} Medusa heads")
    return MedusaRole(heads, tree, num_heads, num_layers, shares)
