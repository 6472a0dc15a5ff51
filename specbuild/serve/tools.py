"""Tool calling for the chat endpoint: the request's tools into the prompt, the model's calls
out of the text, and the grammar that makes `required` and named choices exact.

Format. Tools render through the chat template (`tools` is a template variable, as in HF
templates). A template that never mentions tools (SmolLM2's, or a bundle without one) is
replaced, for requests with tools or tool turns, by `BUILTIN_TEMPLATE`: ChatML with the tool
block of Hermes-2-Pro / SmolLM2's function-calling data (the function signatures as JSON lines
inside <tools></tools> in the system turn; calls as `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`; results as a `tool` turn inside <tool_response></tool_response>).
`specbuild serve --chat-template FILE` replaces the bundle's template (vLLM's option) and
`--tool-call-parser` names how calls are read back (`PARSERS`: hermes, the <tool_call> JSON
form Hermes, Qwen2.5 and SmolLM2 write).

Choices. `none`: no tools in the prompt, no parsing. `required` / a named function: the
output is constrained by a Lark grammar for llguidance (`call_grammar`): one call (or up to
`MAX_PARALLEL` with parallel_tool_calls) whose JSON matches `{"name": const, "arguments":
<the function's parameters schema>}`. The constraint runs in the engine's one logits path
(sampling/processing.py), so it stays lossless under speculation, and the tokens it forces
(`<tool_call>`, the name, the key names) are free drafts. `auto`: free text in which every
`<tool_call>` that starts must be a valid call (a lazy trigger lexeme, llguidance's
tool-calling form), so nothing is forced until the model itself opens a call.

Ending. A call identical to an earlier one of the same answer ends the answer at its closing
tag and is dropped (`sampling.constraint.CallsConstraint`, in the engine's step, so plain and
speculative decoding stop at the same token): small models otherwise repeat their call until
max_tokens cuts the last one. Under required / named the answer is calls only: what a
max_tokens cut leaves of an unfinished call is neither content nor a call (finish reason
"length"); under auto it stays text.

Written by hand: the template text, the grammar and the <tool_call> parser are a few dozen
lines each over jinja2 and llguidance; the libraries that do this (vLLM's tool parsers,
transformers' templates) pull in whole serving stacks.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from specbuild.engine.chat import TEMPLATE_VARIABLES, render_chat
from specbuild.errors import RequestError
from specbuild.sampling.constraint import MAX_SPEC_CHARS, ResponseFormat

MAX_PARALLEL = 8  # calls in one answer with parallel_tool_calls

BUILTIN_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == "system" %}{{ messages[0].content }}

{% endif %}
You are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags. \
You may call one or more functions to assist with the user query. Don't make assumptions about what values to plug \
into functions. Here are the available tools:
<tools>
{% for tool in tools %}
{{ tool.function | tojson }}
{% endfor %}
</tools>
For each function call, return a json object with the function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% set first = 1 if messages[0].role == "system" else 0 %}
{%- else %}
{% set first = 0 %}
{%- endif %}
{% for message in messages[first:] %}
{% if message.role == "assistant" %}
<|im_start|>assistant
{% if message.content %}{{ message.content }}{% if message.tool_calls %}{{ "\\n" }}{% endif %}{% endif %}
{% for call in message.tool_calls or [] %}
{% if not loop.first %}{{ "\\n" }}{% endif %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}
<|im_end|>
{% elif message.role == "tool" or message.role == "function" %}
<|im_start|>tool
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""


# ---- parsing calls out of text -------------------------------------------------------------------
class HermesParser:
    """`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, any number of them."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    PATTERN = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
    # a call's body up to its arguments (the grammar's layout: name first), the name complete
    HEAD = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_.\-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*')

    @classmethod
    def parse_call(cls, body: str, names: set[str]) -> dict[str, Any] | None:
        """{"name", "arguments" (JSON text)} of one call's body, or None if it is not one. The
        arguments are the model's own text of the object (what streaming sends piece by piece),
        re-serialized only when the body is not in the name-first layout."""
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in names:
            return None
        args = value.get("arguments", value.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        head = cls.HEAD.match(body)
        if head is not None and head.group(1) == value["name"]:
            try:
                parsed, end = json.JSONDecoder().raw_decode(body, head.end())
                if parsed == args:
                    return {"name": value["name"], "arguments": body[head.end():end]}
            except ValueError:
                pass
        return {"name": value["name"], "arguments": json.dumps(args, ensure_ascii=False)}

    @classmethod
    def parse(cls, text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
        """(content: the text outside the calls, None when only calls; calls). A call that
        repeats an earlier one (same name and arguments) is dropped: it is where a tool grammar
        ends the output (sampling.constraint.CallsConstraint)."""
        calls, kept, at = [], [], 0
        for m in cls.PATTERN.finditer(text):
            call = cls.parse_call(m.group(1), names)
            if call is None:
                continue
            kept.append(text[at:m.start()])
            at = m.end()
            if call not in calls:
                calls.append(call)
        kept.append(text[at:])
        content = "".join(kept)
        if calls:
            content = content.strip()
        return (content or None) if calls else text, calls


PARSERS = {"hermes": HermesParser}


class StreamParser:
    """Text deltas in, chat deltas out, in the shape the openai client accumulates: content
    until a call may start (text that could be the start of "<tool_call>" is held back); then
    each call as it is generated: a first delta with its index, id, type and name (arguments
    "") once the name is complete, then the arguments' text piece by piece (OpenAI's
    streaming). What is held back inside a call: from its last "}" on (the end of the
    arguments is only known at the closing tag), and all of a call while its text is the start
    of an earlier call's (a repeat, which ends the answer and is dropped, is never sent)."""

    def __init__(self, use: "ToolUse") -> None:
        self.use = use
        self.parser = PARSERS[use.parser]
        self.buffer = ""
        self.calls: list[dict[str, Any]] = []  # complete calls
        self.bodies: list[str] = []  # their bodies' text, to hold back a repeat
        self.started = 0  # calls whose first delta was sent (complete, or the one being streamed)
        self.open_sent: str | None = None  # the open call's arguments text sent so far (None: not started)
        self.after_call = False  # newlines right after a call separate calls: not content

    def push(self, text: str) -> list[dict[str, Any]]:
        self.buffer += text
        if self.after_call:
            self.buffer = self.buffer.lstrip("\n")
            self.after_call = not self.buffer
        out: list[dict[str, Any]] = []
        open_, close = self.parser.OPEN, self.parser.CLOSE
        while self.buffer:
            start = self.buffer.find(open_)
            if start < 0:
                keep = held_prefix(self.buffer, open_)
                if len(self.buffer) > keep:
                    out.append({"content": self.buffer[:len(self.buffer) - keep]})
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            if start > 0:
                out.append({"content": self.buffer[:start]})
                self.buffer = self.buffer[start:]
            end = self.buffer.find(close)
            if end < 0:  # inside a call: its arguments so far
                out += self._partial(self.buffer[len(open_):].lstrip())
                break
            body = self.buffer[len(open_):end].strip()
            call = self.parser.parse_call(body, self.use.names)
            out += self._complete(call, body, self.buffer[:end + len(close)])
            self.buffer = self.buffer[end + len(close):]
            if call is not None:
                self.buffer = self.buffer.lstrip("\n")
                self.after_call = not self.buffer
        return [d for d in out if d.get("content") != ""]

    def _partial(self, body: str) -> list[dict[str, Any]]:
        head = self.parser.HEAD.match(body)
        if head is None or head.group(1) not in self.use.names:
            return []
        out = []
        if self.open_sent is None:
            probe = body[:len(body) - held_prefix(body, self.parser.CLOSE)].rstrip()
            if any(b.startswith(probe) for b in self.bodies):
                return []  # may be a repeat: held until it differs or closes
            out.append(self.use.call_delta({"name": head.group(1), "arguments": ""}, self.started))
            self.started += 1
            self.open_sent = ""
        args = body[head.end():]
        last = args.rfind("}")
        safe = (args[:last] if last >= 0 else args).rstrip()
        if len(safe) > len(self.open_sent) and safe.startswith(self.open_sent):
            out.append(self.use.arguments_delta(safe[len(self.open_sent):], self.started - 1))
            self.open_sent = safe
        return out

    def _complete(self, call: dict[str, Any] | None, body: str, text: str) -> list[dict[str, Any]]:
        sent, self.open_sent = self.open_sent, None
        if call is None:  # not a call (outside any grammar): text, unless it was announced as a call
            return [{"content": text}] if sent is None else []
        if call in self.calls:  # a repeated call ends the output and is dropped (as `parse`)
            return []
        self.calls.append(call)
        self.bodies.append(body)
        if sent is None:
            self.started += 1
            return [self.use.call_delta(call, self.started - 1)]
        rest = call["arguments"][len(sent):] if call["arguments"].startswith(sent) else ""
        return [self.use.arguments_delta(rest, self.started - 1)] if rest else []

    def finish(self) -> list[dict[str, Any]]:
        """What is held back, as content (an unfinished call stays text), except under a
        required or named choice, whose output is calls only, and for a call already being
        streamed: what is left there is a call max_tokens cut (finish reason "length"); its
        deltas so far were sent, as OpenAI's stream does, and the rest is dropped."""
        rest, self.buffer = self.buffer, ""
        if self.calls or self.use.calls_only:
            rest = rest.strip()
        if self.use.calls_only or self.open_sent is not None:
            return []
        return [{"content": rest}] if rest else []


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# ---- the request's tool use -------------------------------------------------------------------------
@dataclass
class ToolUse:
    """The tools a chat request offers and how it wants them used."""

    tools: list[dict[str, Any]]  # OpenAI tool objects, {"type": "function", "function": {...}}
    choice: str  # auto | required | the function's name
    parallel: bool = True
    legacy: bool = False  # functions/function_call: answer with message.function_call
    parser: str = "hermes"
    response_format: ResponseFormat | None = None  # the grammar of the calls (CallsConstraint)
    names: set[str] = field(default_factory=set)

    @property
    def calls_only(self) -> bool:
        """required or a named function: the grammar allows calls and nothing else."""
        return self.choice != "auto"

    def call_delta(self, call: dict[str, Any], index: int) -> dict[str, Any]:
        """A call's first streamed delta (with all of its arguments, or "" to stream them)."""
        if self.legacy:
            return {"function_call": {"name": call["name"], "arguments": call["arguments"]}}
        return {"tool_calls": [{"index": index, "id": call_id(), "type": "function",
                                "function": {"name": call["name"], "arguments": call["arguments"]}}]}

    def arguments_delta(self, text: str, index: int) -> dict[str, Any]:
        """More of call `index`'s arguments text (the openai client appends it)."""
        if self.legacy:
            return {"function_call": {"arguments": text}}
        return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}

    def finish_reason(self, reason: str | None, calls: list) -> str | None:
        if calls and reason == "stop":
            return "function_call" if self.legacy else "tool_calls"
        return reason

    def stream_parser(self) -> StreamParser:
        return StreamParser(self)

    def final_choice(self, call, seq, index: int, logprobs: dict | None) -> dict[str, Any]:
        """The finished choice: content outside the calls (null when only calls), tool_calls."""
        content, calls = PARSERS[self.parser].parse(seq.text, self.names)
        if not self.parallel:
            calls = calls[:1]
        if self.calls_only:  # any text left is a call max_tokens cut (finish reason "length"): dropped
            content = None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls and self.legacy:
            message["function_call"] = calls[0]
        elif calls:
            message["tool_calls"] = [{"id": call_id(), "type": "function", "function": c} for c in calls]
        out: dict[str, Any] = {"index": index, "message": message}
        if call.return_token_ids:
            out["token_ids"] = list(seq.output_ids)
        out["logprobs"] = logprobs
        out["finish_reason"] = self.finish_reason(seq.finish_reason, calls)
        return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_use(body: Any, response_format: Any, parser: str = "hermes") -> ToolUse | None:
    """The ToolUse of a ChatRequest, or None (no tools, or tool_choice none). Raises
    RequestError naming the field."""
    legacy = body.functions is not None or body.function_call is not None
    if legacy and (body.tools is not None or body.tool_choice is not None):
        raise RequestError("functions: give either tools/tool_choice or the legacy functions/function_call, "
                           "not both")
    if legacy:
        tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in body.functions or []]
        given = body.function_call
        choice = given.name if given is not None and not isinstance(given, str) else given
    else:
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        given = body.tool_choice
        choice = given.function.name if given is not None and not isinstance(given, str) else given
    names = [t["function"]["name"] for t in tools]
    field_name = "function_call" if legacy else "tool_choice"
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise RequestError(f"{'functions' if legacy else 'tools'}: the function name {dup!r} is given twice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise RequestError(f"{field_name}={choice!r} needs {'functions' if legacy else 'tools'} (none were given)")
    if choice not in ("auto", "required") and choice not in names:
        raise RequestError(f"{field_name} names the function {choice!r}, which is not among the tools {names}")
    if response_format is not None:
        raise RequestError(f"{field_name}={choice!r} with response_format: the output is either tool calls or the "
                           "format; give tool_choice none to use response_format")
    parallel = body.parallel_tool_calls is not False and not legacy
    use = ToolUse(tools, choice, parallel=parallel, legacy=legacy, parser=parser, names=set(names))
    grammar = call_grammar(tools, choice, parallel)
    if len(grammar) > MAX_SPEC_CHARS:
        raise RequestError(f"tools: the grammar of these tools is {len(grammar)} characters; at most "
                           f"{MAX_SPEC_CHARS} (fewer or smaller parameter schemas)")
    use.response_format = ResponseFormat("grammar", grammar, calls=(PARSERS[parser].OPEN, PARSERS[parser].CLOSE))
    return use


def call_schema(tools: list[dict[str, Any]], only: str | None = None) -> dict[str, Any]:
    """JSON schema of one call {"name": ..., "arguments": ...} to any of `tools` (or `only`)."""
    options = []
    for tool in tools:
        fn = tool["function"]
        if only is not None and fn["name"] != only:
            continue
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    # json.dumps' layout, fixed: the format the prompt shows, and every separator a forced token
    return {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


def call_grammar(tools: list[dict[str, Any]], choice: str, parallel: bool) -> str:
    """Lark (llguidance) for `choice`: required / named: calls only; auto: text in which any
    <tool_call> must be a valid call (a lazy trigger: free text until the model opens one)."""
    one = json.dumps(call_schema(tools, None if choice in ("auto", "required") else choice))
    body = f'"\\n" %json {one} "\\n</tool_call>"'
    if choice == "auto":
        return ('%llguidance {}\n'
                'start: call* TEXT\n'
                'trigger[lazy]: TEXT "<tool_call>"\n'
                f'call: trigger {body}\n'
                'TEXT: /(.|\\n)*/\n')
    more = f' ("\\n" call){{0,{MAX_PARALLEL - 1}}}' if parallel and choice == "required" else ""
    return f'start: call{more}\ncall: "<tool_call>" {body}\n'


# ---- rendering ------------------------------------------------------------------------------------
def encode_prompt(engine, messages: list[dict[str, Any]], use: ToolUse | None, template_override: str | None,
                  body: Any) -> list[int]:
    """The prompt ids of a chat request: rendered by the bundle's template (or --chat-template's),
    or by the built-in tool template when the request has tools or tool turns and that template
    never mentions tools. As `BaseEngine.encode_chat`: every string the client sent (message
    text, tool-call arguments, tool descriptions) is escaped before rendering, so a control-token
    string in it stays text; only the template's own control strings become control tokens."""
    from specbuild.engine.chat import ChatEncoder, validate_messages
    from specbuild.serve.openai_fields import template_kwargs

    sp = engine.meta.special_tokens
    template = template_override if template_override is not None else sp.get("chat_template")
    tool_turns = any(m.get("tool_calls") or m["role"] in ("tool", "function") for m in messages)
    if (use is not None or tool_turns) and (template is None or "tool" not in template):
        template = BUILTIN_TEMPLATE
    vocab_size = engine.tokenizer.get_vocab_size()

    def tok(i):
        return engine.tokenizer.id_to_token(i) if isinstance(i, int) and 0 <= i < vocab_size else ""

    encoder = engine.__dict__.get("_chat_encoder")
    if encoder is None:  # the one BaseEngine.encode_chat caches
        encoder = engine._chat_encoder = ChatEncoder(engine.tokenizer)
    validate_messages(messages)
    extra = template_kwargs(getattr(body, "chat_template_kwargs", None), TEMPLATE_VARIABLES)
    add = getattr(body, "add_generation_prompt", None)
    text = render_chat(template, escaped(encoder, messages), add_generation_prompt=add is not False,
                       bos_token=tok(sp.get("bos_token_id")) or "", eos_token=tok(sp.get("eos_token_id")) or "",
                       tools=escaped(encoder, use.tools) if use is not None else None, extra=escaped(encoder, extra))
    ids = encoder.encode_rendered(text)
    bos = sp.get("bos_token_id")
    if getattr(body, "add_special_tokens", None) and bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids  # vLLM's add_special_tokens on chat: a BOS the template did not write
    return ids


def escaped(encoder, value: Any, key: str | None = None) -> Any:
    """`value` with every string in it escaped (ChatEncoder.escape), roles kept."""
    if isinstance(value, str):
        return value if key == "role" else encoder.escape(value)
    if isinstance(value, dict):
        return {k: escaped(encoder, v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [escaped(encoder, v) for v in value]
    return value
