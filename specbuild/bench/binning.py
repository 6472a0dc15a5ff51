"""Binnings measured against the engine's ragged step (scripts/bench_binning.py).

After a step, sequences want different verify widths (gamma + 1, or a prefill chunk).
Three ways to run them: flattened ragged tokens in one pass (no padding; the engine's only
way, the fastest wherever it was measured), one padded batch (every decode item padded to
the widest), or micro-batches planned to minimise a cost model from the calibrated verify
costs: cost(bin) = pass_overhead + token_cost * tokens(bin), where tokens(bin) counts
padding when bins are padded. The planner is a pure function: widths in, groups of item
indices out.

`use(engine, strategy)` runs an engine's steps the measured way through two seams of the
step: `Scheduler.grouping` (bins: the forwards a step's items run in) and `StepRunner.build`
(padded: the batch builder, here `padded_batch`, which adds the filler rows).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specbuild.engine.step import build_forward_batch

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


def bin_cost(speculator) -> BinCost | None:
    """A pass's fixed and per-token cost from the speculator's calibrated verify costs (width 1
    and the widest measured); None when its costs were given rather than calibrated."""
    verify = getattr(speculator.controller.costs, "verify", None)
    if not verify:
        return None
    w1, wn, widest = verify[1], verify[max(verify)], max(verify)
    return BinCost(pass_overhead=max(w1 - (wn - w1) / max(widest - 1, 1), 1e-4),
                   token_cost=max((wn - w1) / max(widest - 1, 1), 1e-6))


def bins_grouping(speculator, max_bins: int = 4):
    """A `Scheduler.grouping` hook: a step's items in micro-batches planned on the measured costs."""
    def grouping(items: list) -> list[list]:
        if len(items) <= 1:
            return [items]
        groups = plan([it.width for it in items], "bins", bin_cost(speculator), max_bins)
        return [[items[i] for i in g] for g in groups]
    return grouping


def padded_batch(items: list, cache, fast: bool = True):
    """A `StepRunner.build` that pads every decode item (one pending token, completing) with
    filler rows to the widest one's width: the last token repeated at the next positions, seen
    causally after the item's own rows (after every node of a tree), their logits never read and
    their K/V rolled back with the rejected drafts. Built as build_forward_batch's batch of the
    items with the filler appended to their drafts, its logit rows those of the items alone."""
    decode = [it for it in items if it.completes and len(it.chunk) == 1]
    widest = max((it.width for it in decode), default=0)
    pads = {id(it): widest - it.width for it in decode if it.width < widest}
    if not pads:
        return build_forward_batch(items, cache, fast)
    shadows = [padded_item(it, pads[id(it)]) if id(it) in pads else it for it in items]
    batch = build_forward_batch(shadows, cache, fast=False)
    rows = []
    for it, shadow in zip(items, shadows):
        it.row0, it.score = shadow.row0, shadow.score
        if it.score is not None:
            rows.append(torch.arange(it.row0 + it.score[0] - it.start, it.row0 + it.score[1] - it.start))
        if it.completes:
            last = it.row0 + len(it.chunk) - 1
            rows.append(torch.arange(last, last + 1 + it.n_draft))
    logit_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    return dataclasses.replace(batch, logit_rows=logit_rows.to(batch.logit_rows.device))


def padded_item(it, pad: int):
    """A copy of a decode item whose draft carries `pad` filler rows after its own."""
    from specbuild.speculation.proposers.base import Draft

    filler = [it.chunk[-1]] * pad
    d = it.draft if it.n_draft else None
    if d is None or d.depths is None:  # a chain (or none): the filler continues it
        draft = Draft(tokens=(list(d.tokens) if d is not None else []) + filler)
    else:  # a tree: filler at depths after the last node's row, each seeing the whole tree
        n = len(d.tokens) + 1
        mask = torch.ones(n + pad, n + pad, dtype=torch.bool).tril()
        mask[:n, :n] = torch.as_tensor(d.tree_mask, dtype=torch.bool)
        draft = Draft(tokens=list(d.tokens) + filler, depths=list(d.depths) + [n + j for j in range(pad)],
                      tree_mask=mask)
    return dataclasses.replace(it, draft=draft)


def use(engine, strategy: str) -> None:
    """Run `engine`'s steps the `strategy` way (one of STRATEGIES); ragged restores the engine's own."""
    if strategy not in STRATEGIES:
        raise ValueError(f"binning strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    scheduler = engine.scheduler
    scheduler.grouping = bins_grouping(scheduler.speculator) if strategy == "bins" else None
    scheduler.runner.build = padded_batch if strategy == "padded" else build_forward_batch
