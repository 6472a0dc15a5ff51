"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

One `forward` runs a ragged batch: the new tokens of every sequence (a prefill chunk, a
single decode token, or a verify window of draft tokens) are flattened into T rows;
their K/V are written into the cache at `write_slots`, and attention reads each
sequence's rows through `read_slots` under an explicit boolean `mask` (causal by default,
a tree mask for tree speculation). Masks and positions are arguments, never model state.
Weights are in the runtime layout of bundle.py (q/k/v fused, gate/up fused). A linear weight
is a plain tensor or a `qlinear.QLinear` (int8/int4/other dtypes); `plans` picks a QLinear's
format per forward by its row count T (e.g. int4 for narrow steps, a float32 copy for wide
verification). Plain tensors run exactly as F.linear.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specbuild.bundle import ModelConfig
from specbuild.model.attention import (InvariantPlan, contiguous_range, paged_attention, paged_attention_invariant,
                                       paged_attention_rows, rows_index, visible_columns)
from specbuild.model.kv_cache import PagedKVCache
from specbuild.model.qlinear import QLinear, as_dense, embed_rows, linear, rows_policy, weight_nbytes, width_classes


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float64), with llama3 scaling when configured."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = config.rope_scaling
    if sc and sc.get("rope_type", sc.get("type")) == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    return inv


def rope_tables(config: ModelConfig, max_pos: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_pos, head_dim] (the half-frequencies repeated, rotate-half convention)."""
    inv = rope_inv_freq(config)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, D]. Returns [T, heads, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [.., D] with its first half negated: rotate_half's sign folded into the table
    (negation is exact, so rope_signed gives apply_rope's bits)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rope_signed(x: torch.Tensor, cos_u: torch.Tensor, sin_u: torch.Tensor) -> torch.Tensor:
    """apply_rope with the tables already [T, 1, D] and the sine signed (signed_sin): the
    same bits in four ops instead of eight (x: [T, heads, D])."""
    half = x.shape[-1] // 2
    return x * cos_u + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin_u


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden]. Normalises in float32 like HF, then scales in the weight dtype."""
    # F.rms_norm: the same bits as x * rsqrt(mean(x^2) + eps) in float32 (checked in tests),
    # in one op instead of five (each eager op costs ~1.5 us here, 60 per step)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@dataclass
