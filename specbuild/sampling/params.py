"""Sampling settings and the one function that turns logits into probabilities.

Plain decoding and speculative verification both call `warp_probs` with the request's
`SamplingParams`, so the target distribution that rejection sampling preserves is exactly
the one plain decoding samples from.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specbuild.errors import NumericsError, RequestError


# Temperatures below this are greedy (vLLM's _SAMPLING_EPS is the same 1e-5): logits / T
# overflows float32 near T = 1e-37 (a 40-unit logit is 4e38), which made every probability
# NaN, and a temperature this small already puts all the mass on the argmax up to rounding
TEMPERATURE_FLOOR = 1e-5
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_STOP_STRINGS = 16  # per request (HTTP, Triton, CLI)
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature 0 means greedy (argmax); so does any temperature below TEMPERATURE_FLOOR
    (1e-5), which is stored as 0. top_k 0 and top_p 1.0 disable those filters; top_k and
    top_p always keep at least one token (the most likely).
    seed None means: draw one at submission and report it, so any output can be redone.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default=())
    # OpenAI's adjustments, applied to the logits by `adjust_logits` before warping, in the one
    # place plain decoding, drafting and verification all go through
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    # vLLM's min_tokens: `min_tokens_ids` (the end-of-sequence and stop token ids) get -inf
    # until that many tokens are generated; applied by `adjust_logits` like the penalties
    min_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = field(default=())
    # vLLM's repetition_penalty: every token of the prompt (`repetition_ids`: its distinct ids,
    # which the front end fills in) or of the output so far has its logit divided by the
    # penalty when positive, multiplied when negative; applied by `adjust_logits`
    repetition_penalty: float = 1.0
    repetition_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature={self.temperature!r} is out of range [0, 100]")
        if self.temperature < TEMPERATURE_FLOOR:  # greedy: see TEMPERATURE_FLOOR
            object.__setattr__(self, "temperature", 0.0)
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= 1 << 20:
            raise RequestError(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p={self.top_p!r} is out of range (0, 1]")
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= 1 << 20:
            raise RequestError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 63):
            raise RequestError(f"seed={self.seed!r} must be an integer in [0, 2**63)")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop string {s!r} must be a non-empty string")
            if len(s) > MAX_STOP_CHARS:  # each is searched for in every new piece of text
                raise RequestError(f"stop string {s[:20]!r}... is {len(s)} characters; at most {MAX_STOP_CHARS}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"{len(self.stop)} stop strings given; at most {MAX_STOP_STRINGS} are allowed")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise RequestError(f"{name}={v!r} is out of range [-2, 2]")
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(bias.items())
        try:
            bias = tuple(sorted((int(k), float(v)) for k, v in bias))
        except (TypeError, ValueError):
            raise RequestError("logit_bias must map token ids to numbers, e.g. {\"50256\": -100}") from None
        if len(bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        for k, v in bias:
            if k < 0 or not -100.0 <= v <= 100.0:
                raise RequestError(f"logit_bias {{{k}: {v}}}: ids must be >= 0 and biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= 1 << 20:
            raise RequestError(f"min_tokens={self.min_tokens!r} must be an integer in [0, {1 << 20}]")
        if self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens={self.min_tokens} is more than max_tokens={self.max_tokens}")
        object.__setattr__(self, "min_tokens_ids", tuple(int(t) for t in self.min_tokens_ids))
        v = self.repetition_penalty
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 100.0:
            raise RequestError(f"repetition_penalty={v!r} is out of range (0, 100] (1 disables it)")
        object.__setattr__(self, "repetition_penalty", float(v))
        object.__setattr__(self, "repetition_ids", tuple(sorted({int(t) for t in self.repetition_ids})))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts(self) -> bool:
        """Whether `adjust_logits` changes anything (penalties or biases set)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or (self.min_tokens and self.min_tokens_ids) or self.repetition_penalty != 1.0)

    def with_seed(self) -> "SamplingParams":
        """Return a copy whose seed is set (drawn from the OS when missing)."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=secrets.randbits(62))

    @classmethod
    def from_dict(cls, data: dict[str, Any], defaults: "SamplingParams | None" = None) -> "SamplingParams":
        """Build from a JSON-ish dict; unknown keys raise, missing keys take `defaults`."""
        base = defaults or cls()
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise RequestError(f"unknown sampling field(s) {sorted(unknown)}; known: {sorted(known)}")
        return dataclasses.replace(base, **{k: v for k, v in data.items() if v is not None})


def adjust_logits(logits: torch.Tensor, params: SamplingParams, history: list[int],
                  row_prefixes: list[list[int]] | None = None) -> torch.Tensor:
    """logit_bias, vLLM's repetition penalty (over the prompt's tokens, `repetition_ids`, and
    the generated ones), then presence and frequency penalties (OpenAI's definitions: over the
    tokens generated so far, not the prompt) for each row of `logits` [rows, vocab]: vLLM's
    order (logits processors, then repetition, frequency, presence).

    `history` is the sequence's generated tokens; row i of a verify pass sits after the draft's
    first i tokens, so `row_prefixes[i]` (default: none) is counted too: a position scores the
    same whether it is decoded plainly or verified inside a draft. min_tokens (vLLM's) masks
    `min_tokens_ids` in every row that sits before the min_tokens-th generated token. Returns a
    new float tensor; the input when nothing is set."""
    if not params.adjusts:
        return logits
    rows, vocab = logits.shape
    out = logits.float().clone()
    if params.min_tokens and params.min_tokens_ids:
        ends = torch.tensor([t for t in params.min_tokens_ids if 0 <= t < vocab], dtype=torch.long)
        for i in range(rows):
            if len(history) + len(row_prefixes[i] if row_prefixes else ()) < params.min_tokens:
                out[i, ends] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([k for k, _ in params.logit_bias if k < vocab], dtype=torch.long)
        vals = torch.tensor([v for k, v in params.logit_bias if k < vocab], dtype=torch.float32)
        out[:, ids] += vals
    prefixes = row_prefixes or [[] for _ in range(rows)]
    if params.repetition_penalty != 1.0:
        penalty = params.repetition_penalty
        seen = torch.zeros(vocab, dtype=torch.bool)
        ids = [t for t in (*params.repetition_ids, *history) if 0 <= t < vocab]
        if ids:
            seen[torch.tensor(ids, dtype=torch.long)] = True
        for i in range(rows):
            mask = seen
            if prefixes[i]:
                mask = seen.clone()
                mask[torch.tensor(prefixes[i], dtype=torch.long)] = True
            row = out[i]
            out[i] = torch.where(mask, torch.where(row > 0, row / penalty, row * penalty), row)
    if params.presence_penalty or params.frequency_penalty:
        base = torch.bincount(torch.tensor(history, dtype=torch.long), minlength=vocab)[:vocab].float() \
            if history else torch.zeros(vocab)
        for i in range(rows):
            counts = base
            if prefixes[i]:
                counts = base + torch.bincount(torch.tensor(prefixes[i], dtype=torch.long), minlength=vocab)[:vocab]
            out[i] -= counts * params.frequency_penalty + (counts > 0).float() * params.presence_penalty
    return out


def token_logprobs(logits: torch.Tensor, params: SamplingParams, tokens: list[int],
                   top_n: int = 0) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row of `logits` [rows, vocab] (already `adjust_logits`ed and constrained), the
    log-probability of `tokens[i]` and the `top_n` most likely tokens, under the distribution the
    request samples from: temperature (1 for greedy requests), then top-k and top-p; a token
    those filters exclude has -inf (vLLM's processed logprobs)."""
    if params.greedy:
        params = dataclasses.replace(params, temperature=1.0)
    probs = warp_probs(logits, params)
    logp = torch.log(probs)
    out = []
    for i, t in enumerate(tokens):
        top: list[tuple[int, float]] = []
        if top_n > 0:
            vals, ids = torch.topk(logp[i], min(top_n, logp.shape[-1]))
            top = [(int(j), float(v)) for j, v in zip(ids, vals)]
        out.append((float(logp[i, t]), top))
    return out


def argmax_ids(x: torch.Tensor) -> list[int]:
    """`x.argmax(-1)` as a flat list of ints: the first maximum on ties, as torch's. On CPU
    float32/float64 through numpy's vectorised argmax: torch's CPU argmax over a row is not
    vectorised (one 49,152-entry row: 126 us against numpy's 9 on a 2-core Xeon, 2026-12-06),
    and every greedy step takes one per verify row. Callers reject NaN first (check_logits)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() >= 1:
        return np.argmax(x.detach().contiguous().numpy(), axis=-1).reshape(-1).tolist()
    return x.argmax(-1).reshape(-1).tolist()


def checked_argmax(row: torch.Tensor, what: str = "logits") -> int:
    """The greedy token of one row [vocab], checked as check_logits checks it, in one pass: the
    argmax propagates NaN (numpy's and torch's both return a NaN's index), so the row is usable
    exactly when the entry it picks is finite (no NaN, no +inf, not every entry -inf); otherwise
    check_logits raises with the reason. A greedy step checked its row with a max, then took its
    argmax: two passes over 49,152 entries per sequence per step, ~50 us each (AMD EPYC)."""
    ids, ok = argmax_rows(row.reshape(1, -1))
    tok = ids[0]
    if not ok[0]:
        check_logits(row, what)
        raise NumericsError(f"{what}: the greedy token's logit is not finite")  # not reached: check_logits raised
    return tok


def argmax_rows(x: torch.Tensor) -> tuple[list[int], list[bool]]:
    """For every row of x [rows, vocab]: its argmax (the first maximum, as torch's) and whether
    the row is usable as check_logits judges it, in one pass over the rows: the argmax
    propagates NaN, so a row is usable exactly when the entry it picks is finite (no NaN, no
    +inf, not every entry -inf). The step takes this once for the whole group's logit rows
    instead of a check and an argmax per sequence (two passes of ~50 us per row on an AMD
    EPYC, 2026-12-06)."""
    if x.shape[0] == 0:
        return [], []
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        a = x.detach().contiguous().numpy()
        ids = np.argmax(a, axis=-1)
        ok = np.isfinite(a[np.arange(a.shape[0]), ids])
        return ids.tolist(), ok.tolist()
    ids_t = x.argmax(-1)
    ok_t = torch.isfinite(x.gather(-1, ids_t.unsqueeze(-1)).squeeze(-1))
    return ids_t.tolist(), ok_t.tolist()


def check_logits(logits: torch.Tensor, what: str = "logits") -> None:
    """Raise NumericsError unless every row of `logits` [..., vocab] is usable: no NaN, no
    +inf, and at least one entry above -inf (-inf alone marks a token as impossible). One
    reduction (amax propagates NaN), so it costs a fraction of the softmax it guards."""
    if logits.numel() == 0:
        return
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and logits.dim() >= 1:
        # numpy's max propagates NaN as amax does, and costs a third of torch's amax + isfinite on
        # one 49,152-entry row (every step checks its rows)
        if np.isfinite(np.max(logits.detach().contiguous().numpy(), axis=-1)).all():
            return
    else:
        top = logits.detach().amax(-1)
        if bool(torch.isfinite(top).all()):
            return
    top = logits.detach().amax(-1)
    flat = logits.detach().reshape(-1, logits.shape[-1])
    row = int((~torch.isfinite(top.reshape(-1))).nonzero()[0, 0])
    r = flat[row]
    why = "NaN" if bool(torch.isnan(r).any()) else "+inf" if bool(torch.isposinf(r).any()) \
        else "no finite entry (every token -inf)"
    raise NumericsError(f"{what} row {row} of {flat.shape[0]} holds {why}: no token can be chosen from it")


def check_probs(probs: torch.Tensor, what: str = "probabilities") -> None:
    """Raise NumericsError unless every row of `probs` [..., vocab] is a usable distribution
    up to scale: finite, non-negative, with positive mass."""
    if probs.numel() == 0:
        return
    p = probs.detach()
    total, low = p.sum(-1), p.amin(-1)
    ok = torch.isfinite(total) & (total > 0) & (low >= 0)
    if bool(ok.all()):
        return
    row = int((~ok.reshape(-1)).nonzero()[0, 0])
    t, lo = float(total.reshape(-1)[row]), float(low.reshape(-1)[row])
    raise NumericsError(f"{what} row {row} of {ok.numel()} is not a distribution (sum {t}, min {lo}): "
                        "no token can be drawn from it")


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits -> the distribution the request samples from.

    logits: [..., vocab] (any float dtype). Returns float32 probabilities [..., vocab].
    Greedy returns the one-hot of the argmax (ties: lowest id, as torch.argmax does).
    Order: temperature, then top-k, then top-p over the tempered distribution; top-k and
    top-p never drop the most likely token (ties: the lowest id), so a degenerate top_p
    (a float32 zero) leaves the greedy token. Raises NumericsError (check_logits) on a
    NaN/+inf row, or a row every token of which is impossible.
    """
    logits = logits.float()
    check_logits(logits)
    if params.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    scaled = logits / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        # stable: ties keep index order, so the first kept token is torch.argmax's
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # keep the smallest prefix whose mass reaches top_p, and always the first token (a
        # top_p below float32's smallest number compares as 0 and would drop every token)
        drop_sorted = before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    check_probs(probs)
    return probs


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs: [n, vocab]; uniform: [n] in [0, 1). Returns [n] int64.

    Taking the uniforms as input (drawn from the request's generator) keeps sampling a pure
    function, which is what makes seeded runs reproducible in any batch.
    """
    check_probs(probs)
    cdf = torch.cumsum(probs.double(), dim=-1)
    total = cdf[..., -1:]
    # the uniforms come from the request's CPU generator (the same values on every device)
    idx = torch.searchsorted(cdf, (uniform.to(cdf.device, torch.float64).unsqueeze(-1) * total), right=True).squeeze(-1)
    # guard against the u * total == total edge: pick the last token with mass
    idx = idx.clamp(max=probs.shape[-1] - 1)
    bad = probs.gather(-1, idx.unsqueeze(-1)).squeeze(-1) <= 0
    if bool(bad.any()):
        last_nonzero = (probs > 0).double().cumsum(-1).argmax(-1)
        idx = torch.where(bad, last_nonzero, idx)
    return idx
