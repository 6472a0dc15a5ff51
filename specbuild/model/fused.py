"""The whole layer stack as one call into specbuild's C++ kernels (cpu_kernels.cpp, int4_stack).

For int4 bundles (float32 hidden states, int4 layer weights on specbuild's int4 kernel with
bfloat16 inputs, attention through rows_attention) a compiling engine runs
this instead of torch.compile: the same per-row arithmetic as Decoder.layer_stack (RMSNorm,
the int4 kernel on the input rounded to bfloat16, its bfloat16 output widened, rope, the K/V
write, rows_attention, the residual adds, SiLU(gate) * up), with the glue between the kernels
written as a few loops per row in C++ rather than inductor's ~150 generated kernels, buffers and
OpenMP regions a step (docs/compiled-step.md measures both). It needs no inductor compile at
load either (seconds instead of minutes on 2 cores the first time).

int4-a8 bundles (`--activations int8`: the int4 weights against inputs rounded to int8 blocks,
cpu_kernels.int4_q8_mm) run the same stack with that kernel: float32 inputs and outputs around
it, nothing rounded to bfloat16, as Decoder.layer_stack computes them with those weights.

What keeps it lossless: every forward of the engine (prefill chunks, decode steps, verify
passes, trees) runs this same call, and within it each row's bits do not depend on the other
rows (the glue is per row, the thread split by whole rows, the int4 kernel and rows_attention
are row-invariant). tests/model/test_compiled.py checks that every row of a w-row pass equals
the decode step bit for bit and that greedy speculation equals plain decoding, on this path.

The call also takes the forward's start and end (stack_prelude: the embedding rows, rope rows
and attention index; int4_stack's final norm, int8-q8 lm_head and each row's argmax): after the
weights stream through the caches, every separate op there ran cold. $SPECBUILD_FUSED_ENDS=0
keeps them as separate ops, $SPECBUILD_FUSED_STACK=0 the torch.compile stack (model/compiled.py),
both for comparisons."""

from __future__ import annotations

import os

import torch

from specbuild.model.arena import weight_arena

STACK_WEIGHTS = ("attn_norm", "qkv", "qkv_bias", "o", "mlp_norm", "gate_up", "down")  # per layer, cpu_kernels.cpp
LINEARS = ("qkv", "o", "gate_up", "down")
STACK_DIMS = 7  # meta's model entries before the per-linear ones (cpu_kernels.cpp, int4_stack)
FORMATS = ("int4", "int4-a8")  # the layer formats it runs (every linear of the stack in the same one)


def fused_reason(model) -> str | None:
    """None when `model` (a Decoder) can run its layer stack through int4_stack, else why not
    (a sentence naming what does not fit)."""
    from specbuild.model import cpu_kernels
    from specbuild.model.qlinear import QLinear

    if os.environ.get("SPECBUILD_FUSED_STACK", "1").strip() == "0":
        return "SPECBUILD_FUSED_STACK=0"
    c = model.config
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"the fused stack runs float32 hidden states on the CPU (this model: {model.dtype} on {model.device})"
    if not model.rows_attention:
        return "its attention does not run through rows_attention (float32 hidden states with rounded kernel inputs)"
    if c.hidden_size % 8 or c.intermediate_size % 8 or c.head_dim % 8:
        return f"hidden {c.hidden_size}, intermediate {c.intermediate_size} and head_dim {c.head_dim} must be " \
               "multiples of 8"
    if not cpu_kernels.status().get("available"):
        return "specbuild's CPU kernels are not available"
    first = model.w.get("layers.0.qkv")
    kind = first.primary if isinstance(first, QLinear) else None
    if kind not in FORMATS:
        return "layers.0.qkv is not an int4 weight"
    for i in range(c.num_layers):
        for name in LINEARS:
            w = model.w.get(f"layers.{i}.{name}")
            if not isinstance(w, QLinear) or w.primary != kind:
                return f"layers.{i}.{name} is not an {kind} weight like layers.0.qkv"
            impl = w.formats[kind]
            if kind == "int4" and (not impl.kernel or impl.cpu_packed is None or impl.act_dtype != torch.bfloat16):
                return f"layers.{i}.{name} does not run on specbuild's int4 kernel with bfloat16 inputs"
            if kind == "int4-a8" and impl.group_size % cpu_kernels.Q8_BLOCK:
                return f"layers.{i}.{name}'s groups of {impl.group_size} are not whole int8 blocks"
    plan = model.plans.get("layers")
    if plan is not None and set(plan.formats) != {kind}:
        return f"the layers' format plan runs other formats at some widths ({plan.describe()})"
    return None


