"""Per-sequence speculation depth (gamma) controller.

Rolling acceptance over the last `window` steps gives a per-token acceptance estimate a.
Expected tokens from one verify pass with g drafts: E(g) = (1 - a^(g+1)) / (1 - a).
Cost of that pass: g * draft_cost + verify_cost(g + 1), both measured at start-up on this
machine (seconds). The controller picks g in [gamma_min, gamma_max] maximising E(g) / cost;
g = 0 is plain decoding (1 token per verify_cost(1)). When acceptance stays low, g = 0 is
chosen; every `probe_every` plain steps one probe step at gamma_max re-measures acceptance
so speculation can come back when the text turns predictable.

A sequence with a gamma policy (speculation/policy.py, `seq.admission.gamma_policy`) starts from the
policy's gamma_default and acceptance prior instead of the global ones, moves within the
policy's bounds, and is switched to plain decoding (speculation off, probes as above) once
its rolling acceptance stayed below the policy's alpha_threshold for collapse_steps steps.
Switching off and back on is reported through `emit(seq, kind, detail)` (acceptance_collapse,
acceptance_recovered) when a sink is attached. Only how much is drafted changes: lossless.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field



def gamma_policy(seq):
    """seq's gamma policy (`seq.admission.gamma_policy`), or None: also for a sequence without
    an admission record (the drafters' and the tests' stand-ins)."""
    admission = getattr(seq, "admission", None)
    return admission.gamma_policy if admission is not None else None

@dataclass
class CostModel:
    """Measured costs in seconds: verify_cost[w] for verify width w (w = g + 1)."""

    verify_cost: dict[int, float]  # not changed after construction: verify() keeps what it computed
    draft_cost: float = 0.0  # per drafted token (0 for prompt lookup)
    _memo: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def verify(self, width: int) -> float:
        cost = self._memo.get(width)
        if cost is None:  # (the controllers and drafters ask for the same few widths every step)
            cost = self._memo[width] = self._verify(width)
        return cost

    def _verify(self, width: int) -> float:
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
    low_steps: int = 0  # consecutive recorded steps with rolling acceptance under the policy's threshold
    collapsed: bool = False  # speculation off for this sequence (policy threshold) until a probe recovers
    off: bool = False  # the cost model chose plain decoding last step
    # per method: 1 when a proposal found a draft, 0 when it found nothing (auto's choice of
    # drafter weighs a drafter's acceptance by how often it has anything to offer)
    found: dict[str, collections.deque] = field(default_factory=dict)

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
        self.emit = None  # callable(seq, kind, detail) or None: failure-mode events (telemetry)
        self.policy_weight = 6  # pseudo-drafts a policy's prior_alpha counts for (learned priors are firmer)

    def state(self, seq) -> GammaState:
        st = seq.spec_state.gamma
        if st is None:
            st = seq.spec_state.gamma = GammaState(self.window)
        return st

    def alpha(self, seq, method: str) -> float:
        """The per-token acceptance estimate of `method` on seq: the one estimator, used for
        the depth (`next`) and, under `auto`, for choosing the method (Speculator). A sequence
        with a gamma policy starts from the policy's prior (learned per content type), held
        firmer than the global one."""
        history = self.state(seq).of(method)
        drafted = sum(d for d, _ in history)
        accepted = sum(a for _, a in history)
        policy = gamma_policy(seq)
        if policy is not None:
            return (accepted + self.policy_weight * policy.prior_alpha) / (drafted + self.policy_weight)
        # a weak prior (2 pseudo-drafts) keeps the first steps from swinging to extremes
        return (accepted + 2 * self.prior_alpha) / (drafted + 2)

    def found(self, seq, method: str, hit: bool) -> None:
        """A proposal of `method` for seq found a draft (hit) or nothing."""
        st = self.state(seq)
        h = st.found.get(method)
        if h is None:
            h = st.found[method] = collections.deque(maxlen=self.window)
        h.append(1 if hit else 0)

    def hit_rate(self, seq, method: str) -> float:
        """How often `method` had a draft for seq (one pseudo-hit: an untried drafter counts as
        finding one, so it gets tried)."""
        h = self.state(seq).found.get(method)
        return (sum(h) + 1) / (len(h) + 1) if h else 1.0

    def next(self, seq, method: str, costs: CostModel | None = None) -> int:
        """costs: the sequence's own cost model (a Medusa tree's) instead of the method's."""
        spec = seq.spec
        if not spec.dynamic:
            return spec.gamma
        st = self.state(seq)
        policy = gamma_policy(seq)
        lo, hi = policy.bounds(spec.gamma_min, spec.gamma_max) if policy is not None else (spec.gamma_min, spec.gamma_max)
        if not st.of(method):
            if policy is not None:
                return policy.start(lo, hi) if hi > 0 else 0
            if spec.method == "auto" and hi > 0:
                # auto's first try of a drafter: the depth its prior acceptance pays for on the
                # measured costs (where a wide pass costs 2.4x a step, as int4's does, a failed
                # first try at gamma 4 cost a whole step more than one at 2)
                return best_gamma(self.alpha(seq, method), max(lo, 1), hi, costs or self.costs[method])
            return max(spec.gamma, 1) if spec.gamma_max > 0 else 0
        if st.collapsed:  # speculation off (policy threshold); a probe every probe_every steps
            st.plain_steps += 1
            if st.plain_steps >= self.probe_every:
                st.plain_steps = 0
                return max(1, min(policy.start(lo, hi), hi))
            return 0
        alpha = self.alpha(seq, method)
        g = best_gamma(alpha, lo, hi, costs or self.costs[method])
        if (g == 0) != st.off:
            st.off = g == 0
            if self.emit is not None:
                self.emit(seq, "acceptance_collapse" if st.off else "acceptance_recovered",
                          {"rule": "cost", "alpha": round(alpha, 4), "method": method})
        if g == 0:
            st.plain_steps += 1
            if st.plain_steps >= self.probe_every:  # probe: maybe the text became predictable
                st.plain_steps = 0
                return max(1, min(policy.start(lo, hi) if policy is not None else spec.gamma, hi))
        else:
            st.plain_steps = 0
        return g

    def record(self, seq, method: str, drafted: int, accepted: int) -> None:
        if drafted > 0:
            st = self.state(seq)
            st.of(method).append((drafted, accepted))
            policy = gamma_policy(seq)
            if policy is not None and seq.spec.dynamic:
                self._watch_collapse(seq, method, st, policy, drafted, accepted)

    def _watch_collapse(self, seq, method: str, st: GammaState, policy, drafted: int, accepted: int) -> None:
        """Acceptance collapse: rolling alpha under policy.alpha_threshold for collapse_steps
        steps switches speculation off (when the bounds allow plain decoding); a probe whose
        own acceptance reaches the threshold switches it back on."""
        lo, _ = policy.bounds(seq.spec.gamma_min, seq.spec.gamma_max)
        if st.collapsed:
            if accepted / drafted >= policy.alpha_threshold:
                st.collapsed, st.low_steps = False, 0
                if self.emit is not None:
                    self.emit(seq, "acceptance_recovered", {"rule": "threshold", "probe_alpha": round(accepted / drafted, 4),
                                                            "threshold": policy.alpha_threshold})
            return
        alpha = self.alpha(seq, method)
        st.low_steps = st.low_steps + 1 if alpha < policy.alpha_threshold else 0
        if st.low_steps >= policy.collapse_steps and lo == 0:
            st.collapsed, st.plain_steps = True, 0
            if self.emit is not None:
                self.emit(seq, "acceptance_collapse", {"rule": "threshold", "alpha": round(alpha, 4),
                                                       "threshold": policy.alpha_threshold, "steps": st.low_steps})
