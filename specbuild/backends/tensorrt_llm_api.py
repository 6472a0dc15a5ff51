"""The TensorRT-LLM 1.x backend: specbuild requests served by TensorRT-LLM's LLM API on its
PyTorch backend (the path NVIDIA keeps after removing the TensorRT engine path).

    LLM(model=<bundle>/trtllm/hf/target, speculative_config=..., ...)
    result = llm.generate_async(prompt_token_ids, SamplingParams(...), streaming=True)
    for out in result: out.outputs[0].token_ids_diff ...       # one engine iteration each

Speculation is fixed when the LLM starts (one `speculative_config`), so a bundle's LLM-API
engine serves one method besides `none` (which then runs through the same speculating LLM;
greedy output is the target's either way):

    draft    DraftTargetDecodingConfig(max_draft_len, speculative_model_dir=trtllm/hf/draft)
    ngram    NGramDecodingConfig(max_draft_len, max_matching_ngram_size) (the default), or
             UserProvidedDecodingConfig(max_draft_len, drafter=specbuild's prompt lookup) with
             ngram_impl="specbuild" (backends/tensorrt_llm_drafter.py: a module-level class, so it
             pickles into TensorRT-LLM's executor worker)
    eagle3   Eagle3DecodingConfig(max_draft_len, speculative_model_dir=an EAGLE-3 head dir), or
             EagleDecodingConfig(..., eagle3_one_model=True) on releases without it (eagle3_config_class)

Why NGramDecodingConfig is the default for ngram: it is TensorRT-LLM's own n-gram drafter, run
inside its executor with nothing of specbuild's crossing the process boundary, and NVIDIA keeps
it (a later hw_agnostic/test_user_provided.py speaks of "the retired host NGram drafter" that a
user-provided one now only imitates, i.e. NGram itself moved on); greedy output is the target's
either way. specbuild's own lookup stays available (ngram_impl="specbuild") where proposals must
match the torch backend's.

Kernels: a speculating target in multi-token query mode on the LLM API's default TRTLLM
attention runs on the speculative XQA kernels, so a target whose query group per rank is not a
power of two (SmolLM2-135M: 9/3) is refused at load with the tensor_parallel_size values that
work; `attn_backend="FLASHINFER"` avoids that path. Whether the target is in that mode is asked
of the installed release (`release_multi_query`: its `_torch/speculative/interface.py`), and
taken from formats/trtllm_support.table_multi_query only where that cannot be asked.
`llmapi_problem` runs these checks without starting an LLM (select.trtllm_path asks it).

Medusa is not in the PyTorch backend's speculative support: Medusa bundles need the engine
path (backends/tensorrt_llm.py, tensorrt_llm>=0.19,<1.3).

API matched (NVIDIA/TensorRT-LLM, read for names and signatures only): `tensorrt_llm/llmapi/
llm.py` (LLM(model, tokenizer, ..., skip_tokenizer_init, tensor_parallel_size, dtype, **kwargs),
generate_async(inputs, sampling_params, ..., streaming) -> RequestOutput, shutdown) at commit
00966934; `executor/result.py` (GenerationResult: sync iteration, one response per step,
outputs[0].token_ids / token_ids_diff / finish_reason in stop|length|timeout|cancelled,
finished, abort(), request_id) at 005bc848; `sampling_params.py` (SamplingParams kw-only:
end_id, pad_id, max_tokens, stop_token_ids, top_k, top_p, seed, temperature, ignore_eos,
detokenize) at 000a01de (v1.0.0rc4); `llmapi/llm_args.py` (DecodingBaseConfig.max_draft_len,
speculative_model with alias speculative_model_dir; DraftTargetDecodingConfig,
NGramDecodingConfig, Eagle3DecodingConfig, UserProvidedDecodingConfig(drafter,
resource_manager)) at several commits; `_torch/speculative/drafter.py` (Drafter:
prepare_draft_tokens(scheduled_requests, resource_manager=None) setting each generation
request's py_draft_tokens from request.get_tokens(0)).
"""

