"""The fused C++ layer stack (model/fused.py, cpu_kernels.cpp int4_stack): which bundles take
it, that it computes the eager layer stack's model, that its rows are the decode step's bits
at every width and beside other sequences, that it returns an EAGLE head's aux layers, and
that bad inputs name the value. (tests/model/test_compiled.py runs the engine-level contracts
on it too: verify rows equal the decode step, greedy speculation equals plain decoding.)"""

from __future__ import annotations

import mmap

import pytest
import torch

from specbuild.compiler.compile import CompileOptions, compile_bundle
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.model import cpu_kernels
from specbuild.model.decoder import Attend, ForwardBatch
from specbuild.model.fused import STACK_DIMS, FusedStack, fused_reason
from specbuild.model.timing import scratch_sequence, verify_batch
from kernel_skip import kernels_or_skip
from tiny import make_tiny_hf


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    target = make_tiny_hf(str(root / "target"), scale=4.0, seed=5, layers=3, inter=96)
    out = {}
    for name, opts in {"int4": {"dtype": "float32", "quantize": "int4", "lm_head_format": "int8"},
                       "int4-a8": {"dtype": "float32", "quantize": "int4", "lm_head_format": "int8",
                                   "activations": "int8", "group_size": 32},
                       "int4-a8-head-a8": {"dtype": "float32", "quantize": "int4", "lm_head_format": "int8",
                                           "activations": "int8", "lm_head_activations": "int8",
                                           "group_size": 32},
                       "float32": {"dtype": "float32"}}.items():
        out[name] = compile_bundle(target, str(root / name), CompileOptions(max_draft_len=8, **opts))
    return out


@pytest.fixture(scope="module")
def engine(bundles):
    kernels_or_skip()
    return Engine(bundles["int4"], EngineConfig(max_batch_size=4, compile=True))


def test_int4_bundles_take_the_fused_stack_and_others_say_why_not(bundles, engine, monkeypatch):
    assert isinstance(engine.model.compiled, FusedStack) and engine.model.fused_why is None
    other = Engine(bundles["float32"], EngineConfig(max_batch_size=1))
    assert "rows_attention" in fused_reason(other.model)  # float32 weights: no rounded inputs, SDPA attention
    with pytest.raises(ValueError, match="cannot run this model"):
        FusedStack(other.model)
    monkeypatch.setenv("SPECBUILD_FUSED_STACK", "0")
    assert fused_reason(engine.model) == "SPECBUILD_FUSED_STACK=0"


def test_the_fused_stack_computes_the_eager_model(engine):
    """One decode step and a 5-row verify pass: the fused stack's logits are the eager layer
    stack's up to rounding (the glue's float32 sums in another order), and the greedy tokens
    are the same."""
    check_fused_is_the_eager_model(engine)


def test_fused_rows_are_the_decode_steps_bits_at_every_width(engine):
    """Each row of a w-row chain pass (w = 1..9) equals the one-row step at its position, bit
    for bit, logits and the K/V it wrote: the lossless contract, on the op itself."""
    check_rows_are_the_decode_steps_bits(engine)


@pytest.mark.parametrize("level", [2, 3, 4])
def test_every_int4_level_keeps_the_rows_bits_in_the_fused_stack(bundles, level, monkeypatch):
    """The same contract with the int4 linears held to each AVX-512 level this CPU has (the
    choice at load picks one by measurement; each must be lossless wherever it is picked)."""
    kernels_or_skip()
    if level == 4 and not cpu_kernels.has_isa4() or level < 4 and cpu_kernels.isa() < 2:
        pytest.skip(f"this CPU has no int4 level {level}")
    cpu_kernels.reset_choices()
    monkeypatch.setitem(cpu_kernels._choices, ("int4", torch.bfloat16), level)
    try:
        eng = Engine(bundles["int4"], EngineConfig(max_batch_size=2, compile=True))
    finally:
        cpu_kernels.reset_choices()
    assert isinstance(eng.model.compiled, FusedStack)
    assert eng.model.w["layers.0.qkv"].formats["int4"].kernel == level
    check_rows_are_the_decode_steps_bits(eng)


@pytest.fixture(scope="module")
def a8_engine(bundles):
    kernels_or_skip()
    if not cpu_kernels.q8_path():
        pytest.skip("this CPU runs no int4 x int8 path (AVX2 + FMA + F16C)")
    return Engine(bundles["int4-a8"], EngineConfig(max_batch_size=4, compile=True))


