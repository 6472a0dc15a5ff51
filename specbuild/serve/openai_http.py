"""OpenAI-compatible HTTP front end over one engine of any backend, on FastAPI + uvicorn.

    POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models, /v1/models/{id}, /health, /metrics, /openapi.json

The engine is what `backend.open_engine` returns (torch or TensorRT-LLM); the server uses
only the request-level interface (`backend.Backend`): submit/abort/start/stop, the text
helpers, and `stats()` for /health and /metrics.

Threads. uvicorn runs one asyncio event loop (on the thread that calls `serve_forever`);
the engine's step loop runs on its own thread and continuous batching happens there. The
event loop never blocks on the engine: parsing, chat rendering, tokenizing and `submit` run
in a worker thread, and a request's events reach its coroutine through `Handle.listener`
(the engine thread calls `loop.call_soon_threadsafe`; the torch engine makes those calls as
its next forward's layer stack begins, so this thread's work runs while the stack holds no
GIL: engine/base.py, wake_listener). Each request also watches its
connection: when the client goes away its request is aborted (KV blocks freed) at once,
while it streams, while it waits for a whole answer, or while it is still queued; the abort
runs on a thread of its own (it takes the engine lock, which a step holds). `/health` runs
on the event loop (lock-free reads), never behind the worker pool. echo + logprobs is an
ordinary request: the engine scores the prompt during the request's own prefill.

Back-pressure: when `max_queue` requests already wait for admission, new ones get 429 with
Retry-After. Bad bodies get 4xx with `{"error": {message, type, param, code}}`, `param`
naming the field. Bodies need a Content-Length (or chunked encoding), at most
`max_body_bytes`; a body that does not arrive within `body_timeout_s` gets 408, so a slow
client holds one connection, never a worker.

Request bodies are pydantic models (`CompletionRequest`, `ChatRequest`, in /openapi.json):
OpenAI's field names, plus the extension fields `top_k`, `ignore_eos`, `return_token_ids`
and the SpeculationConfig names `speculation` (a method name, or an object of those
fields), `gamma`, `gamma_min`, `gamma_max`, `tree`, `ngram_min`, `ngram_max`, `typical`.
`usage` adds drafted_tokens, accepted_tokens, mean_accepted_tokens and seed.

Every field a client controls that reaches a loop bound, an allocation, a string search or
the filesystem has a limit (the LIMIT constants below; 400 names the field, value and
limit): a `tree` is a preset name or inline paths and never opens a file; chat roles are
OpenAI's (system, developer, user, assistant, tool, function).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Union

import uvicorn
from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from specbuild.engine.sequence import Handle, Request
from specbuild.engine.text import IncrementalDetokenizer
from specbuild.errors import RequestError
from specbuild.sampling.params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from specbuild.serve import openai_fields as fields_policy
from specbuild.serve.http_guard import ConnectionLimits, RequestLimit, guarded_protocol, raise_open_files
from specbuild.serve.metrics import CONTENT_TYPE, ServerMetrics
from specbuild.speculation.config import GAMMA_LIMIT, METHODS
from specbuild.speculation.tree import MAX_DEPTH, MAX_INLINE_NODES, MAX_RANK, TreeError, load_tree

log = logging.getLogger("specbuild.server")

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# ---- limits on what a client sends (each reaches a loop, an allocation or a search) -------
LIMIT_STOP_STRINGS = MAX_STOP_STRINGS  # stop strings are searched in every new piece of text
LIMIT_STOP_CHARS = MAX_STOP_CHARS
LIMIT_PROMPT_CHARS = 1 << 22  # (the body limit bounds it too); tokens: the engine's max_seq_len
LIMIT_PROMPT_IDS = 1 << 18
LIMIT_MAX_TOKENS = 1 << 20  # and the engine refuses what its KV cache cannot hold
LIMIT_MESSAGES = 4096  # messages per chat (each is rendered by the template)
LIMIT_TEXT_PARTS = 256  # content parts per chat message
LIMIT_NAME_CHARS = 256  # model, user, message name, tree preset name
LIMIT_TOKEN_ID = 1 << 31  # ids are checked against the vocabulary by the engine
LIMIT_TOP_K = 1 << 20
LIMIT_SEED = (1 << 63) - 1
LIMIT_N = 16  # choices per request (each is a sequence of its own in the engine)
LIMIT_TOP_LOGPROBS = 20  # OpenAI's
LIMIT_LOGIT_BIAS = 300  # OpenAI's
LIMIT_FORMAT_CHARS = 64 * 1024  # a response_format's schema / regex / grammar (sampling.constraint)
LIMIT_PROMPTS = 64  # prompts in one completions request (a list of strings or of token-id lists)
LIMIT_CHOICES = 64  # prompts x n: each choice is a sequence of its own in the engine
LIMIT_CACHE_SALT_CHARS = 256  # hashed once per request (the prefix cache's chain root)
LIMIT_TOOLS = 128  # OpenAI's: tools (or functions) per request, and tool calls per message


@dataclass(frozen=True)
class ServeConfig:
    """HTTP settings. port 0 binds a free port (see `OpenAIServer.url`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64  # requests waiting for admission before 429
    model_name: str | None = None  # None: the bundle directory's name
    retry_after_s: int = 1
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0  # a request body must arrive within this (else 408)
    keep_alive_s: int = 60  # idle keep-alive connections close after this
    strict_fields: bool = False  # unknown body fields: 400 (True) or ignored, logged and listed (serve/openai_fields.py)
    chat_template: str | None = None  # a Jinja chat template's text, replacing the bundle's (--chat-template)
    tool_parser: str = "hermes"  # how tool calls are read out of the text (serve/tools.py PARSERS)
    # the connection layer (serve/http_guard.py): a head's deadline, size and header count, the
    # open-socket cap (longest-idle closed beyond it), requests handled at once (503 beyond)
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024
    max_headers: int = 128
    max_connections: int = 8192
    max_inflight: int = 1024

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is out of range [0, 65535]")
        if not 1 <= self.max_queue <= 1 << 20:
            raise ValueError(f"max_queue={self.max_queue} is out of range [1, {1 << 20}]")
        if not 0.05 <= self.body_timeout_s <= 3600:
            raise ValueError(f"body_timeout_s={self.body_timeout_s} is out of range [0.05, 3600]")
        if not 1 <= self.max_inflight <= 1 << 20:
            raise ValueError(f"max_inflight={self.max_inflight} is out of range [1, {1 << 20}]")
        self.connection_limits()  # range checks of the connection layer's settings

    def connection_limits(self, max_connections: int | None = None) -> ConnectionLimits:
        return ConnectionLimits(header_timeout_s=self.header_timeout_s, max_header_bytes=self.max_header_bytes,
                                max_headers=self.max_headers,
                                max_connections=self.max_connections if max_connections is None else max_connections)


class ApiError(StarletteHTTPException):
    """An HTTP error answer: status plus OpenAI's error object. An HTTPException, so that
    FastAPI passes it through body parsing unchanged (a slow or oversized body)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


class ClientGone(Exception):
    """The client closed its connection."""


# ---- request models ---------------------------------------------------------------------------
class Strict(BaseModel):
    """JSON types as JSON has them: no "10" for 10, no true for 1, no NaN; unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


Name = Annotated[str, Field(max_length=LIMIT_NAME_CHARS)]
Gamma = Annotated[int, Field(ge=0, le=GAMMA_LIMIT)]
NgramSize = Annotated[int, Field(ge=1, le=8)]
TreePaths = Annotated[list[Annotated[list[Annotated[int, Field(ge=0, lt=MAX_RANK)]],
                                     Field(min_length=1, max_length=MAX_DEPTH)]],
                      Field(min_length=1, max_length=MAX_INLINE_NODES)]


def preset_tree(name: str) -> str:
    """A request's tree name must be a preset (load_tree opens no file without allow_files)."""
    try:
        load_tree(name)
    except TreeError as e:
        raise ValueError(str(e)) from None
    return name


Tree = Annotated[Union[Annotated[Name, AfterValidator(preset_tree)], TreePaths], Field(description=(
    "Medusa token tree: a preset name (e.g. mc_sim_7b_63, chain_4) or inline paths, a list of lists "
    f"of ranks (at most {MAX_INLINE_NODES} paths, depth <= {MAX_DEPTH}, ranks < {MAX_RANK}); never a file"))]
Stop = Union[Annotated[str, Field(min_length=1, max_length=LIMIT_STOP_CHARS)],
             Annotated[list[Annotated[str, Field(min_length=1, max_length=LIMIT_STOP_CHARS)]],
                       Field(max_length=LIMIT_STOP_STRINGS)]]
TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=LIMIT_TOKEN_ID)]], Field(max_length=LIMIT_PROMPT_IDS)]
PromptText = Annotated[str, Field(max_length=LIMIT_PROMPT_CHARS)]


