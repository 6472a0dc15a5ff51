"""Per-sequence speculation state: one typed record per request (`seq.spec_state`), written
by the speculator, the depth controller and the drafters. Each field names its owner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specbuild.speculation.gamma import GammaState

NO_ROLLBACK = 1 << 62  # remote_keep when the target has not rolled back since the last send


@dataclass
class SpecState:
    # Speculator: the drafter chosen this step (None: plain decoding), and the accepted path
    # of the last tree step (node indices, root excluded) until `compact` moves its K/V
    method: str | None = None
    accepted_nodes: tuple[int, ...] = ()
    # Speculator under `auto`: every drafter's rate fell below plain decoding's. Its inputs
    # (a drafter's acceptance changes only when it drafts) are fixed from then on, so the
    # choice is final, and the drafters' per-step bookkeeping (recycling's table, EAGLE's
    # features) is skipped for the sequence
    auto_plain: bool = False
    # Speculator: drafters that raised on this sequence alone (propose_apart); it drafts with
    # them no more and decodes plainly instead (lossless), its neighbours unaffected
    draft_failed: frozenset[str] = frozenset()
    # GammaController: recent (drafted, accepted) per method; the one acceptance estimate
    gamma: GammaState | None = None
    # DraftModelProposer: tokens of this sequence held in the draft model's cache
    draft_len: int = 0
    # MedusaProposer: (position, final-normed hidden [H]) of the row that chose the last token
    medusa_hidden: tuple[int, torch.Tensor] | None = None
    # RemoteDraftProposer (MineDraft): text length the draft rank has seen (None: it holds
    # nothing of this sequence), how much of it stays valid after a rollback, and whether the
    # draft rank failed on this sequence (decoded plainly from then on)
    remote_sent: int | None = None
    remote_keep: int = NO_ROLLBACK
    remote_failed: bool = False
    # EagleProposer: the head's own K/V and features for this sequence (proposers/eagle.EagleState)
    eagle: Any = None
    remote_drafted: bool = True  # the draft rank's cache holds drafted (uncommitted) tokens, not just the prompt
