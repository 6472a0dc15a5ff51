"""Masked attention over a paged KV cache: the plain PyTorch reference op.

The decoder calls `paged_attention` once per layer for the whole ragged batch: the new
tokens of every sequence are the query rows; the key/value rows are gathered from the
flat slot pool through `read_slots` (each sequence's slots, concatenated), and `mask`
says which query row may see which gathered row (causal within a sequence by default; a
tree mask for tree speculation; never across sequences). Masks are arguments, never
state on the model.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def contiguous_range(read_slots: torch.Tensor) -> tuple[int, int] | None:
    """(start, stop) when read_slots [S] is the run start, start + 1, ..., stop - 1 (a lone
    sequence's blocks, taken in order from the pool: the usual batch-1 case), else None."""
    n = read_slots.shape[0]
    if n == 0 or read_slots.device.type != "cpu":
        return None
    first, last = int(read_slots[0]), int(read_slots[-1])
    if last - first != n - 1 or (n > 1 and not bool((read_slots[1:] - read_slots[:-1] == 1).all())):
        return None
    return first, last + 1


def gather_rows(cache: torch.Tensor, read_slots: torch.Tensor, read_range: tuple[int, int] | None) -> torch.Tensor:
    """cache rows read_slots: a view when they are one contiguous run (read_range), else a
    gathered copy. Both are [S, kv_heads, head_dim] with the same strides, so the kernels that
    read them give the same bits (tested); the view saves the copy (measured, one layer, 2
    threads: SDPA over 1,024 keys 110 us with the copy, 68 without)."""
    if read_range is not None:
        return cache[read_range[0]:read_range[1]]
    return cache.index_select(0, read_slots)


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    read_slots: torch.Tensor,  # [S] int64, slot of each visible key row
    mask: torch.Tensor | None,  # [T, S] bool, True = may attend; None = all visible
    scale: float,
    read_range: tuple[int, int] | None = None,  # contiguous_range(read_slots), when known
) -> torch.Tensor:  # [T, heads, head_dim]
    """Attention of T query rows over S gathered cache rows, grouped-query aware."""
    t, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    k = gather_rows(k_cache, read_slots, read_range)  # [S, kv_heads, head_dim]
    v = gather_rows(v_cache, read_slots, read_range)
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
    read_range: tuple[int, int] | None = None,  # contiguous_range(read_slots), when known
) -> torch.Tensor:  # [T, heads, head_dim]
    """Row-invariant attention: each query row alone over exactly its visible keys, in
    position order and in the memory layout a one-row decode step gives SDPA (a prefix of
    the gathered rows, or a gather of them), so a row's output does not depend on which
    other rows (drafts, tree nodes, other sequences) share the forward. Half-precision
    activations round a 1e-7 difference into a whole ulp that 30 layers amplify; this keeps
    speculative output equal to plain output there. Costs one small call per row."""
    k = gather_rows(k_cache, read_slots, read_range)
    v = gather_rows(v_cache, read_slots, read_range)
    group = q.shape[1] != k.shape[1]
    # the [1, heads, rows, D] views once, then per row only slices of them: every SDPA call
    # gets the sizes and strides a one-row decode step gives it (so the same bits; tested),
    # in 3 small ops a row instead of 10 (the Python around them was ~1.4 ms of a 5-row int4
    # verify pass, 30 layers)
    qh = q.transpose(0, 1).unsqueeze(0)
    kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    out = []
    for i, cols in enumerate(row_cols):
        if isinstance(cols, int):
            kr, vr = kh[:, :, :cols], vh[:, :, :cols]
        else:  # tree nodes: their keys gathered in position order, laid out as a decode step's
            kr, vr = k.index_select(0, cols).transpose(0, 1).unsqueeze(0), v.index_select(0, cols).transpose(0, 1).unsqueeze(0)
        out.append(F.scaled_dot_product_attention(qh[:, :, i:i + 1], kr, vr, scale=scale, enable_gqa=group))
    return torch.cat(out, dim=2).squeeze(0).transpose(0, 1)


