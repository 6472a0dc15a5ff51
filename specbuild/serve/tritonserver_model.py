"""specbuild's Triton Python-backend model (copied to REPO/<name>/1/model.py by `specbuild triton-repo`).

One file, two roles, chosen by the config parameter `role`:

engine  (decoupled) loads the bundle once per instance (through `engine_factory`, by default
        `specbuild.backends.select:open_engine` with the `backend` parameter: auto, torch or
        tensorrt-llm, as `specbuild generate --backend`) and runs the engine's step loop on a
        background thread. `execute()` only parses and enqueues each request and returns;
        a forwarding thread per request relays the engine's events to that request's
        response sender (one response per text increment when `stream` is true, else one
        response), the last one with TRITONSERVER_RESPONSE_COMPLETE_FINAL. Concurrent
        requests therefore share the engine's batched verification passes.
plain   (not decoupled) a light front for unary HTTP / gRPC `infer`, which Triton refuses on
        decoupled models: it forwards each request to the engine model (BLS) with stream
        false and returns its single response. It never imports torch or specbuild.

Inputs and outputs (names as TensorRT-LLM's ensemble; see specbuild/serve/tritonserver_repo.py):
text_input, max_tokens, stream, temperature, top_k, top_p, stop_words, end_id, seed,
speculation, gamma, content_type, return_perf_metrics -> text_output (generated text only) and, with
return_perf_metrics, acceptance_rate (accepted / drafted, 0 when nothing was drafted),
total_accepted_draft_tokens, total_draft_tokens, and the prefix cache's kv_cache_reused_blocks,
kv_cache_alloc_new_blocks, kv_cache_alloc_total_blocks. A bad value gets a Triton error response
for that request only (wrong types and shapes are refused by Triton before it gets here).

TensorRT-LLM's ensemble inputs are taken as its clients send them ([batch, 1] tensors when
the config's max_batch_size > 0; batch 1): exclude_input_in_output (false: the prompt before
the generated text in a non-streamed answer, as the ensemble; absent: generated text only),
return_log_probs (-> cum_log_probs, output_log_probs: the sampling distribution's, as the HTTP
server's logprobs), random_seed (= seed), min_length (= min_tokens), presence_penalty,
frequency_penalty, repetition_penalty (over the prompt's and the output's tokens, as
TensorRT-LLM's and vLLM's), pad_id (nothing is padded here); beam_width, num_return_sequences,
length_penalty, return_context_logits, return_generation_logits,
bad_words and embedding_bias_* only at their neutral values (else an INVALID_ARG error
naming the input and the value served).

Tool calling: `tools` (OpenAI's tools, JSON text), `tool_choice` (auto, required, none, a
function's name or OpenAI's object as JSON) and `parallel_tool_calls` make text_input the
user's turn of a chat, rendered, constrained and parsed as the HTTP chat endpoint does
(serve/tools.py); text_output is then the content outside the calls and the final response
has `tool_calls` (OpenAI's message.tool_calls as JSON text, "[]" for none).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:  # present inside the Triton stub only; the parsing below is importable anywhere
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - outside Triton
    pb_utils = None

log = logging.getLogger("specbuild.serve.tritonserver")
PERF_OUTPUTS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
                "kv_cache_reused_blocks", "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks")
LOGPROB_OUTPUTS = ("cum_log_probs", "output_log_probs")
ALL_OUTPUTS = ("text_output",) + PERF_OUTPUTS + LOGPROB_OUTPUTS + ("tool_calls",)
# TensorRT-LLM ensemble inputs served only at these values: name -> (neutral, numpy kinds)
NEUTRAL_INPUTS = {"beam_width": (1, "iu"), "num_return_sequences": (1, "iu"),
                  "length_penalty": (1.0, "f"), "return_context_logits": (False, "b"),
                  "return_generation_logits": (False, "b")}
POLL_S = 0.1
# error code -> message prefix: a BLS caller (the plain model) sees every error as INTERNAL,
# so the code travels in the message too
ERROR_TAGS = {"INVALID_ARG": "invalid request: ", "UNAVAILABLE": "unavailable: ", "CANCELLED": "cancelled: "}  # how often a waiting forwarder checks for cancellation and shutdown


class InputError(ValueError):
    """A request's input has a wrong shape or value; its message names the input."""


