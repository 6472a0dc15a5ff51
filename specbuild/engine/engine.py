"""Engine: the seam every front end drives (CLI generate, HTTP server, Triton model).

    engine = Engine.from_bundle("bundle/")
    handle = engine.submit(Request(prompt="Hello", sampling=SamplingParams(max_tokens=32)))
    for event in handle: print(event.text, end="")

`step()` runs one batched step; a server calls `start()` to run the loop on its own
thread, after which handles block on their queues instead of driving the loop.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from specbuild.bundle import BundleMeta, check_fingerprint, read_meta, read_model_config
from specbuild.errors import BundleError, RequestError
from specbuild.model.decoder import Decoder
from specbuild.sampling.constraint import GrammarBackend, ResponseFormat
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig
from specbuild.speculation.proposers.registry import accepts_flat_settings
from specbuild.engine.base import BaseEngine, validated_prompt_ids  # noqa: F401 (validated_prompt_ids: public here too)
from specbuild.engine.guarantees import guarantees
from specbuild.engine.scheduler import Scheduler
from specbuild.engine.sequence import Handle, Request, Sequence

log = logging.getLogger("specbuild.engine")


KV_DTYPES = ("auto", "float32", "float16")


@accepts_flat_settings(defaults=True)
@dataclass(frozen=True)
class EngineConfig:
    """Runtime settings (not part of the bundle). None means: the bundle's limit."""

    device: str = "cpu"
    threads: int | None = None
    max_batch_size: int | None = None
    kv_cache_tokens: int | None = None
    block_size: int = 16
    prefill_chunk: int = 256
    load_draft: bool = True  # False: the draft model runs elsewhere (MineDraft's draft rank)
    # auto: on CPU each dtype's float linears are stored in the layout measured cheaper at
    # load (qlinear.choose_layouts: float32 transposed, ~1.35x faster at 5-11 rows on the
    # machines measured; bfloat16 as rows, oneDNN's transposed kernel 1.6x slower there);
    # rows: as the bundle stores them (no start-up measurement; and a float32 layout changes
    # the last bits of results, so rows gives the same bits on every machine, e.g. to compare
    # machines or reproduce a result)
    weight_layouts: str = "auto"
    # run the target's layer stack compiled (torch.compile; model/compiled.py): fused glue, the
    # same kernels; every forward then runs compiled, so speculation stays lossless. Costs a
    # compile at load (cached on disk by inductor after the first)
    compile: bool = False
    # adapt the thread count to the cores other processes leave free (model/threads.ThreadGovernor:
    # a trial of the full count against fewer when others' load appears, the faster kept); only
    # where the thread count cannot change a result (checked at load). SPECBUILD_ADAPT_THREADS=0
    # turns it off too
    adapt_threads: bool = True
    # automatic prefix caching (model/kv_cache.py): full blocks of earlier text are recorded by a
    # hash chained over their tokens and adopted by later prompts that begin with the same text
    # (a chat's next turn, a shared system prompt); unheld ones are evicted least recently used
    # only when the cache needs room
    prefix_cache: bool = True
    # the KV cache's element type: float32, float16 (half the bytes attention reads each step and
    # half the memory a cached token takes; the fused int4 stack only, which widens each value
    # exactly before the float32 arithmetic), or auto: float16 where the fused stack runs an
    # int4-a8 bundle (whose layers already round every linear's input to 8-bit blocks; a float16
    # K/V keeps 11 bits), else the model's own dtype (Engine.kv_dtype says which and why)
    kv_cache_dtype: str = "auto"
    # the drafters' own settings: drafter name -> its module's Options (proposers/registry.py;
    # given as Options or a dict of their fields); a drafter not named here takes its Options'
    # defaults. Each setting may also be given flat as `<name>_<field>` (suffix_store_tokens=...),
    # the name it has on the CLI (--suffix-store-tokens) and as a Triton parameter, and read back
    # the same way (config.suffix_store_tokens)
    drafters: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.drafters:
            from specbuild.speculation.proposers.registry import make_options

            object.__setattr__(self, "drafters", make_options(self.drafters))
        if self.weight_layouts not in ("auto", "rows"):
            raise ValueError(f"weight_layouts={self.weight_layouts!r} is not one of auto, rows")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size={self.block_size} is not one of 8, 16, 32, 64, 128")
        if self.compile and torch.device(self.device).type != "cpu":
            raise ValueError(f"compile=True runs on CPU only (device={self.device!r}): its row-invariance is "
                             "checked there (tests/model/test_compiled.py); on a GPU use the eager torch backend "
                             "or TensorRT-LLM")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        if not 16 <= self.prefill_chunk <= 8192:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} is out of range [16, 8192]")


