"""The request-level backend contract, parametrised over backends.

    torch              specbuild's own engine (runs everywhere)
    tensorrt-llm-api-stub  TrtllmApiEngine (the LLM-API adapter, TensorRT-LLM 1.x) on a stand-in
                       for the LLM API (tests/helpers/trtllm_api_stub.py), specbuild's prompt
                       lookup drafting through UserProvidedDecodingConfig
    tensorrt-llm-stub  TrtllmEngine (the real adapter code) driving a stand-in for
                       `tensorrt_llm.bindings.executor` (tests/helpers/trtllm_stub.py): greedy only, its tokens
                       from the torch engine, its request/response shapes those of the
                       documented executor API. It checks the adapter's logic (draft rounds,
                       streaming, stats, abort, limits, leader mode), NOT TensorRT-LLM.
    tensorrt-llm       real engines (marked tensorrt_llm + gpu; skipped here with the reason)

Every backend must: stream events whose tokens and text add up to the result; give greedy
output equal to plain greedy decoding whatever the method (and propose and accept drafts
when speculating); batch without changing greedy output; abort; refuse bad input at submit
with nothing queued; refuse draft lengths over the limit; report the same stats keys.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import types

import pytest
import torch
from tiny import make_tiny_hf

from specbuild.errors import RequestError, SpecbuildError
from specbuild.backends.select import STATS_KEYS, Backend, guarantees, open_engine, resolve_backend
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.sampling.params import SamplingParams
from specbuild.engine.sequence import Request
from specbuild.backends.tensorrt_llm import MODE_BITS, EngineLimitError
from trtllm_stub import STUB_VERSION, StubExecutor, stub_module, write_engine_config

VOCAB = 320
LOOPY = [5, 5, 5, 5, 5, 5, 5, 5]  # the tiny model answers it with a loop: prompt lookup finds drafts


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def prompts(k: int, length: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [LOOPY] + [torch.randint(3, VOCAB, (length,), generator=gen).tolist() for _ in range(k - 1)]


# ---- bundles --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("backend_hf")
    # head size 32 and 2 query heads per KV head: what TensorRT-LLM's (speculative) kernels take
    target = make_tiny_hf(str(root / "target"), scale=8.0, head_dim=32)
    return target, target  # the target drafts for itself: its drafts are accepted (the stub corrupts some)


def _compile(hf_pair, out: str) -> str:
    from specbuild.compiler.compile import CompileOptions, compile_bundle

    opts = CompileOptions(dtype="float64", max_seq_len=128, max_batch_size=4, max_draft_len=4,
                          backend="tensorrt-llm", trtllm_dtype="bfloat16")
    return compile_bundle(hf_pair[0], out, opts, draft=hf_pair[1])


@pytest.fixture(scope="module")
def trt_bundle(hf_pair, tmp_path_factory) -> str:
    """tiny target + draft, compiled with --backend tensorrt-llm (checkpoints, no engines here)."""
    return _compile(hf_pair, str(tmp_path_factory.mktemp("trt_bundle") / "bundle"))


@pytest.fixture(scope="module")
def stub_bundle(trt_bundle, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("stub_bundle") / "bundle")
    shutil.copytree(trt_bundle, out)
    for role in ("target", "draft"):
        write_engine_config(out, role)
    return out


@pytest.fixture(scope="module")
def medusa_bundle(hf_pair, stub_bundle, tmp_path_factory) -> str:
    """The same bundle, its TensorRT-LLM part rewritten for a target with 3 random Medusa heads."""
    from specbuild.formats.checkpoints import read_hf_dir
    from specbuild.compiler.trtllm_build import write_trtllm_bundle_part

    out = str(tmp_path_factory.mktemp("medusa_bundle") / "bundle")
    shutil.copytree(stub_bundle, out)
    shutil.rmtree(os.path.join(out, "trtllm"))
    gen = torch.Generator().manual_seed(7)
    heads = {}
    for h in range(3):
        heads[f"{h}.0.linear.weight"] = torch.randn(64, 64, generator=gen)
        heads[f"{h}.0.linear.bias"] = torch.randn(64, generator=gen)
        heads[f"{h}.1.weight"] = torch.randn(VOCAB, 64, generator=gen)
    write_trtllm_bundle_part(out, read_hf_dir(hf_pair[0]), medusa=heads, tree_paths=[[0], [1], [0, 0], [0, 0, 0]],
                             dtype="bfloat16", max_batch_size=4, max_seq_len=128)
    write_engine_config(out, "target")
    return out


# ---- a stand-in for tensorrt_llm.bindings.executor (tests/helpers/trtllm_stub.py) ---------------------------
@pytest.fixture()
def stub_trtllm(monkeypatch):
    executor = stub_module()
    bindings = types.ModuleType("tensorrt_llm.bindings")
    bindings.executor = executor
    pkg = types.ModuleType("tensorrt_llm")
    pkg.bindings, pkg.__version__ = bindings, STUB_VERSION
    for name, mod in (("tensorrt_llm", pkg), ("tensorrt_llm.bindings", bindings),
                      ("tensorrt_llm.bindings.executor", executor)):
        monkeypatch.setitem(sys.modules, name, mod)
    StubExecutor.instances.clear()
    return executor


@pytest.fixture()
def stub_llmapi(monkeypatch):
    """TensorRT-LLM 1.x's LLM API replaced by tests/helpers/trtllm_api_stub.py (in process)."""
    from specbuild.backends.tensorrt_llm_api import TEST_STUB_ENV
    from trtllm_api_stub import LLM

    monkeypatch.setenv(TEST_STUB_ENV, "trtllm_api_stub:package")
    LLM.instances.clear()
    return LLM


