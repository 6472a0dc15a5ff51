"""Per-sequence speculation depth (gamma) controller.

Rolling acceptance over the last `window` steps gives a per-token acceptance estimate a.
Expected tokens from one verify pass with g drafts: E(g) = (1 - a^(g+1)) / (1 - a).
Cost of that pass: g * draft_cost + verify_cost(g + 1), both measured at start-up on this
machine (seconds). The controller picks g in [gamma_min, gamma_max] maximising E(g) / cost;
g = 0 is plain decoding (1 token per verify_cost(1)). When acceptance stays low, g = 0 is
chosen; every `probe_every` plain steps one probe step at gamma_max re-measures acceptance
so speculation can come back when the text turns predictable.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class CostModel:
    """Measured costs in seconds: verify_cost[w] for verify width w (w = g + 1)."""

    verify_cost: dict[int, float]
    draft_cost: float = 0.0  # per drafted token (0 for prompt lookup)

    def verify(self, width: int) -> float:
        if width in self.verify_cost:
            return self.verify_cost[width]
        widths = sorted(self.verify_cost)
        lo = max((w for w in widths if w <= width), default=widths[0])
        hi = min((w for w in widths if w >= width), default=widths[-1])
        if lo == hi:
            # beyond the measured range: extrapolate linearly from the last two points
            if len(widths) >= 2 and width > widths[-1]:
                a, b = widths[-2], widths[-1]
                slope = (self.verify_cost[b] - self.verify_cost[a]) / (b - a)
                return self.verify_cost[b] + slope * (width - b)
            return self.verify_cost[lo]
        f = (width - lo) / (hi - lo)
        return self.verify_cost[lo] * (1 - f) + self.verify_cost[hi] * f


class TreeCostModel(CostModel):
    """A Medusa tree's costs for the depth controller: depth g verifies every node of the
    tree within depth g (width nodes + 1, not g + 1). node_counts[d] = nodes within depth d."""

    def __init__(self, base: CostModel, node_counts: list[int]) -> None:
        super().__init__(base.verify_cost, base.draft_cost)
        self.base, self.node_counts = base, node_counts

    def verify(self, width: int) -> float:
        depth = min(max(width - 1, 0), len(self.node_counts) - 1)
        return self.base.verify(self.node_counts[depth] + 1)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens per verify pass (accepted drafts + the recovered/bonus token)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def best_gamma(alpha: float, lo: int, hi: int, costs: CostModel) -> int:
    """argmax over g in [lo, hi] of E(g) / (g * draft_cost + verify_cost(g + 1))."""
    best, best_rate = lo, -1.0
    for g in range(lo, hi + 1):
        rate = expected_tokens(alpha, g) / (g * costs.draft_cost + costs.verify(g + 1))
        if rate > best_rate + 1e-12:
            best, best_rate = g, rate
    return best


@dataclass
class GammaState:
    """One sequence's recent acceptance: (drafted, accepted) of its last `window` verified
    steps per method (a tree step counts its depth as drafted)."""

    window: int = 20
    history: dict[str, collections.deque] = field(default_factory=dict)
    plain_steps: int = 0

    def of(self, method: str) -> collections.deque:
        h = self.history.get(method)
        if h is None:
            h = self.history[method] = collections.deque(maxlen=self.window)
        return h


class GammaController:
    """Chooses each sequence's gamma from its own recent acceptance."""

    def __init__(self, costs: dict[str, CostModel], window: int = 20, prior_alpha: float = 0.6,
                 probe_every: int = 16) -> None:
        self.costs = costs  # method -> CostModel
        self.window = window
        self.prior_alpha = prior_alpha
        self.probe_every = probe_every

    def state(self, seq) -> GammaState:
        st = seq.spec_state.gamma
        if st is None:
            st = seq.spec_state.gamma = GammaState(self.window)
        return st

    def alpha(self, seq, method: str) -> float:
        """The per-token acceptance estimate of `method` on seq: the one estimator, used for
        the depth (`next`) and, under `auto`, for choosing the method (Speculator)."""
        history = self.state(seq).of(method)
        drafted = sum(d for d, _ in history)
        accepted = sum(a for _, a in history)
        # a weak prior (2 pseudo-drafts) keeps the first steps from swinging to extremes
        return (accepted + 2 * self.prior_alpha) / (drafted + 2)

    def next(self, seq, method: str, costs: CostModel | None = None) -> int:
        """costs: the sequence's own cost model (a Medusa tree's) instead of the method's."""
        spec = seq.spec
        if not spec.dynamic:
            return spec.gamma
        st = self.state(seq)
        if not st.of(method):
            return max(spec.gamma, 1) if spec.gamma_max > 0 else 0
        g = best_gamma(self.alpha(seq, method), spec.gamma_min, spec.gamma_max, costs or self.costs[method])
        if g == 0:
            st.plain_steps += 1
            if st.plain_steps >= self.probe_every:  # probe: maybe the text became predictable
                st.plain_steps = 0
                return max(1, min(spec.gamma, spec.gamma_max))
        else:
            st.plain_steps = 0
        return g

    def record(self, seq, method: str, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.state(seq).of(method).append((drafted, accepted))
