"""Prompt lookup (n-gram) drafter: no model, no cost.

Matches the last n tokens (n from ngram_max down to ngram_min) against the earlier text
(prompt and output so far) and proposes what followed the most recent earlier match.
Deterministic: its drafts count as one-hot distributions in rejection sampling.
"""

from __future__ import annotations

import numpy as np

from specbuild.speculation.proposers.base import Draft, DrafterBase
from specbuild.speculation.proposers.suffix import LocalText


def lookup(ids: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """ids: [L] int64. Returns up to k tokens that followed the latest earlier occurrence of
    the longest matching suffix (length n_max down to n_min); [] when nothing matches. The
    definition, scanning the whole text: NgramProposer gives the same from its index."""
    length = ids.shape[0]
    if k <= 0:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = ids[length - n:]
        # candidate starts: positions i < L - n where ids[i:i+n] == suffix
        windows = np.lib.stride_tricks.sliding_window_view(ids[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < length]  # must be followed by at least one token
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start:start + k].tolist()
    return []


GUARANTEE = ("lossless", "lossless", "specbuild verify: argmax match (greedy), chain rejection sampling with "
                                     "one-hot drafts (sampled)")  # its row of engine/guarantees.py's torch table


class NgramProposer(DrafterBase):
    """Each sequence's text indexed as it grows (suffix.LocalText: the last token's and last
    4-gram's earlier positions), so a step's lookup costs a few index reads and compares
    instead of scanning the whole text with every n (~60-90 us a sequence at a few hundred
    tokens, growing with the text). The drafts are `lookup`'s (tests/speculation/test_ngram.py
    checks them against it). The index holds committed text only: nothing
    to roll back; `release` frees it."""

    name = "ngram"

    def __init__(self) -> None:
        self.local: dict[int, LocalText] = {}

    def propose(self, seqs: list, gammas: list[int]) -> list[Draft | None]:
        out: list[Draft | None] = []
        for seq, gamma in zip(seqs, gammas):
            if gamma <= 0:
                out.append(None)
                continue
            tokens = LocalText.synced(self.local, seq).index.follow(seq.spec.ngram_min, seq.spec.ngram_max, gamma)
            out.append(Draft(tokens, None, method="ngram") if tokens else None)
        return out

    def release(self, seq) -> None:
        self.local.pop(seq.seq_id, None)


def build(ctx) -> NgramProposer:
    return NgramProposer()
