"""One group of a step, top to bottom: build the batch, run the target, settle, commit, emit.

The scheduler (engine/scheduler.py) admits, budgets KV and plans: it hands `StepRunner.run`
a group of `WorkItem`s (one per sequence: a prefill chunk, or the last token plus its
draft) and the speculator's `Proposal` for the step. Per group:

    build_forward_batch   ids, positions, KV slots and the attention mask of the ragged batch
    Decoder.forward       -> ForwardOutput (logits; hidden / auxiliary layers only when asked)
    per item, alone:      prompt logprobs; penalties and grammar (process_logits);
                          Speculator.settle -> Verdict; commit (K/V moves, the kept length);
                          append, telemetry, emit; release when finished

Fault isolation: what fails while one item is finished fails that request alone
(Scheduler.fail_sequence); a failure building the batch or in the forward fails the group
(Scheduler.fail_batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from specbuild.model.decoder import ForwardBatch, ForwardOutput, ragged_mask
from specbuild.model.kv_cache import PagedKVCache
from specbuild.sampling.params import argmax_rows, check_logits, token_logprobs
from specbuild.sampling.processing import chain_paths, process_logits, tree_paths
from specbuild.speculation.speculator import PassResult, Proposal, Verdict
from specbuild.engine.events import StepRecord
from specbuild.engine.stepparts import StepParts
from specbuild.engine.sequence import Event, Sequence


@dataclass
class WorkItem:
    """One sequence's share of a forward: `chunk` of its pending tokens, then drafts."""

    seq: Sequence
    chunk: list[int]
    draft: object = None  # proposers.base.Draft or None
    start: int = 0  # cache length before this step (position of chunk[0])
    row0: int = 0  # first row of this item in the flattened batch (build_forward_batch)
    completes: bool = False  # chunk reaches the end of the pending tokens
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


def build_forward_batch(items: list[WorkItem], cache: PagedKVCache, fast: bool = True) -> ForwardBatch:
    """Flatten items into one ragged batch: ids, positions, slots and the attention mask.

    The mask lets each row see its own sequence's past (all of it) and its own new rows
    under that item's new-token mask (causal, or the tree's ancestor mask for tree drafts).
    """
    if fast and all(len(it.chunk) == 1 and it.completes and it.seq.request.prompt_logprobs is None
                    for it in items):
        return decode_batch(items, cache)
    ids, pos, wslots, rslots, logit_rows, prompt = [], [], [], [], [], []
    blocks = []
    t = s = 0
    for it in items:
        n = it.width
        tokens = it.chunk + (list(it.draft.tokens) if it.n_draft else [])
        depth = torch.arange(n)
        if it.n_draft and it.draft.depths is not None:
            # tree drafts: the chunk's last token is the root; nodes sit at root + depth
            depth = torch.cat([torch.arange(len(it.chunk)), len(it.chunk) - 1 + torch.as_tensor(it.draft.depths)])
        ids.append(torch.tensor(tokens, dtype=torch.int64))
        pos.append(it.start + depth)
        # prompt rows: the chunk's rows at positions inside the prompt (a prefill chunk; never a
        # draft, which follows the chunk)
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
        if it.n_draft and it.draft.tree_mask is not None:
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


