"""Structured output: a grammar that masks the target's (and every drafter's) next-token
distribution, state by state, and rolls back with the KV cache when drafts are rejected.

What a request may ask for (`ResponseFormat`): OpenAI's `response_format` `{"type":
"json_object"}` and `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`,
and specbuild's extensions `{"type": "regex", "regex": ...}` and `{"type": "grammar",
"grammar": ...}` (a Lark grammar, as llguidance reads it). Every text a client sends is
bounded (`MAX_SPEC_CHARS`), and compiled grammars are cached per bundle (`GrammarBackend`).

The engine is llguidance, chosen by measurement and by a correctness check
(`python scripts/bench_grammar.py BUNDLE`; AMD EPYC, 2 cores shared with other work,
SmolLM2's 49,152-token vocabulary, a three-field JSON schema, the 32 tokens of one answer,
median of 5, the tokenizer set up once beforehand): llguidance compiled the grammar in 0.8 ms
and filled a mask in 0.009 ms per token (max 0.14 ms); xgrammar 0.2.9 in 14 ms and 0.003 ms
(max 0.025 ms). Both cost well under 0.1% of a 30 ms decode step. What decided it: xgrammar
0.2.9 turns a string with `maxLength`/`minLength` into a character class that admits raw
control characters, so the tiny test model wrote NUL bytes into a JSON string and the output
did not parse (the task set's own validator, bench/structured.py, caught it; the script's
probe shows it); llguidance refuses them. llguidance also reads the bundle's tokenizer.json as
it is and needs no other package (xgrammar pulls in transformers and triton), rolls back N
tokens (rejected drafts) and names the tokens a grammar forces (free drafts). outlines-core
was not measured: it builds a regex index over the whole vocabulary per schema and has no
rollback.

Lossless under speculation means the constraint is applied to the logits before
`warp_probs`, identically at every position, whether the position is decoded plainly or
verified inside a draft: `Constraint.masks_for_paths` gives the mask after each draft path
(a chain's prefixes, a tree's node paths) and leaves the matcher where it was; the caller then
`advance`s by the tokens actually accepted.

Bounded at admission: the grammar engine works within its parser limits (llguidance's
defaults: 50,000 Earley items and 200,000 units of lexer fuel per step, 500,000 grammar
symbols). A grammar is compiled and taken one step at submission (`GrammarBackend.probe`:
the first mask, the forced tokens, the first allowed token consumed), so one that exceeds a
limit at once, or whose language is empty (no text matches it), is refused there with a
RequestError naming `response_format` (HTTP 400). One that hits a limit later, mid-request,
raises the same error from that request's step (`GrammarLimitError`), and the engine fails
that request alone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specbuild.errors import RequestError

KINDS = ("json_object", "json_schema", "regex", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused
# JSON whitespace between tokens: at most 8 characters a run, so a model cannot loop on spaces forever
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,8}"


@dataclass(frozen=True)
class ResponseFormat:
    """What the output must match. `spec` is the schema (JSON text), regex or grammar."""

    kind: str
    spec: str = ""
    name: str = ""
    # tool calls (serve/tools.py): the (open, close) tags of one call; a call that repeats an
    # earlier one of the same output ends the output there (`CallsConstraint`). Set only by the
    # server, never from a client's response_format.
    calls: tuple[str, str] | None = None

    @classmethod
    def parse(cls, value: Any) -> "ResponseFormat | None":
        """From an OpenAI-style `response_format` object (or None / {"type": "text"} for none)."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise RequestError(f"response_format must be an object, got {type(value).__name__}")
        kind = value.get("type")
        if kind in (None, "text"):
            return None
        if kind not in KINDS:
            raise RequestError(f"response_format.type={kind!r} is not one of {['text', *KINDS]}")
        if kind == "json_object":
            return cls("json_object")
        if kind == "json_schema":
            body = value.get("json_schema")
            if not isinstance(body, dict) or not isinstance(body.get("schema"), dict):
                raise RequestError("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                                   "\"schema\": {...}}}")
            spec = json.dumps(body["schema"])  # key order kept: it is the order properties must appear in
            return cls._checked("json_schema", spec, str(body.get("name") or "")[:64])
        text = value.get(kind)
        if not isinstance(text, str) or not text:
            raise RequestError(f"response_format type {kind!r} needs a non-empty string field {kind!r}")
        return cls._checked(kind, text)

    @classmethod
    def _checked(cls, kind: str, spec: str, name: str = "") -> "ResponseFormat":
        if len(spec) > MAX_SPEC_CHARS:
            raise RequestError(f"response_format {kind} is {len(spec)} characters; at most {MAX_SPEC_CHARS} "
                               "are allowed")
        return cls(kind, spec, name)


