"""The field policy of the OpenAI-compatible front end: what happens to each field a body holds.

Client libraries written for OpenAI, vLLM and SGLang send more than this server implements,
so the policy is vLLM's, made explicit:

- **implemented**: OpenAI's fields and specbuild's extensions (openai_http's request models),
  and the vLLM extras that map onto what the engine does: `min_tokens`, `repetition_penalty`, `stop_token_ids`,
  `chat_template_kwargs`, `add_generation_prompt`, `stream_options.continuous_usage_stats`,
  `skip_special_tokens` (false: the text keeps special tokens, the ending stop token excepted),
  and `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (mapped to a
  `response_format`, `guided_response_format`).
- **accepted, no effect by definition** (`NOOP`): OpenAI fields about storage, billing,
  routing or the caller (`store`, `metadata`, `user`, `service_tier`, ...), and vLLM's
  `spaces_between_special_tokens`, which only its slow (Python) tokenizers' detokenizer reads:
  the bundle's tokenizer is a `tokenizers` one, whose decoder joins special tokens as the
  tokenizer defines.
- **accepted at their neutral value only** (`NEUTRAL`): vLLM extras that would change the
  output but are not implemented here (`min_p`, `length_penalty`, beam search, ...); any
  other value is a 400 naming the field and the value served, never silently ignored.
- **unknown**: dropped before validation, logged, and listed in the response header
  `x-specbuild-ignored-fields`; `specbuild serve --strict-fields` refuses them with 400 instead
  (`ServeConfig.strict_fields`). Only their names are kept (at most `MAX_LISTED`, each cut to
  `MAX_NAME_CHARS`): the body limit bounds the rest.

Written by hand: pydantic's `extra="ignore"` drops unknown fields without saying which, and
the header and the strict mode need their names.
"""

from __future__ import annotations

import json
import re
from typing import Any

from specbuild.errors import RequestError

IGNORED_KEY = "specbuild_ignored_fields"  # where the pre-validator leaves the unknown names
HEADER = "x-specbuild-ignored-fields"
MAX_LISTED = 32
MAX_NAME_CHARS = 64
MAX_CHOICES = 256  # guided_choice entries
MAX_CHOICE_CHARS = 1024
MAX_TEMPLATE_KWARGS_CHARS = 16 * 1024  # chat_template_kwargs, as JSON
MAX_STOP_TOKEN_IDS = 64

# OpenAI fields that change nothing this server computes (storage, billing, routing, the caller)
NOOP = ("store", "metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key",
        "reasoning_effort", "verbosity", "guided_decoding_backend", "request_id", "spaces_between_special_tokens")

# vLLM/OpenAI fields whose neutral value is the only one served: (value, what other values would need)
NEUTRAL: dict[str, Any] = {
    "suffix": "",
    "min_p": 0.0,
    "length_penalty": 1.0,
    "use_beam_search": False,
    "include_stop_str_in_output": False,
    "continue_final_message": False,
    "echo": False,  # on chat (completions' echo is implemented)
    "prompt_logprobs": None,
    "truncate_prompt_tokens": None,
    "guided_whitespace_pattern": None,
    "priority": 0,
}


def split_unknown(data: Any, known: set[str]) -> Any:
    """A pydantic before-validator's work: `data` without the fields the model does not know,
    their names under IGNORED_KEY (a client's own IGNORED_KEY counts as unknown)."""
    if not isinstance(data, dict):
        return data
    unknown = [k for k in data if k not in known or k == IGNORED_KEY]
    if not unknown:
        return data
    kept = {k: v for k, v in data.items() if k in known and k != IGNORED_KEY}
    kept[IGNORED_KEY] = [str(k)[:MAX_NAME_CHARS] for k in unknown[:MAX_LISTED]] + \
        ([f"...{len(unknown) - MAX_LISTED} more"] if len(unknown) > MAX_LISTED else [])
    return kept


def header_value(names: list[str]) -> str:
    """The header's value: names joined by commas, characters a header may not hold replaced."""
    return ",".join(re.sub(r"[^\x21-\x7e]", "?", n).replace(",", "?") for n in names)


def neutral_violation(body: Any, implemented: tuple[str, ...] = ()) -> tuple[str, Any, Any] | None:
    """(field, value, neutral) for the first NEUTRAL field set to another value, else None
    (`implemented`: names this endpoint serves in full, e.g. completions' echo)."""
    for name, neutral in NEUTRAL.items():
        if name in implemented or name not in type(body).model_fields:
            continue
        value = getattr(body, name, None)
        if value is None:
            continue
        if value != neutral:
            return name, value, neutral
    return None


def guided_response_format(body: Any) -> dict[str, Any] | None:
    """vLLM's guided_json / guided_regex / guided_choice / guided_grammar as a response_format
    (at most one of them, and not beside response_format). Raises RequestError naming the field."""
    given = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
             if getattr(body, name, None) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise RequestError(f"{given[0]}: only one of {given} may be given")
    if getattr(body, "response_format", None) is not None:
        raise RequestError(f"{given[0]}: give either {given[0]} or response_format, not both")
    name = given[0]
    value = getattr(body, name)
    if name == "guided_json":
        schema = json.loads(value) if isinstance(value, str) else value
        if not isinstance(schema, dict):
            raise RequestError(f"guided_json must be a JSON schema object, got {type(schema).__name__}")
        return {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": schema}}
    if name == "guided_regex":
        return {"type": "regex", "regex": value}
    if name == "guided_grammar":
        return {"type": "grammar", "grammar": lark_grammar(value)}
    if not value:
        raise RequestError("guided_choice is empty: give at least one choice")
    return {"type": "grammar", "grammar": "start: " + " | ".join(json.dumps(c) for c in value)}


def lark_grammar(text: str) -> str:
    """vLLM's guided_grammar is EBNF in llama.cpp's GBNF (`root ::= ...`) or Lark; the grammar
    engine reads Lark, and converts GBNF with llguidance's own converter."""
    if "::=" not in text:
        return text
    try:
        from llguidance.gbnf_to_lark import gbnf_to_lark
    except ImportError as e:  # pragma: no cover - llguidance is a core dependency
        raise RequestError(f"guided_grammar in GBNF needs llguidance: {e}") from None
    try:
        return gbnf_to_lark(text)
    except Exception as e:  # the converter raises plain exceptions on bad input
        raise RequestError(f"guided_grammar is not valid GBNF: {str(e).splitlines()[0][:300]}") from None


def template_kwargs(value: dict[str, Any] | None, reserved: tuple[str, ...]) -> dict[str, Any]:
    """chat_template_kwargs, bounded, never overriding the variables the renderer sets."""
    if not value:
        return {}
    size = len(json.dumps(value))
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise RequestError(f"chat_template_kwargs is {size} characters as JSON; at most "
                           f"{MAX_TEMPLATE_KWARGS_CHARS} are allowed")
    clash = [k for k in value if k in reserved or k.startswith("_")]
    if clash:
        raise RequestError(f"chat_template_kwargs may not set {clash[0]!r} (reserved: {list(reserved)})")
    return dict(value)
