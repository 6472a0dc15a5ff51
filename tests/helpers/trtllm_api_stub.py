"""A stand-in for TensorRT-LLM 1.x's LLM API (PyTorch backend), to run specbuild's LLM-API
adapter (specbuild/backends/tensorrt_llm_api.py) without TensorRT-LLM or a GPU. It checks the
adapter's logic (streaming, speculative configs, the user-provided drafter, abort, limits), NOT
TensorRT-LLM.

Its names and signatures follow the real sources (see the adapter's docstring for files and
commits): `LLM(model, tokenizer=None, tokenizer_mode, skip_tokenizer_init, trust_remote_code,
tensor_parallel_size, dtype, revision, tokenizer_revision, **kwargs)` with kwargs checked like
TorchLlmArgs (unknown ones refused), `generate_async(inputs, sampling_params, lora_request,
prompt_adapter_request, streaming, ...)`, a result iterated one engine iteration at a time with
`outputs[0].token_ids / token_ids_diff / finish_reason`, `finished`, `abort()`, `request_id`;
`SamplingParams` kw-only; the decoding configs' validators (max_draft_len > 0, a draft model for
DraftTarget and Eagle3); `Drafter.prepare_draft_tokens(scheduled_requests, resource_manager)`
setting `py_draft_tokens` on each generation request (`get_tokens(0)`, `py_request_id`).

What the real LLM API enforces, and the stand-in too: the speculative config is pickled into the
executor worker unless TLLM_WORKER_USE_SINGLE_PROCESS=1 (so a drafter must pickle); a speculating
target on TRTLLM attention needs an XQA kernel (power-of-two query group per rank, fp16/bf16) as
on SM < 120; a user-provided drafter whose drafts are padded must set
`_needs_padding_kv_extension`; `Eagle3DecodingConfig` is exported from 1.3 only (before:
`EagleDecodingConfig(eagle3_one_model=True)`), and STUB_HIDDEN removes names for a test.

Tokens come from the torch oracle (greedy; sampled requests are answered greedily too, which
the adapter refuses on speculating engines anyway). Drafts: the user-provided drafter's own;
DraftTarget / Eagle3 / NGram propose the oracle's continuation with every third token corrupted,
so some are rejected. An iteration yields the accepted drafts plus one token.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import json
import os
import pickle
import types
from typing import Any, List, Optional

from trtllm_stub import oracle

from specbuild.formats.trtllm_support import release

STUB_VERSION = "1.2.0"
STUB_HIDDEN: set[str] = set()  # llmapi names a test removes, to stand in for a release without them
# ("interface" removes _torch/speculative/interface.py's decision functions, so specbuild falls back to its table)
STUB_SM = 90  # what the stand-in's get_sm_version() answers: a Hopper GPU
EAGLE3_CLASS_FROM = (1, 3)  # the stand-in exports Eagle3DecodingConfig from this release (before: EagleDecodingConfig)
_TORCH_LLM_ARGS = {"speculative_config", "max_batch_size", "max_seq_len", "max_num_tokens", "kv_cache_config",
                   "enable_chunked_prefill", "disable_overlap_scheduler", "cuda_graph_config", "attn_backend"}


# ---- _torch/speculative/interface.py and _torch/attention_backend, by release -------------------------
# The rules as read (formats/trtllm_support.py's table cites them): the 1.0 line's file has
# attention_need_spec_dec_mode(self) = one-model EAGLE-3 only and extend_ctx true off SM 100; commit
# 00b6d5a2 (1.1 on) takes (spec_resource_manager, is_draft_model, attention_backend, use_chain_drafter)
# and puts two-model targets on TRTLLM attention in multi-token query mode, extend_ctx where SM >= 120;
# from 1.3 DraftTargetDecodingConfig's mode is DRAFT_TARGET_ONE_MODEL (an external drafter: one engine).
class AttentionBackend:
    pass


class TrtllmAttention(AttentionBackend):
    pass


class FlashInferAttention(AttentionBackend):
    pass


class VanillaAttention(AttentionBackend):
    pass


def get_attention_backend(backend_name: str):
    return {"VANILLA": VanillaAttention, "FLASHINFER": FlashInferAttention}.get(backend_name, TrtllmAttention)


def get_sm_version() -> int:
    return STUB_SM


_MODES = ["EAGLE3", "EAGLE3_ONE_MODEL", "NGRAM", "DRAFT_TARGET", "DRAFT_TARGET_ONE_MODEL", "USER_PROVIDED", "NONE"]


class _ModeCommon:
    def use_one_engine(self):
        return self.name in ("EAGLE3_ONE_MODEL", "DRAFT_TARGET_ONE_MODEL")


class _Rules10(_ModeCommon):
    def extend_ctx(self, attention_backend):
        if self.use_one_engine():
            return False
        return not issubclass(attention_backend, TrtllmAttention) or get_sm_version() != 100

    def attention_need_spec_dec_mode(self):
        return self.name == "EAGLE3_ONE_MODEL"


class _Rules11(_ModeCommon):
    def extend_ctx(self, attention_backend):
        if self.use_one_engine():
            return False
        return not issubclass(attention_backend, TrtllmAttention) or not get_sm_version() < 120

    def attention_need_spec_dec_mode(self, spec_resource_manager, is_draft_model, attention_backend,
                                     use_chain_drafter):
        trtllm = issubclass(attention_backend, TrtllmAttention)
        return self.use_one_engine() or (not is_draft_model and trtllm)


SpeculativeDecodingMode10 = enum.IntEnum("SpeculativeDecodingMode", _MODES, type=_Rules10)
SpeculativeDecodingMode11 = enum.IntEnum("SpeculativeDecodingMode", _MODES, type=_Rules11)


def _mode_class():
    rel = release(STUB_VERSION) or (9,)
    return SpeculativeDecodingMode10 if rel[:2] < (1, 1) else SpeculativeDecodingMode11


def _mode(name: str):
    return _mode_class()[name]


def multi_query(spec, attn_backend) -> bool:
    """What the stand-in's release decides for this target (the LLM refuses a group its XQA lacks)."""
    mode, attention = spec.spec_dec_mode, get_attention_backend(attn_backend or "TRTLLM")
    if isinstance(mode, SpeculativeDecodingMode10):
        need = mode.attention_need_spec_dec_mode()
    else:
        need = mode.attention_need_spec_dec_mode(None, False, attention, False)
    return bool(need) and not mode.extend_ctx(attention)