# llguidance 0.7.x (what TensorRT-LLM 1.2.1 pins: specbuild/data/trtllm_pins.json) takes WHITESPACE but
# does not keep runs of it apart: measured with 0.7.29, the tiny test model wrote "{" and then newlines until
# max_tokens (tests/engine/test_structured.py). There JSON takes json.dumps' fixed layout instead (no free
# whitespace at all), which ends as the bounded pattern does; 1.x keeps the bounded pattern.
FIXED_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
BOUNDED_WHITESPACE_FROM = (1, 0)


def llguidance_release() -> tuple[int, ...] | None:
    """The installed llguidance's release ((1, 9, 1)), or None where its metadata cannot be read."""
    import re
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version("llguidance"))
    except PackageNotFoundError:
        return None
    return tuple(int(g) for g in found.groups() if g is not None) if found else None


def json_options(release: tuple[int, ...] | None) -> dict[str, Any]:
    """The JSON compiler's overrides for llguidance `release` (None: unknown, taken as current)."""
    if release is not None and release[:2] < BOUNDED_WHITESPACE_FROM:
        return dict(FIXED_LAYOUT)
    return {"whitespace_pattern": WHITESPACE}


def make_tokenizer(llguidance, tokenizer_json: str, vocab_size: int, stop_token_ids: list[int]):
    """llguidance's tokenizer with the bundle's stop tokens as the grammar's end.

    llguidance 1.x takes a list of EOS ids; the 0.7 line takes one (`LLTokenizer(..., eos_token:
    Optional[TokenId])` in its `_lib.pyi`, 0.7.29 being what TensorRT-LLM 1.2.1 pins, see
    specbuild/data/trtllm_pins.json). There the first stop token ends a finished grammar: a
    subset of the stop tokens, so output stops where it would on 1.x; only a model that would
    have ended with another stop token ends with the first one instead."""
    if len(stop_token_ids) > 1:
        try:
            return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=stop_token_ids)
        except TypeError:  # the 0.7 line: one EOS id
            pass
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                  eos_token=stop_token_ids[0] if stop_token_ids else None)


