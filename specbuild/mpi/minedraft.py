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

How it plugs in (`plugin`, before the engine opens): the remote drafter is an ordinary
proposer (speculation/proposers/remote.py) given to the engine as its "draft" drafter, over a
link (MpiTransport here; LoopbackTransport in process), and the two-batch split is a planning
policy (`TwoBatchPlanning`) given to the engine's scheduler, which runs it each step. Nothing
of an opened engine is replaced, so whatever is attached to it (a telemetry sink) stays.

Faults: the remote drafter never raises. A lost or late draft rank (DistContext abandons
the link) or a failed sequence yields no drafts, which the scheduler verifies as plain
decoding; `health()` reports it for /health.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from specbuild.mpi import draft_worker as W
from specbuild.speculation.proposers.remote import RemoteDraftProposer

log = logging.getLogger("specbuild.minedraft")


class MpiTransport:
    """Rank 0's end of the draft link over a DistContext (the interface RemoteDraftProposer
    documents): orders go out as draft_worker's int64 requests, replies are decoded here."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.ahead: list = []  # sends not awaited (prefill notices); complete once a later reply came
        self.codec_seconds = 0.0
        self.vocab = 0  # the width of a reply's probability rows: the target's vocabulary (MineDraft sets it)

    @property
    def healthy(self) -> bool:
        return self.ctx.healthy

    @property
    def reason(self) -> str | None:
        return self.ctx.reason

    def post(self, step: int, orders: list, releases: list[int], prob_rows: int):
        """Pre-post the reply's receives, then send the request. Returns a ticket."""
        tc = time.perf_counter()
        request = W.encode_request(W.KIND_DRAFT, step, orders, releases)
        self.codec_seconds += time.perf_counter() - tc
        meta = np.empty(W.REP_HEAD + sum(W.REP_FIELDS + o.gamma for o in orders), dtype=np.int64)
        probs = np.empty((prob_rows, self.vocab), dtype=np.float32)
        pendings = [self.ctx.irecv(meta, W.TAG_REPLY), self.ctx.irecv(probs, W.TAG_PROBS),
                    self.ctx.isend(request, W.TAG_REQUEST)]
        return pendings, meta, probs

    def collect(self, ticket, deadline: float, sampled: set[int]):
        pendings, meta, probs = ticket
        if not self.ctx.wait(pendings, deadline):
            return None
        if self.ahead:  # the draft rank read them before this request (MPI keeps the order): done
            self.ctx.wait(self.ahead, time.monotonic() + 1.0)
            self.ahead = []
        tc = time.perf_counter()
        _, results, timing = W.decode_reply(meta[:int(meta[3])], probs, sampled)
        self.codec_seconds += time.perf_counter() - tc
        return results, timing

    def notify(self, step: int, releases: list[int]) -> None:
        self.ctx.notify(W.encode_request(W.KIND_RELEASE, step, [], releases), W.TAG_REQUEST)

    def send_ahead(self, step: int, orders: list, releases: list[int]) -> None:
        """Send without waiting: a large prefill notice must not hold the verifier while the
        draft rank is busy drafting. A lost link shows up at the next reply's deadline."""
        pending = self.ctx.isend(W.encode_request(W.KIND_PREFILL, step, orders, releases), W.TAG_REQUEST)
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
    """In-process link to a DraftWorker through the same wire format (tests, and a reference
    for the MPI path). `fail_after` requests, it behaves as a dead draft rank."""

    def __init__(self, worker: "W.DraftWorker", fail_after: int | None = None) -> None:
        self.worker = worker
        self.fail_after = fail_after
        self.reason: str | None = None
        self.posted = 0
        self.codec_seconds = 0.0

    @property
    def healthy(self) -> bool:
        return self.reason is None

    def post(self, step: int, orders: list, releases: list[int], prob_rows: int):
        self.posted += 1
        if self.fail_after is not None and self.posted > self.fail_after:
            self.reason = "loopback drafter killed"
            return None
        _, reply = self.worker.handle(W.encode_request(W.KIND_DRAFT, step, orders, releases))
        return reply

    def collect(self, ticket, deadline: float, sampled: set[int]):
        meta, probs = ticket
        _, results, timing = W.decode_reply(meta, probs, sampled)
        return results, timing

    def notify(self, step: int, releases: list[int]) -> None:
        if self.healthy:
            self.worker.handle(W.encode_request(W.KIND_RELEASE, step, [], releases))

    def send_ahead(self, step: int, orders: list, releases: list[int]) -> None:
        if self.healthy:
            self.worker.handle(W.encode_request(W.KIND_PREFILL, step, orders, releases))


