"""Pure acceptance functions for speculative decoding: chains and token trees.

Nothing here knows a model. Inputs are token ids, probabilities made by
`sampling.warp_probs` with the request's `SamplingParams` (so the target distribution is
exactly the one plain decoding samples from), and uniforms in [0, 1) that the caller draws
from the request's `torch.Generator`. Every function is deterministic given its inputs, so
a seeded request gives the same tokens alone or inside any batch.

Uniform convention (one uniform per decision, none used twice, so all are independent):

- chain of k drafts: `uniforms` [k + 1]. `uniforms[i]` (i < k) is the acceptance test of
  draft i; `uniforms[k]` draws the one sampled token of the step: the recovered token after
  a rejection, or the bonus token after full acceptance.
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

Numerics: every function refuses a NaN/+inf row, or a row with no possible token, with
`errors.NumericsError` (params.check_logits / check_probs) before deciding anything; the
engine fails that one request. Shape and dtype mistakes stay ValueError (caller bugs).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from specbuild.sampling.params import argmax_ids, check_logits, check_probs, sample_from

__all__ = [
    "ChainResult", "TreeResult",
    "verify_chain_greedy", "verify_chain_sampled",
    "verify_tree_greedy", "verify_tree_sampled", "verify_tree_typical",
]


@dataclass(frozen=True)
class ChainResult:
    """One sequence's verification: `accepted` drafts, then `next_token` (recovered or bonus)."""

    accepted: int
    next_token: int
    tokens: tuple[int, ...]  # accepted drafts + (next_token,)


@dataclass(frozen=True)
class TreeResult:
    """accepted_nodes: node indices on the accepted path from the root (root excluded)."""

    accepted_nodes: tuple[int, ...]
    next_token: int
    tokens: tuple[int, ...]  # tokens of accepted_nodes + (next_token,)


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


def _check_chain(draft_ids, draft_probs, target, uniforms, target_name="target_probs"):
    """Shape/dtype/range checks; returns (k, vocab)."""
    if draft_ids.dim() != 1 or target.dim() != 2:
        raise ValueError(f"expected draft_ids [k] and {target_name} [k + 1, vocab], got {tuple(draft_ids.shape)} "
                         f"and {tuple(target.shape)}")
    k, vocab = draft_ids.shape[-1], target.shape[-1]
    _check_probs(target_name, target, (k + 1, vocab))
    _check_ids("draft_ids", draft_ids, (k,), vocab)
    if draft_probs is not None:
        _check_probs("draft_probs", draft_probs, (k, vocab))
    if uniforms is not None:
        _check_uniforms(uniforms, (k + 1,))
    return k, vocab


# ----------------------------------------------------------------------------- chains


def verify_chain_greedy(
    draft_ids: torch.Tensor | list[int],  # [k] int64
    target_logits: torch.Tensor | None,  # [k + 1, vocab] logits or probabilities (only argmax is used)
    best: list[int] | None = None,
) -> ChainResult:
    """Accept while draft i equals the target's argmax at i; then the target's argmax.
    `best`: the rows' argmax when the caller took it already, over rows it checked
    (params.argmax_rows); target_logits is then not read (None allowed)."""
    if best is None:
        k, _ = _check_chain(draft_ids, None, target_logits, None, "target_logits")
        check_logits(target_logits, "target_logits")
        best = argmax_ids(target_logits)  # [k + 1]
    drafts = draft_ids.tolist() if isinstance(draft_ids, torch.Tensor) else list(draft_ids)
    k = len(drafts)
    if len(best) != k + 1:
        raise ValueError(f"best holds {len(best)} rows' argmax, expected {k + 1} (k = {k} drafts)")
    accepted = 0
    while accepted < k and drafts[accepted] == best[accepted]:
        accepted += 1
    return ChainResult(accepted, best[accepted], tuple(drafts[:accepted]) + (best[accepted],))


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
    """Speculative (rejection) sampling of one chain (what the engine runs per sequence).

    Draft i is accepted iff uniforms[i] * draft_probs[i, d_i] < target_probs[i, d_i] (so a
    token with zero target probability is never accepted). k = 0 just samples the target.
    """
    _check_chain(draft_ids, draft_probs, target_probs, uniforms)
    check_probs(target_probs, "target_probs")
    if draft_probs is not None:
        check_probs(draft_probs, "draft_probs")
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


def _check_tree(parents, node_tokens, target_probs, uniforms):
    children, depths = _structure(parents)
    n = len(depths)
    if node_tokens.dim() != 1:
        raise ValueError(f"node_tokens has shape {tuple(node_tokens.shape)}, expected [{n}]")
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}, expected [{n}, vocab]")
    vocab = target_probs.shape[-1]
    _check_probs("target_probs", target_probs, (n, vocab))
    _check_ids("node_tokens", node_tokens, (n,), vocab)
    if uniforms is not None:
        _check_uniforms(uniforms, (n,))
    return children, depths


def verify_tree_greedy(
    parents: Sequence[int],  # n entries, parents[0] = -1, parent index < node index
    node_tokens: torch.Tensor | Sequence[int],  # [n] int64 (node 0's entry unused); ints with best
    target_logits: torch.Tensor | None,  # [n, vocab]: target after each node (logits or probs)
    best: list[int] | None = None,
) -> TreeResult:
    """Longest path whose every node equals the target's argmax at its parent (first such
    child wins), then the target's argmax at the last accepted node. `best`: the rows'
    argmax when the caller took it already over rows it checked (params.argmax_rows)."""
    if best is None:
        children, _ = _check_tree(parents, node_tokens, target_logits, None)
        check_logits(target_logits, "target_logits")
        best = argmax_ids(target_logits)
    else:
        children, _ = _structure(parents)
        if len(best) != len(children) or len(node_tokens) != len(children):
            raise ValueError(f"best holds {len(best)} rows' argmax and node_tokens {len(node_tokens)} "
                             f"entries, expected {len(children)} (the tree's nodes)")
    tokens = node_tokens.tolist() if isinstance(node_tokens, torch.Tensor) else list(node_tokens)
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
    """Lossless recursive rejection over siblings (what the engine runs per sequence)."""
    children, _ = _check_tree(parents, node_tokens, target_probs, uniforms)
    check_probs(target_probs, "target_probs")
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
    if not float(residual.sum()) > 0.0:
        # a candidate holding all the residual mass is accepted (u < 1), so only rounding of
        # u * sum against that mass can empty it: draw from the node's row, as the chain does
        residual = target_probs[node].double()
    next_token = int(sample_from(residual[None], uniforms[n - 1:]).item())
    return TreeResult(tuple(path), next_token, tuple(tokens[c] for c in path) + (next_token,))


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
    children, depths = _check_tree(parents, node_tokens, target_probs, uniforms)
    check_probs(target_probs, "target_probs")
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