@pytest.fixture(scope="module")
def head_a8_engine(bundles):
    kernels_or_skip()
    if not cpu_kernels.q8_path() or not cpu_kernels.int8_q8_available():
        pytest.skip("this CPU runs no int4 x int8 path or no int8 x int8 lm_head kernel")
    return Engine(bundles["int4-a8-head-a8"], EngineConfig(max_batch_size=4, compile=True))


def test_the_stack_call_ends_with_the_final_norm_and_the_int8_input_lm_head(engine, head_a8_engine):
    """The quickstart's formats (int4-a8 layers, an lm_head on int8 input blocks): the fused call
    returns the normed logit rows and the lm_head's logits over them, the bits the lm_head's own
    call gives on those rows; the eager end (a separate norm and lm_head) gives the same model up
    to the norm's rounding. Another lm_head format: the stack returns the normed rows only and
    the forward runs the head."""
    for eng, fmt in ((head_a8_engine, "int8-q8"), (engine, None)):
        model, cache = eng.model, eng.cache
        fused = model.compiled
        assert fused.head_format == fmt
        with torch.inference_mode(), scratch_sequence(cache, 40) as slots:
            model.forward(verify_batch(slots, 0, 30), cache)
            for width in (1, 5):
                batch = verify_batch(slots, 30, width)
                inputs, index = fused.inputs(batch)
                hidden, aux, logits, best = fused.run_final(*inputs, batch.write_slots, cache, index, (),
                                                            batch.logit_rows, model.lm_head.primary)
                assert aux == [] and hidden.shape == (width, model.config.hidden_size)
                if fmt is None:
                    assert logits is None and best is None
                    continue
                assert torch.equal(logits, model.lm_head(hidden, fmt))
                out = model.forward(batch, cache, return_hidden=True)
                assert torch.equal(out.logits, logits) and torch.equal(out.hidden, hidden)
                fused.run_final = None  # the forward's end as separate ops
                try:
                    eager = model.forward(batch, cache, return_hidden=True)
                finally:
                    del fused.run_final
                assert torch.equal(eager.logits.argmax(-1), logits.argmax(-1))
                assert float((eager.hidden - hidden).abs().max()) < 1e-4 * float(hidden.abs().max())
    check_rows_are_the_decode_steps_bits(head_a8_engine)


def test_the_stack_calls_argmax_is_numpys_and_the_step_reads_it(head_a8_engine, monkeypatch):
    """The fused end's argmax of each logit row is params.argmax_rows' (the first maximum; the
    first NaN where the row has one), and StepRunner.pick takes it instead of its own pass:
    the same picks, the same check."""
    from specbuild.engine.step import StepRunner
    from specbuild.sampling.params import argmax_rows

    model, cache = head_a8_engine.model, head_a8_engine.cache
    fused = model.compiled
    with torch.inference_mode(), scratch_sequence(cache, 40) as slots:
        model.forward(verify_batch(slots, 0, 30), cache)
        out = model.forward(verify_batch(slots, 30, 5), cache)
        assert out.argmax is not None and out.argmax.tolist() == argmax_rows(out.logits)[0]
        head = model.lm_head.formats[fused.head_format]
        packed = head.q8_packed
        try:  # column 7's scale NaN (block 0 of 16 columns: K * 16 weight bytes, then 16 float32 scales)
            head.q8_packed = packed.clone()
            k = model.config.hidden_size
            head.q8_packed[k * 16 + 7 * 4:k * 16 + 8 * 4] = torch.tensor([float("nan")]).view(torch.uint8)
            bad = model.forward(verify_batch(slots, 30, 2), cache)
        finally:
            head.q8_packed = packed
        assert bool(torch.isnan(bad.logits[:, 7]).all()) and not bool(torch.isnan(bad.logits[:, :7]).any())
        assert bad.argmax.tolist() == argmax_rows(bad.logits)[0] == [7, 7]
        first_nan = [7, 7]

    class Item:  # the fields pick reads of a WorkItem
        def __init__(self, sid, n_draft):
            self.seq = type("S", (), {"seq_id": sid})()
            self.score, self.score_rows, self.completes, self.n_draft = None, 0, True, n_draft

    group = [Item(0, 2), Item(1, 1)]
    runner = object.__new__(StepRunner)
    for logits, best in ((out.logits, out.argmax), (bad.logits[:1].expand(5, -1), bad.argmax[:1].expand(5))):
        taken = runner.pick(group, logits, best)
        monkeypatch.setattr("specbuild.engine.step.argmax_rows", argmax_rows)
        assert taken == runner.pick(group, logits)
    assert taken == {0: ([first_nan[0]] * 3, False), 1: ([first_nan[0]] * 2, False)}