class TwoBatchPlanning:
    """The scheduler's planning policy under MineDraft: draft-model requests alternate
    between two batches (see the module doc). `step(scheduler)` runs one engine step through
    the scheduler's planning interface (engine/scheduler.py: `begin_step`, then
    `complete_step` with the batch being drafted left out; `speculator` for the depths), so
    everything the plain step does (telemetry, hidden states, faults) happens here too."""

    def __init__(self, remote: RemoteDraftProposer) -> None:
        self.remote = remote
        self.batches: tuple[list, list] = ([], [])
        self.turn = 0  # the batch verified this step; 1 - turn is drafted
        self.balance = 0
        self.stats = {"minedraft_steps": 0, "ordinary_steps": 0, "verify_seconds": 0.0, "wait_seconds": 0.0,
                      "imbalance_sum": 0, "batch_sum": 0, "sync_drafted_sequences": 0, "sync_draft_seconds": 0.0}

    def uses_draft(self, seq) -> bool:
        return seq.spec is not None and seq.spec.method in ("draft", "auto") and not self.remote.failed(seq)

    def sync_batches(self, running: list) -> None:
        """Recycle sequences that left, place new decoders (balance counter), rebalance."""
        live = {s.seq_id for s in running if not s.finished and s.num_cached >= len(s.all_ids) - 1
                and self.uses_draft(s)}
        for batch in self.batches:
            batch[:] = [s for s in batch if s.seq_id in live]
        placed = {s.seq_id for b in self.batches for s in b}
        drafted, verified = self.batches[1 - self.turn], self.batches[self.turn]
        for seq in running:
            if seq.seq_id in live and seq.seq_id not in placed:
                (drafted if len(drafted) <= len(verified) else verified).append(seq)
        for big, small in ((drafted, verified), (verified, drafted)):
            while len(big) - len(small) >= 2:  # prefer moving one whose drafts are not in hand
                victim = ([s for s in big if not self.remote.has_draft(s)] or big)[-1]
                big.remove(victim)
                small.append(victim)
        assert not {s.seq_id for s in self.batches[0]} & {s.seq_id for s in self.batches[1]}
        self.balance = len(self.batches[0]) - len(self.batches[1])

    def draft_orders(self, speculator, batch: list) -> list[tuple[object, int]]:
        """(seq, gamma) for the batch to draft: the speculator's method and depth choices."""
        return [(seq, gamma) for seq in batch if (gamma := speculator.depth_for(seq, "draft")) is not None]

    def step(self, scheduler) -> int:
        running = scheduler.begin_step()  # admitted, caches repaired
        if not running:
            self.remote.flush_releases()
            return 0
        self.sync_batches(running)
        verified, drafted = self.batches[self.turn], self.batches[1 - self.turn]
        # prompts the target prefills this step go to the draft rank too, so that its cache
        # fills meanwhile instead of inside the sequence's first draft round trip
        prefilling = [s for s in running if s.num_cached < len(s.all_ids) - 1 and self.uses_draft(s)]
        if not (verified and drafted and self.remote.healthy):
            self.stats["ordinary_steps"] += 1
            self.remote.sync_allowed = True
            placed = verified or drafted
            if not placed:  # no draft round trip in this step to queue behind the prefill
                self.remote.prefill(prefilling)
            n = scheduler.complete_step()
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
            missing = [(s, g) for s, g in self.draft_orders(scheduler.speculator, verified)
                       if g > 0 and not self.remote.has_draft(s)]
            if missing:
                t_sync = time.monotonic()
                self.remote.receive(self.remote.send(missing))
                self.stats["sync_drafted_sequences"] += len(missing)
                self.stats["sync_draft_seconds"] += time.monotonic() - t_sync
            sent = self.remote.send(self.draft_orders(scheduler.speculator, drafted))
            self.remote.prefill(prefilling)  # after the drafts: the worker serves those first
            self.remote.sync_allowed = False
            t0 = time.monotonic()
            # the base step (plan / forward / finish, hidden states included) over every running
            # sequence but the batch being drafted; begin_step admitted above
            n = scheduler.complete_step(leave_out=drafted)
            t1 = time.monotonic()
            self.remote.receive(sent)
            self.stats["verify_seconds"] += t1 - t0
            self.stats["wait_seconds"] += time.monotonic() - t1
            self.turn = 1 - self.turn
        self.remote.flush_releases()
        return n

    def health(self) -> dict:
        remote = self.remote
        info = {"state": "ok" if remote.healthy else "lost", "reason": remote.transport.reason,
                "batches": [len(b) for b in self.batches], "balance": self.balance, **self.stats, **remote.stats}
        return {"status": "ok" if remote.healthy else "degraded", "draft_rank": info}


class MineDraft:
    """What an engine opens with to run MineDraft: `drafters` (the remote drafter as the
    "draft" method) and `planning` (the two-batch policy). See `plugin`."""

    def __init__(self, transport, vocab: int, timeout_s: float = 5.0) -> None:
        if hasattr(transport, "vocab"):
            transport.vocab = vocab
        self.transport = transport
        self.proposer = RemoteDraftProposer(transport, vocab, timeout_s)
        self.planning = TwoBatchPlanning(self.proposer)

    @property
    def drafters(self) -> dict:
        return {"draft": self.proposer}

    def open_kwargs(self) -> dict:
        """Keyword arguments for Engine / open_engine."""
        return {"drafters": self.drafters, "planning": self.planning}

    def health(self) -> dict:
        return self.planning.health()


def plugin(bundle_dir: str, transport, timeout_s: float = 5.0) -> MineDraft:
    """MineDraft for `bundle_dir` over `transport`, to hand to the engine when it opens:
    `open_engine(bundle, config, **plugin(bundle, transport).open_kwargs())`. Refuses a bundle
    without a draft model (the only drafter the draft rank runs) with the reason."""
    from specbuild.bundle import read_meta, read_model_config
    from specbuild.errors import BundleError

    meta = read_meta(bundle_dir)
    if "draft" not in meta.roles:
        raise BundleError(W.no_draft_message(bundle_dir, meta.roles))
    vocab = read_model_config(os.path.join(bundle_dir, meta.roles["target"]["path"])).vocab_size
    return MineDraft(transport, vocab, timeout_s)