class SpeculationFields(Strict):
    """The SpeculationConfig fields a body may give, in a `speculation` object or at the top
    level (both spellings are accepted)."""

    gamma: Gamma | None = None
    gamma_min: Gamma | None = None
    gamma_max: Gamma | None = None
    tree: Tree | None = None
    ngram_min: NgramSize | None = None
    ngram_max: NgramSize | None = None
    typical: bool | None = Field(None, description="Medusa typical acceptance: LOSSY (opt-in)")


class SpeculationObject(SpeculationFields):
    method: Literal[METHODS] | None = None  # type: ignore[valid-type]


class StreamOptions(Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(None, description="vLLM's: usage (so far) in every chunk")


Short = Annotated[str, Field(max_length=512)]
FormatText = Annotated[str, Field(min_length=1, max_length=LIMIT_FORMAT_CHARS)]


class CommonFields(SpeculationFields):
    # the field policy (serve/openai_fields.py): unknown fields are dropped here, their names kept
    specbuild_ignored_fields: SkipJsonSchema[list[str] | None] = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _split_unknown(cls, data: Any) -> Any:
        return fields_policy.split_unknown(data, set(cls.model_fields))

    model: Name | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=0, le=LIMIT_MAX_TOKENS)] | None = Field(
        None, description="0 only with completions echo: score the prompt, generate nothing")
    temperature: Annotated[float, Field(ge=0, le=100)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=LIMIT_TOP_K)] | None = None
    seed: Annotated[int, Field(ge=0, le=LIMIT_SEED)] | None = None
    stop: Stop | None = None
    n: Annotated[int, Field(ge=1, le=LIMIT_N)] | None = None
    user: Name | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=LIMIT_LOGIT_BIAS)] | None = None
    response_format: dict[str, Any] | None = Field(
        None, description="OpenAI's {type: text | json_object | json_schema}; specbuild adds {type: regex, regex} "
                          "and {type: grammar, grammar} (Lark)")
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None
    content_type: Name | None = Field(None, description="the gamma policy's content type (code, structured, "
                                                           "summarization, chat, ...); default: classified")
    speculation: Union[Literal[METHODS], SpeculationObject] | None = Field(  # type: ignore[valid-type]
        None, description="a method name, or an object of SpeculationConfig fields")
    cache_salt: Annotated[str, Field(min_length=1, max_length=LIMIT_CACHE_SALT_CHARS)] | None = Field(
        None, description="vLLM's: mixed into the prefix cache's block hashes, so that only requests with the same "
                          "salt share cached K/V (one tenant cannot probe another's prompts through timing)")
    # OpenAI fields that change nothing computed here (openai_fields.NOOP)
    store: bool | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Short], Field(max_length=16)] | None = None
    service_tier: Name | None = None
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None
    reasoning_effort: Name | None = None
    verbosity: Name | None = None
    request_id: Name | None = None
    guided_decoding_backend: Name | None = None
    # vLLM extras, implemented
    min_tokens: Annotated[int, Field(ge=0, le=LIMIT_MAX_TOKENS)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] | None = Field(
        None, description="vLLM's: logits of tokens in the prompt or the output so far divided by it (when "
                          "positive) or multiplied by it; 1 disables it")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, lt=LIMIT_TOKEN_ID)]],
                              Field(max_length=fields_policy.MAX_STOP_TOKEN_IDS)] | None = None
    guided_json: Union[dict[str, Any], FormatText] | None = None
    guided_regex: FormatText | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=fields_policy.MAX_CHOICE_CHARS)]],
                             Field(min_length=1, max_length=fields_policy.MAX_CHOICES)] | None = None
    guided_grammar: FormatText | None = None
    add_special_tokens: bool | None = None
    skip_special_tokens: bool | None = Field(None, description="vLLM's: false keeps special tokens in the text "
                                                               "(not with stop strings or tools)")
    spaces_between_special_tokens: bool | None = Field(None, description="vLLM's: no effect here (a fast tokenizer)")
    # vLLM extras served at their neutral value only (openai_fields.NEUTRAL)
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    length_penalty: float | None = None
    use_beam_search: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=LIMIT_TOP_LOGPROBS)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=LIMIT_PROMPT_IDS)] | None = None
    guided_whitespace_pattern: Short | None = None
    priority: int | None = None


class CompletionRequest(CommonFields):
    prompt: Union[PromptText, TokenIds, Annotated[list[PromptText], Field(min_length=1, max_length=LIMIT_PROMPTS)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=LIMIT_PROMPTS)]] = Field(
        description=f"a string, a list of token ids, or a list of up to {LIMIT_PROMPTS} of either (one choice "
                    "per prompt per n, index = prompt_index * n + j)")
    echo: bool | None = None
    best_of: Annotated[int, Field(ge=1, le=LIMIT_N)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=LIMIT_TOP_LOGPROBS)] | None = None
    suffix: str | None = None


