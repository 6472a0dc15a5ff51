"""Prompt lookup (n-gram) drafter: no model, no cost.

Matches the last n tokens (n from ngram_max down to ngram_min) against the earlier text
(prompt and output so far) and proposes what followed the most recent earlier match.
Deterministic: its drafts count as one-hot distributions in rejection sampling.
"""

from __future__ import annotations

import numpy as np

from specbuild.speculation.proposers.base import Draft, DrafterBase


def lookup(ids: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """ids: [L] int64. Returns up to k tokens that followed the latest earlier occurrence of
    the longest matching suffix (length n_max down to n_min); [] when nothing matches."""
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
    """Stateless: reads the sequence's text only (DrafterBase's defaults otherwise)."""

    name = "ngram"

    def propose(self, seqs: list, gammas: list[int]) -> list[Draft | None]:
        out: list[Draft | None] = []
        for seq, gamma in zip(seqs, gammas):
            if gamma <= 0:
                out.append(None)
                continue
            ids = np.asarray(seq.all_ids, dtype=np.int64)
            tokens = lookup(ids, seq.spec.ngram_min, seq.spec.ngram_max, gamma)
            out.append(Draft(tokens, None, method="ngram") if tokens else None)
        return out


def build(ctx) -> NgramProposer:
    return NgramProposer()