def rows_index(read_slots: torch.Tensor, mask: torch.Tensor | None, rows: int) -> torch.Tensor:
    """The index cpu_kernels.rows_attention reads, int64 [rows + 1 + total]: the rows' offsets,
    then each row's visible cache slots in position order (row t: read_slots where mask[t], all
    of them when mask is None), exactly the keys a decode step at that row's position reads.
    On the CPU in numpy: the same index in 3-4 numpy calls, where torch's 6 ops cost ~95 us in a
    served step (the weights had just passed through the caches; AMD EPYC)."""
    if read_slots.device.type == "cpu" and (mask is None or mask.device.type == "cpu"):
        rs = read_slots.numpy().astype(np.int64, copy=False)
        if mask is None:
            counts = np.full(rows, rs.shape[0], dtype=np.int64)
            slots = np.tile(rs, rows)
        else:
            m = mask.numpy()
            counts = m.sum(1, dtype=np.int64)
            slots = np.broadcast_to(rs, m.shape)[m]  # row-major: row by row, columns in order
        out = np.empty(rows + 1 + slots.shape[0], dtype=np.int64)
        out[0] = 0
        np.cumsum(counts, out=out[1:rows + 1])
        out[rows + 1:] = slots
        return torch.from_numpy(out)
    read_slots = read_slots.to(torch.int64)
    if mask is None:
        counts = torch.full((rows,), read_slots.shape[0], dtype=torch.int64)
        slots = read_slots.repeat(rows)
    else:
        counts = mask.sum(1)
        slots = read_slots.expand(rows, read_slots.shape[0])[mask]  # row-major: row by row, columns in order
    return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0), slots])


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


INVARIANT_CHUNK = 128  # keys per partial product in paged_attention_invariant (positions from each sequence's start)


def sequence_spans(mask: torch.Tensor | None, rows: int, cols: int) -> list[tuple[int, int, int, int]]:
    """(row0, row1, col0, col1) per sequence of a ragged batch's [T, S] mask: the rows that
    share a first visible column (every row of a sequence sees its first key, no row sees
    another sequence's keys) and the columns from there to the last one any of them sees."""
    if mask is None:
        return [(0, rows, 0, cols)]
    first = mask.int().argmax(1).tolist()
    last = (cols - 1 - mask.flip(1).int().argmax(1)).tolist()
    spans, r0 = [], 0
    for r in range(1, rows + 1):
        if r == rows or first[r] != first[r0]:
            spans.append((r0, r, first[r0], max(last[r0:r]) + 1))
            r0 = r
    return spans


SHARED_LOOP_ROWS = 16  # rows from which shared keys go through shared_matmul (measured below)


