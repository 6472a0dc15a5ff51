"""Per-sequence speculation state every method shares (`seq.spec_state`), written by the
speculator and the depth controller. Each drafter keeps its own per-sequence state
(keyed by seq_id, freed in its `release`): nothing of one drafter lives here."""

from __future__ import annotations

from dataclasses import dataclass

from specbuild.speculation.gamma import GammaState


@dataclass
class SpecState:
    # Speculator: the drafter chosen this step (None: plain decoding)
    method: str | None = None
    # GammaController: recent (drafted, accepted) per method; the one acceptance estimate
    gamma: GammaState | None = None
    # Speculator: the drafters this sequence may draft with, so learns from (its method's,
    # with the drafters that method merges; under `auto` its drafters (Speculator.auto_methods)
    # until auto_plain)
    uses: frozenset[str] = frozenset()
    # Speculator: the drafters whose stores keep this request's text when it ends (suffix's
    # answers): those it may draft with, and under `auto` all of auto's drafters even after
    # auto_plain (its text asked again may pay where it did not: a repeated prompt whose first
    # answer was not kept was decoded plainly again)
    keeps: frozenset[str] = frozenset()
    # Speculator under `auto`: every drafter's rate fell below plain decoding's. Its inputs
    # (a drafter's acceptance changes only when it drafts) are fixed from then on, so the
    # choice is final, and the drafters' per-step bookkeeping (recycling's table, EAGLE's
    # features) is skipped for the sequence
    auto_plain: bool = False
    # Speculator: drafters that raised on this sequence alone (propose_apart); it drafts with
    # them no more and decodes plainly instead (lossless), its neighbours unaffected
    draft_failed: frozenset[str] = frozenset()
    # Speculator.settle: the last verified draft's candidates by source and position
    # (proposers/base.candidate_sources), for telemetry
    candidate_sources: dict | None = None
    # Speculator.plan_draft: the depth planned for this step, until settle hands it to the
    # step's Verdict (the sequence's statistics: SeqStats.gammas)
    planned_gamma: int | None = None