from __future__ import annotations

import collections
import importlib
import logging
import os
import queue
import threading
import time
from typing import Any

from specbuild.engine.guarantees import guarantees
from specbuild.bundle import BundleMeta, check_fingerprint, read_meta, read_model_config
from specbuild.backends.tensorrt_llm import LLMAPI_STUB_ENV, ExecutorEngine, load_stand_in, refuse_torch_only
from specbuild.engine.base import validated_prompt_ids
from specbuild.engine.engine import EngineConfig
from specbuild.engine.sequence import Event, Request, Sequence
from specbuild.speculation.speculator import Verdict
from specbuild.errors import BundleError, RequestError
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig

log = logging.getLogger("specbuild.trtllm_api")

API_METHODS = ("draft", "ngram", "eagle3")
NGRAM_IMPLS = ("trtllm", "specbuild")
ATTN_BACKENDS = ("TRTLLM", "FLASHINFER", "VANILLA")  # _torch/attention_backend/utils.get_attention_backend
# Test-only, like backends/tensorrt_llm.TEST_STUB_ENV: "module:factory" returning a stand-in for
# the `tensorrt_llm` package (tests/helpers/trtllm_api_stub.py); it must say it is one.
TEST_STUB_ENV = LLMAPI_STUB_ENV


def _stand_in():
    return load_stand_in(TEST_STUB_ENV, "package", "TensorRT-LLM's LLM API")


def llmapi_package():
    """The `tensorrt_llm` package (or the test stand-in), refused in one line when its release has
    no LLM API on the PyTorch backend (formats/trtllm_support.llmapi_path_problem)."""
    from specbuild.formats.trtllm_support import llmapi_path_problem

    pkg = _stand_in()
    if pkg is None:
        import tensorrt_llm as pkg  # noqa: PLC0415 (only where it is installed)
    problem = llmapi_path_problem(str(getattr(pkg, "__version__", "unknown")))
    if problem:
        raise BundleError(problem)
    return pkg


def _submodule(pkg, name: str):
    """pkg.<name> for the real package (imported) or the stand-in (an attribute chain)."""
    obj = pkg
    try:
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj
    except AttributeError:
        return importlib.import_module(f"{pkg.__name__}.{name}")


def speculative_config(pkg, method: str, *, max_draft_len: int, models: dict[str, str], drafter=None,
                       ngram_impl: str = "trtllm", ngram_max: int = 3):
    """The LLM's speculative_config for `method` (none -> None), with TensorRT-LLM's own classes."""
    if method == "none":
        return None
    llmapi = _submodule(pkg, "llmapi")
    if method == "draft":
        cls = llmapi.DraftTargetDecodingConfig
        return cls(max_draft_len=max_draft_len, **{model_keyword(cls): models["draft"]})
    if method == "ngram" and ngram_impl == "trtllm":
        return llmapi.NGramDecodingConfig(max_draft_len=max_draft_len, max_matching_ngram_size=ngram_max)
    if method == "ngram":
        return llmapi.UserProvidedDecodingConfig(max_draft_len=max_draft_len, drafter=drafter)
    if method == "eagle3":
        cls, extra = eagle3_config_class(pkg)
        return cls(max_draft_len=max_draft_len, **{model_keyword(cls): models["eagle3"]}, **extra)
    raise BundleError(f"method {method!r} has no LLM-API speculative config (known: none, {', '.join(API_METHODS)})")


def model_keyword(cls: type) -> str:
    """The keyword a decoding config of the installed release takes the draft / EAGLE-3 model
    directory by. llmapi/llm_args.py: DecodingBaseConfig has `speculative_model_dir` in the stored
    1.x files that also have max_total_draft_tokens; later files name the field `speculative_model`
    with validation_alias AliasChoices("speculative_model", "speculative_model_dir"). The field the
    class has is passed, so neither release depends on the other's alias."""
    return "speculative_model" if _has_field(cls, "speculative_model") else "speculative_model_dir"


