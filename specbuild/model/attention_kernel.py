"""Masked paged attention as a Triton-language kernel (CUDA; CPU via TRITON_INTERPRET=1).

Computes exactly what `specbuild.model.attention.paged_attention` computes, with the
same signature: T query rows of a ragged batch against S key/value rows gathered from
the flat slot pool through `read_slots`, a boolean mask [T, S] (causal blocks, tree
ancestor blocks, never across sequences), grouped-query attention (query head h reads
kv head h // (heads // kv_heads)).

Kernel layout: one program per (block of BLOCK_M query rows, query head). It streams
the gathered rows in tiles of BLOCK_N with an online (flash) softmax in float32. The
wrapper first reduces the mask to, per query block, the range of columns any of its
rows may see, so each sequence's rows only scan that sequence's slots (a ragged batch
costs the sum of its sequences, not T x S). A row that sees nothing comes out 0, as
from `paged_attention` (SDPA); the float64 reference gives NaN there.

Triton decides between compiling and interpreting when it is imported (its own
`tl` helpers are jitted then): TRITON_INTERPRET=1 must be set before the first
`import triton` in the process, so tests run the interpreter in a subprocess.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["triton_available", "triton_paged_attention"]


def _interpreting() -> bool:
    """Whether the kernel was built for triton's interpreter (CPU tensors allowed)."""
    return triton is not None and not isinstance(_paged_attention_kernel, triton.JITFunction)


def triton_available(device: torch.device | str) -> bool:
    """Whether `triton_paged_attention` can run on tensors of this device."""
    if triton is None:
        return False
    if _interpreting():
        return True
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, slots_ptr, mask_ptr, out_ptr, lo_ptr, hi_ptr,
        num_rows, scale_log2,
        stride_qt, stride_qh, stride_qd,
        stride_ks, stride_kh, stride_kd,
        stride_vs, stride_vh, stride_vd,
        stride_mt, stride_ms,
        stride_ot, stride_oh, stride_od,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr,
    ):
        block = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        row_ok = rows < num_rows
        dim_ok = dims < HEAD_DIM
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head * stride_qh + dims[None, :] * stride_qd,
            mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        if DOT_FP32:
            q = q.to(tl.float32)
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        col_lo = tl.load(lo_ptr + block)
        col_hi = tl.load(hi_ptr + block)
        for start in range(col_lo, col_hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            col_ok = cols < col_hi
            slots = tl.load(slots_ptr + cols, mask=col_ok, other=0)  # [BLOCK_N] int64
            kv_ok = col_ok[:, None] & dim_ok[None, :]
            keys = tl.load(
                k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :] * stride_kd,
                mask=kv_ok, other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            if DOT_FP32:
                scores = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(keys))
            scores = scores * scale_log2  # [BLOCK_M, BLOCK_N], log2 domain
            visible = row_ok[:, None] & col_ok[None, :]
            if HAS_MASK:
                allowed = tl.load(
                    mask_ptr + rows[:, None] * stride_mt + cols[None, :] * stride_ms,
                    mask=visible, other=0,
                )
                visible = visible & (allowed != 0)
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            weights = tl.exp2(scores - safe_max[:, None])  # masked -> 0
            rescale = tl.exp2(row_max - safe_max)  # first visible tile: 0
            row_sum = row_sum * rescale + tl.sum(weights, 1)
            values = tl.load(
                v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :] * stride_vd,
                mask=kv_ok, other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            if DOT_FP32:
                update = tl.dot(weights, values.to(tl.float32), input_precision="ieee")
            else:
                update = tl.dot(weights.to(values.dtype), values)
            acc = acc * rescale[:, None] + update
            row_max = new_max
        # A row that saw nothing has acc = 0: it comes out 0, as SDPA's does.
        out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head * stride_oh + dims[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


def _column_ranges(
    mask: torch.Tensor | None,  # [T, S] bool
    num_rows: int, num_cols: int, block_m: int, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_blocks] int32 each: [lo, hi) per query block
    num_blocks = -(-num_rows // block_m)
    if mask is None:
        lo = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        return lo, torch.full_like(lo, num_cols)
    cols = torch.arange(num_cols, device=device)
    first = torch.where(mask, cols, num_cols).amin(dim=1)  # [T]
    end = torch.where(mask, cols + 1, 0).amax(dim=1)  # [T]
    pad = num_blocks * block_m - num_rows
    first = torch.nn.functional.pad(first, (0, pad), value=num_cols)
    end = torch.nn.functional.pad(end, (0, pad), value=0)
    lo = first.view(num_blocks, block_m).amin(dim=1)
    hi = torch.maximum(end.view(num_blocks, block_m).amax(dim=1), lo)
    return lo.to(torch.int32), hi.to(torch.int32)


def triton_paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    read_slots: torch.Tensor,  # [S] int64, slot of each visible key row
    mask: torch.Tensor | None,  # [T, S] bool, True = may attend; None = all visible
    scale: float,
    *,
    block_m: int = 16,
    block_n: int = 32,
) -> torch.Tensor:  # [T, heads, head_dim]
    """Same contract as `paged_attention`, computed by the Triton kernel: float32
    softmax and accumulation; fp32 inputs use IEEE dot products (not TF32), fp16/bf16
    inputs native tensor-core dots. Raises RuntimeError where triton cannot run
    (see `triton_available`), ValueError for inconsistent shapes or dtypes."""
    if triton is None:
        raise RuntimeError("triton_paged_attention needs the `triton` package (pip install triton)")
    if q.ndim != 3 or k_cache.ndim != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"shapes q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
            f"{tuple(v_cache.shape)} must be [T, heads, D] and two equal [slots, kv_heads, D]"
        )
    num_rows, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or heads % kv_heads != 0:
        raise ValueError(
            f"head_dim {head_dim} vs cache {k_cache.shape[2]}, heads {heads} must be a "
            f"multiple of kv_heads {kv_heads}"
        )
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtypes q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype} must match")
    read_slots = read_slots.to(device=q.device, dtype=torch.int64).contiguous()
    if read_slots.ndim != 1:
        raise ValueError(f"read_slots shape {tuple(read_slots.shape)} must be [S]")
    num_cols = read_slots.shape[0]
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (num_rows, num_cols)):
        raise ValueError(f"mask {mask.dtype} {tuple(mask.shape)} must be bool [{num_rows}, {num_cols}]")
    interpret = _interpreting()
    if q.device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"triton_paged_attention on {q.device.type} tensors needs TRITON_INTERPRET=1 "
            "(the Triton interpreter); use paged_attention instead"
        )
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    if num_cols == 0:
        raise ValueError("read_slots is empty: every query row needs at least one key row")
    lo, hi = _column_ranges(mask, num_rows, num_cols, block_m, q.device)
    mask_u8 = mask.view(torch.uint8) if mask is not None else lo  # dummy pointer when None
    mask_strides = mask_u8.stride() if mask is not None else (0, 0)
    grid = (lo.shape[0], heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, read_slots, mask_u8, out, lo, hi,
        num_rows, float(scale) * math.log2(math.e),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *mask_strides, *out.stride(),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        HAS_MASK=mask is not None,
        # float32 dots in IEEE precision (not TF32); the interpreter's bf16 dot multiplies
        # the raw uint16 bits (triton 3.9), so bf16 is upcast there.
        DOT_FP32=q.dtype == torch.float32 or (interpret and q.dtype == torch.bfloat16),
    )
    return out
