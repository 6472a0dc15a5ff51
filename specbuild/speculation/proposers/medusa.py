"""Medusa drafter: token trees from Medusa heads on the target's last hidden state.

Which hidden state. The root of a tree step (node 0) is the sequence's last token, which
the target chose in its previous pass and whose K/V is not cached yet. The hidden state
the heads read is the target's final-normed hidden (the input of its lm_head, as
`Decoder.forward(..., return_hidden=True).hidden`) at the row whose logits produced
that root: after a prefill, the last prompt token's row; after a decode or tree step, the
row of the last accepted token (the root itself when no draft was accepted). That row is
at position `total_len - 2` of the sequence.

Which token. FasterDecoding's `generate_candidates`: from the hidden at position t the
base lm_head gives token t + 1 (our root) and Medusa head h gives token t + 2 + h. So a
node at depth d (root 0) takes the `rank`-th best guess of head d - 1:

    token(node i) = topk(heads_logits[depth(i) - 1])[rank(i)]

and a tree deeper than the number of heads cannot be drafted.

Tree per request: `seq.spec.tree` (a preset name or inline paths; never a file) or, when None, the
bundle's tree. `gamma` caps the depth: gamma >= the tree's depth drafts the whole tree,
0 < gamma < depth drafts its nodes of depth <= gamma (still prefix-closed), 0 none.
Candidates are deterministic (probs None), which the tree verifier's recursive rejection
handles losslessly.
"""

from __future__ import annotations

import functools

import torch

from specbuild.errors import RequestError
from specbuild.speculation.tree import TreeError, TreeSpec, request_tree
from specbuild.speculation.medusa_heads import MedusaHeads
from specbuild.speculation.proposers.base import Draft, DrafterBase, Needs, Observation


@functools.lru_cache(maxsize=256)
def prune_tree(tree: TreeSpec, max_depth: int) -> TreeSpec:
    """The tree's nodes of depth <= max_depth (the whole tree when it is no deeper)."""
    if max_depth >= tree.max_depth:
        return tree
    assert max_depth >= 1
    name = f"{tree.name}@depth{max_depth}" if tree.name else None
    return TreeSpec.from_paths([p for p in tree.paths if len(p) <= max_depth], name)


@functools.lru_cache(maxsize=64)
def _load_cached(name_or_paths: str | tuple) -> TreeSpec:
    return request_tree(name_or_paths)  # a preset name or inline paths: never a file


