"""EAGLE-3 drafter: dynamic draft trees from a head that reads the target's features.

Per sequence (`self.states[seq.seq_id]`, an `EagleState`): the head's K/V for positions
0 .. n-1 and the target features of positions n .. n + m - 1 not fed yet. The scheduler
hands the features of every row the target computed for the sequence (`observe`: the
prefill chunks, and after a verify pass the root and accepted nodes only, in path order),
so the head's cache only ever holds positions of the accepted text; nothing to roll back
but a re-prefill (a start below n cuts the cache).

Proposing: feed the pending positions (up to L - 2, L = the text's length: position p
pairs the feature of token p with the embedding of token p + 1), whose last output
predicts the token after the root. Then grow a tree EAGLE-2 style: at each depth expand
the `beam` frontier nodes with the highest path probability (product of the head's
probabilities along the path) by their `topk` children, each new row attending to the
head's cache, its ancestors' rows and itself; after `depth` levels keep the `budget` nodes
with the highest path probability (prefix-closed: a child never beats its parent). The
budget comes from the cost model: the n maximising (1 + sum of the n best path
probabilities) / verify_cost(n + 1), so a chain (budget = depth, beam 1) wins when wide
verification is expensive. Candidates are deterministic given the head (probs None), so
greedy tree verification and the recursive rejection over siblings stay lossless.

Prefix caching: the target's features of full blocks of accepted text are kept (`store`, keyed
by the prefix cache's chained block hash, least recently used out past STORE_BYTES), so a
prompt that takes a block from the target's prefix cache is handed that block's features
(`adopt`) and the head computes its own K/V from them; a sequence may take only the blocks whose
features are kept (`stored_prefix`). Drafts only: output never depends on the store.
"""

from __future__ import annotations

from collections import OrderedDict
import math
from dataclasses import dataclass, field

import torch

from specbuild.model.kv_cache import chain_hashes, salt_root

from specbuild.speculation.eagle_head import EagleHead, rows_index
from specbuild.speculation.proposers.base import Draft, DrafterBase, Needs, Observation
from specbuild.speculation.proposers.suffix import tree_draft



@dataclass
class EagleState:
    # the head's K/V: rows 0 .. n-1 hold positions 0 .. n-1; rows past n are a draft's scratch.
    # Buffers that grow by doubling, so a step writes only its new rows (torch.cat of the whole
    # cache each step made a drafter's work grow with the text)
    kb: torch.Tensor | None = None  # [capacity, kv, D]
    vb: torch.Tensor | None = None
    n: int = 0  # head positions cached
    pending: list = field(default_factory=list)  # features [3H] of positions n, n + 1, ...
    broken: bool = False  # a gap in the features (e.g. never observed): no drafts
    # features of positions acc_start.. (acc_start on a block boundary) not yet kept as a block
    acc_start: int = 0
    acc: list = field(default_factory=list)
    chain: list = field(default_factory=list)  # chained block hashes of the text (kv_cache.chain_hashes)

    @property
    def k(self) -> torch.Tensor | None:  # the cached positions' K [n, kv, D] (a view), None before any
        return None if self.kb is None else self.kb[:self.n]

    @property
    def v(self) -> torch.Tensor | None:
        return None if self.vb is None else self.vb[:self.n]

    def cut(self, length: int) -> None:
        self.n = min(self.n, length)

    def room(self, rows: int, kv: int, d: int, dtype: torch.dtype, device) -> None:
        """Buffers of at least `rows` rows (the rows there kept)."""
        cap = 0 if self.kb is None else self.kb.shape[0]
        if rows <= cap:
            return
        new = max(rows, 2 * cap, 64)
        kb = torch.empty(new, kv, d, dtype=dtype, device=device)
        vb = torch.empty(new, kv, d, dtype=dtype, device=device)
        if cap:  # every row: a draft growing them keeps its earlier levels' rows past n
            kb[:cap] = self.kb
            vb[:cap] = self.vb
        self.kb, self.vb = kb, vb


STORE_BYTES = 64 << 20  # the features kept for prefix caching (SmolLM2-135M: 9,700 positions)


