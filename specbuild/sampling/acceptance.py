"""Pure acceptance functions for speculative decoding: chains and token trees.

Nothing here knows a model. Inputs are token ids, probabilities made by
`sampling.warp_probs` with the request's `SamplingParams` (so the target distribution is
exactly the one plain decoding samples from), and uniforms in [0, 1) that the caller draws
from the request's `torch.Generator`. Every function is deterministic given its inputs, so
a seeded request gives the same tokens alone or inside any batch.

Uniform convention (one uniform per decision, none used twice, so all are independent):

- chain of k drafts: `uniforms` [k + 1]. `uniforms[i]` (i < k) is the acceptance test of
  draft i; `uniforms[k]` draws the one sampled token of the step: the recovered token after
  a rejection, or the bonus token after full acceptance. Batched: row b uses
  `uniforms[b, :lengths[b] + 1]` (its final uniform sits at `uniforms[b, lengths[b]]`).
- tree of n nodes (node 0 = root = the last accepted token): `uniforms` [n].
  `uniforms[c - 1]` is the acceptance test of node c (1 <= c < n); `uniforms[n - 1]` draws
  the recovered/bonus token. A chain-shaped tree uses its uniforms exactly as a chain does.

Rules (lossless):
- chain, sampled: accept draft i with probability min(1, target/draft) at its token; on the
  first rejection draw the recovered token from normalize(max(0, target - draft)); after
  full acceptance draw the bonus token from target_probs[k]. A deterministic drafter
  (n-gram) passes draft_probs=None, which counts as one-hot at the draft token. A draft
  token with zero target probability is always rejected.
- tree, sampled (deterministic candidates, e.g. Medusa top-k): at an accepted node, start
  from residual = target_probs[node]; try its children in order, accept child c with
  probability residual[c] / sum(residual); on rejection set residual[c] = 0. If a child is
  accepted, descend; if all are rejected (or the node is a leaf) draw the next token from
  the residual (renormalised). Each emitted token is distributed exactly as the target.
- greedy: accept while the draft equals the target's argmax (ties: lowest id, as
  torch.argmax and warp_probs), then the target's argmax.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from specbuild.sampling.params import sample_from

__all__ = [
    "ChainResult", "ChainBatchResult", "TreeResult", "TreeBatchResult",
    "verify_chain_greedy", "verify_chain_greedy_batch",
    "verify_chain_sampled", "verify_chain_sampled_batch",
    "verify_tree_greedy", "verify_tree_sampled", "verify_tree_sampled_batch",
    "verify_tree_typical",
]


@dataclass(frozen=True)
class ChainResult:
    """One sequence's verification: `accepted` drafts, then `next_token` (recovered or bonus)."""

    accepted: int
    next_token: int
    tokens: tuple[int, ...]  # accepted drafts + (next_token,)


@dataclass(frozen=True)
class ChainBatchResult:
    accepted: torch.Tensor  # [batch] int64: drafts accepted per row (<= lengths[b])
    next_token: torch.Tensor  # [batch] int64: recovered (accepted < length) or bonus token

    def results(self, draft_ids: torch.Tensor) -> list[ChainResult]:
        """Per-row `ChainResult`s. draft_ids: [batch, max_k] as passed to the verifier."""
        out = []
        for row, (acc, nxt) in enumerate(zip(self.accepted.tolist(), self.next_token.tolist())):
            drafts = tuple(draft_ids[row, :acc].tolist())
            out.append(ChainResult(acc, nxt, drafts + (nxt,)))
        return out


@dataclass(frozen=True)
class TreeResult:
    """accepted_nodes: node indices on the accepted path from the root (root excluded)."""

    accepted_nodes: tuple[int, ...]
    next_token: int
    tokens: tuple[int, ...]  # tokens of accepted_nodes + (next_token,)


@dataclass(frozen=True)
class TreeBatchResult:
    last_node: torch.Tensor  # [batch] int64: deepest accepted node (0 = root, nothing accepted)
    next_token: torch.Tensor  # [batch] int64

    def results(self, parents: Sequence[int], node_tokens: torch.Tensor) -> list[TreeResult]:
        """Per-row `TreeResult`s. node_tokens: [batch, n] as passed to the verifier."""
        out = []
        for row, (last, nxt) in enumerate(zip(self.last_node.tolist(), self.next_token.tolist())):
            path = _path_to(parents, last)
            tokens = tuple(int(node_tokens[row, c]) for c in path) + (nxt,)
            out.append(TreeResult(path, nxt, tokens))
        return out


