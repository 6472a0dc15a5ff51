"""Paged KV cache: a block pool, per-sequence block tables, commit / rollback.

Storage is one flat slot pool per layer: slot = block * block_size + offset. A sequence
owns a block table (list of block ids) and a length (tokens whose K/V are valid).
Rollback is a length update that returns whole blocks past the new end to the pool;
no K/V is copied. Invariant: every block is either in the free list or in exactly one
table, so `free_blocks == num_blocks` whenever no sequence is live.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specbuild.errors import RequestError


@dataclass
class SeqBlocks:
    table: list[int] = field(default_factory=list)
    length: int = 0  # tokens with valid K/V


class PagedKVCache:
    """K/V storage for one model role. k, v: [layers, num_slots, kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.num_blocks = num_blocks
        slots = num_blocks * block_size
        # zeros, not empty: never let garbage (NaN) reach a masked attention row. One tensor per
        # layer (its own storage, not views of one): a compiled layer stack writes them in place
        # as separate graph inputs (views of one base would make it copy the whole base back)
        self.k = [torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.seqs: dict[int, SeqBlocks] = {}
        self.device = torch.device(device)

    # ---- accounting -------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self.free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq_id: int, new_length: int) -> int:
        have = len(self.seqs[seq_id].table) if seq_id in self.seqs else 0
        return max(0, -(-new_length // self.block_size) - have)

    def can_grow(self, seq_id: int, new_length: int) -> bool:
        return self.blocks_needed(seq_id, new_length) <= len(self.free)

    def length(self, seq_id: int) -> int:
        return self.seqs[seq_id].length

    # ---- lifecycle --------------------------------------------------------------------
    def add(self, seq_id: int) -> None:
        assert seq_id not in self.seqs, f"sequence {seq_id} already has blocks"
        self.seqs[seq_id] = SeqBlocks()

    def reserve(self, seq_id: int, new_length: int) -> None:
        """Make room for positions [0, new_length); raises RequestError when the pool is dry."""
        need = self.blocks_needed(seq_id, new_length)
        if need > len(self.free):
            raise RequestError(
                f"KV cache exhausted: sequence needs {need} more blocks, {len(self.free)} free "
                f"of {self.num_blocks}"
            )
        table = self.seqs[seq_id].table
        for _ in range(need):
            table.append(self.free.pop())

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Slot indices of positions [start, end) of a sequence. Returns [end - start] int64."""
        table = self.seqs[seq_id].table
        assert end <= len(table) * self.block_size, "positions beyond reserved blocks"
        first, last = start // self.block_size, -(-end // self.block_size)
        # each block's slots in a row, then the span: 4 small ops where indexing by position took 6
        rows = torch.tensor(table[first:last], dtype=torch.int64).unsqueeze(1) * self.block_size \
            + torch.arange(self.block_size)
        off = first * self.block_size
        return rows.reshape(-1)[start - off:end - off]

    def set_length(self, seq_id: int, length: int) -> None:
        """Commit (grow) or roll back (shrink) to `length` valid tokens; frees spare blocks."""
        seq = self.seqs[seq_id]
        assert 0 <= length <= len(seq.table) * self.block_size
        seq.length = length
        keep = -(-length // self.block_size)
        while len(seq.table) > keep:
            self.free.append(seq.table.pop())

    def release(self, seq_id: int) -> None:
        """Return all of a sequence's blocks to the pool (finished or aborted)."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.free.extend(reversed(seq.table))

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move K/V rows (all layers) from slots src [n] to slots dst [n] (tree compaction)."""
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` [n] in every layer: ([layers, n, kv_heads, head_dim], same)."""
        return torch.stack([k[slots] for k in self.k]), torch.stack([v[slots] for v in self.v])


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