def _skip_without_real_tensorrt_llm():
    from specbuild.backends.tensorrt_llm import tensorrt_llm_importable

    ok, reason = tensorrt_llm_importable()
    if not ok:
        pytest.skip(f"needs TensorRT-LLM: {reason}")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(scope="module")
def real_trt_bundle(hf_pair, tmp_path_factory) -> str:
    _skip_without_real_tensorrt_llm()  # compile builds the engines where TensorRT-LLM imports
    return _compile(hf_pair, str(tmp_path_factory.mktemp("real_trt") / "bundle"))


BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("tensorrt-llm-stub", id="tensorrt-llm-stub"),
    pytest.param("tensorrt-llm-api-stub", id="tensorrt-llm-api-stub"),
    pytest.param("tensorrt-llm", id="tensorrt-llm", marks=[pytest.mark.tensorrt_llm, pytest.mark.gpu]),
]


@pytest.fixture(params=BACKENDS)
def backend(request, trt_bundle, stub_bundle):
    name = request.param
    if name == "torch":
        engine = open_engine(trt_bundle, EngineConfig(), backend="torch")
    elif name == "tensorrt-llm-stub":
        request.getfixturevalue("stub_trtllm")
        from specbuild.backends.tensorrt_llm import TrtllmEngine

        engine = TrtllmEngine(stub_bundle, EngineConfig())
    elif name == "tensorrt-llm-api-stub":  # the LLM-API adapter, its prompt lookup driving UserProvidedDecodingConfig
        request.getfixturevalue("stub_llmapi")
        from specbuild.backends.tensorrt_llm_api import TrtllmApiEngine

        engine = TrtllmApiEngine(trt_bundle, EngineConfig(), method="ngram")
    else:
        engine = open_engine(request.getfixturevalue("real_trt_bundle"), EngineConfig(), backend="tensorrt-llm")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference(trt_bundle):
    """Plain greedy tokens from the torch engine: prompt ids -> first n tokens."""
    engine = Engine(trt_bundle, EngineConfig())

    def ref(ids: list[int], n: int) -> list[int]:
        return engine.generate([Request(prompt_ids=ids, sampling=greedy(n), speculation={"method": "none"})])[0][
            "token_ids"]

    return ref


# ---- the contract ---------------------------------------------------------------------------------
def test_is_a_backend_and_describes_its_guarantees(backend):
    assert isinstance(backend, Backend)
    table = backend.describe_guarantees()
    assert table["backend"] == ("torch" if backend.backend_name == "torch" else "tensorrt-llm")
    assert set(table["methods"]) == set(backend.methods) - ({"auto"} if backend.backend_name != "torch" else set())
    assert table["methods"]["none"] == {**table["methods"]["none"], "greedy": "lossless"}
    assert backend.encode("the") and isinstance(backend.render_chat([{"role": "user", "content": "hi"}]), str)


def test_stream_adds_up_to_the_result(backend):
    handle = backend.submit(Request(prompt_ids=LOOPY, sampling=greedy(10), speculation={"method": "none"}))
    events = list(handle)
    result = handle.result()
    assert [t for e in events for t in e.token_ids] == result["token_ids"] and len(result["token_ids"]) == 10
    assert "".join(e.text for e in events) == result["text"]
    assert events[-1].finished and not any(e.finished for e in events[:-1])
    assert result["finish_reason"] == events[-1].finish_reason == "length"
    assert set(STATS_KEYS) <= set(result["stats"]) and result["stats"]["generated_tokens"] == 10
    assert not backend.has_work()


def test_greedy_output_is_plain_greedy_for_every_method(backend, reference):
    batch = prompts(3)
    expected = [reference(p, 16) for p in batch]
    for method in [m for m in backend.methods if m != "auto"]:
        results = backend.generate([Request(prompt_ids=p, sampling=greedy(16), speculation={"method": method,
                                                                                           "gamma": 3})
                                    for p in batch])
        assert [r["token_ids"] for r in results] == expected, method
        if method != "none":  # speculation happened and was not all rejected
            drafted = sum(r["stats"]["drafted"] for r in results)
            accepted = sum(r["stats"]["accepted"] for r in results)
            assert drafted > 0 and 0 < accepted <= drafted, (method, drafted, accepted)
            assert results[0]["stats"]["mean_accepted_tokens"] > 1.0


