"""OpenAI-compatible HTTP front end over one engine of any backend (standard library only).

    POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models, /health, /metrics

The engine is what `backend.open_engine` returns (torch or TensorRT-LLM); the server uses
only the request-level interface (`backend.Backend`): submit/abort/start/stop, the text
helpers, and `stats()` for /health and /metrics.

One thread per connection (`ThreadingHTTPServer`); the engine's step loop runs on its own
thread and continuous batching happens there: requests join and leave between steps.
A handler thread submits, then waits on its handle's events, polling its socket between
events so that a client that goes away has its request aborted (KV blocks freed) at once.
Back-pressure: when `max_queue` requests already wait for admission, new ones get 429
with Retry-After. Bad bodies get 4xx with `{"error": {message, type, param, code}}`.

Extension fields (beyond OpenAI's): `top_k`, `ignore_eos`, `return_token_ids`, and the
SpeculationConfig names `speculation` (a method name, or an object of those fields),
`gamma`, `gamma_min`, `gamma_max`, `tree`, `ngram_min`, `ngram_max`, `typical`. `usage`
adds drafted_tokens, accepted_tokens, mean_accepted_tokens and seed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from specbuild.errors import RequestError
from specbuild.serve.metrics import CONTENT_TYPE, ServerMetrics
from specbuild.sampling.params import SamplingParams
from specbuild.engine.sequence import Handle, Request

log = logging.getLogger("specbuild.server")

SPEC_FIELDS = ("gamma", "gamma_min", "gamma_max", "tree", "ngram_min", "ngram_max", "typical")
SPEC_OBJECT_FIELDS = ("method",) + SPEC_FIELDS
_INT, _NUM, _STR, _BOOL = ("integer", "null"), ("number", "null"), ("string", "null"), ("boolean", "null")
COMMON_FIELDS: dict[str, tuple[str, ...]] = {
    "model": _STR, "stream": _BOOL, "stream_options": ("object", "null"), "max_tokens": _INT,
    "temperature": _NUM, "top_p": _NUM, "top_k": _INT, "seed": _INT, "stop": ("string", "array", "null"),
    "n": _INT, "user": _STR, "presence_penalty": _NUM, "frequency_penalty": _NUM, "ignore_eos": _BOOL,
    "return_token_ids": _BOOL, "speculation": ("string", "object", "null"), "gamma": _INT, "gamma_min": _INT,
    "gamma_max": _INT, "tree": _STR, "ngram_min": _INT, "ngram_max": _INT, "typical": _BOOL,
}
COMPLETION_FIELDS = {**COMMON_FIELDS, "prompt": ("string", "array"), "echo": _BOOL, "best_of": _INT,
                     "logprobs": _INT, "suffix": _STR}
CHAT_FIELDS = {**COMMON_FIELDS, "messages": ("array",), "max_completion_tokens": _INT, "logprobs": _BOOL,
               "top_logprobs": _INT}
# accepted OpenAI fields this server does not implement: only their neutral value is allowed
NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": (0, False), "top_logprobs": 0, "suffix": "",
           "presence_penalty": 0, "frequency_penalty": 0}


@dataclass(frozen=True)
class ServeConfig:
    """HTTP settings. port 0 binds a free port (see `OpenAIServer.url`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64  # requests waiting for admission before 429
    model_name: str | None = None  # None: the bundle directory's name
    retry_after_s: int = 1
    max_body_bytes: int = 4 << 20
    poll_s: float = 0.05  # how often a waiting handler checks that its client is still there

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is out of range [0, 65535]")
        if not 1 <= self.max_queue <= 1 << 20:
            raise ValueError(f"max_queue={self.max_queue} is out of range [1, {1 << 20}]")
        if not 0 < self.poll_s <= 1:
            raise ValueError(f"poll_s={self.poll_s} is out of range (0, 1]")


class ApiError(Exception):
    """An HTTP error answer: status plus OpenAI's error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    """The client closed its connection."""


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "?")


def request_error(e: RequestError, default_param: str | None) -> ApiError:
    """Map an engine/config RequestError to 400, naming the field its message starts with."""
    msg = str(e)
    m = re.match(r"(\w+)=", msg)
    param = m.group(1) if m else default_param
    if msg.startswith("speculation") or msg.startswith("unknown speculation"):
        param = "speculation"
    elif msg.startswith("stop string"):
        param = "stop"
    elif msg.startswith("unknown sampling"):
        param = None
    return ApiError(400, msg, param=param)


def check_fields(body: Any, fields: dict[str, tuple[str, ...]]) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {json_type(body)}")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise ApiError(400, f"unknown field(s) {unknown}; supported: {sorted(fields)}", param=unknown[0])
    for name, value in body.items():
        kind = json_type(value)
        allowed = fields[name]
        if kind not in allowed and not (kind == "integer" and "number" in allowed):
            raise ApiError(400, f"{name} must be {' or '.join(allowed)}, got {kind} {value!r:.60}", param=name)
        neutral = NEUTRAL.get(name)
        if neutral is not None and value is not None:
            ok = value in neutral if isinstance(neutral, tuple) else value == neutral
            if not ok:
                raise ApiError(400, f"{name}={value!r} is not supported by this server (only {neutral!r})", param=name)


def parse_sampling(body: dict[str, Any], defaults: SamplingParams, chat: bool) -> SamplingParams:
    stop = body.get("stop")
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    max_tokens = body.get("max_completion_tokens") if chat else None
    fields = {"max_tokens": max_tokens if max_tokens is not None else body.get("max_tokens"),
              "temperature": body.get("temperature"), "top_p": body.get("top_p"), "top_k": body.get("top_k"),
              "seed": body.get("seed"), "stop": tuple([stop] if isinstance(stop, str) else stop) if stop else None,
              "ignore_eos": body.get("ignore_eos")}
    try:
        return SamplingParams.from_dict({k: v for k, v in fields.items() if v is not None}, defaults)
    except RequestError as e:
        raise request_error(e, None) from None


def parse_speculation(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's speculation fields as a dict for SpeculationConfig.make (None: bundle default)."""
    spec: dict[str, Any] = {}
    given = body.get("speculation")
    if isinstance(given, str):
        spec["method"] = given
    elif isinstance(given, dict):
        unknown = sorted(set(given) - set(SPEC_OBJECT_FIELDS))
        if unknown:
            raise ApiError(400, f"unknown speculation field(s) {unknown}; known: {list(SPEC_OBJECT_FIELDS)}",
                           param="speculation")
        spec.update({k: v for k, v in given.items() if v is not None})
    for name in SPEC_FIELDS:
        if body.get(name) is not None:
            if name in spec:
                raise ApiError(400, f"{name} is given both at top level and inside speculation", param=name)
            spec[name] = body[name]
    return spec or None


def parse_prompt(body: dict[str, Any]) -> Request:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "prompt is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return Request(prompt=prompt)
    if isinstance(prompt, list) and all(json_type(t) == "integer" for t in prompt):
        return Request(prompt_ids=list(prompt))
    raise ApiError(400, "prompt must be a string, a list of token ids, or a one-element list of either "
                        "(one prompt per request)", param="prompt")


def flatten_messages(messages: list[Any]) -> list[Any]:
    """OpenAI content parts [{type: text, text}] -> one string; other parts are refused."""
    out = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            parts = message["content"]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in parts):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            message = {**message, "content": "".join(p["text"] for p in parts)}
        out.append(message)
    return out