# ----------------------------------------------------------------------------- checks


def _check_ids(name: str, ids: torch.Tensor, shape: tuple[int, ...], vocab: int) -> None:
    if tuple(ids.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(ids.shape)}, expected {shape}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.numel():
        low, high = (int(x) for x in torch.aminmax(ids))
        if low < 0 or high >= vocab:
            raise ValueError(f"{name} holds ids in [{low}, {high}]; vocab is {vocab}")


def _check_probs(name: str, probs: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(probs.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(probs.shape)}, expected {shape}")
    if not probs.dtype.is_floating_point:
        raise ValueError(f"{name} must be floating point, got dtype {probs.dtype}")


def _check_uniforms(uniforms: torch.Tensor, shape: tuple[int, ...]) -> None:
    _check_probs("uniforms", uniforms, shape)
    if uniforms.numel():
        low, high = (float(x) for x in torch.aminmax(uniforms))
        if not (low >= 0.0 and high < 1.0):
            raise ValueError(f"uniforms must lie in [0, 1), got [{low}, {high}]")


def _check_chain(draft_ids, draft_probs, target, uniforms, batched: bool, target_name="target_probs"):
    """Shape/dtype/range checks; returns ([batch,] k, vocab)."""
    lead = tuple(draft_ids.shape[:1]) if batched else ()
    if draft_ids.dim() != len(lead) + 1 or target.dim() != len(lead) + 2:
        raise ValueError(f"expected draft_ids {'[batch, k]' if batched else '[k]'} and {target_name} "
                         f"[{'batch, ' if batched else ''}k + 1, vocab], got {tuple(draft_ids.shape)} "
                         f"and {tuple(target.shape)}")
    k, vocab = draft_ids.shape[-1], target.shape[-1]
    _check_probs(target_name, target, lead + (k + 1, vocab))
    _check_ids("draft_ids", draft_ids, lead + (k,), vocab)
    if draft_probs is not None:
        _check_probs("draft_probs", draft_probs, lead + (k, vocab))
    if uniforms is not None:
        _check_uniforms(uniforms, lead + (k + 1,))
    return lead + (k, vocab)


# ----------------------------------------------------------------------------- chains


def verify_chain_greedy(
    draft_ids: torch.Tensor,  # [k] int64
    target_logits: torch.Tensor,  # [k + 1, vocab] logits or probabilities (only argmax is used)
) -> ChainResult:
    """Accept while draft i equals the target's argmax at i; then the target's argmax."""
    k, _ = _check_chain(draft_ids, None, target_logits, None, False, "target_logits")
    best = target_logits.argmax(-1).tolist()  # [k + 1]
    drafts = draft_ids.tolist()
    accepted = 0
    while accepted < k and drafts[accepted] == best[accepted]:
        accepted += 1
    return ChainResult(accepted, best[accepted], tuple(drafts[:accepted]) + (best[accepted],))


def _row_lengths(lengths: torch.Tensor | None, batch: int, max_k: int, device) -> torch.Tensor:
    if lengths is None:
        return torch.full((batch,), max_k, dtype=torch.int64, device=device)
    lengths = torch.as_tensor(lengths, device=device).long()
    if tuple(lengths.shape) != (batch,):
        raise ValueError(f"lengths has shape {tuple(lengths.shape)}, expected ({batch},)")
    if batch and (int(lengths.min()) < 0 or int(lengths.max()) > max_k):
        raise ValueError(f"lengths must lie in [0, {max_k}], got [{int(lengths.min())}, {int(lengths.max())}]")
    return lengths


def verify_chain_greedy_batch(
    draft_ids: torch.Tensor,  # [batch, max_k] int64 (padding: any valid id)
    target_logits: torch.Tensor,  # [batch, max_k + 1, vocab]
    lengths: torch.Tensor | None = None,  # [batch] drafts per row (default max_k)
) -> ChainBatchResult:
    """Batched `verify_chain_greedy`; row b uses its first lengths[b] drafts."""
    batch, max_k, _ = _check_chain(draft_ids, None, target_logits, None, True, "target_logits")
    lengths = _row_lengths(lengths, batch, max_k, draft_ids.device)
    best = target_logits.argmax(-1)  # [batch, max_k + 1]
    positions = torch.arange(max_k, device=draft_ids.device)
    match = (best[:, :max_k] == draft_ids) & (positions < lengths[:, None])
    accepted = match.long().cumprod(-1).sum(-1)  # [batch]
    return ChainBatchResult(accepted, best.gather(-1, accepted[:, None]).squeeze(-1))


def _recovery_dist(target_row: torch.Tensor, draft_row: torch.Tensor | None, token: int) -> torch.Tensor:
    """normalize(max(0, target - draft)) up to scale, float64 [vocab] (None = one-hot draft)."""
    residual = target_row.double().clone()
    if draft_row is None:
        residual[token] = 0.0
    else:
        residual = (residual - draft_row.double()).clamp_(min=0.0)
    # Rejection implies positive residual mass; only rounding can empty it.
    return residual if float(residual.sum()) > 0.0 else target_row.double()


def verify_chain_sampled(
    draft_ids: torch.Tensor,  # [k] int64
    draft_probs: torch.Tensor | None,  # [k, vocab] warped probs the drafter sampled from; None = one-hot
    target_probs: torch.Tensor,  # [k + 1, vocab] warp_probs(target logits, request params)
    uniforms: torch.Tensor,  # [k + 1] in [0, 1): k acceptance tests, then one draw
) -> ChainResult:
    """Speculative (rejection) sampling of one chain; the plain reference of the batched path.

    Draft i is accepted iff uniforms[i] * draft_probs[i, d_i] < target_probs[i, d_i] (so a
    token with zero target probability is never accepted). k = 0 just samples the target.
    """
    _check_chain(draft_ids, draft_probs, target_probs, uniforms, batched=False)
    k = draft_ids.shape[0]
    drafts = draft_ids.tolist()
    pos = torch.arange(k, device=draft_ids.device)
    at_target = target_probs[pos, draft_ids].double().tolist()
    at_draft = [1.0] * k if draft_probs is None else draft_probs[pos, draft_ids].double().tolist()
    tests = uniforms.double().tolist()
    for i in range(k):
        if not tests[i] * at_draft[i] < at_target[i]:
            residual = _recovery_dist(target_probs[i], None if draft_probs is None else draft_probs[i], drafts[i])
            recovered = int(sample_from(residual[None], uniforms[k:]).item())
            return ChainResult(i, recovered, tuple(drafts[:i]) + (recovered,))
    bonus = int(sample_from(target_probs[k:].double(), uniforms[k:]).item())
    return ChainResult(k, bonus, tuple(drafts) + (bonus,))


def verify_chain_sampled_batch(
    draft_ids: torch.Tensor,  # [batch, max_k] int64 (padding: any valid id, e.g. 0)
    draft_probs: torch.Tensor | None,  # [batch, max_k, vocab]; None = deterministic drafter (one-hot)
    target_probs: torch.Tensor,  # [batch, max_k + 1, vocab]
    uniforms: torch.Tensor,  # [batch, max_k + 1]; row b uses [:lengths[b] + 1] (padding in [0, 1))
    lengths: torch.Tensor | None = None,  # [batch] drafts per row (default max_k)
) -> ChainBatchResult:
    """Batched `verify_chain_sampled` with per-row draft lengths; no loop over rows or vocab.

    Row b gives exactly what `verify_chain_sampled` gives on that row's first lengths[b]
    drafts, lengths[b] + 1 target positions and lengths[b] + 1 uniforms.
    """
    batch, max_k, vocab = _check_chain(draft_ids, draft_probs, target_probs, uniforms, batched=True)
    device = draft_ids.device
    lengths = _row_lengths(lengths, batch, max_k, device)
    rows = torch.arange(batch, device=device)
    ids = draft_ids.long()
    at_target = target_probs[:, :max_k].gather(-1, ids[..., None]).squeeze(-1).double()  # [batch, max_k]
    if draft_probs is None:
        at_draft = torch.ones_like(at_target)
    else:
        at_draft = draft_probs.gather(-1, ids[..., None]).squeeze(-1).double()
    passed = uniforms[:, :max_k].double() * at_draft < at_target
    passed &= torch.arange(max_k, device=device) < lengths[:, None]
    accepted = passed.long().cumprod(-1).sum(-1)  # [batch]

    final = target_probs[rows, accepted].double()  # [batch, vocab]: bonus rows keep this
    rejected = accepted < lengths
    if bool(rejected.any()):
        at = accepted.clamp(max=max(max_k - 1, 0))
        if draft_probs is None:
            residual = final.clone()
            residual[rows, ids[rows, at]] = 0.0
        else:
            residual = (final - draft_probs[rows, at].double()).clamp_(min=0.0)
        usable = rejected & (residual.sum(-1) > 0.0)  # rounding can empty a residual
        final = torch.where(usable[:, None], residual, final)
    next_token = sample_from(final, uniforms[rows, lengths])
    return ChainBatchResult(accepted, next_token)


# ----------------------------------------------------------------------------- trees


@functools.lru_cache(maxsize=512)
def _tree_structure(parents: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Validate `parents` and return (children per node in index order, depth per node)."""
    if len(parents) == 0 or parents[0] != -1:
        raise ValueError(f"tree parents must start with -1 for the root, got {parents[:4]!r}")
    children: list[list[int]] = [[] for _ in parents]
    depths = [0] * len(parents)
    for node in range(1, len(parents)):
        parent = parents[node]
        if not 0 <= parent < node:
            raise ValueError(f"parent of node {node} is {parent}; must be in [0, {node}) (BFS order)")
        children[parent].append(node)
        depths[node] = depths[parent] + 1
    return tuple(tuple(c) for c in children), tuple(depths)


def _structure(parents: Sequence[int]):
    return _tree_structure(tuple(int(p) for p in parents))


def _path_to(parents: Sequence[int], node: int) -> tuple[int, ...]:
    path = []
    while node > 0:
        path.append(node)
        node = int(parents[node])
    return tuple(reversed(path))


def _check_tree(parents, node_tokens, target_probs, uniforms, batched: bool):
    children, depths = _structure(parents)
    n = len(depths)
    lead = tuple(node_tokens.shape[:1]) if batched else ()
    if node_tokens.dim() != len(lead) + 1:
        raise ValueError(f"node_tokens has shape {tuple(node_tokens.shape)}, expected "
                         f"{'[batch, ' if batched else '['}{n}]")
    if target_probs.dim() != len(lead) + 2:
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}, expected [..., {n}, vocab]")
    vocab = target_probs.shape[-1]
    _check_probs("target_probs", target_probs, lead + (n, vocab))
    _check_ids("node_tokens", node_tokens, lead + (n,), vocab)
    if uniforms is not None:
        _check_uniforms(uniforms, lead + (n,))
    return children, depths


def verify_tree_greedy(
    parents: Sequence[int],  # n entries, parents[0] = -1, parent index < node index
    node_tokens: torch.Tensor,  # [n] int64 (node 0's entry unused)
    target_logits: torch.Tensor,  # [n, vocab]: target after each node (logits or probs)
) -> TreeResult:
    """Longest path whose every node equals the target's argmax at its parent (first such
    child wins), then the target's argmax at the last accepted node."""
    children, _ = _check_tree(parents, node_tokens, target_logits, None, False)
    best = target_logits.argmax(-1).tolist()
    tokens = node_tokens.tolist()
    node, path = 0, []
    while True:
        match = next((c for c in children[node] if tokens[c] == best[node]), None)
        if match is None:
            break
        path.append(match)
        node = match
    return TreeResult(tuple(path), best[node], tuple(tokens[c] for c in path) + (best[node],))


def verify_tree_sampled(
    parents: Sequence[int],
    node_tokens: torch.Tensor,  # [n] int64 deterministic candidates (node 0 unused)
    target_probs: torch.Tensor,  # [n, vocab] warped target distribution after each node
    uniforms: torch.Tensor,  # [n]: uniforms[c - 1] tests node c, uniforms[n - 1] draws
) -> TreeResult:
    """Lossless recursive rejection over siblings; plain reference of the batched path."""
    children, _ = _check_tree(parents, node_tokens, target_probs, uniforms, batched=False)
    n = len(children)
    tokens = node_tokens.tolist()
    tests = uniforms.double().tolist()
    node, path = 0, []
    while True:
        residual = target_probs[node].double().clone()
        chosen = None
        for child in children[node]:
            if tests[child - 1] * float(residual.sum()) < float(residual[tokens[child]]):
                chosen = child
                break
            residual[tokens[child]] = 0.0
        if chosen is None:
            break
        path.append(chosen)
        node = chosen
    assert float(residual.sum()) > 0.0, "a candidate holding all residual mass is always accepted"
    next_token = int(sample_from(residual[None], uniforms[n - 1:]).item())
    return TreeResult(tuple(path), next_token, tuple(tokens[c] for c in path) + (next_token,))


@functools.lru_cache(maxsize=512)
def _child_table(parents: tuple[int, ...]) -> torch.Tensor:
    """[n, max_children] int64 children per node in order, padded with -1."""
    children, _ = _tree_structure(parents)
    width = max(1, max(len(c) for c in children))
    return torch.tensor([list(c) + [-1] * (width - len(c)) for c in children], dtype=torch.int64)


def verify_tree_sampled_batch(
    parents: Sequence[int],  # one tree shared by the rows (group rows by tree)
    node_tokens: torch.Tensor,  # [batch, n] int64
    target_probs: torch.Tensor,  # [batch, n, vocab]
    uniforms: torch.Tensor,  # [batch, n]
) -> TreeBatchResult:
    """Batched `verify_tree_sampled` for rows sharing one tree; loops over depth and child
    slots only (each step vectorised over rows and vocab)."""
    _, depths = _check_tree(parents, node_tokens, target_probs, uniforms, batched=True)
    batch, n = node_tokens.shape
    device = node_tokens.device
    table = _child_table(tuple(int(p) for p in parents)).to(device)
    rows = torch.arange(batch, device=device)
    tokens = node_tokens.long()
    tests = uniforms.double()
    node = torch.zeros(batch, dtype=torch.int64, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    residual = target_probs[:, 0].double().clone()  # [batch, vocab]
    for _ in range(max(depths) + 1):
        chosen = torch.full((batch,), -1, dtype=torch.int64, device=device)
        for slot in range(table.shape[1]):
            child = table[node, slot]  # [batch]
            trying = active & (child >= 0) & (chosen < 0)
            if not bool(trying.any()):
                break
            safe = child.clamp(min=1)
            token = tokens[rows, safe]
            ok = trying & (tests[rows, safe - 1] * residual.sum(-1) < residual[rows, token])
            chosen = torch.where(ok, child, chosen)
            gone = trying & ~ok
            residual[rows[gone], token[gone]] = 0.0
        active = chosen >= 0
        if not bool(active.any()):
            break
        node = torch.where(active, chosen, node)
        residual = torch.where(active[:, None], target_probs[rows, node].double(), residual)
    next_token = sample_from(residual, uniforms[:, n - 1])
    return TreeBatchResult(node, next_token)


def verify_tree_typical(
    parents: Sequence[int],
    node_tokens: torch.Tensor,  # [n] int64
    target_probs: torch.Tensor,  # [n, vocab] warped target distribution after each node
    uniforms: torch.Tensor,  # [n]; only uniforms[n - 1] is used (to draw the next token)
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> TreeResult:
    """Medusa's typical acceptance. LOSSY: the output does NOT follow the target distribution.

    Node c passes when target_probs[parent(c), token(c)] > min(posterior_threshold,
    posterior_alpha * exp(-entropy(target_probs[parent(c)]))). The accepted path is the
    deepest node whose whole path passes (ties: larger summed log-probability, then lower
    index); the next token is drawn from target_probs at that node with uniforms[n - 1].
    With one-hot (greedy) target_probs it accepts exactly the greedy path.
    """
    if not 0.0 < posterior_threshold <= 1.0:
        raise ValueError(f"posterior_threshold={posterior_threshold} must lie in (0, 1]")
    if not posterior_alpha > 0.0:
        raise ValueError(f"posterior_alpha={posterior_alpha} must be > 0")
    children, depths = _check_tree(parents, node_tokens, target_probs, uniforms, batched=False)
    n = len(children)
    probs = target_probs.double()
    entropy = -torch.special.xlogy(probs, probs).sum(-1)  # [n] nats
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold).tolist()
    tokens = node_tokens.tolist()
    parent_of = [int(p) for p in parents]
    parent_idx = torch.tensor(parent_of[1:], dtype=torch.int64, device=probs.device)
    cand = probs[parent_idx, node_tokens[1:].long()].tolist()  # [n - 1] candidate probabilities
    ok = [True] + [False] * (n - 1)
    score = [0.0] * n
    best = 0
    for c in range(1, n):
        parent, prob = parent_of[c], cand[c - 1]
        ok[c] = ok[parent] and prob > threshold[parent]
        if ok[c]:
            score[c] = score[parent] + math.log(prob)
            if (depths[c], score[c]) > (depths[best], score[best]):
                best = c
    path = _path_to(parent_of, best)
    next_token = int(sample_from(probs[best:best + 1], uniforms[n - 1:]).item())
    return TreeResult(path, next_token, tuple(tokens[c] for c in path) + (next_token,))
