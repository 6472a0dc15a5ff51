"""A draft model that runs in another process: the Proposer protocol over a draft link.

The drafter itself (a DraftModelProposer) runs elsewhere, e.g. on MineDraft's draft rank
(mpi/minedraft.py); this proposer keeps, per sequence, what that process has seen, and asks
it for drafts through a link handed in at construction. Speculation knows nothing of MPI:
the link (mpi/minedraft.py's MpiTransport, or LoopbackTransport in process) encodes the
orders below onto the wire and decodes the replies.

The link's interface:

    healthy, reason                       False / why, once the link is given up for good
    post(step, orders, releases, prob_rows) -> ticket or None
                                          ask for drafts (not awaited; None: nothing went)
    collect(ticket, deadline, sampled) -> ({seq_id: (status, tokens, probs or None)}, ReplyTiming) or None
                                          the reply by `deadline` (time.monotonic); None: lost
    send_ahead(step, orders, releases)    prompts to prefill there (no reply)
    notify(step, releases)                sequences to forget there (no reply)
    codec_seconds                         encoding / decoding time spent here, summed

`propose` uses drafts fetched ahead (`send` / `receive`, driven by a planning policy such as
MineDraft's two batches) while they are still valid; otherwise it makes a synchronous round
trip, unless `sync_allowed` is False. It never raises: a lost link or a failed sequence
yields no drafts, which the scheduler verifies as plain decoding.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from specbuild.speculation.proposers.base import Draft, DrafterBase

log = logging.getLogger("specbuild.remote_draft")

OK, RESYNC, FAILED = 0, 1, 2  # a sequence's status in a reply
NO_ROLLBACK = 1 << 62  # RemoteState.keep when the target has not rolled back since the last send


@dataclass
class RemoteState:
    """What the draft process holds of one sequence, as this side knows it."""

    sent: int | None = None  # text length the draft rank has seen (None: it holds nothing of it)
    keep: int = NO_ROLLBACK  # how much of that stays valid after the target's rollbacks since
    failed: bool = False  # the draft rank failed on it: decoded plainly from then on
    drafted: bool = True  # its cache there holds drafted (uncommitted) tokens, not just the prompt


@dataclass
class Order:
    """One sequence's part of a draft request."""

    seq_id: int
    keep: int  # KV length the target committed: the remote draft cache rolls back to it
    sent_before: int  # text length the remote drafter should already hold
    new_tokens: list[int]  # the text that follows
    gamma: int
    top_k: int = 0
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    salt: int = 0  # the request's cache_salt as kv_cache.salt_key (0: none): the draft rank's prefix reuse


def request_salt(seq) -> int:
    """seq's cache_salt as the int an Order carries."""
    from specbuild.model.kv_cache import salt_key

    return salt_key(getattr(getattr(seq, "request", None), "cache_salt", None))


@dataclass
class ReplyTiming:
    draft_seconds: float
    seen_at: float  # time.monotonic() where the request was read (0: unknown); one clock per host
    ready_at: float