def decode_batch(items: list[WorkItem], cache: PagedKVCache) -> ForwardBatch:
    """build_forward_batch for decode items (one pending token each, with or without a chain or
    tree draft; no prompt logprobs): the same ForwardBatch from plain lists, a few
    tensors per batch instead of ~15 per item (a plain step's Python was a fifth of a 5 ms step,
    a speculative one's build cost 1.4-1.8x a plain one's; tests/engine/test_engine.py checks this
    against the general path)."""
    ids, pos, prompt, wslots, rslots, blocks = [], [], [], [], [], []
    t = s = 0
    for it in items:
        d = it.draft if it.n_draft else None
        n = 1 + (len(d.tokens) if d is not None else 0)
        start = it.start
        cache.reserve(it.seq.seq_id, start + n)
        all_slots = cache.slots_array(it.seq.seq_id, 0, start + n)
        ids.append(it.chunk[0])
        pos.append(start)
        new_mask = None
        if d is not None:
            ids.extend(d.tokens)
            if d.depths is not None:  # a tree: node i sits at root + depth, sees its ancestors
                pos.extend(start + x for x in d.depths)
                new_mask = torch.as_tensor(d.tree_mask, dtype=torch.bool)
            else:
                pos.extend(range(start + 1, start + n))
        prompt.append(start < len(it.seq.prompt_ids))
        prompt.extend([False] * (n - 1))
        wslots.append(all_slots[start:])
        rslots.append(all_slots)
        it.row0, it.score = t, None
        blocks.append((t, s, n, start, new_mask))
        t += n
        s += start + n
    mask = ragged_mask(blocks, t, s)
    dev = cache.device
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
        positions=torch.tensor(pos, dtype=torch.int64, device=dev),
        write_slots=torch.from_numpy(np.concatenate(wslots)).to(dev),
        read_slots=torch.from_numpy(np.concatenate(rslots)).to(dev),
        mask=None if mask is None else mask.to(dev),
        logit_rows=torch.arange(t, dtype=torch.int64, device=dev),
        prompt_rows=torch.tensor(prompt, dtype=torch.bool, device=dev),
    )


def prompt_score_span(it: WorkItem) -> tuple[int, int] | None:
    """The prompt positions of this chunk whose logits give the next prompt token's logprob
    (request.prompt_logprobs): not scored yet, and before the prompt's last position (whose
    logits choose the first generated token). None when there are none."""
    seq = it.seq
    if seq.request.prompt_logprobs is None:
        return None
    p0 = max(it.start, seq.scoring.prompt_scored)
    p1 = min(it.start + len(it.chunk), len(seq.prompt_ids) - 1)
    return (p0, p1) if p1 > p0 else None


def draft_paths(draft) -> list[list[int]]:
    """The draft tokens before each row of a verify pass ([[]] for a plain step)."""
    if draft is None:
        return [[]]
    if draft.parents is not None:
        return tree_paths(draft.parents, [0, *draft.tokens])
    return chain_paths(draft.tokens)