def test_fused_ends_off_keeps_the_forwards_start_and_end_as_separate_ops(bundles, head_a8_engine, monkeypatch):
    """SPECBUILD_FUSED_ENDS=0 (for comparisons): the stack call takes neither the inputs nor the
    final norm and lm_head; the greedy tokens are the same."""
    monkeypatch.setenv("SPECBUILD_FUSED_ENDS", "0")
    off = Engine(bundles["int4-a8-head-a8"], EngineConfig(max_batch_size=4, compile=True))
    assert isinstance(off.model.compiled, FusedStack) and off.model.compiled.run_final is None
    outs = []
    for eng in (off, head_a8_engine):
        with torch.inference_mode(), scratch_sequence(eng.cache, 40) as slots:
            eng.model.forward(verify_batch(slots, 0, 30), eng.cache)
            outs.append(eng.model.forward(verify_batch(slots, 30, 5), eng.cache))
    assert outs[0].argmax is None and outs[1].argmax is not None
    assert torch.equal(outs[0].logits.argmax(-1), outs[1].argmax)


def test_the_stacks_timers_count_only_while_on(head_a8_engine):
    """cpu_kernels.stack_profile: off by default; on, it gives each part's ms per stack call (the
    linears' above zero) and resets; off again, nothing more is counted."""
    model, cache = head_a8_engine.model, head_a8_engine.cache
    with torch.inference_mode(), scratch_sequence(cache, 40) as slots:
        model.forward(verify_batch(slots, 0, 30), cache)
        assert cpu_kernels.stack_profile(True) == {}  # nothing counted while off
        for _ in range(3):
            model.forward(verify_batch(slots, 30, 2), cache)
        parts = cpu_kernels.stack_profile(False)
        model.forward(verify_batch(slots, 30, 2), cache)
    assert list(parts) == list(cpu_kernels.STACK_PARTS)
    assert all(parts[k] > 0 for k in ("qkv linear", "o linear", "gate_up linear", "down linear", "attention"))
    assert cpu_kernels.stack_profile(False) == {}


def test_the_prelude_is_the_forwards_own_inputs(engine):
    """stack_prelude (one C++ call) gives Decoder.stack_inputs' embedding and rope rows and
    Attend's rows_attention index, bit for bit, for a prompt chunk (masked), a decode row and a
    verify pass."""
    model, cache = engine.model, engine.cache
    assert model.compiled.embed is not None
    with torch.inference_mode(), scratch_sequence(cache, 48) as slots:
        for context, width in ((0, 30), (30, 1), (30, 5)):
            batch = verify_batch(slots, context, width)
            (x, cos_u, sin_u), index = model.compiled.inputs(batch)
            want = model.stack_inputs(batch)
            assert torch.equal(x, want[0]) and torch.equal(cos_u, want[1]) and torch.equal(sin_u, want[2])
            assert torch.equal(index, Attend(model, batch, width).index)
            model.forward(batch, cache)


def test_int4_a8_bundles_take_the_fused_stack_with_the_int8_input_kernel(a8_engine):
    model = a8_engine.model
    assert isinstance(model.compiled, FusedStack) and model.fused_why is None
    assert model.compiled.kind == "int4-a8" and model.compiled.meta[6] == cpu_kernels.q8_path()
    check_fused_is_the_eager_model(a8_engine)


@pytest.mark.parametrize("path", sorted(cpu_kernels.Q8_PATHS))
def test_int4_a8_fused_rows_are_the_decode_steps_bits_on_every_path(bundles, a8_engine, path):
    """Each int4 x int8 path this CPU runs, held for the whole stack: every row of a w-row
    pass is the one-row step's bits, and every path gives the same bits (the same integers and
    the same float epilogue)."""
    if path not in cpu_kernels.q8_paths():
        pytest.skip(f"this CPU cannot run int4 x int8 path {cpu_kernels.Q8_PATHS[path]}")
    fused = a8_engine.model.compiled
    meta = list(fused.meta)
    try:
        fused.meta = meta[:6] + [path] + meta[7:]
        check_rows_are_the_decode_steps_bits(a8_engine)
        with torch.inference_mode(), scratch_sequence(a8_engine.cache, 24) as slots:
            batch = verify_batch(slots, 0, 11)
            got = a8_engine.model.forward(batch, a8_engine.cache).logits
            fused.meta = meta
            want = a8_engine.model.forward(batch, a8_engine.cache).logits
        assert torch.equal(got, want), path
    finally:
        fused.meta = meta


