"""Prefix reuse in PagedKVCache: chained block hashes, shared read-only blocks with reference
counts, copy on write, LRU eviction of unheld recorded blocks, salts, and the pool's invariant.

K/V here are a stand-in model: the row written for position p of a text is a function of the
text's tokens up to p (its prefix sum, as attention would make it depend on everything before),
so a sequence reads back exactly what it would have computed itself iff the reused rows are right.
"""

from __future__ import annotations

import random

import pytest
import torch

from specbuild.model.kv_cache import PagedKVCache, chain_hashes, salt_root

BS = 4


def make_cache(num_blocks: int = 16) -> PagedKVCache:
    return PagedKVCache(num_layers=2, kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=BS)


def row(tokens: list[int], p: int) -> list[float]:
    """The stand-in K row of position p of a text: depends on every token up to p."""
    return [float(sum(tokens[:p + 1]) % 9973), float(p)]


def write(cache: PagedKVCache, sid: int, tokens: list[int], start: int, end: int) -> None:
    """Compute positions [start, end) of sequence sid (as a forward would) and commit them."""
    cache.reserve(sid, end)
    slots = cache.slots(sid, start, end)
    rows = torch.tensor([row(tokens, p) for p in range(start, end)]).unsqueeze(1)
    for k, v in zip(cache.k, cache.v):
        k[slots] = rows
        v[slots] = -rows
    cache.set_length(sid, end)


def readback(cache: PagedKVCache, sid: int) -> list[list[float]]:
    n = cache.length(sid)
    return cache.k[1][cache.slots(sid, 0, n)].squeeze(1).tolist()


def prefill(cache: PagedKVCache, sid: int, tokens: list[int], salt: bytes = b"") -> int:
    """A new prompt: adopt what is recorded (leaving its last token), compute the rest, record.
    Returns the tokens reused."""
    cache.add(sid, salt)
    got = cache.extend(sid, tokens, len(tokens) - 1, query=len(tokens) - 1)
    write(cache, sid, tokens, got, len(tokens))
    cache.register(sid, tokens, len(tokens))
    return got


def test_chain_hash_depends_on_every_earlier_block_and_the_salt():
    a = chain_hashes(list(range(12)), BS, 3)
    b = chain_hashes([99] + list(range(1, 12)), BS, 3)
    assert len(a) == 3 and all(len(h) == 16 for h in a)
    assert all(x != y for x, y in zip(a, b))  # one token of block 0 changes every later hash
    assert chain_hashes(list(range(12)), BS, 3) == a
    assert chain_hashes(list(range(12)), BS, 3, salt_root("tenant-a")) != a
    assert salt_root(None) == salt_root("") == b""
    known = a[:1]
    assert chain_hashes(list(range(12)), BS, 3, known=known) == a and known == a  # extended in place


def test_second_turn_reuses_full_blocks_and_reads_what_it_would_compute():
    cache = make_cache()
    turn1 = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 2 full blocks + 2
    assert prefill(cache, 1, turn1) == 0
    reply = [40, 41, 42, 43]
    write(cache, 1, turn1 + reply, len(turn1), len(turn1) + len(reply))
    cache.register(1, turn1 + reply, 14)
    cache.release(1)
    cache.check()
    assert cache.free_blocks == cache.num_blocks  # recorded blocks are evictable, so free
    turn2 = turn1 + reply + [50, 51, 52]  # 17 tokens: 4 full blocks before the last token
    assert cache.lookup(turn2, 16) == 12  # blocks 0-2 recorded (block 3 was never full)
    got = prefill(cache, 2, turn2)
    assert got == 12
    assert readback(cache, 2) == [row(turn2, p) for p in range(len(turn2))]
    stats = cache.prefix_stats()
    assert stats["hit_tokens"] == 12 and stats["queried_tokens"] == 9 + 16 and stats["hit_rate"] > 0
    cache.check()


def test_last_prompt_token_is_always_computed():
    cache = make_cache()
    text = list(range(1, 9))  # exactly 2 blocks
    prefill(cache, 1, text)
    cache.release(1)
    # the same prompt again: its last block holds the last token, so only block 0 is adopted
    assert prefill(cache, 2, text) == 4
    assert readback(cache, 2) == [row(text, p) for p in range(8)]
    cache.check()


