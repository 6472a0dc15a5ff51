"""Issue 53 rows 2 and 3 on the LLM-API stand-in (tests/helpers/trtllm_api_stub.py):

- row 3: whether a speculating target runs in multi-token query mode (the speculative XQA kernels)
  is asked of the installed release's own tensorrt_llm/_torch/speculative/interface.py
  (SpeculativeDecodingMode.attention_need_spec_dec_mode / extend_ctx, by the signature that release
  has), and taken from specbuild's per-release table only where those cannot be asked. The stand-in
  plays the rules read per release: the 1.0 line (two-model targets never in that mode), 1.1/1.2
  (two-model targets below SM 120), 1.3 (draft/target one-model: every SM).
- row 2: `--backend auto` runs the same checks inside trtllm_path that TrtllmApiEngine runs, takes
  TensorRT-LLM only where engines are built (docs/tensorrt-llm.md), and otherwise serves on torch
  with one line saying why; --trtllm-attn-backend / --trtllm-ngram-impl reach the LLM API."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
from tiny import make_tiny_hf, trtllm_draft_bundle

import trtllm_api_stub as stub
from specbuild.backends.tensorrt_llm_api import TEST_STUB_ENV, TrtllmApiEngine
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.errors import BundleError, SpecbuildError
from specbuild.formats.trtllm_support import table_multi_query
from specbuild.sampling.params import SamplingParams

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def group3(tmp_path_factory):
    """SmolLM2-135M's head shape in small (3 query heads per KV head), draft/target, bfloat16."""
    return trtllm_draft_bundle(tmp_path_factory.mktemp("g3rules"), hidden=96, heads=6, kv_heads=2)


@pytest.fixture()
def api(monkeypatch):
    import specbuild.backends.tensorrt_llm_api as adapter

    monkeypatch.setenv(TEST_STUB_ENV, "trtllm_api_stub:package")
    monkeypatch.setenv("TLLM_WORKER_USE_SINGLE_PROCESS", "1")
    monkeypatch.setattr(stub, "STUB_HIDDEN", set())
    monkeypatch.setattr(stub, "STUB_VERSION", "1.2.0")
    monkeypatch.setattr(stub, "STUB_SM", 90)
    monkeypatch.setattr(adapter, "cuda_sm", lambda: stub.STUB_SM)  # the GPU specbuild sees is the release's
    stub.LLM.instances.clear()
    return stub


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def refusal(bundle, method, **kw) -> str | None:
    try:
        engine = TrtllmApiEngine(bundle, EngineConfig(), method=method, **kw)
    except BundleError as e:
        return str(e)
    r = engine.generate([Request(prompt_ids=PROMPT, sampling=greedy(6))])[0]
    engine.close()
    assert len(r["token_ids"]) == 6
    return None


# (release, SM, method) -> refused? The rows the review found wrong under a rule written once for every 1.x.
CASES = [("1.0.0", 90, "draft", False),   # the 1.0 line: two-model targets take drafts as chunked context
         ("1.0.0", 90, "ngram", False),
         ("1.2.0", 90, "draft", True),    # 1.1/1.2: two-model targets in multi-token query mode below SM 120
         ("1.2.0", 120, "draft", False),  # ... chunked context from SM 120 (extend_ctx)
         ("1.3.0", 120, "draft", True),   # 1.3: draft/target is one-model: multi-token query on every SM
         ("1.3.0", 120, "ngram", False)]


@pytest.mark.parametrize("version, sm, method, refused", CASES)
def test_rule_asked_of_the_release(api, group3, monkeypatch, version, sm, method, refused):
    monkeypatch.setattr(stub, "STUB_VERSION", version)
    monkeypatch.setattr(stub, "STUB_SM", sm)
    why = refusal(group3, method)
    assert (why is not None) == refused, why
    if refused:
        assert f"TensorRT-LLM {version}'s own tensorrt_llm/_torch/speculative/interface.py answers" in why
        assert f"SM {sm}" in why and "--trtllm-attn-backend FLASHINFER" in why
    assert table_multi_query(version, method, sm) == refused  # the table agrees with the release it documents