# llmapi/llm_args.py: the draft model's field is `speculative_model_dir` (no alias) in the stored 1.x files with
# max_total_draft_tokens, `speculative_model` with the alias speculative_model_dir in later ones
STUB_MODEL_FIELD = "speculative_model"


class _Fields(type):
    @property
    def model_fields(cls) -> dict[str, Any]:
        """The fields as the stand-in's release names them (pydantic's model_fields)."""
        out = dict(cls.fields)
        if STUB_MODEL_FIELD != "speculative_model" and "speculative_model" in out:
            out[STUB_MODEL_FIELD] = out.pop("speculative_model")
        return out


class _Base(metaclass=_Fields):
    """pydantic-like: keyword fields only, unknown ones refused (StrictBaseModel)."""

    fields: dict[str, Any] = {}

    def __init__(self, **kw):
        fields = type(self).model_fields
        aliases = getattr(self, "aliases", {}) if STUB_MODEL_FIELD == "speculative_model" else {}
        unknown = set(kw) - set(fields) - set(aliases)
        if unknown:
            raise ValueError(f"{type(self).__name__}: extra inputs are not permitted: {sorted(unknown)}")
        for name, default in fields.items():
            setattr(self, name, kw.get(name, default))
        for alias, name in aliases.items():
            if alias in kw:
                setattr(self, name, kw[alias])
        if STUB_MODEL_FIELD in fields and STUB_MODEL_FIELD != "speculative_model":
            self.speculative_model = getattr(self, STUB_MODEL_FIELD)  # what the stand-in itself reads
        self.validate()

    def validate(self) -> None:
        pass


class DecodingBaseConfig(_Base):
    fields = {"max_draft_len": None, "max_total_draft_tokens": None, "speculative_model": None,
              "max_concurrency": None, "load_format": None}
    aliases = {"speculative_model_dir": "speculative_model"}

    def _needs_len(self, name):
        if self.max_draft_len is None or self.max_draft_len <= 0:
            raise ValueError(f"max_draft_len must be > 0 for {name}")
        self.max_total_draft_tokens = self.max_draft_len


class DraftTargetDecodingConfig(DecodingBaseConfig):
    decoding_type = "Draft_Target"

    @property
    def spec_dec_mode(self):
        one_model = (release(STUB_VERSION) or (9,))[:2] >= (1, 3)
        return _mode("DRAFT_TARGET_ONE_MODEL" if one_model else "DRAFT_TARGET")

    def validate(self):
        self._needs_len("DraftTarget")
        if self.speculative_model is None:
            raise ValueError("speculative_model must be specified for DraftTarget")