# Eagle3DecodingConfig(EagleDecodingConfig) with decoding_type "Eagle3" is in the later llmapi/llm_args.py files;
# tensorrt_llm/llmapi/__init__.py at commit 5ca85aff (a 1.x file: it still exports TrtLlmArgs, i.e. before the
# engine path's removal) exports EagleDecodingConfig, DraftTargetDecodingConfig, NGramDecodingConfig and
# UserProvidedDecodingConfig but no Eagle3DecodingConfig; there EAGLE-3 is EagleDecodingConfig(eagle3_one_model=
# True) (llm_args.py: `eagle3_one_model: Optional[bool] = True`, spec_dec_mode EAGLE3_ONE_MODEL when set, else
# EAGLE3). The first release exporting Eagle3DecodingConfig could not be read; but an llm_args.py that defines it
# still imports `from ..builder import BuildConfig, EngineConfig`, i.e. it predates the engine path's removal, so
# every release without the engine path (1.3 on, formats/trtllm_support.ENGINE_PATH_END) has it: there specbuild
# requires it.
EAGLE3_CLASS_FROM = (1, 3)


def eagle3_config_class(pkg) -> tuple[type, dict]:
    """(class, extra keywords) of the EAGLE-3 speculative_config of the installed release, chosen
    by its version: from 1.3 `Eagle3DecodingConfig`; before, `Eagle3DecodingConfig` where the
    release exports it, else `EagleDecodingConfig(eagle3_one_model=True)`. BundleError naming the
    version where the release has neither."""
    from specbuild.formats.trtllm_support import release

    version = str(getattr(pkg, "__version__", "unknown"))
    rel = release(version) or ()
    llmapi = _submodule(pkg, "llmapi")
    if hasattr(llmapi, "Eagle3DecodingConfig"):
        return llmapi.Eagle3DecodingConfig, {}
    if rel[:2] >= EAGLE3_CLASS_FROM:
        raise BundleError(f"TensorRT-LLM {version} exports no tensorrt_llm.llmapi.Eagle3DecodingConfig, which its "
                          "release line should have: reinstall tensorrt_llm, or serve EAGLE-3 on --backend torch")
    eagle = getattr(llmapi, "EagleDecodingConfig", None)
    if eagle is not None and _has_field(eagle, "eagle3_one_model"):
        return eagle, {"eagle3_one_model": True}
    raise BundleError(f"TensorRT-LLM {version} has neither Eagle3DecodingConfig nor EagleDecodingConfig with "
                      "eagle3_one_model in tensorrt_llm.llmapi, so no EAGLE-3 on its LLM API: install "
                      f"tensorrt_llm>={'.'.join(map(str, EAGLE3_CLASS_FROM))} (or a 1.x release whose "
                      "EagleDecodingConfig takes eagle3_one_model), or serve EAGLE-3 on --backend torch")


def _has_field(cls: type, name: str) -> bool:
    fields = getattr(cls, "model_fields", None)  # pydantic v2 (the real configs)
    if isinstance(fields, dict):
        return name in fields
    return name in (getattr(cls, "fields", None) or {}) or hasattr(cls, name)  # the stand-in's


def make_drafter(pkg, max_draft_len: int, ngram_min: int, ngram_max: int):
    """A `Drafter` (tensorrt_llm._torch.speculative.drafter) proposing specbuild's prompt lookup;
    a module-level class (backends/tensorrt_llm_drafter.py) so it pickles into the worker."""
    from specbuild.backends.tensorrt_llm_drafter import PromptLookupDrafter

    base = _submodule(pkg, "_torch.speculative.drafter").Drafter
    if not issubclass(PromptLookupDrafter, base):
        raise BundleError("specbuild's prompt-lookup drafter was imported against another TensorRT-LLM Drafter "
                          "class than the one now loaded: restart the process")
    return PromptLookupDrafter(max_draft_len, ngram_min, ngram_max)