class ForwardBatch:
    """Everything one forward needs; built by the scheduler, consumed once."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 (rope positions: past length + depth)
    write_slots: torch.Tensor  # [T] int64, where each new token's K/V goes
    read_slots: torch.Tensor  # [S] int64, the K/V rows attention may read
    mask: torch.Tensor | None  # [T, S] bool, True = may attend; None = everything visible
    logit_rows: torch.Tensor  # [R] int64, rows of T whose logits are wanted
    # [T] bool, True where the row is a prompt token (a prefill row; the scheduler sets it):
    # bundles that compute float32 attention row by row take such rows batched (Attend)
    prompt_rows: torch.Tensor | None = None


@dataclass
class ForwardOutput:
    """What Decoder.forward returns: always logits; hidden states and auxiliary layers only
    when asked."""

    logits: torch.Tensor  # [R, vocab] float32, for batch.logit_rows
    hidden: torch.Tensor | None = None  # [R, hidden] final-normed (return_hidden=True): Medusa heads
    aux: torch.Tensor | None = None  # [A, len(aux_layers) * hidden] at aux_rows (EAGLE-3 heads)
    # [R] int64: each logit row's argmax (the first maximum, or the first NaN) where the forward
    # took it already (the fused stack's end), else None
    argmax: torch.Tensor | None = None


def sub_batch(batch: ForwardBatch, r0: int, r1: int) -> ForwardBatch:
    """Rows r0..r1-1 of a forward (their K/V still written, every key they see still read);
    its logit rows are not kept (compiled_rows takes hidden states, not logits)."""
    mask = None if batch.mask is None else batch.mask[r0:r1]
    prompt = None if batch.prompt_rows is None else batch.prompt_rows[r0:r1]
    return ForwardBatch(batch.input_ids[r0:r1], batch.positions[r0:r1], batch.write_slots[r0:r1],
                        batch.read_slots, mask, batch.logit_rows[:0], prompt)


def pad_batch(batch: ForwardBatch, rows: int) -> ForwardBatch:
    """The forward with its last row repeated up to `rows` rows (a copy computes the last
    row's bits and writes them to the last row's slot again)."""
    t = batch.input_ids.shape[0]
    idx = torch.cat([torch.arange(t), torch.full((rows - t,), t - 1)])
    mask = batch.mask
    if mask is None:  # one row that sees every read slot
        mask = torch.ones(t, batch.read_slots.shape[0], dtype=torch.bool, device=batch.read_slots.device)
    prompt = None if batch.prompt_rows is None else batch.prompt_rows[idx]
    return ForwardBatch(batch.input_ids[idx], batch.positions[idx], batch.write_slots[idx], batch.read_slots,
                        mask[idx], batch.logit_rows[:0], prompt)


def ragged_mask(blocks: list[tuple], rows: int, cols: int) -> torch.Tensor | None:
    """The attention mask [rows, cols] bool of a flattened ragged batch.

    blocks: one (row0, col0, n_new, past, new_mask) per sequence: its n_new query rows start
    at row0, its gathered K/V rows at col0 (past ones first, then the new ones); every row
    sees the whole past and the new rows through new_mask [n_new, n_new] (a bool tensor or
    array; None: causal). Nothing crosses sequences. None when a single row may see
    everything (no mask needed).

    Built in numpy and handed to torch once: each torch op here cost 20-40 us in a served
    step, whose weights (~95 MB) have just passed through the caches, against a few us for
    numpy's (a tree item's mask 115 us in torch, 75 in numpy; four decode rows' 120 against 48;
    AMD EPYC, caches evicted before each call).
    """
    if rows == 1 and len(blocks) == 1:
        return None
    mask = np.zeros((rows, cols), dtype=np.bool_)
    for r0, c0, n, past, new_mask in blocks:
        if n == 1 and new_mask is None:  # a decode row: its whole past and itself
            mask[r0, c0:c0 + past + 1] = True
            continue
        mask[r0:r0 + n, c0:c0 + past] = True
        mask[r0:r0 + n, c0 + past:c0 + past + n] = np.tri(n, dtype=np.bool_) if new_mask is None else (
            new_mask.numpy() if isinstance(new_mask, torch.Tensor) else new_mask)
    return torch.from_numpy(mask)


class Decoder:
    """The runtime model. Holds weights (runtime layout) and rope tables; no request state."""

    def __init__(self, config: ModelConfig, weights: dict, max_seq_len: int,
                 device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = weights["embed"].dtype
        self.w = {k: v.to(self.device) for k, v in weights.items()}
        self.lm_head = self.w.get("lm_head", self.w["embed"])
        self.cos, self.sin = rope_tables(config, max_seq_len, self.dtype)
        self.cos, self.sin = self.cos.to(self.device), self.sin.to(self.device)
        self.sin_signed = signed_sin(self.sin)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.plans: dict = {}  # "layers" | "lm_head" -> qlinear.FormatPlan (QLinear weights only)
        # row-invariant attention (attention.paged_attention_invariant) when activations are
        # rounded somewhere (half precision, int8): see row_invariant_needed
        self.row_invariant = row_invariant_needed(self.w, self.dtype)
        # (min, max) rows per call of each half-precision linear so that every row gets the bits
        # it gets alone (measured here: kernels switch with the row count; row_policies)
        self.rows_per_call: dict[str, tuple[int, int]] = row_policies(self.w, config.num_layers) \
            if self.row_invariant else {}
        # float32 hidden states with rounded kernel inputs: every row's attention (prompt, decode,
        # verify, tree) through specbuild's C++ kernel, one call per layer for all rows, each row
        # over exactly its keys (rows_attention_enabled)
        self.rows_attention = self.row_invariant and rows_attention_enabled(self.dtype, config.head_dim, self.device)
        # whether a generated or draft row writes the K/V bits a prompt row at its position would:
        # one row-invariant kernel for every kind of row (rows_attention; the half-precision plan).
        # Otherwise (a float32/64 row-invariant model without the C++ kernel) prompt rows and
        # generated rows take different exact kernels, and the prefix cache reuses only text that
        # was computed as prompt (engine/scheduler.record_prefix)
        self.rows_agree = self.rows_attention or (self.row_invariant and self.dtype in (torch.bfloat16, torch.float16))
        self.compiled = None  # compiled.CompiledStack or fused.FusedStack once compile() is called
        self.fused_why: str | None = None  # why compile() did not take the fused stack (None: it did)
        # called once per forward as the layer stack's one long call begins, its inputs made (the
        # serving engine wakes its HTTP waiters there: BaseEngine.wake_listener); None: nothing
        self.before_stack = None
        self.compiled_aux: tuple[int, ...] = ()  # aux layers every compiled forward computes

    def compile(self, aux_layers: tuple[int, ...] = ()) -> None:
        """Run the layer stack compiled (model/compiled.py) from now on, in every forward.

        aux_layers (an EAGLE-3 head's): every compiled forward returns them, asked for or not.
        inductor fuses a graph that also returns the residuals entering those layers otherwise
        than one that does not, and the two give different bits at some widths (measured on
        the int4 SmolLM2 bundle: identical up to 12 rows, not at 16-17;
        scripts/compiled_aux_check.py), while each graph alone gives a row the same bits at
        every width. One graph for every forward keeps plain decoding and the head's verify
        passes in one arithmetic."""
        from specbuild.model.compiled import CompiledStack
        from specbuild.model.fused import FusedStack, fused_reason

        # int4 layers on specbuild's kernel with rows_attention: the whole stack in one C++ call
        # (model/fused.py: the same arithmetic per row, no inductor glue); otherwise torch.compile
        self.fused_why = fused_reason(self)
        self.compiled = FusedStack(self) if self.fused_why is None else CompiledStack(self)
        self.compiled_aux = tuple(sorted(set(aux_layers)))

    def format_for(self, group: str, width: int) -> str | None:
        """The format QLinear weights of `group` run in for a forward of `width` rows."""
        plan = self.plans.get(group)
        return plan.choose(width) if plan is not None else None

    def new_cache(self, num_blocks: int, block_size: int = 16, dtype: torch.dtype | None = None) -> PagedKVCache:
        """dtype: the cache's element type [the model's]; float16 only where the fused int4 stack
        reads it (engine.kv_cache_dtype)."""
        c = self.config
        return PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size,
                            dtype=self.dtype if dtype is None else dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache, return_hidden: bool = False,
                aux_layers: tuple[int, ...] = (), aux_rows: torch.Tensor | None = None):
        """Run the batch. Writes K/V of the new tokens into `cache` (at write_slots).

        Returns a ForwardOutput: logits [R, vocab] (float32) for `batch.logit_rows`; with
        return_hidden also the final-normed hidden states [R, hidden] of those rows (for
        Medusa heads). With `aux_layers` (EAGLE-3 heads) and `aux_rows` ([A] rows of T) its
        `aux` is the residual stream entering each of those layers at those rows,
        concatenated [A, len(aux_layers) * hidden]; with no aux_layers nothing extra is
        computed.
        """
        c, w = self.config, self.w
        t = batch.input_ids.shape[0]
        fmt = self.format_for("layers", t)
        aux_layers = tuple(aux_layers) if aux_layers and aux_rows is not None else ()
        if getattr(self.compiled, "run_final", None) is not None:
            return self.fused_forward(batch, cache, return_hidden, aux_layers, aux_rows)
        if self.compiled is not None:
            # compiled_aux: every compiled forward computes the same aux layers (one graph family
            # for plain steps and a head's verify passes: the same bits), wanted or not
            run_aux = self.compiled_aux or aux_layers
            if aux_layers and not set(aux_layers) <= set(run_aux):
                raise ValueError(f"aux layers {aux_layers} are not among the compiled stack's {run_aux}")
            x, aux = self.compiled_rows(batch, cache, fmt, run_aux)
            if aux_layers:
                ran = sorted(set(run_aux))
                aux = [aux[ran.index(layer)] for layer in sorted(set(aux_layers))]
        else:
            inputs, attend = self.stack_call(batch, t)
            x, aux = self.layer_stack(*inputs, batch.write_slots, cache.k, cache.v, fmt, attend, aux_layers)
        if aux_layers:
            aux = [a.index_select(0, aux_rows) for a in aux]
        rows = x.index_select(0, batch.logit_rows) if batch.logit_rows.numel() != t else x
        hidden = rms_norm(rows, w["norm"], c.rms_norm_eps)
        feats = aux_features(aux, aux_layers) if aux_layers else None
        return ForwardOutput(self.head_logits(hidden), hidden if return_hidden else None, feats)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head over final-normed rows [R, hidden]: logits [R, vocab] float32 (a
        half-precision lm_head's top entries rescored in float32)."""
        logits = linear(hidden, self.lm_head, self.format_for("lm_head", hidden.shape[0]), None,
                        self.rows_per_call.get("lm_head")).float()
        if isinstance(self.lm_head, torch.Tensor) and self.lm_head.dtype in (torch.bfloat16, torch.float16):
            logits = rescore_top(logits, hidden, self.lm_head)
        return logits

    def fused_forward(self, batch: ForwardBatch, cache: PagedKVCache, return_hidden: bool,
                      aux_layers: tuple[int, ...], aux_rows: torch.Tensor | None):
        """forward through the fused C++ stack (model/fused.py), which also takes the final norm
        and, where it runs the lm_head's format, the lm_head: one call for the whole forward."""
        t = batch.input_ids.shape[0]
        run_aux = self.compiled_aux or aux_layers
        if aux_layers and not set(aux_layers) <= set(run_aux):
            raise ValueError(f"aux layers {aux_layers} are not among the compiled stack's {run_aux}")
        head_fmt = self.format_for("lm_head", batch.logit_rows.shape[0])
        if head_fmt is None and isinstance(self.lm_head, QLinear):
            head_fmt = self.lm_head.primary
        pre = self.compiled.inputs(batch)
        if pre is None:
            inputs, attend = self.stack_call(batch, t)
            index = attend.index
        else:
            inputs, index = pre
            if self.before_stack is not None:
                self.before_stack()
        hidden, aux, logits, best = self.compiled.run_final(*inputs, batch.write_slots, cache, index, run_aux,
                                                            batch.logit_rows, head_fmt)
        if logits is None:
            logits = self.head_logits(hidden)
        feats = None
        if aux_layers:
            ran = sorted(set(run_aux))
            feats = aux_features([aux[ran.index(layer)].index_select(0, aux_rows) for layer in sorted(set(aux_layers))],
                                 aux_layers)
        return ForwardOutput(logits, hidden if return_hidden else None, feats, best)

    def compiled_rows(self, batch: ForwardBatch, cache: PagedKVCache, fmt: str | None, aux_layers: tuple[int, ...]):
        """The layer stack through the compiled graph (compile()), its rows per call bounded
        at the forward's level: the graph's linears take any width, so the half-precision
        kernels' row policy (rows_per_call) is kept by padding a narrow forward with copies
        of its last row (the same token, position, slot and mask row: the same bits written
        to the same slot) and cutting a wide one into consecutive pieces (each row still
        sees exactly its keys: row-invariant attention makes the pieces' rows the rows of
        the whole). Returns (x [T, hidden], aux as layer_stack)."""
        lo, hi = self.compiled.rows
        t = batch.input_ids.shape[0]
        if t > hi:
            parts = [self.compiled_rows(sub_batch(batch, r, min(r + hi, t)), cache, fmt, aux_layers)
                     for r in range(0, t, hi)]
            return torch.cat([p[0] for p in parts]), [torch.cat(a) for a in zip(*[p[1] for p in parts])]
        if t < lo:
            x, aux = self.compiled_rows(pad_batch(batch, lo), cache, fmt, aux_layers)
            return x[:t], [a[:t] for a in aux]
        inputs, attend = self.stack_call(batch, t)
        return self.compiled.run(*inputs, batch.write_slots, cache, fmt, attend, aux_layers)

    def stack_call(self, batch: ForwardBatch, t: int) -> tuple[tuple, "Attend"]:
        """What the layer stack's call takes (stack_inputs, the forward's Attend), made before
        before_stack runs: nothing of the forward's Python is left between the hook and the call."""
        inputs, attend = self.stack_inputs(batch), Attend(self, batch, t)
        if self.before_stack is not None:
            self.before_stack()
        return inputs, attend

    def stack_inputs(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer stack's inputs: embeddings [T, hidden] and the rope tables [T, 1, D] (cos,
        signed sin) at the batch's positions."""
        return (embed_rows(self.w["embed"], batch.input_ids), self.cos[batch.positions].unsqueeze(1),
                self.sin_signed[batch.positions].unsqueeze(1))

    def layer_stack(self, x: torch.Tensor, cos_u: torch.Tensor, sin_u: torch.Tensor, write_slots: torch.Tensor,
                    ks, vs, fmt: str | None, attend, aux_layers: tuple[int, ...] = (), bounded: bool = True):
        """The decoder layers over hidden states x [T, hidden]: K/V of the new rows written into
        the per-layer caches ks[i], vs[i] at write_slots, attention through attend(i, q, k, v).
        Returns (x, the residual entering each of sorted(set(aux_layers)) for every row).
        bounded=False: the linears take every width in one call (compiled_rows bounds them)."""
        c, w = self.config, self.w
        t = x.shape[0]
        aux = []
        # (min, max) rows per call of half-precision linears, or None
        bound = self.rows_per_call.get if bounded else (lambda name: None)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            if i in aux_layers:
                # layer 0's residual is the stack's input: a copy, so that a compiled graph returns
                # it as one of its own outputs (compiled.DirectCall fills only those)
                aux.append(x if i else x.clone())
            h = rms_norm(x, w[p + "attn_norm"], c.rms_norm_eps)
            qkv = linear(h, w[p + "qkv"], fmt, w.get(p + "qkv_bias"), bound(p + "qkv"))  # [T, (H + 2KV) * D]
            # q and k side by side in qkv: one rope call for both (elementwise: the same bits)
            qk = rope_signed(qkv[:, :self.q_size + self.kv_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim),
                             cos_u, sin_u)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:]
            # a float16 cache (engine.kv_cache_dtype) takes the values rounded, as the fused stack writes them
            ks[i].index_copy_(0, write_slots, k.to(ks[i].dtype))
            vs[i].index_copy_(0, write_slots, v.view(t, c.num_kv_heads, c.head_dim).to(vs[i].dtype))
            attn = attend(i, q, ks[i], vs[i])
            x = x + linear(attn.reshape(t, self.q_size), w[p + "o"], fmt, None, bound(p + "o"))
            h = rms_norm(x, w[p + "mlp_norm"], c.rms_norm_eps)
            gate, up = linear(h, w[p + "gate_up"], fmt, None, bound(p + "gate_up")).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, w[p + "down"], fmt, None, bound(p + "down"))
        return x, aux