class ContentPart(Strict):
    """A content part. Only text is served; any other type (image_url, input_audio, file) is
    parsed far enough to be refused by name (`flatten_messages`)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    type: Name
    text: PromptText | None = None


class CallFunction(Strict):
    name: Name
    arguments: PromptText


class MessageToolCall(Strict):
    id: Name | None = None
    type: Literal["function"] = "function"
    function: CallFunction
    index: Annotated[int, Field(ge=0, le=LIMIT_TOOLS)] | None = None


class Message(Strict):
    # unknown keys of a message (what a client library's model_dump() adds) are ignored too
    specbuild_ignored_fields: SkipJsonSchema[list[str] | None] = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _split_unknown(cls, data: Any) -> Any:
        return fields_policy.split_unknown(data, set(cls.model_fields))

    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: Union[PromptText, Annotated[list[ContentPart], Field(max_length=LIMIT_TEXT_PARTS)]] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=LIMIT_TOOLS)] | None = None
    tool_call_id: Name | None = None
    function_call: CallFunction | None = None  # the legacy single call
    refusal: PromptText | None = None
    annotations: Annotated[list[dict[str, Any]], Field(max_length=LIMIT_TEXT_PARTS)] | None = None
    audio: dict[str, Any] | None = None


ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionDef(Strict):
    name: ToolName
    description: Annotated[str, Field(max_length=LIMIT_FORMAT_CHARS)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: ToolName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class ChatRequest(CommonFields):
    messages: Annotated[list[Message], Field(min_length=1, max_length=LIMIT_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=0, le=LIMIT_MAX_TOKENS)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=LIMIT_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=LIMIT_TOOLS)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice] | None = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[FunctionDef], Field(max_length=LIMIT_TOOLS)] | None = None
    function_call: Union[Literal["none", "auto"], FunctionName] | None = None
    # vLLM's chat extras
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    echo: bool | None = None


# ---- parsing -----------------------------------------------------------------------------------
# the field a RequestError is about, by how its message starts (engine, sampling and config
# messages); first match wins, then a leading "name=", then the caller's default
PARAM_BY_PREFIX = (("response_format", "response_format"), ("logit_bias", "logit_bias"), ("stop string", "stop"),
                   ("unknown speculation", "speculation"), ("speculation", "speculation"), ("tree", "tree"),
                   ("typical", "typical"), ("ngram", "ngram"), ("unknown sampling", None))


def request_error(e: RequestError, default_param: str | None, body: BaseModel | None = None) -> ApiError:
    """Map an engine/config RequestError to 400, naming the field it is about. With the body,
    a speculation field the client gave inside `speculation` (not at the top level) is named
    `speculation`."""
    msg = str(e)
    prefixed = [param for prefix, param in PARAM_BY_PREFIX if msg.startswith(prefix)]
    m = re.match(r"(\w+)=", msg)
    if re.match(r"\d+ stop strings", msg):
        param: str | None = "stop"
    elif prefixed:
        param = prefixed[0]
    else:
        param = m.group(1) if m else default_param
    if param == "ngram":  # "ngram sizes [a, b] must satisfy ...": the one given (min first)
        given = [f for f in ("ngram_min", "ngram_max") if body is not None and getattr(body, f, None) is not None]
        param = given[0] if given else "speculation"
    if param in SpeculationFields.model_fields and body is not None and getattr(body, param, None) is None \
            and getattr(body, "speculation", None) is not None:
        param = "speculation"
    return ApiError(400, msg, param=param)


def check_logit_bias(bias: dict[str, float], vocab_size: int) -> None:
    """logit_bias keys are token ids written in plain ASCII decimal, inside the vocabulary
    (int() alone would read "٥" or "1_000" as ids; an id past the vocabulary was ignored)."""
    for key in bias:
        if not (key.isascii() and key.isdigit() and len(key) <= 12):
            raise ApiError(400, f"logit_bias key {key[:40]!r} is not a token id: keys are token ids in plain "
                                f"decimal digits (0-9), in [0, {vocab_size})", param="logit_bias")
        if int(key) >= vocab_size:
            raise ApiError(400, f"logit_bias key {key!r}: token id {int(key)} is out of range [0, {vocab_size}) "
                                "(the vocabulary)", param="logit_bias")


def engine_error(handle: Handle) -> ApiError:
    """A request the engine failed alone (Sequence.fail): 400 naming response_format when its
    grammar caused it, other 4xx as the engine says; else 500."""
    status, msg = getattr(handle, "error_status", 500), handle.error or "the engine failed this request"
    if 400 <= status < 500:
        return ApiError(status, msg, param="response_format" if msg.startswith("response_format") else None)
    return ApiError(500, msg, type_="server_error")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_error(exc: RequestValidationError) -> ApiError:
    """pydantic's first complaint as OpenAI's error object, naming the top-level field."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "the request body is not valid")
    first = [str(p) for p in errors[0].get("loc", ()) if p != "body"][:1]
    # of the complaints about the first field, one about its value beats "wrong type" from
    # the other branches of a union (tree=[[99]]: the rank, not "not a string")
    same = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == first]
    valued = [e for e in same if not e.get("type", "").endswith("_type")]
    err = max(valued, key=lambda e: len(e.get("loc", ()))) if valued else same[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", err.get("msg", ""))
        return ApiError(400, f"the body is not valid JSON: {detail}", code="invalid_json")
    if not loc:
        got = type(err.get("input")).__name__
        return ApiError(400, f"the request body must be a JSON object, got {got}: {err.get('msg')}")
    field = loc[0]
    # the path a client wrote (messages[0].role), without pydantic's union branch tags
    where = field + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc[1:]
                            if p.isdigit() or (re.fullmatch(r"[a-z_]+", p) and p not in _TYPE_TAGS))
    if kind == "extra_forbidden" and len(loc) == 1:
        return ApiError(400, f"unknown field {field!r} (see /openapi.json for the fields this server takes)",
                        param=field)
    if kind == "missing":
        return ApiError(400, f"{where} is required", param=field)
    if kind == "value_error":  # our own validators' messages name the value already
        return ApiError(400, f"{where}: {str(err.get('msg', '')).removeprefix('Value error, ')}", param=field)
    value = repr(err.get("input"))
    value = value if len(value) <= 60 else value[:57] + "..."
    return ApiError(400, f"{where}={value}: {err.get('msg')}", param=field)


def check_neutral(body: BaseModel, chat: bool) -> None:
    """Fields served at their neutral value only (openai_fields.NEUTRAL): 400 for any other."""
    bad = fields_policy.neutral_violation(body, () if chat else ("echo",))
    if bad is not None:
        name, value, neutral = bad
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ApiError(400, f"{name}={shown} is not supported by this server (only {neutral!r})", param=name)


def ignored_fields(body: CompletionRequest | ChatRequest) -> list[str]:
    """The unknown fields the body held (the field policy dropped them): top level, then in messages."""
    names = list(body.specbuild_ignored_fields or [])
    for i, message in enumerate(getattr(body, "messages", None) or []):
        names += [f"messages[{i}].{n}" for n in message.specbuild_ignored_fields or []]
    return names[:fields_policy.MAX_LISTED]


def parse_sampling(body: CommonFields, defaults: SamplingParams, chat: bool, vocab_size: int,
                   eos_ids: tuple[int, ...] = ()) -> SamplingParams:
    stop = body.stop
    if body.logit_bias:
        check_logit_bias(body.logit_bias, vocab_size)
    max_tokens = body.max_completion_tokens if chat else None  # type: ignore[attr-defined]
    max_tokens = max_tokens if max_tokens is not None else body.max_tokens
    fields = {"max_tokens": max_tokens or None,  # 0: scoring only (OpenAIServer.parse)
              "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
              "stop": tuple([stop] if isinstance(stop, str) else stop) if stop else None,
              "ignore_eos": body.ignore_eos, "presence_penalty": body.presence_penalty,
              "frequency_penalty": body.frequency_penalty,
              "logit_bias": tuple(body.logit_bias.items()) if body.logit_bias else None,
              "stop_token_ids": tuple(body.stop_token_ids) if body.stop_token_ids else None,
              "min_tokens": body.min_tokens or None, "repetition_penalty": body.repetition_penalty}
    bad = [t for t in body.stop_token_ids or () if t >= vocab_size]
    if bad:
        raise ApiError(400, f"stop_token_ids: token id {bad[0]} is out of range [0, {vocab_size})",
                       param="stop_token_ids")
    if body.min_tokens:  # vLLM's: no end-of-sequence or stop token before min_tokens
        fields["min_tokens_ids"] = tuple(eos_ids) + tuple(body.stop_token_ids or ())
    try:
        return SamplingParams.from_dict({k: v for k, v in fields.items() if v is not None}, defaults)
    except RequestError as e:
        raise request_error(e, None, body) from None


def parse_speculation(body: CommonFields) -> dict[str, Any] | None:
    """The request's speculation fields as a dict for SpeculationConfig.make (None: bundle default)."""
    spec: dict[str, Any] = {}
    given = body.speculation
    if isinstance(given, str):
        spec["method"] = given
    elif isinstance(given, SpeculationObject):
        spec.update(given.model_dump(exclude_none=True))
    for name in SpeculationFields.model_fields:
        value = getattr(body, name)
        if value is not None:
            if name in spec:
                raise ApiError(400, f"{name} is given both at top level and inside speculation", param=name)
            spec[name] = value
    if isinstance(spec.get("tree"), list):  # inline paths: SpeculationConfig keeps them as tuples
        spec["tree"] = tuple(tuple(p) for p in spec["tree"])
    return spec or None