@dataclass
class Call:
    """One parsed generation request and how to answer it."""

    endpoint: str  # "completions" | "chat"
    request: Request
    stream: bool
    include_usage: bool
    return_token_ids: bool
    id: str
    created: int


class OpenAIServer:
    """The HTTP application: parsing, admission, streaming, metrics. Owns no model state."""

    def __init__(self, engine, config: ServeConfig = ServeConfig()) -> None:
        self.engine = engine
        self.config = config
        self.model_name = config.model_name or os.path.basename(os.path.normpath(engine.bundle_dir))
        self.metrics = ServerMetrics(engine)
        self.active: set[Handle] = set()
        self.closing = False
        self.created = int(time.time())
        self.health_checks: list[Callable[[], dict[str, Any]]] = []  # extra /health fields (e.g. draft rank)
        self._lock = threading.Lock()
        self.httpd: ThreadingHTTPServer | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    def bind(self) -> str:
        """Start the engine loop and bind the socket; returns the URL (serve with serve_forever)."""
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        server_cls = type("SpecbuildHTTPServer", (ThreadingHTTPServer,),
                          {"address_family": family, "daemon_threads": True, "block_on_close": False})
        self.httpd = server_cls((self.config.host, self.config.port), RequestHandler)
        self.httpd.app = self  # type: ignore[attr-defined]
        self.engine.start()
        return self.url

    @property
    def url(self) -> str:
        assert self.httpd is not None
        host, port = self.httpd.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self) -> None:
        assert self.httpd is not None
        self.httpd.serve_forever(poll_interval=0.2)

    def shutdown(self) -> None:
        """Refuse new work, abort what is in flight, stop the loop (call off the serving thread)."""
        with self._lock:
            self.closing = True
            handles = list(self.active)
        for handle in handles:
            self.engine.abort(handle)
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        self.engine.stop()

    # ---- requests ----------------------------------------------------------------------
    def parse(self, body: Any, endpoint: str) -> Call:
        chat = endpoint == "chat"
        check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        model = body.get("model")
        if model is not None and model not in (self.model_name, self.engine.bundle_dir):
            raise ApiError(404, f"model {model!r} is not served here (serving {self.model_name!r})",
                           param="model", code="model_not_found")
        stream = bool(body.get("stream"))
        options = body.get("stream_options") or {}
        if options and not stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
            raise ApiError(400, "stream_options takes only include_usage (boolean)", param="stream_options")
        sampling = parse_sampling(body, self.engine.default_sampling, chat)
        if chat:
            messages = body.get("messages")
            if not messages:
                raise ApiError(400, "messages is required and must not be empty", param="messages")
            try:
                text = self.engine.render_chat(flatten_messages(messages))
            except RequestError as e:
                raise ApiError(400, str(e), param="messages") from None
            request = Request(prompt_ids=self.engine.encode(text, add_special_tokens=False))
        else:
            request = parse_prompt(body)
        prefix = "chatcmpl" if chat else "cmpl"
        request.request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        request.sampling = sampling
        request.speculation = parse_speculation(body)
        return Call(endpoint, request, stream, bool(options.get("include_usage")), bool(body.get("return_token_ids")),
                    request.request_id, int(time.time()))

    def submit(self, call: Call) -> Handle:
        """Queue the request, or raise ApiError (429 when the queue is full, 400 when invalid)."""
        with self._lock:
            if self.closing:
                self.metrics.rejected.inc(reason="shutting_down")
                raise ApiError(503, "the server is shutting down", type_="server_error", code="shutting_down")
            depth = self.engine.stats()["queue_depth"]
            if depth >= self.config.max_queue:
                self.metrics.rejected.inc(reason="queue_full")
                raise ApiError(429, f"{depth} requests are waiting, the queue limit (--max-queue) is "
                                    f"{self.config.max_queue}; retry later", type_="rate_limit_error",
                               code="queue_full", headers={"Retry-After": str(self.config.retry_after_s)})
            try:
                handle = self.engine.submit(call.request)
            except RequestError as e:
                raise request_error(e, "messages" if call.endpoint == "chat" else "prompt") from None
            self.active.add(handle)
        return handle

    def finish(self, handle: Handle) -> None:
        """Abort the request if it is still running (the client went away)."""
        with self._lock:
            self.active.discard(handle)
        if not handle.seq.finished:
            self.engine.abort(handle)
            log.info("request %s aborted: the client went away", handle.request_id)

    def health(self) -> tuple[int, dict[str, Any]]:
        engine = self.engine
        load = engine.stats()  # kv_blocks_* are null where the backend does not report them
        info: dict[str, Any] = {
            "status": "shutting_down" if self.closing else "ok", "model": self.model_name,
            "backend": getattr(engine, "backend_name", "torch"),
            "queue_depth": load["queue_depth"], "running": load["running"],
            "kv_blocks_used": load["kv_blocks_used"], "kv_blocks_total": load["kv_blocks_total"],
            "max_batch_size": engine.max_batch_size, "max_queue": self.config.max_queue}
        for check in self.health_checks:
            extra = check()
            if extra.get("status") == "degraded" and info["status"] == "ok":
                info["status"] = "degraded"
            info.update({k: v for k, v in extra.items() if k != "status"})
        return (503 if self.closing else 200), info

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specbuild", "max_model_len": self.engine.max_seq_len}]}