def test_table_where_the_release_cannot_be_asked(api, group3, monkeypatch):
    """A release whose interface.py is not importable (hidden in the stand-in): the documented table
    decides, and the refusal says it is the table's answer, naming the file and the release."""
    monkeypatch.setattr(stub, "STUB_HIDDEN", {"interface"})
    monkeypatch.setattr(stub, "STUB_VERSION", "1.3.0")
    monkeypatch.setattr(stub, "STUB_SM", 120)
    why = refusal(group3, "draft")
    assert why and ("by specbuild's table of tensorrt_llm/_torch/speculative/interface.py for release 1.3.0, whose "
                    "functions could not be asked") in why
    monkeypatch.setattr(stub, "STUB_VERSION", "1.0.0")
    monkeypatch.setattr(stub, "STUB_SM", 90)
    assert refusal(group3, "draft") is None


def test_release_multi_query_follows_the_signature(api, group3):
    """The 1.0 line's attention_need_spec_dec_mode takes no arguments, 00b6d5a2's four; an unknown
    required argument is not guessed (None: the table decides)."""
    from specbuild.backends.tensorrt_llm_api import llmapi_package, release_multi_query, speculative_config

    models = {"draft": os.path.join(group3, "trtllm", "hf", "draft")}
    for version, want in (("1.0.0", False), ("1.2.0", True)):
        stub.STUB_VERSION = version
        spec = speculative_config(llmapi_package(), "draft", max_draft_len=4, models=models)
        assert release_multi_query(llmapi_package(), spec) is want, version
        assert release_multi_query(llmapi_package(), spec, "FLASHINFER") is False  # extend_ctx off TRTLLM

    class Odd(stub._Rules11):
        def attention_need_spec_dec_mode(self, something_new):
            return True

    odd = stub.enum.IntEnum("SpeculativeDecodingMode", stub._MODES, type=Odd)
    pkg = llmapi_package()
    pkg._torch.speculative.interface.SpeculativeDecodingMode = odd
    assert release_multi_query(pkg, type("Spec", (), {"spec_dec_mode": odd["NGRAM"]})()) is None


# ---- row 2: --backend auto decides by asking ----------------------------------------------------------
@pytest.fixture()
def built(group3, tmp_path):
    from trtllm_stub import write_engine_config

    out = str(tmp_path / "built")
    shutil.copytree(group3, out)
    for role in ("target", "draft"):
        write_engine_config(out, role)
    return out


def test_auto_falls_back_to_torch_with_one_line(api, group3, built, caplog):
    """The README's SmolLM2 draft bundle in small: without engines auto does not take the LLM API
    (the docs say auto needs built engines); with engines, the LLM API's own kernel check (the
    engine's refusal) makes auto serve on torch. Either way one warning line says why."""
    from specbuild.backends.select import open_engine, resolve_backend, trtllm_path

    path, why = trtllm_path(group3, auto=True)
    assert path is None and "engines not built" in why and "--backend auto takes TensorRT-LLM only where" in why
    path, why = trtllm_path(group3)  # --backend tensorrt-llm: the LLM API without engines, and its kernel check
    assert path is None and "would fail on TensorRT-LLM's LLM API" in why
    for bundle, reason in ((group3, "engines not built"), (built, "would fail on TensorRT-LLM's LLM API")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="specbuild.backends"):
            engine = open_engine(bundle, EngineConfig(), backend="auto")
        assert type(engine) is Engine
        lines = [r.getMessage() for r in caplog.records if r.name == "specbuild.backends"]
        assert len(lines) == 1 and lines[0].startswith("--backend auto: serving on torch") and reason in lines[0]
        assert "\n" not in lines[0]
    assert not api.LLM.instances  # no LLM was started only to be refused
    with pytest.raises(SpecbuildError, match="--backend tensorrt-llm cannot run .*3 query heads per KV head"):
        resolve_backend(built, "tensorrt-llm")
    # FLASHINFER attention avoids the XQA kernels: auto then takes the LLM API with it
    assert resolve_backend(built, "auto", trtllm_attn_backend="FLASHINFER")[0] == "tensorrt-llm"
    engine = open_engine(built, EngineConfig(), backend="auto", trtllm_attn_backend="FLASHINFER",
                         trtllm_ngram_impl="specbuild")
    assert type(engine) is TrtllmApiEngine and api.LLM.instances[-1].kwargs["attn_backend"] == "FLASHINFER"
    assert engine.ngram_impl == "specbuild"
    engine.close()