def kv_cache_dtype(model: Decoder, config: EngineConfig) -> tuple[torch.dtype, str]:
    """The target's KV cache dtype for `config.kv_cache_dtype`, and why (EngineConfig's comment).
    float16 needs the fused int4 stack (model/fused.py), the only reader that widens it: asked for
    elsewhere it is refused with the reason."""
    from specbuild.model.fused import fused_reason
    from specbuild.model.qlinear import QLinear

    asked = config.kv_cache_dtype
    if asked == "float32" or (asked == "auto" and model.dtype != torch.float32):
        return model.dtype, "asked" if asked == "float32" else "the model's dtype"
    why_not = "it runs without --compile (EngineConfig.compile)" if not config.compile else fused_reason(model)
    if asked == "float16":
        if why_not is not None:
            raise BundleError(f"kv_cache_dtype=float16 needs the fused int4 layer stack (model/fused.py), which does "
                              f"not run here: {why_not}; use float32 or auto")
        return torch.float16, "asked (kv_cache_dtype=float16)"
    first = model.w.get("layers.0.qkv")
    if why_not is None and isinstance(first, QLinear) and first.primary == "int4-a8":
        return torch.float16, ("auto: the fused stack on an int4-a8 bundle, whose linears round their inputs to "
                               "int8 blocks; half the K/V bytes; --kv-cache-dtype float32 keeps float32")
    return model.dtype, "auto: the model's dtype"


def drafter_options(config: EngineConfig, name: str) -> Any:
    """Drafter `name`'s Options in `config` (its defaults when config names none)."""
    from specbuild.speculation.proposers.registry import options_for

    return options_for(config.drafters, name)


def load_weights(role_dir: str, device: str) -> dict:
    """A role's weights: plain tensors, plus qlinear.QLinear objects (packed here) for the
    quantized or other-dtype weights that the role's quant.json lists."""
    from safetensors.torch import load_file

    path = os.path.join(role_dir, "weights.safetensors")
    if not os.path.isfile(path):
        raise BundleError(f"{role_dir!r} has no weights.safetensors")
    # every tensor in fresh 64-byte-aligned memory: safetensors places them at the file's offsets
    # (all at 24 mod 64 in a specbuild bundle), and oneDNN's bfloat16 matmul on misaligned weights
    # took 27 ms a step instead of 24.5 (SmolLM2-135M, one thread, measured)
    from specbuild.model.qlinear import ensure_aligned

    weights = {k: ensure_aligned(v) for k, v in load_file(path, device=device).items()}
    quant_path = os.path.join(role_dir, "quant.json")
    if os.path.isfile(quant_path):
        import json

        from specbuild.model.qlinear import build_qlinears

        with open(quant_path) as f:
            weights = build_qlinears(weights, json.load(f))
    return weights


def measured_layouts(weights: dict) -> dict:
    """qlinear.choose_layouts with its costs measured once per machine, thread count and set of
    linear shapes (model/timing.cached_costs), so every process on a machine stores a model's
    weights alike (a float32 layout changes the last bits of results)."""
    from specbuild.model.qlinear import choose_layouts, layout_costs
    from specbuild.model.timing import cached_costs, machine_key

    shapes = sorted({(tuple(t.shape), str(t.dtype)) for n, t in weights.items() if isinstance(t, torch.Tensor)
                     and t.dim() == 2 and n.startswith("layers.0.")})
    key = {"what": "weight layouts", **machine_key("cpu"), "layer0": [[list(s), d] for s, d in shapes]}
    costs, _ = cached_costs(key, lambda: layout_costs(weights))
    return choose_layouts(weights, costs)