def test_batch_equals_each_alone(backend):
    batch = prompts(4, 9)
    alone = [backend.generate([Request(prompt_ids=p, sampling=greedy(8))])[0]["token_ids"] for p in batch]
    together = backend.generate([Request(prompt_ids=p, sampling=greedy(8)) for p in batch])
    assert [r["token_ids"] for r in together] == alone


def test_abort_mid_stream(backend):
    handle = backend.submit(Request(prompt_ids=LOOPY, sampling=greedy(40), speculation={"method": "none"}))
    other = backend.submit(Request(prompt_ids=LOOPY[:5], sampling=greedy(4)))
    first = next(iter(handle))
    assert first.token_ids and not first.finished
    backend.abort(handle)
    rest = list(handle)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert handle.result()["finish_reason"] == "abort" and len(handle.result()["token_ids"]) < 40
    assert other.result()["finish_reason"] == "length"  # the neighbour is unaffected
    assert not backend.has_work()


@pytest.mark.parametrize("bad, match", [
    (dict(prompt_ids=[]), "prompt is empty"),
    (dict(prompt_ids=[5, VOCAB]), f"prompt token id {VOCAB} is out of range"),
    (dict(prompt_ids=[5] * 128), "max_seq_len is 128"),
    (dict(prompt_ids=[5, 6], speculation={"method": "bogus"}), "not one of"),
    (dict(prompt_ids=[5, 6], speculation={"method": "ngram", "gamma_max": 9, "gamma": 9}), "max.draft.len"),
])
def test_bad_input_is_refused_at_submit(backend, bad, match):
    with pytest.raises(RequestError, match=match):
        backend.submit(Request(sampling=greedy(4), **bad))
    assert not backend.has_work()


def test_length_limit(backend):
    r = backend.generate([Request(prompt_ids=[5] * 120, sampling=greedy(50))])[0]
    assert r["finish_reason"] == "length" and len(r["token_ids"]) == 128 - 120


def test_background_loop_serves_threads(backend):
    backend.start()
    try:
        results = {}

        def worker(i):
            results[i] = backend.submit(Request(prompt_ids=prompts(3)[i], sampling=greedy(6))).result()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(results) == [0, 1, 2] and all(len(r["token_ids"]) == 6 for r in results.values())
    finally:
        backend.stop()


def test_stats_report_load_in_the_same_keys(backend):
    """What health checks and metrics read (no scheduler, cache or model): the same keys on every
    backend; KV blocks are None where the backend owns its cache (TensorRT-LLM). Beyond them a
    backend adds only its own documented figures (_extra_stats: the torch engine's suffix store and
    its thread count, the step parts, auto's switch, the row price and the prefix cache)."""
    keys = {"queue_depth", "running", "kv_blocks_used", "kv_blocks_total", "gamma", "step_failures",
            "sequence_failures"}
    extras = {"suffix_store_requests", "suffix_store_tokens", "suffix_store_max_tokens", "suffix_store_evictions",
              "suffix_store_warm_tokens", "threads", "step_parts", "auto_switch", "row_price", "prefix_cache"} \
        if backend.backend_name == "torch" else set()
    idle = backend.stats()
    assert set(idle) == keys | extras and (idle["queue_depth"], idle["running"], idle["gamma"]) == (0, 0, 0.0)
    assert (idle["step_failures"], idle["sequence_failures"]) == (0, 0)
    handles = [backend.submit(Request(prompt_ids=p, sampling=greedy(6), speculation={"method": "ngram", "gamma": 2}))
               for p in prompts(2)]
    assert backend.stats()["queue_depth"] == 2 and backend.stats()["running"] == 0
    backend.step()
    busy = backend.stats()
    assert busy["queue_depth"] == 0 and busy["running"] == 2
    backend.run_until_done()
    assert all(h.result()["finish_reason"] == "length" for h in handles)
    done = backend.stats()
    assert (done["queue_depth"], done["running"]) == (0, 0)
    if backend.backend_name == "torch":
        assert busy["kv_blocks_used"] > 0 and done["kv_blocks_used"] == 0 and done["kv_blocks_total"] > 0
    else:
        assert busy["kv_blocks_used"] is busy["kv_blocks_total"] is done["kv_blocks_total"] is None


def test_seeded_sampling_reproduces(backend, request):
    if request.node.callspec.params["backend"].endswith("-stub"):
        pytest.skip("the stub executor does not sample (it answers sampled requests greedily)")
    params = SamplingParams(temperature=0.8, max_tokens=8, seed=1234, ignore_eos=True)
    a, b = (backend.generate([Request(prompt_ids=LOOPY, sampling=params, speculation={"method": "none"})])[0]
            for _ in range(2))
    assert a["token_ids"] == b["token_ids"] and a["stats"]["seed"] == 1234