def test_weight_arena_copies_in_order_aligned_in_one_block():
    """model/arena.py: each copy equal to its original, 64-byte aligned, in the given order,
    none overlapping, all inside one block (an anonymous mapping where the platform has one)."""
    from specbuild.model.arena import weight_arena

    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(-128, 127, (n,), dtype=torch.int8, generator=g) for n in (1000, 3, 64, 5000)]
    tensors += [torch.randn(7, 9, generator=g), torch.randint(0, 255, (33, 2), dtype=torch.uint8, generator=g)]
    block, views = weight_arena(tensors)
    lo = views[0].data_ptr()
    ends = []
    for t, v in zip(tensors, views):
        assert torch.equal(t, v) and v.dtype == t.dtype and v.shape == t.shape and v.is_contiguous()
        assert v.data_ptr() % 64 == 0 and v.data_ptr() != t.data_ptr()
        ends.append((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()))
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # in order, apart
    assert ends[-1][1] - lo <= sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)
    if hasattr(mmap, "MAP_PRIVATE"):
        assert isinstance(block, mmap.mmap) and lo % (2 << 20) == 0  # on a huge page's boundary
    del block  # the views keep it alive
    assert torch.equal(views[3], tensors[3])


@pytest.mark.parametrize("which", ["int4", "int4-a8"])
def test_the_fused_stacks_packed_weights_and_the_lm_heads_live_in_its_arena(engine, a8_engine, which):
    """Every linear of the fused stack and the lm_head's packed rows read the arena's copies
    (the originals are freed), and the stack still computes the eager model (the same bytes)."""
    eng = engine if which == "int4" else a8_engine
    model = eng.model
    fused = model.compiled
    base = fused.weights[1].data_ptr()  # (weights[0] is layer 0's norm, in the arena too)
    lo = min(t.data_ptr() for t in fused.weights if t.numel())
    size = len(fused.arena) if isinstance(fused.arena, mmap.mmap) else fused.arena.numel()
    hi = lo + size

    def inside(t):
        return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi

    assert base >= lo
    for i in range(model.config.num_layers):
        for name in ("qkv", "o", "gate_up", "down"):
            impl = model.w[f"layers.{i}.{name}"].formats[fused.kind]
            assert inside(impl.cpu_packed) and any(impl.cpu_packed is t for t in fused.weights)
    heads = [getattr(impl, a) for impl in model.lm_head.formats.values() for a in ("cpu_packed", "q8_packed")
             if getattr(impl, a, None) is not None]
    assert heads and all(inside(t) for t in heads)
    check_fused_is_the_eager_model(eng)


def check_fused_is_the_eager_model(engine) -> None:
    model, cache = engine.model, engine.cache
    fused = model.compiled
    with torch.inference_mode(), scratch_sequence(cache, 40) as slots:
        model.forward(verify_batch(slots, 0, 30), cache)  # fills the scratch cache through the fused stack
        for width in (1, 5):
            batch = verify_batch(slots, 30, width)
            a = model.forward(batch, cache).logits
            model.compiled = None
            try:
                b = model.forward(batch, cache).logits
            finally:
                model.compiled = fused
            assert a.shape == b.shape == (width, model.config.vocab_size)
            assert torch.equal(a.argmax(-1), b.argmax(-1)), width
            assert float((a - b).abs().max()) < 2e-2 * float(b.abs().max()), width


def check_rows_are_the_decode_steps_bits(engine) -> None:
    model, cache = engine.model, engine.cache
    with torch.inference_mode(), scratch_sequence(cache, 48) as slots:
        model.forward(verify_batch(slots, 0, 20), cache)
        alone, kv = [], []
        for i in range(9):  # token 100 + i at position 20 + i, one step at a time
            b = verify_batch(slots, 20 + i, 1, token=100 + i)
            alone.append(model.forward(b, cache).logits[0])
            kv.append((cache.k[0][slots[20 + i]].clone(), cache.v[-1][slots[20 + i]].clone()))
        for width in range(1, 10):
            for start in (0, 9 - width):
                batch = verify_batch(slots, 20 + start, width, token=100 + start)
                out = model.forward(batch, cache).logits
                for r in range(width):
                    assert torch.equal(out[r], alone[start + r]), (width, start, r)
                    k, v = kv[start + r]
                    assert torch.equal(cache.k[0][slots[20 + start + r]], k)
                    assert torch.equal(cache.v[-1][slots[20 + start + r]], v)


