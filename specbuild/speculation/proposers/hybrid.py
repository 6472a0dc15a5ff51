"""One tree from several drafters (`speculation: hybrid`): suffix decoding's, token
recycling's and (when the bundle has one, served eagerly) the EAGLE head's candidates merged,
deduplicated by prefix, in one verified tree per step.

Each step, every drafter still asked for this sequence proposes its own tree (suffix: the
most frequent continuations of the longest match in the request and earlier requests;
recycling: the target's own earlier top-k, with prompt lookup's branch; EAGLE: the head's
tree from the target's features, which it reads for hybrid's requests as for its own). The
trees are merged into one prefix-closed tree: a node proposed by several is one node. Nodes are then kept
best-first by score within a node budget, each node's score being its drafter's measured
acceptance at its depth for this sequence (a rolling estimate from the step's recorded
candidate sources, proposers/base.candidate_sources; a prior of 0.6^depth before any) times its
parent's; suffix's nodes bring their own estimate instead (their share of the match's
occurrences times the measured rate at which the target follows matches of that length, which
lets a long match's chain run past gamma). The budget n maximises (1 + the n best scores'
sum) / verify_cost(n + 1), the measured verify cost by width (set by the engine's calibration; sqrt(width) before it). A
drafter whose candidates went unaccepted in its last WINDOW offering steps stops being asked
(its proposal cost stops being paid), and is asked again every PROBE steps.

Candidates are a deterministic function of the text, the stores and the target's earlier
rows (one-hot, `probs` None), so greedy tree verification and the recursive rejection over
siblings keep the output lossless, as for each drafter alone.
"""

from __future__ import annotations

import heapq

from specbuild.speculation.proposers.base import Draft, DrafterBase, Needs, Observation
from specbuild.speculation.proposers.suffix import tree_draft

WINDOW = 8  # offering steps without an accepted candidate before a drafter is no longer asked
PROBE = 16  # steps between probes of a drafter no longer asked
PRIOR = 0.6  # acceptance prior per depth level before anything is measured
DECAY = 0.9  # weight of older steps in the rolling per-depth estimates


class _Track:
    """One sequence's rolling acceptance per drafter and depth."""

    __slots__ = ("rates", "misses", "skipped")

    def __init__(self) -> None:
        self.rates: dict[str, list[list[float]]] = {}  # drafter -> per depth [offered, accepted] (decayed)
        self.misses: dict[str, int] = {}  # drafter -> offering steps in a row with nothing accepted
        self.skipped: dict[str, int] = {}  # drafter -> steps not asked since the last probe

    def rate(self, drafter: str, depth: int) -> float:
        rows = self.rates.get(drafter)
        if rows is None or len(rows) < depth or rows[depth - 1][0] < 1.0:
            return PRIOR
        o, a = rows[depth - 1]
        return (a + PRIOR) / (o + 1.0)

    def learn(self, sources: dict) -> None:
        by_drafter: dict[str, list[list[int]]] = {}
        for name, positions in sources.items():
            drafter = name.split(":", 1)[0]
            acc = by_drafter.setdefault(drafter, [])
            for i, (o, a) in enumerate(positions):
                while len(acc) <= i:
                    acc.append([0, 0])
                acc[i][0] += o
                acc[i][1] += a
        for drafter, positions in by_drafter.items():
            rows = self.rates.setdefault(drafter, [])
            for i, (o, a) in enumerate(positions):
                while len(rows) <= i:
                    rows.append([0.0, 0.0])
                rows[i][0] = rows[i][0] * DECAY + o
                rows[i][1] = rows[i][1] * DECAY + a
            got = sum(a for _, a in positions)
            self.misses[drafter] = 0 if got else self.misses.get(drafter, 0) + 1


GUARANTEE = ("lossless", "lossless", "specbuild verify: tree argmax walk (greedy), recursive rejection sampling "
                                     "over siblings with the merged deterministic candidates of suffix and recycle "
                                     "(sampled)")  # its row of engine/guarantees.py's torch table


