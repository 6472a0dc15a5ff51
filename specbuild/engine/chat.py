"""Chat messages -> prompt text, through the model's Jinja chat template.

Templates render as transformers' `apply_chat_template(..., tokenize=False)` renders them: a
sandboxed Jinja environment (`ImmutableSandboxedEnvironment`: templates from model files are
untrusted code) with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a
`{% generation %}` block tag (rendered as its body), the globals `raise_exception`,
`strftime_now` and `namespace`, and a `tojson` filter that does not escape HTML. Variables:
`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools=None`, `documents=None`.

A bundle without a template (a base model) gets the fallback format (`render_fallback`): `bos_token`, then one
"Role: content" paragraph per message, then "Assistant:" when `add_generation_prompt`.

The rendered text usually holds the BOS token already (templates write `bos_token`
themselves): tokenize it without adding special tokens again.

Message text is text (`ChatEncoder`, what a server must use): only the template may emit
control tokens. Encoding the rendered prompt as one string would turn a `<|im_end|>` typed
inside a message into the real control token and let a user forge a system turn. So every
control-token string inside a message (content, name) is first escaped to private-use
characters, the template renders, the rendered text is cut at the control strings that are
left (the template's own: each becomes its token id) and the pieces between are unescaped and
encoded with the tokenizer's `encode_special_tokens` on (control strings as plain text). The
tokenizers library itself cuts text at its added tokens before encoding the pieces, so for a
chat whose messages hold no control string the ids are exactly those of encoding the rendered
prompt (tests/engine/test_chat.py checks it on SmolLM2's tokenizer). Special tokens that strip
the whitespace beside them (AddedToken lstrip/rstrip) are not modelled: chat models' control
tokens do not.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specbuild.errors import BundleError, RequestError

MAX_MESSAGES = 100_000  # a sanity bound on the list, not a token limit (that is the engine's)


def render_chat(
    template: str | None,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """The prompt text for `messages` ([{"role": str, "content": str}, ...]).

    `template` is the model's Jinja chat template, or None for the plain fallback format.
    Raises RequestError for malformed messages or ones the template rejects
    (`raise_exception`, e.g. roles that do not alternate); BundleError for a template that
    does not parse.
    """
    validate_messages(messages)
    plain = [dict(m) for m in messages]  # the template sees copies, never the caller's dicts
    if template is None:
        return render_fallback(plain, add_generation_prompt=add_generation_prompt, bos_token=bos_token)
    if not isinstance(template, str):
        raise BundleError(f"chat template must be a string or None, got {type(template).__name__}")
    compiled = compile_template(template)
    try:
        return compiled.render(
            messages=plain,
            add_generation_prompt=bool(add_generation_prompt),
            bos_token=bos_token,
            eos_token=eos_token,
            tools=None,
            documents=None,
        )
    except jinja2.exceptions.SecurityError as e:
        raise BundleError(f"chat template tried an unsafe operation: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise RequestError(f"the chat template rejected the messages: {e}") from None
    except (TypeError, KeyError, ValueError, AttributeError, IndexError) as e:
        raise RequestError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None


def validate_messages(messages: Any) -> None:
    """RequestError unless `messages` is a non-empty list of dicts with string role/content."""
    if not isinstance(messages, list):
        raise RequestError(f"messages must be a list of {{role, content}} objects, got {type(messages).__name__}")
    if not messages:
        raise RequestError("messages is empty: a chat needs at least one message")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"messages holds {len(messages)} entries, more than the limit {MAX_MESSAGES}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object with role and content, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise RequestError(f"messages[{i}] has no {key!r} (keys: {sorted(map(str, message))})")
            if not isinstance(message[key], str):
                raise RequestError(
                    f"messages[{i}][{key!r}] must be a string, got {type(message[key]).__name__}"
                )
        if not message["role"]:
            raise RequestError(f"messages[{i}]['role'] is empty")


def render_fallback(messages: list[dict], *, add_generation_prompt: bool = True, bos_token: str = "") -> str:
    """The format for models without a template: "System: ...\\n\\nUser: ...\\n\\nAssistant:"."""
    parts = [bos_token]
    for message in messages:
        role = message["role"]
        parts.append(f"{role[:1].upper()}{role[1:]}: {message['content']}\n\n")
    if add_generation_prompt:
        parts.append("Assistant:")
    return "".join(parts)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks in
    transformers): here it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (no route to Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """The compiled template (cached: a server renders the same one for every request)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise BundleError(f"chat template does not parse (line {e.lineno}): {e.message}") from None


MARK = "\ue000"  # escape: MARK + chr(ESCAPES + i) stands for ChatEncoder.table[i]
ESCAPES = 0xF0000  # Unicode plane 15, private use: 65,534 code points


class ChatEncoder:
    """Chat messages -> prompt token ids where message text is plain text (module doc).

    `tokenizer` is a `tokenizers.Tokenizer`; its special added tokens are the control strings."""

    def __init__(self, tokenizer) -> None:
        from tokenizers import Tokenizer

        specials = sorted({t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content},
                          key=lambda c: (-len(c), c))  # longest first: a regex alternation then matches as
        self.ids = {c: tokenizer.token_to_id(c) for c in specials}  # the tokenizer does (leftmost-longest)
        self.table = [MARK, *specials][:0xFFFD]
        self.code = {c: MARK + chr(ESCAPES + i) for i, c in enumerate(self.table)}
        self.escapes = re.compile("|".join(re.escape(c) for c in self.table))
        self.controls = re.compile("|".join(re.escape(c) for c in specials)) if specials else None
        self.marks = re.compile(re.escape(MARK) + "(.)", re.S)
        self.text = Tokenizer.from_str(tokenizer.to_str())  # a copy: the engine's parses control strings
        self.text.encode_special_tokens = True

    def escape(self, text: str) -> str:
        return self.escapes.sub(lambda m: self.code[m.group()], text)

    def unescape(self, text: str) -> str:
        def back(m: re.Match) -> str:
            i = ord(m.group(1)) - ESCAPES
            return self.table[i] if 0 <= i < len(self.table) else m.group()

        return self.marks.sub(back, text) if MARK in text else text

    def escape_messages(self, messages: list[dict]) -> list[dict]:
        """Copies of the messages with every control string in their text escaped (role kept)."""
        out = []
        for m in messages:
            out.append({k: (self.escape(v) if k != "role" and isinstance(v, str) else v) for k, v in m.items()})
        return out

    def encode_rendered(self, text: str) -> list[int]:
        """The ids of a prompt rendered from escaped messages: the control strings left are the
        template's (their ids); the text between is unescaped and encoded as plain text."""
        ids: list[int] = []
        at = 0
        for m in self.controls.finditer(text) if self.controls is not None else ():
            if m.start() > at:
                ids += self.text.encode(self.unescape(text[at:m.start()]), add_special_tokens=False).ids
            ids.append(self.ids[m.group()])
            at = m.end()
        if at < len(text):
            ids += self.text.encode(self.unescape(text[at:]), add_special_tokens=False).ids
        return ids