# ---- TensorRT-LLM adapter specifics (stub executor) ---------------------------------------------------
def stub_engine(bundle: str, **config):
    from specbuild.backends.tensorrt_llm import TrtllmEngine

    return TrtllmEngine(bundle, EngineConfig(**config))


def test_draft_rounds_send_what_the_executor_api_expects(stub_trtllm, stub_bundle, reference):
    engine = stub_engine(stub_bundle)
    target, draft = StubExecutor.instances
    assert (target.role, draft.role) == ("target", "draft")
    for ex in (target, draft):
        assert ex.config.kv_cache_config.enable_block_reuse is True  # draft/target needs KV reuse
        assert ex.config.parallel_config.args == ("mpi", "leader")
    r = engine.generate([Request(prompt_ids=LOOPY, sampling=greedy(12), speculation={"method": "draft", "gamma": 3})])[0]
    assert r["token_ids"] == reference(LOOPY, 12)
    verifies = [q for q in target.requests if q.external_draft_tokens_config]
    assert verifies and all(not q.streaming and q.output_config.exclude_input_from_output for q in verifies)
    produced = LOOPY + r["token_ids"]
    for q in verifies:  # the text so far, up to three drafts, room for the drafts plus one token
        n = len(q.external_draft_tokens_config.tokens)
        assert 1 <= n <= 3 and q.max_tokens == n + 1
        assert q.input_token_ids == produced[:len(q.input_token_ids)]
    assert all(q.max_tokens <= 3 and not q.streaming for q in draft.requests)
    s = r["stats"]
    assert s["drafted"] == sum(len(q.external_draft_tokens_config.tokens) for q in verifies)
    assert 0 < s["accepted"] < s["drafted"]  # the stub's draft engine corrupts every third token
    assert s["acceptance_by_position"][0] is not None and s["gamma"]["max"] == 3
    engine.close()
    assert target.shut and draft.shut


def test_medusa_engine(stub_trtllm, medusa_bundle, reference):
    engine = stub_engine(medusa_bundle)
    (target,) = StubExecutor.instances
    assert target.config.decoding_config.decoding_mode == "medusa"
    assert target.config.decoding_config.medusa_choices == [[0], [1], [0, 0], [0, 0, 0]]
    assert target.config.extended_runtime_perf_knob_config.multi_block_mode is False
    assert engine.methods == ["none", "medusa"] and engine.default_speculation.method == "medusa"
    r = engine.generate([Request(prompt_ids=LOOPY, sampling=greedy(14))])[0]
    assert r["token_ids"] == reference(LOOPY, 14)
    # iterations after the prompt's yield 2, 3, 1, 2, ... tokens: accepted 1, 2, 0, 1, ... of 4 nodes each
    s = r["stats"]
    assert s["accepted"] == 14 - s["target_passes"] and s["drafted"] == 4 * (s["target_passes"] - 1)
    assert s["mean_accepted_tokens"] > 1.0 and len(s["acceptance_by_position"]) == 3
    for method in ("medusa", None):
        with pytest.raises(RequestError, match="greedy-only"):
            engine.submit(Request(prompt_ids=LOOPY, sampling=SamplingParams(temperature=0.7, max_tokens=4),
                                  speculation=None if method is None else {"method": method}))
    with pytest.raises(RequestError, match="per-request trees are torch-only"):
        engine.submit(Request(prompt_ids=LOOPY, sampling=greedy(4), speculation={"method": "medusa",
                                                                                 "tree": "mc_sim_7b_63"}))
    assert not engine.has_work()
    table = engine.describe_guarantees()
    assert table["methods"]["medusa"]["sampled"] == "refused" and table["methods"]["medusa"]["greedy"] == "lossless"


def test_stub_enforces_what_the_gpu_enforces(stub_trtllm, stub_bundle, medusa_bundle):
    """Issue 17: the stand-in answers as TensorRT-LLM would where the real kernels or runtime refuse,
    so a CPU test fails where a GPU would (rules in specbuild/formats/trtllm_support.py)."""
    from trtllm_stub import _Rec, kernel_error

    pre = json.load(open(os.path.join(medusa_bundle, "trtllm", "engines", "target", "config.json")))["pretrained_config"]
    assert pre["dtype"] == "bfloat16" and kernel_error(pre, speculative=True) is None
    assert "No available XQA kernels" in kernel_error({**pre, "dtype": "float32"}, speculative=True)
    assert kernel_error({**pre, "dtype": "float32"}, speculative=False) is None
    assert "No available XQA kernels" in kernel_error({**pre, "num_attention_heads": 6, "num_key_value_heads": 2},
                                                      speculative=True)  # group 3
    assert "unsupported head_size 16" in kernel_error({**pre, "head_size": 16}, speculative=False)
    target = os.path.join(stub_bundle, "trtllm", "engines", "target")
    no_reuse = _Rec(kv_cache_config=_Rec(enable_block_reuse=False), decoding_config=_Rec())
    with pytest.raises(RuntimeError, match="KV cache block reuse must be enabled for speculative decoding target"):
        StubExecutor(target, "decoder_only", no_reuse)
    # trtllm-build records max_seq_len + max_draft_len for speculative engines (tensorrt_llm/builder.py)
    lim = StubExecutor(target, "decoder_only", _Rec(kv_cache_config=_Rec(enable_block_reuse=True),
                                                     decoding_config=_Rec())).limits
    assert (lim["max_seq_len"], lim["max_draft_len"]) == (128 + 4, 4)