def parse_prompts(body: CompletionRequest) -> list[Request]:
    """One Request per prompt: a string, a list of token ids, or a list of either."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [Request(prompt=prompt)]
    if not prompt or isinstance(prompt[0], int):
        return [Request(prompt_ids=list(prompt))]  # type: ignore[arg-type]
    return [Request(prompt=p) if isinstance(p, str) else Request(prompt_ids=list(p)) for p in prompt]


def message_text(message: Message, i: int) -> str | None:
    """A message's content as one string: text parts joined; any other part refused by name."""
    content = message.content
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise ApiError(400, f"messages[{i}].content[{j}] is a {part.type[:40]!r} part: this server serves "
                                "text only (a text model); send {\"type\": \"text\", \"text\": ...} parts",
                           param="messages", code="unsupported_content")
        if part.text is None:
            raise ApiError(400, f"messages[{i}].content[{j}].text is required", param="messages")
        texts.append(part.text)
    return "".join(texts)


def flatten_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: content one string (None only beside tool
    calls), tool calls with their arguments as objects (as HF templates read them) when they
    parse, tool results with their tool_call_id."""
    out = []
    for i, message in enumerate(messages):
        content = message_text(message, i)
        calls = [c.model_dump(exclude_none=True) for c in message.tool_calls or []]
        if message.function_call is not None:
            calls.append({"type": "function", "function": message.function_call.model_dump()})
        if content is None and not (message.role == "assistant" and calls):
            raise ApiError(400, f"messages[{i}].content is required (only an assistant message with tool_calls "
                                "may have content null)", param="messages")
        item: dict[str, Any] = {"role": message.role, "content": content}
        if calls:
            for call in calls:
                try:
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
                except ValueError:
                    pass  # the template shows the text as it is
            item["tool_calls"] = calls
        for key in ("name", "tool_call_id"):
            if getattr(message, key) is not None:
                item[key] = getattr(message, key)
        out.append(item)
    return out


@dataclass
class Prompt:
    """One prompt of a request (completions may send a list) and what echoes it."""

    request: Request  # its first choice's; choice j > 0 is a copy with seed + j (or its own seed)
    echo: str | None = None  # completions echo: the prompt text to put before each answer


@dataclass
class Call:
    """One parsed generation request and how to answer it. Choice i answers prompt i // n
    (OpenAI's order: index = prompt_index * n + j)."""

    endpoint: str  # "completions" | "chat"
    prompts: list[Prompt]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    id: str
    created: int
    n: int = 1
    # echo + logprobs: each choice's prefill scores the prompt (Sequence.scoring.prompt_logprobs)
    echo_scores: bool = False
    logprobs: str | None = None  # "chat" | "completions": how to shape them; None: not asked for
    body: BaseModel | None = None  # the parsed body (errors name the field the client wrote)
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats
    ignored: list[str] = dataclasses.field(default_factory=list)  # unknown fields dropped (field policy)
    tools: Any = None  # serve.tools.ToolUse when the request offers tools (chat)
    scoring_only: bool = False  # max_tokens 0 with echo: the prompt's logprobs, nothing generated
    special_text: bool = False  # skip_special_tokens false: the text keeps the special tokens (`output_text`)

    @property
    def request(self) -> Request:
        return self.prompts[0].request

    def prompt_of(self, choice_index: int) -> Prompt:
        return self.prompts[choice_index // self.n]

    def requests(self) -> list[Request]:
        """One engine request per choice: independent samples, each with its own seed."""
        out = []
        for p, prompt in enumerate(self.prompts):
            for j in range(self.n):
                sampling = prompt.request.sampling
                if j and sampling.seed is not None:
                    sampling = dataclasses.replace(sampling, seed=(sampling.seed + j) % (1 << 63))
                index = p * self.n + j
                out.append(prompt.request if index == 0 else dataclasses.replace(
                    prompt.request, sampling=sampling, request_id=f"{self.id}-{index}"))
        return out

    def headers(self) -> dict[str, str]:
        return {fields_policy.HEADER: fields_policy.header_value(self.ignored)} if self.ignored else {}


def target_model_name(engine) -> str | None:
    """The name of the model the bundle was compiled from: the preset's (smollm2-135m) when its
    checkpoint is a preset's file, else the checkpoint directory's or file's name."""
    meta = getattr(engine, "meta", None)
    source = ((getattr(meta, "roles", None) or {}).get("target") or {}).get("source") or ""
    if not source:
        return None
    from specbuild.formats.checkpoints import PRESETS

    base = os.path.basename(os.path.normpath(source))
    for name, preset in PRESETS.items():
        if base == preset["file"]:
            return name
    return re.sub(r"\.(gguf|safetensors)$", "", base)[:LIMIT_NAME_CHARS] or None


# ---- the application ---------------------------------------------------------------------------
class OpenAIServer:
    """The HTTP application: parsing, admission, streaming, metrics. Owns no model state.

    `bind()` starts the engine loop and binds the socket; `serve_forever()` runs uvicorn on
    the calling thread until `shutdown()` (from another thread)."""

    def __init__(self, engine, config: ServeConfig = ServeConfig()) -> None:
        self.engine = engine
        self.config = config
        self.model_name = config.model_name or os.path.basename(os.path.normpath(engine.bundle_dir))
        # requests may also name the bundle's target model (a preset such as smollm2-135m, or its checkpoint's name)
        self.model_names = [self.model_name] + [a for a in [target_model_name(engine)] if a and a != self.model_name]
        self.chat_template = config.chat_template  # --chat-template: replaces the bundle's (vLLM's option)
        if self.chat_template is not None:  # a template that does not parse fails at start, not per request
            from specbuild.engine.chat import compile_template

            compile_template(self.chat_template)
        self.metrics = ServerMetrics(engine)
        self.active: set[Handle] = set()
        self.closing = False
        self.created = int(time.time())
        self.health_checks: list[Callable[[], dict[str, Any]]] = []  # extra /health fields (e.g. draft rank)
        self._lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.uvicorn: uvicorn.Server | None = None
        self._served = threading.Event()
        self._aborter = ThreadPoolExecutor(1, thread_name_prefix="specbuild-abort")  # finish(): aborts, in order
        self.app = self.make_app()

    # ---- lifecycle ----------------------------------------------------------------------
    def bind(self) -> str:
        """Start the engine loop and bind the socket; returns the URL (serve with serve_forever)."""
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.config.host, self.config.port))
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
        self.sock = sock
        quiet_uvicorn()
        # sockets: as many as the open-file limit allows once raised (soft -> hard)
        limits = self.config.connection_limits(max(16, raise_open_files(self.config.max_connections)))
        self.uvicorn = uvicorn.Server(uvicorn.Config(
            self.app, log_config=None, access_log=False, lifespan="off", ws="none", http=guarded_protocol(limits),
            timeout_keep_alive=self.config.keep_alive_s, timeout_graceful_shutdown=3))
        self.warm()
        self.engine.start()
        return self.url

    def warm(self) -> None:
        """What a server's first chat request would otherwise set up inside its own time: the tool
        module, jinja, the chat encoder (a copy of the tokenizer) and the template. Its first
        request's TTFT was 249 ms against 16-18 ms for the next ones (AMD EPYC, 2026-12-07). Best
        effort: where it fails (a bundle without a chat template), requests report it as before."""
        try:
            from specbuild.serve import tools  # noqa: F401 (the chat path imports it)

            self.engine.encode_chat([{"role": "user", "content": "hello"}], True)
        except Exception as e:  # noqa: BLE001
            log.debug("warming the chat path: %s: %s", type(e).__name__, e)

    @property
    def port(self) -> int:
        """The bound port (the free one picked when ServeConfig.port is 0)."""
        assert self.sock is not None
        return self.sock.getsockname()[1]

    @property
    def url(self) -> str:
        assert self.sock is not None
        host, port = self.sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self) -> None:
        assert self.uvicorn is not None and self.sock is not None
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self._served.set()

    def shutdown(self) -> None:
        """Refuse new work, abort what is in flight, stop the loop (call off the serving thread)."""
        with self._lock:
            self.closing = True
            handles = list(self.active)
        for handle in handles:
            self.engine.abort(handle)
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True
            self._served.wait(timeout=10)
        if self.sock is not None:
            self.sock.close()
        self._aborter.shutdown(wait=True)
        self.engine.stop()

    # ---- requests ----------------------------------------------------------------------
    def parse(self, body: CompletionRequest | ChatRequest, endpoint: str) -> Call:
        chat = endpoint == "chat"
        ignored = ignored_fields(body)
        if ignored and self.config.strict_fields:
            top = re.split(r"[.\[]", ignored[0])[0]
            raise ApiError(400, f"unknown field {ignored[0]!r} (see /openapi.json for the fields this server takes; "
                                "the server runs with --strict-fields)", param=top)
        check_neutral(body, chat)
        if body.model is not None and body.model not in (*self.model_names, self.engine.bundle_dir):
            raise ApiError(404, f"model {body.model!r} is not served here (serving {self.model_name!r})",
                           param="model", code="model_not_found")
        stream = bool(body.stream)
        options = body.stream_options
        if options is not None and not stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        max_tokens = body.max_completion_tokens if chat and body.max_completion_tokens is not None \
            else body.max_tokens  # type: ignore[union-attr]
        scoring = max_tokens == 0
        if scoring and (chat or not body.echo):  # type: ignore[union-attr]
            raise ApiError(400, "max_tokens=0 is only allowed on completions with echo: true (scoring the prompt)",
                           param="max_completion_tokens" if chat and body.max_completion_tokens == 0 else "max_tokens")
        if scoring and stream:
            raise ApiError(400, "max_tokens=0 (scoring the prompt) does not stream; drop stream", param="stream")
        sampling = parse_sampling(body, self.engine.default_sampling, chat, self.engine.target_config.vocab_size,
                                  tuple(getattr(self.engine, "eos_ids", ())))
        if scoring:  # the prefill scores the prompt; the one token it must generate is not returned
            sampling = dataclasses.replace(sampling, max_tokens=1, min_tokens=0)
        try:
            guided = fields_policy.guided_response_format(body)
        except RequestError as e:
            raise request_error(e, "response_format", body) from None
        fmt = guided if guided is not None else body.response_format
        if fmt is not None and len(json.dumps(fmt)) > LIMIT_FORMAT_CHARS:
            raise ApiError(400, f"response_format is over {LIMIT_FORMAT_CHARS} characters", param="response_format")
        tool_use = None
        if chat:
            from specbuild.serve import tools as tooling

            try:
                tool_use = tooling.parse_tool_use(body, fmt, self.config.tool_parser)
            except RequestError as e:  # its messages start with the field's name
                raise ApiError(400, str(e), param=re.split(r"[\s:=]", str(e), maxsplit=1)[0]) from None
            try:  # message text is text: only the template emits control tokens
                ids = tooling.encode_prompt(self.engine, flatten_messages(body.messages), tool_use,  # type: ignore
                                            self.chat_template, body)
            except RequestError as e:
                raise ApiError(400, str(e), param="messages") from None
            if tool_use is not None and tool_use.response_format is not None:
                fmt = tool_use.response_format
            prompts = [Prompt(Request(prompt_ids=ids))]
        else:
            prompts = [Prompt(r) for r in parse_prompts(body)]  # type: ignore[arg-type]
            if body.add_special_tokens is False:
                for p in prompts:
                    if p.request.prompt is not None:
                        p.request.prompt_ids = self.engine.encode(p.request.prompt, add_special_tokens=False)
                        p.request.prompt = None
        special = body.skip_special_tokens is False
        if special and (sampling.stop or tool_use is not None):
            raise ApiError(400, f"skip_special_tokens=false is not supported with {'stop' if sampling.stop else 'tools'}"
                                f": {'stop strings' if sampling.stop else 'tool calls'} are read from the text without "
                                "special tokens", param="skip_special_tokens")
        n = body.n or 1
        if len(prompts) * n > LIMIT_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices; at most "
                                f"{LIMIT_CHOICES} per request", param="prompt" if len(prompts) > 1 else "n")
        if not chat and body.best_of is not None and body.best_of != n:  # type: ignore[union-attr]
            raise ApiError(400, f"best_of={body.best_of} is not supported (only best_of = n = {n}: every sample "
                                "is returned)", param="best_of")
        logprobs, top_n = None, None
        if chat and body.logprobs:  # type: ignore[union-attr]
            top_n, logprobs = body.top_logprobs or 0, "chat"  # type: ignore[union-attr]
        elif chat and body.top_logprobs:  # type: ignore[union-attr]
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        elif not chat and body.logprobs is not None:  # type: ignore[union-attr]
            top_n, logprobs = body.logprobs, "completions"  # type: ignore[union-attr]
        call_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        speculation = parse_speculation(body)
        echo_scores = False
        for p, prompt in enumerate(prompts):
            request = prompt.request
            request.request_id = call_id if p == 0 else f"{call_id}-{p * n}"
            request.sampling = sampling
            if sampling.repetition_penalty != 1.0:  # vLLM's: over the prompt's tokens too (the engine's encoding)
                if request.prompt_ids is None:
                    request.prompt_ids, request.prompt = self.engine.encode(request.prompt), None
                request.sampling = dataclasses.replace(sampling, repetition_ids=tuple(request.prompt_ids))
            request.speculation = speculation
            request.content_type = body.content_type
            request.cache_salt = body.cache_salt
            request.response_format = fmt
            request.logprobs = top_n
            if not chat and body.echo:  # type: ignore[union-attr]
                prompt.echo = request.prompt if request.prompt is not None else \
                    self.engine.tokenizer.decode(request.prompt_ids, skip_special_tokens=not special)
                if logprobs or scoring:  # the prompt's own logprobs (OpenAI: the first token's is null), by its prefill
                    if not getattr(self.engine, "supports_prompt_logprobs", False):
                        raise ApiError(400, "echo with logprobs is not supported on this backend (torch only)",
                                       param="echo")
                    request.prompt_logprobs, echo_scores = top_n or 0, True
        if ignored:
            log.warning("request %s: ignored unknown field(s) %s (listed in the %s header)", call_id,
                        ", ".join(ignored), fields_policy.HEADER)
        return Call(endpoint, prompts, stream, bool(options and options.include_usage), bool(body.return_token_ids),
                    call_id, int(time.time()), n=n, logprobs=logprobs if not scoring else (logprobs or "completions"),
                    echo_scores=echo_scores, body=body,
                    continuous_usage=bool(options and options.include_usage and options.continuous_usage_stats),
                    ignored=ignored, tools=tool_use, scoring_only=scoring, special_text=special)

    def submit(self, call: Call) -> list[Handle]:
        """Queue the request's choices, or raise ApiError (429 when the queue is full, 400 when
        invalid; nothing stays queued then)."""
        with self._lock:
            if self.closing:
                self.metrics.rejected.inc(reason="shutting_down")
                raise ApiError(503, "the server is shutting down", type_="server_error", code="shutting_down")
            depth = self.engine.stats()["queue_depth"]
            requests = call.requests()
            if len(requests) > self.config.max_queue:
                raise ApiError(400, f"the request has {len(requests)} choices (prompts x n); the queue limit "
                                    f"(--max-queue) is {self.config.max_queue}", param="n")
            if depth + len(requests) > self.config.max_queue:
                self.metrics.rejected.inc(reason="queue_full")
                raise ApiError(429, f"{depth} requests are waiting, the queue limit (--max-queue) is "
                                    f"{self.config.max_queue}; retry later", type_="rate_limit_error",
                               code="queue_full", headers={"Retry-After": str(self.config.retry_after_s)})
            handles: list[Handle] = []
            try:
                for i, request in enumerate(requests):
                    if i % call.n:  # choices 1..n-1 of a prompt reuse its choice 0's prefill (torch backend)
                        request.shares_prompt_with = handles[i - i % call.n]
                    handles.append(self.engine.submit(request))
            except RequestError as e:
                for h in handles:
                    self.engine.abort(h)
                raise request_error(e, "messages" if call.endpoint == "chat" else "prompt", call.body) from None
            self.active.update(handles)
        return handles

    def parse_and_submit(self, body: CompletionRequest | ChatRequest, endpoint: str) -> tuple[Call, list[Handle]]:
        call = self.parse(body, endpoint)
        return call, self.submit(call)

    def finish(self, handle: Handle, then: Callable[[], None] | None = None) -> None:
        """Abort the request if it is still running (the client went away), then call `then`
        (the request's metrics: counted once its blocks are free and its finish reason set).
        The abort runs on the abort thread: the event loop never waits for the engine lock."""
        handle.listener = None
        with self._lock:
            self.active.discard(handle)
        if handle.seq.finished:
            if then is not None:
                then()
            return

        def abort() -> None:
            self.engine.abort(handle)
            if then is not None:
                then()

        log.info("request %s aborted: the client went away", handle.request_id)
        try:
            self._aborter.submit(abort)
        except RuntimeError:  # shut down (the server is stopping): abort here
            abort()

    def health(self) -> tuple[int, dict[str, Any]]:
        engine = self.engine
        load = engine.stats()  # kv_blocks_* are null where the backend does not report them
        info: dict[str, Any] = {
            "status": "shutting_down" if self.closing else "ok", "model": self.model_name,
            "backend": getattr(engine, "backend_name", "torch"),
            "queue_depth": load["queue_depth"], "running": load["running"],
            "kv_blocks_used": load["kv_blocks_used"], "kv_blocks_total": load["kv_blocks_total"],
            "max_batch_size": engine.max_batch_size, "max_queue": self.config.max_queue}
        if load.get("step_parts") is not None:  # where the served steps' time goes (engine/stepparts.py)
            info["step_parts"] = load["step_parts"]
        if load.get("auto_switch"):  # auto's batch-wide switch by batch size (speculation/goodput.py)
            info["auto_switch"] = load["auto_switch"]
        if load.get("row_price"):  # what a decode row costs by batch size; draft nodes the batch kept
            info["row_price"] = load["row_price"]
        if load.get("threads"):  # the kernels' threading: the governor's choice and state, the pool's counters
            info["threads"] = load["threads"]
        if load.get("prefix_cache"):  # reuse across requests (model/kv_cache.py): hit rate, blocks recorded
            info["prefix_cache"] = load["prefix_cache"]
        settings = getattr(engine, "drafter_settings", None)  # the drafters' settings (their Options)
        if settings is not None and settings():
            info["drafter_settings"] = settings()
        for check in self.health_checks:
            extra = check()
            if extra.get("status") == "degraded" and info["status"] == "ok":
                info["status"] = "degraded"
            info.update({k: v for k, v in extra.items() if k != "status"})
        return (503 if self.closing else 200), info

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": self.created,
                                            "owned_by": "specbuild", "root": self.model_names[-1],
                                            "max_model_len": self.engine.max_seq_len} for name in self.model_names]}

    # ---- generation --------------------------------------------------------------------------
    async def generate(self, request: HttpRequest, body: CompletionRequest | ChatRequest, endpoint: str) -> Response:
        try:
            call, handles = await run_in_threadpool(self.parse_and_submit, body, endpoint)
        except ApiError as e:
            if 400 <= e.status < 500 and e.status != 429:
                self.metrics.rejected.inc(reason="invalid")
            log.info("%s request rejected (%d): %s", endpoint, e.status, e.message)
            raise
        events = Events(self, call, handles, request.receive)
        if call.stream:
            return SSEResponse(self, call, events)
        try:
            async for _ in events:
                pass
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; uvicorn drops it
        finally:
            events.close()
        for h in handles:
            if h.seq.finish_reason == "error":
                raise engine_error(h)
            if h.seq.finish_reason == "abort":
                raise ApiError(503, "the request was aborted (server shutting down)", type_="server_error",
                               code="aborted")
        tok = self.engine.tokenizer
        if call.scoring_only:  # max_tokens 0 with echo: the prompts and their logprobs
            choices = [choice(call, call.prompt_of(i).echo, None, "length", True, index=i,
                              logprobs=echo_logprobs(call, tok, h.seq)) for i, h in enumerate(handles)]
            return JSONResponse(envelope(call, self.model_name, choices, False,
                                         usage=scoring_usage(call, [h.seq for h in handles])), headers=call.headers())
        choices = []
        for i, h in enumerate(handles):
            prompt = call.prompt_of(i)
            if call.tools is not None:
                choices.append(call.tools.final_choice(call, h.seq, i, shape_logprobs(
                    call, tok, h.seq.output_ids, h.seq.scoring.logprobs, h.seq.text)))
                continue
            choices.append(choice(call, (prompt.echo or "") + output_text(call, tok, h.seq), h.seq.output_ids,
                                  h.seq.finish_reason, True,
                                  index=i, logprobs=join_logprobs(echo_logprobs(call, tok, h.seq), shape_logprobs(
                                      call, tok, h.seq.output_ids, h.seq.scoring.logprobs, h.seq.text,
                                      prompt.echo))))
        return JSONResponse(envelope(call, self.model_name, choices, False, usage=usage(call, [h.seq for h in handles])),
                            headers=call.headers())

    def make_app(self) -> FastAPI:
        from specbuild import __version__

        app = FastAPI(title="specbuild", version=__version__, docs_url=None, redoc_url=None,
                      description="OpenAI-compatible completions and chat over a speculation bundle "
                                  "(lossless speculative decoding).")

        @app.exception_handler(ApiError)
        async def api_error(request, exc: ApiError):
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def invalid(request, exc: RequestValidationError):
            self.metrics.rejected.inc(reason="invalid")
            error = validation_error(exc)
            log.info("%s rejected (%d): %s", request.url.path, error.status, error.message)
            return error.response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request, exc: StarletteHTTPException):
            if exc.status_code == 404:
                e = ApiError(404, f"no route {request.url.path!r}", code="not_found")
            elif exc.status_code == 405:
                e = ApiError(405, f"{request.url.path} does not take {request.method}", code="method_not_allowed")
            else:
                e = ApiError(exc.status_code, str(exc.detail), code=None)
            return e.response()

        @app.exception_handler(Exception)
        async def bug(request, exc: Exception):  # a bug answers 500 with the usual shape, never a bare reset
            log.error("request to %s failed", request.url.path, exc_info=exc)
            return ApiError(500, "internal error (see the server log)", type_="server_error").response()

        @app.post("/v1/completions", tags=["openai"])
        async def completions(body: CompletionRequest, request: HttpRequest):
            return await self.generate(request, body, "completions")

        @app.post("/v1/chat/completions", tags=["openai"])
        async def chat_completions(body: ChatRequest, request: HttpRequest):
            return await self.generate(request, body, "chat")

        @app.get("/v1/models", tags=["openai"])
        async def models():
            return self.models()

        @app.get("/v1/models/{model_id:path}", tags=["openai"])
        async def model(model_id: str):
            found = [m for m in self.models()["data"] if m["id"] == model_id]
            if not found:
                raise ApiError(404, f"model {model_id[:LIMIT_NAME_CHARS]!r} is not served here", param="model",
                               code="model_not_found")
            return found[0]

        from specbuild.serve.openai_tokenize import add_tokenizer_routes

        add_tokenizer_routes(app, self, sys.modules[__name__])  # /tokenize, /detokenize, /tokenizer_info (vLLM's)

        @app.get("/health", tags=["specbuild"])
        async def health():  # on the event loop: lock-free reads, never behind the worker pool
            status, info = self.health()
            return JSONResponse(info, status)

        @app.get("/metrics", tags=["specbuild"])
        async def metrics():
            text = await run_in_threadpool(self.metrics.render)
            return Response(text.encode(), media_type=CONTENT_TYPE)

        return RequestLimit(BodyGuard(app, self.config), self.config.max_inflight,  # type: ignore[return-value]
                            self.config.retry_after_s)