GUARANTEE = ("lossless", "lossless", "specbuild verify: tree argmax walk (greedy), recursive rejection sampling "
                                     "over siblings with the head's deterministic top-k candidates (sampled)")  # its row of engine/guarantees.py's torch table
ROLE = "eagle"  # the bundle role it needs


class EagleProposer(DrafterBase):
    name = "eagle"

    def __init__(self, head: EagleHead, target_vocab: int, max_nodes: int, topk: int = 4, beam: int = 4,
                 block_size: int = 16, store_bytes: int = STORE_BYTES) -> None:
        self.head = head
        self.block_size = block_size
        self.store: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # block hash -> features [block, 3H]
        self.store_bytes, self.stored_bytes = store_bytes, 0
        self.needs = Needs(aux_layers=tuple(head.config.aux_layers), tree=True)
        self.states: dict[int, EagleState] = {}  # seq_id -> the head's cache and pending features
        self.target_vocab = target_vocab
        self.max_nodes = max_nodes
        self.topk, self.beam = topk, beam
        self.verify_cost = None  # callable width -> seconds, set by the engine once costs are measured
        self.stat_budgets: list[int] = []
        self.draft_list: list[int] = head.draft_ids.tolist()  # draft vocabulary index -> target id
        self.rows = head.rows_ready()  # drafting levels through level_rows (the head's buffers; else layer())

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.config.aux_layers

    def cost_key(self) -> list:
        """What level_cost depends on besides the machine (the cost cache's key)."""
        h = self.head
        return ["eagle", h.config.hidden_size, h.draft_vocab, self.beam, self.topk, str(h.w["fc.weight"].dtype),
                "int8" if h.packed else "float", "level_rows" if self.rows else "layer", "cold"]

    @torch.inference_mode()
    def level_cost(self, context: int = 64, repeats: int = 5) -> float:
        """Seconds one draft level costs (the best of `repeats`, each after the caches were
        evicted, as a served step's drafting runs after the target's forward): the head on `beam`
        frontier rows over `context` cached positions, its output layer, log-softmax and top-k,
        which is what draft() runs per level (the first level's feed costs about the same). The cost
        model charges it per drafted depth, as it charges a draft model's step; without it the
        depth controller and `auto` took EAGLE drafts for free (measured: 1.7 / 3.1 / 4.4 ms
        at depth 1 / 2 / 3 in bfloat16 on 2 cores, against a 16.5 ms target step)."""
        from specbuild.model.timing import best_cold_seconds

        h, c = self.head, self.head.config
        dtype = h.w["fc.weight"].dtype
        dev = h.embed.device
        kv = torch.zeros(context, c.num_kv_heads, c.head_dim, dtype=dtype, device=dev)
        emb = h.embed_tokens(torch.zeros(self.beam, dtype=torch.int64, device=dev))
        hid = torch.zeros(self.beam, c.hidden_size, dtype=dtype, device=dev)
        pos = torch.full((self.beam,), context, dtype=torch.int64, device=dev)
        mask = torch.ones(self.beam, context + self.beam, dtype=torch.bool, device=dev)
        kb = torch.zeros(context + self.beam, c.num_kv_heads, c.head_dim, dtype=dtype, device=dev)
        vb = torch.zeros_like(kb)
        index = rows_index([[context + r] for r in range(self.beam)], context)

        def level() -> None:
            if self.rows:
                _, logits = h.level_rows(emb, hid, pos, kb, vb, context, index, self.beam)
            else:
                out, _, _ = h.layer(emb, hid, pos, kv, kv, mask)
                logits = h.logits(out)
            logits.float().log_softmax(-1).topk(min(self.topk, h.draft_vocab), dim=-1)

        return best_cold_seconds(level, repeats)

    # ---- features from the target --------------------------------------------------------
    def observe(self, seq, obs: Observation) -> None:
        if obs.features is not None:
            self.feed(seq, obs.start, obs.features)

    def feed(self, seq, start: int, feats: torch.Tensor) -> None:
        """Features [m, 3H] of positions start .. start + m - 1 of seq's accepted text."""
        st = self.states.get(seq.seq_id)
        if st is None:
            st = self.states[seq.seq_id] = EagleState()
        known = st.n + len(st.pending)
        if start < st.n:
            st.cut(start)
            st.pending = []
        elif start <= known:
            st.pending = st.pending[:start - st.n]
        else:
            st.broken = True
            return
        if start == 0:
            st.broken = False
        st.pending.extend(feats.unbind(0))
        self._collect(seq, st, start, feats)

    # ---- the features kept for prefix caching ------------------------------------------------------
    @staticmethod
    def _salt(seq) -> bytes:
        return salt_root(getattr(getattr(seq, "request", None), "cache_salt", None))

    def _collect(self, seq, st: EagleState, start: int, feats: torch.Tensor) -> None:
        """Gather the features of seq's accepted text by whole blocks (from a block boundary)."""
        bs = self.block_size
        if start == st.acc_start + len(st.acc):
            st.acc.extend(feats.unbind(0))
        else:  # a restart or a gap: from the next block boundary on
            skip = (-start) % bs
            st.acc_start, st.acc = start + skip, list(feats.unbind(0))[skip:]
        self._flush(seq, st)

    def _flush(self, seq, st: EagleState) -> None:
        """Keep every gathered full block whose tokens are all in the text (the tokens of a pass
        are appended after its features arrive)."""
        bs, ids = self.block_size, seq.all_ids
        while len(st.acc) >= bs and st.acc_start + bs <= len(ids):
            j = st.acc_start // bs
            h = chain_hashes(ids, bs, j + 1, self._salt(seq), st.chain)[j]
            if h in self.store:
                self.store.move_to_end(h)
            else:
                block = torch.stack(st.acc[:bs])
                self.store[h] = block
                self.stored_bytes += block.numel() * block.element_size()
                while self.stored_bytes > self.store_bytes and self.store:
                    _, old = self.store.popitem(last=False)
                    self.stored_bytes -= old.numel() * old.element_size()
            st.acc, st.acc_start = st.acc[bs:], st.acc_start + bs

    def stored_prefix(self, seq, limit: int) -> int:
        bs, n = self.block_size, 0
        for h in chain_hashes(seq.all_ids, bs, max(0, limit) // bs, self._salt(seq)):
            if h not in self.store:
                break
            n += 1
        return n * bs

    def adopt(self, seq, start: int, end: int) -> None:
        """Hand the head the kept features of positions start..end (whole blocks), which the
        target took from its prefix cache instead of computing them."""
        bs = self.block_size
        chain = chain_hashes(seq.all_ids, bs, end // bs, self._salt(seq))
        blocks = []
        for h in chain[start // bs:]:
            block = self.store.get(h)
            if block is None:  # evicted since stored_prefix: the head has a gap, so it drafts nothing
                self.states.setdefault(seq.seq_id, EagleState()).broken = True
                return
            self.store.move_to_end(h)
            blocks.append(block)
        if blocks:
            self.feed(seq, start, torch.cat(blocks))

    # ---- drafting ----------------------------------------------------------------------------
    @torch.inference_mode()
    def _feed(self, seq, st: EagleState) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Feed positions st.n .. L - 2; returns (logits [N], out [H]) of the last one."""
        ids = seq.all_ids
        last = len(ids) - 2
        m = last + 1 - st.n
        if m <= 0 or len(st.pending) < m:
            return None
        head, c = self.head, self.head.config
        dev = head.embed.device
        feats = torch.stack(st.pending[:m]).to(dev)
        st.pending = st.pending[m:]
        pos = torch.arange(st.n, last + 1, device=dev)
        emb = head.embed_tokens(torch.tensor(ids[st.n + 1:last + 2], device=dev))
        dtype = head.cos.dtype
        if self.rows:  # room for the draft's rows too (draft() writes them past n)
            st.room(last + 1 + self.beam * max(1, self.max_nodes), c.num_kv_heads, c.head_dim, dtype, dev)
            out, logits = head.level_rows(emb, None, pos, st.kb, st.vb, st.n, None, 1, feats=feats)
            st.n = last + 1
            return logits[0], out[-1]
        out, k, v = head.layer(emb, head.project(feats), pos, st.k, st.v, None)
        st.room(last + 1, c.num_kv_heads, c.head_dim, k.dtype, dev)
        st.kb[st.n:last + 1] = k
        st.vb[st.n:last + 1] = v
        st.n = last + 1
        return head.logits(out[-1:])[0], out[-1]

    def budget(self, scores: list[float], cap: int) -> int:
        """Node count maximising (1 + sum of the best path probabilities) / verify cost."""
        best_n, best_rate = 1, -1.0
        total = 1.0
        for n, s in enumerate(sorted(scores, reverse=True)[:cap], start=1):
            total += s
            cost = self.verify_cost(n + 1) if self.verify_cost is not None else float(n + 1) ** 0.5
            rate = total / cost
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n

    @torch.inference_mode()
    def draft(self, seq, depth: int, first: tuple[torch.Tensor, torch.Tensor], st: EagleState) -> Draft | None:
        head, c = self.head, self.head.config
        root_logits, root_out = first
        # nodes: token, parent (0 = root), depth, path log-prob, head output at the row that fed it
        tokens, parents, depths, scores = [0], [-1], [0], [0.0]
        outs: list[torch.Tensor | None] = [root_out]
        k = min(self.topk, head.draft_vocab)
        top = root_logits.float().log_softmax(-1).topk(k)
        tops = {0: (top.values.tolist(), top.indices.tolist())}  # node -> its children's log-probs and ids
        row_k, row_v = [], []  # draft rows' K/V (node i >= 1 -> index i - 1, when computed; layer() only)
        frontier = [0]
        computed: dict[int, int] = {}  # node -> index of its row among the draft rows
        base_pos = len(seq.all_ids) - 1  # head position of a depth-1 node's row
        dev = head.embed.device
        past_rows = 0
        for d in range(1, depth + 1):
            new = []
            for node in frontier:
                vals, idxs = tops[node]
                for val, idx in zip(vals, idxs):
                    tokens.append(self.draft_list[idx])
                    parents.append(node)
                    depths.append(d)
                    scores.append(scores[node] + val)
                    outs.append(None)
                    new.append(len(tokens) - 1)
            if d == depth:
                break
            frontier = sorted(new, key=lambda i: -scores[i])[:self.beam]
            # run the head on the frontier: hidden = the parent's output, embed = the node's token
            hid = torch.stack([outs[parents[i]] for i in frontier])
            emb = head.embed_tokens(torch.tensor([tokens[i] for i in frontier], device=dev))
            pos = torch.full((len(frontier),), base_pos + d - 1, dtype=torch.int64, device=dev)
            ancestors = []  # each frontier row's computed ancestors' rows, shallowest first
            for i in frontier:
                rows, a = [], parents[i]
                while a > 0:
                    if a in computed:
                        rows.append(computed[a])
                    a = parents[a]
                ancestors.append(rows[::-1])
            if self.rows:  # the draft's rows go into the head's buffers past its cached positions
                at = st.n + past_rows
                st.room(at + len(frontier), c.num_kv_heads, c.head_dim, head.cos.dtype, dev)
                index = rows_index([[st.n + a for a in anc] + [at + r] for r, anc in enumerate(ancestors)], st.n)
                out, logits = head.level_rows(emb, hid, pos, st.kb, st.vb, at, index, len(frontier))
            else:
                mask = torch.zeros(len(frontier), st.n + past_rows + len(frontier), dtype=torch.bool)
                mask[:, :st.n] = True
                for r, anc in enumerate(ancestors):
                    for a in anc:
                        mask[r, st.n + a] = True
                    mask[r, st.n + past_rows + r] = True
                pk = torch.cat([st.k, *row_k]) if row_k else st.k
                pv = torch.cat([st.v, *row_v]) if row_v else st.v
                out, kr, vr = head.layer(emb, hid, pos, pk, pv, mask.to(dev))
                row_k.append(kr)
                row_v.append(vr)
                logits = head.logits(out)
            for r, i in enumerate(frontier):
                computed[i] = past_rows + r
                outs[i] = out[r]
            past_rows += len(frontier)
            top = logits.float().log_softmax(-1).topk(k, dim=-1)
            for i, vals, idxs in zip(frontier, top.values.tolist(), top.indices.tolist()):
                tops[i] = (vals, idxs)
        cand = list(range(1, len(tokens)))
        probs = [math.exp(scores[i]) for i in cand]
        n = self.budget(probs, min(self.max_nodes, len(cand)))
        self.stat_budgets.append(n)
        keep = sorted(sorted(cand, key=lambda i: (-scores[i], depths[i]))[:n])
        keep_set = set(keep)
        # prefix-closed by construction (a child's path probability never exceeds its parent's);
        # ties broken by depth keep the parent first
        assert all(parents[i] == 0 or parents[i] in keep_set for i in keep)
        index = {0: 0}
        out_tokens, out_parents, out_depths = [], [-1], []
        for i in keep:
            index[i] = len(index)
            out_tokens.append(tokens[i])
            out_parents.append(index[parents[i]])
            out_depths.append(depths[i])
        return tree_draft(out_tokens, out_parents, out_depths, self.name)

    def propose(self, seqs: list, gammas: list[int]) -> list[Draft | None]:
        out: list[Draft | None] = []
        for seq, gamma in zip(seqs, gammas):
            st: EagleState | None = self.states.get(seq.seq_id)
            if st is not None:
                self._flush(seq, st)  # blocks whose last tokens the previous pass appended
            if gamma <= 0 or st is None or st.broken:
                out.append(None)
                continue
            first = self._feed(seq, st)
            out.append(None if first is None else self.draft(seq, gamma, first, st))
        return out

    def rollback(self, seq, length: int) -> None:
        """The head caches only accepted positions (< length - 1); a shorter target cache
        (a re-prefill) cuts it, and the features are observed again."""
        st = self.states.get(seq.seq_id)
        if st is not None and length < st.n + 1:
            st.cut(max(length - 1, 0))
            st.pending = []

    def release(self, seq) -> None:
        st = self.states.pop(seq.seq_id, None)
        if st is not None:
            self._flush(seq, st)  # the last pass's blocks, whose tokens are in the text by now


def build(ctx) -> EagleProposer | None:
    if "eagle" not in ctx.roles:
        return None
    from specbuild.speculation.eagle_head import load_eagle

    head = load_eagle(ctx.bundle_dir, ctx.roles["eagle"], ctx.target.w, ctx.max_seq_len + ctx.max_draft_len + 2,
                      ctx.settings.device)
    level = head_kernel_level(ctx.settings.device)
    if level:
        head.quantize_int8(level)
    return EagleProposer(head, ctx.vocab_size, ctx.max_draft_len, block_size=ctx.settings.block_size)


def head_kernel_level(device) -> int:
    """The ISA level at which the head's linears run int8 through specbuild's CPU kernel, or 0
    (float weights, torch's matmul): on the CPU wherever the kernel is available, unless
    SPECBUILD_CPU_KERNEL=torch. Only the drafts depend on it (measured on SmolLM2's shipped
    head: held-out expected tokens per pass 1.760 int8 against 1.757 float32, one level 1.0-1.6
    ms against 7.5-8.9 ms; docs/eagle-training.md)."""
    import sys

    from specbuild.model import cpu_kernels

    if torch.device(device).type != "cpu" or cpu_kernels.mode() == "torch":
        return 0
    level = cpu_kernels.isa()
    if level == 2:  # the same bits at 2 and 3 (one-row tiles in AVX2 or AVX-512): the faster one here
        level = cpu_kernels.ours_level("int8", torch.bfloat16) or level
    if level:
        print(f"specbuild: the EAGLE head's linears run int8 through specbuild's {cpu_kernels.level_name('int8', level)} kernel "
              "(drafts only: the target's output does not depend on it)", file=sys.stderr)
    return level
