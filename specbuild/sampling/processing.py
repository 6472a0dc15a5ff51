"""The one place a request's logits become the distribution it samples from, before
warping: logit_bias and penalties (`adjust_logits`), then the structured-output mask.

Plain decoding, chain verification and tree verification all call `process_logits` with the
draft tokens that precede each row (`paths`: [] for a plain step; draft[:i] for chain row i;
the node's path for a tree row), so a position is scored identically however it is reached:
that is what keeps constrained and penalised speculation lossless.
"""

from __future__ import annotations

import torch

from specbuild.sampling.constraint import Constraint
from specbuild.sampling.params import SamplingParams, adjust_logits


def process_logits(rows: torch.Tensor, params: SamplingParams, history: list[int], paths: list[list[int]],
                   constraint: Constraint | None = None) -> torch.Tensor:
    """rows [n, vocab] -> rows with penalties, biases and the grammar applied (the input itself
    when the request sets none of them)."""
    if params.adjusts:
        rows = adjust_logits(rows, params, history, paths)
    if constraint is not None:
        allowed = constraint.masks_for_paths(paths).to(rows.device)
        rows = rows.masked_fill(~allowed, float("-inf"))
    return rows


def chain_paths(draft_tokens: list[int]) -> list[list[int]]:
    """Row i of a chain verify pass sits after the draft's first i tokens."""
    return [list(draft_tokens[:i]) for i in range(len(draft_tokens) + 1)]


def tree_paths(parents: tuple[int, ...] | list[int], node_tokens: list[int]) -> list[list[int]]:
    """Row i of a tree verify pass sits after the tokens on node i's path from the root
    (node 0 = the root, whose own token is already in the sequence)."""
    paths: list[list[int]] = []
    for i in range(len(parents)):
        path, j = [], i
        while j > 0:
            path.append(int(node_tokens[j]))
            j = parents[j]
        paths.append(path[::-1])
    return paths
