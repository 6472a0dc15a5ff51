"""The compiled layer stack (EngineConfig.compile, model/compiled.py): every row of a compiled
pass has the bits of the compiled decode step, greedy speculation equals plain decoding,
and nothing recompiles or compiles inside a request.

Each bundle compiles its graphs once (a minute or more cold on 2 cores, inductor's disk cache
after that), so the engines are module fixtures."""

from __future__ import annotations

import pytest
import torch

from specbuild.compiler.compile import CompileOptions, compile_bundle
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.model.decoder import ForwardBatch
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig
from tiny import make_tiny_hf, perturbed_copy

FORMATS = {
    # float32 hidden states, int4 weights with bfloat16 activations: row-invariant per-row attention
    "int4": {"dtype": "float32", "quantize": "int4", "lm_head_format": "int8"},
    # bfloat16 throughout: the batched invariant attention and the linears' row policy
    "bfloat16": {"dtype": "bfloat16"},
    "float32": {"dtype": "float32"},
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10], [20, 21, 22, 20, 21, 22, 20], list(range(30, 70))]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    target = make_tiny_hf(str(root / "target"), scale=4.0, seed=3)
    draft = perturbed_copy(target, str(root / "draft"), noise=0.08)
    out = {}
    for name, opts in FORMATS.items():
        bundle = compile_bundle(target, str(root / name), CompileOptions(max_draft_len=8, **opts), draft=draft)
        out[name] = Engine(bundle, EngineConfig(max_batch_size=4, compile=True))
    return out


def prefill(engine, seq_id: int, ids: torch.Tensor, n: int, total: int) -> None:
    cache = engine.cache
    cache.add(seq_id)
    cache.reserve(seq_id, total)
    s = cache.slots(seq_id, 0, n)
    engine.model.forward(ForwardBatch(ids[:n], torch.arange(n), s, s, torch.ones(n, n, dtype=torch.bool).tril(),
                                      torch.tensor([n - 1])), cache)


@pytest.mark.parametrize("p", [21, 300])  # 300 keys: the one-row step reads a cache view through the op
@pytest.mark.parametrize("name", list(FORMATS))
def test_compiled_rows_equal_the_compiled_decode_step(engines, name, p):
    """A chain verify pass of W rows, alone and beside another sequence's rows, gives each row
    exactly the logits that decoding those tokens one by one gives (the contract that keeps
    greedy speculation equal to plain decoding)."""
    engine = engines[name]
    model, cache = engine.model, engine.cache
    assert model.compiled is not None
    torch.manual_seed(0)
    ids = torch.randint(1, 300, (p + 20,))
    w = 6
    prefill(engine, 901, ids, p, p + w)
    steps = []
    for j in range(w):
        s = cache.slots(901, 0, p + j + 1)
        steps.append(model.forward(ForwardBatch(ids[p + j:p + j + 1], torch.tensor([p + j]), s[-1:], s, None,
                                                torch.tensor([0])), cache).logits[0])
    # the same window in one pass; then again beside a 3-row prefill chunk of another sequence
    for partner in (False, True):
        sid = 902 + 2 * partner
        prefill(engine, sid, ids, p, p + w)
        s = cache.slots(sid, 0, p + w)
        mask = torch.zeros(w, p + w, dtype=torch.bool)
        mask[:, :p] = True
        mask[:, p:] = torch.ones(w, w, dtype=torch.bool).tril()
        batch = ForwardBatch(ids[p:p + w], torch.arange(p, p + w), s[p:], s, mask, torch.arange(w))
        if partner:
            other = 903 + 2 * partner
            cache.add(other)
            cache.reserve(other, 3)
            o = cache.slots(other, 0, 3)
            big = torch.zeros(w + 3, p + w + 3, dtype=torch.bool)
            big[:w, :p + w] = mask
            big[w:, p + w:] = torch.ones(3, 3, dtype=torch.bool).tril()
            batch = ForwardBatch(torch.cat([ids[p:p + w], ids[:3]]), torch.cat([torch.arange(p, p + w), torch.arange(3)]),
                                 torch.cat([s[p:], o]), torch.cat([s, o]), big, torch.arange(w))
        rows = model.forward(batch, cache).logits
        for j in range(w):
            if model.row_invariant:  # rounded activations: bit for bit, as in eager mode
                assert torch.equal(rows[j], steps[j]), (name, partner, j, (rows[j] - steps[j]).abs().max().item())
            else:  # float32 throughout runs plain batched SDPA (eager too): ~1e-6, not bits
                assert torch.allclose(rows[j], steps[j], atol=1e-4), (name, partner, j)
    for sid in list(cache.seqs):
        cache.release(sid)