class FusedStack:
    """Decoder.layer_stack through one int4_stack call; `run` has CompiledStack.run's contract."""

    rows = (1, 1 << 30)  # any width in one call (int4 and rows_attention need no row policy)

    def __init__(self, model) -> None:
        why = fused_reason(model)
        if why is not None:
            raise ValueError(f"the fused C++ layer stack cannot run this model: {why}")
        c, w = model.config, model.w
        self.model = model
        self.kind = w["layers.0.qkv"].primary
        empty = torch.empty(0, dtype=torch.float32)
        # meta[5]: the int4 kernel's ISA level; meta[6]: the int4 x int8 kernel's path (0: int4)
        weights, meta = [], [c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, 0, 0]
        for i in range(c.num_layers):
            p = f"layers.{i}."
            for name in STACK_WEIGHTS:
                if name in LINEARS:
                    impl = w[p + name].formats[self.kind]
                    weights.append(impl.cpu_packed)
                    if self.kind == "int4-a8":  # per linear: group size, fp32 scales (0/1)
                        meta += [impl.group_size, int(not impl.f16_scales)]
                        meta[6] = impl.path
                    else:
                        meta += [impl.group_size, int(impl.act_dtype != torch.bfloat16)]
                        meta[5] = impl.kernel
                elif name == "qkv_bias":
                    bias = w.get(p + "qkv_bias")
                    weights.append(empty if bias is None else bias.float().contiguous())
                else:
                    weights.append(w[p + name].float().contiguous())
        # the packed weights in one block, in the order a step reads them, on huge pages where
        # the kernel gives them (model/arena.py); each linear's own copy is the block's from now
        # on, so the scattered originals are freed. The lm_head's packed rows go last.
        owners = [(w[f"layers.{i}.{name}"].formats[self.kind], "cpu_packed") for i in range(c.num_layers)
                  for name in STACK_WEIGHTS if name in LINEARS]
        heads = [(impl, attr) for impl in (getattr(model.lm_head, "formats", None) or {}).values()
                 for attr in ("cpu_packed", "q8_packed") if getattr(impl, attr, None) is not None]
        moved = [t for t in weights if t.numel()] + [getattr(impl, attr) for impl, attr in heads]
        self.arena, views = weight_arena(moved)
        new_of = {id(t): v for t, v in zip(moved, views)}
        for impl, attr in owners + heads:
            setattr(impl, attr, new_of[id(getattr(impl, attr))])
        weights = [new_of.get(id(t), t) for t in weights]
        self.weights, self.meta = weights, meta
        self.eps, self.scale = float(c.rms_norm_eps), float(model.scale)
        # the forward's end in the same call (run_final): the final norm (the stack's own norm
        # arithmetic) and, where the lm_head is the int8 x int8 kernel's, the lm_head: after the
        # weights have streamed through the caches, each separate op of the forward's end ran
        # cold (the final norm's torch ops alone 0.1-0.2 ms of a ~5.5 ms step, AMD EPYC)
        self.final_norm = w["norm"].float().contiguous()
        self.head_format = head_format(model)
        self.embed = embed_table(model)  # (table, scales or None) for stack_prelude, or None
        if os.environ.get("SPECBUILD_FUSED_ENDS", "1").strip() == "0":
            self.run_final = None  # the forward's start and end as separate ops (for comparisons)

    def inputs(self, batch):
        """The stack's inputs and the rows_attention index in one C++ call (stack_prelude: the
        same embedding rows, rope rows and index as Decoder.stack_inputs and attention.rows_index,
        without a dozen cold torch and numpy ops at each step's start), or None where the
        embedding is not an int8 or float32 table."""
        if self.embed is None:
            return None
        m = self.model
        x, cos_u, sin_u, index = torch.ops.specbuild_cpu.stack_prelude(
            batch.input_ids, self.embed[0], self.embed[1], batch.positions, m.cos, m.sin_signed, batch.read_slots,
            batch.mask)
        return (x, cos_u, sin_u), index

    def run(self, x, cos_u, sin_u, write_slots, cache, fmt, attend, aux_layers):
        outs = self._call(x, cos_u, sin_u, write_slots, cache, attend.index, aux_layers, {})
        return outs[0], list(outs[1:])

    def run_final(self, x, cos_u, sin_u, write_slots, cache, index, aux_layers, logit_rows, head_fmt):
        """The stack, then the final norm of `logit_rows` and, when `head_fmt` is
        head_format, the lm_head over them. Returns (hidden [R, hidden], aux, logits [R, vocab]
        or None: the caller runs the lm_head, argmax [R] of each logit row or None: the first
        maximum, or the first NaN, as params.argmax_rows takes it)."""
        final = {"final_norm": self.final_norm, "logit_rows": logit_rows}
        head = None
        if head_fmt is not None and head_fmt == self.head_format:
            head = self.model.lm_head.formats[head_fmt]
            final.update(head=head.q8_packed, head_n=head.qweight.shape[0], head_path=head.path)
        outs = self._call(x, cos_u, sin_u, write_slots, cache, index, aux_layers, final)
        if head is None:
            return outs[0], list(outs[1:]), None, None
        return outs[0], list(outs[1:-2]), outs[-2], outs[-1]

    def _call(self, x, cos_u, sin_u, write_slots, cache, index, aux_layers, final: dict):
        if index is None:
            raise ValueError("the fused layer stack needs the forward's rows_attention index")
        return torch.ops.specbuild_cpu.int4_stack(x, cos_u, sin_u, write_slots, cache.k, cache.v, index,
                                                  self.weights, self.meta, self.scale, self.eps,
                                                  sorted(set(aux_layers)), **final)