def release_multi_query(pkg, spec, attn_backend: str | None = None) -> bool | None:
    """Ask the installed release whether the target of `spec` (the speculative_config the LLM gets)
    runs in multi-token query mode, i.e. on the speculative XQA kernels: the mode's own
    `attention_need_spec_dec_mode(...)` and not `extend_ctx(attention class)`, from
    tensorrt_llm/_torch/speculative/interface.py (SpeculativeDecodingMode), with the attention class
    from _torch/attention_backend/utils.get_attention_backend. The arguments are passed by the
    signature the release has: (self) in the 1.0 line's file, (spec_resource_manager, is_draft_model,
    attention_backend, use_chain_drafter) at commit 00b6d5a2. None where the release has no such
    functions or they cannot be called here (formats/trtllm_support.table_multi_query decides then)."""
    import inspect

    mode = getattr(spec, "spec_dec_mode", None)
    if spec is None or mode is None or not hasattr(mode, "attention_need_spec_dec_mode"):
        return None
    try:
        modes = _submodule(pkg, "_torch.speculative.interface").SpeculativeDecodingMode
        if not isinstance(mode, modes):
            return None
        attention = _submodule(pkg, "_torch.attention_backend.utils").get_attention_backend(attn_backend or "TRTLLM")
        known = {"spec_resource_manager": None, "is_draft_model": False, "attention_backend": attention,
                 "use_chain_drafter": False}
        params = inspect.signature(mode.attention_need_spec_dec_mode).parameters
        if any(p.default is p.empty and name not in known for name, p in params.items()):
            return None  # a signature not read: the table decides
        need = bool(mode.attention_need_spec_dec_mode(**{k: v for k, v in known.items() if k in params}))
        extend = bool(mode.extend_ctx(attention)) if hasattr(mode, "extend_ctx") else False
    except Exception as e:  # ImportError, AttributeError, a CUDA query failing: the table decides
        log.debug("could not ask TensorRT-LLM's interface.py: %s: %s", type(e).__name__, e)
        return None
    return need and not extend


def default_method(default: SpeculationConfig, models: dict[str, str]) -> str:
    """The method an LLM-API engine serves when none is named: EAGLE-3 where the bundle has its head,
    else the bundle's default method where the LLM API has it, else none."""
    return "eagle3" if "eagle3" in models else default.method if default.method in API_METHODS else "none"


def bundle_models(bundle_dir: str, trt_meta: dict) -> dict[str, str]:
    """role -> the Hugging Face directory the LLM API loads (trtllm/hf/<role>)."""
    api = trt_meta.get("llmapi") or {}
    root = os.path.join(bundle_dir, "trtllm")
    return {role: os.path.join(root, rel) for role, rel in (api.get("models") or {}).items()}


def kernel_refusal(pkg, target_config, *, method: str, spec, tp: int, dtype: str,
                   attn_backend: str | None) -> str | None:
    """Why this target would fail on the release's LLM API at its first speculative step, or None
    (formats/trtllm_support.llmapi_kernel_problems, with the release's own answer where it can be asked)."""
    from specbuild.formats.trtllm_support import llmapi_kernel_problems

    asked = release_multi_query(pkg, spec, attn_backend) if method != "none" else None
    problems = llmapi_kernel_problems(target_config, method=method, version=str(pkg.__version__), dtype=dtype,
                                      tp=tp, sm=cuda_sm(), attn_backend=attn_backend, multi_query=asked)
    return "this bundle's target would fail on TensorRT-LLM's LLM API: " + "; ".join(problems) if problems else None


