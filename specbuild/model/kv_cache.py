"""Paged KV cache: a block pool, per-sequence block tables, commit / rollback, and prefix reuse.

Storage is one flat slot pool per layer: slot = block * block_size + offset. A sequence
owns a block table (list of block ids) and a length (tokens whose K/V are valid).
Rollback is a length update that returns whole blocks past the new end to the pool;
no K/V is copied.

Prefix reuse (automatic prefix caching): a full block whose K/V are committed is known by a
hash chained over the tokens of every block up to and including it (and a salt: a tenant's
`cache_salt` or nothing), so equal hashes mean equal text from position 0, hence equal K/V
in a row-invariant model. `register` records a sequence's full blocks under their hashes;
`extend` puts the longest run of recorded blocks that continues a sequence's text (a new
prompt, or one still prefilling beside another with the same beginning) in its table. Blocks are reference counted: a block in several tables is read-only to
all of them (a sequence only writes positions at or past its length, and a rollback into a
shared or recorded block copies that block first: copy on write). A recorded block nobody
holds stays in the pool as "evictable" and is reused, least recently released first, only
when the free list is empty; `free_blocks` counts both.

Invariant (`check`): a block's reference count is the number of tables that hold it; a
block with count 0 is in exactly one of the free list and the evictable list, and recorded
blocks are exactly the values of the hash map. `free_blocks == num_blocks` whenever no
sequence is live.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from specbuild.errors import BundleError, RequestError


@dataclass
class SeqBlocks:
    table: list[int] = field(default_factory=list)
    length: int = 0  # tokens with valid K/V
    chain: list[bytes] = field(default_factory=list)  # hashes of the text's first full blocks (prefix reuse)
    registered: int = 0  # table[:registered] was offered to the hash map (recorded, or a twin was already)
    salt: bytes = b""  # the root of the chain: a tenant's cache_salt, hashed


def chain_hashes(tokens, block_size: int, n_blocks: int, salt: bytes = b"",
                 known: list[bytes] | None = None) -> list[bytes]:
    """Hashes of the first n_blocks full blocks of `tokens`, each over its parent's hash and its
    own tokens (blake2b, 16 bytes: a collision would hand one text another's K/V, so not
    Python's 64-bit hash). `known`: a prefix of the chain already computed, extended in place."""
    out = known if known is not None else []
    parent = out[-1] if out else salt
    for j in range(len(out), n_blocks):
        block = array("q", tokens[j * block_size:(j + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return out


def salt_root(salt: str | None) -> bytes:
    """The chain's root for a cache_salt (none: b"", so unsalted prompts share)."""
    return b"" if not salt else hashlib.blake2b(b"salt:" + salt.encode(), digest_size=16).digest()


def salt_key(salt: str | None) -> int:
    """A cache_salt as a non-negative int64 (0: none), for caches in another process (MineDraft's
    draft rank gets it in each order); key_root turns it back into a chain root."""
    return 0 if not salt else int.from_bytes(salt_root(salt)[:8], "little") >> 1 or 1


def key_root(key: int) -> bytes:
    return b"" if not key else key.to_bytes(8, "little")


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
        self._offsets = np.arange(block_size, dtype=np.int64)  # a block's slots from its first (slots_array)
        slots = num_blocks * block_size
        # zeros, not empty: never let garbage (NaN) reach a masked attention row. One tensor per
        # layer (its own storage, not views of one): a compiled layer stack writes them in place
        # as separate graph inputs (views of one base would make it copy the whole base back)
        # on CPU each in a zero-filled mapping of its own on huge pages (model/arena.py: attention
        # reads every layer's blocks of each sequence every step)
        # [slots, kv_heads, head_dim] either way; head-major by default: each kv head's rows of
        # all slots together (strides head_dim, slots * head_dim, 1), so attention, which reads
        # one kv head's rows of a sequence's slots at a time, reads whole runs of memory
        # (cpu_kernels.cpp, cache_layout, has the measurements). SPECBUILD_KV_LAYOUT=slot keeps
        # each slot's heads together (contiguous), for comparisons. The values are the same.
        # On CPU only, where it was measured; other devices keep the contiguous layout.
        cpu = torch.device(device).type == "cpu"
        self.layout = kv_layout() if cpu else "slot"
        stride = (head_dim, slots * head_dim, 1) if self.layout == "head" else None
        if cpu:
            from specbuild.model.arena import zeros
        else:
            def zeros(shape, dt, stride=None):
                return torch.zeros(shape, dtype=dt, device=device)
        self.k = [zeros((slots, kv_heads, head_dim), dtype, stride) for _ in range(num_layers)]
        self.v = [zeros((slots, kv_heads, head_dim), dtype, stride) for _ in range(num_layers)]
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.seqs: dict[int, SeqBlocks] = {}
        self.device = torch.device(device)
        self.refs = [0] * num_blocks  # tables holding each block
        self.cached: dict[bytes, int] = {}  # chained hash -> the block recorded under it
        self.block_hash: dict[int, bytes] = {}  # the reverse
        self.evictable: OrderedDict[int, None] = OrderedDict()  # recorded, held by no table; oldest first
        # prefix reuse counters: prompt tokens looked up, found, blocks recorded / evicted
        self.counters = {"queried_tokens": 0, "hit_tokens": 0, "recorded_blocks": 0, "evicted_blocks": 0}

    # ---- accounting -------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    def blocks_needed(self, seq_id: int, new_length: int) -> int:
        have = len(self.seqs[seq_id].table) if seq_id in self.seqs else 0
        return max(0, -(-new_length // self.block_size) - have)

    def can_grow(self, seq_id: int, new_length: int) -> bool:
        return self.blocks_needed(seq_id, new_length) <= self.free_blocks

    def length(self, seq_id: int) -> int:
        return self.seqs[seq_id].length

    # ---- blocks ---------------------------------------------------------------------------
    def _take(self) -> int:
        """A block for a table: a free one, else the least recently released recorded one
        (its record dropped)."""
        if self.free:
            b = self.free.pop()
        else:
            b, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash.pop(b)]
            self.counters["evicted_blocks"] += 1
        self.refs[b] = 1
        return b

    def _drop(self, b: int) -> None:
        """One table lets go of block b."""
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if b in self.block_hash:
                self.evictable[b] = None  # newest last: evicted after everything released before it
            else:
                self.free.append(b)

    def _hold(self, b: int) -> None:
        """One more table holds recorded block b (taken out of the evictable list if nobody did)."""
        if self.refs[b] == 0:
            del self.evictable[b]
        self.refs[b] += 1

    # ---- lifecycle --------------------------------------------------------------------
    def add(self, seq_id: int, salt: bytes = b"") -> None:
        assert seq_id not in self.seqs, f"sequence {seq_id} already has blocks"
        self.seqs[seq_id] = SeqBlocks(salt=salt)

    def reserve(self, seq_id: int, new_length: int) -> None:
        """Make room for positions [0, new_length); raises RequestError when the pool is dry."""
        need = self.blocks_needed(seq_id, new_length)
        if need > self.free_blocks:
            raise RequestError(
                f"KV cache exhausted: sequence needs {need} more blocks, {self.free_blocks} free "
                f"of {self.num_blocks}"
            )
        table = self.seqs[seq_id].table
        for _ in range(need):
            table.append(self._take())

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Slot indices of positions [start, end) of a sequence. Returns [end - start] int64."""
        return torch.from_numpy(self.slots_array(seq_id, start, end))

    def slots_array(self, seq_id: int, start: int, end: int) -> np.ndarray:
        """slots() as a numpy int64 array: each block's slots in a row, then the span. numpy's
        small ops cost ~1 us where torch's cost ~5-10 (the torch version took ~50-60 us a call,
        once per sequence per step, AMD EPYC, 2026-12-06)."""
        table = self.seqs[seq_id].table
        bs = self.block_size
        assert end <= len(table) * bs, "positions beyond reserved blocks"
        first, last = start // bs, -(-end // bs)
        rows = np.asarray(table[first:last], dtype=np.int64)[:, None] * bs + self._offsets
        off = first * bs
        return rows.reshape(-1)[start - off:end - off]

    def set_length(self, seq_id: int, length: int) -> None:
        """Commit (grow) or roll back (shrink) to `length` valid tokens; frees spare blocks. A
        rollback that ends inside a block others hold or that is recorded copies that block's
        valid rows to a block of its own first (the sequence writes there next). With no block
        to copy into, the shared block is let go and the length ends at its start instead: the
        scheduler's length check then recomputes the text (a repair, never a wrong row)."""
        seq = self.seqs[seq_id]
        assert 0 <= length <= len(seq.table) * self.block_size
        bs = self.block_size
        if length < seq.length:
            seq.registered = min(seq.registered, length // bs)
            del seq.chain[length // bs:]  # the text past here may change: its hashes are recomputed
            keep = -(-length // bs)
            while len(seq.table) > keep:  # the tail first: it may free the block the copy needs
                self._drop(seq.table.pop())
            j = length // bs
            if length % bs:
                old = seq.table[j]
                if self.refs[old] > 1 or old in self.block_hash:
                    if self.free_blocks:
                        new = self._take()
                        src = torch.arange(old * bs, old * bs + length % bs)
                        self.copy_slots(src.to(self.device), (src + (new - old) * bs).to(self.device))
                        seq.table[j] = new
                    else:
                        seq.table.pop()
                        length = j * bs
                    self._drop(old)
        seq.length = length
        keep = -(-length // bs)  # blocks reserved past the end (a draft's room) go back too
        while len(seq.table) > keep:
            self._drop(seq.table.pop())

    def release(self, seq_id: int) -> None:
        """Let go of all of a sequence's blocks (finished or aborted): unrecorded ones go back
        to the free list, recorded ones to the evictable list, tail first (so a text's tail is
        evicted before its head)."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            for b in reversed(seq.table):
                self._drop(b)

    # ---- prefix reuse ----------------------------------------------------------------------
    def register(self, seq_id: int, tokens, upto: int) -> int:
        """Record the sequence's full blocks below position `upto` (their K/V committed, their
        text tokens[:upto]) under their chained hashes, so that later prompts can adopt them.
        A hash already recorded (the same text computed by another sequence) keeps its block.
        Returns the number of blocks newly recorded."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return 0
        full = min(upto, seq.length) // self.block_size
        if full <= seq.registered:
            return 0
        chain_hashes(tokens, self.block_size, full, seq.salt, seq.chain)
        added = 0
        for j in range(seq.registered, full):
            h, b = seq.chain[j], seq.table[j]
            if h not in self.cached and b not in self.block_hash:
                self.cached[h] = b
                self.block_hash[b] = h
                added += 1
        seq.registered = full
        self.counters["recorded_blocks"] += added
        return added

    def extend(self, seq_id: int, tokens, limit: int, query: int = 0) -> int:
        """Append to the sequence's table the recorded blocks that continue its text `tokens`
        (up to `limit` tokens from position 0), read-only; returns the tokens gained. Only a
        sequence that ends on a block boundary with no block reserved past its length can grow
        this way (a new prompt, or one still prefilling). query: prompt tokens to count as looked
        up (a prompt's first lookup: all of it but its last token, even where a drafter bounds
        `limit`); hits count either way."""
        seq = self.seqs[seq_id]
        bs, have = self.block_size, len(seq.table)
        self.counters["queried_tokens"] += max(0, query)
        n = max(0, limit) // bs
        if seq.length != have * bs or n <= have:
            return 0
        chain = chain_hashes(tokens, bs, n, seq.salt, seq.chain)
        added = 0
        for j in range(have, n):
            b = self.cached.get(chain[j])
            if b is None:
                break
            self._hold(b)
            seq.table.append(b)
            added += 1
        if seq.registered == have:  # the blocks taken are recorded already
            seq.registered += added
        seq.length += added * bs
        self.counters["hit_tokens"] += added * bs
        return added * bs

    def lookup(self, tokens, limit: int, salt: bytes = b"") -> int:
        """Tokens of `tokens` (at most `limit`) whose blocks are recorded, from position 0
        (inspection and tests: nothing is held or counted)."""
        n = 0
        for h in chain_hashes(tokens, self.block_size, max(0, limit) // self.block_size, salt):
            if h not in self.cached:
                break
            n += 1
        return n * self.block_size

    def share(self, src_id: int, dst_id: int, n: int) -> None:
        """dst (empty) takes src's first n positions: full blocks held by both (read-only), the
        partial last block copied (n > 1 choices of one prompt)."""
        src, dst = self.seqs[src_id], self.seqs[dst_id]
        assert not dst.table and dst.length == 0 and n <= src.length
        bs = self.block_size
        full = n // bs
        for b in src.table[:full]:
            self._hold(b)
        dst.table = src.table[:full]
        dst.length = full * bs
        if n % bs:
            self.reserve(dst_id, n)
            a, b = src.table[full], dst.table[full]
            self.copy_slots(torch.arange(a * bs, a * bs + n % bs).to(self.device),
                            torch.arange(b * bs, b * bs + n % bs).to(self.device))
        dst.length = n

    def forget(self) -> int:
        """Drop every record (benchmarks: each row starts with an empty prefix cache); unheld
        recorded blocks go back to the free list, held ones stay with their tables. Returns the
        number of records dropped."""
        n = len(self.cached)
        self.free.extend(self.evictable)
        self.evictable.clear()
        self.cached.clear()
        self.block_hash.clear()
        for seq in self.seqs.values():
            seq.registered = len(seq.table)  # their blocks are not offered again
        return n

    def prefix_stats(self) -> dict:
        c = self.counters
        return {**c, "hit_rate": round(c["hit_tokens"] / c["queried_tokens"], 4) if c["queried_tokens"] else 0.0,
                "cached_blocks": len(self.cached), "evictable_blocks": len(self.evictable)}

    def check(self) -> None:
        """Assert the pool's invariant (tests, soaks): counts match the tables, every unheld
        block is free or evictable (once), records are consistent."""
        held = [0] * self.num_blocks
        for s in self.seqs.values():
            for b in s.table:
                held[b] += 1
        assert held == self.refs, "reference counts disagree with the tables"
        idle = self.free + list(self.evictable)
        assert len(idle) == len(set(idle)), "a block is idle twice"
        assert sorted(idle) == [b for b in range(self.num_blocks) if held[b] == 0], "a block leaked or is lost"
        assert all(b in self.block_hash for b in self.evictable), "an evictable block is not recorded"
        assert {b: h for h, b in self.cached.items()} == self.block_hash, "hash records disagree"

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move K/V rows (all layers) from slots src [n] to slots dst [n] (tree compaction)."""
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` [n] in every layer: ([layers, n, kv_heads, head_dim], same)."""
        return torch.stack([k[slots] for k in self.k]), torch.stack([v[slots] for v in self.v])


LAYOUTS = ("head", "slot")


def kv_layout() -> str:
    """The CPU KV cache's layout from $SPECBUILD_KV_LAYOUT: "head" (the default: each kv head's
    rows of all slots together) or "slot" (each slot's heads together); see PagedKVCache."""
    value = os.environ.get("SPECBUILD_KV_LAYOUT", "head").strip().lower() or "head"
    if value not in LAYOUTS:
        raise BundleError(f"SPECBUILD_KV_LAYOUT={value!r} is not one of {', '.join(LAYOUTS)}")
    return value


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
