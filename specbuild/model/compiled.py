"""The decoder's layer stack compiled with torch.compile (inductor), opt-in.

Why: on a 2-core CPU an eager SmolLM2-135M int4 step is ~45% op overhead (about 1,500
small ops at 1-2 us each around 121 linear kernels; docs/benchmarks.md has the profile).
Inductor fuses the glue between the linears (norms, rope, residual adds,
SiLU, the dtype casts) into a few generated C++ loops and calls the linear kernels
(int4/int8 weight-only, oneDNN bfloat16) as they are.

What keeps it lossless. Every forward of an engine that compiles runs the compiled stack
(prefill chunks, decode steps, verify passes, any width), so speculative and plain
decoding share one arithmetic. Within it a row must get the same bits whatever the width:
the glue is per element or reduces over the fixed hidden size, the linear kernels are the
eager ones (their row-invariance is measured at load, qlinear.width_classes), and
attention stays the eager row-invariant code, called as an opaque custom op per layer
(its per-forward plan, worked out from the mask in Python, is handed over beside the
graph). The width is one dynamic dimension, unbacked so that one row is not compiled
apart from many (dynamo specialises sizes 0 and 1 otherwise). tests/model/test_compiled.py
checks, on the machine it runs on, that every row of a compiled w-row pass equals the
compiled decode step bit for bit, and that greedy speculation equals plain decoding.

Calls: each compiled variant's graph is called directly (DirectCall, checked against
dynamo's own call once), not through dynamo's frame evaluation, which costs 0.5-0.9 ms a
call here (graphs that also return an EAGLE head's aux layers too); a variant DirectCall
cannot fill runs through dynamo with its guard checks skipped (one graph per code object
makes that safe). Inductor writes
each graph's wrapper (the code that allocates buffers and calls the ~150 kernels of a decode
step in turn) in C++ (`cpp_wrapper`, INDUCTOR_OPTIONS) instead of Python: the same kernels,
so the same bits, without ~400 Python-level calls a step (measured 0.85x the graph's CPU time
at one thread, docs/compiled-step.md); the graph also releases the GIL while it runs.

Cost: a compile at load (minutes on 2 cores the first time, most of it the C++ wrapper;
inductor caches the result on disk, keyed by the code, shapes and options, so later loads
take ~10-20 s for SmolLM2).
"""

from __future__ import annotations

import os
import threading
import types

import torch
from torch._dynamo.decorators import mark_unbacked

from specbuild.model.attention import paged_attention

# SPECBUILD_COMPILE_GUARDS=1: variants that run through dynamo (no DirectCall) keep its guard
# checks on every call (for debugging a suspected wrong-graph call; slower)
_NO_SKIP = bool(os.environ.get("SPECBUILD_COMPILE_GUARDS"))
_local = threading.local()  # the forward's attention (decoder.Attend) while its compiled stack runs


@torch.library.custom_op("specbuild::paged_attention", mutates_args=())
def paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """Attention of layer `layer` for the running forward, through its decoder.Attend."""
    return _local.attend(layer, q, k_cache, v_cache).contiguous()


@paged_attention_op.register_fake
def _(q, k_cache, v_cache, layer):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# a one-row step over one run of more keys than this reads them as a view of the cache
# through the op (attention.gather_rows: the same bits) rather than gathering them in the
# graph: the copy costs more than the op's ~20 us a layer from here (measured, 2 threads)
INLINE_MAX_KEYS = 256

# inductor config patches of every compiled stack (CompiledStack(options=...) for others):
# the graphs' wrapper in C++, not Python (docs/compiled-step.md has the measurements and the
# candidates that did not win)
INDUCTOR_OPTIONS: dict = {"cpp_wrapper": True}


