"""Token recycling: a training-free tree drafter fed by the target's own verify passes.

Every verify (or decode) pass already computes the target's logits at each of its rows; a
row whose input token is x holds the target's guess of what follows x in that context.
The proposer keeps, per token id, the top-k successors from the latest row that had that
token as input (a [vocab, k] table, "the adjacency matrix" of Luo et al., "Turning Trash
into Treasure", arXiv 2408.08696), and drafts a token tree from it: a tree path
(r1, r2, ...) of per-depth ranks (the Medusa path format of speculation/tree.py) becomes the
tokens t1 = table[root][r1], t2 = table[t1][r2], ... Nodes whose table entry is still
empty are dropped with their subtrees. Where prompt lookup (n-gram of length >= 2, as in
proposers/ngram.py) finds an earlier occurrence of the text's end, its continuation goes
in first as one branch and the table's nodes fill the rest of the node budget.

The table is one per engine and is kept across requests (it warms up as the engine
serves), like the paper's. Drafts are a deterministic function of what the target said
before this step (one-hot, `probs` None), so greedy tree verification and the recursive
rejection over siblings (sampling/acceptance.py) stay lossless; what the table holds
changes only how many drafts are accepted. Because the table is shared, a seeded sampled
request's exact tokens may depend on earlier requests (its distribution does not).

Cost: one `topk` over each verified row's logits (observe), a few table reads (propose).
"""

from __future__ import annotations

import functools

import torch

from specbuild.errors import RequestError
from specbuild.speculation.proposers.base import Draft, DrafterBase, Needs, Observation
from specbuild.speculation.proposers.suffix import LocalText
from specbuild.speculation.tree import MAX_RANK, TreeError, TreeSpec, request_tree

# Node budgets for the default trees, keyed by the most nodes the bundle verifies. Path
# values: per-rank hit rates measured for the table on Spec-Bench train answers of the
# default model (see README "Token recycling"), used by tree.sparse_tree to pick the best
# tree of each size.
RANK_ACC = [[0.40, 0.12, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01]] * 8


def default_tree(max_nodes: int) -> TreeSpec:
    """The best tree of at most `max_nodes` (>= 1) drafts under RANK_ACC."""
    from specbuild.speculation.tree import sparse_tree

    n = max(1, min(int(max_nodes), 24))
    return sparse_tree(RANK_ACC, n, name=f"recycle_{n}")


@functools.lru_cache(maxsize=64)
def _load_cached(name_or_paths: str | tuple) -> TreeSpec:
    return request_tree(name_or_paths)  # a preset name or inline paths (README: `tree`), never a file


@functools.lru_cache(maxsize=256)
def _prune(tree: TreeSpec, max_depth: int) -> TreeSpec:
    if max_depth >= tree.max_depth:
        return tree
    return TreeSpec.from_paths([p for p in tree.paths if len(p) <= max_depth],
                               f"{tree.name}@depth{max_depth}" if tree.name else None)


GUARANTEE = ("lossless", "lossless", "specbuild verify: tree argmax walk (greedy), recursive rejection sampling "
                                     "over siblings with deterministic candidates from the target's own earlier "
                                     "top-k (sampled)")  # its row of engine/guarantees.py's torch table