def test_both_cache_layouts_give_the_fused_stack_the_same_bits(bundles, a8_engine, monkeypatch):
    """The default head-major KV cache and SPECBUILD_KV_LAYOUT=slot's contiguous one: the same
    logits bit for bit over a prefill and a few decode rows, and the same K/V in every layer."""
    monkeypatch.setenv("SPECBUILD_KV_LAYOUT", "slot")
    slot = Engine(bundles["int4-a8"], EngineConfig(max_batch_size=1, compile=True))
    assert slot.cache.layout == "slot" and a8_engine.cache.layout == "head"
    assert slot.cache.k[0].is_contiguous() and not a8_engine.cache.k[0].is_contiguous()
    got = []
    for eng in (a8_engine, slot):
        model, cache = eng.model, eng.cache
        with torch.inference_mode(), scratch_sequence(cache, 40) as slots:
            logits = [model.forward(verify_batch(slots, 0, 30), cache).logits]
            for i in range(4):
                logits.append(model.forward(verify_batch(slots, 30 + i, 1, token=50 + i), cache).logits)
            logits.append(model.forward(verify_batch(slots, 34, 5, token=9), cache).logits)
            kv = [torch.stack([c[slots[:39]] for c in cache.k]), torch.stack([c[slots[:39]] for c in cache.v])]
        got.append((logits, kv))
    (la, kva), (lb, kvb) = got
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert torch.equal(kva[0], kvb[0]) and torch.equal(kva[1], kvb[1]) and kva[0].abs().sum() > 0


def test_fused_aux_layers_are_the_residuals_entering_them(engine):
    model, cache = engine.model, engine.cache
    fused = model.compiled
    with torch.inference_mode(), scratch_sequence(cache, 16) as slots:
        batch = verify_batch(slots, 0, 12)
        x, cos_u, sin_u = model.stack_inputs(batch)
        at = Attend(model, batch, 12)
        out, aux = fused.run(x, cos_u, sin_u, batch.write_slots, cache, None, at, (2, 0, 2))
        assert len(aux) == 2 and torch.equal(aux[0], x)  # layer 0's input is the embedding itself
        # the stack up to layer 2, run again as a 2-layer stack over the same cache, gives aux[1]
        part = FusedStack.__new__(FusedStack)
        part.weights, part.eps, part.scale = fused.weights[:2 * 7], fused.eps, fused.scale
        part.meta = fused.meta[:STACK_DIMS] + fused.meta[STACK_DIMS:STACK_DIMS + 2 * 8]

        class TwoLayers:  # the cache's first two layers
            k, v = cache.k[:2], cache.v[:2]

        two, _ = part.run(x, cos_u, sin_u, batch.write_slots, TwoLayers, None, at, ())
        assert torch.equal(two, aux[1])
        assert out.shape == x.shape and not torch.equal(out, aux[1])


def test_bad_inputs_name_the_value(engine):
    model, cache = engine.model, engine.cache
    fused = model.compiled
    op = torch.ops.specbuild_cpu.int4_stack
    with torch.inference_mode(), scratch_sequence(cache, 8) as slots:
        batch = verify_batch(slots, 0, 2)
        x, cos_u, sin_u = model.stack_inputs(batch)
        index = Attend(model, batch, 2).index
        args = [x, cos_u, sin_u, batch.write_slots, cache.k, cache.v, index, fused.weights, fused.meta,
                fused.scale, fused.eps, []]
        with pytest.raises(RuntimeError, match="meta entries"):
            op(*args[:8], fused.meta[:-1], *args[9:])
        with pytest.raises(RuntimeError, match="needs .* packed bytes"):
            w = list(fused.weights)
            w[1] = w[1][:-16].clone()
            op(*args[:7], w, *args[8:])
        with pytest.raises(RuntimeError, match="write slot 99999 outside"):
            op(*args[:3], torch.tensor([0, 99999]), *args[4:])
        with pytest.raises(RuntimeError, match="aux layer 7 outside"):
            op(*args[:11], [7])
        with pytest.raises(RuntimeError, match="x must be float32"):
            op(x.bfloat16(), *args[1:])
        with pytest.raises(RuntimeError, match="slot-major or head-major"):  # a layer's caches in another layout
            op(*args[:4], [cache.k[0]] + [c.contiguous() for c in cache.k[1:]], cache.v, *args[6:])
        with pytest.raises(RuntimeError, match="logit row 2 outside the 2 rows"):
            op(*args, final_norm=fused.final_norm, logit_rows=torch.tensor([0, 2]))
        with pytest.raises(RuntimeError, match="come together"):
            op(*args, final_norm=fused.final_norm)
        with pytest.raises(RuntimeError, match="final_norm must be float32"):
            op(*args, final_norm=fused.final_norm[:-8], logit_rows=torch.tensor([1]))
        prelude = torch.ops.specbuild_cpu.stack_prelude
        table, scales = fused.embed
        with pytest.raises(RuntimeError, match="token id 99999 outside the vocabulary"):
            prelude(torch.tensor([1, 99999]), table, scales, batch.positions, model.cos, model.sin_signed,
                    batch.read_slots, batch.mask)
        with pytest.raises(RuntimeError, match="mask must be bool"):
            prelude(batch.input_ids, table, scales, batch.positions, model.cos, model.sin_signed,
                    batch.read_slots, torch.ones(2, 1, dtype=torch.bool))