def usage(seq) -> dict[str, Any]:
    stats = seq.stats()
    return {"prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["generated_tokens"],
            "total_tokens": stats["prompt_tokens"] + stats["generated_tokens"], "drafted_tokens": stats["drafted"],
            "accepted_tokens": stats["accepted"], "mean_accepted_tokens": stats["mean_accepted_tokens"],
            "seed": stats["seed"]}


def choice(call: Call, text: str | None, token_ids: list[int] | None, finish_reason: str | None,
           final: bool) -> dict[str, Any]:
    """One choice: a message (chat, final), a delta (chat, stream) or text (completions)."""
    out: dict[str, Any] = {"index": 0}
    if call.endpoint == "chat":
        content = {} if text is None else {"content": text}
        out["message" if final else "delta"] = {"role": "assistant", **content} if final else content
    else:
        out["text"] = text or ""
    if call.return_token_ids and token_ids is not None:
        out["token_ids"] = list(token_ids)
    out["logprobs"] = None
    out["finish_reason"] = finish_reason
    return out


def envelope(call: Call, model: str, choices: list[dict], stream: bool, **extra: Any) -> dict[str, Any]:
    kind = ("chat.completion" if call.endpoint == "chat" else "text_completion") + \
        (".chunk" if stream and call.endpoint == "chat" else "")
    return {"id": call.id, "object": kind, "created": call.created, "model": model, "choices": choices, **extra}