def quiet_uvicorn() -> None:
    """uvicorn's own log under this server's name, its lifecycle lines (INFO) only at debug:
    `specbuild serve` prints what it always printed (a line named "uvicorn.error" would read
    as an error to anyone grepping the log)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _Rename) for f in logger.filters):
        logger.addFilter(_Rename())
    logger.setLevel(logging.DEBUG if logging.getLogger().isEnabledFor(logging.DEBUG) else logging.WARNING)


class _Rename(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.name = "specbuild.http"
        return True


class Events:
    """A request's engine events as an async iterator. The engine thread wakes it through
    `Handle.listener`; a watcher on the connection's `receive` wakes it when the client goes
    away (then ClientGone is raised and the request aborted, KV blocks freed)."""

    def __init__(self, server: OpenAIServer, call: Call, handles: list[Handle], receive) -> None:
        self.server, self.call, self.handles = server, call, handles
        self.ready = asyncio.Event()
        self.gone = False
        self.recorded: set[int] = set()  # seq_ids of the handles counted (from the loop or the abort thread)
        loop = asyncio.get_running_loop()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(self.ready.set)
            except RuntimeError:  # the loop is closed (shutting down)
                pass

        for handle in handles:
            handle.listener = wake
        self.watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                self.ready.set()
                return

    def record(self, handle: Handle | None = None) -> None:
        """Metrics for each finished choice, once; before its last bytes go out, so that a
        client that reads /metrics after its response sees its request counted."""
        for h in [handle] if handle is not None else self.handles:
            if h.seq.seq_id not in self.recorded:
                self.recorded.add(h.seq.seq_id)
                self.server.metrics.observe_request(self.call.endpoint, h.seq.finish_reason, h.seq)

    def __aiter__(self):
        return self._events()

    async def _events(self):
        """(choice index, event) in arrival order per choice, until every choice has finished."""
        done: set[int] = set()
        while True:
            self.ready.clear()
            for i, handle in enumerate(self.handles):
                while i not in done:
                    event = handle.get_nowait()
                    if event is None:
                        break
                    if event.finished:
                        self.record(handle)
                        done.add(i)
                    yield i, event
            if len(done) == len(self.handles):
                return
            if self.gone:
                raise ClientGone()
            await self.ready.wait()

    def close(self) -> None:
        self.watcher.cancel()
        for handle in self.handles:
            self.server.finish(handle, then=lambda h=handle: self.record(h))


class SSEResponse(Response):
    """Server-sent events for one streaming request (uvicorn chunks the body)."""

    media_type = "text/event-stream"

    def __init__(self, server: OpenAIServer, call: Call, events: Events) -> None:
        super().__init__(status_code=200)
        # set by hand: Starlette would append "; charset=utf-8" to a text/* type
        self.raw_headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")] + [(k.encode(), v.encode()) for k, v in call.headers().items()]
        self.server, self.call, self.events = server, call, events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (ClientGone, OSError):  # uvicorn raises OSError (ClientDisconnected) on a closed socket
            pass
        except Exception:
            log.exception("request %s failed while streaming", self.call.id)
        finally:
            self.events.close()

    async def chunks(self):
        call, model, handles = self.call, self.server.model_name, self.events.handles
        tok = self.server.engine.tokenizer
        counts = [0] * len(handles)
        parsers = [call.tools.stream_parser() for _ in handles] if call.tools is not None else None

        def so_far(i: int) -> dict[str, Any]:  # vLLM's continuous_usage_stats: usage so far on every chunk
            if not call.continuous_usage:
                return {}
            prompt = len(handles[i].seq.prompt_ids)
            return {"usage": {"prompt_tokens": prompt, "completion_tokens": counts[i],
                              "total_tokens": prompt + counts[i]}}

        for i in range(len(handles)):
            if call.endpoint == "chat":
                first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield sse(envelope(call, model, [first], True, **so_far(i)))
            elif call.prompt_of(i).echo is not None and not call.echo_scores:
                yield sse(envelope(call, model, [choice(call, call.prompt_of(i).echo, None, None, False, index=i)], True,
                                   **so_far(i)))
        unechoed = set(range(len(handles))) if call.echo_scores else set()
        detoks = [IncrementalDetokenizer(tok, skip_special_tokens=False) for _ in handles] if call.special_text else None
        async for i, event in self.events:
            counts[i] += len(event.token_ids)
            if detoks is not None:  # skip_special_tokens false: this choice's text with its special tokens
                event = dataclasses.replace(event, text=special_piece(detoks[i], handles[i].seq, event))
            if i in unechoed:  # its prefill is done (an event came): the prompt's logprobs are known
                unechoed.discard(i)
                yield sse(envelope(call, model, [choice(call, call.prompt_of(i).echo, None, None, False, index=i,
                                                        logprobs=echo_logprobs(call, tok, handles[i].seq))], True,
                                   **so_far(i)))
            # a token whose text is still incomplete (part of a character) still has its ids and logprobs
            if event.text or (event.token_ids and (call.return_token_ids or call.logprobs)):
                lp = shape_logprobs(call, tok, event.token_ids, event.logprobs or [], event.text,
                                    call.prompt_of(i).echo)
                if parsers is None:
                    yield sse(envelope(call, model, [choice(call, event.text, event.token_ids, None, False, index=i,
                                                            logprobs=lp)], True, **so_far(i)))
                else:
                    deltas = parsers[i].push(event.text) or ([{}] if lp or call.return_token_ids else [])
                    for k, delta in enumerate(deltas):
                        out = {"index": i, "delta": delta, "logprobs": lp if k == 0 else None, "finish_reason": None}
                        if call.return_token_ids and k == 0:
                            out["token_ids"] = list(event.token_ids)
                        yield sse(envelope(call, model, [out], True, **so_far(i)))
            if event.finished and event.finish_reason == "error":
                yield sse(engine_error(handles[i]).body())
            elif event.finished:
                reason = event.finish_reason
                if parsers is not None:
                    for delta in parsers[i].finish():
                        yield sse(envelope(call, model, [{"index": i, "delta": delta, "logprobs": None,
                                                          "finish_reason": None}], True, **so_far(i)))
                    reason = call.tools.finish_reason(reason, parsers[i].calls)
                yield sse(envelope(call, model, [choice(call, None, [] if call.return_token_ids else None,
                                                        reason, False, index=i)], True, **so_far(i)))
        if call.include_usage:  # OpenAI's: once, at the end, with no choices
            yield sse(envelope(call, model, [], True, usage=usage(call, [h.seq for h in handles])))
        yield b"data: [DONE]\n\n"


def output_text(call: Call, tokenizer, seq) -> str:
    """A finished choice's text: the engine's (special tokens skipped), or with
    skip_special_tokens false the output decoded with them, less the end-of-sequence or stop
    token that ended it (as vLLM: the stop token is not text)."""
    if not call.special_text:
        return seq.text
    ids = list(seq.output_ids)
    if seq.finish_reason == "stop" and ids and ids[-1] in seq.ending.eos_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def special_piece(detok, seq, event) -> str:
    """The text of one streamed event with skip_special_tokens false (output_text's, piece by piece)."""
    ids = list(event.token_ids)
    if event.finished and event.finish_reason == "stop" and ids and ids[-1] in seq.ending.eos_ids:
        ids = ids[:-1]
    text = detok.push(ids)
    return text + detok.flush() if event.finished else text


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class BodyGuard:
    """ASGI middleware in front of the app: a POST needs a Content-Length (or chunked
    encoding) of at most max_body_bytes (411/413 before any byte is read), and its body must
    arrive within body_timeout_s (408): a client that sends half a body holds its own
    connection only. Counted while reading, so chunked bodies are bounded too."""

    def __init__(self, app: FastAPI, config: ServeConfig) -> None:
        self.app, self.config = app, config

    def __getattr__(self, name: str) -> Any:  # .openapi(), .routes ... of the wrapped FastAPI app
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        limit = self.config.max_body_bytes
        if length is None and not chunked:
            return await self.reject(send, ApiError(411, "a Content-Length header is required", code="length_required"))
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await self.reject(send, ApiError(413, f"the body is {length.decode(errors='replace')[:20]} bytes; "
                                                         f"the limit is {limit}", code="body_too_large"))
        received, complete = 0, False
        deadline = time.monotonic() + self.config.body_timeout_s

        async def guarded() -> dict:
            nonlocal received, complete
            if complete:
                return await receive()  # the body is in; this waits for the disconnect
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {self.config.body_timeout_s:g}s "
                                    f"({received} bytes came)", code="body_timeout") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise ApiError(413, f"the body is over {limit} bytes, the limit", code="body_too_large")
                complete = not message.get("more_body", False)
            return message

        # the body is JSON whatever Content-Type says (curl -d sends a form type), as before
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                 + [(b"content-type", b"application/json")]}
        await self.app(scope, guarded, send)

    @staticmethod
    async def reject(send, error: ApiError) -> None:
        data = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": data})