def test_sampled_speculation_is_refused_or_served_without_drafts(stub_trtllm, stub_bundle):
    engine = stub_engine(stub_bundle)
    hot = SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True, seed=3)
    for method, match in (("ngram", "prompt lookup is not lossless"), ("draft", "--gather_generation_logits")):
        with pytest.raises(RequestError, match=match):
            engine.submit(Request(prompt_ids=LOOPY, sampling=hot, speculation={"method": method}))
    assert engine.default_speculation.method == "draft"  # the bundle's default (a draft was compiled)
    r = engine.generate([Request(prompt_ids=LOOPY, sampling=hot)])[0]  # default: served without drafts
    assert len(r["token_ids"]) == 5 and r["stats"]["drafted"] == 0
    assert "--gather_generation_logits" in r["stats"]["stat_speculation_off"]
    (sent,) = [q for q in StubExecutor.instances[0].requests]
    assert sent.streaming and sent.sampling_config.temperature == 0.7 and sent.sampling_config.seed is not None
    assert sent.external_draft_tokens_config is None


def test_load_time_checks_name_the_rebuild_flag(stub_trtllm, stub_bundle, tmp_path):
    bundle = str(tmp_path / "b")
    shutil.copytree(stub_bundle, bundle)
    write_engine_config(bundle, "target", speculative_decoding_mode=MODE_BITS["none"], max_draft_len=0)
    with pytest.raises(EngineLimitError, match="rebuild with --speculative_decoding_mode draft_tokens_external "
                                               "--max_draft_len 4"):
        stub_engine(bundle)
    write_engine_config(bundle, "target", max_batch_size=2)
    with pytest.raises(EngineLimitError, match=r"max_batch_size 4 > maximum \(2\)"):
        stub_engine(bundle)
    assert stub_engine(bundle, max_batch_size=2).max_batch_size == 2
    assert len(StubExecutor.instances) == 2  # the refused loads built no executor


def test_sampled_speculation_default_needs_gathered_logits(stub_trtllm, stub_bundle, tmp_path):
    """A bundle whose defaults sample with draft tokens is refused at load on engines built without
    --gather_generation_logits; the error names the flag. Engines that gather them load and accept
    sampled drafts (the guarantees table says so)."""
    bundle = str(tmp_path / "b")
    shutil.copytree(stub_bundle, bundle)
    meta_path = os.path.join(bundle, "bundle.json")
    meta = json.load(open(meta_path))
    meta["default_sampling"] = {**meta["default_sampling"], "temperature": 0.8}
    assert meta["default_speculation"]["method"] == "draft"
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(EngineLimitError, match=r"the target engine .*sampled speculation \(temperature > 0 with "
                                               r"draft tokens\) is refused.*rebuild with --gather_generation_logits "
                                               r"\(`specbuild compile --trtllm-gather-generation-logits`"):
        stub_engine(bundle)
    write_engine_config(bundle, "target", gather_generation_logits=True)
    with pytest.raises(EngineLimitError, match="the draft engine .*--trtllm-gather-generation-logits"):
        stub_engine(bundle)  # the draft engine must return its logits too
    assert StubExecutor.instances == []
    write_engine_config(bundle, "draft", gather_generation_logits=True)
    engine = stub_engine(bundle)
    assert engine.logits_acceptance and engine.default_sampling.temperature == 0.8
    assert engine.describe_guarantees()["methods"]["draft"]["sampled"] == "lossless"
    engine.close()
    # greedy defaults load on engines without logits; sampled draft requests are then refused by name
    engine = stub_engine(stub_bundle)
    assert not engine.logits_acceptance
    with pytest.raises(RequestError, match="--trtllm-gather-generation-logits"):
        engine.submit(Request(prompt_ids=LOOPY, sampling=SamplingParams(temperature=0.7, max_tokens=4),
                              speculation={"method": "draft"}))
    engine.close()