def test_shared_blocks_are_counted_and_freed_once():
    cache = make_cache(num_blocks=8)
    text = list(range(1, 14))
    prefill(cache, 1, text)  # 4 blocks, 3 full recorded
    assert prefill(cache, 2, text + [77]) == 12  # while 1 is live: blocks held by both
    t1, t2 = cache.seqs[1].table, cache.seqs[2].table
    assert t1[:3] == t2[:3] and t1[3] != t2[3]
    assert all(cache.refs[b] == 2 for b in t1[:3])
    assert cache.used_blocks == 5
    cache.release(1)
    assert all(cache.refs[b] == 1 for b in t2[:3]) and cache.used_blocks == 4
    cache.check()
    cache.release(2)
    assert cache.free_blocks == 8 and cache.used_blocks == 0
    cache.check()


def test_rollback_into_a_shared_block_copies_it_first():
    cache = make_cache()
    text = list(range(1, 14))
    prefill(cache, 1, text)
    prefill(cache, 2, text)
    shared = cache.seqs[2].table[1]
    assert cache.refs[shared] == 2
    cache.set_length(2, 6)  # into block 1, which seq 1 holds too (and is recorded)
    mine = cache.seqs[2].table[1]
    assert mine != shared and cache.refs[shared] == 1 and cache.refs[mine] == 1
    # seq 2 writes other text at 6..: seq 1's rows and the recorded block stay as they were
    other = text[:6] + [90, 91, 92]
    write(cache, 2, other, 6, 9)
    assert readback(cache, 2) == [row(other, p) for p in range(9)]
    assert readback(cache, 1) == [row(text, p) for p in range(13)]
    cache.release(1)
    cache.release(2)
    assert prefill(cache, 3, text) == 12  # the record still reads as the original text
    assert readback(cache, 3) == [row(text, p) for p in range(13)]
    cache.check()


def test_rollback_into_a_recorded_block_of_ones_own_copies_it():
    cache = make_cache()
    text = list(range(1, 10))
    prefill(cache, 1, text)  # blocks 0, 1 recorded, held by seq 1 alone
    rec = cache.seqs[1].table[1]
    cache.set_length(1, 5)
    assert cache.seqs[1].table[1] != rec and rec in cache.evictable  # the record kept, unheld
    assert cache.seqs[1].registered == 1
    write(cache, 1, text[:5] + [66, 67, 68], 5, 8)
    cache.release(1)
    assert prefill(cache, 2, text) == 8
    assert readback(cache, 2) == [row(text, p) for p in range(9)]
    cache.check()


def test_unheld_records_are_evicted_least_recently_released_first_tail_first():
    cache = make_cache(num_blocks=6)
    a, b = [1] * 9, [2] * 9  # 2 full blocks + 1 each
    prefill(cache, 1, a)
    cache.release(1)
    prefill(cache, 2, b)
    cache.release(2)
    a_blocks = cache.lookup(a, 8)
    assert a_blocks == 8 and cache.lookup(b, 8) == 8 and len(cache.evictable) == 4
    cache.add(3)
    cache.reserve(3, 12)  # 3 blocks: the 2 plain free ones, then a's tail block (oldest, released tail first)
    assert cache.lookup(a, 8) == 4 and cache.lookup(b, 8) == 8
    assert cache.counters["evicted_blocks"] == 1
    cache.reserve(3, 16)
    assert cache.lookup(a, 8) == 0 and cache.lookup(b, 8) == 8
    cache.check()
    cache.release(3)
    assert cache.free_blocks == 6
    cache.check()


def test_adopting_an_evictable_block_takes_it_off_the_eviction_list():
    cache = make_cache(num_blocks=4)
    text = [3] * 9
    prefill(cache, 1, text)
    cache.release(1)
    assert prefill(cache, 2, text) == 8
    held = cache.seqs[2].table[:2]
    assert not set(held) & set(cache.evictable)
    cache.add(3)
    cache.reserve(3, 4)  # the one block left: must not be a held one
    assert cache.free_blocks == 0 and cache.seqs[3].table[0] not in held
    cache.check()


def test_salts_keep_texts_apart():
    cache = make_cache()
    text = list(range(20, 33))
    prefill(cache, 1, text, salt_root("alice"))
    cache.release(1)
    assert prefill(cache, 2, text, salt_root("bob")) == 0
    assert prefill(cache, 3, text) == 0  # no salt is a salt of its own
    assert prefill(cache, 4, text, salt_root("alice")) == 12
    cache.check()