def test_cli_options_reach_the_llm_api(api, built, monkeypatch):
    """--trtllm-attn-backend and --trtllm-ngram-impl on generate (declared once in cli/options.py)."""
    from click.testing import CliRunner

    from specbuild.cli.main import main

    r = CliRunner().invoke(main, ["generate", built, "--prompt", "hello there", "--max-tokens", "4",
                                  "--temperature", "0", "--backend", "auto", "--trtllm-attn-backend", "FLASHINFER",
                                  "--trtllm-ngram-impl", "specbuild", "--json"])
    assert r.exit_code == 0, r.output
    assert api.LLM.instances[-1].kwargs["attn_backend"] == "FLASHINFER"
    r = CliRunner().invoke(main, ["generate", built, "--prompt", "x", "--trtllm-attn-backend", "XFORMERS"])
    assert r.exit_code == 2 and "XFORMERS" in r.output


def test_triton_repo_carries_the_llm_api_options(api, built, tmp_path):
    """triton-repo --trtllm-attn-backend / --trtllm-ngram-impl: written as the engine model's parameters,
    which tritonserver_model hands to open_engine; refused with another engine factory."""
    from click.testing import CliRunner

    from specbuild.cli.main import main
    from specbuild.serve.tritonserver_repo import RepoConfig

    out = str(tmp_path / "repo")
    r = CliRunner().invoke(main, ["triton-repo", built, "--out", out, "--trtllm-attn-backend", "flashinfer",
                                  "--trtllm-ngram-impl", "specbuild"])
    assert r.exit_code == 0, r.output
    text = open(os.path.join(out, "specbuild", "config.pbtxt")).read()
    assert 'key: "trtllm_attn_backend" value: { string_value: "FLASHINFER" }' in text
    assert 'key: "trtllm_ngram_impl" value: { string_value: "specbuild" }' in text
    with pytest.raises(ValueError, match="trtllm_attn_backend apply to the default engine factory"):
        RepoConfig(trtllm_attn_backend="FLASHINFER", engine_factory="my.module:factory")
    with pytest.raises(ValueError, match="trtllm_ngram_impl='mine' is not one of trtllm, specbuild"):
        RepoConfig(trtllm_ngram_impl="mine")


# ---- row 4: EAGLE-3 reachable on TensorRT-LLM ------------------------------------------------------------
@pytest.fixture(scope="module")
def eagle_bundle(tmp_path_factory):
    """compile --eagle HEAD --backend tensorrt-llm (no draft model)."""
    from tiny import make_tiny_eagle3

    from specbuild.compiler.compile import CompileOptions, compile_bundle

    root = tmp_path_factory.mktemp("e3")
    target = make_tiny_hf(str(root / "target"), scale=8.0, head_dim=32)
    head = make_tiny_eagle3(str(root / "head"), target)
    opts = CompileOptions(dtype="float32", max_seq_len=128, max_batch_size=4, max_draft_len=4,
                          backend="tensorrt-llm", trtllm_dtype="bfloat16")
    return compile_bundle(target, str(root / "bundle"), opts, eagle=head)


@pytest.mark.parametrize("version, field", [("1.2.0", "speculative_model"), ("1.1.0", "speculative_model_dir"),
                                            ("1.3.0", "speculative_model")])