def test_executor_errors_end_the_request(stub_trtllm, stub_bundle):
    engine = stub_engine(stub_bundle)
    StubExecutor.instances[0].limits["max_draft_len"] = 1  # the engine turns out smaller than it said
    periodic = [10, 11, 12, 13, 10, 11, 12]  # prompt lookup drafts [13, 10, 11] at once
    r = engine.generate([Request(prompt_ids=periodic, sampling=greedy(8), speculation={"method": "ngram", "gamma": 3})])[0]
    assert r["finish_reason"] == "error" and "Number of draft tokens (3) > maximum (1)" in r["error"]
    assert not engine.has_work()


def test_leader_mode(stub_trtllm, stub_bundle, medusa_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "1")
    with pytest.raises(SpecbuildError, match=r"built for tp\*pp = 1 ranks .* 2 were launched"):
        stub_engine(stub_bundle)
    bundle = str(tmp_path / "b")
    shutil.copytree(stub_bundle, bundle)
    for role in ("target", "draft"):
        path = os.path.join(bundle, "trtllm", "engines", role, "config.json")
        cfg = json.load(open(path))
        cfg["pretrained_config"]["mapping"].update(world_size=2, tp_size=2)
        json.dump(cfg, open(path, "w"))
    # two leader-mode executors on one 2-rank MPI world (issue 17 row 7): refused, not left to hang
    with pytest.raises(EngineLimitError, match=r"draft/target with target tp\*pp = 2 .* leader mode on one MPI "
                                               r"world, which can hang"):
        stub_engine(bundle)
    assert StubExecutor.instances == []
    medusa = str(tmp_path / "m")  # Medusa splits across ranks (tensor parallel): leader mode serves it
    shutil.copytree(medusa_bundle, medusa)
    path = os.path.join(medusa, "trtllm", "engines", "target", "config.json")
    cfg = json.load(open(path))
    cfg["pretrained_config"]["mapping"].update(world_size=2, tp_size=2)
    json.dump(cfg, open(path, "w"))
    worker = stub_engine(medusa)
    assert not worker.is_leader and worker.rank == 1
    with pytest.raises(SpecbuildError, match="only rank 0 takes requests"):
        worker.submit(Request(prompt_ids=LOOPY, sampling=greedy(2)))
    worker.wait_as_worker()
    assert all(ex.shut for ex in StubExecutor.instances[-1:])
    monkeypatch.setenv("PMI_RANK", "0")
    assert stub_engine(medusa).is_leader


def test_open_engine_picks_the_backend(stub_trtllm, trt_bundle, stub_bundle, tiny_bundle):
    assert resolve_backend(tiny_bundle, "auto")[0] == "torch"
    assert "compiled for the torch backend" in resolve_backend(tiny_bundle, "auto")[1]
    name, why = resolve_backend(trt_bundle, "auto")
    assert name == "torch" and "engines not built" in why and "build.sh" in why
    if not torch.cuda.is_available():
        assert resolve_backend(stub_bundle, "auto") == ("torch", "TensorRT-LLM needs a CUDA device and torch sees none")
        with pytest.raises(SpecbuildError, match="--backend tensorrt-llm cannot run .* needs a CUDA device"):
            open_engine(stub_bundle, backend="tensorrt-llm")
    assert type(open_engine(stub_bundle, backend="torch")) is Engine
    with pytest.raises(SpecbuildError, match="--backend 'onnx' is not one of auto, torch, tensorrt-llm"):
        resolve_backend(trt_bundle, "onnx")


def test_stand_in_executor_is_guarded(stub_bundle, monkeypatch):
    """SPECBUILD_TEST_TRTLLM_BINDINGS (how the CLI under mpirun gets the stand-in) takes only a
    factory whose module says it is a test stub; with one, open_engine runs the adapter on it."""
    from specbuild.backends.select import trtllm_status
    from specbuild.backends.tensorrt_llm import TEST_STUB_ENV, TrtllmEngine, stand_in_bindings, tensorrt_llm_importable

    monkeypatch.delenv(TEST_STUB_ENV, raising=False)
    assert stand_in_bindings() is None
    monkeypatch.setenv(TEST_STUB_ENV, "types:SimpleNamespace")  # importable, callable, but no stub
    with pytest.raises(SpecbuildError, match="is not a specbuild test stub .*for specbuild's tests only: unset it"):
        stand_in_bindings()
    monkeypatch.setenv(TEST_STUB_ENV, "no_such_module_here:bindings")
    with pytest.raises(SpecbuildError, match="No module named 'no_such_module_here'.*unset it"):
        stand_in_bindings()
    monkeypatch.setenv(TEST_STUB_ENV, "trtllm_stub:stub_module")
    assert stand_in_bindings().Executor is StubExecutor and tensorrt_llm_importable() == (True, "")
    assert trtllm_status(stub_bundle) == (True, "") and "tensorrt_llm" not in sys.modules
    StubExecutor.instances.clear()
    engine = open_engine(stub_bundle, EngineConfig(), backend="auto")
    assert type(engine) is TrtllmEngine and len(StubExecutor.instances) == 2
    assert engine.generate([Request(prompt_ids=LOOPY, sampling=greedy(3))])[0]["finish_reason"] == "length"
    engine.close()


