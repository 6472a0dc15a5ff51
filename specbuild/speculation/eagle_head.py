"""An EAGLE-3 head: one decoder layer that reads three of the target's hidden states.

Inputs at head position p: the target's residual stream entering three layers (low, mid,
high; formats/eagle3.py) at the row of token p, concatenated [3H] and projected by `fc`
to H -- or, when drafting deeper, the head's own output at p - 1 -- and the embedding of
token p + 1 (the target's embedding, shared). One Llama layer over cat(embed, hidden)
(q/k/v take 2H), the final norm, and an output layer over the draft vocabulary
(`draft_ids`: [N] target ids); the output predicts token p + 2, probability zero outside
the draft vocabulary. Weights use the EAGLE-3 names (formats/eagle3.py) without the
embedding; the same functions run inference (no grad) and training (autograd).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import json
import os

import numpy as np
import torch
import torch.nn.functional as F

from specbuild.model.decoder import apply_rope, rms_norm, rope_tables, signed_sin

L = "midlayer."
_NO_INDEX = torch.zeros(0, dtype=torch.int64)  # eagle_level: causal rows (the index built in C++)
# the weights quantize_int8 also packs as one (their rows side by side), for layer_rows
FUSED = {"qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def causal_index(n0: int, m: int) -> torch.Tensor:
    """rows_attention's index for m new rows after n0 cached ones (row r sees slots 0 .. n0 + r)."""
    lengths = n0 + 1 + np.arange(m, dtype=np.int64)
    offsets = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    slots = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    return torch.from_numpy(np.concatenate([offsets, slots]))