class RecyclingProposer(DrafterBase):
    """Proposer protocol (base.py): one table shared by every request; `learn(tokens, logits)`
    feeds it with each verified row of the requests that use it (`observe`)."""

    name = "recycle"
    needs = Needs(logits=True, tree=True)
    request_tree = True  # a request may name its tree (validate_tree)

    def __init__(self, vocab_size: int, tree: TreeSpec | None = None, k: int = MAX_RANK, max_nodes: int = 8,
                 with_lookup: bool = True) -> None:
        if not 1 <= k <= MAX_RANK:
            raise ValueError(f"k={k} successors per token is out of range [1, {MAX_RANK}]")
        self.vocab_size = vocab_size
        self.k = k
        self.table = torch.full((vocab_size, k), -1, dtype=torch.int64)
        self.default_tree = tree or default_tree(max_nodes)
        self.observed_rows = 0
        self.with_lookup = with_lookup  # prompt lookup's continuation (n >= 2) as the first branch
        self.local: dict[int, LocalText] = {}  # seq_id -> its text's index (the lookup's; committed text only)

    # ---- the table -------------------------------------------------------------------
    @torch.inference_mode()
    def learn(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """tokens [r] input token of each row; logits [r, vocab] the target after it."""
        if tokens.numel() == 0:
            return
        top = logits.topk(self.k, dim=-1).indices.to(device="cpu", dtype=torch.int64)
        self.table[tokens.to("cpu", torch.int64)] = top
        self.observed_rows += int(tokens.numel())

    def snapshot(self) -> torch.Tensor:
        """A copy of the table (benchmarks restore it so repeats start alike)."""
        return self.table.clone()

    def restore(self, snap: torch.Tensor | None) -> None:
        """Put back a snapshot; None empties the table (a cold start)."""
        if snap is None:
            self.table.fill_(-1)
        else:
            self.table.copy_(snap)

    def successors(self, token: int) -> list[int]:
        """The table's current top-k successors of `token` (-1 = not seen yet)."""
        return self.table[token].tolist()

    # ---- trees -----------------------------------------------------------------------
    def validate_tree(self, tree: str | TreeSpec | None) -> TreeSpec:
        """A request's tree (None: the default), checked against k."""
        if tree is None:
            return self.default_tree
        try:
            spec = tree if isinstance(tree, TreeSpec) else _load_cached(tree if isinstance(tree, tuple) else str(tree))
        except TreeError as err:
            raise RequestError(str(err)) from err
        if max(spec.ranks) >= self.k:
            raise RequestError(f"tree {spec.name or 'given'} asks for rank {max(spec.ranks)} but token "
                               f"recycling keeps {self.k} successors per token (ranks 0..{self.k - 1})")
        return spec

    def tree_for(self, seq, gamma: int) -> TreeSpec | None:
        if gamma <= 0:
            return None
        spec = getattr(seq, "spec", None)
        return _prune(self.validate_tree(getattr(spec, "tree", None)), gamma)

    def draft_tree(self, root: int, tree: TreeSpec, chain: list[int] = ()) -> Draft | None:
        """Walk `tree` over the table from `root`; None when no node has a token.

        `chain` (prompt lookup's continuation, may be empty) goes in first as a chain; the
        table's nodes then fill the remaining budget (tree.num_drafts nodes in all), merging
        into the chain where they propose the same token under the same parent."""
        budget = tree.num_drafts
        table = self.table
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        tokens, parents, depths, sources = [root], [-1], [0], [""]

        def add(parent: int, tok: int, source: str = "table") -> int:
            node = children.get((parent, tok))
            if node is None:
                if len(tokens) > budget:
                    return -1
                node = len(tokens)
                children[(parent, tok)] = node
                tokens.append(tok)
                parents.append(parent)
                depths.append(depths[parent] + 1)
                sources.append(f"{self.name}:{source}")
            return node

        node = 0
        for tok in chain[:tree.max_depth]:
            node = add(node, int(tok), "lookup")
            if node < 0:
                break
        where = {0: 0}  # tree node -> draft node
        for i in range(1, tree.num_nodes):
            p = where.get(tree.parents[i])
            if p is None:
                continue
            tok = int(table[tokens[p], tree.ranks[i]])
            if tok < 0:
                continue
            node = add(p, tok)
            if node > 0:
                where[i] = node
        if len(tokens) == 1:
            return None
        n = len(tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for i in range(1, n):
            mask[i] = mask[parents[i]]
            mask[i, i] = True
        # node order: parents before children (they are appended after them); depth order
        # is not required by the verifier or the batch builder
        return Draft(tokens[1:], None, tuple(parents), depths[1:], mask, method=self.name, sources=sources[1:])

    # ---- the protocol ----------------------------------------------------------------
    def propose(self, seqs: list, gammas: list[int]) -> list[Draft | None]:
        out: list[Draft | None] = []
        for seq, gamma in zip(seqs, gammas):
            tree = self.tree_for(seq, gamma)
            if tree is None:
                out.append(None)
                continue
            cont: list[int] = []
            if self.with_lookup:  # ngram.lookup's continuation, from the sequence's text index
                spec = seq.spec
                cont = LocalText.synced(self.local, seq).index.follow(max(2, spec.ngram_min), max(2, spec.ngram_max), tree.max_depth)
            out.append(self.draft_tree(int(seq.all_ids[-1]), tree, cont))
        return out

    def release(self, seq) -> None:
        self.local.pop(seq.seq_id, None)

    def observe(self, seq, obs: Observation) -> None:
        if obs.logits is not None:
            self.learn(torch.tensor(obs.tokens, dtype=torch.int64), obs.logits)


def build(ctx) -> RecyclingProposer:
    return RecyclingProposer(ctx.vocab_size, max_nodes=ctx.max_draft_len)