def llmapi_problem(bundle_dir: str, *, attn_backend: str | None = None, ngram_impl: str = "trtllm") -> str | None:
    """Why TrtllmApiEngine(bundle_dir, attn_backend=..., ngram_impl=...) would refuse this bundle
    here, or None: the same checks the engine runs before its LLM starts (select.trtllm_path asks
    this, so `--backend auto` falls back instead of ending in the engine's refusal)."""
    from specbuild.backends.tensorrt_llm import read_trtllm_meta

    try:
        meta = read_meta(bundle_dir)
        trt_meta = read_trtllm_meta(bundle_dir)
        models = bundle_models(bundle_dir, trt_meta)
        default = SpeculationConfig.make(None, **dict(meta.default_speculation))
        method = default_method(default, models)
        pkg = llmapi_package()
        max_draft_len = int(trt_meta["limits"]["max_draft_len"] or default.gamma_max)
        drafter = (make_drafter(pkg, max_draft_len, default.ngram_min, default.ngram_max)
                   if method == "ngram" and ngram_impl == "specbuild" else None)
        spec = speculative_config(pkg, method, max_draft_len=max_draft_len, models=models, drafter=drafter,
                                  ngram_impl=ngram_impl, ngram_max=default.ngram_max)
        target = read_model_config(os.path.join(bundle_dir, meta.roles["target"]["path"]))
        return kernel_refusal(pkg, target, method=method, spec=spec, tp=int((trt_meta.get("llmapi") or {}).get(
            "tp", 1)), dtype=trt_meta.get("dtype", "bfloat16"), attn_backend=attn_backend)
    except (BundleError, ValueError, ImportError) as e:
        return str(e)