def test_eagle3_bundle_serves_on_the_llm_api(api, eagle_bundle, monkeypatch, version, field):
    """The head is written where TensorRT-LLM's EAGLE-3 loader reads it (trtllm/hf/eagle3: config.json
    and model.safetensors in the engines' dtype, checked by the stand-in against the loader's
    tensor names), recorded as an LLM-API role, and open_engine passes it by the keyword the
    release's config has (speculative_model, or speculative_model_dir in the older llm_args.py)."""
    import json

    from safetensors import safe_open

    from specbuild.backends.select import open_engine
    from specbuild.backends.tensorrt_llm import read_trtllm_meta

    monkeypatch.setattr(stub, "STUB_VERSION", version)
    monkeypatch.setattr(stub, "STUB_MODEL_FIELD", field)
    head = os.path.join(eagle_bundle, "trtllm", "hf", "eagle3")
    assert read_trtllm_meta(eagle_bundle)["llmapi"]["models"]["eagle3"] == "hf/eagle3"
    assert json.load(open(os.path.join(head, "config.json")))["torch_dtype"] == "bfloat16"
    with safe_open(os.path.join(head, "model.safetensors"), "pt") as f:
        assert set(stub.EAGLE3_TENSORS) <= set(f.keys()) and "embed_tokens.weight" not in f.keys()
        assert str(f.get_tensor("fc.weight").dtype) == "torch.bfloat16"
    assert not os.path.exists(os.path.join(eagle_bundle, ".eagle3-trtllm"))
    engine = open_engine(eagle_bundle, EngineConfig(), backend="tensorrt-llm")
    spec = api.LLM.instances[-1].kwargs["speculative_config"]
    assert type(engine) is TrtllmApiEngine and engine.methods == ["none", "eagle3"]
    assert getattr(spec, field) == head and spec.eagle3_one_model is True
    r = engine.generate([Request(prompt_ids=PROMPT, sampling=greedy(8))])[0]
    assert len(r["token_ids"]) == 8 and r["stats"]["drafted"] > 0
    engine.close()


def test_stand_in_refuses_a_head_in_another_layout(api, eagle_bundle, tmp_path):
    """The stand-in's layout check has teeth: a Hugging Face model directory (what the head used to be
    mistaken for) is not an EAGLE-3 head."""
    with pytest.raises(ValueError, match="EAGLE-3 head .* lacks"):
        TrtllmApiEngine(eagle_bundle, EngineConfig(), eagle3_dir=os.path.join(eagle_bundle, "trtllm", "hf", "target"))


def test_eagle3_bundle_prefers_the_llm_api(eagle_bundle, tmp_path, monkeypatch):
    """With engines built on a release that has both paths, an EAGLE-3 bundle still takes the LLM API:
    its engines are plain, the head runs only there."""
    import sys

    import torch
    from trtllm_stub import write_engine_config

    from specbuild.backends.select import trtllm_path

    built = str(tmp_path / "e3built")
    shutil.copytree(eagle_bundle, built)
    write_engine_config(built, "target")
    monkeypatch.delenv(TEST_STUB_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pkg = stub.package()
    pkg.__version__ = "1.2.0"
    monkeypatch.setitem(sys.modules, "tensorrt_llm", pkg)
    monkeypatch.setattr("specbuild.backends.tensorrt_llm_api.llmapi_package", lambda: pkg)
    assert trtllm_path(built, auto=True) == ("llmapi", "")


def test_triton_model_hands_the_options_to_open_engine(monkeypatch):
    """tritonserver_model reads the parameters triton-repo wrote and passes them to the default factory."""
    import specbuild.backends.select as select
    from specbuild.serve import tritonserver_model as triton_model
    from specbuild.serve.tritonserver_repo import DEFAULT_FACTORY

    seen = {}

    class Stop(Exception):
        pass

    def factory(bundle, config, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(select, "open_engine", factory)
    with pytest.raises(Stop):
        triton_model.EngineModel({"name": "specbuild"}, {"bundle": "b", "engine_factory": DEFAULT_FACTORY,
                                                         "backend": "auto", "trtllm_attn_backend": "FLASHINFER",
                                                         "trtllm_ngram_impl": "specbuild"})
    assert seen == {"backend": "auto", "trtllm_attn_backend": "FLASHINFER", "trtllm_ngram_impl": "specbuild"}