def test_a_mixed_batch_gives_each_sequence_its_own_bits(engine):
    """A prefill chunk of one sequence beside the decode row of another: each gets what it
    gets alone (nothing crosses rows in the glue either)."""
    model, cache = engine.model, engine.cache
    with torch.inference_mode(), scratch_sequence(cache, 24) as a, scratch_sequence(cache, 24) as b:
        model.forward(verify_batch(b, 0, 10), cache)
        alone_b = model.forward(verify_batch(b, 10, 1, token=7), cache).logits[0]
        pa = verify_batch(a, 0, 6)
        alone_a = model.forward(pa, cache).logits[-1]
        mask = torch.zeros(7, 17, dtype=torch.bool)
        mask[:6, :6] = torch.ones(6, 6, dtype=torch.bool).tril()
        mask[6, 6:] = True
        both = ForwardBatch(torch.cat([pa.input_ids, torch.tensor([7])]), torch.cat([pa.positions, torch.tensor([10])]),
                            torch.cat([a[:6], b[10:11]]), torch.cat([a[:6], b[:11]]), mask, torch.tensor([5, 6]))
        out = model.forward(both, cache).logits
        assert torch.equal(out[0], alone_a) and torch.equal(out[1], alone_b)


def test_the_thread_governor_changes_the_count_but_never_a_token(engine):
    """The engine runs its steps under a ThreadGovernor where the thread count cannot change a
    result: driven here by a fake machine that reports a neighbour's load and makes one thread
    the faster, the count changes mid-request (the trial alternates, then one thread holds) and
    plain and speculative greedy outputs are the tokens of the fixed-count engine."""
    from specbuild.engine.sequence import Request
    from specbuild.model import threads as T
    from specbuild.sampling.params import SamplingParams
    from specbuild.speculation.config import SpeculationConfig

    assert engine.threads_governor is not None or torch.get_num_threads() < 2, engine.threads_why
    prompts = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10], [20, 21, 22, 20, 21, 22, 20], list(range(30, 70))]

    def run(method):
        reqs = [Request(prompt_ids=p, speculation=SpeculationConfig.make(None, method=method, gamma=4),
                        sampling=SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts]
        return engine.generate(reqs)

    saved, threads = engine.threads_governor, torch.get_num_threads()
    try:
        engine.threads_governor = None
        want = {m: [r["token_ids"] for r in run(m)] for m in ("none", "ngram")}
        clock = {"now": 0.0, "busy": 0.0}

        def reader():  # 1.5 cores of others' use, whatever we do (own CPU reads 0)
            total = int(clock["now"] * 200)
            return {0: (total - int(clock["busy"]), total), 1: (total, total)}

        def set_threads(n):
            torch.set_num_threads(n)

        gov = T.ThreadGovernor(2, cpus=[0, 1], clock=lambda: clock["now"], reader=reader, own_cpu=lambda: 0.0,
                               set_threads=set_threads, tick_s=0.01)
        real_after = gov.after

        def after(seconds, shape=None):  # one thread is the faster, and fake time moves on
            clock["now"] += 0.05
            clock["busy"] += 1.5 * 0.05 * 100
            real_after(0.01 if gov.threads == 1 else 0.03, shape)

        gov.after = after
        engine.threads_governor = gov
        for method in ("none", "ngram"):
            out = run(method)
            assert [r["token_ids"] for r in out] == want[method], method
            if method == "ngram":
                assert sum(r["stats"]["drafted"] for r in out) > 0 and sum(r["stats"]["accepted"] for r in out) > 0
        assert gov.trials >= 1 and gov.changes >= 2 and gov.threads == 1, gov.describe()
        assert engine.stats()["threads"]["adaptive"] is True
    finally:
        engine.threads_governor = saved
        torch.set_num_threads(threads)


def test_no_governor_where_the_thread_count_could_change_a_result(bundles, monkeypatch):
    """float32 layers run torch's kernels, whose sums may split by thread count: the count stays
    fixed, and stats() says why; SPECBUILD_ADAPT_THREADS=0 and adapt_threads=False turn it off."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to adapt")
    other = Engine(bundles["float32"], EngineConfig(max_batch_size=1))
    assert other.threads_governor is None and "quantized kernels" in other.threads_why
    threads = dict(other.stats()["threads"])
    pool = threads.pop("kernels_pool", None)  # the kernels' pool's counters, where the kernels loaded
    assert threads == {"threads": torch.get_num_threads(), "adaptive": False, "why": other.threads_why}
    assert pool is None or {"jobs", "waits", "helpers"} <= set(pool)
    kernels_or_skip()
    assert Engine(bundles["int4"], EngineConfig(max_batch_size=1, adapt_threads=False)).threads_why == "adapt_threads=False"
    monkeypatch.setenv("SPECBUILD_ADAPT_THREADS", "0")
    assert Engine(bundles["int4"], EngineConfig(max_batch_size=1)).threads_governor is None


@pytest.mark.parametrize("which", ["int4", "int4-a8"])
def test_on_the_kernels_pool_the_rows_keep_the_decode_steps_bits(engine, a8_engine, which):
    """The fused stack with every kernel loop on the kernels' own pool (SPECBUILD_POOL=1, as under
    others' load): each row of a w-row pass is the one-row step's bits, and a verify pass gives
    OpenMP's bits."""
    eng = engine if which == "int4" else a8_engine
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode(), scratch_sequence(eng.cache, 24) as slots:
            batch = verify_batch(slots, 0, 11)
            cpu_kernels.pool_config(mode=0)
            want = eng.model.forward(batch, eng.cache).logits
            cpu_kernels.pool_config(mode=1)
            jobs = cpu_kernels.pool_stats()["jobs"]
            got = eng.model.forward(batch, eng.cache).logits
            assert cpu_kernels.pool_stats()["jobs"] > jobs  # the stack's loops ran on the pool
        assert torch.equal(got, want)
        check_rows_are_the_decode_steps_bits(eng)
    finally:
        cpu_kernels.pool_config(mode=cpu_kernels.pool_mode())
        torch.set_num_threads(saved)


def test_the_threading_is_decided_in_the_thread_that_then_runs_the_steps(bundles):
    """Issue 50: the kernels' threading (pool, OpenMP, one thread) is timed in the thread that
    runs the steps: the caller's under generate, the engine loop's own thread when it serves; not
    at load, not at import. Every candidate is timed, and the outputs are the same tokens."""
    import threading

    from specbuild.engine.sequence import Request
    from specbuild.model import threads as T
    from specbuild.sampling.params import SamplingParams

    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to choose")
    kernels_or_skip()
    saved = torch.get_num_threads()
    req = lambda: Request(prompt_ids=[5, 6, 7, 8, 9, 10], sampling=SamplingParams(max_tokens=12, ignore_eos=True))  # noqa: E731
    try:
        caller = Engine(bundles["int4"], EngineConfig(max_batch_size=2, compile=True))
        gov = caller.threads_governor
        assert gov is not None and gov.decided is None, caller.threads_why  # nothing decided at load
        want = caller.generate([req()])[0]["token_ids"]
        d = gov.decided
        assert d["thread_ident"] == threading.get_ident() == caller.step_thread
        labels = {T.choice_label(c) for c in gov.choices}
        n = gov.max_threads
        assert set(d["ms"]) == labels == {T.choice_label(("pool", n)), T.choice_label(("openmp", n)), "1 thread"}
        assert all(v > 0 for v in d["ms"].values()) and d["choice"] in labels
        assert caller.stats()["threads"]["decided"] == d
        assert torch.get_num_threads() == saved  # generate gives the caller's thread count back
        caller.start()  # the same engine's steps moved to its loop thread: decided again, there
        try:
            assert caller.submit(req()).result()["token_ids"] == want
        finally:
            caller.stop()
        assert gov.decided["thread"] == "specbuild-engine" and gov.decided["thread_ident"] == caller.step_thread

        torch.set_num_threads(saved)  # the choice may have been one thread, in this thread
        served = Engine(bundles["int4"], EngineConfig(max_batch_size=2, compile=True))
        served.start()
        try:
            got = served.submit(req()).result()["token_ids"]
        finally:
            served.stop()
        assert served.threads_governor is not None, served.threads_why
        d = served.threads_governor.decided
        assert d["thread"] == "specbuild-engine" and d["thread_ident"] == served.step_thread != threading.get_ident()
        assert got == want
    finally:
        torch.set_num_threads(saved)
        from specbuild.model import cpu_kernels

        cpu_kernels.pool_config(mode=cpu_kernels.pool_mode())


def test_generate_decides_the_threading_before_its_first_request(bundles, monkeypatch):
    """`specbuild generate` times the threading in its own thread before it submits anything:
    timed at the first step instead, the candidates' forwards counted in the first request's
    time to first token (420-445 ms against 30-35 ms on a 40-token prompt)."""
    import threading

    from click.testing import CliRunner

    from specbuild.cli.main import main

    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to choose")
    kernels_or_skip()
    saved = torch.get_num_threads()
    at_submit = []
    own = Engine.submit

    def submit(self, request):
        d = self.threads_governor.decided if self.threads_governor is not None else None
        at_submit.append(None if d is None else d["thread_ident"])
        return own(self, request)

    monkeypatch.setattr(Engine, "submit", submit)
    try:
        r = CliRunner().invoke(main, ["generate", bundles["int4"], "--compile", "--max-tokens", "4",
                                      "--ignore-eos", "--prompt", "hello there"])
    finally:
        torch.set_num_threads(saved)
        cpu_kernels.pool_config(mode=cpu_kernels.pool_mode())
    assert r.exit_code == 0, r.output
    assert at_submit == [threading.get_ident()], at_submit


def test_an_int4_a8_engine_keeps_its_kv_in_float16_and_stays_lossless(bundles, a8_engine):
    """kv_cache_dtype auto: the fused stack on an int4-a8 bundle keeps K/V in float16 (half the
    bytes), writing each value rounded from the float32 one; float32 keeps float32; without the
    fused stack auto keeps float32 and float16 is refused with the reason. The float16 engine's
    rows stay the decode step's bits (the lossless contract, checked above on this engine too),
    and greedy speculation equals plain decoding with drafts accepted."""
    from specbuild.engine.sequence import Request
    from specbuild.errors import BundleError
    from specbuild.sampling.params import SamplingParams
    from specbuild.speculation.config import SpeculationConfig

    assert a8_engine.kv_dtype == torch.float16 and a8_engine.cache.k[0].dtype == torch.float16
    full = Engine(bundles["int4-a8"], EngineConfig(max_batch_size=1, compile=True, kv_cache_dtype="float32"))
    assert full.kv_dtype == torch.float32 and full.cache.k[0].dtype == torch.float32
    eager = Engine(bundles["int4-a8"], EngineConfig(max_batch_size=1))
    assert eager.kv_dtype == torch.float32 and "auto" in eager.kv_why
    with pytest.raises(BundleError, match="kv_cache_dtype=float16 needs the fused int4 layer stack.*--compile"):
        Engine(bundles["int4-a8"], EngineConfig(max_batch_size=1, kv_cache_dtype="float16"))
    with pytest.raises(ValueError, match="kv_cache_dtype='bf16' is not one of auto, float32, float16"):
        EngineConfig(kv_cache_dtype="bf16")
    # the same rows written through both: layer 0's float16 K/V (computed before any attention
    # reads the cache) are its float32 ones rounded
    written = []
    with torch.inference_mode():
        for eng in (a8_engine, full):
            with scratch_sequence(eng.cache, 32) as slots:
                eng.model.forward(verify_batch(slots, 0, 30, token=40), eng.cache)
                written.append((eng.cache.k[0][slots[:30]].clone(), eng.cache.v[0][slots[:30]].clone()))
    (k16, v16), (k32, v32) = written
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())
    prompt = list(range(40, 70))
    check_rows_are_the_decode_steps_bits(a8_engine)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [prompt, [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]]
    plain = a8_engine.generate([Request(prompt_ids=p, sampling=params, speculation=SpeculationConfig.make(
        None, method="none")) for p in prompts])
    spec = a8_engine.generate([Request(prompt_ids=p, sampling=params, speculation=SpeculationConfig.make(
        None, method="ngram", gamma=3)) for p in prompts])
    assert [o["token_ids"] for o in spec] == [o["token_ids"] for o in plain]
    assert sum(o["stats"]["drafted"] for o in spec) > 0 and sum(o["stats"]["accepted"] for o in spec) > 0
