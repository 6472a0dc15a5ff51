"""Requests, admission, KV budget and planning: the scheduler half of a step.

One `step()` reads top to bottom:

    begin_step          admit: waiting requests while the KV budget lasts; check_lengths
    complete_step
      plan              share_prefills, Speculator.propose -> Proposal, WorkItems
      grouping          the forwards the items run in: one (ragged); a hook may split them
      StepRunner.run    per group: batch, Decoder.forward, Speculator.settle -> Verdict, commit, emit

Every sequence has pending tokens `all_ids[num_cached:]` whose K/V are not yet in the
cache: the remaining prompt while prefilling, just the last sampled token when decoding,
the whole text again after a repair (`num_cached = 0` re-prefills). When a sequence's
pending tokens all fit in this step, the last row's logits (and those of any drafts)
are read and new tokens are produced.

The scheduler reaches the speculator through `propose` and `settle` (the latter inside
StepRunner) and `on_step` every step, `rollback` when it re-prefills, shares a prompt's K/V or
adopts recorded blocks, `prefix_limit` and `adopted` when it does (EAGLE-3's features of the
adopted blocks), and `release` when a request ends. Requests without speculation go the same way: their verdict is
one sampled token.

A planning policy (`planning`, given at open: MineDraft's two batches, mpi/minedraft.py) runs
each engine step in place of `step()` through this interface, and nothing else of the scheduler:

    begin_step()                 admission and cache-length repair, once per step; -> the running
                                 sequences (a copy: the policy partitions it)
    complete_step(leave_out=())  the rest of the step (plan, forwards, emit, telemetry) over the
                                 running sequences but `leave_out` (the batch being drafted);
                                 -> how many advanced
    speculator                   the drafting choices it orders with (`depth_for`)

`step()` is `begin_step()` then `complete_step()`.

Prefix caching: admitted prompts adopt the recorded blocks that begin them (`adopt_prefix`),
again each step while they prefill; committed full blocks are recorded after every step and at
release (`record_prefix`; model/kv_cache.py has the rules).

Fault isolation: an exception raised while one sequence's tokens are chosen (its penalties
and grammar, sampling, verification, drafter bookkeeping, non-finite rows in its logits)
fails that request alone (`fail_sequence`: 400 when its own values caused it, a
RequestError such as its grammar hitting the grammar engine's limits; 500 otherwise), frees
its KV blocks and drafter state; the rest of the batch goes on untouched. A failure that
belongs to no one sequence (building the batch, the target's forward, planning) fails the
sequences of that forward only (`fail_batch`), logged with their request ids. Both are
counted in `failures` (engine stats, /metrics).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Collection

from specbuild.errors import RequestError
from specbuild.model.kv_cache import PagedKVCache, salt_root
from specbuild.model.decoder import Decoder
from specbuild.engine.sequence import Sequence
from specbuild.engine.events import NULL_SINK
from specbuild.engine.step import StepRunner, WorkItem
from specbuild.engine.stepparts import StepParts

log = logging.getLogger("specbuild.scheduler")


class Scheduler:
    """Owns the target model and its cache; plans and runs steps over the engine's queue."""

    def __init__(self, model: Decoder, cache: PagedKVCache, max_batch_size: int, max_seq_len: int,
                 speculator, prefill_chunk: int = 256, waiting: collections.deque | None = None,
                 running: list | None = None, planning=None, prefix_cache: bool = True) -> None:
        self.model = model
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.speculator = speculator
        # the forwards a step's items run in: None runs them all in one ragged pass (the fastest
        # wherever measured); the binning benchmark sets one to measure others (bench/binning.py)
        self.grouping: Callable[[list[WorkItem]], list[list[WorkItem]]] | None = None
        # automatic prefix caching (model/kv_cache.py): prompts adopt recorded blocks of earlier text
        self.prefix_cache = prefix_cache
        self.parts = StepParts()  # where each step's time goes, by kind and batch (engine/stepparts.py)
        self.runner = StepRunner(self, model, cache, speculator, self.parts)
        # the engine's queue (BaseEngine.waiting / running), shared, mutated in place only
        self.waiting: collections.deque[Sequence] = collections.deque() if waiting is None else waiting
        self.running: list[Sequence] = [] if running is None else running
        self.budget_blocks = 0  # blocks promised to running sequences (never over-committed)
        self.sink = NULL_SINK  # telemetry (engine/events.py); Engine.set_sink attaches one
        # a planning policy given at open: its step(scheduler) runs each engine step through this
        # scheduler (MineDraft's two batches, mpi/minedraft.TwoBatchPlanning); None: step()
        self.planning = planning
        # requests failed alone inside a step (sequence) and forwards whose whole batch failed (step)
        self.failures = {"sequence": 0, "step": 0}

    # ---- admission --------------------------------------------------------------------
    @property
    def passes(self) -> int:
        """Target forwards run so far."""
        return self.runner.passes

    def block_budget(self, seq: Sequence) -> int:
        extra = self.speculator.draft_room
        tokens = min(seq.total_len + seq.params.max_tokens + extra + 1, self.max_seq_len + extra + 1)
        return -(-tokens // self.cache.block_size)

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            need = self.block_budget(seq)
            if self.budget_blocks + need > self.cache.num_blocks:
                if not self.running:
                    self.waiting.popleft()
                    self.fail(seq, f"request needs {need} KV blocks but the cache holds "
                                   f"{self.cache.num_blocks}; lower max_tokens or raise --kv-cache-tokens")
                    continue
                break
            self.waiting.popleft()
            seq.admission.budget_blocks = need
            self.budget_blocks += need
            self.cache.add(seq.seq_id, salt_root(seq.request.cache_salt))
            seq.tally.on_admit()
            self.running.append(seq)
            try:
                if self.sink.enabled:
                    self.sink.on_session_start(seq)
                if self.reuses_prefix(seq):
                    self.adopt_prefix(seq, first=True)
            except Exception as e:  # noqa: BLE001 - this request's failure, not its neighbours'
                self.fail_sequence(seq, e, "admitting it")

    # ---- prefix reuse ---------------------------------------------------------------------
    def reuses_prefix(self, seq: Sequence) -> bool:
        """Whether seq may start from recorded blocks: prefix caching is on and it asks for no
        prompt logprobs (those come from its own prefill's rows). A sibling choice of `n` > 1
        takes its source's blocks instead (share_prefills), adopted prefix included."""
        return self.prefix_cache and seq.request.prompt_logprobs is None and seq.admission.prefill_source is None

    def adopt_prefix(self, seq: Sequence, first: bool = False) -> None:
        """Extend seq's cached text with the longest run of recorded blocks that continues its
        prompt (at least the prompt's last token is left to compute: its row gives the first
        token's logits). At admission (first) and again each step while it prefills: a prompt
        admitted beside another with the same beginning takes the blocks the other has computed
        meanwhile (a `generate` batch with one system prompt)."""
        limit = len(seq.prompt_ids) - 1
        if seq.num_cached >= limit:
            return
        # a drafter that reads every row's features (EAGLE-3) bounds it to the blocks whose
        # features it keeps, and is handed them
        looked_up = limit if first else 0
        limit = self.speculator.prefix_limit(seq, limit)
        start = seq.num_cached
        n = self.cache.extend(seq.seq_id, seq.prompt_ids, limit, query=looked_up)
        if n:
            seq.set_cached(seq.num_cached + n)
            seq.tally.on_prefix_hit(n)
            self.speculator.adopted(seq, start, seq.num_cached)
            self.speculator.rollback(seq, seq.num_cached)

    def twin_prefilling(self, seq: Sequence, n: int, inflight: set[bytes]) -> bool:
        """Whether the block seq would compute next is one that another prompt's chunk computes
        in this step (same text from position 0: `inflight`); if not, the full prompt blocks of
        seq's chunk of n tokens join `inflight`."""
        bs, chain = self.cache.block_size, self.cache.seqs[seq.seq_id].chain
        first = seq.num_cached // bs
        if seq.num_cached % bs == 0 and first < len(chain) and chain[first] in inflight:
            return True
        inflight.update(chain[first:min(len(chain), (seq.num_cached + n) // bs)])
        return False

    def record_prefix(self, seq: Sequence) -> None:
        """Record seq's full blocks of committed text so that later prompts can adopt them: all of
        it where every kind of row writes the K/V a prompt row would (Decoder.rows_agree, or a
        model that is not row-invariant at all, whose reuse is as close as its batching), else
        only its prompt (a later prompt would compute the reply's positions as prompt rows)."""
        if self.prefix_cache and seq.seq_id in self.cache.seqs:
            upto = min(seq.num_cached, len(seq.all_ids))
            if self.model.row_invariant and not self.model.rows_agree:
                upto = min(upto, len(seq.prompt_ids))
            self.cache.register(seq.seq_id, seq.all_ids, upto)

    # ---- lifecycle ----------------------------------------------------------------------
    def release(self, seq: Sequence, record: bool = True) -> None:
        """End seq's hold on the cache and the drafters; its committed full blocks are recorded
        for later prompts first unless `record` is False (a failed request's K/V is not offered)."""
        was_running = seq in self.running
        if record and seq.finish_reason != "error":
            self.record_prefix(seq)
        if was_running:
            self.running.remove(seq)
            self.budget_blocks -= seq.admission.budget_blocks
        self.cache.release(seq.seq_id)
        self.speculator.release(seq)
        if was_running and self.sink.enabled:
            self.sink.on_session_end(seq)

    def fail(self, seq: Sequence, message: str, status: int = 500) -> None:
        seq.fail(message, status)

    @staticmethod
    def request_id(seq: Sequence) -> str:
        return seq.handle.request_id if seq.handle is not None else f"seq-{seq.seq_id}"

    def _release_quietly(self, seq: Sequence) -> None:
        """release() of a failing sequence (its blocks not recorded), logging (not raising) a
        drafter that fails to let go of the sequence."""
        try:
            self.release(seq, record=False)
        except Exception:  # noqa: BLE001 - the target's blocks are back already; a drafter's leak is logged
            log.exception("releasing request %s failed", self.request_id(seq))
            self.cache.release(seq.seq_id)
            if seq in self.running:
                self.running.remove(seq)
                self.budget_blocks -= seq.admission.budget_blocks

    def fail_sequence(self, seq: Sequence, exc: BaseException, while_: str) -> None:
        """`exc` was raised for seq alone: end that request with an error naming the cause
        (status 400 when its own values caused it: a RequestError; else 500), free its KV
        blocks and drafter state. Its neighbours in the batch are not touched."""
        client = isinstance(exc, RequestError)
        cause = (str(exc).splitlines() or [""])[0][:400]
        rid = self.request_id(seq)
        self.failures["sequence"] += 1
        if client:
            log.warning("request %s failed while %s: %s", rid, while_, cause)
            message = cause
        else:
            log.error("request %s failed while %s (its neighbours go on)", rid, while_, exc_info=exc)
            message = f"the engine failed this request while {while_}: {type(exc).__name__}: {cause}"
        if self.sink.enabled:
            try:
                self.sink.on_event(seq, "sequence_failure", {"while": while_, "status": 400 if client else 500,
                                                             "error": f"{type(exc).__name__}: {cause}"[:200]})
            except Exception:  # noqa: BLE001 - telemetry never decides a request's fate
                log.exception("telemetry sink failed on a sequence failure")
        self._release_quietly(seq)
        self.fail(seq, message, 400 if client else 500)

    def fail_batch(self, seqs: list[Sequence], exc: BaseException, while_: str) -> None:
        """A failure that belongs to no single sequence (the forward, building the batch):
        the sequences of that forward fail (500), nothing else; logged with their ids."""
        self.failures["step"] += 1
        ids = [self.request_id(s) for s in seqs]
        log.error("engine step failed while %s; failing the %d request(s) of that forward: %s", while_, len(seqs),
                  ", ".join(ids), exc_info=exc)
        for seq in seqs:
            self._release_quietly(seq)
            self.fail(seq, f"internal error in the engine step while {while_} (see the server log); "
                           "other requests in the batch failed too")

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)
        seq.abort()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def set_cache_lengths(self, seq: Sequence, length: int) -> None:
        """Target and drafter caches of seq move to `length` together (a repair's rollback,
        a shared prompt's copy)."""
        self.cache.set_length(seq.seq_id, length)
        self.speculator.rollback(seq, length)

    def check_lengths(self) -> None:
        """A cache whose length disagrees with the sequence is repaired by re-prefilling it;
        never ignored (it would make every later token wrong)."""
        for seq in self.running:
            have = self.cache.length(seq.seq_id)
            if have != seq.num_cached:
                log.warning("sequence %d: target KV holds %d tokens, expected %d; re-prefilling",
                            seq.seq_id, have, seq.num_cached)
                if self.sink.enabled:
                    self.sink.on_event(seq, "kv_desync", {"cache": "target", "have": have, "expected": seq.num_cached,
                                                          "repair": "re-prefill"})
                seq.set_cached(0)
                seq.tally.on_repair()
                self.set_cache_lengths(seq, 0)

    # ---- the step -----------------------------------------------------------------------
    def plan(self, leave_out: Collection[Sequence] = ()) -> tuple[list[WorkItem], "object"]:
        """(work for every running sequence not in `leave_out` (MineDraft's batch being
        drafted), the speculator's Proposal). `self.running` itself is never replaced:
        lock-free readers (stats()) always see every running request."""
        items, budget = [], self.prefill_chunk
        skip = {s.seq_id for s in leave_out}
        running = [s for s in self.running if s.seq_id not in skip] if skip else list(self.running)
        self.share_prefills(running)
        proposal = self.speculator.propose(running, on_error=self.fail_sequence)
        drafts = proposal.drafts
        running = [s for s in running if not s.finished]  # a sequence failed alone while drafting
        for seq in running:
            pending = seq.all_ids[seq.num_cached:]
            if len(pending) == 1 or seq.seq_id in drafts:
                items.append(WorkItem(seq, pending, drafts.get(seq.seq_id), seq.num_cached, completes=True))
        inflight: set[bytes] = set()  # hashes of the prompt blocks this step's prefill chunks complete
        for seq in running:
            pending = seq.all_ids[seq.num_cached:]
            if len(pending) > 1 and seq.seq_id not in drafts and budget > 0 and seq.admission.prefill_source is None:
                if self.prefix_cache and seq.num_cached < len(seq.prompt_ids) - 1 and self.reuses_prefix(seq):
                    self.adopt_prefix(seq)  # blocks others computed since: a batch with one system prompt
                    pending = seq.all_ids[seq.num_cached:]
                    if self.twin_prefilling(seq, min(len(pending), budget), inflight):
                        continue  # another prompt computes the same next block now: adopt it next step
                chunk = pending[:budget]
                budget -= len(chunk)
                items.append(WorkItem(seq, chunk, None, seq.num_cached, completes=len(chunk) == len(pending)))
        return items, proposal

    def share_prefills(self, running: list[Sequence]) -> None:
        """Sequences that share another's prompt (`n` > 1 choices: prefill_source) take its
        prompt's K/V once it has them, instead of prefilling again: full blocks are held by both
        (read-only: model/kv_cache.py), the partial last one copied, and only the last prompt
        token is run as the sequence's first decode step. Until then they
        wait (no prefill chunk of their own); if the source is gone first, they prefill."""
        for seq in running:
            src = seq.admission.prefill_source
            if src is None:
                continue
            n = len(seq.prompt_ids) - 1
            if n <= 0 or seq.num_cached or src.finished or src.seq_id not in self.cache.seqs or src not in self.running:
                seq.admission.prefill_source = None  # prefill as usual
                continue
            if src.num_cached < n:
                continue  # wait: the source is still prefilling
            self.cache.share(src.seq_id, seq.seq_id, n)  # full blocks held by both, the last one copied
            seq.set_cached(n)
            self.set_cache_lengths(seq, n)
            if seq.request.prompt_logprobs is not None:  # the prompt is the source's: so are its logprobs
                seq.scoring.score_prompt(list(src.scoring.prompt_logprobs), src.scoring.prompt_scored)
            seq.admission.prefill_source = None
            seq.tally.note("stat_shared_prefill_tokens", n)

    def run_step(self) -> int:
        """One step of the engine loop: the planning policy's, else `step()`."""
        return self.planning.step(self) if self.planning is not None else self.step()

    def step(self) -> int:
        """One batched step. Returns the number of sequences that advanced."""
        t0 = time.perf_counter()
        if not self.begin_step():
            return 0
        return self.complete_step(t0=t0)

    # ---- what a planning policy uses (see the module doc) -------------------------------
    def begin_step(self) -> list[Sequence]:
        """Admit waiting requests while the KV budget lasts, then repair every cache whose length
        disagrees with its sequence (check_lengths): once per step, before complete_step.
        Returns the running sequences (a copy)."""
        self.admit()
        if self.running:
            self.check_lengths()
        return list(self.running)

    def complete_step(self, leave_out: Collection[Sequence] = (), t0: float | None = None) -> int:
        """The rest of the step begun by begin_step: plan, run the forwards and emit, over the
        running sequences but `leave_out` (MineDraft: the batch the draft rank is drafting).
        Returns the number of sequences that advanced. t0: when the step began (its timing)."""
        t0 = time.perf_counter() if t0 is None else t0
        if not self.running:
            return 0
        parts = self.parts
        try:
            tp = time.perf_counter()
            items, proposal = self.plan(leave_out)
            parts.add("plan", time.perf_counter() - tp)
            parts.add("draft", sum(proposal.draft_ms.values()) / 1e3)
            groups = [] if not items else [items] if self.grouping is None else self.grouping(items)
        except Exception as e:  # noqa: BLE001 - planning belongs to no single sequence
            skip = {s.seq_id for s in leave_out}
            self.fail_batch([s for s in self.running if s.seq_id not in skip], e, "planning the step")
            return 0
        runner = self.runner
        runner.emitted = 0
        for group in groups:
            runner.run(group, proposal)
        if self.prefix_cache:
            for it in items:
                if not it.seq.finished:
                    self.record_prefix(it.seq)
        decode = [it for it in items if it.completes]
        methods = {d.method for d in proposal.drafts.values()}
        kind = "prefill" if not decode else "plain" if not methods else methods.pop() if len(methods) == 1 else "mixed"
        rows = sum(it.width for it in items)
        parts.end(kind, len(decode), runner.emitted, rows, time.perf_counter() - t0)
        self.speculator.on_step(kind, len(decode), runner.emitted, rows, parts.last_total)
        return len(items)