def _op_attend(i: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    return paged_attention_op(q.contiguous(), k_cache, v_cache, i)


class CompiledStack:
    """Decoder.layer_stack through torch.compile; `run` has layer_stack's contract.

    One compiled function per static variant of a call (key below), each on its own code
    object, so each holds exactly one graph: dynamo's guard checks (~1 ms a call over the
    ~500 weight tensors the graph reads, a sixth of an int4 step) can then be skipped
    (torch.compiler.set_stance(skip_guard_eval_unsafe=True)) without the risk that stance
    has where one function holds several graphs, of running one graph for another's inputs."""

    def __init__(self, model, options: dict | None = None) -> None:
        self.model = model
        # inductor config patches every graph of this stack compiles under (INDUCTOR_OPTIONS)
        self.options = dict(INDUCTOR_OPTIONS if options is None else options)
        self.rows = stack_rows(model.rows_per_call)
        self.fns: dict = {}  # key -> the compiled function of that variant
        self.checked: set = set()  # keys whose function recompiled once: always run with guards
        self.direct: dict = {}  # key -> DirectCall (or None: that variant runs through dynamo)

    def _stack(self):
        model = self.model

        def stack(x, cos_u, sin_u, write_slots, read_slots, ks, vs, fmt, aux_layers, inline):
            if inline == "rows":  # specbuild's C++ attention over every row's own keys, in the graph
                def attend(i, q, k_cache, v_cache):  # read_slots: the forward's rows_attention index
                    return torch.ops.specbuild_cpu.rows_attention(q, k_cache, v_cache, read_slots, model.scale)
            elif inline:  # one sequence, no mask: eager's own SDPA call, in the graph
                def attend(i, q, k_cache, v_cache):
                    return paged_attention(q, k_cache, v_cache, read_slots, None, model.scale)
            else:
                attend = _op_attend
            return model.layer_stack(x, cos_u, sin_u, write_slots, ks, vs, fmt, attend, aux_layers, bounded=False)

        # a fresh code object: dynamo keeps its compiled graphs on the code object, not on
        # the function, so every variant needs its own
        code = stack.__code__.replace(co_name=f"stack_{len(self.fns)}")
        return types.FunctionType(code, stack.__globals__, code.co_name, None, stack.__closure__)

    def run(self, x, cos_u, sin_u, write_slots, cache, fmt, attend, aux_layers):
        # no mask and the plain SDPA path (a one-row decode step in float32 hidden states): SDPA
        # inline in a one-row graph; otherwise the width is dynamic (unbacked: one graph for all
        # widths) and attention the eager row-invariant op
        # (rows: the model's rows_attention kernel in the graph, the forward's index in place of
        # read_slots; static width at one row, like the SDPA decode graph, else unbacked)
        if attend.index is not None:
            inline, keys = "rows", attend.index
        else:
            inline = attend.mask is None and attend.plan is None and attend.row_cols is None and \
                attend.prompt_plan is None and (
                attend.read_range is None or attend.read_slots.shape[0] <= INLINE_MAX_KEYS)
            keys = attend.read_slots
        # the index tensors come as views at an offset (slices of a slot list) or not, made in
        # inference mode or not: dynamo guards on both, so fresh copies (one small op each,
        # made here in the forward's inference mode) keep every call on the graphs compiled
        write_slots, read_slots = write_slots.clone(), keys.clone()
        if not inline or (inline == "rows" and x.shape[0] != 1):
            for t in (x, cos_u, sin_u, write_slots):
                mark_unbacked(t, 0)
        torch._dynamo.mark_dynamic(read_slots, 0)
        # every static property a graph is specialised on: the format, the aux layers, the
        # attention path, the inputs' dtypes and inference-ness, the cache's shape (the width
        # and the number of keys are dynamic)
        key = (fmt, aux_layers, inline, inline == "rows" and x.shape[0] == 1, x.dtype, cos_u.dtype,
               tuple(cache.k[0].shape), cache.k[0].dtype,
               len(cache.k), x.device, tuple(t.is_inference() for t in (x, cos_u, sin_u, write_slots, read_slots)))
        args = (x, cos_u, sin_u, write_slots, read_slots, cache.k, cache.v, fmt, aux_layers, inline)
        _local.attend = attend
        try:
            direct = self.direct.get(key)
            if direct is not None:
                outs = direct(args)
                return outs[0], list(outs[1:])
            fn = self.fns.get(key)
            if fn is None:
                capture: dict = {}
                fn = self.fns[key] = torch.compile(self._stack(), backend=capturing_backend(capture, self.options),
                                                   dynamic=False,
                                                   fullgraph=True)
                out = fn(*args)
                if capture:
                    self.direct[key] = DirectCall.checked(capture, args, [out[0], *out[1]])
                return out
            if key not in self.checked and not _NO_SKIP:
                try:
                    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                        return fn(*args)
                except RuntimeError as e:  # its one graph does not fit: recompile, guarded from now on
                    if "skip_guard_eval_unsafe" not in str(e):
                        raise
                    self.checked.add(key)
            return fn(*args)
        finally:
            _local.attend = None


def capturing_backend(capture: dict, options: dict | None = None):
    """Inductor (compile_fx, as torch.compile's default backend) under the config patches
    `options` that also keeps the compiled graph and the example inputs dynamo called it
    with, for DirectCall."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        compiled = compile_fx(gm, example_inputs, config_patches=dict(options or {}))
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        capture.update(compiled=compiled, inputs=list(example_inputs), outputs=len(outputs))
        return compiled

    return backend


class DirectCall:
    """A compiled graph called without dynamo's frame evaluation: each call would otherwise
    fetch and check the ~500 weight tensors it reads (measured 0.5-0.9 ms of a 5.5 ms int4
    layer stack on 2 cores; 4.1 ms direct). The graph's inputs are those dynamo lifted, in
    its order: the call's own tensors (found by identity at capture), the weights (fixed:
    the same tensors every call), and the sizes marked dynamic (an unbacked size is the
    width, a backed one the number of keys). Made for a graph whose outputs are the hidden
    states and then the aux layers' residuals, and kept only if, on the capturing call's inputs, it returns exactly
    what dynamo's call returned; otherwise calls go through dynamo."""

    def __init__(self, compiled, plan: list) -> None:
        self.compiled = compiled
        # the weights placed once; per call only the call's own tensors and sizes are filled in
        self.template = [v if kind == "const" else None for kind, v in plan]
        self.fill = [(i, kind, v) for i, (kind, v) in enumerate(plan) if kind != "const"]

    @classmethod
    def checked(cls, capture: dict, args: tuple, expect: list[torch.Tensor]) -> "DirectCall | None":
        if capture.get("outputs") != len(expect):
            return None
        x, cos_u, sin_u, write_slots, read_slots, ks, vs = args[:7]
        where = {id(x): 0, id(cos_u): 1, id(sin_u): 2, id(write_slots): 3, id(read_slots): 4}
        where.update({id(t): ("k", i) for i, t in enumerate(ks)})
        where.update({id(t): ("v", i) for i, t in enumerate(vs)})
        plan = []
        for e in capture["inputs"]:
            if isinstance(e, torch.Tensor):
                plan.append(("arg", where[id(e)]) if id(e) in where else ("const", e))
            elif isinstance(e, torch.SymInt):
                hint = e.node.hint if e.node.has_hint() else None
                if hint is None:
                    plan.append(("rows", None))
                elif hint == read_slots.shape[0] and hint != x.shape[0]:
                    plan.append(("keys", None))
                else:
                    return None  # a size this class does not know how to fill
            else:
                return None
        call = cls(capture["compiled"], plan)
        try:
            got = call(args)
        except Exception:  # noqa: BLE001 - any mismatch in the calling convention: use dynamo
            return None
        same = len(got) == len(expect) and all(torch.equal(g, e) for g, e in zip(got, expect))
        return call if same else None

    def __call__(self, args: tuple) -> list[torch.Tensor]:
        x, cos_u, sin_u, write_slots, read_slots, ks, vs = args[:7]
        own = (x, cos_u, sin_u, write_slots, read_slots)
        inputs = list(self.template)  # a fresh copy each call: the template stays as built
        for i, kind, v in self.fill:
            if kind == "arg":
                inputs[i] = own[v] if isinstance(v, int) else (ks if v[0] == "k" else vs)[v[1]]
            elif kind == "rows":
                inputs[i] = x.shape[0]
            else:
                inputs[i] = read_slots.shape[0]
        return list(self.compiled(*inputs))  # the hidden states, then the aux layers' residuals


def stack_rows(rows_per_call: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """One (min, max) rows per forward that keeps every layer linear's own policy (decoder.
    row_policies): the largest minimum and the smallest maximum. (1, no limit) without any."""
    layers = [v for k, v in rows_per_call.items() if k.startswith("layers.")]
    if not layers:
        return 1, 1 << 30
    lo, hi = max(v[0] for v in layers), min(v[1] for v in layers)
    if lo > hi:
        raise ValueError(f"the layers' half-precision kernels need {lo} to {hi} rows per call: no width fits "
                         f"them all, so this bundle cannot run compiled here")
    return lo, hi