class NGramDecodingConfig(DecodingBaseConfig):
    fields = {**DecodingBaseConfig.fields, "max_matching_ngram_size": 0, "is_keep_all": True, "is_use_oldest": True,
              "is_public_pool": True}
    decoding_type = "NGram"

    @property
    def spec_dec_mode(self):
        return _mode("NGRAM")

    def validate(self):
        self._needs_len("NGram")


class EagleDecodingConfig(DecodingBaseConfig):
    """1.x llm_args.py: EAGLE-3 is this class with eagle3_one_model (default True) where the release
    has no Eagle3DecodingConfig."""

    fields = {**DecodingBaseConfig.fields, "eagle_choices": None, "greedy_sampling": True, "eagle3_one_model": True,
              "num_eagle_layers": None}
    decoding_type = "Eagle"

    @property
    def spec_dec_mode(self):
        return _mode("EAGLE3_ONE_MODEL" if self.eagle3_one_model else "EAGLE3")

    def validate(self):
        if self.speculative_model is None:
            raise ValueError("Draft model must be provided for EAGLE")


class Eagle3DecodingConfig(EagleDecodingConfig):
    decoding_type = "Eagle3"


class UserProvidedDecodingConfig(DecodingBaseConfig):
    fields = {**DecodingBaseConfig.fields, "drafter": None, "resource_manager": None}
    decoding_type = "User_Provided"

    @property
    def spec_dec_mode(self):
        return _mode("USER_PROVIDED")

    def validate(self):
        self.max_total_draft_tokens = self.max_draft_len


class KvCacheConfig(_Base):
    fields = {"enable_block_reuse": True, "max_tokens": None, "free_gpu_memory_fraction": None}


class Drafter(abc.ABC):
    # later drafter.py: TorchSampler drafters (NGram, two-model, user-provided) must set this True, or the
    # padding of draft tokens for CUDA graphs is not covered by the KV cache (the stand-in checks it, below)
    _needs_padding_kv_extension: bool = False

    def __init__(self, max_draft_len: int = None, max_total_draft_tokens: int = None,
                 max_concurrency: Optional[int] = None, draft_len_schedule=None) -> None:
        self.max_draft_len = max_draft_len
        self.max_total_draft_tokens = max_total_draft_tokens
        self.max_concurrency = max_concurrency

    @abc.abstractmethod
    def prepare_draft_tokens(self, scheduled_requests, resource_manager=None) -> None:
        raise NotImplementedError


@dataclasses.dataclass(kw_only=True)
class SamplingParams:
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    stop: Optional[Any] = None
    stop_token_ids: Optional[List[int]] = None
    n: int = 1
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    return_perf_metrics: bool = False
    ignore_eos: bool = False
    detokenize: bool = True


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    _last_token_ids_len: int = 0

    @property
    def token_ids_diff(self) -> list:
        return self.token_ids[self._last_token_ids_len:]


class _LlmRequest:
    """What a Drafter sees of a generation request (tensorrt_llm._torch.pyexecutor.llm_request)."""

    def __init__(self, request_id: int, tokens: list[int], end_id: int):
        self.py_request_id, self._tokens, self.py_end_id, self.py_draft_tokens = request_id, tokens, end_id, []

    def get_tokens(self, beam: int) -> list[int]:
        assert beam == 0
        return list(self._tokens)