@functools.lru_cache(maxsize=256)
def _tree_index(tree: TreeSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(head of each draft node [n], rank of each draft node [n], ancestor mask [n+1, n+1])."""
    heads = torch.tensor(tree.depths[1:], dtype=torch.int64) - 1
    ranks = torch.tensor(tree.ranks[1:], dtype=torch.int64)
    return heads, ranks, tree.ancestor_mask_tensor()


GUARANTEE = ("lossless", "lossless", "specbuild verify: tree argmax walk (greedy), recursive rejection sampling "
                                     "over siblings (sampled); --typical is LOSSY and opt-in")  # its row of engine/guarantees.py's torch table
ROLE = "medusa"  # the bundle role it needs


class MedusaProposer(DrafterBase):
    """Proposer protocol (base.py) over `MedusaHeads`; `default_tree` is the bundle's tree.
    Per sequence it keeps the hidden state its next draft starts from (`self.hidden`)."""

    name = "medusa"
    needs = Needs(hidden=True, tree=True)
    request_tree = True  # a request may name its tree (validate_tree)

    def __init__(self, heads: MedusaHeads, default_tree: TreeSpec) -> None:
        self.heads = heads
        self.default_tree = self.validate_tree(default_tree)
        self.hidden: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (position, final-normed hidden [H])

    # ---- trees --------------------------------------------------------------------------
    def cost_key(self) -> list:
        """What level_cost depends on besides the machine (the cost cache's key)."""
        h = self.heads
        return ["medusa", h.num_heads, h.num_layers, h.hidden_size, h.vocab_size, str(h.dtype)]

    @torch.inference_mode()
    def level_cost(self, repeats: int = 5) -> float:
        """Seconds one depth of a Medusa draft costs (the best of `repeats`): one head on one
        row, its block and the output layer it shares with the target (a full-vocabulary
        matmul, about the target's own lm_head), and the top-k. Charged per depth by the cost
        model; it was charged 0, so deep trees looked cheaper than they are."""
        from specbuild.model.timing import best_seconds

        hidden = torch.zeros(1, self.heads.hidden_size, dtype=self.heads.dtype, device=self.heads.device)
        return best_seconds(lambda: self.heads.forward(hidden, 1).topk(4, dim=-1), repeats)

    def validate_tree(self, tree: str | TreeSpec | None) -> TreeSpec:
        """Resolve a request's tree (None: the bundle's) and check it against the heads.
        Raises RequestError naming the tree, its depth and the head count."""
        if tree is None:
            return self.default_tree
        try:
            spec = tree if isinstance(tree, TreeSpec) else _load_cached(tree if isinstance(tree, tuple) else str(tree))
        except TreeError as err:
            raise RequestError(str(err)) from err
        if spec.max_depth > self.heads.num_heads:
            raise RequestError(
                f"tree {spec.name or 'given'} has depth {spec.max_depth} but the bundle has "
                f"{self.heads.num_heads} Medusa heads (one per depth): use a tree of depth "
                f"<= {self.heads.num_heads}")
        if max(spec.ranks) >= self.heads.vocab_size:
            raise RequestError(f"tree {spec.name or 'given'} asks for rank {max(spec.ranks)} "
                               f"of a {self.heads.vocab_size}-token vocabulary")
        return spec

    def tree_for(self, seq, gamma: int) -> TreeSpec | None:
        """The tree seq drafts this step: its request's tree, depth-capped by gamma."""
        if gamma <= 0:
            return None
        spec = getattr(seq, "spec", None)
        return prune_tree(self.validate_tree(getattr(spec, "tree", None)), gamma)

    # ---- hidden states ----------------------------------------------------------------------
    def observe(self, seq, obs: Observation) -> None:
        """Keep the hidden [H] of the row whose logits chose seq's new last token: position
        obs.length - 1 (the last cached token's row), which is total_len - 2 once that token
        is appended."""
        if obs.hidden is not None:
            self.hidden[seq.seq_id] = (obs.length - 1, obs.hidden.detach())

    def hidden_of(self, seq) -> torch.Tensor | None:
        """seq's recorded hidden [H] if it belongs to the current root, else None."""
        stored = self.hidden.get(seq.seq_id)
        if stored is None or stored[0] != seq.total_len - 2:
            return None
        return stored[1]

    # ---- drafting ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_from_hidden(self, hidden: torch.Tensor,  # [B, H] final-normed target hidden
                            trees: list[TreeSpec | None]) -> list[Draft | None]:
        """One Draft per row (None where trees[b] is None). Node i of row b takes the
        ranks[i]-th best token of head depths[i] - 1 on hidden[b]."""
        assert hidden.shape[0] == len(trees)
        live = [b for b, t in enumerate(trees) if t is not None]
        out: list[Draft | None] = [None] * len(trees)
        if not live:
            return out
        k = max(max(trees[b].ranks) for b in live) + 1
        depth = max(trees[b].max_depth for b in live)  # heads deeper than every tree are skipped
        logits = self.heads.forward(hidden[live], depth)  # [L, depth, vocab]
        top = logits.topk(k, dim=-1).indices.cpu()  # [L, heads, k], best first
        for row, b in enumerate(live):
            tree = trees[b]
            heads, ranks, mask = _tree_index(tree)
            tokens = top[row, heads, ranks].tolist()  # [n]
            out[b] = Draft(tokens, None, tree.parents, list(tree.depths[1:]), mask, method="medusa")
        return out

    def propose(self, seqs: list, gammas: list[int]) -> list[Draft | None]:
        """Drafts for seqs whose hidden state is current; None for the rest (plain step)."""
        trees, rows, hiddens = [], [], []
        for i, (seq, gamma) in enumerate(zip(seqs, gammas)):
            hidden = self.hidden_of(seq)
            tree = self.tree_for(seq, gamma) if hidden is not None else None
            if tree is not None:
                rows.append(i)
                trees.append(tree)
                hiddens.append(hidden)
        out: list[Draft | None] = [None] * len(seqs)
        if rows:
            for i, draft in zip(rows, self.propose_from_hidden(torch.stack(hiddens), trees)):
                out[i] = draft
        return out

    def release(self, seq) -> None:
        """(rollback has nothing to undo: a recorded hidden state that no longer matches the
        root is ignored by `hidden_of`, the position check)."""
        self.hidden.pop(seq.seq_id, None)


def build(ctx) -> MedusaProposer | None:
    if "medusa" not in ctx.roles:
        return None
    from specbuild.speculation.medusa_heads import load_medusa

    role = load_medusa(ctx.bundle_dir, ctx.target.w, ctx.settings.device)
    return MedusaProposer(role.heads, role.tree)
