"""The TensorRT-LLM 1.x LLM-API backend (backends/tensorrt_llm_api.py) on the stand-in of
tests/helpers/trtllm_api_stub.py: which speculative config each method builds, with which
arguments; greedy output equal to plain greedy; the refusals; how `--backend tensorrt-llm`
picks the path the installed release supports. (The request-level contract runs in
test_backend.py as the `tensorrt-llm-api-stub` backend.)"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
from tiny import make_tiny_eagle3, make_tiny_hf, trtllm_draft_bundle

from specbuild.backends.tensorrt_llm_api import TEST_STUB_ENV, TrtllmApiEngine
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.errors import BundleError, RequestError
from specbuild.sampling.params import SamplingParams

import trtllm_api_stub as stub


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


PROMPTS = [[5] * 8, [17, 33, 2, 99, 150, 7, 8, 9, 250, 3]]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return trtllm_draft_bundle(tmp_path_factory.mktemp("api"))


@pytest.fixture()
def api(monkeypatch):
    monkeypatch.setenv(TEST_STUB_ENV, "trtllm_api_stub:package")
    monkeypatch.delenv("TLLM_WORKER_USE_SINGLE_PROCESS", raising=False)  # the LLM API's default: a worker process
    monkeypatch.setattr(stub, "STUB_HIDDEN", set())
    stub.LLM.instances.clear()
    return stub


@pytest.fixture(scope="module")
def reference(bundle):
    engine = Engine(bundle, EngineConfig())
    return lambda ids, n: engine.generate([Request(prompt_ids=ids, sampling=greedy(n),
                                                   speculation={"method": "none"})])[0]["token_ids"]


def test_bundle_carries_hugging_face_roles(bundle):
    from specbuild.backends.tensorrt_llm import read_trtllm_meta
    from specbuild.formats.checkpoints import read_hf_dir

    api = read_trtllm_meta(bundle)["llmapi"]
    assert api["models"] == {"target": "hf/target", "draft": "hf/draft"} and api["tp"] == 1
    ckpt = read_hf_dir(os.path.join(bundle, "trtllm", "hf", "target"))
    assert ckpt.config.head_dim == 32 and ckpt.tensors["model.embed_tokens.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("method, impl, config_class", [("draft", None, stub.DraftTargetDecodingConfig),
                                                        ("ngram", None, stub.NGramDecodingConfig),
                                                        ("ngram", "specbuild", stub.UserProvidedDecodingConfig)])
def test_each_method_builds_its_speculative_config(api, bundle, reference, method, impl, config_class):
    """ngram defaults to TensorRT-LLM's own NGramDecodingConfig (issue 31 row 2); specbuild's
    lookup goes through UserProvidedDecodingConfig as a module-level, picklable Drafter."""
    from specbuild.backends.tensorrt_llm_drafter import PromptLookupDrafter

    engine = TrtllmApiEngine(bundle, EngineConfig(), method=method, **({"ngram_impl": impl} if impl else {}))
    (llm,) = api.LLM.instances
    spec = llm.kwargs["speculative_config"]
    assert type(spec) is config_class and spec.max_draft_len == 4
    assert llm.model == os.path.join(bundle, "trtllm", "hf", "target") and llm.skip_tokenizer_init
    assert llm.kwargs["max_seq_len"] == 128 + 4 and llm.kwargs["max_batch_size"] == 4
    if method == "draft":
        assert spec.speculative_model == os.path.join(bundle, "trtllm", "hf", "draft")
    elif impl == "specbuild":  # specbuild's prompt lookup is a real Drafter subclass, rebuilt in the "worker"
        assert type(spec.drafter) is PromptLookupDrafter and isinstance(spec.drafter, stub.Drafter)
        assert spec.drafter.max_draft_len == 4 and spec.drafter._needs_padding_kv_extension is True
    else:
        assert spec.max_matching_ngram_size == 3
    results = engine.generate([Request(prompt_ids=p, sampling=greedy(16)) for p in PROMPTS])
    assert [r["token_ids"] for r in results] == [reference(p, 16) for p in PROMPTS]
    assert llm.drafts_proposed > 0
    drafted, accepted = (sum(r["stats"][k] for r in results) for k in ("drafted", "accepted"))
    assert drafted > 0 and 0 < accepted <= drafted, (drafted, accepted)
    sent = llm.requests[0][1]
    assert (sent.top_k, sent.detokenize, sent.ignore_eos, sent.max_tokens) == (1, False, True, 16)
    engine.close()
    assert llm.shut


def test_eagle3_config_by_release(api, bundle, reference, tmp_path, monkeypatch):
    """Issue 31 row 4: 1.0-1.2 export no Eagle3DecodingConfig (llmapi/__init__.py at 5ca85aff);
    there EAGLE-3 is EagleDecodingConfig(eagle3_one_model=True). Picked by the installed version;
    a release with neither is refused naming it."""
    head = make_tiny_eagle3(str(tmp_path / "eagle3"), os.path.join(bundle, "trtllm", "hf", "target"))
    for version, cls, one_model in (("1.2.0", stub.EagleDecodingConfig, True), ("1.3.0", stub.Eagle3DecodingConfig,
                                                                                 True)):
        monkeypatch.setattr(stub, "STUB_VERSION", version)
        engine = TrtllmApiEngine(bundle, EngineConfig(), eagle3_dir=head)
        spec = api.LLM.instances[-1].kwargs["speculative_config"]
        assert engine.methods == ["none", "eagle3"] and type(spec) is cls, version
        assert spec.speculative_model == head and spec.max_draft_len == 4 and spec.eagle3_one_model is one_model
        assert cls.__name__ in engine.describe_guarantees()["methods"]["eagle3"]["acceptance"]
        r = engine.generate([Request(prompt_ids=PROMPTS[1], sampling=greedy(12),
                                     speculation={"method": "eagle3"})])[0]
        assert r["token_ids"] == reference(PROMPTS[1], 12) and r["stats"]["accepted"] > 0
        engine.close()
    monkeypatch.setattr(stub, "STUB_VERSION", "1.1.0")
    monkeypatch.setattr(stub, "STUB_HIDDEN", {"EagleDecodingConfig"})
    with pytest.raises(BundleError, match=r"TensorRT-LLM 1.1.0 has neither Eagle3DecodingConfig nor "
                                          r"EagleDecodingConfig with eagle3_one_model.*install tensorrt_llm>=1.3"):
        TrtllmApiEngine(bundle, EngineConfig(), eagle3_dir=head)
    monkeypatch.setattr(stub, "STUB_VERSION", "1.3.1")
    monkeypatch.setattr(stub, "STUB_HIDDEN", {"Eagle3DecodingConfig"})
    with pytest.raises(BundleError, match=r"TensorRT-LLM 1.3.1 exports no tensorrt_llm.llmapi.Eagle3DecodingConfig"):
        TrtllmApiEngine(bundle, EngineConfig(), eagle3_dir=head)
    assert len(api.LLM.instances) == 2  # the refusals started no LLM


def test_trtllm_ngram(api, bundle, reference):
    engine = TrtllmApiEngine(bundle, EngineConfig(), method="ngram", ngram_impl="trtllm")
    spec = api.LLM.instances[-1].kwargs["speculative_config"]
    assert type(spec) is stub.NGramDecodingConfig and (spec.max_draft_len, spec.max_matching_ngram_size) == (4, 3)
    assert engine.generate([Request(prompt_ids=PROMPTS[0], sampling=greedy(8))])[0]["token_ids"] == reference(
        PROMPTS[0], 8)
    engine.close()
    with pytest.raises(BundleError, match="ngram_impl 'mine'"):
        TrtllmApiEngine(bundle, EngineConfig(), method="ngram", ngram_impl="mine")


def test_refusals(api, bundle, monkeypatch):
    engine = TrtllmApiEngine(bundle, EngineConfig(), method="draft")
    with pytest.raises(RequestError, match="sampled requests are refused .* speculates \\(draft\\)"):
        engine.submit(Request(prompt_ids=PROMPTS[0], sampling=SamplingParams(temperature=0.7, max_tokens=4)))
    with pytest.raises(RequestError, match=r"Number of draft tokens \(9\) > maximum \(4\)"):
        engine.submit(Request(prompt_ids=PROMPTS[0], sampling=greedy(4), speculation={"method": "draft", "gamma": 9}))
    with pytest.raises(RequestError, match="method 'ngram' is not available .* fixes it at start"):
        engine.submit(Request(prompt_ids=PROMPTS[0], sampling=greedy(4), speculation={"method": "ngram"}))
    assert not engine.has_work()
    engine.close()
    plain = TrtllmApiEngine(bundle, EngineConfig(), method="none")  # no speculation: sampled requests run
    assert "speculative_config" not in api.LLM.instances[-1].kwargs
    hot = SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True, seed=5)
    assert len(plain.generate([Request(prompt_ids=PROMPTS[0], sampling=hot)])[0]["token_ids"]) == 4
    sent = api.LLM.instances[-1].requests[-1][1]
    assert sent.temperature == 0.7 and sent.seed is not None and sent.top_k is None
    plain.close()
    with pytest.raises(BundleError, match="method 'eagle3' needs its model"):
        TrtllmApiEngine(bundle, EngineConfig(), method="eagle3")
    monkeypatch.setattr(stub, "STUB_VERSION", "0.21.0")  # before 1.0, tensorrt_llm.LLM is the TensorRT one
    with pytest.raises(BundleError, match=r"TensorRT-LLM 0.21.0 is installed; the LLM-API path needs tensorrt_llm>=1.0"):
        TrtllmApiEngine(bundle, EngineConfig(), method="draft")


def test_medusa_bundles_are_engine_path_only(api, bundle, tmp_path):
    from specbuild.backends.tensorrt_llm import read_trtllm_meta
    from specbuild.backends.select import trtllm_path
    import json

    medusa = str(tmp_path / "m")
    shutil.copytree(bundle, medusa)
    path = os.path.join(medusa, "trtllm", "trtllm.json")
    meta = read_trtllm_meta(medusa)
    meta["mode"] = "medusa"
    json.dump(meta, open(path, "w"))
    with pytest.raises(BundleError, match="Medusa is not in TensorRT-LLM's PyTorch-backend speculative decoding"):
        TrtllmApiEngine(medusa, EngineConfig())
    assert trtllm_path(medusa)[0] is None


def test_backend_choice_follows_the_installed_release(bundle, monkeypatch, tmp_path):
    """`--backend tensorrt-llm`: a release >= 1.3 (no engine path) serves through the LLM API
    even where engines are built; before 1.0 without engines nothing runs, and the reason says so."""
    from specbuild.backends.select import open_engine, trtllm_path
    from trtllm_stub import write_engine_config

    built = str(tmp_path / "built")
    shutil.copytree(bundle, built)
    for role in ("target", "draft"):
        write_engine_config(built, role)
    monkeypatch.delenv(TEST_STUB_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pkg = stub.package()
    for version, where, path in (("1.3.0", built, "llmapi"), ("1.2.0", built, "engine"), ("1.2.0", bundle, "llmapi"),
                                 ("0.21.0", built, "engine")):
        pkg.__version__ = version
        monkeypatch.setitem(sys.modules, "tensorrt_llm", pkg)
        assert trtllm_path(where) == (path, ""), (version, where)
    pkg.__version__ = "0.21.0"
    path, why = trtllm_path(bundle)
    assert path is None and "engines not built" in why and "tensorrt_llm>=1.0" in why
    pkg.__version__ = "1.3.0"
    stub.LLM.instances.clear()
    engine = open_engine(built, EngineConfig(), backend="tensorrt-llm")
    assert type(engine) is TrtllmApiEngine and engine.method == "draft" and len(stub.LLM.instances) == 1
    engine.close()


def test_cli_generate_on_the_llmapi_path(bundle):
    """`specbuild generate --backend tensorrt-llm` in a subprocess picks the LLM-API path (stand-in
    named by SPECBUILD_TEST_TRTLLM_LLMAPI), one process, greedy ids equal to plain greedy."""
    import json
    import subprocess

    helpers = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
    env = {**os.environ, TEST_STUB_ENV: "trtllm_api_stub:package",
           "PYTHONPATH": os.pathsep.join(filter(None, [helpers, os.environ.get("PYTHONPATH")]))}
    def generate(backend: str) -> dict:
        r = subprocess.run([sys.executable, "-m", "specbuild.cli", "generate", bundle, "--backend", backend,
                            "--prompt", "the the the the the", "--max-tokens", "10", "--temperature", "0",
                            "--ignore-eos", "--json", "--speculation", "none" if backend == "torch" else "draft"],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        return {**json.loads(r.stdout), "stderr": r.stderr}

    trt, plain = generate("tensorrt-llm"), generate("torch")
    assert trt["token_ids"] == plain["token_ids"] and len(trt["token_ids"]) == 10 and trt["stats"]["drafted"] > 0
    assert "TEST STUB" in trt["stderr"]


# ---- issue 31 row 2: the prompt-lookup drafter reaches TensorRT-LLM's worker ----------------------
def _proposals(drafter, tokens):
    import types

    req = stub._LlmRequest(1, tokens, 0)
    drafter.prepare_draft_tokens(types.SimpleNamespace(generation_requests=[req], context_requests=[]))
    return req.py_draft_tokens


def test_drafter_pickles_by_reference(api):
    """The drafter is a module-level class with its settings as attributes: pickle and cloudpickle
    round trips give an equal drafter (by reference, not by value), and a fresh interpreter, like
    TensorRT-LLM's MPI worker, rebuilds it by importing specbuild and proposes the same drafts."""
    import pickle
    import subprocess

    import cloudpickle

    from specbuild.backends.tensorrt_llm_api import llmapi_package, make_drafter
    from specbuild.backends.tensorrt_llm_drafter import PromptLookupDrafter
    from specbuild.speculation.proposers.ngram import lookup
    import numpy as np

    drafter = make_drafter(llmapi_package(), 4, 1, 3)
    tokens = [5, 6, 7, 8, 9, 5, 6, 7]
    want = _proposals(drafter, tokens)
    assert want == [8, 9, 5, 6] == lookup(np.asarray(tokens), 1, 3, 4)
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        blob = dumps(drafter)
        assert b"PromptLookupDrafter" in blob and b"prepare_draft_tokens" not in blob  # by name, not by value
        back = loads(blob)
        assert type(back) is PromptLookupDrafter and vars(back) == vars(drafter)
        assert _proposals(back, tokens) == want
    helpers = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
    code = ("import pickle, sys, types, trtllm_api_stub as s\n"
            "d = pickle.loads(sys.stdin.buffer.read())\n"
            "r = s._LlmRequest(1, [5, 6, 7, 8, 9, 5, 6, 7], 0)\n"
            "d.prepare_draft_tokens(types.SimpleNamespace(generation_requests=[r], context_requests=[]))\n"
            "print(type(d).__module__, r.py_draft_tokens)")
    env = {**os.environ, TEST_STUB_ENV: "trtllm_api_stub:package",
           "PYTHONPATH": os.pathsep.join(filter(None, [helpers, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(drafter), capture_output=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().split() == ["specbuild.backends.tensorrt_llm_drafter", "[8,", "9,", "5,", "6]"]
    with pytest.raises(ValueError, match="ngram_min=4 is above ngram_max=3"):
        PromptLookupDrafter(4, 4, 3)


def test_stand_in_enforces_worker_pickling_and_padding_flag(api, bundle, monkeypatch):
    """The stand-in refuses what the real LLM API would: a drafter that does not pickle (a class
    made in a function, as before) when the executor runs in its worker process, and, in a single
    process, a TorchSampler drafter whose padded drafts lack _needs_padding_kv_extension."""
    from specbuild.backends.tensorrt_llm_api import speculative_config

    pkg = stub.package()

    def local_drafter(padding_flag: bool):
        class LocalDrafter(stub.Drafter):
            _needs_padding_kv_extension = padding_flag

            def prepare_draft_tokens(self, scheduled_requests, resource_manager=None):
                for req in scheduled_requests.generation_requests:
                    req.py_draft_tokens = []

        return LocalDrafter(max_draft_len=4, max_total_draft_tokens=4)

    hf = os.path.join(bundle, "trtllm", "hf", "target")
    spec = speculative_config(pkg, "ngram", max_draft_len=4, models={}, drafter=local_drafter(True), ngram_impl="x")
    with pytest.raises((AttributeError, pickle_error())):
        stub.LLM(hf, skip_tokenizer_init=True, speculative_config=spec)
    monkeypatch.setenv("TLLM_WORKER_USE_SINGLE_PROCESS", "1")
    llm = stub.LLM(hf, skip_tokenizer_init=True, speculative_config=spec)
    assert llm.spec.drafter is spec.drafter  # nothing crossed a process
    unflagged = speculative_config(pkg, "ngram", max_draft_len=4, models={}, drafter=local_drafter(False),
                                   ngram_impl="x")
    result = stub.LLM(hf, skip_tokenizer_init=True, speculative_config=unflagged).generate_async(
        PROMPTS[0], stub.SamplingParams(max_tokens=6, end_id=0), streaming=True)
    with pytest.raises(RuntimeError, match="_needs_padding_kv_extension"):
        list(result)


def pickle_error():
    import pickle

    return pickle.PicklingError


# ---- issue 31 row 3: the LLM-API path's kernel check ---------------------------------------------
@pytest.fixture(scope="module")
def group3_bundle(tmp_path_factory):
    """SmolLM2-135M's shape in small (3 query heads per KV head), draft/target: accepted by the engine
    path's compile (issue 31 row 1), so it reaches the LLM-API path's own check."""
    from specbuild.compiler.compile import CompileOptions, compile_bundle

    root = tmp_path_factory.mktemp("g3")
    target = make_tiny_hf(str(root / "target"), hidden=96, heads=6, kv_heads=2, scale=8.0, head_dim=32)
    opts = CompileOptions(dtype="float64", max_seq_len=128, max_batch_size=4, max_draft_len=4,
                          backend="tensorrt-llm", trtllm_dtype="bfloat16")
    return compile_bundle(target, str(root / "bundle"), opts, draft=target)


def test_llmapi_kernel_check(api, group3_bundle, reference, monkeypatch):
    """A speculating target on TRTLLM attention runs in multi-token query mode (XQA) below SM 120
    (_torch/speculative/interface.py): a group of 3 is refused at load with the reason, the
    tensor_parallel_size that works and the FLASHINFER way out, before any LLM starts; plain decoding,
    FLASHINFER attention and (for two-model methods) SM 120 pass, and the stand-in, which enforces
    the same kernel rule on its own, then serves greedy output equal to plain greedy."""
    import specbuild.backends.tensorrt_llm_api as adapter

    monkeypatch.setattr(adapter, "cuda_sm", lambda: 90)
    for method in ("draft", "ngram"):
        with pytest.raises(BundleError, match=rf"would fail on TensorRT-LLM's LLM API: the target has 6 query heads "
                                              rf"over 2 KV heads: 3 query heads per KV head at tp=1, and {method} "
                                              rf"speculation on TensorRT-LLM 1.2.0's LLM API \(multi-token query mode "
                                              rf"on TRTLLM attention on SM 90.*tensor_parallel_size \(--tp\) that makes "
                                              rf"it one \(6\); or attn_backend='FLASHINFER'"):
            TrtllmApiEngine(group3_bundle, EngineConfig(), method=method)
    assert not api.LLM.instances
    with pytest.raises(RuntimeError, match="No available XQA kernels"):  # what the stand-in alone would answer
        from specbuild.backends.tensorrt_llm_api import speculative_config

        spec = speculative_config(stub.package(), "draft", max_draft_len=4,
                                  models={"draft": os.path.join(group3_bundle, "trtllm", "hf", "draft")})
        stub.LLM(os.path.join(group3_bundle, "trtllm", "hf", "target"), skip_tokenizer_init=True,
                 speculative_config=spec)
    TrtllmApiEngine(group3_bundle, EngineConfig(), method="none").close()
    engine = TrtllmApiEngine(group3_bundle, EngineConfig(), method="draft", attn_backend="FLASHINFER")
    assert api.LLM.instances[-1].kwargs["attn_backend"] == "FLASHINFER"
    r = engine.generate([Request(prompt_ids=PROMPTS[0], sampling=greedy(10))])[0]
    assert r["stats"]["drafted"] > 0 and r["stats"]["accepted"] > 0
    engine.close()
    monkeypatch.setattr(adapter, "cuda_sm", lambda: 120)  # two-model targets: chunked context, not XQA
    from specbuild.formats.trtllm_support import llmapi_kernel_problems

    cfg = engine.target_config
    assert llmapi_kernel_problems(cfg, method="draft", version="1.2.0", dtype="bfloat16", sm=120) == []
    assert llmapi_kernel_problems(cfg, method="eagle3", version="1.2.0", dtype="bfloat16", sm=120)  # one-model
    assert llmapi_kernel_problems(cfg, method="draft", version="1.2.0", dtype="bfloat16", sm=90, tp=6) == []
