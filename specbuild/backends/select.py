"""The request-level backend seam, and `open_engine`, which picks the backend for a bundle.

TensorRT-LLM owns its KV cache, its batching and (for Medusa) its acceptance, so it cannot
sit behind specbuild's `forward(tokens, mask) -> logits`. Front ends (the CLI's `generate`,
the HTTP server, the Triton model) therefore talk to a backend at the request level:

    engine = open_engine("bundle/", EngineConfig(), backend="auto")
    handle = engine.submit(Request(prompt="Hello", sampling=SamplingParams(max_tokens=32)))
    for event in handle: print(event.text, end="")      # Event(token_ids, text, finished, ...)
    handle.result()["stats"]                               # drafted, accepted, ... (one shape)

Two implementations: `TorchEngine` (specbuild's own scheduler: the existing `Engine`,
unchanged, plus `describe_guarantees`) and `trtllm_engine.TrtllmEngine` (TensorRT-LLM's
executor). Which guarantee holds where is one table, `guarantees()`, printed by
`specbuild inspect` and documented in the README.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

from specbuild.bundle import read_meta
from specbuild.errors import SpecbuildError
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Handle, Request

BACKEND_CHOICES = ("auto", "torch", "tensorrt-llm")
STATS_KEYS = ("seed", "prompt_tokens", "generated_tokens", "target_passes", "ttft_ms", "tpot_ms", "tokens_per_s",
              "drafted", "accepted", "mean_accepted_tokens", "acceptance_by_position", "gamma")


@runtime_checkable
class Backend(Protocol):
    """What every front end may rely on. Handles and events are `sequence.Handle`/`Event`;
    `handle.result()["stats"]` has at least `STATS_KEYS`. Bad input raises RequestError
    at `submit` (nothing queued). Front ends use nothing else (no scheduler, cache or model)."""

    backend_name: str
    bundle_dir: str
    load_seconds: float
    target_config: Any  # the target's ModelConfig (vocab_size, ...)
    tokenizer: Any  # tokenizers.Tokenizer
    default_sampling: Any  # SamplingParams
    default_speculation: Any  # SpeculationConfig
    max_seq_len: int
    max_batch_size: int
    background: bool  # True while start()ed: handles wait on their queues instead of stepping

    @property
    def methods(self) -> list[str]: ...

    def submit(self, request: Request) -> Handle: ...

    def abort(self, handle: Handle) -> None: ...

    def step(self) -> int: ...

    def has_work(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...

    def describe_guarantees(self) -> dict: ...

    def stats(self) -> dict:
        """Load figures (health, metrics): queue_depth, running, kv_blocks_used, kv_blocks_total,
        gamma; None where the backend does not know (TensorRT-LLM's KV cache is its own)."""
        ...

    def close(self) -> None: ...


# ---- the guarantees table ------------------------------------------------------------------
LOSSLESS = "lossless"
REFUSED = "refused"

_TORCH_ROWS = {
    "none": (LOSSLESS, LOSSLESS, "plain decoding"),
    "ngram": (LOSSLESS, LOSSLESS, "specbuild verify: argmax match (greedy), chain rejection sampling with "
                                  "one-hot drafts (sampled)"),
    "draft": (LOSSLESS, LOSSLESS, "specbuild verify: argmax match (greedy), chain rejection sampling with the "
                                  "draft's probabilities (sampled)"),
    "medusa": (LOSSLESS, LOSSLESS, "specbuild verify: tree argmax walk (greedy), recursive rejection sampling "
                                   "over siblings (sampled); --typical is LOSSY and opt-in"),
    "recycle": (LOSSLESS, LOSSLESS, "specbuild verify: tree argmax walk (greedy), recursive rejection sampling "
                                    "over siblings with deterministic candidates from the target's own earlier "
                                    "top-k (sampled)"),
    "eagle": (LOSSLESS, LOSSLESS, "specbuild verify: tree argmax walk (greedy), recursive rejection sampling over "
                                  "siblings with the head's deterministic top-k candidates (sampled)"),
    "auto": (LOSSLESS, LOSSLESS, "as the method it picks per sequence"),
}


def guarantees(backend: str, *, mode: str = "none", gather_generation_logits: bool = False,
               methods: list[str] | None = None) -> dict[str, Any]:
    """Which output guarantee holds for each speculation method on a backend.

    Returns {"backend", "methods": {method: {"greedy", "sampled", "acceptance"}}, "notes"}.
    "lossless": the output is the target's (greedy: token for token; sampled: in
    distribution); "refused": such a request is rejected with an error saying why (a request
    that did not name the method is served without drafts instead, which is lossless).
    For tensorrt-llm, `mode` is the engines' (none | draft_tokens_external | medusa) and
    `gather_generation_logits` whether both engines were built with --gather_generation_logits.
    """
    if backend == "torch":
        rows = {m: r for m, r in _TORCH_ROWS.items() if methods is None or m in methods}
        notes = ["every method runs through specbuild's own verifier (tested by chi-square against the "
                 "exact joint distribution: `specbuild verify`)",
                 "the draft length is chosen per sequence within [gamma_min, gamma_max]"]
    elif backend == "tensorrt-llm":
        rows = {"none": (LOSSLESS, LOSSLESS, "TensorRT-LLM's own sampler (seeded, but not the same random "
                                             "stream as the torch backend)")}
        if mode == "draft_tokens_external":
            sampled_draft = (LOSSLESS if gather_generation_logits else REFUSED)
            rows["ngram"] = (LOSSLESS, REFUSED, "TensorRT-LLM external draft tokens: accepted while equal to "
                                                "the target's argmax; prompt-lookup drafts carry no logits, "
                                                "so sampled requests are not speculated")
            rows["draft"] = (LOSSLESS, sampled_draft,
                             "TensorRT-LLM external draft tokens; sampled acceptance compares draft and target "
                             "logits, which needs both engines built with --gather_generation_logits"
                             + ("" if gather_generation_logits else " (these were not)"))
        elif mode == "medusa":
            rows["medusa"] = (LOSSLESS, REFUSED, "TensorRT-LLM's Medusa: greedy-only in its TensorRT path "
                                                 "(drafts accepted while equal to the target's argmax); "
                                                 "no typical acceptance")
            rows["none"] = (LOSSLESS, REFUSED, "served by the Medusa engine: every request uses the heads "
                                               "(TensorRT-LLM has no per-request off), greedy-only")
        if methods is not None:
            rows = {m: r for m, r in rows.items() if m in methods}
        notes = ["TensorRT-LLM owns the KV cache, the batching and the acceptance; specbuild streams the "
                 "tokens and counts acceptance per engine iteration",
                 "sampled acceptance needs generation logits (--gather_generation_logits on both engines: "
                 "specbuild compile --trtllm-gather-generation-logits)",
                 "the draft length is fixed at the request's gamma (no per-sequence controller); "
                 "method 'auto' is torch-only",
                 "lossless on this backend rests on TensorRT-LLM's acceptance kernels; specbuild checks "
                 "greedy equality with the torch backend (scripts/gpu_trtllm_e2e.sh)"]
    else:
        raise ValueError(f"backend {backend!r} is not one of torch, tensorrt-llm")
    return {"backend": backend,
            "methods": {m: {"greedy": g, "sampled": s, "acceptance": how} for m, (g, s, how) in rows.items()},
            "notes": notes}


def bundle_guarantees(bundle_dir: str) -> dict[str, dict[str, Any]]:
    """backend -> guarantees table, for each backend this bundle can run on (inspect)."""
    meta = read_meta(bundle_dir)
    torch_methods = ["none", "ngram", *[m for m in ("draft", "medusa") if m in meta.roles], "auto"]
    out = {"torch": guarantees("torch", methods=torch_methods)}
    if meta.backend == "tensorrt-llm":
        from specbuild.backends.tensorrt_llm import read_trtllm_meta

        trt = read_trtllm_meta(bundle_dir)
        methods = {"medusa": ["none", "medusa"], "draft_tokens_external": ["none", "ngram"]}.get(trt["mode"], ["none"])
        methods += ["draft"] if trt["mode"] == "draft_tokens_external" and "draft" in trt["roles"] else []
        out["tensorrt-llm"] = guarantees("tensorrt-llm", mode=trt["mode"], methods=methods,
                                         gather_generation_logits=bool(trt.get("gather_generation_logits")))
    return out


def guarantee_lines(table: dict[str, Any]) -> list[str]:
    """The table as aligned text lines (inspect, README)."""
    lines = [f"guarantees on the {table['backend']} backend:"]
    for method, row in table["methods"].items():
        lines.append(f"  {method:7s} greedy {row['greedy']:9s} sampled {row['sampled']:9s} {row['acceptance']}")
    lines += [f"  note: {n}" for n in table["notes"]]
    return lines


# ---- the torch backend ---------------------------------------------------------------------
class TorchEngine(Engine):
    """The torch `Engine`, unchanged, named as a backend and able to describe its guarantees."""

    backend_name = "torch"

    def describe_guarantees(self) -> dict:
        return guarantees("torch", methods=self.methods)

    def close(self) -> None:
        self.stop()


# ---- choosing a backend --------------------------------------------------------------------
def trtllm_status(bundle_dir: str) -> tuple[bool, str]:
    """(True, "") when the bundle can run on TensorRT-LLM here, else (False, why not).

    Needs: the bundle compiled with --backend tensorrt-llm, its engines built (each role's
    engines/<role>/config.json), `import tensorrt_llm` working and a CUDA device."""
    meta = read_meta(bundle_dir)
    if meta.backend != "tensorrt-llm":
        return False, f"the bundle was compiled for the {meta.backend} backend (compile with --backend tensorrt-llm)"
    from specbuild.backends.tensorrt_llm import engine_dirs

    try:
        dirs = engine_dirs(bundle_dir)
    except SpecbuildError as e:
        return False, str(e)
    missing = [d for d in dirs.values() if not os.path.isfile(os.path.join(d, "config.json"))]
    if missing:
        return False, f"engines not built ({missing[0]} has no config.json): run trtllm/build.sh on a GPU machine"
    from specbuild.backends.tensorrt_llm import tensorrt_llm_importable

    ok, reason = tensorrt_llm_importable()
    if not ok:
        return False, reason
    from specbuild.backends.tensorrt_llm import TEST_STUB_ENV

    if os.environ.get(TEST_STUB_ENV):
        return True, ""  # tests: the stand-in executor runs on the CPU
    import torch

    if not torch.cuda.is_available():
        return False, "TensorRT-LLM needs a CUDA device and torch sees none"
    return True, ""


def resolve_backend(bundle_dir: str, backend: str = "auto") -> tuple[str, str]:
    """(backend to use, why). "auto" picks tensorrt-llm only when `trtllm_status` says it can
    run; an explicit "tensorrt-llm" that cannot run raises SpecbuildError with the reason."""
    if backend not in BACKEND_CHOICES:
        raise SpecbuildError(f"--backend {backend!r} is not one of {', '.join(BACKEND_CHOICES)}")
    if backend == "torch":
        return "torch", "asked for"
    ok, reason = trtllm_status(bundle_dir)
    if backend == "tensorrt-llm":
        if not ok:
            raise SpecbuildError(f"--backend tensorrt-llm cannot run bundle {bundle_dir!r}: {reason}")
        return "tensorrt-llm", "asked for"
    return ("tensorrt-llm", "engines built and TensorRT-LLM available") if ok else ("torch", reason)


def open_engine(bundle_dir: str, config: EngineConfig = EngineConfig(), backend: str = "auto"):
    """The bundle's serving backend: `TorchEngine` or `trtllm_engine.TrtllmEngine`.

    Under `mpirun -n tp*pp` every rank calls this; on the TensorRT-LLM backend only rank 0
    (`engine.is_leader`) takes requests, the others wait in `parallel.follow_leader(engine)`."""
    name, _ = resolve_backend(bundle_dir, backend)
    if name == "torch":
        return TorchEngine(bundle_dir, config)
    from specbuild.backends.tensorrt_llm import TrtllmEngine

    return TrtllmEngine(bundle_dir, config)


def describe_guarantees(engine) -> dict:
    """Guarantees of any engine object (a plain `Engine` counts as the torch backend)."""
    if hasattr(engine, "describe_guarantees"):
        return engine.describe_guarantees()
    return guarantees("torch", methods=engine.methods)