class Unavailable(RuntimeError):
    """The model cannot take the request now (queue full, shutting down)."""


MAX_FORMAT_CHARS = 64 * 1024  # as the HTTP server's limit (sampling.constraint bounds the schema itself)
MAX_TOOLS_CHARS = 1 << 20  # the tools input, as JSON text (each tool is then bounded as the HTTP server's)


@dataclass(frozen=True)
class Parsed:
    """A request's inputs as plain Python values (None: not given, the bundle's default)."""

    prompt: str
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields
    speculation: dict[str, Any] = field(default_factory=dict)  # SpeculationConfig fields
    end_id: int | None = None
    stream: bool = False
    perf: bool = False
    response_format: dict[str, Any] | None = None  # structured output (sampling.constraint.ResponseFormat)
    content_type: str | None = None  # the gamma policy's content type (None: classified from the prompt)
    exclude_input: bool | None = None  # exclude_input_in_output (None: not given: generated text only)
    logprobs: bool = False  # return_log_probs
    tools: list | None = None  # OpenAI's tools (text_input is then the user's turn of a chat)
    tool_choice: Any = None  # "auto" | "required" | "none" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None


def scalar(tensors: dict[str, np.ndarray], name: str, kinds: str) -> Any:
    """The single element of input `name` (None when absent), checked against numpy kinds."""
    arr = tensors.get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.size != 1:
        hint = " (one sequence per request: batch size 1)" if arr.ndim == 2 and arr.shape[0] > 1 else ""
        raise InputError(f"input {name} must hold exactly one element, got shape {list(arr.shape)}{hint}")
    if arr.dtype.kind not in kinds:
        raise InputError(f"input {name} has numpy dtype {arr.dtype}, expected kind {kinds!r}")
    return arr.reshape(-1)[0]


