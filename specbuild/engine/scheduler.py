"""Requests, admission and the step loop of the torch backend.

One `step()`: admit waiting requests while the KV budget lasts; give every running
sequence its work (a prefill chunk, or its last token plus any drafted tokens); run the
target once over the ragged batch; verify / sample; commit or roll back the caches; emit.

Every sequence has pending tokens `all_ids[num_cached:]` whose K/V are not yet in the
cache: the remaining prompt while prefilling, just the last sampled token when decoding,
the whole text again after a repair (`num_cached = 0` re-prefills). When a sequence's
pending tokens all fit in this step, the last row's logits (and those of any drafts)
are read and new tokens are produced.

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
from collections.abc import Collection
import time
from dataclasses import dataclass

import torch

from specbuild.errors import RequestError
from specbuild.model.kv_cache import PagedKVCache
from specbuild.model.decoder import Decoder, ForwardBatch, ragged_mask
from specbuild.sampling.params import check_logits, sample_from, token_logprobs, warp_probs
from specbuild.sampling.processing import chain_paths, process_logits, tree_paths
from specbuild.engine.sequence import Event, Sequence
from specbuild.engine.events import NULL_SINK, StepRecord

log = logging.getLogger("specbuild.scheduler")


@dataclass
class WorkItem:
    """One sequence's share of a forward: `chunk` of its pending tokens, then drafts."""

    seq: Sequence
    chunk: list[int]
    draft: object = None  # proposers.Draft or None
    start: int = 0  # cache length before this step (position of chunk[0])
    row0: int = 0  # first row of this item in the flattened batch
    completes: bool = False  # chunk reaches the end of the pending tokens
    pad: int = 0  # filler rows (padded binning only): computed, never read, rolled back
    score: tuple[int, int] | None = None  # prompt positions [p0, p1) whose logits score the prompt

    @property
    def score_rows(self) -> int:
        return 0 if self.score is None else self.score[1] - self.score[0]

    @property
    def n_draft(self) -> int:
        return 0 if self.draft is None else len(self.draft.tokens)

    @property
    def width(self) -> int:
        return len(self.chunk) + self.n_draft


def build_forward_batch(items: list[WorkItem], cache: PagedKVCache) -> ForwardBatch:
    """Flatten items into one ragged batch: ids, positions, slots and the attention mask.

    The mask lets each row see its own sequence's past (all of it) and its own new rows
    under that item's new-token mask (causal, or the tree's ancestor mask for tree drafts).
    """
    ids, pos, wslots, rslots, logit_rows, prompt = [], [], [], [], [], []
    blocks = []
    t = s = 0
    for k, it in enumerate(items):
        n = it.width + it.pad
        tokens = it.chunk + (list(it.draft.tokens) if it.n_draft else []) + [it.chunk[-1]] * it.pad
        depth = torch.arange(n)
        if it.n_draft and getattr(it.draft, "depths", None) is not None:
            # tree drafts: the chunk's last token is the root; nodes sit at root + depth
            depth = torch.cat([torch.arange(len(it.chunk)), len(it.chunk) - 1 + torch.as_tensor(it.draft.depths),
                               torch.arange(it.pad) + it.width])
        ids.append(torch.tensor(tokens, dtype=torch.int64))
        pos.append(it.start + depth)
        # prompt rows: the chunk's rows at positions inside the prompt (a prefill chunk; never a
        # draft or a pad row, which follow the chunk)
        in_prompt = torch.zeros(n, dtype=torch.bool)
        in_prompt[:max(0, min(len(it.chunk), len(it.seq.prompt_ids) - it.start))] = True
        prompt.append(in_prompt)
        cache.reserve(it.seq.seq_id, it.start + n)
        all_slots = cache.slots(it.seq.seq_id, 0, it.start + n)
        wslots.append(all_slots[it.start:])
        rslots.append(all_slots)
        it.row0 = t
        it.score = prompt_score_span(it)
        if it.score is not None:  # echo + logprobs: these prompt rows' logits too, before the last row's
            logit_rows.append(torch.arange(t + it.score[0] - it.start, t + it.score[1] - it.start))
        if it.completes:
            last = t + len(it.chunk) - 1
            logit_rows.append(torch.arange(last, last + 1 + it.n_draft))
        new_mask = torch.ones(n, n, dtype=torch.bool).tril()
        if it.n_draft and getattr(it.draft, "tree_mask", None) is not None:
            c = len(it.chunk)
            tm = torch.as_tensor(it.draft.tree_mask, dtype=torch.bool)  # [1 + nodes, 1 + nodes], row 0 root
            new_mask[c - 1:it.width, c - 1:it.width] = tm
            new_mask[c:it.width, :c - 1] = True
        blocks.append((t, s, n, it.start, new_mask))
        t += n
        s += it.start + n
    mask = ragged_mask(blocks, t, s)
    dev = cache.device
    return ForwardBatch(
        input_ids=torch.cat(ids).to(dev),
        positions=torch.cat(pos).to(dev),
        write_slots=torch.cat(wslots).to(dev),
        read_slots=torch.cat(rslots).to(dev),
        mask=None if mask is None else mask.to(dev),
        logit_rows=(torch.cat(logit_rows) if logit_rows else torch.zeros(0, dtype=torch.int64)).to(dev),
        prompt_rows=torch.cat(prompt).to(dev),
    )