def test_guarantees_table():
    torch_table = guarantees("torch")
    assert all(row["greedy"] == row["sampled"] == "lossless" for row in torch_table["methods"].values())
    dte = guarantees("tensorrt-llm", mode="draft_tokens_external")
    assert dte["methods"]["draft"]["sampled"] == "refused" and dte["methods"]["ngram"]["greedy"] == "lossless"
    assert guarantees("tensorrt-llm", mode="draft_tokens_external",
                      gather_generation_logits=True)["methods"]["draft"]["sampled"] == "lossless"
    assert set(guarantees("tensorrt-llm", mode="none")["methods"]) == {"none"}
    with pytest.raises(ValueError, match="backend 'x'"):
        guarantees("x")


def test_cli_backend_choice_and_inspect(trt_bundle):
    import subprocess

    def specbuild(*args):
        return subprocess.run([sys.executable, "-m", "specbuild.cli", *args], capture_output=True, text=True,
                              timeout=120)

    r = specbuild("generate", trt_bundle, "--prompt", "the", "--max-tokens", "3", "--backend", "tensorrt-llm")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "--backend tensorrt-llm cannot run" in r.stderr and "engines not built" in r.stderr
    r = specbuild("generate", trt_bundle, "--prompt", "the", "--max-tokens", "3", "--json")  # auto -> torch
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 3
    r = specbuild("inspect", trt_bundle)
    assert r.returncode == 0, r.stderr
    assert "guarantees on the torch backend:" in r.stdout and "guarantees on the tensorrt-llm backend:" in r.stdout
    assert "greedy lossless  sampled refused" in r.stdout  # prompt lookup on TensorRT-LLM
    table = json.loads(specbuild("inspect", trt_bundle, "--json").stdout)["guarantees"]
    assert table["tensorrt-llm"]["methods"]["draft"]["sampled"] == "refused"
    assert table["torch"]["methods"]["draft"]["sampled"] == "lossless"


# ---- front ends on the TensorRT-LLM backend (stub executor), through open_engine ------------------------
@pytest.fixture()
def trtllm_runs_here(stub_trtllm, monkeypatch):
    """open_engine's TensorRT-LLM check passes (the stub stands in for tensorrt_llm; no CUDA needed)."""
    import specbuild.backends.select as backend_module

    monkeypatch.setattr(backend_module, "trtllm_status", lambda bundle_dir, **options: (True, ""))


def test_open_engine_gives_the_tensorrt_llm_engine(trtllm_runs_here, stub_bundle, tiny_bundle):
    from specbuild.backends.tensorrt_llm import TrtllmEngine

    for choice in ("auto", "tensorrt-llm"):
        engine = open_engine(stub_bundle, EngineConfig(), backend=choice)
        assert type(engine) is TrtllmEngine and isinstance(engine, Backend)
        engine.close()
    assert type(open_engine(stub_bundle, EngineConfig(), backend="torch")) is Engine


def test_http_server_on_the_tensorrt_llm_backend(trtllm_runs_here, stub_bundle, reference):
    """The OpenAI server over a real socket, on the engine open_engine gives for a TensorRT-LLM bundle."""
    from http_client import get, parse_metrics, post, stream

    from specbuild.serve.openai_http import OpenAIServer, ServeConfig

    engine = open_engine(stub_bundle, EngineConfig(), backend="auto")
    assert engine.backend_name == "tensorrt-llm"
    app = OpenAIServer(engine, ServeConfig(port=0, model_name="stub"))
    app.bind()
    serving = threading.Thread(target=app.serve_forever, daemon=True)
    serving.start()
    port = app.port
    try:
        status, text = get(port, "/health")
        health = json.loads(text)
        assert status == 200 and health["status"] == "ok" and health["backend"] == "tensorrt-llm"
        assert health["kv_blocks_used"] is None and health["kv_blocks_total"] is None
        assert (health["queue_depth"], health["running"], health["max_batch_size"]) == (0, 0, 4)

        expected = reference(LOOPY, 12)
        body = {"model": "stub", "prompt": LOOPY, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "speculation": "draft", "gamma": 3}
        status, _, full = post(port, "/v1/completions", body)
        assert status == 200, full
        assert full["choices"][0]["token_ids"] == expected and full["choices"][0]["finish_reason"] == "length"
        usage = full["usage"]
        assert usage["completion_tokens"] == 12 and 0 < usage["accepted_tokens"] < usage["drafted_tokens"]
        chunks = stream(port, "/v1/completions", {**body, "speculation": "ngram",
                                                  "stream_options": {"include_usage": True}})
        # usage once, in a last chunk with no choices (OpenAI's include_usage)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["drafted_tokens"] > 0
        assert sum((c["choices"][0]["token_ids"] for c in chunks[:-1]), []) == expected
        assert all("usage" not in c or c["usage"] is None for c in chunks[:-1])

        # sampled speculation with the draft engine: refused, naming the compile flag
        status, _, err = post(port, "/v1/completions", {**body, "temperature": 0.7})
        assert status == 400 and "--trtllm-gather-generation-logits" in err["error"]["message"], err

        status, text = get(port, "/metrics")
        samples = parse_metrics(text)
        assert "# TYPE specbuild_kv_blocks_used gauge" in text  # the family, without a sample
        assert not any(name.startswith("specbuild_kv_blocks") for name, _ in samples)
        ok = (("endpoint", "completions"), ("finish_reason", "length"))
        assert samples[("specbuild_requests_total", ok)] == 2
        assert samples[("specbuild_generation_tokens_total", ())] == 24
        assert samples[("specbuild_draft_tokens_total", ())] == usage["drafted_tokens"] + \
            chunks[-1]["usage"]["drafted_tokens"]
        assert samples[("specbuild_queue_depth", ())] == 0 and samples[("specbuild_running_requests", ())] == 0
        assert samples[("specbuild_requests_rejected_total", (("reason", "invalid"),))] == 1
    finally:
        app.shutdown()
        serving.join(timeout=10)
        engine.close()
    assert all(ex.shut for ex in StubExecutor.instances)


