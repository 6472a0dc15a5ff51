"""Write a Triton Inference Server model repository that serves a bundle.

    REPO/<name>/config.pbtxt        Python backend, decoupled (responses stream), one instance
    REPO/<name>/1/model.py          specbuild/serve/tritonserver_model.py: loads the bundle, runs the engine loop
    REPO/<name>_plain/config.pbtxt  (unless plain=False) a non-decoupled front model, so that plain
    REPO/<name>_plain/1/model.py    HTTP / gRPC `infer` calls work; it forwards each request to
                                    <name> (BLS) and returns the one final response

Triton 2.51 refuses unary HTTP and gRPC `infer` on decoupled models ("doesn't support models
with decoupled transaction policy"); only the gRPC stream and `generate[_stream]` reach them.
The plain front model shares the one engine, so plain and streamed requests batch together.

Tensor names, types and shapes follow TensorRT-LLM's ensemble (see `INPUTS`, `OUTPUTS`):
max_batch_size > 0 (`RepoConfig.triton_max_batch_size`, default 64 as the ensemble's), so a
client sends [batch, 1] tensors (batch 1: one sequence per request), and the ensemble's
sampling and output inputs are taken (exclude_input_in_output, return_log_probs, beam_width
1, random_seed, min_length, the penalties, ...). A TensorRT-LLM client or genai-perf
(`--service-kind triton --backend tensorrtllm`) needs only the model name changed.
`triton_max_batch_size=0` writes the older layout ([1] tensors, no batch dimension).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field

from specbuild.speculation.proposers.registry import accepts_flat_settings

# name -> (Triton data type, dims, optional)
INPUTS: dict[str, tuple[str, tuple[int, ...], bool]] = {
    "text_input": ("TYPE_STRING", (1,), False),
    "max_tokens": ("TYPE_INT32", (1,), False),
    "stream": ("TYPE_BOOL", (1,), True),
    "temperature": ("TYPE_FP32", (1,), True),
    "top_k": ("TYPE_INT32", (1,), True),
    "top_p": ("TYPE_FP32", (1,), True),
    "stop_words": ("TYPE_STRING", (-1,), True),
    "end_id": ("TYPE_INT32", (1,), True),
    "seed": ("TYPE_UINT64", (1,), True),
    "speculation": ("TYPE_STRING", (1,), True),
    "gamma": ("TYPE_INT32", (1,), True),
    "response_format": ("TYPE_STRING", (1,), True),  # structured output: OpenAI's response_format as JSON text
    "content_type": ("TYPE_STRING", (1,), True),
    "return_perf_metrics": ("TYPE_BOOL", (1,), True),
    # tool calling (tritonserver_model.build): OpenAI's tools as JSON text; text_input is then the user's turn
    "tools": ("TYPE_STRING", (1,), True),
    "tool_choice": ("TYPE_STRING", (1,), True),
    "parallel_tool_calls": ("TYPE_BOOL", (1,), True),
    # TensorRT-LLM's ensemble inputs (tritonserver_model.parse_inputs: served, or refused unless neutral)
    "exclude_input_in_output": ("TYPE_BOOL", (1,), True),
    "return_log_probs": ("TYPE_BOOL", (1,), True),
    "return_context_logits": ("TYPE_BOOL", (1,), True),
    "return_generation_logits": ("TYPE_BOOL", (1,), True),
    "beam_width": ("TYPE_INT32", (1,), True),
    "num_return_sequences": ("TYPE_INT32", (1,), True),
    "random_seed": ("TYPE_UINT64", (1,), True),
    "min_length": ("TYPE_INT32", (1,), True),
    "presence_penalty": ("TYPE_FP32", (1,), True),
    "frequency_penalty": ("TYPE_FP32", (1,), True),
    "repetition_penalty": ("TYPE_FP32", (1,), True),
    "length_penalty": ("TYPE_FP32", (1,), True),
    "pad_id": ("TYPE_INT32", (1,), True),
    "bad_words": ("TYPE_STRING", (-1,), True),
    "embedding_bias_words": ("TYPE_STRING", (-1,), True),
    "embedding_bias_weights": ("TYPE_FP32", (-1,), True),
}
# the last three are sent only when return_perf_metrics is true
OUTPUTS: dict[str, tuple[str, tuple[int, ...]]] = {
    "text_output": ("TYPE_STRING", (1,)),
    "acceptance_rate": ("TYPE_FP32", (1,)),
    "total_accepted_draft_tokens": ("TYPE_INT32", (1,)),
    "total_draft_tokens": ("TYPE_INT32", (1,)),
    # with return_perf_metrics: prefix cache reuse (the output names of tensorrtllm_backend)
    "kv_cache_reused_blocks": ("TYPE_INT32", (1,)),
    "kv_cache_alloc_new_blocks": ("TYPE_INT32", (1,)),
    "kv_cache_alloc_total_blocks": ("TYPE_INT32", (1,)),
    # with return_log_probs (beam 1): the sum, and one per generated token
    "cum_log_probs": ("TYPE_FP32", (-1,)),
    "output_log_probs": ("TYPE_FP32", (-1, -1)),
    # with tools: the calls, OpenAI's message.tool_calls as JSON text ("[]": none)
    "tool_calls": ("TYPE_STRING", (1,)),
}
MODEL_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tritonserver_model.py")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
PLAIN_SUFFIX = "_plain"
DEFAULT_FACTORY = "specbuild.backends.select:open_engine"
BACKEND_CHOICES = ("auto", "torch", "tensorrt-llm")  # runtime.backend's (not imported: it loads torch)


@accepts_flat_settings(defaults=False)
@dataclass(frozen=True)
class RepoConfig:
    """What the repository's config.pbtxt files record.

    python_env: a directory with bin/activate whose Python the backend stub runs
    (EXECUTION_ENV_PATH); scripts/get_tritonserver.py makes one (numpy<2 first, then this
    project's site-packages). None: the stub's own default Python.
    engine_factory: "module:callable" building the engine from (bundle_dir, EngineConfig);
    by default `backend.open_engine`, which also takes `backend`.
    backend: auto | torch | tensorrt-llm, as `specbuild generate --backend` (auto: TensorRT-LLM
    where the bundle's engines are built and it runs there, else torch); written as the
    `backend` parameter and passed to the default factory only (another factory picks its own).
    """

    model_name: str = "specbuild"
    max_queue: int = 64
    python_env: str | None = None
    threads: int | None = None
    max_batch_size: int | None = None
    device: str = "cpu"
    kv_cache_tokens: int | None = None
    compile: bool = False  # the engine model runs the layer stack compiled (EngineConfig.compile)
    plain: bool = True
    plain_instances: int = 2
    engine_factory: str = DEFAULT_FACTORY
    backend: str = "auto"
    # the LLM-API path's attention backend and n-gram drafter (open_engine's keywords of the same names)
    trtllm_attn_backend: str | None = None
    trtllm_ngram_impl: str | None = None
    telemetry: str | None = None  # telemetry store (SQLite path or postgresql:// DSN) for the engine model
    triton_max_batch_size: int = 64  # > 0: [batch, 1] tensors as TensorRT-LLM's ensemble; 0: [1] tensors
    prefix_cache: bool = True  # EngineConfig.prefix_cache (`--no-prefix-cache`): parameter prefix_cache "0" when off
    # the drafters' settings given (drafter name -> {field: value}; proposers/registry.py), each
    # written as the model parameter `<name>_<field>` (a flag as "1" when set, a file path
    # absolute) and read back into EngineConfig.drafters by the model (tritonserver_model.py);
    # also given flat as RepoConfig(suffix_store_tokens=...). The files they name are checked here
    drafters: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.model_name):
            raise ValueError(f"model name {self.model_name!r} must match {NAME_RE.pattern}")
        if not 1 <= self.max_queue <= 1 << 20:
            raise ValueError(f"max_queue={self.max_queue} is out of range [1, {1 << 20}]")
        if not 0 <= self.triton_max_batch_size <= 4096:
            raise ValueError(f"triton_max_batch_size={self.triton_max_batch_size} is out of range [0, 4096]")
        if not 1 <= self.plain_instances <= 64:
            raise ValueError(f"plain_instances={self.plain_instances} is out of range [1, 64]")
        if self.threads is not None and not 1 <= self.threads <= 1024:
            raise ValueError(f"threads={self.threads} is out of range [1, 1024]")
        if self.max_batch_size is not None and not 1 <= self.max_batch_size <= 4096:
            raise ValueError(f"max_batch_size={self.max_batch_size} is out of range [1, 4096]")
        if ":" not in self.engine_factory:
            raise ValueError(f"engine_factory={self.engine_factory!r} must be 'module:callable'")
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend={self.backend!r} is not one of {', '.join(BACKEND_CHOICES)}")
        if self.trtllm_attn_backend not in (None, "TRTLLM", "FLASHINFER", "VANILLA"):
            raise ValueError(f"trtllm_attn_backend={self.trtllm_attn_backend!r} is not one of TRTLLM, FLASHINFER, "
                             "VANILLA")
        if self.trtllm_ngram_impl not in (None, "trtllm", "specbuild"):
            raise ValueError(f"trtllm_ngram_impl={self.trtllm_ngram_impl!r} is not one of trtllm, specbuild")
        trtllm_set = [k for k in ("trtllm_attn_backend", "trtllm_ngram_impl") if getattr(self, k) is not None]
        if trtllm_set and self.engine_factory != DEFAULT_FACTORY:
            raise ValueError(f"{', '.join(trtllm_set)} apply to the default engine factory ({DEFAULT_FACTORY}); "
                             f"engine_factory={self.engine_factory!r} picks its own backend")
        if self.backend != "auto" and self.engine_factory != DEFAULT_FACTORY:
            raise ValueError(f"backend={self.backend!r} applies to the default engine factory ({DEFAULT_FACTORY}); "
                             f"engine_factory={self.engine_factory!r} picks its own backend")
        if self.drafters:
            from specbuild.speculation.proposers.registry import make_options

            given = {name: {k: v for k, v in values.items() if v is not None} for name, values in self.drafters.items()}
            object.__setattr__(self, "drafters", given)
            for opts in make_options(given, what="RepoConfig").values():  # their own checks, and their files
                opts.check_files()
        if self.python_env is not None and not os.path.isfile(os.path.join(self.python_env, "bin", "activate")):
            raise ValueError(f"python_env={self.python_env!r} has no bin/activate (make one with "
                             "scripts/get_tritonserver.py)")


def pbtxt_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def tensor_block(kind: str, specs: dict[str, tuple]) -> str:
    rows = []
    for name, spec in specs.items():
        dtype, dims = spec[0], spec[1]
        optional = " optional: true" if len(spec) > 2 and spec[2] else ""
        rows.append(f'  {{ name: "{name}" data_type: {dtype} dims: [ {", ".join(map(str, dims))} ]{optional} }}')
    return f"{kind} [\n" + ",\n".join(rows) + "\n]\n"


def config_pbtxt(name: str, decoupled: bool, instances: int, parameters: dict[str, str],
                 max_batch_size: int = 64) -> str:
    """One model's config.pbtxt: Python backend; max_batch_size > 0 puts a batch dimension
    before every listed shape (TensorRT-LLM's layout), 0 takes the shapes exactly as listed."""
    out = [f"name: {pbtxt_string(name)}\n", 'backend: "python"\n', f"max_batch_size: {max_batch_size}\n",
           f"model_transaction_policy {{ decoupled: {'true' if decoupled else 'false'} }}\n",
           tensor_block("input", INPUTS), tensor_block("output", OUTPUTS),
           f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"]
    for key, value in parameters.items():
        out.append(f"parameters {{ key: {pbtxt_string(key)} value: {{ string_value: {pbtxt_string(value)} }} }}\n")
    return "".join(out)


def project_path() -> str:
    """The directory holding the specbuild package (so the stub can import it if not installed)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_model(repo: str, name: str, config_text: str) -> str:
    model_dir = os.path.join(repo, name)
    os.makedirs(os.path.join(model_dir, "1"), exist_ok=True)
    with open(os.path.join(model_dir, "config.pbtxt"), "w") as f:
        f.write(config_text)
    shutil.copyfile(MODEL_SOURCE, os.path.join(model_dir, "1", "model.py"))
    return model_dir


def write_repository(bundle_dir: str, out: str, config: RepoConfig = RepoConfig()) -> list[str]:
    """Write (or overwrite) the model directories; returns the model names written.

    The bundle is checked (its bundle.json read) here, so a wrong path fails now and not
    at server start-up."""
    from specbuild.bundle import read_meta

    bundle_dir = os.path.abspath(bundle_dir)
    meta = read_meta(bundle_dir)  # raises BundleError naming what is wrong
    if config.max_batch_size is not None and config.max_batch_size > meta.limits.max_batch_size:
        raise ValueError(f"max_batch_size={config.max_batch_size} exceeds the bundle's limit "
                         f"{meta.limits.max_batch_size}")
    common: dict[str, str] = {"python_path": project_path()}
    if config.python_env:
        common["EXECUTION_ENV_PATH"] = os.path.abspath(config.python_env)
    engine_params = {"role": "engine", "bundle": bundle_dir, "max_queue": str(config.max_queue),
                     "device": config.device, "engine_factory": config.engine_factory, **common}
    if config.engine_factory == DEFAULT_FACTORY:
        engine_params["backend"] = config.backend
        for key in ("trtllm_attn_backend", "trtllm_ngram_impl"):
            if getattr(config, key) is not None:
                engine_params[key] = getattr(config, key)
    if config.telemetry:
        is_dsn = config.telemetry.startswith(("postgresql://", "postgres://"))
        engine_params["telemetry"] = config.telemetry if is_dsn else os.path.abspath(config.telemetry)
    for key in ("threads", "max_batch_size", "kv_cache_tokens"):
        if getattr(config, key) is not None:
            engine_params[key] = str(getattr(config, key))
    if config.compile:
        engine_params["compile"] = "1"
    if not config.prefix_cache:
        engine_params["prefix_cache"] = "0"
    engine_params.update(drafter_parameters(config.drafters))
    os.makedirs(out, exist_ok=True)
    names = [config.model_name]
    batch = config.triton_max_batch_size
    write_model(out, config.model_name, config_pbtxt(config.model_name, True, 1, engine_params, batch))
    plain_name = config.model_name + PLAIN_SUFFIX
    if config.plain:
        write_model(out, plain_name, config_pbtxt(plain_name, False, config.plain_instances,
                                                  {"role": "plain", "target_model": config.model_name, **common},
                                                  batch))
        names.append(plain_name)
    else:
        remove_stale_plain(os.path.join(out, plain_name))
    return names


def drafter_parameters(drafters: dict) -> dict[str, str]:
    """The model parameters `<name>_<field>` of the drafters' settings given (RepoConfig.drafters):
    a flag "1" when set or "0" when unset, each only where it differs from the field's default
    (--no-suffix-answers writes suffix_answers "0"), a path (Options field metadata "path")
    absolute."""
    from specbuild.speculation.proposers.registry import settings

    out = {}
    for key, (name, f) in settings().items():
        value = drafters.get(name, {}).get(f.name)
        if value is None:
            continue
        if isinstance(value, bool):
            if value == (f.default is True):  # the field's default (a flag's is False): nothing to write
                continue
            value = "1" if value else "0"
        elif f.metadata.get("path"):
            value = os.path.abspath(value)
        out[key] = str(value)
    return out


def remove_stale_plain(model_dir: str) -> None:
    """Remove a front model this writer made earlier (it would forward to nothing)."""
    path = os.path.join(model_dir, "config.pbtxt")
    if os.path.isfile(path):
        with open(path) as f:
            ours = 'key: "role" value: { string_value: "plain" }' in f.read()
        if ours:
            shutil.rmtree(model_dir)