def prompt_score_span(it: WorkItem) -> tuple[int, int] | None:
    """The prompt positions of this chunk whose logits give the next prompt token's logprob
    (request.prompt_logprobs): not scored yet, and before the prompt's last position (whose
    logits choose the first generated token). None when there are none."""
    seq = it.seq
    if seq.request.prompt_logprobs is None:
        return None
    p0 = max(it.start, seq.prompt_scored)
    p1 = min(it.start + len(it.chunk), len(seq.prompt_ids) - 1)
    return (p0, p1) if p1 > p0 else None


def draft_paths(draft) -> list[list[int]]:
    """The draft tokens before each row of a verify pass ([[]] for a plain step)."""
    if draft is None:
        return [[]]
    if draft.parents is not None:
        return tree_paths(draft.parents, [0, *draft.tokens])
    return chain_paths(draft.tokens)


def plain_next_token(seq: Sequence, logits: torch.Tensor) -> int:
    """Sample one token from logits [vocab] (already `process_logits`ed) with the request's
    params and generator."""
    if seq.params.greedy:
        check_logits(logits)
        return int(logits.argmax())
    probs = warp_probs(logits.unsqueeze(0), seq.params)
    return int(sample_from(probs, seq.uniforms(1))[0])


class Scheduler:
    """Owns the target model and its cache; plans and runs steps over the engine's queue."""

    def __init__(self, model: Decoder, cache: PagedKVCache, max_batch_size: int, max_seq_len: int,
                 prefill_chunk: int = 256, speculator=None, waiting: collections.deque | None = None,
                 running: list | None = None, planning=None) -> None:
        self.model = model
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.speculator = speculator  # None: plain decoding only
        # the engine's queue (BaseEngine.waiting / running), shared, mutated in place only
        self.waiting: collections.deque[Sequence] = collections.deque() if waiting is None else waiting
        self.running: list[Sequence] = [] if running is None else running
        self.budget_blocks = 0  # blocks promised to running sequences (never over-committed)
        self.passes = 0
        self.sink = NULL_SINK  # telemetry (engine/events.py); Engine.set_sink attaches one
        self._target_ms = 0.0  # the last group's target forward, for the sink's step rows
        # a planning policy given at open: its step(scheduler) runs each engine step through this
        # scheduler (MineDraft's two batches, dist/minedraft.TwoBatchPlanning); None: step()
        self.planning = planning
        # requests failed alone inside a step (sequence) and forwards whose whole batch failed (step)
        self.failures = {"sequence": 0, "step": 0}

    # ---- admission --------------------------------------------------------------------
    def block_budget(self, seq: Sequence) -> int:
        extra = self.speculator.max_extra_tokens(seq) if self.speculator else 0
        tokens = min(seq.total_len + seq.params.max_tokens + extra + 1, self.max_seq_len + extra + 1)
        return -(-tokens // self.cache.block_size)

    def admit(self) -> None:
        import time

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
            seq.budget_blocks = need
            self.budget_blocks += need
            self.cache.add(seq.seq_id)
            seq.t_admit = time.perf_counter()
            self.running.append(seq)
            try:
                if self.speculator:
                    self.speculator.on_admit(seq)
                if self.sink.enabled:
                    self.sink.on_session_start(seq)
            except Exception as e:  # noqa: BLE001 - this request's failure, not its neighbours'
                self.fail_sequence(seq, e, "admitting it")

    # ---- lifecycle ----------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        was_running = seq in self.running
        if was_running:
            self.running.remove(seq)
            self.budget_blocks -= seq.budget_blocks
        self.cache.release(seq.seq_id)
        if self.speculator:
            self.speculator.on_release(seq)
        if was_running and self.sink.enabled:
            self.sink.on_session_end(seq)

    def fail(self, seq: Sequence, message: str, status: int = 500) -> None:
        seq.fail(message, status)

    @staticmethod
    def request_id(seq: Sequence) -> str:
        return seq.handle.request_id if seq.handle is not None else f"seq-{seq.seq_id}"

    def _release_quietly(self, seq: Sequence) -> None:
        """release(), logging (not raising) a drafter that fails to let go of the sequence."""
        try:
            self.release(seq)
        except Exception:  # noqa: BLE001 - the target's blocks are back already; a drafter's leak is logged
            log.exception("releasing request %s failed", self.request_id(seq))
            self.cache.release(seq.seq_id)
            if seq in self.running:
                self.running.remove(seq)
                self.budget_blocks -= seq.budget_blocks

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
        if not seq.finished:
            seq.finished, seq.finish_reason = True, "abort"
            if seq.handle:
                seq.handle._emit(Event([], "", True, "abort"))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def commit(self, seq: Sequence, length: int) -> None:
        """Target and drafter caches of seq move to `length` together (commit or rollback)."""
        if self.speculator:
            self.speculator.commit(seq, length)
        else:
            self.cache.set_length(seq.seq_id, length)

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
                seq.num_cached = 0
                seq.repairs += 1
                self.commit(seq, 0)

    # ---- the step -----------------------------------------------------------------------
    def plan(self, exclude: Collection[int] = ()) -> list[WorkItem]:
        """Work for every running sequence whose id() is not in `exclude` (MineDraft's batch
        being drafted). `self.running` itself is never replaced: lock-free readers (stats())
        always see every running request."""
        self.check_lengths()
        items, budget = [], self.prefill_chunk
        running = [s for s in self.running if id(s) not in exclude] if exclude else list(self.running)
        self.share_prefills(running)
        decoding = [s for s in running if s.num_cached >= len(s.all_ids) - 1]
        drafts = self.speculator.propose(decoding, on_error=self.fail_sequence) if (self.speculator and decoding) \
            else {}
        running = [s for s in running if not s.finished]  # a sequence failed alone while drafting
        for seq in running:
            pending = seq.all_ids[seq.num_cached:]
            if len(pending) == 1 or seq in drafts:
                items.append(WorkItem(seq, pending, drafts.get(seq), seq.num_cached, completes=True))
        for seq in running:
            pending = seq.all_ids[seq.num_cached:]
            if len(pending) > 1 and seq not in drafts and budget > 0 and seq.prefill_source is None:
                chunk = pending[:budget]
                budget -= len(chunk)
                items.append(WorkItem(seq, chunk, None, seq.num_cached, completes=len(chunk) == len(pending)))
        return items

    def share_prefills(self, running: list[Sequence]) -> None:
        """Sequences that share another's prompt (`n` > 1 choices: prefill_source) take its
        prompt's K/V once it has them, instead of prefilling again: the blocks are copied and
        only the last prompt token is run as the sequence's first decode step. Until then they
        wait (no prefill chunk of their own); if the source is gone first, they prefill."""
        for seq in running:
            src = seq.prefill_source
            if src is None:
                continue
            n = len(seq.prompt_ids) - 1
            if n <= 0 or seq.num_cached or src.finished or src.seq_id not in self.cache.seqs or src not in self.running:
                seq.prefill_source = None  # prefill as usual
                continue
            if src.num_cached < n:
                continue  # wait: the source is still prefilling
            self.cache.reserve(seq.seq_id, n)
            dev = self.cache.device
            self.cache.copy_slots(self.cache.slots(src.seq_id, 0, n).to(dev), self.cache.slots(seq.seq_id, 0, n).to(dev))
            seq.num_cached = n
            self.commit(seq, n)
            if seq.request.prompt_logprobs is not None:  # the prompt is the source's: so are its logprobs
                seq.prompt_logprobs, seq.prompt_scored = list(src.prompt_logprobs), src.prompt_scored
            seq.prefill_source = None
            seq.extra_stats["stat_shared_prefill_tokens"] = n

    def run_step(self) -> int:
        """One step of the engine loop: the planning policy's, else `step()`."""
        return self.planning.step(self) if self.planning is not None else self.step()

    def step(self, exclude: Collection[int] = (), admit: bool = True) -> int:
        """One batched step. Returns the number of sequences that advanced.

        exclude: id()s of running sequences to leave out of this step (MineDraft: the batch
        the draft rank is drafting); admit=False when the caller already admitted."""
        if admit:
            self.admit()
        if not self.running:
            return 0
        try:
            items = self.plan(exclude)
            groups = (self.speculator.bins(items) if self.speculator else [items]) if items else []
        except Exception as e:  # noqa: BLE001 - planning belongs to no single sequence
            self.fail_batch([s for s in self.running if id(s) not in exclude], e, "planning the step")
            return 0
        if not items:
            return 0
        for group in groups:
            try:
                logits, hidden, aux = self.forward_group(group)
            except Exception as e:  # noqa: BLE001 - a forward belongs to its whole group
                self.fail_batch([it.seq for it in group], e, "running the target's forward")
                continue
            self.finish_items(group, logits, hidden, aux)
        return len(items)

    def forward_group(self, group: list[WorkItem]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One target forward over a group of items: (logits, hidden or None, aux or None)."""
        batch = build_forward_batch(group, self.cache)
        hidden = aux = None
        t0 = time.perf_counter()
        aux_rows = self.speculator.aux_rows(group) if self.speculator else None
        if aux_rows is not None:  # an EAGLE head reads three layers' hidden states
            out = self.model.forward(batch, self.cache, return_hidden=self.speculator.wants_hidden,
                                     aux_layers=self.speculator.aux_layers, aux_rows=aux_rows)
            logits, hidden, aux = out if len(out) == 3 else (out[0], None, out[1])
        elif self.speculator and self.speculator.wants_hidden:
            logits, hidden = self.model.forward(batch, self.cache, return_hidden=True)
        else:
            logits = self.model.forward(batch, self.cache)
        self._target_ms = (time.perf_counter() - t0) * 1e3
        self.passes += 1
        return logits, hidden, aux

    def finish_items(self, items: list[WorkItem], logits: torch.Tensor, hidden: torch.Tensor | None = None,
                     aux: torch.Tensor | None = None) -> None:
        """logits: [sum over completing items of (1 + n_draft), vocab]; hidden: the same rows'
        final-normed hidden states [rows, hidden] when a drafter reads them (Medusa)."""
        r = 0
        for it in items:
            score_rows = None
            if it.score is not None:  # the prompt's logprobs rows come first
                score_rows = logits[r:r + it.score_rows]
                r += it.score_rows
            rows = hidden_rows = None
            if it.completes:
                rows = logits[r:r + 1 + it.n_draft]  # [1 + k, vocab]
                hidden_rows = hidden[r:r + 1 + it.n_draft] if hidden is not None else None
                r += 1 + it.n_draft
            if it.seq.finished:  # failed or aborted meanwhile (its blocks are gone)
                continue
            try:
                self.finish_item(it, score_rows, rows, hidden_rows, aux, len(items))
            except Exception as e:  # noqa: BLE001 - this sequence's failure, not its neighbours'
                self.fail_sequence(it.seq, e, "choosing its next tokens")

    def finish_item(self, it: WorkItem, score_rows: torch.Tensor | None, rows: torch.Tensor | None,
                    hidden_rows: torch.Tensor | None, aux: torch.Tensor | None, batch_size: int) -> None:
        """One item after the forward: score_rows the prompt rows whose logprobs echo asked for
        (None: not asked in this chunk), rows [1 + k, vocab] its logits (None: a prefill chunk
        that does not complete), hidden_rows the same rows' hidden states or None."""
        seq = it.seq
        seq.target_passes += 1
        if score_rows is not None:  # the prompt's logprobs: plain numbers kept, the rows let go
            p0, p1 = it.score
            seq.prompt_logprobs += token_logprobs(score_rows, seq.params, seq.prompt_ids[p0 + 1:p1 + 1],
                                                  seq.request.prompt_logprobs)
            seq.prompt_scored = p1
        if aux is not None:
            if not it.completes:
                self.speculator.observe_features(seq, it, aux)
        if not it.completes:
            seq.num_cached = it.start + len(it.chunk)
            self.commit(seq, seq.num_cached)
            return
        # the model's own rows: a NaN/inf here is this sequence's failure, found before the
        # shared recycling table or any drafter reads them
        check_logits(rows, "the target's logits")
        was_decode = len(it.chunk) == 1 and seq.output_ids
        if self.speculator is not None:  # token recycling reads the rows it verifies
            self.speculator.observe_logits(seq, [it.chunk[-1], *(it.draft.tokens if it.n_draft else ())], rows)
        # penalties, logit_bias and the grammar, identically for plain and verify rows
        rows = process_logits(rows, seq.params, seq.output_ids, draft_paths(it.draft if it.n_draft else None),
                              seq.constraint)
        if it.n_draft:
            accepted, new_tokens = self.speculator.verify(seq, it.draft, rows)
        else:
            accepted, new_tokens = 0, [plain_next_token(seq, rows[0])]
        if seq.request.logprobs is not None:  # the rows that chose the new tokens
            chosen = [0, *seq.spec_state.accepted_nodes] if it.n_draft and it.draft.parents is not None \
                else list(range(len(new_tokens)))
            seq.pending_logprobs = token_logprobs(rows[chosen[:len(new_tokens)]], seq.params, new_tokens,
                                                  seq.request.logprobs)
        if aux is not None:  # before compact: it moves the accepted nodes' K/V
            self.speculator.observe_features(seq, it, aux, accepted)
        if was_decode or it.n_draft:
            seq.verify_passes += 1
        # K/V valid: the chunk plus the accepted drafts; the new last token is pending
        seq.num_cached = it.start + len(it.chunk) + accepted
        if it.n_draft and getattr(it.draft, "depths", None) is not None:
            self.speculator.compact(seq, it, self.cache, accepted)
        self.commit(seq, seq.num_cached)
        before = len(seq.text)
        kept = seq.append_tokens(new_tokens)
        lps = None
        if seq.request.logprobs is not None:
            lps = seq.pending_logprobs[:len(kept)]
            seq.logprobs += lps
        if self.sink.enabled and (was_decode or it.n_draft):
            self.record_step(seq, it, accepted, len(kept), batch_size)
        if hidden_rows is not None and not seq.finished:
            # the row whose logits chose the new last token: the last accepted node
            # (chain: draft `accepted`; tree: that node's index); 0 when none was accepted
            row = it.draft.last_row if it.n_draft and getattr(it.draft, "last_row", None) is not None \
                else accepted
            self.speculator.observe_hidden(seq, hidden_rows[row])
        if seq.handle is not None:
            seq.handle._emit(Event(kept, seq.text[before:], seq.finished, seq.finish_reason, lps))
        if seq.finished:
            self.release(seq)

    def record_step(self, seq: Sequence, it: WorkItem, accepted: int, emitted: int, batch_size: int) -> None:
        """One decode pass of seq, for the telemetry sink (only called when one is attached)."""
        method = seq.spec_state.method if self.speculator else None
        depths = getattr(it.draft, "depths", None) if it.n_draft else None
        draft_ms = self.speculator.last_draft_ms.get(method, 0.0) if (self.speculator and it.n_draft) else 0.0
        self.sink.on_step(seq, StepRecord(
            step_num=seq.verify_passes, method=method if it.n_draft else None,
            gamma=seq.gammas[-1] if seq.gammas else 0, drafted=it.n_draft, accepted=accepted, emitted=emitted,
            depth=(max(depths) if depths is not None and len(depths) else it.n_draft), draft_ms=draft_ms,
            target_ms=self._target_ms, batch_size=batch_size,
            fallback=bool(seq.spec is not None and seq.spec.enabled and not it.n_draft)))