class _TritonTensor:
    def __init__(self, name, value):
        self._name, self._value = name, value

    def name(self):
        return self._name

    def as_numpy(self):
        return self._value


class _TritonSender:
    def __init__(self):
        self.responses, self.done = [], threading.Event()

    def send(self, response, flags=0):
        self.responses.append(response)
        if flags == 1:
            self.done.set()

    def is_cancelled(self):
        return False


class _TritonRequest:
    def __init__(self, **inputs):
        import numpy as np

        self.sender = _TritonSender()
        self._inputs = [_TritonTensor(k, np.array([v.encode()], dtype=np.object_) if isinstance(v, str)
                        else np.array([v])) for k, v in inputs.items()]

    def inputs(self):
        return self._inputs

    def get_response_sender(self):
        return self.sender

    def request_id(self):
        return ""


def test_triton_model_on_the_tensorrt_llm_backend(trtllm_runs_here, stub_bundle, monkeypatch):
    """specbuild/serve/tritonserver_model.py's engine role, with the parameters `triton-repo --backend auto`
    writes, loads the TensorRT-LLM engine through open_engine and answers requests from it."""
    import numpy as np

    from specbuild.serve import tritonserver_model as triton_model
    from specbuild.serve.tritonserver_repo import DEFAULT_FACTORY

    fake = types.SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=1, Tensor=lambda name, value: (name, value),
        InferenceResponse=lambda output_tensors, error=None: types.SimpleNamespace(outputs=dict(output_tensors),
                                                                                   error=error),
        TritonError=lambda message, code=None: message)
    monkeypatch.setattr(triton_model, "pb_utils", fake)
    model = triton_model.EngineModel({"name": "specbuild"}, {"bundle": stub_bundle, "engine_factory": DEFAULT_FACTORY,
                                                             "backend": "auto"})
    try:
        assert model.engine.backend_name == "tensorrt-llm"
        prompt = "the cat sat on the mat"
        torch_engine = Engine(stub_bundle, EngineConfig())
        expected = torch_engine.generate([Request(prompt=prompt, sampling=SamplingParams(max_tokens=10),
                                                  speculation={"method": "none"})])[0]
        good = _TritonRequest(text_input=prompt, max_tokens=np.int32(10), speculation="draft", gamma=np.int32(3),
                              return_perf_metrics=True)
        hot = _TritonRequest(text_input=prompt, max_tokens=np.int32(10), speculation="draft",
                             temperature=np.float32(0.7))
        model.execute([good, hot])
        assert good.sender.done.wait(30) and hot.sender.done.wait(30)
        (answer,) = good.sender.responses
        assert answer.error is None
        assert answer.outputs["text_output"][0].decode() == expected["text"]
        assert 0 < int(answer.outputs["total_accepted_draft_tokens"][0]) <= int(answer.outputs["total_draft_tokens"][0])
        (refused,) = hot.sender.responses
        assert refused.error.startswith("invalid request: ") and "--trtllm-gather-generation-logits" in refused.error
        assert model.engine.stats()["queue_depth"] == 0
    finally:
        model.finalize()
    assert all(ex.shut for ex in StubExecutor.instances)  # finalize closes the TensorRT-LLM engine
    assert len(expected["token_ids"]) > 3 and expected["text"].strip()
    # the backend parameter reaches open_engine
    model = triton_model.EngineModel({"name": "specbuild"}, {"bundle": stub_bundle, "engine_factory": DEFAULT_FACTORY,
                                                             "backend": "torch"})
    assert model.engine.backend_name == "torch"
    model.finalize()
