"""TelemetrySink: the engine's EventSink (engine/events.py) backed by a Store.

The step loop's calls build one tuple and `put_nowait` it on a bounded queue; a background
thread takes batches off the queue and writes each batch in one transaction. When the queue
is full the row is dropped and counted (`stats()`: telemetry_rows_dropped, by table in
`dropped`): generation never waits for the database. A crash loses the queued rows and the
batch being written; everything committed before stays (SQLite WAL, PostgreSQL).
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import threading
import time
import uuid

from specbuild.engine.events import StepRecord
from specbuild.telemetry.schema import EVENT_COLUMNS, SESSION_COLUMNS, STEP_COLUMNS
from specbuild.telemetry.store import Store, describe

log = logging.getLogger("specbuild.telemetry")

ROLLING = 20  # steps in the session's rolling acceptance (the article's window)

_INSERT_SESSION = (f"INSERT INTO speculation_sessions ({', '.join(SESSION_COLUMNS)}) VALUES "
                   f"({', '.join('?' for _ in SESSION_COLUMNS)}) ON CONFLICT (session_id) DO NOTHING")
_UPSERT_SESSION = (f"INSERT INTO speculation_sessions ({', '.join(SESSION_COLUMNS)}) VALUES "
                   f"({', '.join('?' for _ in SESSION_COLUMNS)}) ON CONFLICT (session_id) DO UPDATE SET "
                   + ", ".join(f"{c} = excluded.{c}" for c in SESSION_COLUMNS[1:] if c != "created_at"))
_INSERT_STEP = (f"INSERT INTO speculation_steps ({', '.join(STEP_COLUMNS)}) VALUES "
                f"({', '.join('?' for _ in STEP_COLUMNS)})")
_INSERT_EVENT = (f"INSERT INTO speculation_events ({', '.join(EVENT_COLUMNS)}) VALUES "
                 f"({', '.join('?' for _ in EVENT_COLUMNS)})")
_SQL = {"session": _INSERT_SESSION, "session_end": _UPSERT_SESSION, "step": _INSERT_STEP, "event": _INSERT_EVENT}
TABLE = {"session": "sessions", "session_end": "sessions", "step": "steps", "event": "events"}


class _Session:
    __slots__ = ("session_id", "created_at", "rolling", "steps")

    def __init__(self, session_id: str, created_at: float) -> None:
        self.session_id = session_id
        self.created_at = created_at
        self.rolling: collections.deque = collections.deque(maxlen=ROLLING)
        self.steps = 0


class TelemetrySink:
    """Records sessions, steps and events of one engine into `target` (path or DSN).

    model_id: the engine's; source / run_id: where the rows come from (generate, serve,
    bench, triton; a bench run's id). queue_size bounds the rows in memory; batch_size
    the rows per transaction; delay_s sleeps before each batch (load tests only)."""

    enabled = True

    def __init__(self, target: str, model_id: str, source: str = "generate", run_id: str | None = None,
                 queue_size: int = 8192, batch_size: int = 512, flush_s: float = 0.2, delay_s: float = 0.0) -> None:
        if not 1 <= queue_size <= 1 << 22:
            raise ValueError(f"telemetry queue_size={queue_size} is out of range [1, {1 << 22}]")
        self.target = target
        self.model_id = model_id
        self.source = source
        self.run_id = run_id
        self.batch_size = batch_size
        self.flush_s = flush_s
        self.delay_s = delay_s
        self.store = Store(target)  # opened (and migrated) here: a bad target fails before any request
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._sessions: dict[int, _Session] = {}  # seq_id -> session (step loop thread only)
        self.dropped: collections.Counter = collections.Counter()  # table -> rows dropped (queue full)
        self.written: collections.Counter = collections.Counter()
        self.write_errors = 0
        self._closed = False
        self._queued_n = 0  # rows put on the queue (step loop)
        self._done_n = 0  # rows taken off it and written or failed (writer)
        self._thread = threading.Thread(target=self._run, name="specbuild-telemetry", daemon=True)
        self._thread.start()

    # ---- the step loop's side (never blocks) ----------------------------------------------------
    def _put(self, kind: str, row: tuple) -> None:
        try:
            self._queue.put_nowait((kind, row))
            self._queued_n += 1
        except queue.Full:
            self.dropped[TABLE[kind]] += 1

    def _session(self, seq) -> _Session:
        s = self._sessions.get(seq.seq_id)
        if s is None:  # admitted before the sink was attached
            s = self._sessions[seq.seq_id] = _Session(uuid.uuid4().hex, time.time())
        return s

    def _session_row(self, seq, s: _Session, end: bool) -> tuple:
        spec = seq.spec
        stats = seq.stats() if end else None
        reason = seq.finish_reason if seq.finished else None
        status = ("active" if not end else "completed" if reason in ("stop", "length")
                  else "failed" if reason == "error" else "aborted")
        t = seq.tally
        gammas = t.gammas
        return (s.session_id, seq.request.request_id, s.created_at, time.time() if end else None, self.model_id,
                spec.method if spec is not None else "none", getattr(spec, "tree", None), seq.admission.content_type,
                seq.admission.content_type_source, self.source, self.run_id, len(seq.prompt_ids), len(seq.output_ids),
                gammas[-1] if gammas else 0, sum(a for _, a in s.rolling), sum(d for d, _ in s.rolling),
                t.drafted, t.accepted, t.drafted - t.accepted, t.target_passes, t.verify_passes,
                seq.num_cached, stats["ttft_ms"] if stats and t.t_first else None,
                stats["tpot_ms"] if stats and len(seq.output_ids) > 1 else None, status, reason)

    def on_session_start(self, seq) -> None:
        s = self._sessions[seq.seq_id] = _Session(uuid.uuid4().hex, time.time())
        self._put("session", self._session_row(seq, s, end=False))

    def on_step(self, seq, step: StepRecord) -> None:
        s = self._session(seq)
        s.steps += 1
        if step.drafted:
            s.rolling.append((step.depth, step.accepted))
        tpot = (step.draft_ms + step.target_ms) / max(step.emitted, 1)
        self._put("step", (s.session_id, step.step_num, step.method, getattr(seq.spec, "tree", None), step.gamma,
                           step.drafted, step.accepted, step.depth - step.accepted if step.drafted else 0, step.emitted,
                           step.depth, int(step.fallback), step.draft_ms, step.target_ms, tpot, step.batch_size,
                           time.time(), self._sources(seq, step)))

    @staticmethod
    def _sources(seq, step: StepRecord) -> str | None:
        """The step's candidate sources (schema.STEP_COLUMNS), as the speculator left them."""
        sources = seq.spec_state.candidate_sources if step.drafted else None
        return json.dumps(sources, separators=(",", ":")) if sources else None

    def on_session_end(self, seq) -> None:
        s = self._sessions.pop(seq.seq_id, None) or _Session(uuid.uuid4().hex, time.time())
        self._put("session_end", self._session_row(seq, s, end=True))

    def on_event(self, seq, kind: str, detail: dict) -> None:
        s = self._session(seq) if seq is not None else None
        self._put("event", (s.session_id if s else None, kind, seq.tally.verify_passes if seq is not None else None,
                            json.dumps(detail, default=str), time.time()))

    # ---- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=self.flush_s)
            except queue.Empty:
                if self._closed:
                    break
                continue
            if first is None:  # close(): everything before it has been written
                break
            batch = [first]
            stop = False
            while len(batch) < self.batch_size:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            if self.delay_s:
                time.sleep(self.delay_s)
            self._write(batch)
            self._done_n += len(batch)
            if stop:
                break
        self.store.close()

    def _write(self, batch: list[tuple[str, tuple]]) -> None:
        # in order, consecutive rows of one kind in one executemany (a session's end after its start)
        groups: list[tuple[str, list]] = []
        for kind, row in batch:
            if groups and groups[-1][0] == kind:
                groups[-1][1].append(row)
            else:
                groups.append((kind, [row]))
        try:
            self.store.begin()
            for kind, rows in groups:
                self.store.executemany(_SQL[kind], rows)
            self.store.commit()
            for kind, rows in groups:
                self.written[TABLE[kind]] += len(rows)
        except self.store.errors as e:
            self.store.rollback()
            self.write_errors += 1
            for kind, rows in groups:
                self.dropped[TABLE[kind]] += len(rows)
            if self.write_errors == 1 or self.write_errors % 100 == 0:
                log.error("telemetry store %s: a batch of %d rows was not written (%s); %d failed batches so far",
                          describe(self.target), len(batch), e, self.write_errors)

    # ---- control --------------------------------------------------------------------------------
    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued row is written (tests, end of a run). True when drained."""
        target, deadline = self._queued_n, time.monotonic() + timeout
        while self._done_n < target:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop the writer (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def stats(self) -> dict:
        return {"telemetry_rows_dropped": sum(self.dropped.values()), "telemetry_rows_written": sum(self.written.values()),
                "telemetry_rows_queued": self._queue.qsize(), "telemetry_write_errors": self.write_errors}
