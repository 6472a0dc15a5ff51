"""MineDraft: the draft rank drafts one batch while the target verifies the other.

The decoding requests that speculate with the draft model form two batches. One step:

    send batch B's draft request (non-blocking)      rank 1 drafts B
    verify batch A with the drafts received last step (plus prefill chunks, plain requests)
    receive B's drafts (by a deadline)               then A and B swap roles

so the drafting time hides behind verification. Placement (the balance counter
`balance` = |batch 0| - |batch 1|, kept within [-1, 1]): a request that starts decoding
joins the batch being drafted this step unless that batch is already the larger one, and
a surplus of two or more moves to the other batch (preferably requests whose drafts are
not in hand); finished and aborted requests leave their batch at the next step. When one batch is empty the step is
ordinary speculation (draft, wait, verify) through the same remote drafter. KV blocks of
the target are reserved when a sequence is verified (build_forward_batch), never for
the batch that is only being drafted, whose draft K/V lives on the draft rank: nothing is
allocated twice (the paper's deferred allocation).

Keeping both ranks busy, and nobody waiting a turn it does not need to:

- a request is admitted at the first step after it is submitted (Engine.submit queues it
  without the engine lock) and its prefill chunks run in the verifier's pass of that step,
  whichever batch is verified; its prompt goes to the draft rank in the same step
  (`RemoteDraftProposer.prefill`, not awaited), which fills the draft cache meanwhile;
- a sequence whose verify turn comes without drafts in hand (it just started decoding, the
  step before was ordinary, it was resynced) is drafted then, synchronously, on the draft
  rank that is idle at that moment, instead of decoding a single token (per sequence, not
  per step);
- when one batch is empty the step is ordinary speculation through the same remote drafter.

Which drafters can run on the draft rank: the draft model (this module). Medusa or EAGLE
heads would need the target's hidden states of each sequence's last verification shipped
over (the alternation makes them available one turn ahead), a copy of the lm_head there, and
they cost little next to a verification pass: hiding them does not repay the extra target
passes that two half-size batches take, so they stay on rank 0 (ordinary speculation).

Faults: the remote drafter never raises. A lost or late draft rank (DistContext abandons
the link) or a failed sequence yields no drafts, which the scheduler verifies as plain
decoding; `health()` reports it for /health.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from specbuild.dist import draft_worker as W
from specbuild.speculation.state import NO_ROLLBACK
from specbuild.speculation.proposers.base import Draft
from specbuild.engine.scheduler import Scheduler

log = logging.getLogger("specbuild.minedraft")


class MpiTransport:
    """Rank 0's end of the link over a DistContext."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.ahead: list = []  # sends not awaited (prefill notices); complete once a later reply came

    @property
    def healthy(self) -> bool:
        return self.ctx.healthy

    @property
    def reason(self) -> str | None:
        return self.ctx.reason

    def post(self, request: np.ndarray, meta_len: int, prob_rows: int, vocab: int):
        """Pre-post the reply's receives, then send the request. Returns a ticket."""
        meta = np.empty(meta_len, dtype=np.int64)
        probs = np.empty((prob_rows, vocab), dtype=np.float32)
        pendings = [self.ctx.irecv(meta, W.TAG_REPLY), self.ctx.irecv(probs, W.TAG_PROBS),
                    self.ctx.isend(request, W.TAG_REQUEST)]
        return pendings, meta, probs

    def collect(self, ticket, deadline: float):
        pendings, meta, probs = ticket
        if not self.ctx.wait(pendings, deadline):
            return None
        if self.ahead:  # the draft rank read them before this request (MPI keeps the order): done
            self.ctx.wait(self.ahead, time.monotonic() + 1.0)
            self.ahead = []
        meta = meta[:int(meta[3])]
        return meta, probs

    def notify(self, request: np.ndarray) -> None:
        self.ctx.notify(request, W.TAG_REQUEST)

    def send_ahead(self, request: np.ndarray) -> None:
        """Send without waiting: a large prefill notice must not hold the verifier while the
        draft rank is busy drafting. A lost link shows up at the next reply's deadline."""
        pending = self.ctx.isend(request, W.TAG_REQUEST)
        if pending is not None:
            self.ahead.append(pending)

    def handshake(self, timeout_s: float) -> dict:
        """Wait (bounded) for the draft rank's hello; {} when it never came (link abandoned)."""
        hello = np.zeros(W.HELLO_LEN, dtype=np.int64)
        if not self.ctx.wait([self.ctx.irecv(hello, W.TAG_HELLO)], time.monotonic() + timeout_s):
            return {}
        return {"pid": int(hello[0]), "vocab": int(hello[1]), "draft_cache_blocks": int(hello[2])}

    def close(self) -> None:
        """Tell a healthy draft rank to stop (bounded); the link is unused afterwards."""
        if self.ctx.healthy:
            self.ctx.notify(W.encode_request(W.KIND_STOP, 0, [], []), W.TAG_REQUEST)
            self.ctx.abandon("shut down")