def usage(call: Call, seqs: list) -> dict[str, Any]:
    """OpenAI's usage for one request's choices: each prompt counted once (and its cached
    tokens: prompt_tokens_details.cached_tokens), completions summed;
    specbuild's drafted/accepted summed, mean accepted tokens over all their passes."""
    stats = [s.stats() for s in seqs]
    prompt = sum(st["prompt_tokens"] for st in stats[::call.n])
    completion = sum(st["generated_tokens"] for st in stats)
    passes = sum(s.tally.verify_passes for s in seqs)
    accepted = sum(st["accepted"] for st in stats)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           # OpenAI's: prompt tokens whose K/V came from the prefix cache (each prompt's first choice)
           "prompt_tokens_details": {"cached_tokens": sum(st.get("cached_tokens", 0) for st in stats[::call.n])},
           "drafted_tokens": sum(st["drafted"] for st in stats), "accepted_tokens": accepted,
           "mean_accepted_tokens": round((accepted + passes) / passes, 4) if passes else 1.0,
           "seed": stats[0]["seed"]}
    if len(seqs) > 1:
        out["seeds"] = [st["seed"] for st in stats]
    return out


def scoring_usage(call: Call, seqs: list) -> dict[str, Any]:
    """Usage of a scoring-only request: each prompt counted once, nothing generated."""
    prompt = sum(len(s.prompt_ids) for s in seqs[::call.n])
    return {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}