def attach_format_plans(model: Decoder, max_draft_len: int) -> None:
    """Measure which format each width runs in (only when weights hold several formats)."""
    from specbuild.model.qlinear import attach_plans

    t0 = time.perf_counter()
    plans = attach_plans(model, sorted({1, 2, 3, 4, 6, 8, 12, 16, 32, max_draft_len + 1}))
    for group, plan in plans.items():
        log.info("formats for %s: %s (measured in %.2fs)", group, plan.describe(), time.perf_counter() - t0)


def shared_draft_weights(bundle_dir: str, role: dict, weights: dict, target_w: dict) -> tuple[dict, torch.Tensor | None]:
    """A draft role's weights with its `shares` filled in from the target's (the same
    tensors, not copies; with a `vocab_map` the output layer is the shared tensor's rows at
    those ids) and its vocab_map ([N] target ids) or None. See compiler/draft_role.py."""
    from specbuild.model.qlinear import as_dense

    vocab_map = None
    if role.get("vocab_map"):
        from safetensors.torch import load_file

        vocab_map = load_file(os.path.join(bundle_dir, role["vocab_map"]))["vocab_map"]
    for name, ref in (role.get("shares") or {}).items():
        shared = target_w[ref.split("/", 1)[1]]
        if name == "lm_head" and vocab_map is not None:
            shared = as_dense(shared)[vocab_map.to(as_dense(shared).device)].contiguous()
        weights = {**weights, name: shared}
    return weights, vocab_map


MAX_TOP_LOGPROBS = 20  # OpenAI's limit
FIXED_TREE_METHODS = ("medusa", "recycle")  # built-in drafters of a request-chosen tree (named in errors)


def check_logprobs(request: Request) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(request, name)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS):
            raise RequestError(f"{name}={n!r} must be an integer in [0, {MAX_TOP_LOGPROBS}] (the number of most "
                               "likely tokens to report beside each chosen one)")


