"""One block of memory for a model's packed weights (and the KV cache's tensors), on 2 MiB pages
where the kernel gives them.

A decode step streams every packed weight once (~95 MB for the default bundle's layers and
lm_head). Allocated tensor by tensor, they lie scattered over the heap on 4 KiB pages: ~23,000
pages a step, each a TLB miss and a page the hardware prefetcher will not run past. Copied into
one anonymous private mapping, in the order the step reads them, with MADV_HUGEPAGE (Linux's
transparent huge pages in "madvise" mode, this project's machines' setting), they take ~50 pages.
One decode row, the fused stack's weights and the lm_head's, pool x2, AMD EPYC: 0.885-0.905x the
scattered tensors' time; the stack's alone in one block on 4 KiB pages 0.955-0.987x (lab pairs
in one process, 2026-12-07). The bytes are the same, so every result is the same bits.

The KV cache's per-layer tensors come the same way (`zeros`): attention reads each sequence's
blocks of every layer every step, 12 KiB runs scattered over a pool of ~760 MB. One process,
alternating (the same lab): one row after 200 tokens 0.979x, after 1,000 tokens 0.948x; 4 rows
0.981x and 0.958x. The kernel zero-fills an anonymous mapping; each page is touched once at
start, so the pool takes its memory then, as torch.zeros did (a machine short of it fails at
load, not in a request). That costs load time where the kernel compacts memory into huge pages:
the default pool's 760 MB took 1.7 s here against torch.zeros' 0.2 s; left to the first write,
each 2 MiB page cost ~2.7 ms inside a request.

Where huge pages are not offered (another OS, THP "never") the arena is still one contiguous
allocation; nothing is required of the system.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor's start (the kernels' and oneDNN's alignment)


def weight_arena(tensors: list[torch.Tensor]) -> tuple[object, list[torch.Tensor]]:
    """Copies of `tensors` (contiguous) in one block, each 64-byte aligned, in the given order:
    (the block, which the views keep alive too; the views)."""
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors]
    total = sum(sizes)
    block, base = _mapping(total + HUGE_PAGE)
    if block is None:
        base = torch.empty(total + ALIGN, dtype=torch.uint8)
        block = base
    start = (-base.data_ptr()) % (HUGE_PAGE if block is not base else ALIGN)
    views, off = [], start
    for t, size in zip(tensors, sizes):
        n = t.numel() * t.element_size()
        view = base[off:off + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        views.append(view)
        off += size
    return block, views


def _mapping(length: int):
    """An anonymous private mapping of `length` bytes advised onto huge pages, as a uint8
    tensor over it; (None, None) where the platform has no such mapping."""
    flags = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if None in flags or length <= 0:
        return None, None
    try:
        block = mmap.mmap(-1, length, flags=flags[0] | flags[1])
    except (OSError, ValueError):
        return None, None
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            block.madvise(advice)
        except OSError:  # THP unavailable: 4 KiB pages, still one block
            pass
    return block, torch.frombuffer(block, dtype=torch.uint8)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """A zero tensor in a mapping of its own (its own storage, as the KV cache's per-layer
    tensors need) on huge pages where offered; torch.zeros where there is no such mapping.
    `stride`: the element strides of a dense non-contiguous layout (a permutation of the
    contiguous one); the tensor still owns its storage, it is not a view."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    block, base = _mapping(nbytes)
    if block is None:
        if stride is None:
            return torch.zeros(shape, dtype=dtype)
        return torch.empty_strided(shape, stride, dtype=dtype).zero_()
    # a tensor over the storage, not a view of the mapping's byte tensor: a compiled layer stack
    # writes the cache in place as graph inputs, and a view would make it write back its base
    base[::4096].zero_()  # one write a page: the memory is taken now (huge pages where given)
    out = torch.empty(0, dtype=dtype)
    if stride is None:
        out.set_(base.untyped_storage(), 0, shape)
    else:
        out.set_(base.untyped_storage(), 0, shape, stride)
    return out