def echo_logprobs(call: Call, tokenizer, seq) -> dict[str, Any] | None:
    """The echoed prompt's part of a completions logprobs object (the first token's is null),
    from the choice's sequence: its prompt ids and the logprobs its prefill computed."""
    if not call.echo_scores:
        return None
    ids, items = seq.prompt_ids, seq.scoring.prompt_logprobs

    def piece(i: int) -> str:
        return tokenizer.decode([i], skip_special_tokens=False)

    offsets, at = [], 0
    for t in ids:
        offsets.append(at)
        at += len(piece(t))
    return {"tokens": [piece(t) for t in ids],
            "token_logprobs": [None] + [-9999.0 if lp == float("-inf") else lp for lp, _ in items],
            "top_logprobs": [None] + [{piece(j): (-9999.0 if v == float("-inf") else v) for j, v in top}
                                      for _, top in items], "text_offset": offsets}


def join_logprobs(head: dict[str, Any] | None, tail: dict[str, Any] | None) -> dict[str, Any] | None:
    """A completions logprobs object for echo + answer: the lists concatenated."""
    if head is None or tail is None:
        return tail if head is None else head
    return {k: head[k] + tail[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def shape_logprobs(call: Call, tokenizer, token_ids: list[int], items: list, text: str,
                   echo: str | None = None) -> dict[str, Any] | None:
    """The engine's (logprob, [(id, logprob)...]) per token in OpenAI's shape: chat
    {"content": [{token, logprob, bytes, top_logprobs}]}; completions {tokens, token_logprobs,
    top_logprobs, text_offset}. A logprob of -inf (a token top-k/top-p excluded) is -9999.0,
    as OpenAI reports such values."""
    if call.logprobs is None:
        return None

    def piece(i: int) -> str:
        return tokenizer.decode([i], skip_special_tokens=False)

    def num(x: float) -> float:
        return -9999.0 if x == float("-inf") else x

    items = items[:len(token_ids)]
    if call.logprobs == "chat":
        return {"content": [{"token": piece(t), "logprob": num(lp), "bytes": list(piece(t).encode()),
                             "top_logprobs": [{"token": piece(j), "logprob": num(v), "bytes": list(piece(j).encode())}
                                              for j, v in top]} for t, (lp, top) in zip(token_ids, items)]}
    offsets, at = [], len(echo or "")
    for t in token_ids:
        offsets.append(at)
        at += len(piece(t))
    return {"tokens": [piece(t) for t in token_ids], "token_logprobs": [num(lp) for lp, _ in items],
            "top_logprobs": [{piece(j): num(v) for j, v in top} for _, top in items], "text_offset": offsets}


def choice(call: Call, text: str | None, token_ids: list[int] | None, finish_reason: str | None,
           final: bool, index: int = 0, logprobs: dict | None = None) -> dict[str, Any]:
    """One choice: a message (chat, final), a delta (chat, stream) or text (completions)."""
    out: dict[str, Any] = {"index": index}
    if call.endpoint == "chat":
        content = {} if text is None else {"content": text}
        out["message" if final else "delta"] = {"role": "assistant", **content} if final else content
    else:
        out["text"] = text or ""
    if call.return_token_ids and token_ids is not None:
        out["token_ids"] = list(token_ids)
    out["logprobs"] = logprobs
    out["finish_reason"] = finish_reason
    return out


def envelope(call: Call, model: str, choices: list[dict], stream: bool, **extra: Any) -> dict[str, Any]:
    kind = ("chat.completion" if call.endpoint == "chat" else "text_completion") + \
        (".chunk" if stream and call.endpoint == "chat" else "")
    return {"id": call.id, "object": kind, "created": call.created, "model": model, "choices": choices, **extra}