def text_of(value: Any, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"input {name} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    return str(value)


def parse_inputs(tensors: dict[str, np.ndarray]) -> Parsed:
    """Triton input tensors (name -> array) -> Parsed. Raises InputError naming the input.

    TensorRT-LLM conventions kept: empty stop words are ignored (clients send [""] for
    none) and top_p 0 means "no top-p filter"."""
    text = scalar(tensors, "text_input", "OSU")
    if text is None:
        raise InputError("input text_input is required")
    max_tokens = scalar(tensors, "max_tokens", "iu")
    if max_tokens is None:
        raise InputError("input max_tokens is required")
    sampling: dict[str, Any] = {"max_tokens": int(max_tokens)}
    for name, kinds, cast in (("temperature", "f", float), ("top_k", "iu", int), ("top_p", "f", float),
                              ("seed", "iu", int), ("presence_penalty", "f", float), ("frequency_penalty", "f", float),
                              ("min_length", "iu", int), ("repetition_penalty", "f", float)):
        value = scalar(tensors, name, kinds)
        if value is not None:
            sampling["min_tokens" if name == "min_length" else name] = cast(value)
    random_seed = scalar(tensors, "random_seed", "iu")
    if random_seed is not None:
        if sampling.get("seed", int(random_seed)) != int(random_seed):
            raise InputError(f"inputs seed={sampling['seed']} and random_seed={int(random_seed)} disagree")
        sampling["seed"] = int(random_seed)
    for name, (neutral, kinds) in NEUTRAL_INPUTS.items():
        value = scalar(tensors, name, kinds)
        if value is not None and value != neutral:
            raise InputError(f"input {name}={value!r} is not supported (only {neutral!r})")
    for name in ("bad_words", "embedding_bias_words", "embedding_bias_weights"):
        arr = tensors.get(name)
        if arr is not None and any(v not in (b"", "", 0.0) for v in np.asarray(arr).reshape(-1)):
            raise InputError(f"input {name} is not supported (only empty)")
    if sampling.get("top_p") == 0.0:
        sampling["top_p"] = 1.0
    stop_words = tensors.get("stop_words")
    if stop_words is not None:
        stop_words = np.asarray(stop_words)
        if stop_words.dtype.kind not in "OSU":
            raise InputError(f"input stop_words has numpy dtype {stop_words.dtype}, expected strings")
        stops = tuple(s for s in (text_of(v, "stop_words") for v in stop_words.reshape(-1)) if s)
        if stops:
            sampling["stop"] = stops
    speculation: dict[str, Any] = {}
    method = scalar(tensors, "speculation", "OSU")
    if method is not None:
        method = text_of(method, "speculation").strip()
        if method:
            speculation["method"] = method
    gamma = scalar(tensors, "gamma", "iu")
    if gamma is not None:
        speculation["gamma"] = int(gamma)
    content_type = scalar(tensors, "content_type", "OSU")
    content_type = text_of(content_type, "content_type").strip() or None if content_type is not None else None
    end_id = scalar(tensors, "end_id", "iu")
    stream = scalar(tensors, "stream", "b")
    perf = scalar(tensors, "return_perf_metrics", "b")
    exclude = scalar(tensors, "exclude_input_in_output", "b")
    logprobs = scalar(tensors, "return_log_probs", "b")
    response_format = None
    fmt = scalar(tensors, "response_format", "OSU")
    if fmt is not None:
        fmt = text_of(fmt, "response_format")
        if len(fmt) > MAX_FORMAT_CHARS:
            raise InputError(f"input response_format is {len(fmt)} characters; at most {MAX_FORMAT_CHARS}")
        if fmt.strip():
            try:
                response_format = json.loads(fmt)
            except ValueError as e:
                raise InputError(f"input response_format is not JSON: {e}") from None
            if not isinstance(response_format, dict):
                raise InputError("input response_format must be a JSON object, e.g. {\"type\": \"json_object\"}")
    tools, tool_choice = json_input(tensors, "tools", MAX_TOOLS_CHARS, list), None
    choice = scalar(tensors, "tool_choice", "OSU")
    if choice is not None:
        choice = text_of(choice, "tool_choice").strip()
        if choice.startswith("{"):
            tool_choice = json_input({"tool_choice": choice}, "tool_choice", MAX_FORMAT_CHARS, dict)
        elif choice in ("auto", "required", "none"):
            tool_choice = choice
        elif choice:  # a function's name
            tool_choice = {"type": "function", "function": {"name": choice}}
    if tool_choice is not None and tools is None:
        raise InputError("input tool_choice needs the tools input")
    parallel = scalar(tensors, "parallel_tool_calls", "b")
    return Parsed(prompt=text_of(text, "text_input"), sampling=sampling, speculation=speculation,
                  end_id=None if end_id is None else int(end_id), stream=bool(stream), perf=bool(perf),
                  response_format=response_format, content_type=content_type,
                  exclude_input=None if exclude is None else bool(exclude), logprobs=bool(logprobs),
                  tools=tools, tool_choice=tool_choice, parallel_tool_calls=None if parallel is None else bool(parallel))


def json_input(tensors: dict[str, np.ndarray], name: str, limit: int, kind: type) -> Any:
    """The JSON value of string input `name` (None when absent or blank), at most `limit`
    characters, of type `kind`; else InputError naming the input."""
    value = scalar(tensors, name, "OSU")
    if value is None:
        return None
    value = text_of(value, name)
    if len(value) > limit:
        raise InputError(f"input {name} is {len(value)} characters; at most {limit}")
    if not value.strip():
        return None
    try:
        out = json.loads(value)
    except ValueError as e:
        raise InputError(f"input {name} is not JSON: {e}") from None
    if not isinstance(out, kind):
        raise InputError(f"input {name} must be a JSON {'array' if kind is list else 'object'}, "
                         f"got {type(out).__name__}")
    return out


def build_request(parsed: Parsed, engine, request_id: str | None = None):
    """Parsed -> specbuild Request over the engine's defaults. Raises RequestError."""
    return build(parsed, engine, request_id)[0]


def tool_prompt(parsed: Parsed, engine) -> tuple[list[int], Any]:
    """With the tools input: (prompt ids, serve.tools.ToolUse or None for tool_choice none) of
    text_input as the user's turn of a chat, rendered and constrained as the HTTP chat
    endpoint does (the same request model, template and call grammar). Raises RequestError."""
    from pydantic import ValidationError

    from specbuild.errors import RequestError
    from specbuild.serve.openai_http import ChatRequest
    from specbuild.serve.tools import encode_prompt, parse_tool_use

    body = {"messages": [{"role": "user", "content": parsed.prompt}], "tools": parsed.tools}
    if parsed.tool_choice is not None:
        body["tool_choice"] = parsed.tool_choice
    if parsed.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = parsed.parallel_tool_calls
    try:
        chat = ChatRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise RequestError(f"input {where.split('.')[0]}: {where}: {first.get('msg')}") from None
    use = parse_tool_use(chat, parsed.response_format)
    messages = [{"role": "user", "content": parsed.prompt}]
    return encode_prompt(engine, messages, use, None, chat), use


def build(parsed: Parsed, engine, request_id: str | None = None):
    """(Request, ToolUse or None): build_request's, and the tools input's use when given."""
    from specbuild.errors import RequestError
    from specbuild.sampling.params import SamplingParams
    from specbuild.engine.sequence import Request
    from specbuild.speculation.config import SpeculationConfig
    from specbuild.speculation.policy import check_content_type

    sampling = dict(parsed.sampling)
    if parsed.end_id is not None:
        vocab = engine.target_config.vocab_size
        if not 0 <= parsed.end_id < vocab:
            raise RequestError(f"end_id={parsed.end_id} is out of range [0, {vocab})")
        sampling["stop_token_ids"] = (parsed.end_id,)
    if sampling.get("min_tokens"):  # no end-of-sequence or stop token before min_length
        sampling["min_tokens_ids"] = tuple(getattr(engine, "eos_ids", ())) + tuple(sampling.get("stop_token_ids", ()))
    params = SamplingParams.from_dict(sampling, engine.default_sampling)
    prompt, prompt_ids, use, fmt = parsed.prompt, None, None, parsed.response_format
    if parsed.tools is not None:
        prompt_ids, use = tool_prompt(parsed, engine)
        prompt, fmt = None, use.response_format if use is not None else fmt
    if params.repetition_penalty != 1.0:  # it counts the prompt's tokens: the engine's encoding of it
        prompt_ids = prompt_ids or engine.encode(parsed.prompt)
        prompt, params = None, dataclasses.replace(params, repetition_ids=tuple(prompt_ids))
    spec = SpeculationConfig.make(engine.default_speculation, **parsed.speculation) if parsed.speculation else None
    return Request(prompt=prompt, prompt_ids=prompt_ids, sampling=params, speculation=spec, request_id=request_id or None,
                   response_format=fmt, content_type=check_content_type(parsed.content_type),
                   logprobs=0 if parsed.logprobs else None), use


def logprob_values(items: list) -> dict[str, np.ndarray]:
    """cum_log_probs [1] and output_log_probs [1, tokens] (beam 1) of (logprob, top) items."""
    lps = [-9999.0 if lp == float("-inf") else lp for lp, _ in items]
    return {"cum_log_probs": np.array([sum(lps)], dtype=np.float32),
            "output_log_probs": np.array([lps], dtype=np.float32).reshape(1, len(lps))}


def batched(arr: np.ndarray, on: bool) -> np.ndarray:
    """An output with the batch dimension (size 1) in front when the config has max_batch_size > 0."""
    return arr.reshape((1,) + arr.shape) if on else arr


def perf_values(drafted: int, accepted: int, cached_tokens: int = 0, tokens: int = 0,
                block_size: int = 16) -> dict[str, np.ndarray]:
    """The perf outputs, each shape [1]: speculation's, and the KV cache reuse counts
    TensorRT-LLM's backend returns under the same names (blocks of the request's text taken
    from the prefix cache, newly allocated, in all; `tokens`: prompt and output)."""
    total = -(-tokens // block_size)
    reused = min(cached_tokens // block_size, total)
    return {"acceptance_rate": np.array([accepted / drafted if drafted else 0.0], dtype=np.float32),
            "total_accepted_draft_tokens": np.array([accepted], dtype=np.int32),
            "total_draft_tokens": np.array([drafted], dtype=np.int32),
            "kv_cache_reused_blocks": np.array([reused], dtype=np.int32),
            "kv_cache_alloc_new_blocks": np.array([total - reused], dtype=np.int32),
            "kv_cache_alloc_total_blocks": np.array([total], dtype=np.int32)}


def string_tensor(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


def drafter_settings(params: dict[str, str], only: str | None = None) -> dict[str, Any]:
    """The drafters' settings (`<name>_<field>`, as EngineConfig takes them flat) from the model's
    parameters of those names (tritonserver_repo.drafter_parameters; the CLI's --<name>-<field>):
    written by the repository's author, so a path among them (the suffix store's warm corpus) is
    server-side configuration, never a request's. Each is read as its Options field's default
    is typed (a flag: "1"); `only`: one drafter's."""
    import dataclasses

    from specbuild.speculation.proposers.registry import settings

    out: dict[str, Any] = {}
    for key, (name, f) in settings().items():
        raw = params.get(key)
        if not raw or (only is not None and name != only):
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, bool):
            if raw in ("1", "0"):
                out[key] = raw == "1"
        elif isinstance(default, (int, float)):
            out[key] = type(default)(raw)
        else:
            out[key] = raw
    return out


def suffix_settings(params: dict[str, str]) -> dict[str, Any]:
    """The suffix drafter's settings among the model's parameters (drafter_settings)."""
    return drafter_settings(params, "suffix")


def engine_flags(params: dict[str, str]) -> dict[str, Any]:
    """EngineConfig's switches from the model's parameters: compile ("1": triton-repo
    --compile), prefix_cache ("0": --no-prefix-cache) and the drafters' settings."""
    out: dict[str, Any] = {"compile": True} if params.get("compile") == "1" else {}
    if params.get("prefix_cache") == "0":
        out["prefix_cache"] = False
    return {**out, **drafter_settings(params)}


def config_parameters(model_config: dict) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}


def error_response(message: str, code: str | None = None, tagged: bool = False):
    """An error response; the message starts with the code's tag (see ERROR_TAGS)."""
    if code in ERROR_TAGS and not tagged:
        message = ERROR_TAGS[code] + message
    value = getattr(pb_utils.TritonError, code, None) if code else None
    error = pb_utils.TritonError(message, value) if value is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


class EngineModel:
    """The decoupled model: one engine, a forwarding thread per request."""

    def __init__(self, model_config: dict, params: dict[str, str]) -> None:
        path = params.get("python_path")
        if path and path not in sys.path:
            sys.path.append(path)  # after site-packages: an installed specbuild wins
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: idle threads sleep
        from specbuild.errors import RequestError
        from specbuild.engine.engine import EngineConfig

        self.RequestError = RequestError
        # repositories written before the backend seam name no factory and no backend: the torch Engine
        module, _, attr = params.get("engine_factory", "specbuild.engine.engine:Engine").partition(":")
        factory = getattr(importlib.import_module(module), attr)
        ints = {k: int(params[k]) for k in ("threads", "max_batch_size", "kv_cache_tokens") if params.get(k)}
        backend = {"backend": params["backend"]} if params.get("backend") else {}  # open_engine's choice
        backend.update({k: params[k] for k in ("trtllm_attn_backend", "trtllm_ngram_impl") if params.get(k)})
        flags = engine_flags(params)
        self.engine = factory(params["bundle"], EngineConfig(device=params.get("device") or "cpu", **ints, **flags),
                              **backend)
        self.max_queue = int(params.get("max_queue") or 64)
        self.batched = int(model_config.get("max_batch_size") or 0) > 0  # [batch, 1] tensors (TensorRT-LLM's)
        self.closing = False
        self.lock = threading.Lock()
        self.ipc_lock = threading.Lock()
        self.active: dict[int, tuple[Any, threading.Thread]] = {}
        self.metrics = self.make_metrics(model_config.get("name", "specbuild"))
        self.telemetry = None
        if params.get("telemetry"):  # sessions, steps and events into this store; its gamma policies
            from specbuild.telemetry import attach

            self.telemetry = attach(self.engine, params["telemetry"], source="triton")
        self.engine.start()
        log.warning("specbuild engine loaded %s in %.1fs (%s backend, max batch %d, methods %s)", params["bundle"],
                    self.engine.load_seconds, getattr(self.engine, "backend_name", "torch"),
                    self.engine.max_batch_size, ", ".join(self.engine.methods))

    @staticmethod
    def make_metrics(model: str) -> dict[str, Any]:
        """Counters on Triton's /metrics (the stub registers them with the server)."""
        if not hasattr(pb_utils, "MetricFamily"):
            return {}
        out = {}
        for name, doc in (("generated_tokens", "Tokens generated"), ("draft_tokens", "Draft tokens proposed"),
                          ("accepted_draft_tokens", "Draft tokens accepted")):
            family = pb_utils.MetricFamily(name=f"specbuild_{name}_total", description=doc,
                                           kind=pb_utils.MetricFamily.COUNTER)
            out[name] = (family, family.Metric(labels={"model": model}))
        return out

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = parse_inputs({t.name(): t.as_numpy() for t in request.inputs()})
                if self.closing:
                    raise Unavailable("the model is shutting down")
                waiting = self.engine.stats()["queue_depth"]
                if waiting >= self.max_queue:
                    raise Unavailable(f"{waiting} requests are waiting, the queue limit (max_queue) is "
                                          f"{self.max_queue}; retry later")
                built, use = build(parsed, self.engine, request.request_id())
                handle = self.engine.submit(built)
            except (InputError, self.RequestError) as e:
                self.send(sender, error_response(str(e), "INVALID_ARG"), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            except Unavailable as e:
                self.send(sender, error_response(str(e), "UNAVAILABLE"), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            thread = threading.Thread(target=self.forward, args=(handle, sender, parsed, request, use), daemon=True,
                                      name=f"specbuild-forward-{handle.request_id}")
            with self.lock:
                self.active[handle.seq.seq_id] = (handle, thread)
            thread.start()
        return None

    # Every call that messages the Triton backend from a forwarding thread goes through
    # ipc_lock: in 2.51 concurrent custom-metric updates from threads crash tritonserver
    # (SIGSEGV in ModelInstanceState::ProcessMetricRequest), so none of it runs concurrently.
    def send(self, sender, response, flags: int = 0) -> None:
        with self.ipc_lock:
            sender.send(response, flags=flags)

    def is_cancelled(self, sender) -> bool:
        if not hasattr(sender, "is_cancelled"):
            return False
        with self.ipc_lock:
            return bool(sender.is_cancelled())

    def response(self, text: str, handle, perf: bool, logprobs: list | None = None, tool_calls: str | None = None):
        b = self.batched
        outputs = [pb_utils.Tensor("text_output", batched(string_tensor(text), b))]
        if tool_calls is not None:
            outputs.append(pb_utils.Tensor("tool_calls", batched(string_tensor(tool_calls), b)))
        if perf:
            seq = handle.seq
            block = getattr(getattr(self.engine, "cache", None), "block_size", 16)
            values = perf_values(seq.tally.drafted, seq.tally.accepted, seq.tally.cached_tokens,
                                 len(seq.prompt_ids) + len(seq.output_ids), block)
            outputs += [pb_utils.Tensor(k, batched(v, b)) for k, v in values.items()]
        if logprobs is not None:
            outputs += [pb_utils.Tensor(k, batched(v, b)) for k, v in logprob_values(logprobs).items()]
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def forward(self, handle, sender, parsed: Parsed, request=None, use=None) -> None:
        """Relay one request's events to its sender until the final one (runs on its own thread).

        `request` is held only so the stub keeps the request object until its final response.
        With tools (`use`, serve.tools.ToolUse): text_output is the content outside the calls
        (streamed: as the HTTP server's stream parser releases it), and the final response
        has tool_calls."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        text: list[str] = []
        parser = use.stream_parser() if use is not None and parsed.stream else None
        try:
            while True:
                event = handle.get(timeout=POLL_S)
                if event is None:
                    if self.closing or self.is_cancelled(sender):
                        self.engine.abort(handle)  # emits a final "abort" event, handled below
                    continue
                if event.finished and event.finish_reason in ("error", "abort"):
                    aborted = event.finish_reason == "abort"
                    reason = handle.error or ("the request was cancelled" if aborted else "internal error in the engine")
                    self.send(sender, error_response(reason, "CANCELLED" if aborted else "INTERNAL"), final)
                    return
                if parsed.stream:
                    piece, calls = event.text, None
                    if parser is not None:
                        deltas = parser.push(event.text) + (parser.finish() if event.finished else [])
                        piece = "".join(d.get("content", "") for d in deltas)
                        if event.finished:
                            calls = calls_json(parser.calls)
                    if piece or event.finished:
                        lps = (event.logprobs or []) if parsed.logprobs else None
                        response = self.response(piece, handle, parsed.perf and event.finished, lps, calls)
                        self.send(sender, response, final if event.finished else 0)
                else:
                    text.append(event.text)
                    if event.finished:
                        calls = None
                        if use is not None:  # the content outside the calls, and the calls
                            message = use.final_choice(_NoTokenIds, handle.seq, 0, None)["message"]
                            text, calls = [message["content"] or ""], json.dumps(message.get("tool_calls") or [])
                        if parsed.exclude_input is False:  # the ensemble's default: prompt + generated text
                            text.insert(0, parsed.prompt)
                        lps = list(handle.seq.scoring.logprobs) if parsed.logprobs else None
                        self.send(sender, self.response("".join(text), handle, parsed.perf, lps, calls), final)
                if event.finished:
                    self.count(handle.seq)
                    return
        except Exception as e:  # a bug must not leave the client waiting
            log.exception("forwarding request %s failed", handle.request_id)
            if not handle.seq.finished:
                self.engine.abort(handle)
            try:
                self.send(sender, error_response(f"internal error: {e}", "INTERNAL"), final)
            except Exception:
                pass
        finally:
            with self.lock:
                self.active.pop(handle.seq.seq_id, None)

    def count(self, seq) -> None:
        for name, value in (("generated_tokens", len(seq.output_ids)), ("draft_tokens", seq.tally.drafted),
                            ("accepted_draft_tokens", seq.tally.accepted)):
            if name in self.metrics and value:
                with self.ipc_lock:
                    self.metrics[name][1].increment(value)

    def finalize(self) -> None:
        self.closing = True
        with self.lock:
            running = list(self.active.values())
        for handle, _ in running:
            self.engine.abort(handle)
        for _, thread in running:
            thread.join(timeout=2)
        getattr(self.engine, "close", self.engine.stop)()  # close: TensorRT-LLM shuts its executors down
        if self.telemetry is not None:
            self.telemetry.close()


class _NoTokenIds:
    """What ToolUse.final_choice reads of an HTTP call: no token ids asked for."""

    return_token_ids = False


def calls_json(calls: list[dict[str, Any]]) -> str:
    """Complete calls ({"name", "arguments"}) as OpenAI's message.tool_calls, JSON text."""
    from specbuild.serve.tools import call_id

    return json.dumps([{"id": call_id(), "type": "function", "function": c} for c in calls])


class PlainModel:
    """The non-decoupled front: each request goes to the engine model as one BLS call."""

    def __init__(self, model_config: dict, params: dict[str, str]) -> None:
        self.target = params["target_model"]
        self.batched = int(model_config.get("max_batch_size") or 0) > 0

    def execute(self, requests: list) -> list:
        return [self.forward(request) for request in requests]

    def forward(self, request):
        inputs = [t for t in request.inputs() if t.name() != "stream"]
        rows = next((t.as_numpy().shape[0] for t in inputs if t.name() == "text_input"), 1) if self.batched else 1
        stream = np.zeros((rows, 1) if self.batched else (1,), dtype=np.bool_)  # the batch the client sent
        inputs.append(pb_utils.Tensor("stream", stream))
        bls = pb_utils.InferenceRequest(model_name=self.target, inputs=inputs,
                                        requested_output_names=list(ALL_OUTPUTS))
        text: list[str] = []
        outputs: dict[str, Any] = {}
        for response in bls.exec(decoupled=True):
            if response.has_error():
                # BLS hands every error over as INTERNAL: recover the code from the message's tag
                message = response.error().message()
                code = next((c for c, tag in ERROR_TAGS.items() if message.startswith(tag)), None)
                return error_response(message, code, tagged=True)
            for tensor in response.output_tensors():
                if tensor.name() == "text_output":
                    text.extend(text_of(v, "text_output") for v in tensor.as_numpy().reshape(-1))
                else:
                    outputs[tensor.name()] = tensor.as_numpy()
        tensors = [pb_utils.Tensor("text_output", batched(string_tensor("".join(text)), self.batched))]
        tensors += [pb_utils.Tensor(name, value) for name, value in outputs.items()]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self) -> None:
        pass


def utf8_locale() -> None:
    """Make text files open as UTF-8 in the stub.

    The stub embeds Python without PEP 538 locale coercion, so under the C locale a plain
    open() decodes ASCII and a bundle's tokenizer.json fails to read. Setting LC_CTYPE
    changes what open() defaults to (locale.getencoding reads the current LC_CTYPE)."""
    import locale

    if locale.getpreferredencoding(False).replace("-", "").lower() == "utf8":
        return
    for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
            return
        except locale.Error:
            continue
    log.warning("no UTF-8 locale available; files are read as %s", locale.getpreferredencoding(False))


class TritonPythonModel:
    """The class Triton's Python backend instantiates; delegates to the configured role."""

    def initialize(self, args: dict) -> None:
        if not log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
        model_config = json.loads(args["model_config"])
        params = config_parameters(model_config)
        utf8_locale()
        if int(np.__version__.split(".")[0]) >= 2:
            log.warning("numpy %s in the backend stub (%s): Triton <= 2.51 stubs were built against numpy 1 and "
                        "corrupt string tensors under numpy 2; point EXECUTION_ENV_PATH at an environment with "
                        "numpy<2 (scripts/get_tritonserver.py makes one)", np.__version__, sys.executable)
        role = params.get("role", "engine")
        if role == "engine":
            self.impl = EngineModel(model_config, params)
        elif role == "plain":
            self.impl = PlainModel(model_config, params)
        else:
            raise ValueError(f"parameter role={role!r} is not one of engine, plain")

    def execute(self, requests: list):
        return self.impl.execute(requests)

    def finalize(self) -> None:
        self.impl.finalize()
