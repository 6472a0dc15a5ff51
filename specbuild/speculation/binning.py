"""Ragged-accept micro-batch planner.

After a step, sequences want different verify widths (gamma + 1, or a prefill chunk).
Three ways to run them: one padded batch (every item padded to the widest), flattened
ragged tokens in one pass (no padding; the decoder's default), or micro-batches planned
to minimise a cost model calibrated at start-up: cost(bin) = pass_overhead +
token_cost * tokens(bin), where tokens(bin) counts padding when bins are padded. The
planner is a pure function: widths in, groups of item indices out.
"""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("ragged", "padded", "bins")


@dataclass(frozen=True)
class BinCost:
    pass_overhead: float  # seconds per forward pass regardless of size
    token_cost: float  # seconds per token row
    padded: bool = True  # bins pad to their widest item (False: ragged within a bin)

    def cost(self, widths: list[int]) -> float:
        rows = len(widths) * max(widths) if self.padded else sum(widths)
        return self.pass_overhead + self.token_cost * rows


def plan_bins(widths: list[int], cost: BinCost, max_bins: int = 4) -> list[list[int]]:
    """Group item indices into <= max_bins bins minimising the summed cost.

    Optimal for contiguous groups of items sorted by width (with padding, an optimal
    partition always groups similar widths), by dynamic programming: O(n^2 * max_bins).
    """
    if not widths:
        return []
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    w = [widths[i] for i in order]
    n = len(w)
    inf = float("inf")
    # best[b][j]: min cost of covering the first j sorted items with b bins
    best = [[inf] * (n + 1) for _ in range(max_bins + 1)]
    back = [[0] * (n + 1) for _ in range(max_bins + 1)]
    best[0][0] = 0.0
    for b in range(1, max_bins + 1):
        for j in range(1, n + 1):
            for i in range(b - 1, j):
                if best[b - 1][i] == inf:
                    continue
                c = best[b - 1][i] + cost.cost(w[i:j])
                if c < best[b][j]:
                    best[b][j], back[b][j] = c, i
    b = min(range(1, max_bins + 1), key=lambda k: best[k][n])
    groups, j = [], n
    while b > 0:
        i = back[b][j]
        groups.append([order[k] for k in range(i, j)])
        j, b = i, b - 1
    return groups[::-1]


def plan(widths: list[int], strategy: str, cost: BinCost | None = None, max_bins: int = 4) -> list[list[int]]:
    """Groups of item indices for a strategy; 'ragged' and 'padded' are single passes."""
    if strategy not in STRATEGIES:
        raise ValueError(f"binning strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if strategy in ("ragged", "padded") or cost is None:
        return [list(range(len(widths)))] if widths else []
    return plan_bins(widths, cost, max_bins)