def embed_table(model):
    """What stack_prelude reads for the embedding: (int8 rows, float32 scales) for an int8
    embedding whose rows() is dequantize_int8's q * scale in float32, (float32 rows, None) for a
    float32 tensor, else None (the forward gathers the rows itself)."""
    from specbuild.model.qlinear import QLinear

    if model.cos.dtype != torch.float32 or not (model.cos.is_contiguous() and model.sin_signed.is_contiguous()):
        return None
    e = model.w["embed"]
    if isinstance(e, torch.Tensor):
        return (e, None) if e.dtype == torch.float32 and e.dim() == 2 and e.is_contiguous() else None
    if not isinstance(e, QLinear) or e.dtype != torch.float32:
        return None
    impl = e.formats[e.primary]
    if impl.kind != "int8" or impl.scales.dtype != torch.float32 or not impl.qweight.is_contiguous():
        return None
    return impl.qweight, impl.scales.contiguous()


def head_format(model) -> str | None:
    """The lm_head format int4_stack runs itself (int8-q8 on specbuild's kernel: the format's own
    call is int8_q8_mm over float32 rows with float32 outputs), or None: the forward runs it."""
    from specbuild.model.qlinear import Int8Q8Format, QLinear

    head = model.lm_head
    if not isinstance(head, QLinear) or head.dtype != torch.float32 or head.act_dtype != torch.float32:
        return None
    if model.rows_per_call.get("lm_head") is not None:
        return None
    for name, impl in head.formats.items():
        if isinstance(impl, Int8Q8Format) and getattr(impl, "q8_packed", None) is not None and impl.path:
            return name
    return None