def cuda_sm() -> int | None:
    """major*10 + minor of GPU 0 (90 for Hopper), or None without CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return major * 10 + minor
    except Exception:  # a broken CUDA install: unknown, treated as SM < 120 by the checks
        return None
    return None


class TrtllmApiEngine(ExecutorEngine):
    """A bundle served by TensorRT-LLM's LLM API behind the request-level backend interface.

    Each running request has one streaming `generate_async` result, read by a thread of its own
    (the result's iteration blocks); `step()` turns what the readers queued into events, so the
    handles, stop strings, detokenisation and stats are the torch engine's code."""

    backend_name = "tensorrt-llm"
    path = "llmapi"
    poll_ms = 2

    def __init__(self, bundle_dir: str, config: EngineConfig = EngineConfig(), *, method: str | None = None,
                 eagle3_dir: str | None = None, ngram_impl: str = "trtllm", attn_backend: str | None = None) -> None:
        t0 = time.perf_counter()
        from tokenizers import Tokenizer

        from specbuild.backends.tensorrt_llm import read_trtllm_meta

        self.bundle_dir, self.config = bundle_dir, config
        self.meta: BundleMeta = read_meta(bundle_dir)
        self.tokenizer = Tokenizer.from_str(check_fingerprint(bundle_dir, self.meta))
        self.trt_meta = read_trtllm_meta(bundle_dir)
        api = self.trt_meta.get("llmapi") or {}
        models = bundle_models(bundle_dir, self.trt_meta)
        if eagle3_dir is not None:
            models["eagle3"] = eagle3_dir
        if "target" not in models:
            raise BundleError(f"bundle {bundle_dir!r} has no Hugging Face target for the LLM-API path "
                              "(trtllm/hf/target): recompile it with --backend tensorrt-llm")
        if self.trt_meta["mode"] == "medusa":
            raise BundleError("Medusa is not in TensorRT-LLM's PyTorch-backend speculative decoding: serve this "
                              "bundle on the engine path (tensorrt_llm>=0.19,<1.3) or on --backend torch")
        bundle_limits = self.trt_meta["limits"]
        self.max_seq_len = int(bundle_limits["max_seq_len"])
        self.max_batch_size = int(config.max_batch_size or bundle_limits["max_batch_size"])
        self.target_config = read_model_config(os.path.join(bundle_dir, self.meta.roles["target"]["path"]))
        default = SpeculationConfig.make(None, **dict(self.meta.default_speculation))
        if method is None:
            method = default_method(default, models)
        if method not in ("none",) + API_METHODS:
            raise BundleError(f"method {method!r} is not served on the LLM-API path (none, {', '.join(API_METHODS)})")
        if method in ("draft", "eagle3") and method not in models:
            raise BundleError(f"method {method!r} needs its model: {'compile with --draft' if method == 'draft' else 'compile with --eagle, or pass eagle3_dir (an EAGLE-3 head directory)'}")
        self.method = method
        self.max_draft_len = int(bundle_limits["max_draft_len"] or default.gamma_max) if method != "none" else 0
        if ngram_impl not in NGRAM_IMPLS:
            raise BundleError(f"ngram_impl {ngram_impl!r}: use 'trtllm' (NGramDecodingConfig) or 'specbuild' "
                              "(specbuild's prompt lookup through UserProvidedDecodingConfig)")
        self.ngram_impl = ngram_impl
        if attn_backend is not None and attn_backend.upper() not in ATTN_BACKENDS:
            raise BundleError(f"attn_backend {attn_backend!r} is not one of {', '.join(ATTN_BACKENDS)} (TensorRT-LLM's "
                              "_torch/attention_backend/utils.get_attention_backend)")
        attn_backend = attn_backend.upper() if attn_backend is not None else None

        self._pkg = llmapi_package()
        drafter = None
        if method == "ngram" and ngram_impl == "specbuild":
            drafter = make_drafter(self._pkg, self.max_draft_len, default.ngram_min, default.ngram_max)
        spec = speculative_config(self._pkg, method, max_draft_len=self.max_draft_len, models=models,
                                  drafter=drafter, ngram_impl=ngram_impl, ngram_max=default.ngram_max)
        self._check_kernels(method, int(api.get("tp", 1)), attn_backend, spec)
        dtype = self.trt_meta.get("dtype", "bfloat16")
        kw: dict[str, Any] = dict(skip_tokenizer_init=True, tensor_parallel_size=int(api.get("tp", 1)), dtype=dtype,
                                  max_batch_size=self.max_batch_size,
                                  max_seq_len=self.max_seq_len + self.max_draft_len)
        if spec is not None:
            kw["speculative_config"] = spec
        if attn_backend is not None:
            kw["attn_backend"] = attn_backend
        self.llm = self._pkg.LLM(model=models["target"], **kw)
        self.is_leader, self.rank = True, 0  # the LLM API spawns its own MPI workers
        sp = self.meta.special_tokens
        self.eos_ids = tuple(sp.get("eos_token_ids") or ([sp["eos_token_id"]] if sp.get("eos_token_id") is not None
                                                         else []))
        self.default_sampling = SamplingParams.from_dict(dict(self.meta.default_sampling))
        cap = self.max_draft_len or default.gamma_max
        self.default_speculation = SpeculationConfig.make(
            default, method=method, gamma_min=min(default.gamma_min, cap), gamma_max=min(default.gamma_max, cap),
            gamma=min(default.gamma, cap))
        self._results: dict[int, Any] = {}  # seq_id -> its generate_async result
        self._inbox: queue.Queue = queue.Queue()
        self._backlog: dict[int, collections.deque] = {}  # seq_id -> its iterations not yet turned into events
        self._init_loop(threading.RLock())
        self._iterations: dict[int, int] = {}  # seq_id -> generation iterations seen
        self.load_seconds = time.perf_counter() - t0

    def _check_kernels(self, method: str, tp: int, attn_backend: str | None, spec=None) -> None:
        """Refuse, before the LLM starts, a speculating target the installed release would send to
        XQA kernels it has none for (kernel_refusal: the release's own interface.py where it can be
        asked, else formats/trtllm_support's table)."""
        why = kernel_refusal(self._pkg, self.target_config, method=method, spec=spec, tp=tp,
                             dtype=self.trt_meta.get("dtype", "bfloat16"), attn_backend=attn_backend)
        if why:
            raise BundleError(why)

    # ---- what this engine serves ------------------------------------------------------------
    @property
    def methods(self) -> list[str]:
        return ["none"] + ([self.method] if self.method != "none" else [])

    def describe_guarantees(self) -> dict:
        table = guarantees("tensorrt-llm", mode="none", methods=["none"])
        if self.method != "none":
            how = {"draft": "TensorRT-LLM DraftTargetDecodingConfig (PyTorch backend)",
                   "ngram": "specbuild's prompt lookup through UserProvidedDecodingConfig" if self.ngram_impl ==
                   "specbuild" else "TensorRT-LLM NGramDecodingConfig",
                   "eagle3": f"TensorRT-LLM {eagle3_config_class(self._pkg)[0].__name__} (EAGLE-3)"}[self.method]
            table["methods"][self.method] = {"greedy": "lossless", "sampled": "refused",
                                             "acceptance": how + "; drafts accepted while equal to the target's "
                                                                 "argmax (sampled speculation is not checked here)"}
            table["methods"]["none"] = {"greedy": "lossless", "sampled": "refused",
                                        "acceptance": f"served by the speculating LLM ({self.method}): the LLM API "
                                                      "fixes speculation when it starts, so greedy-only"}
        table["notes"] = [f"TensorRT-LLM LLM API (PyTorch backend), {self._pkg.__version__}: it owns the KV cache, "
                          "batching and acceptance; specbuild streams the tokens and counts acceptance per iteration",
                          "drafted counts max_draft_len per generation iteration (an upper bound: the LLM API "
                          "reports no per-request draft counts); accepted is the iteration's tokens minus one"]
        return table

    def resolve_speculation(self, request: Request, params: SamplingParams) -> SpeculationConfig:
        spec = SpeculationConfig.for_request(request.speculation, self.default_speculation)
        cap = self.max_draft_len or self.trt_meta["limits"]["max_draft_len"]
        if spec.method != "none" and spec.gamma_max > cap:
            raise RequestError(f"Number of draft tokens ({spec.gamma_max}) > maximum ({cap}) of this LLM's "
                               "speculative_config: lower --gamma-max, or recompile with a larger --max-draft-len")
        if spec.method not in self.methods:
            raise RequestError(f"speculation method {spec.method!r} is not available on this TensorRT-LLM LLM-API "
                               f"engine (available: {', '.join(self.methods)}; the LLM API fixes it at start)")
        if spec.typical:
            raise RequestError("typical acceptance is not available on the tensorrt-llm backend (torch only)")
        if not params.greedy and self.method != "none":
            raise RequestError(f"sampled requests are refused on this TensorRT-LLM LLM-API engine: it speculates "
                               f"({self.method}) for every request and its sampled acceptance is not checked "
                               "lossless here; use temperature 0, or the torch backend")
        return spec

    # ---- requests -----------------------------------------------------------------------------
    def _new_sequence(self, request: Request) -> Sequence:
        """Validate a request (BaseEngine.submit queues it). RequestError: nothing queued."""
        prompt_ids = validated_prompt_ids(request, self.encode, self.target_config.vocab_size, self.max_seq_len)
        params = request.sampling.with_seed()
        refuse_torch_only(request, params)
        spec = self.resolve_speculation(request, params)
        return Sequence(request, prompt_ids, params, spec, self.tokenizer, self.eos_ids, self.max_seq_len)

    def _release(self, seq: Sequence) -> None:
        self._backlog.pop(seq.seq_id, None)
        self._iterations.pop(seq.seq_id, None)
        result = self._results.pop(seq.seq_id, None)
        if result is not None and not result.finished:
            result.abort()
        if seq in self.running:
            self.running.remove(seq)

    def _sampling_params(self, seq: Sequence):
        p = seq.params
        eos = [] if p.ignore_eos else list(self.eos_ids) + list(p.stop_token_ids)
        kw: dict[str, Any] = {"max_tokens": min(p.max_tokens, self.max_seq_len - seq.total_len),
                              "end_id": eos[0] if eos else -1, "pad_id": eos[0] if eos else 0,
                              "stop_token_ids": eos[1:] or None, "ignore_eos": p.ignore_eos, "detokenize": False}
        if p.greedy:
            kw["top_k"] = 1
        else:
            kw.update(temperature=float(p.temperature), seed=int(seq.uniforms(1)[0] * (1 << 62)))
            if p.top_k:
                kw["top_k"] = p.top_k
            if p.top_p < 1.0:
                kw["top_p"] = float(p.top_p)
        return self._pkg.SamplingParams(**kw)

    def _launch(self, seq: Sequence) -> None:
        result = self.llm.generate_async(list(seq.all_ids), sampling_params=self._sampling_params(seq),
                                         streaming=True)
        self._results[seq.seq_id] = result
        threading.Thread(target=self._read, args=(seq, result), name="specbuild-trtllm-reader", daemon=True).start()

    def _read(self, seq: Sequence, result) -> None:
        """The reader of one request: each streamed iteration to the inbox, then a final marker."""
        try:
            for out in result:
                o = out.outputs[0]
                self._inbox.put((seq, list(o.token_ids_diff), out.finished, o.finish_reason, None))
        except Exception as e:  # an executor error for this request: its failure, not the engine's
            self._inbox.put((seq, [], True, None, f"TensorRT-LLM: {type(e).__name__}: {e}"))

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> int:
        with self._lock:
            while self.waiting and len(self.running) < self.max_batch_size:
                seq = self.waiting.popleft()
                seq.tally.on_admit()
                self.running.append(seq)
                self._iterations[seq.seq_id] = 0
                self._launch(seq)
        arrived = []  # what the readers queued (outside the lock: abort() must not wait on it)
        try:
            arrived.append(self._inbox.get(timeout=self.poll_ms / 1000))
            while True:
                arrived.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        with self._lock:  # in arrival order per request; one iteration per request per step
            for item in arrived:
                if item[0].seq_id in self._results:
                    self._backlog.setdefault(item[0].seq_id, collections.deque()).append(item)
            items = [q.popleft() for q in self._backlog.values()]
            self._backlog = {k: q for k, q in self._backlog.items() if q}
            return sum(self._on_item(*item) for item in items)

    def _on_item(self, seq: Sequence, tokens: list[int], final: bool, reason, error) -> int:
        if seq.finished or seq.seq_id not in self._results:
            return 0  # aborted or stopped by specbuild: what its cancelled result still said
        if error:
            self._release(seq)
            self._fail(seq, error)
            return 1
        iteration = self._iterations.get(seq.seq_id, 0)
        self._iterations[seq.seq_id] = iteration + 1
        # the first answer is the prompt's (context) iteration: a target pass that decodes nothing yet
        seq.tally.on_pass(self._verdict(len(tokens)) if iteration > 0 and self.method != "none"
                          else Verdict(tokens, 0, [], 0))
        before = len(seq.text)
        kept = seq.append_tokens(tokens) if tokens else []
        if not seq.finished and final:
            seq._finish({"length": "length", "cancelled": "abort"}.get(reason, "stop"))
        if seq.handle is not None and (kept or seq.finished):
            seq.handle._emit(Event(kept, seq.text[before:], seq.finished, seq.finish_reason))
        if seq.finished:
            self._release(seq)
        return 1

    def _verdict(self, produced: int) -> Verdict:
        """One generation iteration that produced `produced` tokens: produced - 1 drafts accepted of
        max_draft_len (an upper bound of what was drafted: the LLM API reports no per-request draft
        counts, and the drafter may run in TensorRT-LLM's worker process, out of specbuild's sight)."""
        drafted = self.max_draft_len
        return self._verification(drafted, min(max(produced - 1, 0), drafted), drafted)

    def close(self) -> None:
        self.stop()
        with self._lock:
            for seq in list(self.running):
                self._release(seq)
        self.llm.shutdown()

    def wait_as_worker(self) -> None:  # the LLM API runs its own workers; every caller is the leader
        return None