class StubResult:
    """A streaming generate_async result: each next() is one engine iteration."""

    def __init__(self, llm: "LLM", request_id: int, ids: list[int], params: SamplingParams):
        self.llm, self.request_id, self.ids, self.params = llm, request_id, list(ids), params
        self.outputs = [CompletionOutput(0)]
        self.finished, self._aborted, self._iterations = False, False, 0
        self._truth = oracle(llm.bundle, self.ids, params.max_tokens)  # the greedy continuation

    def abort(self) -> None:
        self._aborted = True

    def __iter__(self):
        return self

    def __next__(self):
        if self.finished:
            raise StopIteration
        out = self.outputs[0]
        out._last_token_ids_len = len(out.token_ids)
        done = len(out.token_ids)
        if self._aborted:
            self.finished, out.finish_reason = True, "cancelled"
            return self
        n = 1 if self._iterations == 0 or self.llm.spec is None else self._accepted(done) + 1
        self._iterations += 1
        new = self._truth[done:done + n]
        stops = set() if self.params.ignore_eos else {self.params.end_id, *(self.params.stop_token_ids or [])}
        for i, t in enumerate(new):
            if t in stops:
                new, out.finish_reason = new[:i + 1], "stop"
                break
        out.token_ids.extend(new)
        if out.finish_reason == "stop" or len(out.token_ids) >= self.params.max_tokens:
            out.finish_reason = out.finish_reason or "length"
            self.finished = True
        return self

    def _accepted(self, done: int) -> int:
        spec, truth = self.llm.spec, self._truth[done:]
        k = spec.max_draft_len
        if isinstance(spec, UserProvidedDecodingConfig):
            req = _LlmRequest(self.request_id, self.ids + self.outputs[0].token_ids, self.params.end_id)
            spec.drafter.prepare_draft_tokens(types.SimpleNamespace(generation_requests=[req], context_requests=[]))
            drafts = list(req.py_draft_tokens)
            assert len(drafts) <= k, f"the drafter proposed {len(drafts)} > max_draft_len {k}"
            if len(drafts) < k and not spec.drafter._needs_padding_kv_extension:
                # pad_draft_tokens_for_cuda_graph pads to max_draft_len; TorchSampler rewinds by the padded length
                raise RuntimeError("draft tokens padded for CUDA graphs past the KV cache capacity: a TorchSampler "
                                   "drafter must set _needs_padding_kv_extension = True")
        else:  # the model's own drafter: right but for every third token
            drafts = [(t + 1) % self.llm.vocab if (done + i) % 3 == 2 else t for i, t in enumerate(truth[:k])]
        self.llm.drafts_proposed += len(drafts)
        n = 0
        while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
            n += 1
        return n


# What TensorRT-LLM's EAGLE-3 draft loader (_torch/models/modeling_speculative.py, Eagle3ForCausalLM) reads from
# speculative_model: a Llama config of one layer and model.safetensors with the midlayer / fc / norm / lm_head
# tensors and the d2t map (the target's embedding is used where the head has none). Listed here on its own,
# not imported from specbuild, so the stand-in checks specbuild's writer against the layout.
EAGLE3_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "midlayer.hidden_norm.weight",
                  "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight",
                  "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
                  "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
                  "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight")


def check_eagle3_layout(path: str, target: dict) -> None:
    from safetensors import safe_open

    cfg = json.load(open(os.path.join(path, "config.json")))
    weights = os.path.join(path, "model.safetensors")
    if not os.path.isfile(weights):
        raise ValueError(f"EAGLE-3 head {path} has no model.safetensors")
    with safe_open(weights, "pt") as f:
        names = set(f.keys())
        fc = f.get_slice("fc.weight").get_shape() if "fc.weight" in names else None
    missing = [n for n in EAGLE3_TENSORS if n not in names]
    if missing:
        raise ValueError(f"EAGLE-3 head {path} lacks {missing}")
    if int(cfg.get("num_hidden_layers", 0)) != 1 or cfg.get("vocab_size") != target["vocab_size"]:
        raise ValueError(f"EAGLE-3 head {path}: one layer over the target's vocabulary expected, got {cfg}")
    if list(fc) != [cfg["hidden_size"], 3 * target["hidden_size"]]:
        raise ValueError(f"EAGLE-3 head {path}: fc.weight {fc} does not read three target layers")


