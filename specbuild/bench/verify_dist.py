"""`specbuild verify`: a statistical check that speculative sampling gives the target's
distribution, end to end through the engine (drafters, verification, caches, batching).

With a small top-k, the joint distribution of the first `n_tokens` generated tokens can
be enumerated exactly from the plain target (k + k^2 + ... forward passes). N seeded
speculative samples are drawn through the engine and compared with that distribution by
a chi-square goodness-of-fit test, pooling cells whose expected count is below 5.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from specbuild.engine.engine import Engine
from specbuild.model.decoder import ForwardBatch
from specbuild.sampling.params import SamplingParams, warp_probs
from specbuild.engine.sequence import Request
from specbuild.speculation.config import SpeculationConfig

# Prompts with repetition, so prompt lookup finds matches and any drafter gets accepted.
DEFAULT_PROMPTS = (
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
)


@torch.inference_mode()
def last_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Target logits [vocab] after `ids`, by a throwaway full forward (no request state)."""
    from specbuild.model.timing import scratch_sequence

    cache, n = engine.cache, len(ids)
    with scratch_sequence(cache, n) as slots:
        mask = torch.ones(n, n, dtype=torch.bool).tril().to(cache.device)
        batch = ForwardBatch(torch.tensor(ids, device=cache.device), torch.arange(n, device=cache.device),
                             slots, slots, mask, torch.tensor([n - 1], device=cache.device))
        return engine.model.forward(batch, cache).logits[0]


def exact_joint(engine: Engine, prompt_ids: list[int], params: SamplingParams, n_tokens: int) -> dict:
    """{(t1, ..., tn): probability} of the first n tokens under plain decoding."""
    out: dict[tuple, float] = {}

    def walk(prefix: tuple, prob: float) -> None:
        if len(prefix) == n_tokens:
            out[prefix] = prob
            return
        probs = warp_probs(last_logits(engine, prompt_ids + list(prefix)).unsqueeze(0), params)[0]
        for tok in torch.nonzero(probs > 0).flatten().tolist():
            walk(prefix + (tok,), prob * float(probs[tok]))

    walk((), 1.0)
    return out


def pooled_chisquare(observed: dict, expected_probs: dict, n: int) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value); cells with expected < 5 pooled into one.
    An observed outcome the exact distribution gives zero probability fails outright."""
    from scipy.stats import chi2

    stat, dof = pooled_statistic(observed, expected_probs, n)
    return stat, dof, 0.0 if math.isinf(stat) else float(chi2.sf(stat, dof))


def pooled_statistic(observed: dict, expected_probs: dict, n: int) -> tuple[float, int]:
    """pooled_chisquare's (statistic, degrees of freedom) without the p-value: (inf, 0) when an
    observed outcome has zero exact probability."""
    if any(k not in expected_probs for k in observed):
        return math.inf, 0
    big = [k for k, p in expected_probs.items() if p * n >= 5]
    small = [k for k in expected_probs if k not in big]
    cells = [(observed.get(k, 0), expected_probs[k] * n) for k in big]
    if small:
        cells.append((sum(observed.get(k, 0) for k in small), sum(expected_probs[k] for k in small) * n))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    return stat, max(len(cells) - 1, 1)


@dataclass(frozen=True)
class VerifyResult:
    prompt: str
    temperature: float
    top_k: int
    method: str
    samples: int
    statistic: float
    dof: int
    p_value: float
    drafted: int
    accepted: int
    cells: int

    def to_json(self) -> dict:
        return self.__dict__.copy()


def check(engine: Engine, prompt: str | list[int], temperature: float, top_k: int, spec: SpeculationConfig,
          samples: int, n_tokens: int = 3, seed: int = 1234, progress=None) -> VerifyResult:
    prompt_ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=n_tokens, ignore_eos=True)
    exact = exact_joint(engine, prompt_ids, params, n_tokens)
    observed: dict[tuple, int] = {}
    drafted = accepted = 0
    done = 0
    batch = engine.max_batch_size * 4
    while done < samples:
        n = min(batch, samples - done)
        handles = [engine.submit(Request(prompt_ids=prompt_ids, speculation=spec,
                                         sampling=SamplingParams(temperature=temperature, top_k=top_k,
                                                                 max_tokens=n_tokens, ignore_eos=True,
                                                                 seed=seed + done + i)))
                   for i in range(n)]
        engine.run_until_done()
        for h in handles:
            r = h.result()
            key = tuple(r["token_ids"][:n_tokens])
            observed[key] = observed.get(key, 0) + 1
            drafted += r["stats"]["drafted"]
            accepted += r["stats"]["accepted"]
        done += n
        if progress:
            progress(n)
    stat, dof, p = pooled_chisquare(observed, exact, samples)
    return VerifyResult(prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>", temperature, top_k, spec.method, samples, stat, dof, p, drafted, accepted, len(exact))


def holm(p_values: list[float]) -> list[float]:
    """Holm-adjusted p-values (same order as given)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


# Exit codes of `specbuild verify` (documented in its --help and the README).
EXIT_PASS, EXIT_FAIL, EXIT_INCONCLUSIVE = 0, 1, 3
MIN_ACCEPTED = 20  # accepted drafts a setting needs before its p-value says anything about acceptance


@dataclass(frozen=True)
class Verdict:
    """The check's outcome. `status` per setting: pass | fail (the distribution differs:
    Holm-adjusted p < alpha) | inconclusive (p fine, but fewer than `min_accepted` drafts
    were accepted, so the acceptance rule was hardly exercised in that setting)."""

    status: str  # pass | fail | inconclusive
    statuses: tuple[str, ...]
    advice: tuple[str, ...]

    @property
    def exit_code(self) -> int:
        return {"pass": EXIT_PASS, "fail": EXIT_FAIL, "inconclusive": EXIT_INCONCLUSIVE}[self.status]


def verdict(results: list[VerifyResult], adjusted: list[float], alpha: float,
            min_accepted: int = MIN_ACCEPTED, bundle: str = "BUNDLE") -> Verdict:
    """A failing p-value anywhere fails the check; otherwise a setting whose drafter had too
    few acceptances makes it inconclusive, named with what to run instead."""
    statuses, advice = [], []
    for r, p in zip(results, adjusted):
        if p < alpha:
            statuses.append("fail")
        elif r.accepted < min_accepted:
            statuses.append("inconclusive")
            advice.append(
                f"{r.method} at T={r.temperature:g} on {r.prompt[:40]!r}: {r.accepted} of {r.drafted} drafts "
                f"accepted (< {min_accepted}), too few to judge the acceptance rule in this setting; "
                + ("no drafts were proposed (use --tokens >= 3 so that a draft fits)" if r.drafted == 0 else
                   "the drafter rarely agrees with the target on this prompt")
                + f". Run instead: specbuild verify {bundle} "
                f"--speculation {r.method} --temperatures {r.temperature:g} --chat (prompts in the chat template "
                f"the drafters were trained on), or give --prompt with text the drafter continues, or more --samples")
        else:
            statuses.append("pass")
    status = "fail" if "fail" in statuses else "inconclusive" if "inconclusive" in statuses else "pass"
    return Verdict(status, tuple(statuses), tuple(advice))


def settings(temperatures, methods, prompts) -> list[tuple]:
    return list(itertools.product(prompts, temperatures, methods))