class Engine(BaseEngine):
    """A loaded bundle plus the scheduler that serves it (the torch step loop): the torch
    backend that `backends.select.open_engine` returns."""

    backend_name = "torch"
    # Request.prompt_logprobs is served: the request's own prefill keeps its prompt rows' logits
    # (engine/scheduler.py), so it is validated, queued, batched and aborted like any request
    supports_prompt_logprobs = True
    defer_wakes = True  # the waiters woken as each forward begins (BaseEngine.wake_listener)

    def __init__(self, bundle_dir: str, config: EngineConfig = EngineConfig(), drafters: dict | None = None,
                 planning=None) -> None:
        """drafters: method name -> Proposer, used instead of (or beside) the bundle's own (a
        "draft" given here means the bundle's draft model is not loaded); planning: the
        scheduler's planning policy (Scheduler.run_step). MineDraft opens with both
        (mpi/minedraft.plugin)."""
        t0 = time.perf_counter()
        self.drafters = dict(drafters or {})
        if config.threads:
            torch.set_num_threads(config.threads)
        self.bundle_dir = bundle_dir
        self.config = config
        self.meta: BundleMeta = read_meta(bundle_dir)
        tokenizer_json = check_fingerprint(bundle_dir, self.meta)
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self._tokenizer_json = tokenizer_json
        self._grammar = None  # sampling.constraint.GrammarBackend, made at the first structured request
        limits = self.meta.limits
        self.max_seq_len = limits.max_seq_len
        self.max_batch_size = config.max_batch_size or limits.max_batch_size
        if self.max_batch_size > limits.max_batch_size:
            raise BundleError(f"max_batch_size={self.max_batch_size} exceeds the bundle's limit "
                              f"{limits.max_batch_size}; recompile with --max-batch-size")
        if "target" not in self.meta.roles:
            raise BundleError(f"bundle {bundle_dir!r} has no target role")
        target_dir = os.path.join(bundle_dir, self.meta.roles["target"]["path"])
        self.target_config = read_model_config(target_dir)
        weights = load_weights(target_dir, config.device)
        self.layouts: dict = {}
        if config.weight_layouts == "auto" and torch.device(config.device).type == "cpu":
            self.layouts = measured_layouts(weights)
            log.info("weight layouts (ms, widths 1 + 5, two layers): %s", self.layouts)
        self.model = Decoder(self.target_config, weights, self.max_seq_len + limits.max_draft_len + 2,
                             device=config.device)
        attach_format_plans(self.model, limits.max_draft_len)
        # room for the bundle's full batch even when this engine runs fewer at once: what a
        # smaller batch leaves free keeps earlier requests' blocks for the prefix cache (a batch
        # of one sized for one request evicted every earlier chat before its next turn came)
        kv_tokens = config.kv_cache_tokens or max(self.max_batch_size, limits.max_batch_size or 1) * (
            self.max_seq_len + limits.max_draft_len + 16)
        self.kv_dtype, self.kv_why = kv_cache_dtype(self.model, config)
        self.cache = self.model.new_cache(-(-kv_tokens // config.block_size), config.block_size, self.kv_dtype)
        if self.kv_dtype != self.model.dtype:
            print(f"specbuild: KV cache {str(self.kv_dtype).split('.')[-1]} ({self.kv_why})", file=sys.stderr)
        sp = self.meta.special_tokens
        self.eos_ids = tuple(sp.get("eos_token_ids") or ([sp["eos_token_id"]] if sp.get("eos_token_id") is not None else []))
        self.default_sampling = SamplingParams.from_dict(
            {k: v for k, v in self.meta.default_sampling.items()})
        self.speculator = self.make_speculator()
        self.compile_seconds = None
        if config.compile:
            from specbuild.model.timing import warm_up_compiled
            from specbuild.speculation.calibration import compile_drafters

            try:
                # a head's aux layers in every forward's graph (Decoder.compile): one graph family
                self.model.compile(aux_layers=self.speculator.aux_layers)
                aux = [self.speculator.aux_layers] if self.speculator.aux_layers else [()]
                self.compile_seconds = warm_up_compiled(self.model, self.cache, aux)
                # draft models too (their proposals only decide speed; the target's pass decides tokens)
                self.compile_seconds += compile_drafters(self.speculator.proposers)
            except Exception as e:  # noqa: BLE001 - inductor's failures (no C++ compiler, ...) vary widely
                raise BundleError(f"compile=True: torch.compile of the layer stack failed here ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:300] if str(e) else ''}); inductor's CPU backend needs a "
                                  "C++ compiler (g++); run without --compile") from e
            log.info("compiled the layer stacks in %.1fs", self.compile_seconds)
            # which stack runs and why, in one line (the kernels' own lines say which linears run)
            kernel = "the int4 x int8 kernel (int4-a8)" if getattr(self.model.compiled, "kind", "") == "int4-a8" \
                else "specbuild's kernel"
            how = f"one fused C++ call (model/fused.py: int4 layers on {kernel}, rows attention)" \
                if self.model.fused_why is None else f"torch.compile (inductor; not fused: {self.model.fused_why})"
            print(f"specbuild: the target's layer stack runs as {how}", file=sys.stderr)
        _ = self.speculator.controller  # cost calibration now (cached per machine + bundle), never in a request
        self.default_speculation = SpeculationConfig.make(
            None, **{k: v for k, v in self.meta.default_speculation.items()})
        if self.default_speculation.method not in self.methods + list(self.meta.roles) \
                or self.default_speculation.method in self.unavailable:
            self.default_speculation = SpeculationConfig.make(None, method="none")
        # the draft depth's bound: the bundle's own default where it names one, else the most draft
        # tokens it was compiled for (`compile --max-draft-len`: a bundle built for 16 drafts 16 deep
        # where a match or an acceptance estimate says so; the default bundle's 8 is the config's 8)
        named = self.meta.default_speculation.get("gamma_max")
        gamma_max = limits.max_draft_len if named is None else min(int(named), limits.max_draft_len)
        self.default_speculation = SpeculationConfig.make(self.default_speculation, gamma_max=gamma_max)
        self._init_loop(threading.Lock())
        self.scheduler = Scheduler(self.model, self.cache, self.max_batch_size, self.max_seq_len, self.speculator,
                                   config.prefill_chunk, waiting=self.waiting, running=self.running,
                                   planning=planning, prefix_cache=config.prefix_cache)
        self.model.before_stack = self.flush_wakes  # the waiters woken as the layer stack begins
        self.policies = None  # speculation.policy.PolicyTable (set_policies) or None
        self.threads_governor, self.threads_why = self.make_governor()
        self.step_thread: int | None = None  # the ident of the thread that ran the last step
        self.load_seconds = time.perf_counter() - t0

    def make_governor(self):
        """(ThreadGovernor or None, why): the governor where it may run (a CPU engine of more than
        one thread whose results the thread count does not change), else None and the reason."""
        from specbuild.model.fused import LINEARS
        from specbuild.model.qlinear import QLinear
        from specbuild.model.threads import REVISIT_S, ThreadGovernor
        from specbuild.model.timing import thread_count_changes_results

        threads = torch.get_num_threads()
        if not self.config.adapt_threads:
            return None, "adapt_threads=False"
        if os.environ.get("SPECBUILD_ADAPT_THREADS") == "0":
            return None, "SPECBUILD_ADAPT_THREADS=0"
        if torch.device(self.config.device).type != "cpu":
            return None, f"device {self.config.device}"
        if threads < 2:
            return None, "one thread"
        m = self.model
        if not m.rows_attention or not all(isinstance(m.w.get(f"layers.{i}.{n}"), QLinear)
                                           for i in range(m.config.num_layers) for n in LINEARS):
            # torch's float kernels may split a sum differently by thread count (measured: float32
            # logits differ between 2 threads and 1); specbuild's int kernels and rows attention
            # give each output to one thread
            return None, "its layers are not all on specbuild's quantized kernels with rows attention"
        if thread_count_changes_results(self.model, self.cache, threads):
            return None, f"this model's logits differ between {threads} threads and 1 (torch's kernels split sums by thread)"
        from specbuild.model import cpu_kernels

        pool_mode = cpu_kernels.pool_mode()
        if pool_mode == 1:
            return ThreadGovernor(threads, pool=cpu_kernels.pool_contended, set_mode=cpu_kernels.kernels_mode,
                                  choices=[("pool", threads)]), \
                f"{threads} threads; the kernels' loops on their own pool (SPECBUILD_POOL=1)"
        if pool_mode == 2:  # measured in the stepping thread (decide_threads); others' load: the pool
            return ThreadGovernor(threads, pool=cpu_kernels.pool_contended, set_mode=cpu_kernels.kernels_mode,
                                  choices=[("pool", threads), ("openmp", threads), ("openmp", 1)]), \
                f"the fastest of the kernels' pool, OpenMP and one thread, timed in the thread that runs the " \
                f"steps and tried again on real steps every {REVISIT_S:.0f} s; the pool under others' load " \
                "(SPECBUILD_POOL=auto)"
        return ThreadGovernor(threads), f"up to {threads} threads, fewer when others' load makes fewer faster"

    def decide_threads(self) -> dict | None:
        """Choose the kernels' threading (ThreadGovernor.decide) in the calling thread, the one
        that will run the steps: one-row decode forwards after 64 cached tokens, each candidate
        in turn. Prints one line with the choice and each candidate's ms per forward. Once per
        engine and stepping thread; None where there is no governor."""
        from specbuild.model.timing import fit_context, scratch_sequence, verify_batch

        g = self.threads_governor
        here = threading.get_ident()
        if g is None or (g.decided is not None and g.decided["thread_ident"] == here):
            return None if g is None else g.decided
        with self._lock:
            if g.decided is not None and g.decided["thread_ident"] == here:
                return g.decided
            context = fit_context(self.model, self.cache, 64, 1)
            with torch.inference_mode(), scratch_sequence(self.cache, context + 1) as slots:
                batch = verify_batch(slots, context, 1)

                def measure() -> float:
                    t0 = time.perf_counter()
                    self.model.forward(batch, self.cache)
                    return time.perf_counter() - t0

                d = g.decide(measure)
        ms = ", ".join(f"{k} {v:.2f}" for k, v in d["ms"].items())
        timed = f" (ms per decode forward, timed in thread {d['thread']}: {ms})" if ms else ""
        print(f"specbuild: threads: {d['choice']}{timed}; {self.threads_why}", file=sys.stderr)
        return d

    @classmethod
    def from_bundle(cls, bundle_dir: str, **kwargs) -> "Engine":
        return cls(bundle_dir, EngineConfig(**kwargs))

    def make_speculator(self):
        """The drafters of proposers/registry.py that this bundle and configuration serve
        (prompt lookup always), behind one Speculator; a drafter that cannot be served in this
        configuration is named in self.unavailable with why."""
        from specbuild.speculation.proposers.base import DrafterContext, EngineSettings
        from specbuild.speculation.proposers.registry import build_all
        from specbuild.speculation.speculator import Speculator

        limits = self.meta.limits
        c = self.config
        settings = EngineSettings(device=c.device, block_size=c.block_size, prefix_cache=c.prefix_cache,
                                  load_draft=c.load_draft)
        ctx = DrafterContext(self.bundle_dir, self.meta, settings, self.model, self.cache, limits.max_draft_len,
                             self.max_seq_len, self.load_role_model,
                             encode=lambda text: self.encode(text, add_special_tokens=False))
        proposers, self.unavailable = build_all(ctx, self.drafters, c.drafters)
        return Speculator(self.model, self.cache, proposers, limits.max_draft_len, self.max_seq_len)

    def load_role_model(self, role_name: str) -> tuple[Decoder, torch.Tensor | None]:
        """A decoder role of the bundle (a draft model): its weights with the target's shared
        tensors filled in, its formats planned; and its vocab_map or None."""
        role = self.meta.roles[role_name]
        role_dir = os.path.join(self.bundle_dir, role["path"])
        weights, vocab_map = shared_draft_weights(self.bundle_dir, role, load_weights(role_dir, self.config.device),
                                                  self.model.w)
        model = Decoder(read_model_config(role_dir), weights, self.max_seq_len + self.meta.limits.max_draft_len + 2,
                        device=self.config.device)
        attach_format_plans(model, self.meta.limits.max_draft_len)
        return model, vocab_map

    # ---- requests ---------------------------------------------------------------------
    def _new_sequence(self, request: Request) -> Sequence:
        prompt_ids = validated_prompt_ids(request, self.encode, self.target_config.vocab_size, self.max_seq_len)
        params = request.sampling.with_seed()
        spec = self.resolve_speculation(request)
        source = request.shares_prompt_with
        shared = source.seq if source is not None and getattr(source, "seq", None) is not None \
            and source.seq.prompt_ids == prompt_ids else None
        seq = Sequence(request, prompt_ids, params, spec, self.tokenizer, self.eos_ids, self.max_seq_len, shared)
        check_logprobs(request)
        fmt = ResponseFormat.parse(request.response_format) if isinstance(request.response_format, dict) \
            else request.response_format
        if fmt is not None:
            seq.admission.constraint = self.grammar().constraint(fmt)
        self.assign_content_type(request, seq)
        need = self.scheduler.block_budget(seq)
        if need > self.cache.num_blocks:
            raise RequestError(f"request needs {need} KV blocks (prompt {len(prompt_ids)} + max_tokens "
                               f"{params.max_tokens} tokens) but the cache holds {self.cache.num_blocks}; "
                               "lower max_tokens or raise --kv-cache-tokens")
        return seq

    def grammar(self) -> GrammarBackend:
        """The bundle's tokenizer as the grammar engine reads it (compiled grammars cached)."""
        if self._grammar is None:
            self._grammar = GrammarBackend(self._tokenizer_json, self.target_config.vocab_size, list(self.eos_ids))
        return self._grammar

    @property
    def methods(self) -> list[str]:
        """Speculation methods this bundle can serve."""
        return ["none", *self.speculator.proposers, "auto"]

    def drafter_settings(self) -> dict:
        """Every registered drafter's settings as this engine runs them (its Options, defaults
        filled in), `<name>_<field>` -> value; a setting naming a server-side file (Options field
        metadata "path") reads as whether one is set, never the path."""
        from specbuild.speculation.proposers.registry import names, options_for, settings

        opts = {name: options_for(self.config.drafters, name) for name in names()}
        return {key: (getattr(opts[name], f.name) is not None) if f.metadata.get("path") else getattr(opts[name], f.name)
                for key, (name, f) in settings().items()}

    def describe_guarantees(self) -> dict:
        """The torch rows of the guarantees table (engine/guarantees.py) for this bundle's methods."""
        return guarantees("torch", methods=self.methods)

    def resolve_speculation(self, request: Request) -> SpeculationConfig:
        """The request's setting (or the bundle's default), checked against what we have."""
        spec = SpeculationConfig.for_request(request.speculation, self.default_speculation)
        if spec.method in self.unavailable:
            raise RequestError(f"speculation method {spec.method!r}: {self.unavailable[spec.method]}")
        if spec.method not in self.methods:
            raise RequestError(f"speculation method {spec.method!r} is not available in this bundle "
                               f"(available: {', '.join(self.methods)})")
        if spec.method != "none" and spec.gamma_max > self.meta.limits.max_draft_len:
            raise RequestError(f"gamma_max={spec.gamma_max} exceeds the bundle's max_draft_len "
                               f"{self.meta.limits.max_draft_len}; recompile with --max-draft-len")
        tree_methods = (*self.tree_methods(all_known=True), "auto")
        if spec.tree is not None and spec.tree != self.default_speculation.tree and spec.method not in tree_methods:
            # EAGLE grows its tree each step from the head's scores within a node budget set by the
            # measured verify cost (proposers/eagle.py); a fixed tree has no place there, and chains
            # (ngram, draft) have none: refused rather than silently ignored
            raise RequestError(f"tree={str(spec.tree)[:60]!r} applies to speculation methods "
                               f"{', '.join(tree_methods)}, not {spec.method!r}"
                               + (" (EAGLE builds its own tree each step from the head's scores)"
                                  if spec.method == "eagle" else ""))
        for name, prop in self.speculator.proposers.items():  # e.g. a fixed tree the request names
            if spec.method in (name, "auto"):
                prop.check_request(spec, self.meta.limits.max_draft_len)
        return spec

    def tree_methods(self, all_known: bool = False) -> list[str]:
        """The drafters whose tree a request may choose (request_tree: Medusa, token recycling);
        all_known also names the built-in ones this bundle lacks."""
        have = [n for n, p in self.speculator.proposers.items() if p.request_tree]
        return list(dict.fromkeys([*FIXED_TREE_METHODS, *have])) if all_known else have

    # ---- telemetry and gamma policies (engine/events.py, speculation/policy.py) ---------------
    @property
    def model_id(self) -> str:
        """The target's name for telemetry and policies: its source's base name (64 chars)."""
        source = str(self.meta.roles.get("target", {}).get("source") or self.bundle_dir)
        return os.path.basename(source.rstrip("/\\")).removesuffix(".gguf")[:64] or "target"

    def set_sink(self, sink) -> None:
        """Report sessions, steps and failure-mode events to `sink` (an events.EventSink; None: off).
        Call before submitting requests."""
        from specbuild.engine.events import NULL_SINK

        sink = sink or NULL_SINK
        with self._lock:
            self.scheduler.sink = sink
            self.speculator.set_emit(sink.on_event if sink.enabled else None)

    def set_policies(self, policies) -> None:
        """Start each new sequence from its content type's policy (a PolicyTable; None: off)."""
        self.policies = policies if policies else None

    def assign_content_type(self, request: Request, seq: Sequence) -> None:
        """seq's content type (the request's, else the classifier's) and its gamma policy;
        skipped (both None) when neither a sink nor policies would use them."""
        if request.content_type is not None:
            from specbuild.speculation.policy import check_content_type

            seq.admission.content_type = check_content_type(request.content_type)
            seq.admission.content_type_source = "request"
        elif self.policies is not None or self.scheduler.sink.enabled:
            from specbuild.speculation.policy import classify_prompt

            text = request.prompt if request.prompt is not None else self.tokenizer.decode(seq.prompt_ids[-2048:])
            seq.admission.content_type = classify_prompt(text)
            seq.admission.content_type_source = "classifier"
        if self.policies is not None and seq.spec is not None and seq.spec.enabled:
            seq.admission.gamma_policy = self.policies.lookup(seq.content_type, seq.spec.method)

    def _extra_stats(self) -> dict:
        """With a telemetry sink attached (set_sink), its counters in stats():
        telemetry_rows_dropped / _written / _queued, telemetry_write_errors; each drafter's
        engine_stats (the suffix drafter's global store: suffix_store_requests / _tokens /
        _max_tokens / _evictions / _warm_tokens); and
        threads: the step's thread count now, with the ThreadGovernor's state (or why it is off);
        step_parts: where the steps' time went, by kind and batch size (engine/stepparts.py);
        auto_switch: auto's plain-or-speculate arm by batch size (speculation/goodput.py);
        row_price: a decode step's learned cost per forward row by batch size, the draft
        nodes that the batch's fit (Speculator.fit_to_batch) was offered and kept, and the
        factor it scales each drafter's own node odds by (Speculator.odds_factor);
        prefix_cache: whether it is on, prompt tokens looked up and found (hit_rate), blocks
        recorded, evicted, recorded now (cached_blocks) and held by no request (evictable_blocks)."""
        out = dict(self.scheduler.sink.stats())
        out["prefix_cache"] = {"enabled": self.scheduler.prefix_cache, **self.cache.prefix_stats()}
        out["step_parts"] = self.scheduler.parts.describe()
        out["auto_switch"] = self.speculator.goodput.describe()
        out["row_price"] = self.speculator.fit_stats()
        out["threads"] = {**self.threads_governor.describe(), "why": self.threads_why} \
            if self.threads_governor is not None \
            else {"threads": torch.get_num_threads(), "adaptive": False, "why": self.threads_why}
        from specbuild.model import cpu_kernels

        pool = cpu_kernels.pool_stats() if torch.device(self.config.device).type == "cpu" else {}
        if pool:  # the kernels' pool: jobs, chunks by helpers and callers, waits for a preempted helper
            out["threads"] = {**out["threads"], "kernels_pool": pool}
        for prop in self.speculator.proposers.values():  # the drafters' own (DrafterBase.engine_stats)
            out.update(prop.engine_stats())
        return out

    def _failure_counts(self) -> dict[str, int]:
        """The loop's own count plus the scheduler's isolated failures (engine/scheduler.py)."""
        own = getattr(self.scheduler, "failures", {})
        return {"step": self._loop_failures + own.get("step", 0), "sequence": own.get("sequence", 0)}

    def _kv_blocks(self) -> tuple[int | None, int | None]:
        """(used, total) KV cache blocks, for stats()."""
        return self.cache.used_blocks, self.cache.num_blocks

    def clear_prefix_cache(self) -> int:
        """Forget every recorded prefix block (thread-safe): benchmarks start each row cold, so
        a row never reuses another row's prompts. Returns the records dropped."""
        with self._lock:
            return self.cache.forget()

    def abort(self, handle: Handle) -> None:
        """Stop a request and free its KV blocks (thread-safe)."""
        with self._lock:
            self.scheduler.abort(handle.seq)

    # ---- the loop -----------------------------------------------------------------------
    def _before_run(self) -> int:
        """run_until_done (generate, bench without a loop thread) steps in the caller's thread: the
        governor sets that thread's count again, and _after_run gives the caller's count back (with
        the kernels on their pool the steps keep torch's own ops on one thread)."""
        if self.threads_governor is not None:
            self.threads_governor.reprime()
        return torch.get_num_threads()

    def _after_run(self, state: int) -> None:
        torch.set_num_threads(state)

    def _before_loop(self) -> None:
        self.decide_threads()  # in the engine loop's thread, before the first request

    def step(self) -> int:
        governor = self.threads_governor
        if governor is not None and (governor.decided is None or governor.decided["thread_ident"] != threading.get_ident()):
            self.decide_threads()  # generate, bench: in the caller's thread, which runs the steps; again if
            # the steps move to another thread (decided where they ran before)
        with self._lock:
            self.step_thread = threading.get_ident()
            if governor is None:
                return self.scheduler.run_step()
            governor.before()
            # a step on a threading under trial (OpenMP ran 1.3-2x the pool's step served) says
            # nothing of what steps cost once the choice is kept: the row price skips it
            self.speculator.learn_costs = not governor.trialling
            t0 = time.perf_counter()
            n = self.scheduler.run_step()
            if n:  # the step's shape: a thread trial compares like with like
                governor.after(time.perf_counter() - t0, self.scheduler.parts.last_shape)
            return n

    def _fail_running(self, message: str) -> None:
        """Release and fail every running request (called with the lock held)."""
        for seq in list(self.scheduler.running):
            self.scheduler.release(seq)
            self.scheduler.fail(seq, message)