class HybridProposer(DrafterBase):
    """Proposer protocol (base.py) over the engine's suffix and recycling proposers (their
    stores and tables are shared with the methods of those names, and learn from hybrid's
    requests too: Needs.parts)."""

    name = "hybrid"

    def __init__(self, suffix, recycle, max_nodes: int = 8, eagle=None) -> None:
        self.suffix, self.recycle, self.eagle = suffix, recycle, eagle
        # the merged drafters learn from hybrid's requests too (the EAGLE head: their features)
        self.needs = Needs(tree=True, parts=("suffix", "recycle") + (("eagle",) if eagle is not None else ()))
        self.max_nodes = max(1, int(max_nodes))
        self.verify_cost = None  # callable width -> seconds (speculator calibration), else sqrt(width)
        self.tracks: dict[int, _Track] = {}
        self.asked = {"suffix": 0, "recycle": 0, "eagle": 0}  # proposals requested, per drafter (tests, tuning)
        self.got = {"suffix": 0, "recycle": 0, "eagle": 0}  # and the ones that came back with candidates

    def _cost(self, width: int) -> float:
        return self.verify_cost(width) if self.verify_cost is not None else float(width) ** 0.5

    def _ask(self, track: _Track, drafter: str) -> bool:
        if track.misses.get(drafter, 0) < WINDOW:
            return True
        track.skipped[drafter] = track.skipped.get(drafter, 0) + 1
        if track.skipped[drafter] >= PROBE:
            track.skipped[drafter] = 0
            track.misses[drafter] = WINDOW - 1  # one more miss and it is dropped again
            return True
        return False

    def draft_for(self, seq, gamma: int) -> Draft | None:
        track = self.tracks.get(seq.seq_id)
        if track is None:
            track = self.tracks[seq.seq_id] = _Track()
        if gamma <= 0:
            return None
        drafts: list[tuple[str, Draft]] = []
        if self._ask(track, "suffix"):
            self.asked["suffix"] += 1
            d = self.suffix.draft_for(seq, gamma)
            if d is not None:
                drafts.append(("suffix", d))
                self.got["suffix"] += 1
        if self._ask(track, "recycle"):
            self.asked["recycle"] += 1
            d = self.recycle.propose([seq], [gamma])[0]
            if d is not None:
                drafts.append(("recycle", d))
                self.got["recycle"] += 1
        if self.eagle is not None and self._ask(track, "eagle"):
            self.asked["eagle"] += 1
            d = self.eagle.propose([seq], [gamma])[0]
            if d is not None:
                drafts.append(("eagle", d))
                self.got["eagle"] += 1
        # suffix may draft past gamma where its match is long (SuffixProposer.depth_limit)
        depth = max([gamma] + [max(d.depths) for name, d in drafts if name == "suffix"])
        return self.merge(drafts, track, depth) if drafts else None

    def merge(self, drafts: list[tuple[str, Draft]], track: _Track, max_depth: int) -> Draft | None:
        """One prefix-closed tree of the drafts' nodes, best-first by score within the budget."""
        # the union trie: key (parent union node, token) -> union node; a node keeps its best score
        kids: dict[int, dict[int, int]] = {0: {}}
        tok, depth, score, source = [0], [0], [1.0], [""]
        for drafter, d in drafts:
            where = {0: 0}
            names = d.sources or [drafter] * len(d.tokens)
            for i, t in enumerate(d.tokens, start=1):
                p = where.get(d.parents[i])
                if p is None or depth[p] + 1 > max_depth:
                    continue
                # the drafter's own estimate where it gives one (suffix: path share times the
                # measured rate for its match length), else its measured rate at this depth
                s = min(d.scores[i - 1], score[p]) if d.scores is not None \
                    else score[p] * track.rate(drafter, depth[p] + 1)
                node = kids[p].get(t)
                if node is None:
                    node = len(tok)
                    kids[p][t] = node
                    kids[node] = {}
                    tok.append(t)
                    depth.append(depth[p] + 1)
                    score.append(s)
                    source.append(names[i - 1])
                elif s > score[node]:
                    score[node], source[node] = s, names[i - 1]
                where[i] = node
        # best-first within the budget that pays most per measured verify cost
        order, heap = [], [(-score[k], k) for k in kids[0].values()]
        heapq.heapify(heap)
        while heap and len(order) < self.max_nodes:
            _, k = heapq.heappop(heap)
            order.append(k)
            for c in kids[k].values():
                heapq.heappush(heap, (-score[c], c))
        if not order:
            return None
        best_n, best_rate, total = 0, 1.0 / self._cost(1), 0.0
        for n, k in enumerate(order, start=1):
            total += score[k]
            rate = (1.0 + total) / self._cost(n + 1)
            if rate > best_rate:
                best_n, best_rate = n, rate
        keep = order[:max(best_n, 1)]
        node_of = {0: 0}
        tokens, parents, depths, sources = [], [-1], [], []
        parent_of = {c: p for p, cs in kids.items() for c in cs.values()}
        for k in keep:  # best-first order: a parent always precedes its children
            node_of[k] = len(tokens) + 1
            tokens.append(tok[k])
            parents.append(node_of[parent_of[k]])
            depths.append(depth[k])
            sources.append(source[k])
        draft = tree_draft(tokens, parents, depths, self.name)
        draft.sources = sources
        return draft

    # ---- the protocol ----------------------------------------------------------------
    def propose(self, seqs: list, gammas: list[int]) -> list[Draft | None]:
        return [self.draft_for(seq, gamma) for seq, gamma in zip(seqs, gammas)]

    def observe(self, seq, obs: Observation) -> None:
        """Each drafter's acceptance by depth, from the verified draft's candidate sources."""
        if obs.method == self.name and obs.sources is not None:
            track = self.tracks.get(seq.seq_id)
            if track is None:
                track = self.tracks[seq.seq_id] = _Track()
            track.learn(obs.sources)

    def release(self, seq) -> None:
        self.tracks.pop(seq.seq_id, None)


def build(ctx) -> HybridProposer:
    return HybridProposer(ctx.built["suffix"], ctx.built["recycle"], max(1, ctx.max_draft_len), ctx.built.get("eagle"))
