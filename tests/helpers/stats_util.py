"""Goodness-of-fit helpers for the statistical tests: chi-square with pooling of rare
cells, several multinomial strata summed into one test, and Holm's correction.

Pooling depends on the expected counts only (never on what was observed), so the
statistic keeps its chi-square law. A cell with expected probability exactly 0 that was
observed is an impossible outcome: the test fails outright (statistic inf, p = 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats

MIN_EXPECTED = 5.0


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    dof: int
    pvalue: float
    cells: int  # cells after pooling
    impossible: int  # observations in cells of expected probability 0


def _pool(observed: np.ndarray, expected: np.ndarray, min_expected: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep cells with expected >= min_expected; group the rest, smallest first, into
    bins that each reach min_expected (a short last bin joins the one before it, or the
    smallest kept cell)."""
    big = expected >= min_expected
    obs, exp = list(observed[big]), list(expected[big])
    order = np.argsort(expected[~big], kind="stable")
    small_obs, small_exp = observed[~big][order], expected[~big][order]
    bins_obs, bins_exp, acc_o, acc_e = [], [], 0.0, 0.0
    for o, e in zip(small_obs, small_exp):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= min_expected:
            bins_obs.append(acc_o)
            bins_exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0.0 or acc_o > 0.0:
        if bins_exp:
            bins_obs[-1] += acc_o
            bins_exp[-1] += acc_e
        elif exp:
            smallest = int(np.argmin(exp))
            obs[smallest] += acc_o
            exp[smallest] += acc_e
        else:
            bins_obs.append(acc_o)
            bins_exp.append(acc_e)
    return np.array(obs + bins_obs, dtype=np.float64), np.array(exp + bins_exp, dtype=np.float64)


def _statistic(observed, probs, min_expected) -> tuple[float, int, int, int]:
    observed = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if observed.shape != probs.shape:
        raise ValueError(f"observed has {observed.size} cells, probabilities {probs.size}")
    if np.any(probs < 0) or abs(probs.sum() - 1.0) > 1e-6:
        raise ValueError(f"probabilities must be >= 0 and sum to 1, sum is {probs.sum()!r}")
    total = observed.sum()
    possible = probs > 0
    impossible = int(observed[~possible].sum())
    obs, exp = _pool(observed[possible], total * probs[possible] / probs[possible].sum(), min_expected)
    if len(exp) < 2:
        raise ValueError(f"only {len(exp)} cell(s) after pooling: draw more samples")
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, len(exp) - 1, len(exp), impossible


def pooled_chisquare(observed, probs, min_expected: float = MIN_EXPECTED) -> ChiSquare:
    """Pearson chi-square of counts `observed` against cell probabilities `probs`."""
    return stratified_chisquare([(observed, probs)], min_expected)


def stratified_chisquare(strata: Sequence[tuple], min_expected: float = MIN_EXPECTED) -> ChiSquare:
    """One test over independent multinomials (observed_s, probs_s): statistics and degrees
    of freedom add; each stratum is pooled on its own."""
    stat, dof, cells, impossible = 0.0, 0, 0, 0
    for observed, probs in strata:
        s, d, c, i = _statistic(observed, probs, min_expected)
        stat, dof, cells, impossible = stat + s, dof + d, cells + c, impossible + i
    if impossible:
        return ChiSquare(float("inf"), dof, 0.0, cells, impossible)
    return ChiSquare(stat, dof, float(stats.chi2.sf(stat, dof)), cells, 0)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values (same order): the family passes at alpha iff all >= alpha."""
    p = np.asarray(pvalues, dtype=np.float64)
    m = len(p)
    order = np.argsort(p, kind="stable")
    adjusted = np.empty(m)
    running = 0.0
    for rank, idx in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[idx]))
        adjusted[idx] = running
    return adjusted.tolist()


def broken_tree_rule(parents, node_tokens, target_probs, uniforms):
    """A wrong tree verifier for power checks: after the accepted path it recovers from the
    target's distribution instead of the residual (so sampled output is no longer exact)."""
    import torch

    import specbuild.sampling.acceptance as acc

    good = acc.verify_tree_sampled(parents, node_tokens, target_probs, uniforms)
    node = good.accepted_nodes[-1] if good.accepted_nodes else 0
    row = target_probs[node].double()
    tok = int(torch.searchsorted(row.cumsum(0), uniforms[-1].double() * row.sum()).clamp(max=row.numel() - 1))
    return acc.TreeResult(good.accepted_nodes, tok, good.tokens[:-1] + (tok,))
