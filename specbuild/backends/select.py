"""The request-level backend seam, and `open_engine`, which picks the backend for a bundle.

TensorRT-LLM owns its KV cache, its batching and (for Medusa) its acceptance, so it cannot
sit behind specbuild's `forward(tokens, mask) -> logits`. Front ends (the CLI's `generate`,
the HTTP server, the Triton model) therefore talk to a backend at the request level:

    engine = open_engine("bundle/", EngineConfig(), backend="auto")
    handle = engine.submit(Request(prompt="Hello", sampling=SamplingParams(max_tokens=32)))
    for event in handle: print(event.text, end="")      # Event(token_ids, text, finished, ...)
    handle.result()["stats"]                               # drafted, accepted, ... (one shape)

Two implementations, both subclasses of `engine.base.BaseEngine` (the request queue and
the background loop): `engine.engine.Engine` (specbuild's own scheduler) and
`tensorrt_llm.TrtllmEngine` (TensorRT-LLM's executor). Which guarantee holds where is one
table, `engine.guarantees.guarantees()`, printed by `specbuild inspect` and documented in the
README.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol, runtime_checkable

from specbuild.engine.guarantees import LOSSLESS, REFUSED, guarantee_lines, guarantees  # noqa: F401 (public here)
from specbuild.bundle import read_meta
from specbuild.errors import SpecbuildError
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Handle, Request

log = logging.getLogger("specbuild.backends")
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


def bundle_guarantees(bundle_dir: str) -> dict[str, dict[str, Any]]:
    """backend -> guarantees table, for each backend this bundle can run on (inspect)."""
    meta = read_meta(bundle_dir)
    from specbuild.speculation.proposers import registry

    # every registered drafter whose bundle role (its module's ROLE) this bundle has
    torch_methods = ["none", *[m for m in registry.names() if registry.role(m) in (None, *meta.roles)], "auto"]
    out = {"torch": guarantees("torch", methods=torch_methods)}
    if meta.backend == "tensorrt-llm":
        from specbuild.backends.tensorrt_llm import read_trtllm_meta

        trt = read_trtllm_meta(bundle_dir)
        methods = {"medusa": ["none", "medusa"], "draft_tokens_external": ["none", "ngram"]}.get(trt["mode"], ["none"])
        methods += ["draft"] if trt["mode"] == "draft_tokens_external" and "draft" in trt["roles"] else []
        out["tensorrt-llm"] = guarantees("tensorrt-llm", mode=trt["mode"], methods=methods,
                                         gather_generation_logits=bool(trt.get("gather_generation_logits")))
    return out


# ---- choosing a backend --------------------------------------------------------------------
AUTO_NEEDS_ENGINES = ("--backend auto takes TensorRT-LLM only where the bundle's engines are built "
                      "(docs/tensorrt-llm.md); --backend tensorrt-llm serves the LLM API without them")


def trtllm_path(bundle_dir: str, *, auto: bool = False, attn_backend: str | None = None,
                ngram_impl: str = "trtllm") -> tuple[str | None, str]:
    """("engine" | "llmapi", "") for the TensorRT-LLM path this machine can run the bundle on, or
    (None, why not).

    engine: the bundle's built engines (engines/<role>/config.json) on a release with the engine
    path (tensorrt_llm>=0.19,<1.3; the test stand-in of backends/tensorrt_llm.TEST_STUB_ENV);
    llmapi: its Hugging Face roles (trtllm/hf/) on a release with the LLM API on the PyTorch backend
    (tensorrt_llm>=1.0; stand-in: tensorrt_llm_api.TEST_STUB_ENV). Where both run, built engines win
    (they are what the user built). Both need a CUDA device, except under a stand-in.
    auto (`--backend auto`): only a bundle whose engines are built, as docs/tensorrt-llm.md says.
    The LLM-API path runs the same checks TrtllmApiEngine runs before its LLM starts
    (tensorrt_llm_api.llmapi_problem: the kernel check with `attn_backend`, the method's config with
    `ngram_impl`), so a target the release would refuse is (None, the engine's reason)."""
    meta = read_meta(bundle_dir)
    if meta.backend != "tensorrt-llm":
        return None, f"the bundle was compiled for the {meta.backend} backend (compile with --backend tensorrt-llm)"
    from specbuild.backends.tensorrt_llm import TEST_STUB_ENV, engine_dirs, read_trtllm_meta
    from specbuild.backends.tensorrt_llm_api import TEST_STUB_ENV as API_STUB_ENV, llmapi_problem
    from specbuild.formats.trtllm_support import engine_path_problem, installed_version, llmapi_path_problem

    try:
        dirs = engine_dirs(bundle_dir)
        trt = read_trtllm_meta(bundle_dir)
    except SpecbuildError as e:
        return None, str(e)
    missing = [d for d in dirs.values() if not os.path.isfile(os.path.join(d, "config.json"))]
    built = not missing
    has_hf = bool((trt.get("llmapi") or {}).get("models")) and trt["mode"] != "medusa"
    not_built = (f"engines not built ({missing[0]} has no config.json): run trtllm/build.sh on a GPU machine with "
                 "tensorrt_llm>=0.19,<1.3" if missing else "")

    def api_path() -> tuple[str | None, str]:
        problem = llmapi_problem(bundle_dir, attn_backend=attn_backend, ngram_impl=ngram_impl)
        return (None, problem) if problem else ("llmapi", "")

    if os.environ.get(TEST_STUB_ENV) and built:
        return "engine", ""  # tests: the stand-in executor runs on the CPU
    if auto and not built:
        return None, f"{not_built} ({AUTO_NEEDS_ENGINES})"
    if os.environ.get(API_STUB_ENV) and has_hf:
        return api_path()  # tests: the stand-in LLM API runs on the CPU
    version, why = installed_version()
    if version is None:
        return None, not_built or why
    engine_problem, api_problem = engine_path_problem(version), llmapi_path_problem(version)
    # an EAGLE-3 bundle's engines are plain (the engine path has no EAGLE-3): its head runs on the LLM API
    eagle3_api = has_hf and api_problem is None and "eagle3" in trt["llmapi"]["models"]
    if built and engine_problem is None and not eagle3_api:
        path = "engine"
    elif has_hf and api_problem is None:
        path = "llmapi"
    else:
        reasons = [r for r in (not_built, engine_problem if built else None,
                               api_problem if has_hf else "the bundle has no Hugging Face roles for the LLM-API path "
                               "(trtllm/hf/; Medusa bundles have none: the PyTorch backend has no Medusa)") if r]
        return None, "; ".join(reasons)
    import torch

    if not torch.cuda.is_available():
        return None, "TensorRT-LLM needs a CUDA device and torch sees none"
    return api_path() if path == "llmapi" else (path, "")


def trtllm_status(bundle_dir: str, **options) -> tuple[bool, str]:
    """(True, "") when the bundle can run on TensorRT-LLM here (either path), else (False, why not).
    options: trtllm_path's (auto, attn_backend, ngram_impl)."""
    path, why = trtllm_path(bundle_dir, **options)
    return path is not None, why


def _path_options(trtllm_attn_backend: str | None, trtllm_ngram_impl: str | None) -> dict:
    out: dict[str, Any] = {}
    if trtllm_attn_backend is not None:
        out["attn_backend"] = trtllm_attn_backend
    if trtllm_ngram_impl is not None:
        out["ngram_impl"] = trtllm_ngram_impl
    return out


def resolve_backend(bundle_dir: str, backend: str = "auto", *, trtllm_attn_backend: str | None = None,
                    trtllm_ngram_impl: str | None = None) -> tuple[str, str]:
    """(backend to use, why). "auto" picks tensorrt-llm only when `trtllm_status` says it can
    run (built engines, and the LLM API's own checks where it is the path); an explicit
    "tensorrt-llm" that cannot run raises SpecbuildError with the reason."""
    if backend not in BACKEND_CHOICES:
        raise SpecbuildError(f"--backend {backend!r} is not one of {', '.join(BACKEND_CHOICES)}")
    if backend == "torch":
        return "torch", "asked for"
    options = _path_options(trtllm_attn_backend, trtllm_ngram_impl)
    ok, reason = trtllm_status(bundle_dir, auto=backend == "auto", **options)
    if backend == "tensorrt-llm":
        if not ok:
            raise SpecbuildError(f"--backend tensorrt-llm cannot run bundle {bundle_dir!r}: {reason}")
        return "tensorrt-llm", "asked for"
    return ("tensorrt-llm", "engines built and TensorRT-LLM available") if ok else ("torch", reason)


def open_engine(bundle_dir: str, config: EngineConfig = EngineConfig(), backend: str = "auto", *,
                trtllm_attn_backend: str | None = None, trtllm_ngram_impl: str | None = None, **plugins):
    """The bundle's serving backend: `Engine` (torch) or `trtllm_engine.TrtllmEngine`.
    plugins: `drafters` / `planning` for the torch engine (MineDraft: mpi/minedraft.plugin).
    trtllm_attn_backend / trtllm_ngram_impl: the LLM-API path's attention backend (TRTLLM,
    FLASHINFER; FLASHINFER avoids the speculative XQA kernels) and n-gram drafter (trtllm,
    specbuild); `--backend auto` asks the same checks with them before it chooses.

    `--backend auto` on a bundle compiled for TensorRT-LLM that cannot run it here logs one
    warning line saying why it serves on torch.

    Under `mpirun -n tp*pp` every rank calls this; on the TensorRT-LLM backend only rank 0
    (`engine.is_leader`) takes requests, the others wait in `parallel.follow_leader(engine)`."""
    name, why = resolve_backend(bundle_dir, backend, trtllm_attn_backend=trtllm_attn_backend,
                                trtllm_ngram_impl=trtllm_ngram_impl)
    if name == "torch":
        if backend == "auto" and read_meta(bundle_dir).backend == "tensorrt-llm":
            log.warning("--backend auto: serving on torch, not TensorRT-LLM: %s", why)
        return Engine(bundle_dir, config, **plugins)
    if plugins:
        raise ValueError(f"{', '.join(sorted(plugins))} plug into specbuild's own scheduler: the torch backend "
                         f"only (this bundle opens on {name})")
    options = _path_options(trtllm_attn_backend, trtllm_ngram_impl)
    if trtllm_path(bundle_dir, auto=backend == "auto", **options)[0] == "llmapi":  # >= 1.0 (or >= 1.3)
        from specbuild.backends.tensorrt_llm_api import TrtllmApiEngine

        return TrtllmApiEngine(bundle_dir, config, **options)
    from specbuild.backends.tensorrt_llm import TrtllmEngine

    return TrtllmEngine(bundle_dir, config)


def describe_guarantees(engine) -> dict:
    """Guarantees of any engine object (a plain `Engine` counts as the torch backend)."""
    if hasattr(engine, "describe_guarantees"):
        return engine.describe_guarantees()
    return guarantees("torch", methods=engine.methods)
