"""A stand-in for `tensorrt_llm.bindings.executor`, to run specbuild's TensorRT-LLM adapter
(backends/tensorrt_llm.py) without TensorRT-LLM or a GPU. It checks the adapter's logic (draft
rounds, streaming, stats, abort, limits, leader mode), NOT TensorRT-LLM.

Two ways in:

- in process: test_backend.py's `stub_trtllm` fixture puts `stub_module()` into sys.modules;
- in a subprocess (the CLI, under `mpirun` too): set
  `SPECBUILD_TEST_TRTLLM_BINDINGS=trtllm_stub:mpi_bindings` and put tests/ on PYTHONPATH;
  `trtllm_engine.stand_in_bindings` then uses `mpi_bindings()` instead of importing
  TensorRT-LLM (the returned module carries `SPECBUILD_TEST_STUB = True`, which the runtime
  requires of anything named there). Its executor talks MPI between ranks as TensorRT-LLM's
  leader mode does: only rank 0 can enqueue, and a worker rank's shutdown() returns only
  once rank 0's shutdown() released it. Each rank reports what it did on stderr
  ("stub executor rank R/N ROLE: ...").
"""

from __future__ import annotations

import json
import os
import sys
import time
import types

from specbuild.engine.engine import Engine, EngineConfig
from specbuild.sampling.params import SamplingParams
from specbuild.engine.sequence import Request
from specbuild.backends.tensorrt_llm import accepted_prefix, engine_limits


class _Rec(types.SimpleNamespace):
    def __init__(self, *args, **kw):
        super().__init__(args=args, **kw)


_ORACLES: dict[str, Engine] = {}
STUB_VERSION = "0.19.0"  # the release whose executor API the stand-in follows


def oracle(bundle: str, ids: list[int], n: int) -> list[int]:
    """Plain greedy continuation by the torch engine (what a correct engine must produce)."""
    if bundle not in _ORACLES:
        _ORACLES[bundle] = Engine(bundle, EngineConfig())
    r = _ORACLES[bundle].generate([Request(prompt_ids=list(ids), speculation={"method": "none"},
                                           sampling=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))])
    return r[0]["token_ids"]


class StubResponse:
    def __init__(self, request_id, tokens=(), final=True, reason="LENGTH", error=None):
        self.request_id, self.error_msg = request_id, error
        self.result = types.SimpleNamespace(is_final=final, output_token_ids=[list(tokens)],
                                            finish_reasons=[types.SimpleNamespace(name=reason)],
                                            generation_logits=None, request_perf_metrics=None)

    def has_error(self):
        return self.error_msg is not None