def aux_features(aux: list[torch.Tensor], aux_layers: tuple[int, ...]) -> torch.Tensor:
    """The residuals of sorted(set(aux_layers)) at the aux rows, concatenated in aux_layers' own
    order [A, len(aux_layers) * hidden] (a layer named twice is gathered once per mention)."""
    order = sorted(set(aux_layers))
    return torch.cat([aux[order.index(layer)] for layer in aux_layers], dim=-1)


class Attend:
    """One forward's attention over the paged cache, worked out once for all layers from its
    mask: row-invariant when activations are rounded (see Decoder.__init__), else plain SDPA.
    Called per layer as attend(i, q, k_cache, v_cache)."""

    def __init__(self, model: "Decoder", batch: ForwardBatch, t: int) -> None:
        self.read_slots, self.mask, self.scale = batch.read_slots, batch.mask, model.scale
        self.plan = self.row_cols = self.read_range = None
        # (prompt row ids, other row ids, InvariantPlan of the prompt rows); ids None: all rows
        self.prompt_plan = None
        # model.rows_attention: every row (prompt, generated, draft) over exactly its keys through
        # one C++ call per layer (cpu_kernels.rows_attention; it also beats the batched invariant
        # path on prompt rows: one layer, 256 rows after 512 keys, 1 thread, 11.3 ms against 30.5)
        self.index = rows_index(batch.read_slots, batch.mask, t) if model.rows_attention else None
        if self.index is not None:
            return
        # row-invariant attention (prefill too: its K/V must not depend on the batch): half-precision
        # hidden states in one batched call per sequence, float32 ones row by row (measured on 2
        # cores, SmolLM2 shapes, 30 layers: float32 rows 0.6 / 2.8 / 10.9 ms at widths 1 / 5 / 17,
        # batched 1.8 / 4.0 / 9.5; bfloat16 rows 1.8 / 9.7 / 35.6, batched 1.9 / 4.0 / 9.7)
        if model.row_invariant and model.dtype in (torch.bfloat16, torch.float16):
            self.plan = InvariantPlan(batch.mask, batch.read_slots, t)
        elif model.row_invariant and batch.prompt_rows is not None and bool(batch.prompt_rows.any()):
            # float32 hidden states, rounded kernel inputs: prompt rows batched and row-invariant
            # (the decode step never recomputes them, so only they must agree among themselves,
            # whatever the chunking), generated and draft rows one SDPA call each as below
            # (measured: a 256-row int4 prefill chunk after 512 keys spent 344 ms in 7,680
            # per-row SDPA calls)
            if bool(batch.prompt_rows.all()):  # a pure prefill forward: nothing to split
                self.prompt_plan = (None, None, InvariantPlan(batch.mask, batch.read_slots, t))
            else:
                pre = batch.prompt_rows.nonzero().squeeze(1)
                rest = (~batch.prompt_rows).nonzero().squeeze(1)
                self.prompt_plan = (pre, rest, InvariantPlan(batch.mask.index_select(0, pre), batch.read_slots,
                                                             pre.shape[0]))
                self.row_cols = visible_columns(batch.mask.index_select(0, rest))
        elif model.row_invariant and batch.mask is not None:
            self.row_cols = visible_columns(batch.mask)
        if self.plan is None:  # the keys as a view of the cache when they are one run of slots
            self.read_range = contiguous_range(batch.read_slots)

    def __call__(self, i: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if self.index is not None:
            return torch.ops.specbuild_cpu.rows_attention(q, k_cache, v_cache, self.index, self.scale)
        if self.plan is not None:
            return paged_attention_invariant(q, k_cache, v_cache, self.plan, self.scale)
        if self.prompt_plan is not None:
            pre, rest, plan = self.prompt_plan
            if pre is None:  # every row a prompt row
                return paged_attention_invariant(q, k_cache, v_cache, plan, self.scale)
            out = q.new_empty(q.shape)
            out[pre] = paged_attention_invariant(q.index_select(0, pre), k_cache, v_cache, plan, self.scale)
            out[rest] = paged_attention_rows(q.index_select(0, rest), k_cache, v_cache, self.read_slots,
                                             self.row_cols, self.scale, self.read_range)
            return out
        if self.row_cols is not None:
            return paged_attention_rows(q, k_cache, v_cache, self.read_slots, self.row_cols, self.scale,
                                        self.read_range)
        return paged_attention(q, k_cache, v_cache, self.read_slots, self.mask, self.scale, self.read_range)


def rows_attention_enabled(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether a row-invariant float32 model runs its decode and verify rows' attention through
    cpu_kernels.rows_attention (one C++ call per layer; each row's bits depend only on its own
    query and keys, so a verify row is the decode step by construction) rather than one SDPA call
    per row (paged_attention_rows). Measured on a 2-core AMD EPYC, SmolLM2 shapes, one thread:
    5.8 / 10.3 / 29.1 us a layer at 1 / 64 / 256 keys against SDPA's 29.9 / 48.6 / 85.2 (one
    row), and the Python views around per-row calls are gone (docs/compiled-step.md).
    $SPECBUILD_ROWS_ATTENTION=0 keeps the SDPA path (for comparisons); SPECBUILD_CPU_KERNEL=torch
    does too."""
    if os.environ.get("SPECBUILD_ROWS_ATTENTION", "1").strip() == "0":
        return False
    from specbuild.model import cpu_kernels

    return cpu_kernels.rows_attention_usable(dtype, head_dim, device)


def row_invariant_needed(weights: dict, dtype: torch.dtype) -> bool:
    """Whether a forward must compute each row independently of the others: when hidden
    states or some linear's activations are half precision, the 1e-7 differences between a
    one-row and a many-row attention kernel round into whole bfloat16 ulps and grow over the
    layers (measured: int4 with bfloat16 activations, prompt lookup diverged from plain
    decoding on 3 of 7 Spec-Bench turns, top-2 logit gaps up to 0.12). float32/64 keep them
    at ~1e-6 in the logits."""
    if dtype in (torch.bfloat16, torch.float16):
        return True
    if any(getattr(v, "quantizes_inputs", False) for v in weights.values()):  # int8 activations round far more
        return True
    return any(not isinstance(v, torch.Tensor) and getattr(v, "act_dtype", torch.float32) in
               (torch.bfloat16, torch.float16) for v in weights.values())


def row_policies(weights: dict, num_layers: int) -> dict[str, tuple[int, int]]:
    """Per half-precision linear (a plain tensor, or a QLinear whose primary format is a dense
    half-precision one) the (min, max) rows per call under which its kernel gives every row
    the same bits (qlinear.width_classes / rows_policy; probed once per distinct shape,
    layout and dtype, and kept per machine in the cost cache). "lm_head" stands for the
    output layer (the embedding when tied). Int8 and int4 kernels need none: measured
    invariant at every width."""
    from specbuild.model.costcache import cached_costs, machine_key

    names = [f"layers.{i}.{n}" for i in range(num_layers) for n in ("qkv", "o", "gate_up", "down")]
    names.append("lm_head" if "lm_head" in weights else "embed")
    probed: dict[tuple, tuple[int, int]] = {}
    out: dict[str, tuple[int, int]] = {}
    for name in names:
        t = weights.get(name)
        if isinstance(t, QLinear):
            impl = t.formats[t.primary]
            t = impl.weight if impl.kind == "dense" else None
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.bfloat16, torch.float16):
            continue
        transposed = not t.is_contiguous()
        bias = name + "_bias" in weights
        key = (tuple(t.shape), transposed, str(t.dtype), bias, str(t.device))
        if key not in probed:
            ck = {"what": "row classes", **machine_key(t.device), "weight": list(key)}
            classes, _ = cached_costs(ck, lambda: width_classes(tuple(t.shape), transposed, t.dtype, t.device, bias))
            probed[key] = rows_policy(classes)
        # even a kernel invariant at every probed width is cut at the widest probed (a prefill
        # chunk of 256 rows runs as 4 calls of 64: nearly the same cost in half precision)
        out["lm_head" if name == "embed" else name] = probed[key]
    return out


def rescore_top(logits: torch.Tensor, hidden: torch.Tensor, lm_head: torch.Tensor, top: int = 64) -> torch.Tensor:
    """Recompute each row's `top` largest logits in float32 (one fixed-order dot product per
    entry). Half-precision logits carry ~3 digits: exact ties and 1-ulp flips between verify
    widths would otherwise decide greedy tokens, so speculative output could differ from
    plain output of the same bundle. logits: [R, V] float32; hidden: [R, H]. In place."""
    if logits.shape[0] == 0:
        return logits
    idx = logits.topk(min(top, logits.shape[1]), dim=-1).indices  # [R, k]
    rows = lm_head.index_select(0, idx.reshape(-1)).float().view(*idx.shape, -1)  # [R, k, H]
    exact = (rows * hidden.float().unsqueeze(1)).sum(-1)  # [R, k]
    return logits.scatter_(1, idx, exact)


def weight_bytes(weights: dict, tied: bool) -> int:
    """Bytes one decode step reads: every weight once (embedding rows are negligible, the
    lm_head is read in full; a tied embedding counts once, as the lm_head). A QLinear counts
    its primary (narrow-step) format."""
    return sum(weight_nbytes(t) for n, t in weights.items() if n != "embed" or tied)


@torch.inference_mode()
def reference_forward(config: ModelConfig, weights: dict[str, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
    """Plain full-sequence causal forward without any cache: the yardstick for the paged
    decoder and for checkpoint round trips. input_ids: [T]. Returns logits [T, vocab] float32.
    QLinear weights enter as their dequantised values (dense matmuls throughout)."""
    c, w = config, {k: as_dense(v) for k, v in weights.items()}
    dtype = w["embed"].dtype
    t = input_ids.shape[0]
    cos, sin = rope_tables(c, t, dtype)
    x = w["embed"][input_ids]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    group = c.num_heads // c.num_kv_heads
    for i in range(c.num_layers):
        p = f"layers.{i}."
        h = rms_norm(x, w[p + "attn_norm"], c.rms_norm_eps)
        qkv = h @ w[p + "qkv"].T
        if p + "qkv_bias" in w:
            qkv = qkv + w[p + "qkv_bias"]
        q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], -1)
        q = apply_rope(q.reshape(t, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.reshape(t, c.num_kv_heads, c.head_dim), cos, sin).repeat_interleave(group, 1)
        v = v.reshape(t, c.num_kv_heads, c.head_dim).repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, -1)
        x = x + attn @ w[p + "o"].T
        h = rms_norm(x, w[p + "mlp_norm"], c.rms_norm_eps)
        gate, up = (h @ w[p + "gate_up"].T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ w[p + "down"].T
    x = rms_norm(x, w["norm"], c.rms_norm_eps)
    return (x @ w.get("lm_head", w["embed"]).T).float()