class RemoteDraftProposer(DrafterBase):
    """The Proposer protocol over a draft link (see the module docstring)."""

    name = "draft"

    def __init__(self, transport, vocab: int, timeout_s: float = 5.0) -> None:
        self.transport = transport
        self.states: dict[int, RemoteState] = {}  # seq_id -> what the draft rank holds of it
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

    def state(self, seq) -> RemoteState:
        st = self.states.get(seq.seq_id)
        if st is None:
            st = self.states[seq.seq_id] = RemoteState()
        return st

    def failed(self, seq) -> bool:
        st = self.states.get(seq.seq_id)
        return st is not None and st.failed

    @property
    def healthy(self) -> bool:
        return self.transport.healthy

    # ---- the split round trip ------------------------------------------------------------
    def send(self, pairs: list[tuple[object, int]]):
        """Ask for drafts of (seq, gamma) pairs; returns a ticket for `receive` (None: nothing sent)."""
        pairs = [(s, g) for s, g in pairs if g > 0 and not self.failed(s)]
        if not pairs or not self.healthy:
            return None
        self.step += 1
        orders = []
        for seq, gamma in pairs:
            ids = seq.all_ids
            st = self.state(seq)
            sent = st.sent or 0
            p = seq.params
            # the draft cache may hold at most the committed text (never past len - 1)
            keep = min(st.keep, len(ids) - 1) if sent else 0
            orders.append(Order(seq.seq_id, keep, sent, ids[sent:], gamma, p.top_k, p.seed,
                                float(p.temperature), float(p.top_p), request_salt(seq)))
            st.sent, st.keep = len(ids), NO_ROLLBACK
            st.drafted = True  # the draft cache now holds K/V of drafted tokens
        prob_rows = sum(g for s, g in pairs if not s.params.greedy)
        t0 = time.monotonic()
        ticket = self.transport.post(self.step, orders, self.releases, prob_rows)
        self.releases = []
        self.stats["codec_seconds"] = self.transport.codec_seconds
        if ticket is None:
            return None
        return ticket, t0, {s.seq_id: s for s, _ in pairs}

    def prefill(self, seqs: list) -> int:
        """Send the prompts of sequences the target is prefilling, so that the draft rank fills
        its cache meanwhile (no reply is awaited). Only the committed text goes: the prompt,
        fixed while it is prefilled. Returns how many were sent."""
        seqs = [s for s in seqs if self.state(s).sent is None and not self.failed(s)]
        if not seqs or not self.healthy:
            return 0
        orders = []
        for seq in seqs:
            p = seq.params
            orders.append(Order(seq.seq_id, 0, 0, list(seq.all_ids), 0, p.top_k, p.seed,
                                float(p.temperature), float(p.top_p), request_salt(seq)))
            st = self.state(seq)
            st.sent, st.keep = len(seq.all_ids), NO_ROLLBACK
            st.drafted = False  # only committed text so far: valid at any target length
        self.transport.send_ahead(self.step, orders, self.releases)
        self.releases = []
        self.stats["prefilled_sequences"] += len(orders)
        return len(orders)

    def receive(self, sent) -> None:
        """Collect the drafts of `send` by its deadline into `prefetched`."""
        if sent is None:
            return
        ticket, t0, seqs = sent
        t_free = time.monotonic()  # the verifier starts looking for the reply
        sampled = {i for i, s in seqs.items() if not s.params.greedy}
        # the deadline runs from here: a long verification of the other batch is not the drafter's fault
        reply = self.transport.collect(ticket, t_free + self.timeout_s, sampled)
        t_got = time.monotonic()
        self.stats["codec_seconds"] = self.transport.codec_seconds
        if reply is None:
            log.warning("no drafts from the draft rank (%s): continuing with plain decoding", self.transport.reason)
            return
        results, timing = reply
        self.stats["requests"] += 1
        self.stats["sequences"] += len(results)
        self.stats["draft_seconds"] += timing.draft_seconds
        self.stats["round_trip_seconds"] += t_got - t0
        if timing.seen_at:  # CLOCK_MONOTONIC is one clock for every process on the host
            self.stats["request_latency_seconds"] += max(0.0, timing.seen_at - t0)
            self.stats["reply_latency_seconds"] += max(0.0, t_got - max(timing.ready_at, t_free))
        for seq_id, (status, tokens, draft_probs) in results.items():
            seq = seqs.get(seq_id)
            if seq is None:  # not a sequence this request asked about
                log.warning("the draft rank answered for sequence %d, which this request did not name", seq_id)
                continue
            if status == RESYNC:
                self.state(seq).sent, self.state(seq).keep = 0, 0
                self.stats["resyncs"] += 1
            elif status == FAILED:
                self.state(seq).failed = True
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
        st = self.states.get(seq.seq_id)
        if st is not None and st.sent is not None and st.drafted:
            st.keep = min(st.keep, length)

    def release(self, seq) -> None:
        self.prefetched.pop(seq.seq_id, None)
        st = self.states.pop(seq.seq_id, None)
        if st is not None and st.sent is not None:
            self.releases.append(seq.seq_id)

    def flush_releases(self) -> None:
        if self.releases and self.healthy:
            self.transport.notify(self.step, self.releases)
        self.releases = []