def kernel_error(pretrained: dict, speculative: bool) -> str | None:
    """What TensorRT-LLM's attention answers at the first generation step of an engine with this
    pretrained_config (rules: specbuild/formats/trtllm_support.py, read in NVIDIA/TensorRT-LLM):
    "unsupported head_size" outside the masked-MHA sizes; for speculative tree (Medusa/EAGLE)
    generation (`speculative`), which alone takes the spec-decoding XQA path (generation_mixin.py
    gives draft/target engines no packed mask, so their drafts are not `speculative` here), no
    XQA kernel for a float32 engine or a non-power-of-two group per rank."""
    from specbuild.formats.trtllm_support import MMHA_HEAD_SIZES, SPECULATIVE_DTYPES, xqa_group

    heads = int(pretrained["num_attention_heads"])
    head = int(pretrained.get("head_size") or int(pretrained["hidden_size"]) // heads)
    if head not in MMHA_HEAD_SIZES:
        return f"[TensorRT-LLM][ERROR] Assertion failed: unsupported head_size {head}"
    if speculative:
        tp = int(pretrained["mapping"].get("tp_size", 1))
        group = xqa_group(heads, int(pretrained.get("num_key_value_heads") or heads), tp)
        if pretrained.get("dtype") not in SPECULATIVE_DTYPES or group & (group - 1):
            return "[TensorRT-LLM][ERROR] No available XQA kernels are found for speculative decoding mode."
    return None


def paged_context_fmha(engine_config: dict) -> bool | None:
    """build_config.plugin_config.use_paged_context_fmha of an engine config (None: not recorded)."""
    plugin = (engine_config.get("build_config") or {}).get("plugin_config") or {}
    return None if "use_paged_context_fmha" not in plugin else bool(plugin["use_paged_context_fmha"])


class StubExecutor:
    """Greedy executor: tokens from the torch oracle; drafts accepted while equal to its
    argmax, one more token after; streaming answers one engine iteration per await (Medusa
    iterations yield 3, 1, 2, ... tokens); a draft-role engine corrupts every third token.

    It enforces what the real runtime enforces (see kernel_error and __init__): kernels per head
    size, and dtype and XQA group for Medusa; KV block reuse (which needs an engine built with paged
    context FMHA) for a draft/target target; Medusa tp-only; prompt +
    max_tokens + drafts within the engine's recorded max_seq_len; draft logits sized to the
    target's padded vocabulary."""

    instances: list["StubExecutor"] = []

    def __init__(self, engine_dir, model_type, config):
        engine_dir = str(engine_dir)
        self.role = os.path.basename(engine_dir)
        self.bundle = os.path.dirname(os.path.dirname(os.path.dirname(engine_dir)))
        self.engine_config = json.load(open(os.path.join(engine_dir, "config.json")))
        self.limits = engine_limits(self.engine_config)
        self.vocab = int(self.limits["vocab_size"])
        self.medusa = getattr(config.decoding_config, "decoding_mode", None) == "medusa"
        if self.medusa and self.limits["pp"] > 1:
            raise RuntimeError("[TensorRT-LLM][ERROR] Medusa does not support pipeline parallelism")
        # trtGptModelInflightBatching.cpp (fixExecutorConfig): block reuse is turned off, with a warning, for an
        # engine built without paged context FMHA; a draft/target target then fails its reuse check
        self.block_reuse = bool(config.kv_cache_config.enable_block_reuse)
        if self.block_reuse and paged_context_fmha(self.engine_config) is False:
            print("[TensorRT-LLM][WARNING] Fixing executorConfig: KV cache reuse disabled because model was not "
                  "built with paged context FMHA support", file=sys.stderr)
            self.block_reuse = False
        if "draft_tokens_external" in self.limits["modes"] and not self.block_reuse:
            raise RuntimeError("[TensorRT-LLM][ERROR] KV cache block reuse must be enabled for speculative "
                               "decoding target model")
        self.config, self.requests, self.pending, self.next_id, self.shut = config, [], {}, 1, False
        StubExecutor.instances.append(self)

    def _refusal(self, req) -> str | None:
        """The error the real executor answers this request with, or None."""
        drafts = req.external_draft_tokens_config.tokens if req.external_draft_tokens_config else []
        pre = self.engine_config.get("pretrained_config") or {}
        error = kernel_error(pre, speculative=self.medusa) if "num_attention_heads" in pre else None
        if error:
            return error
        need = len(req.input_token_ids) + req.max_tokens + len(drafts)
        if need > self.limits["max_seq_len"]:
            return (f"[TensorRT-LLM][ERROR] Assertion failed: prompt length + max new tokens + draft tokens ({need}) "
                    f"exceeds max_seq_len ({self.limits['max_seq_len']})")
        logits = req.external_draft_tokens_config.logits if req.external_draft_tokens_config else None
        if logits is not None:
            from specbuild.formats.trtllm_checkpoint import pad_vocab_size

            want = (len(drafts), pad_vocab_size(self.vocab, self.limits["tp"]))
            if tuple(logits.shape) != want:
                return f"[TensorRT-LLM][ERROR] draft logits shape {tuple(logits.shape)} != {want}"
        return None

    def can_enqueue_requests(self):
        return int(os.environ.get("PMI_RANK", "0")) == 0

    def enqueue_request(self, req):
        rid, self.next_id = self.next_id, self.next_id + 1
        self.requests.append(req)
        drafts = req.external_draft_tokens_config.tokens if req.external_draft_tokens_config else []
        ids = req.input_token_ids
        if len(drafts) > self.limits["max_draft_len"]:  # what TensorRT-LLM answers
            self.pending[rid] = [StubResponse(rid, error=f"Number of draft tokens ({len(drafts)}) > maximum "
                                                         f"({self.limits['max_draft_len']})")]
            return rid
        refusal = self._refusal(req)
        if refusal:
            self.pending[rid] = [StubResponse(rid, error=refusal)]
            return rid
        # sampled requests are answered greedily (a stand-in, not a sampler); never with drafts
        assert req.sampling_config.top_k == 1 or not drafts, "sampled drafts reached the stub"
        tokens = oracle(self.bundle, ids, len(drafts) + 1 if drafts else req.max_tokens)
        if self.role == "draft":
            tokens = [(t + 1) % self.vocab if (len(ids) + i) % 3 == 0 else t for i, t in enumerate(tokens)]
        if drafts:
            tokens = tokens[:accepted_prefix(drafts, tokens) + 1]
        reason = "LENGTH"
        if req.end_id is not None and req.end_id in tokens:
            tokens, reason = tokens[:tokens.index(req.end_id) + 1], "END_ID"
        if not req.streaming:
            chunks = [tokens]
        elif self.medusa:
            chunks, rest, sizes = [tokens[:1]], tokens[1:], [3, 1, 2]
            while rest:
                chunks.append(rest[:sizes[len(chunks) % 3]])
                rest = rest[len(chunks[-1]):]
        else:
            chunks = [[t] for t in tokens]
        self.pending[rid] = [StubResponse(rid, c, i == len(chunks) - 1, reason) for i, c in enumerate(chunks)]
        return rid

    def await_responses(self, timeout=None):
        out = []
        for rid in list(self.pending):  # one iteration: at most one answer per request
            out.append(self.pending[rid].pop(0))
            if not self.pending[rid]:
                del self.pending[rid]
        return out

    def cancel_request(self, rid):
        if rid in self.pending:
            self.pending[rid] = [StubResponse(rid, (), True, "CANCELLED")]

    def shutdown(self):
        self.shut = True


class MpiStubExecutor(StubExecutor):
    """StubExecutor on every rank of `mpirun -n N`, with TensorRT-LLM's leader-mode contract
    (CommunicationMode.LEADER): every rank builds one; only rank 0 can enqueue; rank 0's
    shutdown() tells each other rank's executor of the same role to stop, and a worker's
    shutdown() waits for that (polling, so it spins no core). MPI through mpi4py, initialised
    by the first executor as TensorRT-LLM's initialises it; MPI_Finalize runs at exit."""

    _built = 0  # executors built in this process: the same order on every rank, one tag each

    def __init__(self, engine_dir, model_type, config):
        super().__init__(engine_dir, model_type, config)
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        if self.size > 1 and MpiStubExecutor._built:  # issue 17 row 7: what specbuild refuses at load
            raise RuntimeError("a second leader-mode executor on a multi-rank MPI world: its collectives would wait "
                               "on the first executor's (a hang on a GPU)")
        self.tag = 100 + MpiStubExecutor._built
        MpiStubExecutor._built += 1
        self.say(f"built, can_enqueue_requests={self.can_enqueue_requests()}")

    def say(self, what: str) -> None:
        print(f"stub executor rank {self.rank}/{self.size} {self.role}: {what}", file=sys.stderr, flush=True)

    def can_enqueue_requests(self):
        return self.rank == 0

    def shutdown(self):
        if self.shut:
            return
        if self.rank == 0:
            pending = [self.comm.isend(b"stop", dest=r, tag=self.tag) for r in range(1, self.size)]
            while not all(p.Test() for p in pending):
                time.sleep(0.01)
            self.say(f"shut down; released {self.size - 1} worker rank(s)")
        else:
            self.say("waiting for rank 0's shutdown")
            request = self.comm.irecv(source=0, tag=self.tag)
            while not request.Test():
                time.sleep(0.01)
            self.say("released by rank 0")
        self.shut = True


def stub_module(executor: type = StubExecutor) -> types.ModuleType:
    m = types.ModuleType("tensorrt_llm.bindings.executor")
    m.SPECBUILD_TEST_STUB = True  # what backends/tensorrt_llm.stand_in_bindings requires
    m.TENSORRT_LLM_VERSION = STUB_VERSION  # the release it stands in for (checked like tensorrt_llm.__version__)
    m.ModelType = types.SimpleNamespace(DECODER_ONLY="decoder_only")
    m.CommunicationType = types.SimpleNamespace(MPI="mpi")
    m.CommunicationMode = types.SimpleNamespace(LEADER="leader")
    m.DecodingMode = types.SimpleNamespace(Medusa=lambda: "medusa")
    for name in ("KvCacheConfig", "DecodingConfig", "ExecutorConfig", "ParallelConfig", "OutputConfig",
                 "ExtendedRuntimePerfKnobConfig"):
        setattr(m, name, _Rec)
    m.SamplingConfig = lambda beam_width=1, **kw: types.SimpleNamespace(beam_width=beam_width, top_k=kw.get("top_k"),
                                                                        **{k: v for k, v in kw.items() if k != "top_k"})
    m.ExternalDraftTokensConfig = lambda tokens, logits=None, acceptance_threshold=None: types.SimpleNamespace(
        tokens=list(tokens), logits=logits)
    # max_tokens keyword-only, as one executor binding declares it (issue 53): positional use fails here
    m.Request = lambda input_token_ids, *, max_tokens, **kw: types.SimpleNamespace(
        input_token_ids=list(input_token_ids), max_tokens=max_tokens, end_id=kw.pop("end_id", None),
        streaming=kw.pop("streaming", False), external_draft_tokens_config=kw.pop("external_draft_tokens_config", None),
        **kw)
    m.Executor = executor
    return m


def mpi_bindings() -> types.ModuleType:
    """The factory named by SPECBUILD_TEST_TRTLLM_BINDINGS=trtllm_stub:mpi_bindings."""
    return stub_module(MpiStubExecutor)


# ---- engine config.json as trtllm-build would write it, for bundles the stand-in runs ----
def build_flags(argv: list[str]) -> dict[str, str | None]:
    out, i = {}, 1
    while i < len(argv):
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        out[argv[i][2:]] = argv[i + 1] if has_value else None
        i += 2 if has_value else 1
    return out


def write_engine_config(bundle: str, role: str, **build_override) -> dict:
    """engines/<role>/config.json as trtllm-build writes it from the bundle's own build command:
    pretrained_config = the checkpoint's config.json, build_config = the flags."""
    from specbuild.backends.tensorrt_llm import MODE_BITS

    root = os.path.join(bundle, "trtllm")
    meta = json.load(open(os.path.join(root, "trtllm.json")))
    f = build_flags(meta["build_commands"][role])
    pretrained = json.load(open(os.path.join(root, "checkpoints", role, "config.json")))
    mode = f.get("speculative_decoding_mode") or "none"
    # trtllm-build takes Medusa's max_draft_len from the checkpoint, and tensorrt_llm/builder.py adds
    # max_draft_len to max_seq_len for every speculative mode
    draft_len = int(f.get("max_draft_len") or pretrained.get("max_draft_len") or 0) if mode != "none" else 0
    build = {"max_batch_size": int(f["max_batch_size"]), "max_seq_len": int(f["max_seq_len"]) + draft_len,
             "max_input_len": int(f["max_input_len"]), "max_draft_len": draft_len,
             "speculative_decoding_mode": MODE_BITS[mode],
             "gather_generation_logits": "gather_generation_logits" in f,
             "plugin_config": {"use_paged_context_fmha": f.get("use_paged_context_fmha") == "enable"}}
    build.update(build_override)
    cfg = {"version": STUB_VERSION, "pretrained_config": pretrained, "build_config": build}
    engine = os.path.join(root, meta["roles"][role]["engine_dir"])
    os.makedirs(engine, exist_ok=True)
    with open(os.path.join(engine, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return cfg

