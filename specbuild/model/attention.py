"""Masked attention over a paged KV cache: the plain PyTorch reference op.

The decoder calls `paged_attention` once per layer for the whole ragged batch: the new
tokens of every sequence are the query rows; the key/value rows are gathered from the
flat slot pool through `read_slots` (each sequence's slots, concatenated), and `mask`
says which query row may see which gathered row (causal within a sequence by default; a
tree mask for tree speculation; never across sequences). Masks are arguments, never
state on the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    read_slots: torch.Tensor,  # [S] int64, slot of each visible key row
    mask: torch.Tensor | None,  # [T, S] bool, True = may attend; None = all visible
    scale: float,
) -> torch.Tensor:  # [T, heads, head_dim]
    """Attention of T query rows over S gathered cache rows, grouped-query aware."""
    t, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    k = k_cache.index_select(0, read_slots)  # [S, kv_heads, head_dim]
    v = v_cache.index_select(0, read_slots)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, T, D]
    kh = k.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, S, D]
    vh = v.transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=kv_heads != heads
    )
    return out.squeeze(0).transpose(0, 1)  # [T, heads, D]


def paged_attention_rows(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,
    read_slots: torch.Tensor,  # [S]
    row_cols: list[int | torch.Tensor],  # per row: n (it sees columns 0..n-1) or its column ids
    scale: float,
) -> torch.Tensor:  # [T, heads, head_dim]
    """Row-invariant attention: each query row alone over exactly its visible keys, in
    position order and in the memory layout a one-row decode step gives SDPA (a prefix of
    the gathered rows, or a gather of them), so a row's output does not depend on which
    other rows (drafts, tree nodes, other sequences) share the forward. Half-precision
    activations round a 1e-7 difference into a whole ulp that 30 layers amplify; this keeps
    speculative output equal to plain output there. Costs one small call per row."""
    k = k_cache.index_select(0, read_slots)
    v = v_cache.index_select(0, read_slots)
    group = q.shape[1] != k.shape[1]
    out = []
    for i, cols in enumerate(row_cols):
        kr, vr = (k[:cols], v[:cols]) if isinstance(cols, int) else (k.index_select(0, cols), v.index_select(0, cols))
        o = F.scaled_dot_product_attention(q[i:i + 1].transpose(0, 1).unsqueeze(0), kr.transpose(0, 1).unsqueeze(0),
                                           vr.transpose(0, 1).unsqueeze(0), scale=scale, enable_gqa=group)
        out.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(out)


def visible_columns(mask: torch.Tensor) -> list[int | torch.Tensor]:
    """Per row of a [T, S] mask: n when it sees exactly columns 0..n-1, else their ids."""
    out = []
    for m in mask:
        cols = m.nonzero().squeeze(1)
        n = cols.numel()
        out.append(n if n and int(cols[-1]) == n - 1 else cols)
    return out


def paged_attention_reference(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    read_slots: torch.Tensor,  # [S]
    mask: torch.Tensor | None,  # [T, S] bool
    scale: float,
) -> torch.Tensor:  # [T, heads, head_dim]
    """Explicit softmax(q k^T * scale + mask) v, computed in float64: the yardstick for
    every fast path (SDPA above, the Triton kernel)."""
    heads = q.shape[1]
    k = k_cache.index_select(0, read_slots).double()
    v = v_cache.index_select(0, read_slots).double()
    group = heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [S, heads, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hts,shd->thd", weights, v).to(q.dtype)