class LoopbackTransport:
    """In-process link to a DraftWorker (tests, and a reference for the MPI path).
    `fail_after` requests, it behaves as a dead draft rank."""

    def __init__(self, worker: "W.DraftWorker", fail_after: int | None = None) -> None:
        self.worker = worker
        self.fail_after = fail_after
        self.reason: str | None = None
        self.posted = 0

    @property
    def healthy(self) -> bool:
        return self.reason is None

    def post(self, request: np.ndarray, meta_len: int, prob_rows: int, vocab: int):
        self.posted += 1
        if self.fail_after is not None and self.posted > self.fail_after:
            self.reason = "loopback drafter killed"
            return None
        _, reply = self.worker.handle(request)
        return reply

    def collect(self, ticket, deadline: float):
        return ticket

    def notify(self, request: np.ndarray) -> None:
        if self.healthy:
            self.worker.handle(request)

    send_ahead = notify


class RemoteDraftProposer:
    """The Proposer protocol over a transport. `propose` uses drafts prefetched by the
    MineDraft step when they are still valid; otherwise (ordinary speculation) it makes a
    synchronous round trip, unless `sync_allowed` is False (inside a MineDraft step)."""

    name = "draft"

    def __init__(self, transport, vocab: int, timeout_s: float = 5.0) -> None:
        self.transport = transport
        self.vocab = vocab
        self.timeout_s = timeout_s
        self.prefetched: dict[int, tuple[int, Draft]] = {}  # seq_id -> (text length it drafted from, draft)
        self.releases: list[int] = []
        self.sync_allowed = True
        self.step = 0
        # seconds, summed over requests: drafting on the draft rank; request send -> seen there
        # (transfer + its polling); reply ready -> collected here, counted from the later of
        # "ready" and "verifier free to look" (transfer + our polling); encode/decode here
        self.stats = {"requests": 0, "sequences": 0, "draft_seconds": 0.0, "round_trip_seconds": 0.0,
                      "request_latency_seconds": 0.0, "reply_latency_seconds": 0.0, "codec_seconds": 0.0,
                      "failed_sequences": 0, "resyncs": 0, "prefilled_sequences": 0}

    @property
    def healthy(self) -> bool:
        return self.transport.healthy

    # ---- the split round trip ------------------------------------------------------------
    def send(self, pairs: list[tuple[object, int]]):
        """Ask for drafts of (seq, gamma) pairs; returns a ticket for `receive` (None: nothing sent)."""
        pairs = [(s, g) for s, g in pairs if g > 0 and not s.spec_state.remote_failed]
        if not pairs or not self.healthy:
            return None
        self.step += 1
        orders = []
        for seq, gamma in pairs:
            ids = seq.all_ids
            st = seq.spec_state
            sent = st.remote_sent or 0
            p = seq.params
            # the draft cache may hold at most the committed text (never past len - 1)
            keep = min(st.remote_keep, len(ids) - 1) if sent else 0
            orders.append(W.Order(seq.seq_id, keep, sent, ids[sent:], gamma, p.top_k, p.seed,
                                  float(p.temperature), float(p.top_p)))
            st.remote_sent, st.remote_keep = len(ids), NO_ROLLBACK
            st.remote_drafted = True  # the draft cache now holds K/V of drafted tokens
        tc = time.perf_counter()
        request = W.encode_request(W.KIND_DRAFT, self.step, orders, self.releases)
        self.stats["codec_seconds"] += time.perf_counter() - tc
        self.releases = []
        meta_len = W.REP_HEAD + sum(W.REP_FIELDS + g for _, g in pairs)
        prob_rows = sum(g for s, g in pairs if not s.params.greedy)
        t0 = time.monotonic()
        ticket = self.transport.post(request, meta_len, prob_rows, self.vocab)
        if ticket is None:
            return None
        return ticket, t0, {s.seq_id: s for s, _ in pairs}

    def prefill(self, seqs: list) -> int:
        """Send the prompts of sequences the target is prefilling, so that the draft rank fills
        its cache meanwhile (no reply is awaited). Only the committed text goes: the prompt,
        fixed while it is prefilled. Returns how many were sent."""
        seqs = [s for s in seqs if s.spec_state.remote_sent is None and not s.spec_state.remote_failed]
        if not seqs or not self.healthy:
            return 0
        orders = []
        for seq in seqs:
            p = seq.params
            orders.append(W.Order(seq.seq_id, 0, 0, list(seq.all_ids), 0, p.top_k, p.seed,
                                  float(p.temperature), float(p.top_p)))
            st = seq.spec_state
            st.remote_sent, st.remote_keep = len(seq.all_ids), NO_ROLLBACK
            st.remote_drafted = False  # only committed text so far: valid at any target length
        self.transport.send_ahead(W.encode_request(W.KIND_PREFILL, self.step, orders, self.releases))
        self.releases = []
        self.stats["prefilled_sequences"] += len(orders)
        return len(orders)

    def receive(self, sent) -> None:
        """Collect the drafts of `send` by its deadline into `prefetched`."""
        if sent is None:
            return
        ticket, t0, seqs = sent
        t_free = time.monotonic()  # the verifier starts looking for the reply
        # the deadline runs from here: a long verification of the other batch is not the drafter's fault
        reply = self.transport.collect(ticket, t_free + self.timeout_s)
        t_got = time.monotonic()
        if reply is None:
            log.warning("no drafts from the draft rank (%s): continuing with plain decoding", self.transport.reason)
            return
        meta, probs = reply
        sampled = {i for i, s in seqs.items() if not s.params.greedy}
        tc = time.perf_counter()
        _, results, timing = W.decode_reply(meta, probs, sampled)
        self.stats["codec_seconds"] += time.perf_counter() - tc
        self.stats["requests"] += 1
        self.stats["sequences"] += len(results)
        self.stats["draft_seconds"] += timing.draft_seconds
        self.stats["round_trip_seconds"] += t_got - t0
        if timing.seen_at:  # CLOCK_MONOTONIC is one clock for every process on the host
            self.stats["request_latency_seconds"] += max(0.0, timing.seen_at - t0)
            self.stats["reply_latency_seconds"] += max(0.0, t_got - max(timing.ready_at, t_free))
        for seq_id, (status, tokens, draft_probs) in results.items():
            seq = seqs[seq_id]
            if status == W.RESYNC:
                seq.spec_state.remote_sent, seq.spec_state.remote_keep = 0, 0
                self.stats["resyncs"] += 1
            elif status == W.FAILED:
                seq.spec_state.remote_failed = True
                self.stats["failed_sequences"] += 1
                log.warning("sequence %d: the drafter failed on it; decoding it plainly from now on", seq_id)
            elif tokens and not seq.finished:  # (an abort may have come in the meantime)
                self.prefetched[seq_id] = (len(seq.all_ids), Draft(tokens, draft_probs, method="draft"))

    # ---- Proposer protocol -------------------------------------------------------------------
    def propose(self, seqs: list, gammas: list[int]) -> list[Draft | None]:
        missing = [(s, g) for s, g in zip(seqs, gammas) if g > 0 and not self._valid(s)]
        if missing and self.sync_allowed:
            self.receive(self.send(missing))
        out: list[Draft | None] = []
        for seq, gamma in zip(seqs, gammas):
            entry = self.prefetched.pop(seq.seq_id, None)
            if entry is None or gamma <= 0 or entry[0] != len(seq.all_ids):
                out.append(None)
                continue
            draft = entry[1]
            if len(draft.tokens) > gamma:  # a prefix of a sampled chain is a valid draft
                draft = Draft(draft.tokens[:gamma], None if draft.probs is None else draft.probs[:gamma],
                              method="draft")
            out.append(draft)
        return out

    def has_draft(self, seq) -> bool:
        return self._valid(seq)

    def _valid(self, seq) -> bool:
        entry = self.prefetched.get(seq.seq_id)
        return entry is not None and entry[0] == len(seq.all_ids)

    def rollback(self, seq, length: int) -> None:
        # a draft cache that holds only committed text (a prefilled prompt) is valid at any
        # target length: the target's chunked prefill must not trim it
        st = seq.spec_state
        if st.remote_sent is not None and st.remote_drafted:
            st.remote_keep = min(st.remote_keep, length)

    def release(self, seq) -> None:
        self.prefetched.pop(seq.seq_id, None)
        st = seq.spec_state
        if st.remote_sent is not None:
            st.remote_sent, st.remote_keep = None, NO_ROLLBACK
            self.releases.append(seq.seq_id)

    def flush_releases(self) -> None:
        if self.releases and self.healthy:
            self.transport.notify(W.encode_request(W.KIND_RELEASE, self.step, [], self.releases))
        self.releases = []