def generate(engine, method: str, prompts=PROMPTS, max_tokens: int = 24):
    reqs = [Request(prompt_ids=p, speculation=SpeculationConfig.make(None, method=method, gamma=4),
                    sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    return engine.generate(reqs)


@pytest.mark.parametrize("name", list(FORMATS))
def test_compiled_greedy_speculation_equals_plain_decoding(engines, name):
    from torch._dynamo.utils import counters

    engine = engines[name]
    plain = [r["token_ids"] for r in generate(engine, "none")]
    graphs = counters["stats"]["unique_graphs"]
    for method in ("draft", "ngram"):
        out = generate(engine, method)
        assert [r["token_ids"] for r in out] == plain, (name, method)
        assert sum(r["stats"]["drafted"] for r in out) > 0 and sum(r["stats"]["accepted"] for r in out) > 0, method
    # every graph was compiled at load (timing.warm_up_compiled): none inside these requests
    assert counters["stats"]["unique_graphs"] == graphs
    assert engine.cache.free_blocks == engine.cache.num_blocks


def test_compiled_and_eager_agree_closely(engines):
    """The compiled stack computes the same model: its greedy tokens match the eager engine's
    on the float32 bundle (fused glue may round differently in the last bit, so this is a
    token comparison on a tiny model, not a bit-equality claim)."""
    engine = engines["float32"]
    eager = Engine(engine.bundle_dir, EngineConfig(max_batch_size=4))
    assert eager.model.compiled is None
    a = [r["token_ids"] for r in generate(engine, "none")]
    b = [r["token_ids"] for r in generate(eager, "none")]
    assert a == b


def test_stack_rows_takes_every_layer_policy():
    from specbuild.model.compiled import stack_rows

    assert stack_rows({}) == (1, 1 << 30)
    assert stack_rows({"lm_head": (4, 8), "layers.0.qkv": (2, 64), "layers.1.down": (1, 32)}) == (2, 32)
    with pytest.raises(ValueError, match="2 to 1 rows"):
        stack_rows({"layers.0.qkv": (2, 64), "layers.0.o": (1, 1)})


def test_compile_flag_in_the_cli_help():
    from click.testing import CliRunner

    from specbuild.cli.main import main

    for cmd in ("generate", "serve", "bench", "verify"):
        out = CliRunner().invoke(main, [cmd, "--help"])
        assert out.exit_code == 0 and "--compile" in out.output, cmd



def test_compile_is_refused_off_cpu():
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(device="cuda", compile=True)


def test_a_failed_compile_is_one_clear_error(engines, monkeypatch):
    import specbuild.model.compiled as compiled
    from specbuild.errors import BundleError

    def broken(self):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(compiled.CompiledStack, "__init__", broken)
    with pytest.raises(BundleError, match="needs a C\\+\\+ compiler.*without --compile"):
        Engine(engines["float32"].bundle_dir, EngineConfig(max_batch_size=1, compile=True))


@pytest.mark.parametrize("compiled,kernel", [(False, True), (False, False), (True, True)])
def test_prompt_rows_are_invariant_to_chunking_and_neighbours(engines, compiled, kernel):
    """int4 (float32 hidden states, bfloat16 kernel inputs) takes prompt rows through the C++
    rows kernel (decoder.Attend's index; kernel=False: the batched fallback, prompt_plan): a
    prompt's K/V and last logits are the same bits in one chunk, in chunks of 7, and beside
    another sequence's decode row."""
    engine = engines["int4"] if compiled else Engine(engines["int4"].bundle_dir, EngineConfig(max_batch_size=4))
    model, cache = engine.model, engine.cache
    assert model.row_invariant and model.dtype == torch.float32
    if not kernel:
        model.rows_attention = False  # this eager engine's own model: the fallback path
    assert model.rows_attention == kernel, "the C++ kernel is built here, so the int4 bundle runs it"
    torch.manual_seed(1)
    n = 40
    ids = torch.randint(1, 300, (n,))

    def run(seq_id, chunk, partner=False):
        cache.add(seq_id)
        cache.reserve(seq_id, n)
        slots = cache.slots(seq_id, 0, n)
        last = None
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            m = torch.zeros(b - a, b, dtype=torch.bool)
            m[:, :a] = True
            m[:, a:] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
            batch = ForwardBatch(ids[a:b], torch.arange(a, b), slots[a:b], slots[:b], m, torch.tensor([b - a - 1]),
                                 torch.ones(b - a, dtype=torch.bool))
            if partner:  # one decode row of another sequence (3 cached tokens) in the same forward
                cache.add(seq_id + 1)
                cache.reserve(seq_id + 1, 4)
                o = cache.slots(seq_id + 1, 0, 4)
                big = torch.zeros(b - a + 1, b + 4, dtype=torch.bool)
                big[:b - a, :b] = m
                big[b - a, b:] = True
                batch = ForwardBatch(torch.cat([ids[a:b], ids[:1]]), torch.cat([torch.arange(a, b), torch.tensor([3])]),
                                     torch.cat([slots[a:b], o[3:]]), torch.cat([slots[:b], o]), big,
                                     torch.tensor([b - a - 1]), torch.cat([torch.ones(b - a, dtype=torch.bool),
                                                                           torch.zeros(1, dtype=torch.bool)]))
            last = model.forward(batch, cache).logits[0]
        return cache.rows(slots), last

    from specbuild.model.decoder import Attend

    probe = ForwardBatch(ids[:3], torch.arange(3), torch.arange(3), torch.arange(3),
                         torch.ones(3, 3, dtype=torch.bool).tril(), torch.tensor([2]), torch.ones(3, dtype=torch.bool))
    a = Attend(model, probe, 3)
    if kernel:  # one C++ call per layer for all rows: index = offsets, then each row's slots
        assert a.prompt_plan is None and a.index.tolist() == [0, 1, 3, 6, 0, 0, 1, 0, 1, 2]
    else:
        assert a.prompt_plan is not None  # the batched path, not one SDPA call per row
    (k1, v1), l1 = run(801, n)
    (k2, v2), l2 = run(803, 7)
    (k3, v3), l3 = run(805, n, partner=True)
    assert torch.equal(k1, k2) and torch.equal(v1, v2) and torch.equal(l1, l2)
    assert torch.equal(k1, k3) and torch.equal(v1, v3) and torch.equal(l1, l3)
    for sid in list(cache.seqs):
        cache.release(sid)


def test_compiled_graphs_run_through_a_cpp_wrapper(engines):
    """Every graph a compiling engine calls directly was built with inductor's C++ wrapper
    (compiled.INDUCTOR_OPTIONS: no Python between the ~150 kernels of a decode step)."""
    from specbuild.model.compiled import INDUCTOR_OPTIONS

    assert INDUCTOR_OPTIONS.get("cpp_wrapper") is True
    for name, engine in engines.items():
        stack = engine.model.compiled
        if name == "int4":  # int4 layers on specbuild's kernels: the fused C++ stack, no inductor graph
            assert type(stack).__name__ == "FusedStack" and engine.model.fused_why is None
            continue
        assert stack.options == INDUCTOR_OPTIONS, name
        graphs = [d for d in stack.direct.values() if d is not None]
        # the one-row step and the verify graph (one graph for both where attention is never inline)
        assert len(graphs) == (2 if name != "bfloat16" else 1), (name, list(stack.direct))
        for d in graphs:
            assert "cpp_wrapper_src" in d.compiled.source_code, name


def test_the_cpp_wrapper_changes_no_bits(engines):
    """The same graphs with inductor's Python wrapper (CompiledStack options) give the C++
    wrapper's logits bit for bit, decode step and verify pass: the wrapper only calls the
    kernels, it computes nothing."""
    from specbuild.model.compiled import CompiledStack
    from specbuild.model.timing import scratch_sequence, verify_batch

    engine = engines["int4"]
    model, cache = engine.model, engine.cache
    fused = model.compiled  # this engine runs the fused C++ stack; the inductor stacks are built here
    cpp = CompiledStack(model)
    python = CompiledStack(model, {"cpp_wrapper": False})
    try:
        with torch.inference_mode(), scratch_sequence(cache, 24) as slots:
            for width in (1, 4):
                batch = verify_batch(slots, 20, width)
                model.compiled = cpp
                a = model.forward(batch, cache).logits
                model.compiled = python
                b = model.forward(batch, cache).logits
                assert torch.equal(a, b), (width, (a - b).abs().max().item())
        graphs = [d for d in python.direct.values() if d is not None]
        assert len(graphs) == 2 and all("cpp_wrapper_src" not in d.compiled.source_code for d in graphs)
    finally:
        model.compiled = fused
