"""Where the served steps' time goes: each part of every step the engine runs, by what the step
did (plain decoding, or the drafter whose drafts it verified) and by its batch size.

The scheduler (engine/scheduler.py) times one step as it runs, in the thread that runs it:

    plan      share_prefills, the speculator's propose (drafting is inside: `draft`)
    draft     the drafters' propose calls alone (Proposal.draft_ms)
    build     build_forward_batch
    forward   the target's forward
    settle    per item: logits checks and processing, verification or sampling, the drafters'
              observe and rollback (Speculator.settle)
    commit    per item: K/V moves and the cache's length (StepRunner.commit)
    emit      per item: appending the tokens, telemetry, the event to the waiting handle
    other     the rest of the step (admission, check_lengths, grouping, the loop around the groups)

Every figure is a sum over steps of one key; `describe()` gives ms per step, tokens per step and
tokens per second of step time. The accounting costs a few clock reads per step. Steps that only
prefill (no token chosen) are counted apart ("prefill"); a step that mixes prefill chunks with
decode rows is keyed by its decode rows. The speculation controller (speculation/goodput.py)
reads the same step times: it learns what a step costs where it runs.
"""

from __future__ import annotations

import threading

from specbuild.speculation.goodput import batch_bucket  # one grouping of batch sizes for both

PARTS = ("plan", "draft", "build", "forward", "settle", "commit", "emit", "other")


class StepParts:
    """Sums of each part's seconds by (kind, batch bucket); written by the step's thread only,
    read by anyone (a snapshot under a lock that the writer takes once per step)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sums: dict[tuple[str, str], list[float]] = {}  # key -> [steps, tokens, rows, seconds of each part..., total]
        self.cur = dict.fromkeys(PARTS, 0.0)
        self.last_total = 0.0  # the last step's wall seconds
        self.last_shape: tuple | None = None

    def add(self, part: str, seconds: float) -> None:
        self.cur[part] += seconds

    def end(self, kind: str, batch: int, tokens: int, rows: int, total: float) -> None:
        """Close one step: `kind` plain, prefill or the drafter verified; `batch` its decode rows'
        sequences; `tokens` chosen; `rows` the forwards' rows; `total` its wall seconds."""
        cur = self.cur
        self.last_total = total
        self.last_shape = (kind, batch, rows)  # what the step was: steps of one shape cost alike
        cur["other"] = max(0.0, total - sum(cur[p] for p in PARTS if p not in ("other", "draft")))
        key = (kind, batch_bucket(batch))
        with self._lock:
            acc = self.sums.get(key)
            if acc is None:
                acc = self.sums[key] = [0.0] * (3 + len(PARTS) + 1)
            acc[0] += 1
            acc[1] += tokens
            acc[2] += rows
            for i, p in enumerate(PARTS):
                acc[3 + i] += cur[p]
            acc[-1] += total
        self.cur = dict.fromkeys(PARTS, 0.0)

    def describe(self) -> list[dict]:
        """One row per (kind, batch): steps, tokens and rows per step, ms per step of each part
        and in all, output tokens per second of step time."""
        with self._lock:
            items = sorted(self.sums.items(), key=lambda kv: (kv[0][0] != "plain", kv[0][0], kv[0][1]))
            items = [(k, list(v)) for k, v in items]
        out = []
        for (kind, batch), acc in items:
            steps = acc[0]
            row = {"kind": kind, "batch": batch, "steps": int(steps), "tokens_per_step": round(acc[1] / steps, 3),
                   "rows_per_step": round(acc[2] / steps, 2)}
            row.update({f"{p}_ms": round(acc[3 + i] / steps * 1e3, 3) for i, p in enumerate(PARTS)})
            row["step_ms"] = round(acc[-1] / steps * 1e3, 3)
            row["tokens_per_s"] = round(acc[1] / acc[-1], 1) if acc[-1] > 0 else 0.0
            out.append(row)
        return out

    def reset(self) -> None:
        with self._lock:
            self.sums.clear()