def shared_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul(a, b) for a [n, kv, 1 or nc, g, x] and b [1, kv, nc, x, y] (keys or values
    that all n rows share), without the n copies of b that matmul's broadcast materialises:
    one bmm per (kv head, key chunk), its b operand a stride-0 expand. The products are the
    same [g, x] x [x, y] ones in a one-shape batch, so every row gets matmul's bits (checked
    in tests/model). Measured on 2 cores, one thread, 256 rows over 1,024 keys (8 chunks, 3 kv
    heads): 7.2 ms instead of 101 ms for the scores of one layer; 24 small calls lose to one
    matmul below ~16 rows."""
    n, kv, _, g, x = a.shape
    nc, y = b.shape[2], b.shape[-1]
    out = a.new_empty(n, kv, nc, g, y)
    for h in range(kv):
        for j in range(nc):
            out[:, h, j] = torch.bmm(a[:, h, 0 if a.shape[2] == 1 else j], b[0, h, j].expand(n, x, y))
    return out


class InvariantPlan:
    """What paged_attention_invariant needs of one forward's mask, worked out once for all
    layers: per sequence, its rows, the key slots in chunks (shared [1, sp] or per row
    [n, sp]) and the weight-zero keys [n, 1, nc, 1, chunk] (None: none)."""

    def __init__(self, mask: torch.Tensor | None, read_slots: torch.Tensor, rows: int) -> None:
        c = INVARIANT_CHUNK
        self.parts = []
        for r0, r1, c0, c1 in sequence_spans(mask, rows, read_slots.shape[0]):
            n, cols = r1 - r0, read_slots[c0:c1]
            sub = None if mask is None else mask[r0:r1, c0:c1]
            slots, visible = cols.unsqueeze(0), sub
            if sub is not None:
                counts = sub.sum(1)
                ends = (counts - 1).unsqueeze(1)
                prefix = sub.gather(1, ends).squeeze(1) & (sub.cumsum(1).gather(1, ends).squeeze(1) == counts)
                if not bool(prefix.all()):
                    # tree nodes off the first branch: each row's visible keys gathered in
                    # position order, as the decode step after accepting that branch has them
                    width = int(counts.max())
                    idx = torch.arange(c1 - c0, device=cols.device)
                    order = torch.where(sub, idx, c1 - c0).sort(1).values[:, :width]
                    slots = cols[order.clamp_max(c1 - c0 - 1)]  # [n, width]
                    visible = idx[:width].unsqueeze(0) < counts.unsqueeze(1)
            b, s_len = slots.shape
            nc = -(-s_len // c)
            sp = nc * c
            if sp != s_len:
                slots = torch.cat([slots, slots[:, :1].expand(b, sp - s_len)], 1)
            hidden = None
            if visible is not None or sp != s_len:
                hidden = torch.ones(n, sp, dtype=torch.bool, device=cols.device)
                hidden[:, :s_len] = False if visible is None else ~visible
                hidden = hidden.view(n, 1, nc, 1, c)
            self.parts.append((r0, r1, slots.reshape(-1), b, nc, hidden))


def paged_attention_invariant(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: InvariantPlan,  # of the forward's read_slots and mask
    scale: float,
) -> torch.Tensor:  # [T, heads, head_dim]
    """Row-invariant attention, one batched call per sequence: a row's output is bit for bit
    what that row gets alone (a decode step over exactly its visible keys), whatever other
    rows (drafts, tree nodes, other sequences) share the forward, so speculative output
    equals plain output when activations are rounded (half precision, int8).

    Every reduction has an order that does not depend on the other rows, in float32: keys
    are taken in chunks of INVARIANT_CHUNK counted from the sequence's first key (the last
    chunk padded with weight-zero keys; tree rows get their own keys gathered in position
    order), and every matrix product is a batch of products of one fixed shape ([group,
    head_dim] x [head_dim, chunk], [group, chunk] x [chunk, head_dim]), which the batched
    kernel computes alike however many there are (its order is the shape's, not the
    batch's: a one-shape batch gives each product the same bits, checked in tests/model;
    a single product of more rows does not). The max is exact in any order; hidden keys
    get exp(-inf) = 0.0; sums within a chunk run over a contiguous axis of fixed length,
    and chunk partials are added one after another in position order (a cumulative sum,
    read at the end), so all-zero chunks add exact zeros."""
    t, heads, d = q.shape
    kv = k_cache.shape[1]
    g, c = heads // kv, INVARIANT_CHUNK
    out = q.new_empty(t, heads, d)
    for r0, r1, slots, b, nc, hidden in plan.parts:
        n = r1 - r0
        k = k_cache.index_select(0, slots).float().view(b, nc, c, kv, d).permute(0, 3, 1, 4, 2).contiguous()
        v = v_cache.index_select(0, slots).float().view(b, nc, c, kv, d).permute(0, 3, 1, 2, 4).contiguous()
        qh = q[r0:r1].float().contiguous().view(n, kv, 1, g, d)
        mm = shared_matmul if b == 1 and n >= SHARED_LOOP_ROWS else torch.matmul
        s = mm(qh, k).mul_(scale)  # [n, kv, nc, g, c]
        if hidden is not None:
            s.masked_fill_(hidden, float("-inf"))
        p = s.sub_(s.amax(dim=(2, 4), keepdim=True)).exp_()
        total = p.sum(-1)  # [n, kv, nc, g]
        o = mm(p, v)  # [n, kv, nc, g, d]
        if nc > 1:
            total, o = total.cumsum(2)[:, :, -1], o.cumsum(2)[:, :, -1]
        else:
            total, o = total[:, :, 0], o[:, :, 0]
        out[r0:r1] = (o / total.unsqueeze(-1)).reshape(n, heads, d).to(q.dtype)
    return out