class GrammarBackend:
    """One per bundle: the tokenizer as the grammar engine sees it, and compiled grammars."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        try:
            import llguidance
        except ImportError as e:
            raise RequestError("structured output needs the grammar engine llguidance (a dependency of specbuild: "
                               f"pip install llguidance); import failed: {e}") from None
        self._ll = llguidance
        self.tokenizer = make_tokenizer(llguidance, tokenizer_json, vocab_size, list(stop_token_ids))
        self.vocab_size = vocab_size
        self._template = functools.lru_cache(maxsize=64)(self._compile)

    def grammar_text(self, fmt: ResponseFormat) -> str:
        M = self._ll.LLMatcher
        options = json_options(llguidance_release())
        try:
            if fmt.kind == "json_object":
                return M.grammar_from_json_schema({"type": "object"}, overrides=options)
            if fmt.kind == "json_schema":
                return M.grammar_from_json_schema(fmt.spec, overrides=options)
            if fmt.kind == "regex":
                return M.grammar_from_regex(fmt.spec)
            return M.grammar_from_lark(fmt.spec)
        except (ValueError, RuntimeError) as e:
            raise RequestError(f"response_format {fmt.kind} is not valid: {str(e).splitlines()[0][:300]}") from None

    def _compile(self, fmt: ResponseFormat):
        matcher = self._ll.LLMatcher(self.tokenizer, self.grammar_text(fmt), log_level=0)
        if matcher.is_error():
            raise RequestError(f"response_format {fmt.kind} does not compile: {first_line(matcher.get_error())}")
        self.probe(fmt, matcher)
        return matcher

    def probe(self, fmt: ResponseFormat, matcher) -> None:
        """Take the grammar's first step on a copy of `matcher`: the first mask, the forced
        tokens and the first allowed token. Raises RequestError naming response_format when
        the grammar engine gives up there (a parser limit) or no text matches the grammar
        (the language is empty: the engine stops with an error at once)."""
        c = Constraint(self, matcher.deep_copy(), fmt.kind)
        allowed = c.allowed(check=False)
        if c.matcher.is_error():
            why = first_line(c.matcher.get_error())
            if why.startswith("NoExtension") or not bool(allowed.any()):
                raise RequestError(f"response_format {fmt.kind} matches no text (its language is empty): "
                                   "nothing could be generated under it")
            raise RequestError(f"response_format {fmt.kind} exceeds the grammar engine's limits at the first "
                               f"token: {why}")
        c.forced(1 << 20, check=False)
        first = [int(t) for t in allowed.nonzero().flatten()[:1]]
        if first and not c.matcher.is_stopped():
            c.matcher.consume_token(first[0])
        if c.matcher.is_error():
            raise RequestError(f"response_format {fmt.kind} exceeds the grammar engine's limits at the first "
                               f"token: {first_line(c.matcher.get_error())}")

    def constraint(self, fmt: ResponseFormat) -> "Constraint":
        matcher = self._template(dataclasses.replace(fmt, calls=None)).deep_copy()
        if fmt.calls is not None:
            return CallsConstraint(self, matcher, fmt.kind, fmt.calls)
        return Constraint(self, matcher, fmt.kind)


def first_line(text: str, limit: int = 300) -> str:
    return (str(text).splitlines() or [""])[0][:limit]


class GrammarLimitError(RequestError):
    """A request's grammar stopped the grammar engine mid-request (a parser limit): that
    request's error, answered 400 naming response_format."""


class Constraint:
    """One sequence's grammar state. Not thread-safe; owned by the sequence's step loop."""

    def __init__(self, backend: GrammarBackend, matcher, kind: str = "grammar") -> None:
        from llguidance.numpy import fill_next_token_bitmask

        self._fill_raw = fill_next_token_bitmask
        self.kind = kind
        self.vocab_size = backend.vocab_size
        self.matcher = matcher
        self._words = (self.vocab_size + 31) // 32
        self.mask_seconds = 0.0  # time spent computing masks (and forced tokens) for this sequence
        self.masks = 0  # rows masked

    # ---- errors ---------------------------------------------------------------------------
    def check(self) -> None:
        """Raise GrammarLimitError when the grammar engine has stopped on this grammar (it
        then allows only the stop token, which would end the request silently)."""
        if self.matcher.is_error():
            raise GrammarLimitError(f"response_format {self.kind}: the grammar engine stopped on this grammar: "
                                    f"{first_line(self.matcher.get_error())}")

    def _fill(self, matcher, bits: np.ndarray, row: int) -> None:
        self._fill_raw(matcher, bits, row)
        self.check()

    # ---- one position -------------------------------------------------------------------
    def bitmask(self, rows: int = 1) -> np.ndarray:
        return np.zeros((rows, self._words), dtype=np.int32)

    def allowed(self, check: bool = True) -> torch.Tensor:
        """bool [vocab]: the tokens the grammar allows next."""
        bits = self.bitmask()
        (self._fill if check else self._fill_raw)(self.matcher, bits, 0)
        return unpack(bits, self.vocab_size)[0]

    def advance(self, token: int) -> None:
        """Accept one emitted token (it was sampled under the mask, so the grammar takes it)."""
        if not self.matcher.consume_token(int(token)):
            self.check()  # the grammar engine gave up (a limit): the request's error
            raise RuntimeError(f"token {token} is not allowed by the grammar here: the mask was not applied "
                               f"({first_line(self.matcher.get_error())})")

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    @property
    def finished(self) -> bool:
        """The grammar is complete and took its stop token: nothing more may be generated.
        Raises GrammarLimitError when the grammar engine stopped on an error instead."""
        self.check()
        return self.matcher.is_stopped()

    # ---- along a draft -------------------------------------------------------------------
    def _take(self, path: list[int]) -> int:
        """Consume as many of `path` as the grammar allows; how many."""
        return self.matcher.try_consume_tokens([int(t) for t in path]) if path else 0

    def masks_along(self, draft: list[int]) -> tuple[torch.Tensor, int]:
        """(allowed [k+1, vocab] bool, valid): the mask at each position of `draft` (row 0 is the
        next position; row i the position after draft[:i]) for the `valid` draft tokens the
        grammar allows in a row; rows past `valid` are all False. The matcher ends where it
        started."""
        self.check()
        bits = self.bitmask(len(draft) + 1)
        self._fill(self.matcher, bits, 0)
        valid = 0
        for i, t in enumerate(draft):
            if self.matcher.is_stopped() or self._take([t]) != 1:
                break
            valid = i + 1
            self._fill(self.matcher, bits, i + 1)
        self.rollback(valid)
        allowed = unpack(bits, self.vocab_size)
        allowed[valid + 1:] = False
        return allowed, valid

    def masks_for_paths(self, paths: list[list[int]]) -> torch.Tensor:
        """allowed [len(paths), vocab]: row i is the mask after the tokens of paths[i] (a draft
        tree's node paths; a chain's prefixes). A path the grammar refuses is unreachable in
        verification (its refused token has probability 0 there), so its row is left
        unconstrained (all True) rather than all False, which would make its logits all -inf.
        The matcher ends where it started."""
        self.check()
        t0 = time.perf_counter()
        bits = self.bitmask(len(paths))
        reachable = [True] * len(paths)
        for i, path in enumerate(paths):
            n = self._take(path)
            if n == len(path) and not self.matcher.is_stopped():
                self._fill(self.matcher, bits, i)
            else:
                reachable[i] = False
            self.rollback(n)
        self.check()  # a draft path that stopped the grammar engine stops it for the request
        allowed = unpack(bits, self.vocab_size)
        for i, ok in enumerate(reachable):
            if not ok:
                allowed[i] = True
        self.mask_seconds += time.perf_counter() - t0
        self.masks += len(paths)
        return allowed

    def forced(self, limit: int, check: bool = True) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (a free draft: the target still
        verifies them, so a forced tokenization the model would not pick is only rejected)."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        t0 = time.perf_counter()
        out = [int(t) for t in self.matcher.compute_ff_tokens()[:limit]]
        self.mask_seconds += time.perf_counter() - t0
        if check:
            self.check()
        return out


