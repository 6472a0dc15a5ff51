"""Gamma policy per content type, and the cheap rule-based classifier that assigns a type.

A `GammaPolicy` (the design article's gamma_policy row: per model and content type) gives
the depth controller a starting point for a new sequence: its first draft length
(gamma_default), the bounds it may move in (gamma_min, gamma_max), the acceptance prior it
starts from (prior_alpha) and the acceptance below which speculation is switched off for
the sequence after `collapse_steps` steps (alpha_threshold; probes bring it back). A policy
only changes how much is drafted, never which tokens are kept: output stays lossless.

Content types are short lower-case names; the classifier knows code, structured, chat and
summarization (long prompts, documents to condense or answer from: summarisation and RAG),
and operators may name their own (a request's `content_type`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from specbuild.errors import RequestError

CONTENT_TYPES = ("code", "structured", "summarization", "chat")
ANY = "*"  # a policy for every model / content type / method
_NAME = re.compile(r"^[a-z][a-z0-9_.-]{0,31}$")


def check_content_type(value) -> str | None:
    """A request's content_type: None, or a name of at most 32 characters [a-z0-9_.-]."""
    if value is None:
        return None
    if not isinstance(value, str) or not _NAME.match(value):
        shown = value if not isinstance(value, str) else value[:40]
        raise RequestError(f"content_type={shown!r} is not a name of 1 to 32 characters [a-z0-9_.-] starting "
                           f"with a letter (known: {', '.join(CONTENT_TYPES)})")
    return value


def request_content_type(body: dict) -> str | None:
    """The `content_type` field of a request body (HTTP JSON, Triton parameters), checked;
    None when absent. Front ends call this and put the result in Request.content_type."""
    if not isinstance(body, dict):
        return None
    return check_content_type(body.get("content_type"))


# ---- the classifier -----------------------------------------------------------------------------
_CODE_FENCE = re.compile(r"```")
_CODE_TOKENS = re.compile(r"(\bdef |\bclass |\bimport |\breturn\b|#include|\bfunction\b|=>|\bpublic |\bvoid |"
                          r"\bfor \(|;\s*$|\{\s*$|^\s*}|\bSELECT\b|\bconst |\blet |\bfn )", re.M)
_CODE_ASK = re.compile(r"\b(python|javascript|typescript|java|c\+\+|rust|golang|sql|bash|function|code|program|"
                       r"script|implement|compile|regex|algorithm)\b", re.I)
_STRUCT_ASK = re.compile(r"\b(json|yaml|xml|csv|schema|key-value|table)\b", re.I)
_SUMMARY_ASK = re.compile(r"\b(summari[sz]e|summary|tl;?dr|condense|abstract|key points|based on the "
                          r"(following|passage|context|document|text|article)|according to the (passage|context|"
                          r"document|text|article)|context:|document:|passage:)", re.I)
_CHAT_MARKERS = ("<|im_start|>", "[INST]", "<|user|>", "<|start_header_id|>", "\nUser:", "\nAssistant:")

LONG_PROMPT_CHARS = 2400  # ~600 tokens: documents, not questions


def _repeat_share(words: list[str], n: int = 3) -> float:
    """Share of word n-grams that occur more than once (copy-heavy prompts)."""
    grams = [tuple(words[i:i + n]) for i in range(max(len(words) - n + 1, 0))]
    if not grams:
        return 0.0
    seen: dict[tuple, int] = {}
    for g in grams:
        seen[g] = seen.get(g, 0) + 1
    return sum(c for c in seen.values() if c > 1) / len(grams)


def classify_prompt(text: str) -> str:
    """code | structured | summarization | chat, from rules on the prompt text (microseconds
    for ordinary prompts; only the last 8000 characters are read)."""
    text = text[-8000:]
    body = text
    for marker in ("<|im_start|>user", "[INST]", "<|user|>"):
        # a chat-templated prompt: judge the user's turns, not the template
        if marker in body:
            body = "\n".join(part.split("<|im_end|>")[0] for part in body.split(marker)[1:])
            break
    if _CODE_FENCE.search(body) or len(_CODE_TOKENS.findall(body)) >= 2:
        return "code"
    stripped = body.strip()
    if stripped[:1] in "{[" and stripped[-1:] in "}]":
        try:
            json.loads(stripped)
            return "structured"
        except ValueError:
            pass
    if _STRUCT_ASK.search(body) and (stripped.count("{") + stripped.count(":") >= 2 or "json" in body.lower()):
        return "structured"
    if _CODE_ASK.search(body) and re.search(r"\b(write|implement|fix|debug|refactor|code)\b", body, re.I):
        return "code"
    words = body.split()
    if _SUMMARY_ASK.search(body) or len(body) >= LONG_PROMPT_CHARS or (len(words) >= 120 and _repeat_share(words) > 0.2):
        return "summarization"
    return "chat"


# ---- policies -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GammaPolicy:
    """One gamma_policy row. model_id / content_type / method: a name or ANY ("*")."""

    model_id: str = ANY
    content_type: str = ANY
    method: str = ANY
    gamma_min: int = 0
    gamma_max: int = 8
    gamma_default: int = 4
    alpha_threshold: float = 0.3
    prior_alpha: float = 0.6
    collapse_steps: int = 10
    source: str = "set"  # set (by an operator) | learned (policy learn)
    n_steps: int = 0  # recorded steps the learned values came from

    def __post_init__(self) -> None:
        if not 0 <= self.gamma_min <= self.gamma_default <= self.gamma_max <= 16:
            raise ValueError(f"policy needs 0 <= gamma_min ({self.gamma_min}) <= gamma_default "
                             f"({self.gamma_default}) <= gamma_max ({self.gamma_max}) <= 16")
        for name in ("alpha_threshold", "prior_alpha"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name}={v} is out of range [0, 1]")
        if not 1 <= self.collapse_steps <= 1000:
            raise ValueError(f"collapse_steps={self.collapse_steps} is out of range [1, 1000]")

    def bounds(self, lo: int, hi: int) -> tuple[int, int]:
        """The request's bounds [lo, hi] narrowed to the policy's (the request's when disjoint)."""
        a, b = max(lo, self.gamma_min), min(hi, self.gamma_max)
        return (a, b) if a <= b else (lo, hi)

    def start(self, lo: int, hi: int) -> int:
        a, b = self.bounds(lo, hi)
        return min(max(self.gamma_default, a), b)


class PolicyTable:
    """Policies of one model, looked up by (content type, method); the most specific wins:
    (type, method), (type, *), (*, method), (*, *). None when nothing matches."""

    def __init__(self, policies: list[GammaPolicy], model_id: str = ANY) -> None:
        self.model_id = model_id
        self._by_key: dict[tuple[str, str], GammaPolicy] = {}
        # a model's own rows override the rows for every model
        for p in sorted(policies, key=lambda p: p.model_id != ANY):
            if p.model_id in (ANY, model_id):
                self._by_key[(p.content_type, p.method)] = p

    def __len__(self) -> int:
        return len(self._by_key)

    def lookup(self, content_type: str | None, method: str | None) -> GammaPolicy | None:
        ct, m = content_type or ANY, method or ANY
        for key in ((ct, m), (ct, ANY), (ANY, m), (ANY, ANY)):
            if key in self._by_key:
                return self._by_key[key]
        return None
