"""The sink the step loop reports speculation telemetry to (specbuild.telemetry implements it).

The engine never imports the telemetry store: it calls an `EventSink`, a no-op by default,
at four places. Every call runs on the step loop's thread and must return at once (the
store's sink puts a tuple on a bounded queue and drops it when the queue is full).

    on_session_start(seq)           a sequence was admitted (its content type and policy are set)
    on_step(seq, step)              a decode pass of seq ended: a StepRecord
    on_session_end(seq)             seq left the running set (finished, aborted or failed)
    on_event(seq, kind, detail)     a failure-mode signal: acceptance_collapse, acceptance_recovered,
                                    kv_desync (and its repair), draft_failure (with its fallback)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class StepRecord:
    """One decode pass of one sequence. Times are the whole batch's (the draft call of the
    sequence's method, the target forward of its group), in milliseconds."""

    step_num: int  # the sequence's decode pass count (1-based)
    method: str | None  # drafter used this step; None: plain decoding
    gamma: int  # draft length the controller chose (0: plain)
    drafted: int  # tokens (tree: nodes) actually verified
    accepted: int
    emitted: int  # tokens appended this step (accepted + 1, fewer at a stop)
    depth: int  # chain: drafted; tree: the tree's depth (positions that could be accepted)
    draft_ms: float
    target_ms: float
    batch_size: int
    fallback: bool  # the sequence asked to speculate but this step ran plain (no draft, or gamma 0)


class EventSink(Protocol):
    enabled: bool

    def on_session_start(self, seq) -> None: ...

    def on_step(self, seq, step: StepRecord) -> None: ...

    def on_session_end(self, seq) -> None: ...

    def on_event(self, seq, kind: str, detail: dict[str, Any]) -> None: ...


class NullSink:
    """The default: nothing recorded, nothing built (the scheduler checks `enabled`)."""

    enabled = False

    def on_session_start(self, seq) -> None:
        pass

    def on_step(self, seq, step: StepRecord) -> None:
        pass

    def on_session_end(self, seq) -> None:
        pass

    def on_event(self, seq, kind: str, detail: dict[str, Any]) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}


NULL_SINK = NullSink()
