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
from tiny import make_tiny_hf

from specbuild.backends.tensorrt_llm_api import TEST_STUB_ENV, TrtllmApiEngine
from specbuild.engine.engine import EngineConfig
from specbuild.engine.sequence import Request
from specbuild.errors import BundleError, RequestError
from specbuild.sampling.params import SamplingParams

import trtllm_api_stub as stub


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


PROMPTS = [[5] * 8, [17, 33, 2, 99, 150, 7, 8, 9, 250, 3]]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from specbuild.compiler.compile import CompileOptions, compile_bundle

    root = tmp_path_factory.mktemp("api")
    target = make_tiny_hf(str(root / "target"), scale=8.0, head_dim=32)
    opts = CompileOptions(dtype="float64", max_seq_len=128, max_batch_size=4, max_draft_len=4,
                          backend="tensorrt-llm", trtllm_dtype="bfloat16")
    return compile_bundle(target, str(root / "bundle"), opts, draft=target)


@pytest.fixture()
def api(monkeypatch):
    monkeypatch.setenv(TEST_STUB_ENV, "trtllm_api_stub:package")
    stub.LLM.instances.clear()
    return stub


@pytest.fixture(scope="module")
def reference(bundle):
    from specbuild.backends.select import TorchEngine

    engine = TorchEngine(bundle, EngineConfig())
    return lambda ids, n: engine.generate([Request(prompt_ids=ids, sampling=greedy(n),
                                                   speculation={"method": "none"})])[0]["token_ids"]


def test_bundle_carries_hugging_face_roles(bundle):
    from specbuild.backends.tensorrt_llm import read_trtllm_meta
    from specbuild.formats.checkpoints import read_hf_dir

    api = read_trtllm_meta(bundle)["llmapi"]
    assert api["models"] == {"target": "hf/target", "draft": "hf/draft"} and api["tp"] == 1
    ckpt = read_hf_dir(os.path.join(bundle, "trtllm", "hf", "target"))
    assert ckpt.config.head_dim == 32 and ckpt.tensors["model.embed_tokens.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("method, config_class", [("draft", stub.DraftTargetDecodingConfig),
                                                  ("ngram", stub.UserProvidedDecodingConfig)])
def test_each_method_builds_its_speculative_config(api, bundle, reference, method, config_class):
    engine = TrtllmApiEngine(bundle, EngineConfig(), method=method)
    (llm,) = api.LLM.instances
    spec = llm.kwargs["speculative_config"]
    assert type(spec) is config_class and spec.max_draft_len == 4
    assert llm.model == os.path.join(bundle, "trtllm", "hf", "target") and llm.skip_tokenizer_init
    assert llm.kwargs["max_seq_len"] == 128 + 4 and llm.kwargs["max_batch_size"] == 4
    if method == "draft":
        assert spec.speculative_model == os.path.join(bundle, "trtllm", "hf", "draft")
    else:  # specbuild's prompt lookup is a real Drafter subclass
        assert isinstance(spec.drafter, stub.Drafter) and spec.drafter.max_draft_len == 4
    results = engine.generate([Request(prompt_ids=p, sampling=greedy(16)) for p in PROMPTS])
    assert [r["token_ids"] for r in results] == [reference(p, 16) for p in PROMPTS]
    assert llm.drafts_proposed > 0
    drafted, accepted = (sum(r["stats"][k] for r in results) for k in ("drafted", "accepted"))
    assert drafted > 0 and 0 < accepted <= drafted, (drafted, accepted)
    sent = llm.requests[0][1]
    assert (sent.top_k, sent.detokenize, sent.ignore_eos, sent.max_tokens) == (1, False, True, 16)
    engine.close()
    assert llm.shut


def test_trtllm_ngram_and_eagle3(api, bundle, reference, tmp_path):
    engine = TrtllmApiEngine(bundle, EngineConfig(), method="ngram", ngram_impl="trtllm")
    spec = api.LLM.instances[-1].kwargs["speculative_config"]
    assert type(spec) is stub.NGramDecodingConfig and (spec.max_draft_len, spec.max_matching_ngram_size) == (4, 3)
    assert engine.generate([Request(prompt_ids=PROMPTS[0], sampling=greedy(8))])[0]["token_ids"] == reference(
        PROMPTS[0], 8)
    engine.close()
    head = str(tmp_path / "eagle3")  # the stand-in reads only its config.json (formats/eagle3.py writes the real one)
    shutil.copytree(os.path.join(bundle, "trtllm", "hf", "draft"), head)
    engine = TrtllmApiEngine(bundle, EngineConfig(), eagle3_dir=head)
    spec = api.LLM.instances[-1].kwargs["speculative_config"]
    assert engine.methods == ["none", "eagle3"] and type(spec) is stub.Eagle3DecodingConfig
    assert spec.speculative_model == head and spec.max_draft_len == 4
    r = engine.generate([Request(prompt_ids=PROMPTS[1], sampling=greedy(12), speculation={"method": "eagle3"})])[0]
    assert r["token_ids"] == reference(PROMPTS[1], 12) and r["stats"]["accepted"] > 0
    engine.close()


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
