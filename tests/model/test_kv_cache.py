"""PagedKVCache accounting: every block is free or in exactly one table, always."""

from __future__ import annotations

import pytest
import torch

from specbuild.errors import BundleError, RequestError
from specbuild.model.kv_cache import PagedKVCache, kv_bytes_per_token


def make_cache(num_blocks: int = 8, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(num_layers=2, kv_heads=2, head_dim=8, num_blocks=num_blocks, block_size=block_size)


def owned(cache: PagedKVCache) -> list[int]:
    return [b for s in cache.seqs.values() for b in s.table]


def check_invariant(cache: PagedKVCache) -> None:
    """Free list and tables partition the pool."""
    blocks = cache.free + owned(cache)
    assert sorted(blocks) == list(range(cache.num_blocks))


def test_reserve_counts_whole_blocks():
    cache = make_cache()
    cache.add(1)
    assert cache.blocks_needed(1, 1) == 1 and cache.blocks_needed(1, 4) == 1 and cache.blocks_needed(1, 5) == 2
    cache.reserve(1, 5)
    assert len(cache.seqs[1].table) == 2 and cache.free_blocks == 6 and cache.used_blocks == 2
    cache.reserve(1, 8)  # still fits in 2 blocks: nothing taken
    assert cache.free_blocks == 6
    cache.reserve(1, 9)
    assert cache.free_blocks == 5
    cache.set_length(1, 9)
    assert cache.length(1) == 9
    check_invariant(cache)


def test_slots_follow_the_block_table():
    cache = make_cache(block_size=4)
    cache.add(1)
    cache.add(2)
    # interleave so that sequence 1's blocks are not contiguous
    cache.reserve(1, 4)
    cache.reserve(2, 4)
    cache.reserve(1, 8)
    t1 = cache.seqs[1].table
    assert t1[1] != t1[0] + 1
    slots = cache.slots(1, 2, 7).tolist()
    expected = [t1[p // 4] * 4 + p % 4 for p in range(2, 7)]
    assert slots == expected
    # no slot is shared between sequences
    s2 = set(cache.slots(2, 0, 4).tolist())
    assert not s2 & set(cache.slots(1, 0, 8).tolist())


def test_rollback_frees_blocks_past_the_end():
    cache = make_cache(block_size=4)
    cache.add(1)
    cache.reserve(1, 13)  # 4 blocks
    cache.set_length(1, 13)
    assert cache.free_blocks == 4
    cache.set_length(1, 9)  # 3 blocks still needed
    assert cache.free_blocks == 5 and len(cache.seqs[1].table) == 3
    cache.set_length(1, 8)  # exactly 2 blocks
    assert cache.free_blocks == 6 and cache.length(1) == 8
    cache.set_length(1, 0)
    assert cache.free_blocks == 8 and cache.seqs[1].table == []
    check_invariant(cache)


def test_release_returns_everything_and_is_idempotent():
    cache = make_cache()
    for sid, n in ((1, 7), (2, 3), (3, 12)):
        cache.add(sid)
        cache.reserve(sid, n)
        cache.set_length(sid, n)
    check_invariant(cache)
    assert cache.free_blocks == 8 - (2 + 1 + 3)
    cache.release(2)
    cache.release(2)  # a second release (abort after finish) is harmless
    assert 2 not in cache.seqs and cache.free_blocks == 3
    cache.release(1)
    cache.release(3)
    assert cache.free_blocks == cache.num_blocks and not cache.seqs
    check_invariant(cache)


def test_exhaustion_raises_request_error_and_takes_nothing():
    cache = make_cache(num_blocks=3, block_size=4)
    cache.add(1)
    cache.reserve(1, 8)
    cache.add(2)
    assert not cache.can_grow(2, 5)
    with pytest.raises(RequestError, match=r"needs 2 more blocks, 1 free of 3"):
        cache.reserve(2, 5)
    assert cache.free_blocks == 1 and cache.seqs[2].table == []
    assert cache.can_grow(2, 4)
    cache.reserve(2, 4)
    assert cache.free_blocks == 0
    check_invariant(cache)


def test_random_churn_keeps_the_pool_whole():
    gen = torch.Generator().manual_seed(0)
    cache = make_cache(num_blocks=16, block_size=4)
    live: dict[int, int] = {}
    next_id = 1
    for _ in range(500):
        op = int(torch.randint(0, 3, (1,), generator=gen))
        if op == 0:
            cache.add(next_id)
            live[next_id] = 0
            next_id += 1
        elif live:
            sid = list(live)[int(torch.randint(0, len(live), (1,), generator=gen))]
            if op == 1:
                new_len = int(torch.randint(0, 30, (1,), generator=gen))
                if cache.can_grow(sid, new_len):
                    cache.reserve(sid, new_len)
                    cache.set_length(sid, new_len)
                    live[sid] = new_len
                    assert len(cache.seqs[sid].table) == -(-new_len // 4)
            else:
                cache.release(sid)
                del live[sid]
        check_invariant(cache)
    for sid in list(live):
        cache.release(sid)
    assert cache.free_blocks == cache.num_blocks


def test_copy_slots_moves_all_layers():
    cache = make_cache()
    for t in (*cache.k, *cache.v):
        t.normal_()
    src, dst = torch.tensor([5, 9]), torch.tensor([0, 1])
    k_src, v_src = cache.rows(src)
    cache.copy_slots(src, dst)
    k_dst, v_dst = cache.rows(dst)
    assert torch.equal(k_dst, k_src) and torch.equal(v_dst, v_src)
    assert len(cache.k) > 1 and not torch.equal(k_src[0], k_src[1])  # every layer moved, not one


def test_kv_bytes_per_token():
    # SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64, float32 -> 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(30, 3, 64, torch.float32) == 46080
    assert kv_bytes_per_token(30, 3, 64, torch.bfloat16) == 23040


def test_slots_of_every_span_are_block_times_size_plus_offset():
    """slots(start, end) against the definition, position by position, for every span of a
    scattered block table (edges, empty spans, spans inside one block)."""
    cache = PagedKVCache(1, 1, 4, num_blocks=12, block_size=4)
    cache.add(0)
    cache.add(1)
    for seq, n in ((1, 5), (0, 9), (1, 9), (0, 17)):  # interleaved: seq 0's blocks are not contiguous
        cache.reserve(seq, n)
    table = cache.seqs[0].table
    for start in range(0, 18):
        for end in range(start, 18):
            want = [table[p // 4] * 4 + p % 4 for p in range(start, end)]
            assert cache.slots(0, start, end).tolist() == want, (start, end)


def test_the_layers_tensors_start_at_zero_each_on_a_storage_of_its_own():
    """On CPU each layer's K and V lie in a zero-filled mapping of their own (model/arena.py, on
    huge pages where offered): zeros, no view of another tensor (a compiled stack writes them in
    place as graph inputs), and a write to one is seen in no other. By default each is
    head-major: [slots, kv heads, head_dim] with each kv head's rows of all slots together."""
    cache = PagedKVCache(num_layers=3, kv_heads=2, head_dim=8, num_blocks=64, block_size=16)
    tensors = cache.k + cache.v
    assert cache.layout == "head"
    assert all(t.shape == (64 * 16, 2, 8) and t.dtype == torch.float32 and t.stride() == (8, 64 * 16 * 8, 1)
               for t in tensors)
    assert all(not t._is_view() and not t.any() for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    cache.k[1][5] = 1.0
    assert cache.k[1].sum() == 16 and all(not t.any() for t in tensors if t is not cache.k[1])
    half = PagedKVCache(num_layers=1, kv_heads=2, head_dim=8, num_blocks=4, block_size=4, dtype=torch.bfloat16)
    assert half.k[0].dtype == torch.bfloat16 and not half.k[0].any()


def test_the_slot_layout_keeps_each_slots_heads_together_and_a_bad_layout_is_named(monkeypatch):
    """SPECBUILD_KV_LAYOUT=slot gives the contiguous [slots, kv heads, head_dim] tensors; the
    values a slot holds are the same either way; any other value is refused by name."""
    monkeypatch.setenv("SPECBUILD_KV_LAYOUT", "slot")
    slot = PagedKVCache(num_layers=2, kv_heads=2, head_dim=8, num_blocks=8, block_size=4)
    assert slot.layout == "slot" and all(t.is_contiguous() and not t._is_view() for t in slot.k + slot.v)
    monkeypatch.delenv("SPECBUILD_KV_LAYOUT")
    head = PagedKVCache(num_layers=2, kv_heads=2, head_dim=8, num_blocks=8, block_size=4)
    assert head.layout == "head" and not head.k[0].is_contiguous()
    rows = torch.arange(5 * 2 * 8, dtype=torch.float32).view(5, 2, 8)
    for c in (slot, head):
        c.k[1][torch.tensor([3, 9, 30, 0, 17])] = rows
    assert torch.equal(slot.k[1], head.k[1]) and torch.equal(head.k[1][9], rows[1])
    monkeypatch.setenv("SPECBUILD_KV_LAYOUT", "diagonal")
    with pytest.raises(BundleError, match="SPECBUILD_KV_LAYOUT='diagonal' is not one of head, slot"):
        PagedKVCache(num_layers=1, kv_heads=2, head_dim=8, num_blocks=4, block_size=4)