def rows_index(rows: list[list[int]], n0: int) -> torch.Tensor:
    """rows_attention's index: each row sees slots 0 .. n0 - 1 and then its own `rows` entry."""
    base = np.arange(n0, dtype=np.int64)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([n0 + len(r) for r in rows], out=offsets[1:])
    return torch.from_numpy(np.concatenate([offsets, *[np.concatenate([base, np.asarray(r, dtype=np.int64)])
                                                       for r in rows]]))


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    vocab_size: int
    aux_layers: tuple[int, ...]

    @classmethod
    def from_eagle3(cls, config: dict, aux_layers: tuple[int, ...]) -> "HeadConfig":
        h = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        return cls(h, int(config["intermediate_size"]), heads, int(config.get("num_key_value_heads", heads)),
                   int(config.get("head_dim") or h // heads), float(config.get("rms_norm_eps", 1e-5)),
                   float(config.get("rope_theta", 10000.0)), config.get("rope_scaling"), int(config["vocab_size"]),
                   tuple(aux_layers))


class EagleHead:
    """Weights (EAGLE-3 names), the shared embedding [V, H], draft_ids [N] and rope tables."""

    def __init__(self, config: HeadConfig, weights: dict[str, torch.Tensor], embed: torch.Tensor,
                 draft_ids: torch.Tensor, max_pos: int) -> None:
        self.config = config
        self.w = weights
        self.embed = embed
        self.draft_ids = draft_ids.to(device=embed.device, dtype=torch.int64)
        dtype = weights["fc.weight"].dtype
        rope_cfg = SimpleNamespace(head_dim=config.head_dim, rope_theta=config.rope_theta,
                                   rope_scaling=config.rope_scaling)
        device = weights["fc.weight"].device
        self.cos, self.sin = (t.to(device) for t in rope_tables(rope_cfg, max_pos, dtype))
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.packed: dict[str, tuple[torch.Tensor, int, int]] = {}  # name -> (int8 packed, rows, ISA level)
        # qkv and gate_up: the int8 rows of q|k|v and gate|up in one weight each (quantize_int8;
        # each output row is quantised and multiplied alone, so the same numbers in one call)
        self.fused: dict[str, tuple[torch.Tensor, int, int]] = {}
        self.arena = None  # the block the drafting level's int8 weights lie in (quantize_int8)
        self.q8: dict[str, tuple[torch.Tensor, int, int]] = {}  # name -> (int8-q8 packed, rows, path)
        self.level_args = None  # eagle_level's weights and dims (level_rows), () where it does not run
        self.sin_signed = signed_sin(self.sin)  # rotate_half's sign folded in (decoder.signed_sin), for eagle_level

    def lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W[name].T: the float weight, or its int8 copy through specbuild's CPU kernel
        (quantize_int8; `qkv` and `gate_up` are the fused copies, FUSED)."""
        q8 = self.q8.get(name)
        if q8 is not None:
            from specbuild.model import cpu_kernels

            return cpu_kernels.int8_q8_mm(x, *q8)
        got = self.packed.get(name) or self.fused.get(name)
        if got is not None:
            packed, n, level = got
            from specbuild.model import cpu_kernels

            return cpu_kernels.int8_mm(x, packed, n, level)
        return x @ self.w[name].T

    def quantize_int8(self, level: int) -> None:
        """Run every linear of the head as per-row int8 weights through specbuild's CPU kernel
        at ISA `level` (inference only; training uses the float weights). A drafter's arithmetic
        cannot change what the target emits, only which drafts are proposed: the float32 head's
        linears ran at ~6 GB/s through torch's matmul at four rows (one level 6-10 ms against a
        ~8 ms compiled int4 target step on the EPYC), a quarter of the bytes through the kernel
        costs a fraction of that (docs/eagle-training.md)."""
        from specbuild.model import cpu_kernels
        from specbuild.model.qlinear import quantize_int8

        for name, wt in self.w.items():
            if wt.dim() == 2:
                q, scales = quantize_int8(wt, torch.float32)
                self.packed[name] = (cpu_kernels.repack_int8(q, scales), wt.shape[0], level)
        # what a drafting level reads: its int8 weights times int8 input blocks (int8_q8_mm, the
        # target's lm_head kernel) where that kernel runs, else int8_mm's bfloat16 inputs (~3x
        # slower at one row), in one block on huge pages in the order a level reads them
        # (model/arena.py: the target's weights lie so); a level reads ~10 MB cold, after the
        # target's forward has passed ~95 MB through the caches
        from specbuild.model.arena import weight_arena

        order = ["fc.weight", "qkv", L + "self_attn.o_proj.weight", "gate_up", L + "mlp.down_proj.weight",
                 "lm_head.weight"]
        dense = {name: (torch.cat([self.w[L + part] for part in FUSED[name]]) if name in FUSED else self.w[name])
                 for name in order}
        path = cpu_kernels.int8_q8_path() if self.cos.dtype == torch.float32 else 0
        if path and all(wt.shape[1] % cpu_kernels.Q8_BLOCK == 0 for wt in dense.values()):
            packs = [cpu_kernels.repack_int8_q8(*quantize_int8(dense[name], torch.float32)) for name in order]
            self.arena, views = weight_arena(packs)
            self.q8 = {name: (view, dense[name].shape[0], path) for name, view in zip(order, views)}
        else:  # int8_mm's packs, the fused ones too (each output row quantised alone: the same numbers)
            for name in FUSED:
                q, scales = quantize_int8(dense[name], torch.float32)
                self.fused[name] = (cpu_kernels.repack_int8(q, scales), dense[name].shape[0], level)
            tables = [self.fused if name in FUSED else self.packed for name in order]
            self.arena, views = weight_arena([table[name][0] for table, name in zip(tables, order)])
            for table, name, view in zip(tables, order, views):
                table[name] = (view, *table[name][1:])

    def rows_ready(self) -> bool:
        """Whether layer_rows runs here: the int8 head (quantize_int8) in float32 with a head_dim
        specbuild's rows_attention kernel is built for."""
        from specbuild.model import cpu_kernels

        c = self.config
        return bool(self.q8 or self.fused) and cpu_kernels.rows_attention_usable(self.cos.dtype, c.head_dim,
                                                                                  self.cos.device)

    def level_rows(self, emb: torch.Tensor, hidden: torch.Tensor | None, positions: torch.Tensor, kb: torch.Tensor,
                   vb: torch.Tensor, at: int, index: torch.Tensor | None, last: int,
                   feats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """layer_rows, then the output layer over its last `last` rows: (out [T, H], logits
        [last, N]). Where the int8-q8 packs exist, one C++ call (cpu_kernels.cpp's eagle_level: the
        same steps in one pass, no eager op paid cold after the target's forward). feats: the
        target's features [T, 3H] instead of `hidden` (projected first); index None: causal rows
        after the `at` cached ones."""
        if self.level_args is None and len(self.q8) == 6 and hasattr(torch.ops.specbuild_cpu, "eagle_level"):
            c, w = self.config, self.w
            self.level_args = (
                [w[L + "input_layernorm.weight"], w[L + "hidden_norm.weight"], w[L + "post_attention_layernorm.weight"],
                 w["norm.weight"]],
                [self.q8[name][0] for name in ("qkv", L + "self_attn.o_proj.weight", "gate_up",
                                               L + "mlp.down_proj.weight", "lm_head.weight")],
                [c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, self.draft_vocab],
                self.q8["qkv"][2])
        if self.level_args:
            norms, packed, dims, path = self.level_args
            out, logits = torch.ops.specbuild_cpu.eagle_level(
                emb, feats if feats is not None else hidden, self.cos[positions], self.sin_signed[positions], kb, vb,
                at, _NO_INDEX if index is None else index, norms, packed, dims, self.config.rms_norm_eps, self.scale,
                path, last, self.q8["fc.weight"][0] if feats is not None else None)
            return out, logits
        self.level_args = ()  # no fused level here: the eager ops
        if feats is not None:
            hidden = self.project(feats)
        if index is None:
            index = causal_index(at, emb.shape[0])
        out = self.layer_rows(emb, hidden, positions, kb, vb, at, index)
        return out, self.logits(out[-last:])

    def layer_rows(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kb: torch.Tensor,
                   vb: torch.Tensor, at: int, index: torch.Tensor) -> torch.Tensor:
        """layer() for drafting (rows_ready): the new rows' K/V written into the buffers kb, vb
        ([slots, kv, D]) at rows at .. at + T - 1, and row t attending to the slots index lists
        for it (cpu_kernels.rows_attention's index: T + 1 offsets, then each row's slots). One
        int8 call for q|k|v and one for gate|up, rope on q and k at once, no copy of the cached
        K/V and no mask: a drafting level was ~30 eager ops, each paid cold after the target's
        forward (~1.2 ms of a ~2 ms EAGLE draft on a 2-core AMD EPYC). Returns out [T, H]
        pre-norm, as layer() does, up to the kernels' rounding (drafts only)."""
        from specbuild.model import cpu_kernels

        c, w = self.config, self.w
        t, d = emb.shape[0], c.head_dim
        hq, hk = c.num_heads, c.num_kv_heads
        x = torch.cat([rms_norm(emb, w[L + "input_layernorm.weight"], c.rms_norm_eps),
                       rms_norm(hidden, w[L + "hidden_norm.weight"], c.rms_norm_eps)], dim=-1)
        qkv = self.lin(x, "qkv")
        qk = apply_rope(qkv[:, :(hq + hk) * d].reshape(t, hq + hk, d), self.cos[positions], self.sin[positions])
        kb[at:at + t] = qk[:, hq:]
        vb[at:at + t] = qkv[:, (hq + hk) * d:].view(t, hk, d)
        attn = cpu_kernels.rows_attention(qk[:, :hq].contiguous(), kb, vb, index, self.scale)
        residual = hidden + self.lin(attn.reshape(t, hq * d), L + "self_attn.o_proj.weight")
        h = rms_norm(residual, w[L + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gu = self.lin(h, "gate_up")
        inter = gu.shape[1] // 2
        return residual + self.lin(F.silu(gu[:, :inter]) * gu[:, inter:], L + "mlp.down_proj.weight")

    @property
    def draft_vocab(self) -> int:
        return self.draft_ids.numel()

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        """[T, 3H] target features -> [T, H]."""
        return self.lin(feats.to(self.w["fc.weight"].dtype), "fc.weight")

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed[ids].to(self.w["fc.weight"].dtype)

    def layer(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              past_k: torch.Tensor | None, past_v: torch.Tensor | None, mask: torch.Tensor | None):
        """emb, hidden [T, H] at `positions` [T]; past K/V [S, kv, D] (or None); mask
        [T, S + T] bool (None: all past visible, causal among the new rows). Returns
        (out [T, H] pre-norm, k [T, kv, D], v [T, kv, D])."""
        c, w = self.config, self.w
        t = emb.shape[0]
        x = torch.cat([rms_norm(emb, w[L + "input_layernorm.weight"], c.rms_norm_eps),
                       rms_norm(hidden, w[L + "hidden_norm.weight"], c.rms_norm_eps)], dim=-1)
        cos, sin = self.cos[positions], self.sin[positions]
        q = apply_rope(self.lin(x, L + "self_attn.q_proj.weight").view(t, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(self.lin(x, L + "self_attn.k_proj.weight").view(t, c.num_kv_heads, c.head_dim), cos, sin)
        v = self.lin(x, L + "self_attn.v_proj.weight").view(t, c.num_kv_heads, c.head_dim)
        keys = k if past_k is None else torch.cat([past_k, k])
        vals = v if past_v is None else torch.cat([past_v, v])
        s = keys.shape[0]
        if mask is None and t > 1:  # (one new row sees every key: no mask to build)
            mask = torch.ones(t, s, dtype=torch.bool, device=emb.device)
            mask[:, s - t:] = torch.ones(t, t, dtype=torch.bool, device=emb.device).tril()
        # grouped-query attention inside SDPA: no repeated copy of every key and value per call
        # (the same outputs here; 0.09 against 0.14 ms at 300 keys on a 2-core Xeon)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                                              attn_mask=None if mask is None else mask.unsqueeze(0),
                                              scale=self.scale, enable_gqa=True)  # [heads, T, D]
        attn = attn.transpose(0, 1).reshape(t, c.num_heads * c.head_dim)
        residual = hidden + self.lin(attn, L + "self_attn.o_proj.weight")
        h = rms_norm(residual, w[L + "post_attention_layernorm.weight"], c.rms_norm_eps)
        mlp = self.lin(F.silu(self.lin(h, L + "mlp.gate_proj.weight")) * self.lin(h, L + "mlp.up_proj.weight"),
                       L + "mlp.down_proj.weight")
        return residual + mlp, k, v

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H] pre-norm outputs -> [T, N] logits over the draft vocabulary."""
        return self.lin(rms_norm(out, self.w["norm.weight"], self.config.rms_norm_eps), "lm_head.weight")

    def to_target(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        full = torch.full((logits.shape[0], vocab), float("-inf"), dtype=logits.dtype, device=logits.device)
        full[:, self.draft_ids] = logits
        return full


def init_head_weights(target_w: dict, target_cfg, draft_ids: torch.Tensor, aux_layers: tuple[int, ...],
                      seed: int = 0) -> dict[str, torch.Tensor]:
    """A starting point for training: the target's layer at the high aux layer for the
    MLP, norms and o_proj; q/k/v see [embed | hidden] (the target's projections on each
    half, halved); fc averages the three features; lm_head the target's output rows at
    draft_ids; norm the target's final norm."""
    from specbuild.model.qlinear import as_dense

    c = target_cfg
    g = torch.Generator().manual_seed(seed)
    src = f"layers.{aux_layers[-1]}."
    w = {k: as_dense(v).float() for k, v in target_w.items() if k.startswith(src) or k in ("norm", "embed", "lm_head")}
    h = c.hidden_size
    qkv = w[src + "qkv"]
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], 0)
    gate, up = w[src + "gate_up"].chunk(2, 0)
    eye = torch.eye(h)
    head = {
        "fc.weight": torch.cat([eye, eye, eye], 1) / 3 + 0.01 * torch.randn(h, 3 * h, generator=g),
        L + "hidden_norm.weight": w[src + "attn_norm"].clone(),
        L + "input_layernorm.weight": w[src + "attn_norm"].clone(),
        L + "self_attn.q_proj.weight": torch.cat([q, q], 1) / 2,
        L + "self_attn.k_proj.weight": torch.cat([k, k], 1) / 2,
        L + "self_attn.v_proj.weight": torch.cat([v, v], 1) / 2,
        L + "self_attn.o_proj.weight": w[src + "o"].clone(),
        L + "post_attention_layernorm.weight": w[src + "mlp_norm"].clone(),
        L + "mlp.gate_proj.weight": gate.clone(),
        L + "mlp.up_proj.weight": up.clone(),
        L + "mlp.down_proj.weight": w[src + "down"].clone(),
        "norm.weight": w["norm"].clone(),
        "lm_head.weight": w.get("lm_head", w["embed"])[draft_ids].clone(),
    }
    return {k: v.contiguous() for k, v in head.items()}


# ---- the bundle's eagle/ role, as the engine loads it (compiler/eagle_role.py writes it) -------
ROLE = "eagle"
WEIGHTS = "weights.safetensors"
CONFIG = "config.json"


def load_eagle(bundle_dir: str, role: dict, target_w: dict, max_pos: int, device: str = "cpu"):
    """The bundle's EAGLE head (speculation.eagle_head.EagleHead) over the target's embedding."""
    from safetensors.torch import load_file

    from specbuild.formats import eagle3
    from specbuild.model.qlinear import as_dense

    role_dir = os.path.join(bundle_dir, role["path"])
    with open(os.path.join(role_dir, CONFIG)) as f:
        config = json.load(f)
    w = load_file(os.path.join(role_dir, WEIGHTS), device=device)
    draft_ids = eagle3.ids_from_d2t(w.pop("d2t"))
    w.pop("t2d", None)
    embed = as_dense(target_w[role["shares"]["embed"].split("/", 1)[1]])
    head_cfg = HeadConfig.from_eagle3(config, tuple(role["aux_layers"]))
    return EagleHead(head_cfg, {k: v.to(embed.dtype) for k, v in w.items()}, embed, draft_ids, max_pos)
