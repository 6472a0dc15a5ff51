"""The small protocol every drafter implements, and the Draft it returns.

A chain draft is `tokens` [k] (+ the probabilities each was sampled from, for rejection
sampling; None for deterministic drafters, which count as one-hot). A tree draft also
carries `parents` / `depths` / `tree_mask` (node 0 = the root = the sequence's last
token, not part of `tokens`; node i >= 1 is tokens[i - 1]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Draft:
    tokens: list[int]  # [k] drafted token ids (tree: nodes 1..n in node order)
    probs: torch.Tensor | None = None  # [k, vocab] distribution each token was drawn from; None = one-hot
    parents: tuple[int, ...] | None = None  # tree only: [n + 1], root -1
    depths: list[int] | None = None  # tree only: [n] depth of nodes 1..n (>= 1)
    tree_mask: torch.Tensor | None = None  # tree only: [n + 1, n + 1] bool ancestor mask, root row 0
    method: str = ""
    last_row: int | None = None  # set by tree verification: the row of the last accepted node
    sources: list[str] | None = None  # per drafted token / node: where it came from (None: `method`)

    def __len__(self) -> int:
        return len(self.tokens)


def candidate_sources(draft: Draft, accepted: int, accepted_nodes: tuple[int, ...] = ()) -> dict[str, list[list[int]]]:
    """{source: [[offered, accepted] at position 1, 2, ...]}: a chain offers token j at position
    j (the first `accepted` accepted); a tree node offers at its depth, accepted when on the
    accepted path (`accepted_nodes`, node indices 1..n)."""
    out: dict[str, list[list[int]]] = {}
    n = len(draft.tokens)
    names = draft.sources if draft.sources is not None and len(draft.sources) == n else [draft.method or "?"] * n
    on_path = set(accepted_nodes)
    for i in range(n):
        pos = draft.depths[i] if draft.depths is not None else i + 1
        ok = (i + 1) in on_path if draft.parents is not None else i < accepted
        rows = out.setdefault(names[i], [])
        while len(rows) < pos:
            rows.append([0, 0])
        rows[pos - 1][0] += 1
        rows[pos - 1][1] += int(ok)
    return out


class Proposer(Protocol):
    """A drafter. `propose` must not change the target's cache; drafters with their own
    state keep it per sequence and bring it in line in `rollback`."""

    name: str

    def propose(self, seqs: list, gammas: list[int]) -> list[Draft | None]:
        """Draft up to gammas[i] tokens for seqs[i] (0 = none). None or empty = no draft."""
        ...

    def rollback(self, seq, length: int) -> None:
        """The target's cache for seq now holds `length` tokens: drop any drafter state past it."""
        ...

    def release(self, seq) -> None:
        """seq finished or aborted: free drafter state (e.g. its KV blocks)."""
        ...
