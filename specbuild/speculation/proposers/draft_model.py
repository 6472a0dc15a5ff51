"""Draft-model drafter: a small decoder with its own paged KV cache.

Per sequence the draft cache holds a prefix of the sequence's tokens (`self.lengths[seq_id]`,
the proposer's own record). Proposing first feeds the tokens it has not seen (the last
accepted token, or more after a repair), then drafts gamma tokens one batched forward at
a time, sampling each from the request's warped distribution and keeping those
probabilities for rejection sampling. After verification `rollback` trims the draft
cache to what the target accepted, in the same call that trims the target's.
"""

from __future__ import annotations

import logging

import torch

from specbuild.model.decoder import Decoder, ForwardBatch, ragged_mask
from specbuild.model.kv_cache import key_root, salt_key
from specbuild.sampling.params import sample_from, warp_probs
from specbuild.speculation.proposers.base import Draft, DrafterBase

log = logging.getLogger("specbuild.draft")


GUARANTEE = ("lossless", "lossless", "specbuild verify: argmax match (greedy), chain rejection sampling with "
                                     "the draft's probabilities (sampled)")  # its row of engine/guarantees.py's torch table
ROLE = "draft"  # the bundle role it needs


class DraftModelProposer(DrafterBase):
    name = "draft"
    emit = None  # callable(seq, kind, detail) or None: cache desync reports (Speculator.set_emit)

    def __init__(self, model: Decoder, num_blocks: int, target_vocab: int, block_size: int = 16,
                 vocab_map: torch.Tensor | None = None, prefix_cache: bool = True) -> None:
        self.model = model
        # prefix reuse in the draft's own cache (model/kv_cache.py): a new sequence adopts the
        # recorded blocks that begin its text, and committed text is recorded before each draft.
        # Drafts only: the target checks every token, so this never changes output
        self.prefix_cache = prefix_cache
        self.cache = model.new_cache(num_blocks, block_size)
        self.vocab_map = vocab_map  # [draft_vocab] target ids of the draft's outputs, or None
        self.target_vocab = target_vocab
        self.lengths: dict[int, int] = {}  # seq_id -> tokens of the sequence held in the draft cache

    def _ensure(self, seq) -> None:
        if seq.seq_id not in self.cache.seqs:
            self.cache.add(seq.seq_id, key_root(self.salt_of(seq)))
            self.lengths[seq.seq_id] = 0
            if self.prefix_cache:
                n = len(seq.all_ids) - 1
                self.lengths[seq.seq_id] = self.cache.extend(seq.seq_id, seq.all_ids, n, query=n)

    @staticmethod
    def salt_of(seq) -> int:
        """The sequence's cache_salt as salt_key's int (a MineDraft mirror carries it as `salt`)."""
        if hasattr(seq, "salt"):
            return seq.salt
        request = getattr(seq, "request", None)
        return salt_key(getattr(request, "cache_salt", None))

    def _record(self, seq) -> None:
        """Offer the committed text held in the draft cache (drafts were rolled back) for reuse."""
        if self.prefix_cache:
            self.cache.register(seq.seq_id, seq.all_ids, self.lengths[seq.seq_id])

    def _forward(self, rows: list[tuple[object, list[int]]]) -> torch.Tensor:
        """Feed tokens[i] to seqs[i] (ragged); returns last-row logits [len(rows), vocab]."""
        ids, pos, wslots, rslots, last = [], [], [], [], []
        blocks, t, s = [], 0, 0
        for seq, toks in rows:
            start = self.lengths[seq.seq_id]
            n = len(toks)
            self.cache.reserve(seq.seq_id, start + n)
            slots = self.cache.slots(seq.seq_id, 0, start + n)
            ids += toks
            pos.append(torch.arange(start, start + n))
            wslots.append(slots[start:])
            rslots.append(slots)
            blocks.append((t, s, n, start, None))
            t += n
            s += start + n
            last.append(t - 1)
            self.lengths[seq.seq_id] = start + n
        mask = ragged_mask(blocks, t, s)
        dev = self.cache.device
        batch = ForwardBatch(torch.tensor(ids, dtype=torch.int64, device=dev), torch.cat(pos).to(dev),
                             torch.cat(wslots).to(dev), torch.cat(rslots).to(dev),
                             None if mask is None else mask.to(dev), torch.tensor(last, device=dev))
        for seq, _ in rows:
            self.cache.set_length(seq.seq_id, self.lengths[seq.seq_id])
        return self.model.forward(batch, self.cache).logits

    def _to_target_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """A reduced-vocabulary draft: scatter its logits into the target's vocabulary,
        -inf elsewhere (probability zero: rejection sampling stays exact)."""
        if self.vocab_map is None:
            return logits
        full = torch.full((logits.shape[0], vocab), float("-inf"), dtype=logits.dtype, device=logits.device)
        full[:, self.vocab_map] = logits
        return full

    def propose(self, seqs: list, gammas: list[int]) -> list[Draft | None]:
        active = [(i, s, g) for i, (s, g) in enumerate(zip(seqs, gammas)) if g > 0]
        out: list[Draft | None] = [None] * len(seqs)
        if not active:
            return out
        tokens: dict[int, list[int]] = {i: [] for i, _, _ in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in active}
        rows = []
        for i, seq, g in active:
            self._ensure(seq)
            ids = seq.all_ids
            if self.lengths[seq.seq_id] > len(ids) - 1:  # cannot happen unless state broke: repair
                log.warning("draft cache of sequence %d ahead of its text (%d > %d): re-prefilling",
                            seq.seq_id, self.lengths[seq.seq_id], len(ids) - 1)
                if self.emit is not None:
                    self.emit(seq, "kv_desync", {"cache": "draft", "have": self.lengths[seq.seq_id],
                                                 "expected": len(ids) - 1, "repair": "re-prefill"})
                self.rollback(seq, 0)
            self._record(seq)
            rows.append((seq, ids[self.lengths[seq.seq_id]:]))
        live = active
        for step in range(max(g for _, _, g in active)):
            logits = self._forward(rows)
            logits = self._to_target_vocab(logits, self.target_vocab)
            nxt_rows, nxt_live = [], []
            for r, (i, seq, g) in enumerate(live):
                row = logits[r:r + 1]
                constraint = getattr(seq, "constraint", None)  # MineDraft's draft-rank mirrors have none
                if constraint is not None:  # draft only what the grammar allows (the target checks anyway)
                    row = row.masked_fill(~constraint.masks_for_paths([tokens[i]]), float("-inf"))
                if seq.params.greedy:
                    tok = int(row[0].argmax())
                    p = None
                else:
                    p = warp_probs(row, seq.params)[0]
                    tok = int(sample_from(p.unsqueeze(0), seq.uniforms(1))[0])
                tokens[i].append(tok)
                probs[i].append(p)
                if len(tokens[i]) < g:
                    nxt_rows.append((seq, [tok]))
                    nxt_live.append((i, seq, g))
            if not nxt_live:
                break
            rows, live = nxt_rows, nxt_live
        for i, seq, g in active:
            p = None if seq.params.greedy else torch.stack(probs[i])
            out[i] = Draft(tokens[i], p, method="draft")
        return out

    def prefill(self, seqs: list) -> None:
        """Feed each sequence's text but its last token into the draft cache, drafting nothing
        (one batched forward): the prompt's K/V are in place before the first `propose`, which
        then feeds only what came after. MineDraft's draft rank runs it while the target
        prefills the same prompt."""
        rows = []
        for seq in seqs:
            self._ensure(seq)
            self._record(seq)
            todo = seq.all_ids[self.lengths[seq.seq_id]:len(seq.all_ids) - 1]
            if todo:
                rows.append((seq, todo))
        if rows:
            self._forward(rows)

    def rollback(self, seq, length: int) -> None:
        """Target holds `length` valid tokens: keep at most that many in the draft cache."""
        if seq.seq_id not in self.cache.seqs:
            return
        keep = min(self.lengths[seq.seq_id], length)
        self.lengths[seq.seq_id] = keep
        self.cache.set_length(seq.seq_id, keep)

    def models(self) -> list[tuple[Decoder, object]]:
        return [(self.model, self.cache)]

    def release(self, seq) -> None:
        self.cache.release(seq.seq_id)
        self.lengths.pop(seq.seq_id, None)


def build(ctx) -> DraftModelProposer | None:
    """The bundle's draft role, unless its model runs elsewhere (load_draft=False: MineDraft's
    draft rank) or is not in the bundle."""
    if "draft" not in ctx.roles or not ctx.settings.load_draft:
        return None
    model, vocab_map = ctx.load_model("draft")
    return DraftModelProposer(model, ctx.cache.num_blocks, ctx.vocab_size, ctx.settings.block_size,
                              vocab_map=vocab_map, prefix_cache=ctx.settings.prefix_cache)