def test_extend_continues_a_prefilling_sequence():
    """Two prompts with one beginning, admitted together: the second takes the blocks the first
    computed since, then computes its own rest."""
    cache = make_cache()
    system = list(range(100, 116))  # 4 blocks
    p1, p2 = system + [1, 2, 3], system + [7, 8]
    cache.add(1)
    cache.add(2)
    assert cache.extend(1, p1, len(p1) - 1, query=len(p1) - 1) == 0
    assert cache.extend(2, p2, len(p2) - 1, query=len(p2) - 1) == 0
    write(cache, 1, p1, 0, 8)  # a first chunk of seq 1
    cache.register(1, p1, 8)
    assert cache.extend(2, p2, len(p2) - 1) == 8
    write(cache, 1, p1, 8, len(p1))
    cache.register(1, p1, len(p1))
    assert cache.extend(2, p2, len(p2) - 1) == 8
    write(cache, 2, p2, 16, len(p2))
    assert readback(cache, 2) == [row(p2, p) for p in range(len(p2))]
    # a sequence mid-block (or with blocks reserved past its length) does not grow this way
    cache.add(3)
    write(cache, 3, p1, 0, 6)
    assert cache.extend(3, p1, len(p1) - 1) == 0
    cache.check()


def test_share_holds_full_blocks_and_copies_the_partial_one():
    cache = make_cache()
    text = list(range(1, 12))
    cache.add(1)
    write(cache, 1, text, 0, 11)
    cache.add(2)
    cache.share(1, 2, 10)
    assert cache.seqs[2].table[:2] == cache.seqs[1].table[:2] and cache.seqs[2].table[2] != cache.seqs[1].table[2]
    assert cache.length(2) == 10
    write(cache, 2, text[:10] + [55], 10, 11)
    assert readback(cache, 2) == [row(text[:10] + [55], p) for p in range(11)]
    assert readback(cache, 1) == [row(text, p) for p in range(11)]
    cache.release(1)
    cache.release(2)
    assert cache.free_blocks == cache.num_blocks
    cache.check()


def test_check_catches_a_leak():
    cache = make_cache()
    cache.add(1)
    cache.reserve(1, 8)
    cache.seqs[1].table.pop()  # a block dropped without going back
    with pytest.raises(AssertionError):
        cache.check()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_churn_with_reuse_keeps_the_pool_whole_and_rows_right(seed):
    """Prompts from a few shared beginnings, decoding with rollbacks, releases in any order,
    a pool small enough to evict: the invariant holds after every operation, every live
    sequence reads back its own text's rows, and nothing leaks at the end."""
    rng = random.Random(seed)
    cache = make_cache(num_blocks=24)
    heads = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 14))] for _ in range(4)]
    live: dict[int, list[int]] = {}
    reused = 0
    for sid in range(400):
        op = rng.random()
        if op < 0.35 or not live:
            text = rng.choice(heads) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
            if -(-len(text) // BS) + 2 > cache.free_blocks:
                continue
            reused += prefill(cache, sid, text, rng.choice([b"", salt_root("t")]))
            live[sid] = text
        elif op < 0.75:
            s = rng.choice(list(live))
            text = live[s]
            n = len(text)
            if rng.random() < 0.4 and n > 2:  # roll back (a rejected draft, a repair)
                n = rng.randrange(1, n)
                cache.set_length(s, n)
                if cache.length(s) < n:  # no block to copy a shared one into: recompute from its start
                    assert cache.length(s) % BS == 0 and cache.free_blocks == 0
                    write(cache, s, text, cache.length(s), n)
                text = live[s] = text[:n]
            grow = rng.randrange(1, 6)
            if cache.can_grow(s, n + grow):
                text = live[s] = text + [rng.randrange(1, 50) for _ in range(grow)]
                write(cache, s, text, n, len(text))
                cache.register(s, text, len(text))
        else:
            s = rng.choice(list(live))
            cache.release(s)
            del live[s]
        cache.check()
        for s, text in live.items():
            assert readback(cache, s) == [row(text, p) for p in range(len(text))], s
    assert reused > 0 and cache.counters["evicted_blocks"] > 0
    for s in list(live):
        cache.release(s)
    cache.check()
    assert cache.free_blocks == cache.num_blocks


def test_forget_drops_every_record_and_frees_unheld_blocks():
    cache = make_cache(num_blocks=8)
    text = list(range(1, 14))
    prefill(cache, 1, text)
    prefill(cache, 2, text[:9] + [50, 51])
    cache.release(1)
    assert cache.evictable and cache.cached
    assert cache.forget() > 0
    cache.check()
    assert not cache.cached and not cache.evictable and cache.lookup(text, 12) == 0
    assert len(cache.free) == 8 - len(cache.seqs[2].table)
    cache.release(2)
    assert cache.free_blocks == 8
    cache.check()