class StepRunner:
    """Runs the groups the scheduler plans (the scheduler owns admission and lifecycle:
    `owner` gives release, fail_sequence, fail_batch and the telemetry sink). `build` makes a
    group's ForwardBatch: build_forward_batch; the binning benchmark's padded strategy swaps in
    its own (bench/binning.padded_batch)."""

    def __init__(self, owner, model, cache: PagedKVCache, speculator, parts: StepParts | None = None) -> None:
        self.owner = owner
        self.parts = parts if parts is not None else StepParts()
        self.emitted = 0  # tokens chosen in the current step (the scheduler resets it per step)
        self.model = model
        self.cache = cache
        self.speculator = speculator
        self.passes = 0
        self.target_ms = 0.0  # the last group's target forward, for the sink's step rows
        self.build = build_forward_batch

    def run(self, group: list[WorkItem], proposal: Proposal) -> None:
        try:
            out, aux0 = self.forward(group, proposal)
        except Exception as e:  # noqa: BLE001 - a forward belongs to its whole group
            self.owner.fail_batch([it.seq for it in group], e, "running the target's forward")
            return
        t0 = time.perf_counter()
        try:  # every completing row's argmax and check, in one pass for the group
            picks = self.pick(group, out.logits, out.argmax)
        except Exception as e:  # noqa: BLE001 - the rows belong to the whole group
            self.owner.fail_batch([it.seq for it in group], e, "reading the target's logits")
            return
        self.parts.add("settle", time.perf_counter() - t0)
        r = 0
        for it in group:
            score_rows = rows = hidden = None
            pick = None
            if it.score is not None:  # the prompt's logprobs rows come first
                score_rows = out.logits[r:r + it.score_rows]
                r += it.score_rows
            if it.completes:
                rows = out.logits[r:r + 1 + it.n_draft]  # [1 + k, vocab]
                hidden = out.hidden[r:r + 1 + it.n_draft] if out.hidden is not None else None
                pick = picks.get(it.seq.seq_id)
                r += 1 + it.n_draft
            a = aux0.get(it.seq.seq_id)
            feats = out.aux[a:a + it.width] if a is not None else None
            if it.seq.finished:  # failed or aborted meanwhile (its blocks are gone)
                continue
            try:
                self.finish(it, score_rows, rows, hidden, feats, proposal, len(group), pick)
            except Exception as e:  # noqa: BLE001 - this sequence's failure, not its neighbours'
                self.owner.fail_sequence(it.seq, e, "choosing its next tokens")

    def forward(self, group: list[WorkItem], proposal: Proposal) -> tuple[ForwardOutput, dict[int, int]]:
        """The target over the group, asked for what the drafters read: hidden states of the
        logit rows, and the auxiliary layers at every row of the sequences in
        proposal.feature_seqs (returns their first row in out.aux, by seq_id)."""
        t0 = time.perf_counter()
        batch = self.build(group, self.cache)
        self.parts.add("build", time.perf_counter() - t0)
        aux0: dict[int, int] = {}
        rows: list[int] = []
        for it in group:
            if it.seq.seq_id in proposal.feature_seqs:
                aux0[it.seq.seq_id] = len(rows)
                rows.extend(range(it.row0, it.row0 + it.width))
        t0 = time.perf_counter()
        out = self.model.forward(batch, self.cache, return_hidden=proposal.hidden,
                                 aux_layers=proposal.aux_layers if rows else (),
                                 aux_rows=torch.tensor(rows, dtype=torch.int64, device=self.cache.device) if rows
                                 else None)
        t1 = time.perf_counter()
        self.target_ms = (t1 - t0) * 1e3
        self.parts.add("forward", t1 - t0)
        self.passes += 1
        return out, aux0

    def pick(self, group: list[WorkItem], logits: torch.Tensor,
             argmax: torch.Tensor | None = None) -> dict[int, tuple[list[int], bool]]:
        """seq_id -> (argmax of each of its completing rows, whether every one of them is usable),
        for the group's completing items, in one pass over their rows (params.argmax_rows): the
        check every sequence's rows need, and the greedy tokens, instead of a check and an
        argmax per sequence. `argmax`: the rows' argmax where the forward took it (ForwardOutput);
        then only the picked entries are read (a row is usable exactly when its entry is finite)."""
        spans, index, r = [], [], 0  # spans over the completing rows alone; index: their rows in logits
        for it in group:
            if it.score is not None:
                r += it.score_rows
            if it.completes:
                n = 1 + it.n_draft
                spans.append((it.seq.seq_id, len(index), len(index) + n))
                index.extend(range(r, r + n))
                r += n
        if not spans:
            return {}
        if argmax is not None:
            picked = argmax.tolist()
            ids = [picked[i] for i in index]
            a = logits.numpy()
            ok = np.isfinite(a[index, ids]).tolist()
            return {sid: (ids[a0:b], all(ok[a0:b])) for sid, a0, b in spans}
        if len(index) < logits.shape[0]:  # prompt-logprob rows in between: only the completing rows are read
            logits = logits.index_select(0, torch.tensor(index, dtype=torch.int64, device=logits.device))
        ids, ok = argmax_rows(logits)
        return {sid: (ids[a:b], all(ok[a:b])) for sid, a, b in spans}

    def finish(self, it: WorkItem, score_rows: torch.Tensor | None, rows: torch.Tensor | None,
               hidden: torch.Tensor | None, feats: torch.Tensor | None, proposal: Proposal, batch_size: int,
               pick: tuple[list[int], bool] | None = None) -> None:
        """One item after the forward: score_rows the prompt rows whose logprobs echo asked for
        (None: not asked in this chunk), rows [1 + k, vocab] its logits (None: a prefill chunk
        that does not complete), hidden / feats what the drafters asked for, pick its rows'
        argmax and check (StepRunner.pick; None: taken here)."""
        t0 = time.perf_counter()
        seq = it.seq
        if score_rows is not None:  # the prompt's logprobs: plain numbers kept, the rows let go
            p0, p1 = it.score
            seq.scoring.score_prompt(token_logprobs(score_rows, seq.params, seq.prompt_ids[p0 + 1:p1 + 1],
                                                    seq.request.prompt_logprobs), p1)
        if not it.completes:
            verdict = self.speculator.settle(seq, PassResult(it.start, it.chunk, features=feats))
            seq.tally.on_pass(verdict)
            self.commit(seq, verdict)
            return
        # the model's own rows: a NaN/inf here is this sequence's failure, found before the
        # shared recycling table or any drafter reads them
        if pick is None or not pick[1]:
            check_logits(rows, "the target's logits")  # raises, naming the row and what it holds
        draft = it.draft if it.n_draft else None
        # penalties, logit_bias and the grammar, identically for plain and verify rows
        scores = process_logits(rows, seq.params, seq.output_ids, draft_paths(draft), seq.constraint)
        # the group's argmax is the scores' only where nothing changed the rows (process_logits
        # returns the rows themselves when the request sets no penalty, bias or grammar)
        argmax = pick[0] if pick is not None and scores is rows else None
        verdict = self.speculator.settle(seq, PassResult(it.start, it.chunk, draft, rows, scores, hidden, feats,
                                                         argmax=argmax))
        seq.tally.on_pass(verdict)
        chosen: list = []  # the new tokens' logprobs, when the request asks for them
        if seq.request.logprobs is not None:  # the rows that chose the new tokens
            chosen = token_logprobs(scores[verdict.rows], seq.params, verdict.tokens, seq.request.logprobs)
        t1 = time.perf_counter()
        self.commit(seq, verdict)
        t2 = time.perf_counter()
        parts = self.parts
        parts.add("settle", t1 - t0)
        parts.add("commit", t2 - t1)
        before = len(seq.text)
        kept = seq.append_tokens(verdict.tokens)
        self.emitted += len(kept)
        lps = None
        if seq.request.logprobs is not None:
            lps = chosen[:len(kept)]
            seq.scoring.add(lps)
        sink = self.owner.sink
        if sink.enabled and verdict.verify_pass:
            self.record_step(seq, it, verdict, len(kept), proposal, batch_size)
        if seq.handle is not None:
            seq.handle._emit(Event(kept, seq.text[before:], seq.finished, seq.finish_reason, lps))
        if seq.finished:
            self.owner.release(seq)
        parts.add("emit", time.perf_counter() - t2)

    def commit(self, seq: Sequence, verdict: Verdict) -> None:
        """The verdict's K/V moves (a tree's accepted path into place), then the target's
        cache cut to the kept length; the new last token stays pending."""
        if verdict.kv_moves:
            slots = self.cache.slots(seq.seq_id, 0, max(max(m) for m in verdict.kv_moves) + 1)
            src = slots[torch.tensor([m[0] for m in verdict.kv_moves])]
            dst = slots[torch.tensor([m[1] for m in verdict.kv_moves])]
            self.cache.copy_slots(src.to(self.cache.device), dst.to(self.cache.device))
        seq.set_cached(verdict.length)
        self.cache.set_length(seq.seq_id, verdict.length)

    def record_step(self, seq: Sequence, it: WorkItem, verdict: Verdict, emitted: int, proposal: Proposal,
                    batch_size: int) -> None:
        """One decode pass of seq, for the telemetry sink (only called when one is attached)."""
        method = seq.spec_state.method
        depths = it.draft.depths if it.n_draft else None
        self.owner.sink.on_step(seq, StepRecord(
            step_num=seq.tally.verify_passes, method=method if it.n_draft else None,
            gamma=seq.tally.gammas[-1] if seq.tally.gammas else 0, drafted=it.n_draft, accepted=verdict.accepted, emitted=emitted,
            depth=(max(depths) if depths is not None and len(depths) else it.n_draft),
            draft_ms=proposal.draft_ms.get(method, 0.0) if it.n_draft else 0.0,
            target_ms=self.target_ms, batch_size=batch_size,
            fallback=bool(seq.spec is not None and seq.spec.enabled and not it.n_draft)))