class CallsConstraint(Constraint):
    """A tool-call grammar's constraint that also ends the output when a call repeats: once the
    closing tag of a call whose text equals an earlier call's (same name, same arguments, in the
    grammar's fixed layout) is consumed, `finished` is true, so the sequence stops there with
    finish reason "stop" and the repeat is dropped by the parser (serve/tools.py). A small model
    under `tool_choice: required` otherwise writes its one call again and again until max_tokens
    cuts the last one in half.

    Lossless: `finished` depends only on the tokens emitted (`advance`), so plain decoding and
    speculation stop at the same token (a verify pass whose accepted run crosses that token is
    cut there by the sequence, as by a stop string)."""

    def __init__(self, backend: GrammarBackend, matcher, kind: str, tags: tuple[str, str]) -> None:
        super().__init__(backend, matcher, kind)
        self._decode = backend.tokenizer.decode_bytes
        self._open, self._close = tags[0].encode(), tags[1].encode()
        self._text = bytearray()  # the output so far (bytes), from the last call's close on
        self._seen: set[bytes] = set()  # the bodies of the calls completed so far
        self.repeated = False

    def advance(self, token: int) -> None:
        super().advance(token)
        self._text += self._decode([int(token)])
        if not self._text.endswith(self._close):
            return
        start = self._text.rfind(self._open)
        body = bytes(self._text[start + len(self._open):len(self._text) - len(self._close)]).strip()
        self._text.clear()
        if start < 0:  # a closing tag in free text (tool_choice auto), not a call
            return
        self.repeated = body in self._seen
        self._seen.add(body)

    @property
    def finished(self) -> bool:
        return super().finished or self.repeated


def unpack(bits: np.ndarray, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [rows, words] (bit j of word w = token 32w + j) -> bool [rows, vocab]."""
    flat = np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(flat.astype(bool))


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens get -inf (then `warp_probs` gives them probability 0)."""
    return logits.masked_fill(~allowed, float("-inf"))