class MineDraftScheduler(Scheduler):
    """Scheduler whose draft-model requests alternate between two batches (see module doc)."""

    def __init__(self, base: Scheduler, remote: RemoteDraftProposer) -> None:
        super().__init__(base.model, base.cache, base.max_batch_size, base.max_seq_len, base.prefill_chunk,
                         base.speculator)
        self.waiting, self.running, self.budget_blocks = base.waiting, base.running, base.budget_blocks
        self.sink = base.sink  # a telemetry sink attached before install keeps recording
        self.remote = remote
        self.batches: tuple[list, list] = ([], [])
        self.turn = 0  # the batch verified this step; 1 - turn is drafted
        self.balance = 0
        self.stats = {"minedraft_steps": 0, "ordinary_steps": 0, "verify_seconds": 0.0, "wait_seconds": 0.0,
                      "imbalance_sum": 0, "batch_sum": 0, "sync_drafted_sequences": 0, "sync_draft_seconds": 0.0}

    def uses_draft(self, seq) -> bool:
        return seq.spec is not None and seq.spec.method in ("draft", "auto") and not seq.spec_state.remote_failed

    def sync_batches(self) -> None:
        """Recycle sequences that left, place new decoders (balance counter), rebalance."""
        live = {id(s) for s in self.running if not s.finished and s.num_cached >= len(s.all_ids) - 1
                and self.uses_draft(s)}
        for batch in self.batches:
            batch[:] = [s for s in batch if id(s) in live]
        placed = {id(s) for b in self.batches for s in b}
        drafted, verified = self.batches[1 - self.turn], self.batches[self.turn]
        for seq in self.running:
            if id(seq) in live and id(seq) not in placed:
                (drafted if len(drafted) <= len(verified) else verified).append(seq)
        for big, small in ((drafted, verified), (verified, drafted)):
            while len(big) - len(small) >= 2:  # prefer moving one whose drafts are not in hand
                victim = ([s for s in big if not self.remote.has_draft(s)] or big)[-1]
                big.remove(victim)
                small.append(victim)
        assert not {id(s) for s in self.batches[0]} & {id(s) for s in self.batches[1]}
        self.balance = len(self.batches[0]) - len(self.batches[1])

    def draft_orders(self, batch: list) -> list[tuple[object, int]]:
        """(seq, gamma) for the batch to draft: the speculator's method and depth choices."""
        spec = self.speculator
        pairs = []
        for seq in batch:
            if spec.choose_method(seq) != "draft":
                continue
            gamma = spec.controller.next(seq, "draft")
            pairs.append((seq, max(0, min(gamma, spec.max_draft_len, seq.remaining - 1))))
        return pairs

    def step(self) -> int:
        self.admit()
        if not self.running:
            self.remote.flush_releases()
            return 0
        self.check_lengths()
        self.sync_batches()
        verified, drafted = self.batches[self.turn], self.batches[1 - self.turn]
        # prompts the target prefills this step go to the draft rank too, so that its cache
        # fills meanwhile instead of inside the sequence's first draft round trip
        prefilling = [s for s in self.running if s.num_cached < len(s.all_ids) - 1 and self.uses_draft(s)]
        if not (verified and drafted and self.remote.healthy):
            self.stats["ordinary_steps"] += 1
            self.remote.sync_allowed = True
            placed = verified or drafted
            if not placed:  # no draft round trip in this step to queue behind the prefill
                self.remote.prefill(prefilling)
            n = super().step()
            if placed:
                self.remote.prefill([s for s in prefilling if not s.finished])
        else:
            self.stats["minedraft_steps"] += 1
            self.stats["imbalance_sum"] += abs(len(verified) - len(drafted))
            self.stats["batch_sum"] += len(verified) + len(drafted)
            # per sequence, not per step: a sequence to verify whose drafts are not in hand (it just
            # started decoding, the previous step was ordinary, it was resynced) is drafted now,
            # on the idle draft rank, before the other batch's request; otherwise it would get one
            # token from this pass instead of its accepted run
            missing = [(s, g) for s, g in self.draft_orders(verified) if g > 0 and not self.remote.has_draft(s)]
            if missing:
                t_sync = time.monotonic()
                self.remote.receive(self.remote.send(missing))
                self.stats["sync_drafted_sequences"] += len(missing)
                self.stats["sync_draft_seconds"] += time.monotonic() - t_sync
            sent = self.remote.send(self.draft_orders(drafted))
            self.remote.prefill(prefilling)  # after the drafts: the worker serves those first
            self.remote.sync_allowed = False
            t0 = time.monotonic()
            n = self.verify_except({id(s) for s in drafted})
            t1 = time.monotonic()
            self.remote.receive(sent)
            self.stats["verify_seconds"] += t1 - t0
            self.stats["wait_seconds"] += time.monotonic() - t1
            self.turn = 1 - self.turn
        self.remote.flush_releases()
        return n

    def verify_except(self, skip: set[int]) -> int:
        """The base step (plan / forward / finish, hidden states included) over every running
        sequence but `skip`; admission was done by `step`."""
        return Scheduler.step(self, exclude=skip, admit=False)

    def health(self) -> dict:
        remote = self.remote
        info = {"state": "ok" if remote.healthy else "lost", "reason": remote.transport.reason,
                "batches": [len(b) for b in self.batches], "balance": self.balance, **self.stats, **remote.stats}
        return {"status": "ok" if remote.healthy else "degraded", "draft_rank": info}


def install(engine, transport, timeout_s: float = 5.0) -> MineDraftScheduler:
    """Swap the engine's drafter for the remote one and its scheduler for MineDraft's
    (before `engine.start()`). Returns the new scheduler."""
    if "draft" not in engine.meta.roles:  # the local draft model is not loaded (load_draft=False)
        from specbuild.errors import BundleError

        raise BundleError(W.no_draft_message(engine.bundle_dir, engine.meta.roles))
    remote = RemoteDraftProposer(transport, engine.target_config.vocab_size, timeout_s)
    engine.speculator.proposers["draft"] = remote
    engine.scheduler = MineDraftScheduler(engine.scheduler, remote)
    return engine.scheduler
