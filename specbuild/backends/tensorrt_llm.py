"""The TensorRT-LLM backend: specbuild requests served by TensorRT-LLM's C++ executor.

TensorRT-LLM owns the KV cache, the in-flight batching and (for Medusa) the acceptance, so
this backend works at the request level (see select.py; the queue and loop it shares with
the torch engine are engine/base.py's). Three modes, from the bundle's `trtllm/trtllm.json`
(written by `specbuild compile --backend tensorrt-llm`):

- none / Medusa: one streaming executor request per specbuild request; each response holds
  the tokens of one engine iteration, so a Medusa iteration that yields n tokens accepted
  n - 1 drafts. Medusa's tree goes to `DecodingConfig(decoding_mode=DecodingMode.Medusa(),
  medusa_choices=...)`; TensorRT-LLM accepts Medusa drafts greedily only.
- draft_tokens_external: specbuild drafts (prompt lookup from proposers/ngram.py, or the
  draft engine) and each round sends the target one non-streaming request with
  `input_token_ids` = the text so far, `ExternalDraftTokensConfig(tokens, logits)` and
  max_tokens = drafts + 1; KV block reuse (`KvCacheConfig(enable_block_reuse=True)`) makes
  the repeated prefix cheap. Tokens back = accepted drafts + one token. This is the loop of
  tensorrtllm_backend's `tensorrt_llm_bls/1/lib/decode.py` (`_spec_generate`), but with
  batching and streaming, which the BLS refuses.

API matched (NVIDIA/TensorRT-LLM, read for names and signatures only):
`cpp/tensorrt_llm/pybind/executor/{executor,request,executorConfig}.cpp` (Executor(model_path,
ModelType.DECODER_ONLY, ExecutorConfig), enqueue_request, await_responses(timeout),
cancel_request, can_enqueue_requests, shutdown; Request(input_token_ids, max_tokens, *,
streaming, sampling_config, output_config, end_id, pad_id, stop_words,
external_draft_tokens_config); Result.output_token_ids / is_final / finish_reasons /
generation_logits / request_perf_metrics.speculative_decoding), `tensorrt_llm/runtime/
model_runner_cpp.py` (`ModelRunnerCpp.from_dir`: ParallelConfig(CommunicationType.MPI,
CommunicationMode.LEADER), DecodingConfig.medusa_choices), and the leader-mode rule of
`all_models/inflight_batcher_llm/tensorrt_llm/1/model.py` (ranks that cannot enqueue wait in
shutdown() until the leader is done).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specbuild.bundle import BundleMeta, check_fingerprint, read_meta, read_model_config
from specbuild.errors import BundleError, RequestError, SpecbuildError
from specbuild.formats.trtllm_checkpoint import pad_vocab_size
from specbuild.engine.guarantees import guarantees
from specbuild.backends.launch import launcher_rank_size
from specbuild.engine.base import BaseEngine, validated_prompt_ids
from specbuild.engine.engine import EngineConfig
from specbuild.sampling.params import SamplingParams
from specbuild.engine.sequence import Event, Handle, Request, Sequence
from specbuild.speculation.config import SpeculationConfig
from specbuild.speculation.speculator import Verdict

log = logging.getLogger("specbuild.trtllm")

MODE_BITS = {"none": 1, "draft_tokens_external": 2, "medusa": 4, "lookahead": 8, "explicit_draft_tokens": 16,
             "eagle": 32}  # tensorrt_llm.models.SpeculativeDecodingMode (reference §2)
MODE_FLAG = {"draft_tokens_external": "--speculative_decoding_mode draft_tokens_external",
             "medusa": "--speculative_decoding_mode medusa"}
# how to get engines that gather generation logits (sampled acceptance of external draft tokens)
LOGITS_REBUILD = ("rebuild with --gather_generation_logits (`specbuild compile --trtllm-gather-generation-logits` "
                  "writes it into trtllm/build.sh)")


class EngineLimitError(BundleError):
    """A built engine that cannot serve this bundle / runtime setting; says what to rebuild."""


# ---- pure: engine config.json -> limits, and the checks ---------------------------------------
def engine_modes(value: Any) -> list[str]:
    """build_config.speculative_decoding_mode (an IntFlag written as int, or a name) -> names."""
    if value is None:
        return ["none"]
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BundleError(f"speculative_decoding_mode {value!r} is neither a bit mask nor a name")
    if isinstance(value, int):
        names = [n for n, bit in MODE_BITS.items() if value & bit]
    else:
        names = [p.strip().split(".")[-1].lower() for p in value.split("|") if p.strip()]
    unknown = [n for n in names if n not in MODE_BITS]
    if unknown:
        raise BundleError(f"unknown speculative_decoding_mode {unknown[0]!r} (known: {', '.join(MODE_BITS)})")
    return names or ["none"]


def engine_limits(engine_config: dict) -> dict[str, Any]:
    """The limits a built engine's config.json records (trtllm-build's `build_config` and the
    checkpoint's `pretrained_config`; max_seq_len falls back to max_input_len + max_output_len
    as older engines store it)."""
    build = engine_config.get("build_config") or {}
    pre = engine_config.get("pretrained_config") or {}
    mapping = pre.get("mapping") or {}
    modes = engine_modes(build.get("speculative_decoding_mode"))
    max_input = int(build.get("max_input_len") or 0)
    max_seq = int(build.get("max_seq_len") or (max_input + int(build.get("max_output_len") or 0)))
    max_draft = int(build.get("max_draft_len") or 0)
    if "medusa" in modes and not max_draft:  # Medusa takes it from the checkpoint
        max_draft = int(pre.get("max_draft_len") or 0)
    tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
    return {"max_batch_size": int(build.get("max_batch_size") or 0), "max_seq_len": max_seq,
            "max_input_len": max_input or max_seq, "max_draft_len": max_draft, "modes": modes,
            "gather_generation_logits": bool(build.get("gather_generation_logits", False)),
            "tp": tp, "pp": pp, "world_size": int(mapping.get("world_size", tp * pp)),
            "gpus_per_node": int(mapping.get("gpus_per_node", 8)),
            "num_medusa_heads": int(pre.get("num_medusa_heads") or 0), "vocab_size": pre.get("vocab_size"),
            "paged_context_fmha": _paged_context_fmha(build)}


def _paged_context_fmha(build: dict) -> bool | None:
    """build_config.plugin_config.use_paged_context_fmha as recorded (None: not recorded)."""
    plugin = build.get("plugin_config") or {}
    return None if "use_paged_context_fmha" not in plugin else bool(plugin["use_paged_context_fmha"])


def check_engine_limits(engine_config: dict, *, role: str = "target", max_batch_size: int | None = None,
                        max_seq_len: int | None = None, mode: str = "none", max_draft_len: int = 0,
                        tree: dict | None = None, needs_generation_logits: bool = False,
                        sampled_speculation: bool = False, world_size: int | None = None,
                        vocab_size: int | None = None) -> dict[str, Any]:
    """Check a built engine against what the bundle and this run need; return its limits.

    mode: none | draft_tokens_external | medusa (what this engine must do); max_draft_len:
    drafts per request (draft_tokens_external); tree: the bundle's Medusa tree
    ({"name", "num_drafts", "max_depth"}); needs_generation_logits: the bundle says its engines
    gather them; sampled_speculation: this run drafts for sampled requests (temperature > 0
    with draft tokens), whose acceptance compares draft and target logits. Raises
    EngineLimitError naming every mismatch and
    the trtllm-build flag that fixes it (TensorRT-LLM itself reports only, e.g., "Number of
    draft tokens (56) > maximum (0)", at the first request)."""
    lim = engine_limits(engine_config)
    problems: list[str] = []
    if mode in MODE_FLAG and mode not in lim["modes"]:
        extra = f" --max_draft_len {max_draft_len}" if mode == "draft_tokens_external" else ""
        problems.append(f"it was built without {MODE_FLAG[mode]} (its mode: {'|'.join(lim['modes'])}); "
                        f"rebuild with {MODE_FLAG[mode]}{extra}")
    elif mode == "draft_tokens_external" and max_draft_len > lim["max_draft_len"]:
        problems.append(f"Number of draft tokens ({max_draft_len}) > maximum ({lim['max_draft_len']}); "
                        f"rebuild with --max_draft_len {max_draft_len}")
    elif mode == "medusa" and tree is not None:
        if tree["num_drafts"] > lim["max_draft_len"]:
            problems.append(f"Number of draft tokens ({tree['num_drafts']}, the nodes of Medusa tree "
                            f"{tree.get('name')!r}) > maximum ({lim['max_draft_len']}); rewrite the checkpoint "
                            f"with `specbuild compile --max-draft-len {tree['num_drafts']}` and rebuild with "
                            f"{MODE_FLAG['medusa']}")
        if lim["num_medusa_heads"] and tree["max_depth"] > lim["num_medusa_heads"]:
            problems.append(f"the Medusa tree {tree.get('name')!r} is {tree['max_depth']} deep but the engine "
                            f"has {lim['num_medusa_heads']} heads; use a tree of depth <= {lim['num_medusa_heads']}")
    if max_batch_size is not None and max_batch_size > lim["max_batch_size"]:
        problems.append(f"max_batch_size {max_batch_size} > maximum ({lim['max_batch_size']}); rebuild with "
                        f"--max_batch_size {max_batch_size} or run with --max-batch-size {lim['max_batch_size']}")
    if max_seq_len is not None and max_seq_len > lim["max_seq_len"]:
        problems.append(f"max_seq_len {max_seq_len} > maximum ({lim['max_seq_len']}); rebuild with "
                        f"--max_seq_len {max_seq_len}")
    if (needs_generation_logits or sampled_speculation) and not lim["gather_generation_logits"]:
        why = ("sampled speculation (temperature > 0 with draft tokens) is refused: its acceptance needs "
               "generation logits" if sampled_speculation else "sampled acceptance needs generation logits")
        problems.append(f"{why} but it was built without --gather_generation_logits; {LOGITS_REBUILD}")
    if world_size is not None and world_size != lim["world_size"]:
        problems.append(f"it was built for tp*pp = {lim['world_size']} ranks (tp {lim['tp']}, pp {lim['pp']}) "
                        f"but {world_size} were launched; run it under `mpirun -n {lim['world_size']}`")
    if vocab_size is not None and lim["vocab_size"] is not None and int(lim["vocab_size"]) != vocab_size:
        problems.append(f"vocab_size {lim['vocab_size']} != the bundle's {vocab_size}: it was built from another "
                        "checkpoint; rebuild from this bundle's trtllm/build.sh")
    if lim["paged_context_fmha"] is False:
        # the executor runs with KV block reuse, which TensorRT-LLM turns off for an engine without paged context
        # FMHA (trtGptModelInflightBatching.cpp, fixExecutorConfig; compiler/trtllm_build.py cites it)
        if "draft_tokens_external" in lim["modes"]:
            problems.append("it was built without --use_paged_context_fmha enable, so TensorRT-LLM turns KV cache "
                            "block reuse off, which a draft/target target needs; rebuild with "
                            "--use_paged_context_fmha enable (specbuild compile writes it into trtllm/build.sh)")
        else:
            log.warning("the %s engine was built without --use_paged_context_fmha enable: TensorRT-LLM turns KV "
                        "cache block reuse off for it (rebuild with the flag to reuse prompt prefixes)", role)
    problems += engine_kernel_problems(engine_config, role=role, mode=mode)
    if problems:
        raise EngineLimitError(f"the {role} engine cannot serve this bundle: " + "; ".join(problems))
    return lim


def engine_kernel_problems(engine_config: dict, *, role: str, mode: str) -> list[str]:
    """What TensorRT-LLM's attention kernels refuse in this engine (head size; for a speculative
    mode the dtype and the XQA group size), read from its pretrained_config; the rules and where
    they were read are in formats/trtllm_support.py. An engine built before these checks existed
    fails here at load instead of at its first generation step."""
    import types

    from specbuild.formats.trtllm_support import kernel_problems

    pre = engine_config.get("pretrained_config") or {}
    if "num_attention_heads" not in pre:
        return []  # nothing recorded to check (hand-written configs)
    heads = int(pre["num_attention_heads"])
    cfg = types.SimpleNamespace(num_heads=heads, num_kv_heads=int(pre.get("num_key_value_heads") or heads),
                                head_dim=int(pre.get("head_size") or int(pre["hidden_size"]) // heads))
    tp = int((pre.get("mapping") or {}).get("tp_size", 1))
    problems = kernel_problems(cfg, role=role, mode=mode, dtype=str(pre.get("dtype", "float16")), tp=tp)
    out = []
    for p in problems:  # the engine was built: name the compile flag as what to recompile with
        p = p.replace(": use --trtllm-dtype", ": recompile with --trtllm-dtype")
        out.append("built with dtype " + p[len("--trtllm-dtype "):] if p.startswith("--trtllm-dtype ") else p)
    return out


def check_engine_version(version: str) -> None:
    """Refuse a TensorRT-LLM release without (or older than) the engine path, in one line naming
    the installed version and what to do (formats/trtllm_support.engine_path_problem)."""
    from specbuild.formats.trtllm_support import engine_path_problem

    problem = engine_path_problem(version)
    if problem:
        raise EngineLimitError(problem)


def check_draft_target_engines(target: dict[str, Any], draft: dict[str, Any] | None) -> None:
    """Draft/target engines (their engine_limits): one GPU each and the same tp, or refused
    (formats/trtllm_support.draft_target_layout_problems: leader-mode executors on one MPI world,
    vocabulary padding of the draft's logits)."""
    from specbuild.formats.trtllm_support import draft_target_layout_problems

    if draft is None:
        return
    problems = draft_target_layout_problems(tp=target["tp"], pp=target["pp"], draft_tp=draft["tp"],
                                            draft_pp=draft["pp"])
    if problems:
        raise EngineLimitError("these draft/target engines cannot run: " + "; ".join(problems))


def fit_draft_logits(logits, vocab_size: int, target_vocab_padded: int):
    """Draft generation logits [k, V_draft_padded] -> [k, target_vocab_padded]: the real vocabulary
    kept, the padding columns (no token) set to the dtype's lowest value, so the target's
    acceptance never reads a column the draft padded differently. None stays None."""
    if logits is None:
        return None
    import torch

    t = torch.as_tensor(logits)
    out = t.new_full((t.shape[0], target_vocab_padded), torch.finfo(t.dtype).min)
    out[:, :vocab_size] = t[:, :vocab_size]
    return out


def sampled_speculation_default(mode: str, sampling: SamplingParams, spec: SpeculationConfig) -> bool:
    """Whether a bundle's defaults make requests speculate while sampling (temperature > 0
    with draft-model tokens), which needs engines that gather generation logits. Prompt lookup
    is not counted: its sampled requests are served without drafts whatever the engines."""
    return mode == "draft_tokens_external" and not sampling.greedy and spec.method == "draft" and spec.gamma_max > 0


def leader_plan(rank: int, world_size: int, lim: dict[str, Any], visible_gpus: int | None) -> int:
    """Leader mode (reference §5): under `mpirun -n tp*pp` every rank loads its own engine file
    and binds GPU `rank % gpus_per_node`; only rank 0 takes requests. Returns the GPU index."""
    if world_size != lim["world_size"]:
        raise SpecbuildError(f"the engines were built for tp*pp = {lim['world_size']} ranks (tp {lim['tp']}, "
                             f"pp {lim['pp']}) but the MPI world size is {world_size}; launch with "
                             f"`mpirun -n {lim['world_size']} specbuild ...`")
    device = rank % lim["gpus_per_node"]
    if visible_gpus is not None and device >= visible_gpus:
        raise SpecbuildError(f"rank {rank} binds GPU {device} (rank % gpus_per_node {lim['gpus_per_node']}) but "
                             f"this node shows {visible_gpus} GPU(s); rebuild with --gpus_per_node {visible_gpus} "
                             "or start fewer ranks per node")
    return device


def accepted_prefix(draft: list[int], tokens: list[int]) -> int:
    """How many drafts the target kept: the leading positions where its tokens equal them."""
    n = 0
    for d, t in zip(draft, tokens):
        if d != t:
            break
        n += 1
    return n


# ---- the bundle side ------------------------------------------------------------------------
def read_trtllm_meta(bundle_dir: str) -> dict[str, Any]:
    path = os.path.join(bundle_dir, "trtllm", "trtllm.json")
    if not os.path.isfile(path):
        raise BundleError(f"bundle {bundle_dir!r} has no trtllm/trtllm.json: compile it with --backend tensorrt-llm")
    with open(path) as f:
        return json.load(f)


def engine_dirs(bundle_dir: str) -> dict[str, str]:
    """role -> its engine directory (trtllm/engines/<role>)."""
    meta = read_trtllm_meta(bundle_dir)
    return {role: os.path.join(bundle_dir, "trtllm", r["engine_dir"]) for role, r in meta["roles"].items()}


def read_engine_config(engine_dir: str) -> dict:
    path = os.path.join(engine_dir, "config.json")
    if not os.path.isfile(path):
        raise BundleError(f"{engine_dir!r} has no config.json: build the engines (trtllm/build.sh) first")
    with open(path) as f:
        return json.load(f)


# Test-only: "module:factory", a factory returning a stand-in for tensorrt_llm.bindings.executor,
# so that tests can run the real adapter (and the CLI under mpirun) without TensorRT-LLM or a GPU
# (tests/helpers/trtllm_stub.py). Never set it in production: the stand-in decodes with the torch engine.
TEST_STUB_ENV = "SPECBUILD_TEST_TRTLLM_BINDINGS"
LLMAPI_STUB_ENV = "SPECBUILD_TEST_TRTLLM_LLMAPI"  # the LLM API's stand-in (backends/tensorrt_llm_api.py)
TEST_STUB_MARK = "SPECBUILD_TEST_STUB"  # the stand-in must say it is one (guard against a mistaken value)


def load_stand_in(env: str, default_factory: str, what: str):
    """The test stand-in named by $env ("module:factory"), or None when it is unset.

    Guarded: the factory's result must carry `SPECBUILD_TEST_STUB = True`, else SpecbuildError;
    every use logs a warning, so a stray variable cannot pass unnoticed."""
    spec = os.environ.get(env)
    if not spec:
        return None
    import importlib

    module, _, factory = spec.partition(":")
    try:
        stub = getattr(importlib.import_module(module), factory or default_factory)()
    except (ImportError, AttributeError) as e:
        raise SpecbuildError(f"{env}={spec!r}: {e}; it is for specbuild's tests only: unset it") from None
    if getattr(stub, TEST_STUB_MARK, False) is not True:
        raise SpecbuildError(f"{env}={spec!r} is not a specbuild test stub (no {TEST_STUB_MARK} = True); "
                             "it is for specbuild's tests only: unset it")
    log.warning("%s is replaced by the TEST STUB %s (%s is set)", what, spec, env)
    return stub


def stand_in_bindings():
    """The executor bindings' stand-in ($SPECBUILD_TEST_TRTLLM_BINDINGS), or None."""
    return load_stand_in(TEST_STUB_ENV, "bindings", "TensorRT-LLM")


def tensorrt_llm_importable() -> tuple[bool, str]:
    if os.environ.get(TEST_STUB_ENV):
        return True, ""  # the stand-in (stand_in_bindings) replaces the import
    try:
        import tensorrt_llm  # noqa: F401
    except Exception as e:  # ImportError, or a broken CUDA/TensorRT install underneath
        return False, f"import tensorrt_llm failed: {type(e).__name__}: {e}"
    return True, ""


def _bindings():
    stub = stand_in_bindings()
    if stub is not None:
        check_engine_version(str(getattr(stub, "TENSORRT_LLM_VERSION", "unknown")))
        return stub
    import tensorrt_llm  # noqa: PLC0415 (only where it is installed)

    check_engine_version(str(getattr(tensorrt_llm, "__version__", "unknown")))
    import tensorrt_llm.bindings.executor as trtllm  # noqa: PLC0415

    return trtllm


def _reason_name(result) -> str:
    reasons = getattr(result, "finish_reasons", None) or []
    return getattr(reasons[0], "name", str(reasons[0])) if reasons else ""


@dataclass
class _Flight:
    """One executor request in flight for a sequence."""

    seq: Sequence
    kind: str  # stream | draft | verify
    draft: list[int] = field(default_factory=list)
    responses: int = 0


def refuse_torch_only(request: Request, params: SamplingParams) -> None:
    """What only the torch backend serves (structured output, logprobs, OpenAI's penalties):
    a RequestError naming them, for both TensorRT-LLM paths."""
    unsupported = [name for name, on in (("response_format", request.response_format is not None),
                                         ("logprobs", request.logprobs is not None),
                                         ("presence_penalty/frequency_penalty/logit_bias/min_tokens/repetition_penalty", params.adjusts)) if on]
    if unsupported:
        raise RequestError(f"{', '.join(unsupported)}: not supported on the tensorrt-llm backend in this version; "
                           "serve the bundle with --backend torch for them")


class ExecutorEngine(BaseEngine):
    """A BaseEngine whose executor owns each request: abort() drops it from the queue and has
    the subclass's `_release(seq)` cancel what the executor holds."""

    def _release(self, seq: Sequence) -> None:
        raise NotImplementedError

    def abort(self, handle: Handle) -> None:
        """Stop a request; its executor requests are cancelled (thread-safe)."""
        with self._lock:
            seq = handle.seq
            if seq in self.waiting:
                self.waiting.remove(seq)
            self._release(seq)
            seq.abort()

    @staticmethod
    def _verification(drafted: int, accepted: int, positions: int) -> Verdict:
        """One verification as the sequence's statistics count it (SeqStats.on_pass, as the
        torch step's Verdicts): a decode pass of `positions` draft positions."""
        return Verdict([], accepted, [], 0, verify_pass=True, gamma=positions or None, drafted=drafted,
                       depth_counts=[1] * positions)

    def _fail(self, seq: Sequence, message: str) -> None:
        seq.fail(message)

    def _fail_running(self, message: str) -> None:
        """Release and fail every running request (the shared loop calls it, lock held)."""
        for seq in list(self.running):
            self._release(seq)
            self._fail(seq, message)


class TrtllmEngine(ExecutorEngine):
    """A bundle's TensorRT-LLM engines behind the request-level backend interface.

    The request queue, text helpers, background loop and load figures are `BaseEngine`'s,
    as for the torch `Engine`: `step()` drives the loop, or `start()` runs it on a thread;
    handles are `sequence.Handle`s over `Sequence` state (so stop strings, detokenisation
    and stats are the same code on both backends). TensorRT-LLM's executor owns the KV
    cache, so stats() reports its blocks as None (BaseEngine._kv_blocks)."""

    backend_name = "tensorrt-llm"
    poll_ms = 2  # how long one step waits for executor responses

    def __init__(self, bundle_dir: str, config: EngineConfig = EngineConfig()) -> None:
        t0 = time.perf_counter()
        from tokenizers import Tokenizer

        self.bundle_dir, self.config = bundle_dir, config
        self.meta: BundleMeta = read_meta(bundle_dir)
        self.tokenizer = Tokenizer.from_str(check_fingerprint(bundle_dir, self.meta))
        self.trt_meta = read_trtllm_meta(bundle_dir)
        self.mode: str = self.trt_meta["mode"]  # none | draft_tokens_external | medusa
        self.tree: dict | None = self.trt_meta.get("tree")
        bundle_limits = self.trt_meta["limits"]
        self.max_seq_len = int(bundle_limits["max_seq_len"])
        self.max_batch_size = int(config.max_batch_size or bundle_limits["max_batch_size"])
        self.target_config = read_model_config(os.path.join(bundle_dir, self.meta.roles["target"]["path"]))
        dirs = engine_dirs(bundle_dir)
        rank, world = launcher_rank_size()
        self.rank = rank
        logits = bool(self.trt_meta.get("gather_generation_logits"))
        sampled = sampled_speculation_default(self.mode, SamplingParams.from_dict(dict(self.meta.default_sampling)),
                                              SpeculationConfig.make(None, **dict(self.meta.default_speculation)))
        common = dict(max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len, world_size=world,
                      vocab_size=self.target_config.vocab_size, needs_generation_logits=logits,
                      sampled_speculation=sampled)
        self.limits = check_engine_limits(
            read_engine_config(dirs["target"]), role="target", mode=self.mode, tree=self.tree,
            max_draft_len=int(bundle_limits["max_draft_len"]) if self.mode == "draft_tokens_external" else 0,
            **common)
        self.draft_limits = None
        if "draft" in dirs:  # the draft engine runs plain; it must return logits where the target compares them
            self.draft_limits = check_engine_limits(read_engine_config(dirs["draft"]), role="draft", **common)
        check_draft_target_engines(self.limits, self.draft_limits)
        # what the built engines can do (a bundle that asked for logits was checked to have them above)
        self.logits_acceptance = self.limits["gather_generation_logits"] and (
            self.draft_limits is None or self.draft_limits["gather_generation_logits"])
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else None
        self.device = leader_plan(rank, world, self.limits, visible)
        if visible:
            torch.cuda.set_device(self.device)
        self._trt = _bindings()
        self.executors: dict[str, Any] = {}
        share = 0.45 if "draft" in dirs else None  # two engines on one GPU: leave the draft room
        self.executors["target"] = self._make_executor(dirs["target"], share, medusa=self.mode == "medusa",
                                                       reuse=self.limits["paged_context_fmha"] is not False)
        if "draft" in dirs:
            self.executors["draft"] = self._make_executor(dirs["draft"], share, medusa=False,
                                                          reuse=self.draft_limits["paged_context_fmha"] is not False)
        self.is_leader = bool(self.executors["target"].can_enqueue_requests())
        sp = self.meta.special_tokens
        self.eos_ids = tuple(sp.get("eos_token_ids") or ([sp["eos_token_id"]] if sp.get("eos_token_id") is not None
                                                         else []))
        self.default_sampling = SamplingParams.from_dict(dict(self.meta.default_sampling))
        default = SpeculationConfig.make(None, **dict(self.meta.default_speculation))
        if default.method not in self.methods:
            default = SpeculationConfig.make(None, method="medusa" if self.mode == "medusa" else "none")
        cap = self.limits["max_draft_len"] or default.gamma_max
        self.default_speculation = SpeculationConfig.make(
            default, gamma_min=min(default.gamma_min, cap), gamma_max=min(default.gamma_max, cap))
        from specbuild.speculation.proposers.ngram import NgramProposer

        self._ngram = NgramProposer()
        self._flights: dict[tuple[str, int], _Flight] = {}
        self._init_loop(threading.RLock())
        self.load_seconds = time.perf_counter() - t0

    def _make_executor(self, engine_dir: str, share: float | None, medusa: bool, reuse: bool = True):
        """reuse: KV block reuse, off for an engine built without paged context FMHA (a float32 one), which
        older releases refuse with reuse on (compiler/trtllm_build.py cites trtGptModelInflightBatching.cpp)."""
        trt = self._trt
        kv = trt.KvCacheConfig(enable_block_reuse=reuse, max_tokens=self.config.kv_cache_tokens,
                               free_gpu_memory_fraction=share)
        decoding = trt.DecodingConfig()
        if medusa:
            decoding = trt.DecodingConfig(decoding_mode=trt.DecodingMode.Medusa(),
                                          medusa_choices=[list(p) for p in self.tree["paths"]])
        cfg = trt.ExecutorConfig(max_beam_width=1, max_batch_size=self.max_batch_size, kv_cache_config=kv,
                                 decoding_config=decoding)
        cfg.parallel_config = trt.ParallelConfig(trt.CommunicationType.MPI, trt.CommunicationMode.LEADER)
        if medusa:  # as ModelRunnerCpp.from_dir does: Medusa does not support multi-block mode
            cfg.extended_runtime_perf_knob_config = trt.ExtendedRuntimePerfKnobConfig(multi_block_mode=False)
        return trt.Executor(Path(engine_dir), trt.ModelType.DECODER_ONLY, cfg)

    # ---- what this bundle can serve ---------------------------------------------------------
    @property
    def methods(self) -> list[str]:
        if self.mode == "medusa":
            return ["none", "medusa"]
        if self.mode == "draft_tokens_external":
            return ["none", "ngram"] + (["draft"] if "draft" in self.executors else [])
        return ["none"]

    def describe_guarantees(self) -> dict:
        return guarantees("tensorrt-llm", mode=self.mode, gather_generation_logits=self.logits_acceptance,
                          methods=self.methods)

    def _sampled_refusal(self, method: str) -> str | None:
        """Why a sampled (temperature > 0) request cannot speculate with `method` here, or None."""
        if self.mode == "medusa":
            return ("Medusa on the TensorRT-LLM path is greedy-only (its acceptance compares drafts with the "
                    "target's argmax): use temperature 0, or the torch backend for sampled Medusa")
        if method == "ngram":
            return ("sampled speculation with prompt lookup is not lossless on the TensorRT-LLM backend (its drafts "
                    "carry no logits): use temperature 0, method none, or the torch backend")
        if method == "draft" and not self.logits_acceptance:
            return (f"sampled acceptance needs generation logits, which these engines do not gather: "
                    f"{LOGITS_REBUILD}, or use temperature 0")
        return None

    def resolve_speculation(self, request: Request, params: SamplingParams) -> tuple[SpeculationConfig, str]:
        """The request's setting checked against the engines; (spec, note). A sampled request
        that did not name its method and cannot speculate losslessly here is served without drafts."""
        explicit = request.speculation is not None
        spec = SpeculationConfig.for_request(request.speculation, self.default_speculation)
        if spec.method not in self.methods:
            raise RequestError(f"speculation method {spec.method!r} is not available on this bundle's TensorRT-LLM "
                               f"engines (available: {', '.join(self.methods)})")
        if spec.typical:
            raise RequestError("typical acceptance is not available on the tensorrt-llm backend (torch only)")
        if spec.tree is not None and spec.method == "medusa" and spec.tree != (self.tree or {}).get("name"):
            raise RequestError(f"tree {spec.tree!r}: TensorRT-LLM fixes the Medusa tree when its executor starts "
                               f"(this engine's is {(self.tree or {}).get('name')!r}); per-request trees are torch-only")
        cap = self.limits["max_draft_len"]
        if spec.method in ("ngram", "draft") and spec.gamma_max > cap:
            raise RequestError(f"Number of draft tokens ({spec.gamma_max}) > maximum ({cap}) of the target engine: "
                               f"lower --gamma-max, or rebuild the engine with --max_draft_len {spec.gamma_max}")
        note = ""
        if not params.greedy and (self.mode == "medusa" or spec.method != "none"):
            why = self._sampled_refusal(spec.method)
            if why and (explicit or self.mode == "medusa"):
                raise RequestError(why)
            if why:
                spec, note = SpeculationConfig.make(spec, method="none"), why
        return spec, note

    # ---- requests -----------------------------------------------------------------------------
    def _new_sequence(self, request: Request) -> Sequence:
        if not self.is_leader:
            raise SpecbuildError(f"rank {self.rank} is not the leader: only rank 0 takes requests")
        prompt_ids = validated_prompt_ids(request, self.encode, self.target_config.vocab_size, self.max_seq_len)
        params = request.sampling.with_seed()
        refuse_torch_only(request, params)
        spec, note = self.resolve_speculation(request, params)
        seq = Sequence(request, prompt_ids, params, spec, self.tokenizer, self.eos_ids, self.max_seq_len)
        if note:
            seq.tally.note("stat_speculation_off", note)
        return seq

    def _release(self, seq: Sequence) -> None:
        self._ngram.release(seq)  # its index of the sequence's text
        for key, flight in list(self._flights.items()):
            if flight.seq is seq:
                del self._flights[key]
                self.executors[key[0]].cancel_request(key[1])
        if seq in self.running:
            self.running.remove(seq)

    # ---- executor requests ----------------------------------------------------------------------
    def _round_seed(self, seq: Sequence) -> int:
        """A fresh seed per executor request, drawn from the request's own generator: rounds of one
        request must not replay the same random stream, and the same seed redoes the same output."""
        return int(seq.uniforms(1)[0] * (1 << 62))

    def _sampling_config(self, params: SamplingParams, seed: int):
        trt = self._trt
        if params.greedy:
            return trt.SamplingConfig(1, top_k=1)
        kw = {"temperature": float(params.temperature)}
        if params.top_k:
            kw["top_k"] = params.top_k
        if params.top_p < 1.0:
            kw["top_p"] = float(params.top_p)
        try:
            return trt.SamplingConfig(1, seed=seed, **kw)
        except TypeError:  # releases before the `random_seed` -> `seed` rename
            return trt.SamplingConfig(1, random_seed=seed, **kw)

    def _request(self, seq: Sequence, max_tokens: int, *, streaming: bool, draft: list[int] | None = None,
                 draft_logits=None, want_logits: bool = False):
        trt = self._trt
        out = trt.OutputConfig(exclude_input_from_output=True, return_generation_logits=want_logits)
        if hasattr(out, "return_perf_metrics"):
            out.return_perf_metrics = True  # acceptance totals, where the release reports them
        kw: dict[str, Any] = {"streaming": streaming, "output_config": out,
                              "sampling_config": self._sampling_config(seq.params, self._round_seed(seq))}
        eos = [] if seq.params.ignore_eos else list(self.eos_ids) + list(seq.params.stop_token_ids)
        if eos:
            kw["end_id"] = eos[0]
            if len(eos) > 1:
                kw["stop_words"] = [[t] for t in eos[1:]]
        kw["pad_id"] = eos[0] if eos else 0
        if draft:
            dk = {"logits": draft_logits} if draft_logits is not None else {}
            kw["external_draft_tokens_config"] = trt.ExternalDraftTokensConfig(list(draft), **dk)
        # max_tokens by keyword: one executor binding declares it keyword-only (issue 53's review), and
        # every release takes it so
        return trt.Request(list(seq.all_ids), max_tokens=int(max_tokens), **kw)

    def _enqueue(self, which: str, request, flight: _Flight) -> None:
        req_id = self.executors[which].enqueue_request(request)
        self._flights[(which, req_id)] = flight

    def _launch(self, seq: Sequence) -> None:
        """Give an idle running sequence its next executor request."""
        method, remaining = seq.spec.method, seq.remaining
        if method in ("none", "medusa"):
            self._enqueue("target", self._request(seq, remaining, streaming=True), _Flight(seq, "stream"))
            return
        gamma = max(0, min(seq.spec.gamma, remaining - 1, self.limits["max_draft_len"]))
        if method == "draft" and gamma > 0:
            want = self.logits_acceptance and not seq.params.greedy
            self._enqueue("draft", self._request(seq, gamma, streaming=False, want_logits=want),
                          _Flight(seq, "draft"))
            return
        draft = self._ngram.propose([seq], [gamma])[0] if gamma > 0 else None
        self._verify(seq, list(draft.tokens) if draft else [], None)

    def _verify(self, seq: Sequence, draft: list[int], draft_logits) -> None:
        n = min(len(draft) + 1, seq.remaining)
        draft = draft[:n - 1]
        logits = None if draft_logits is None else fit_draft_logits(  # [k, the target's padded vocabulary]
            draft_logits[:len(draft)], self.target_config.vocab_size,
            pad_vocab_size(self.target_config.vocab_size, self.limits["tp"]))
        self._enqueue("target", self._request(seq, n, streaming=False, draft=draft, draft_logits=logits),
                      _Flight(seq, "verify", draft))

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self) -> int:
        """Admit, launch the next executor request of every idle sequence, wait up to `poll_ms`
        for responses and turn them into events. Returns the number of sequences that advanced."""
        with self._lock:
            while self.waiting and len(self.running) < self.max_batch_size:
                seq = self.waiting.popleft()
                seq.tally.on_admit()
                self.running.append(seq)
            busy = {f.seq.seq_id for f in self._flights.values()}
            for seq in list(self.running):
                if seq.seq_id not in busy:
                    self._launch(seq)
            waiting_on = {key[0] for key in self._flights}
        responses = []
        timeout = datetime.timedelta(milliseconds=self.poll_ms)
        for which in sorted(waiting_on):  # outside the lock: abort() must not wait for the executor
            responses += [(which, r) for r in self.executors[which].await_responses(timeout=timeout)]
        with self._lock:
            return sum(self._on_response(which, r) for which, r in responses)

    def _on_response(self, which: str, response) -> int:
        flight = self._flights.get((which, response.request_id))
        if flight is None:  # cancelled (abort, stop string): its last answer
            return 0
        seq = flight.seq
        if response.has_error():
            del self._flights[(which, response.request_id)]
            self._release(seq)
            self._fail(seq, f"TensorRT-LLM: {response.error_msg}")
            return 1
        result = response.result
        if result.is_final:
            del self._flights[(which, response.request_id)]
        tokens = [int(t) for t in (result.output_token_ids[0] if result.output_token_ids else [])]
        if flight.kind == "draft":
            logits = result.generation_logits[0] if self.logits_acceptance and not seq.params.greedy else None
            self._verify(seq, tokens, logits)
            return 0
        if flight.kind == "verify" and not tokens and _reason_name(result) not in ("END_ID", "STOP_WORDS"):
            self._release(seq)  # no progress and no reason to stop: never loop on it
            self._fail(seq, f"TensorRT-LLM returned no tokens (finish reason {_reason_name(result) or 'none'})")
            return 1
        if flight.kind == "verify":
            verdict = self._verification(len(flight.draft), accepted_prefix(flight.draft, tokens), len(flight.draft))
        elif flight.responses > 0:  # the first streaming answer is the prompt's (context) iteration
            nodes = self.tree["num_drafts"] if self.mode == "medusa" else 0
            depth = self.tree["max_depth"] if self.mode == "medusa" else 0
            verdict = self._verification(nodes, max(len(tokens) - 1, 0), depth)
        else:
            verdict = Verdict(tokens, 0, [], 0)  # a target pass that decodes nothing yet
        seq.tally.on_pass(verdict)
        flight.responses += 1
        before = len(seq.text)
        kept = seq.append_tokens(tokens) if tokens else []
        reason = _reason_name(result)
        if not seq.finished and result.is_final and (flight.kind == "stream" or reason in ("END_ID", "STOP_WORDS")):
            seq._finish({"LENGTH": "length", "CANCELLED": "abort"}.get(reason, "stop"))
        if result.is_final:
            self._perf_stats(seq, result)
        if seq.handle is not None and (kept or seq.finished):
            seq.handle._emit(Event(kept, seq.text[before:], seq.finished, seq.finish_reason))
        if seq.finished:
            self._release(seq)
        return 1

    def _perf_stats(self, seq: Sequence, result) -> None:
        spec = getattr(getattr(result, "request_perf_metrics", None), "speculative_decoding", None)
        if spec is not None and getattr(spec, "total_draft_tokens", 0):
            seq.tally.note("stat_trtllm_total_draft_tokens", int(spec.total_draft_tokens))
            seq.tally.note("stat_trtllm_total_accepted_draft_tokens", int(spec.total_accepted_draft_tokens))
            seq.tally.note("stat_trtllm_acceptance_rate", round(float(spec.acceptance_rate), 4))


    def close(self) -> None:
        """Stop the loop and shut the executors down (the leader's shutdown releases the workers)."""
        self.stop()
        for ex in self.executors.values():
            ex.shutdown()
        self.executors = {}

    def wait_as_worker(self) -> None:
        """A non-leader rank: block until the leader is done (TensorRT-LLM leader mode)."""
        for ex in self.executors.values():
            ex.shutdown()