class RequestHandler(BaseHTTPRequestHandler):
    """Routes one connection's requests (HTTP/1.1 keep-alive; SSE bodies are chunked)."""

    protocol_version = "HTTP/1.1"
    server_version = "specbuild"
    timeout = 300  # idle keep-alive connections and stalled writes give up after this (seconds)

    @property
    def app(self) -> OpenAIServer:
        return self.server.app  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        log.info("%s %s", self.address_string(), format % args)

    # ---- routing -----------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            if path == "/health":
                status, info = self.app.health()
                self.send_json(status, info)
            elif path == "/metrics":
                self.send_bytes(200, self.app.metrics.render().encode(), CONTENT_TYPE)
            elif path == "/v1/models":
                self.send_json(200, self.app.models())
            elif path.startswith("/v1/models/"):
                found = [m for m in self.app.models()["data"] if m["id"] == path[len("/v1/models/"):]]
                if not found:
                    raise ApiError(404, f"model {path[len('/v1/models/'):]!r} is not served here", param="model",
                                   code="model_not_found")
                self.send_json(200, found[0])
            elif path in ("/v1/completions", "/v1/chat/completions"):
                raise ApiError(405, f"{path} takes POST", code="method_not_allowed")
            else:
                raise ApiError(404, f"no route {path!r}", code="not_found")
        except ApiError as e:
            self.send_api_error(e)

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        endpoint = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(path)
        self.responded = False  # status line sent for this request (keep-alive reuses the handler)
        self.recorded = False  # metrics recorded for this request
        try:
            if endpoint is None:
                raise ApiError(404, f"no route {path!r}", code="not_found")
            call = self.app.parse(self.read_json(), endpoint)
            handle = self.app.submit(call)
        except ApiError as e:
            if 400 <= e.status < 500 and e.status != 429:
                self.app.metrics.rejected.inc(reason="invalid")
            self.send_api_error(e)
            return
        except Exception:  # a bug must answer 500, not drop the connection
            log.exception("failed to parse or submit a request")
            self.send_api_error(ApiError(500, "internal error (see the server log)", type_="server_error"))
            return
        try:
            if call.stream:
                self.stream(call, handle)
            else:
                self.complete(call, handle)
        except ClientGone:
            self.close_connection = True
        except Exception:
            log.exception("request %s failed", handle.request_id)
            self.close_connection = True
            if not self.responded:
                self.send_api_error(ApiError(500, "internal error (see the server log)", type_="server_error"))
        finally:
            self.app.finish(handle)
            self.record(handle, endpoint)

    def record(self, handle: Handle, endpoint: str) -> None:
        """Metrics for a finished request, once; before its last bytes go out, so that a client
        that reads /metrics after its response sees its request counted."""
        if not self.recorded:
            self.recorded = True
            self.app.metrics.observe_request(endpoint, handle.seq.finish_reason, handle.seq)

    # ---- bodies --------------------------------------------------------------------------
    def read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise ApiError(411, "a Content-Length header is required", code="length_required")
        if int(length) > self.app.config.max_body_bytes:
            self.close_connection = True
            raise ApiError(413, f"the body is {length} bytes; the limit is {self.app.config.max_body_bytes}",
                           code="body_too_large")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None

    def send_bytes(self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.responded = True
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True
            raise ClientGone() from None

    def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self.send_bytes(status, json.dumps(obj).encode(), "application/json", headers)

    def send_api_error(self, e: ApiError) -> None:
        try:
            self.send_json(e.status, e.body(), e.headers)
        except ClientGone:
            pass

    # ---- generation ------------------------------------------------------------------------
    def client_gone(self) -> bool:
        """True when the peer has closed its end (readable with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def events(self, handle: Handle, endpoint: str):
        """The handle's events; raises ClientGone as soon as the client disconnects."""
        poll = self.app.config.poll_s
        checked = time.monotonic()
        while True:
            # a timed wait lets us notice a departed client
            event = handle.get(timeout=poll)
            now = time.monotonic()
            if event is None or now - checked >= poll:
                checked = now
                if self.client_gone():
                    raise ClientGone()
            if event is not None:
                if event.finished:
                    self.record(handle, endpoint)
                yield event
                if event.finished:
                    return

    def complete(self, call: Call, handle: Handle) -> None:
        for _ in self.events(handle, call.endpoint):
            pass
        seq = handle.seq
        if seq.finish_reason == "error":
            raise_error = ApiError(500, handle.error or "the engine failed this request", type_="server_error")
            return self.send_api_error(raise_error)
        if seq.finish_reason == "abort":
            return self.send_api_error(ApiError(503, "the request was aborted (server shutting down)",
                                                type_="server_error", code="aborted"))
        body = envelope(call, self.app.model_name, [choice(call, seq.text, seq.output_ids, seq.finish_reason, True)],
                        False, usage=usage(seq))
        self.send_json(200, body)

    def write_chunk(self, data: bytes) -> None:
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        except OSError:
            raise ClientGone() from None

    def sse(self, obj: Any) -> None:
        self.write_chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

    def stream(self, call: Call, handle: Handle) -> None:
        self.responded = True
        try:
            self.send_response(200)
            for k, v in (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                         ("Transfer-Encoding", "chunked"), ("X-Accel-Buffering", "no")):
                self.send_header(k, v)
            self.end_headers()
        except OSError:
            raise ClientGone() from None
        model = self.app.model_name
        if call.endpoint == "chat":
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            self.sse(envelope(call, model, [first], True))
        for event in self.events(handle, call.endpoint):
            if event.text or (call.return_token_ids and event.token_ids):
                self.sse(envelope(call, model, [choice(call, event.text, event.token_ids, None, False)], True))
            if event.finished and event.finish_reason == "error":
                self.sse(ApiError(500, handle.error or "the engine failed this request", type_="server_error").body())
            elif event.finished:
                seq_usage = usage(handle.seq)
                self.sse(envelope(call, model, [choice(call, None, [] if call.return_token_ids else None,
                                                       event.finish_reason, False)], True, usage=seq_usage))
                if call.include_usage:
                    self.sse(envelope(call, model, [], True, usage=seq_usage))
        self.sse(b"[DONE]")
        self.write_chunk(b"")