class LLM:
    instances: list["LLM"] = []

    def __init__(self, model, tokenizer=None, tokenizer_mode="auto", skip_tokenizer_init=False,
                 trust_remote_code=False, tensor_parallel_size=1, dtype="auto", revision=None,
                 tokenizer_revision=None, **kwargs):
        unknown = set(kwargs) - _TORCH_LLM_ARGS
        if unknown:
            raise ValueError(f"Failed to parse the arguments for the LLM constructor: {sorted(unknown)}")
        cfg_path = os.path.join(str(model), "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"{model} is not a Hugging Face model directory (no config.json)")
        hf = json.load(open(cfg_path))
        self.spec = kwargs.get("speculative_config")
        if self.spec is not None:
            if getattr(self.spec, "speculative_model", None) is not None and not os.path.isfile(
                    os.path.join(str(self.spec.speculative_model), "config.json")):
                raise ValueError(f"speculative_model {self.spec.speculative_model} has no config.json")
            if isinstance(self.spec, EagleDecodingConfig):
                check_eagle3_layout(str(self.spec.speculative_model), hf)
            if os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS") != "1":
                # executor/executor.py: the executor runs in a worker process (mpi4py) that gets the LLM's arguments
                # pickled; what does not pickle by reference (a class defined in a function) fails here
                self.spec = pickle.loads(pickle.dumps(self.spec))
                kwargs = {**kwargs, "speculative_config": self.spec}
            heads = hf["num_attention_heads"]
            shape = types.SimpleNamespace(num_heads=heads, num_kv_heads=hf.get("num_key_value_heads", heads),
                                          head_dim=hf.get("head_dim") or hf["hidden_size"] // heads)
            group = (heads // tensor_parallel_size) // (max(shape.num_kv_heads, tensor_parallel_size)
                                                         // tensor_parallel_size)
            dt = hf.get("torch_dtype") if dtype == "auto" else dtype
            # _torch/speculative/interface.py of the stand-in's release: a target in multi-token query mode on
            # TRTLLM attention needs a speculative XQA kernel (power-of-two group, fp16/bf16)
            if (kwargs.get("attn_backend") or "TRTLLM") == "TRTLLM" and multi_query(self.spec, None) and (
                    group & (group - 1) or dt not in ("float16", "bfloat16")):
                raise RuntimeError("No available XQA kernels are found for speculative decoding mode.")
        self.model, self.skip_tokenizer_init, self.kwargs = str(model), skip_tokenizer_init, kwargs
        self.bundle = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(str(model)))))
        self.vocab = int(hf["vocab_size"])
        self.max_seq_len = int(kwargs.get("max_seq_len") or hf.get("max_position_embeddings", 2048))
        self.next_id, self.requests, self.drafts_proposed, self.shut = 1, [], 0, False
        LLM.instances.append(self)

    def generate_async(self, inputs, sampling_params=None, lora_request=None, prompt_adapter_request=None,
                       streaming=False, queries=None, kv_cache_retention_config=None, disaggregated_params=None,
                       _postproc_params=None):
        if self.shut:
            raise RuntimeError("the LLM was shut down")
        params = sampling_params or SamplingParams()
        if self.skip_tokenizer_init and params.end_id is None:
            raise ValueError("tokenizer is required to reset end_id if it is None, or you can explicitly specify "
                             "the end_id for sampling_params")
        if not isinstance(inputs, list) or not all(isinstance(t, int) for t in inputs):
            raise TypeError("the stub takes prompt token ids only")
        if len(inputs) + params.max_tokens > self.max_seq_len:
            raise ValueError(f"The sum of prompt length ({len(inputs)}) and max_tokens ({params.max_tokens}) should "
                             f"not exceed max_seq_len ({self.max_seq_len})")
        rid, self.next_id = self.next_id, self.next_id + 1
        self.requests.append((list(inputs), params, streaming))
        result = StubResult(self, rid, inputs, params)
        if not streaming:
            for _ in result:
                pass
        return result

    def shutdown(self):
        self.shut = True


def package() -> types.ModuleType:
    """The stand-in `tensorrt_llm` package (factory for SPECBUILD_TEST_TRTLLM_LLMAPI)."""
    pkg = types.ModuleType("tensorrt_llm")
    pkg.__version__ = STUB_VERSION
    pkg.SPECBUILD_TEST_STUB = True
    pkg.LLM, pkg.SamplingParams = LLM, SamplingParams
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    classes = [LLM, KvCacheConfig, DraftTargetDecodingConfig, NGramDecodingConfig, EagleDecodingConfig,
               UserProvidedDecodingConfig]
    if (release(STUB_VERSION) or ())[:2] >= EAGLE3_CLASS_FROM:  # llmapi/__init__.py at 5ca85aff (1.x): not exported
        classes.append(Eagle3DecodingConfig)
    for cls in classes:
        if cls.__name__ not in STUB_HIDDEN:
            setattr(llmapi, cls.__name__, cls)
    pkg.llmapi = llmapi
    drafter = types.ModuleType("tensorrt_llm._torch.speculative.drafter")
    drafter.Drafter = Drafter
    speculative = types.SimpleNamespace(drafter=drafter)
    if "interface" not in STUB_HIDDEN:
        speculative.interface = types.SimpleNamespace(SpeculativeDecodingMode=_mode_class(),
                                                      get_sm_version=get_sm_version)
    utils = types.SimpleNamespace(get_attention_backend=get_attention_backend)
    pkg._torch = types.SimpleNamespace(speculative=speculative, attention_backend=types.SimpleNamespace(utils=utils))
    return pkg
