"""The native decoder against transformers, and the paged forward against itself.

Tiny random checkpoints written by transformers (Llama with GQA, tied and untied; Qwen2
with q/k/v bias; Llama with llama3 rope scaling), norm weights and biases randomised so
that a swapped or ignored vector shows. Two native paths are checked: `reference_forward`
(no cache) and `Decoder.forward` over a paged cache whose block tables are scattered.
Batches here are built by hand from the cache API, independently of the scheduler.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import hf_logits, make_tiny_hf

from specbuild.formats.checkpoints import read_hf_dir, to_runtime_layout
from specbuild.model.kv_cache import PagedKVCache
from specbuild.model.decoder import Decoder, ForwardBatch, reference_forward

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
VARIANTS = {
    "llama-gqa": dict(arch="llama", heads=4, kv_heads=2, tie=False),
    "llama-tied-mqa": dict(arch="llama", heads=4, kv_heads=1, tie=True),
    "qwen2-bias": dict(arch="qwen2", heads=4, kv_heads=2, tie=False),
    "llama3-rope": dict(arch="llama", heads=4, kv_heads=2, tie=False, rope_scaling=LLAMA3_SCALING),
}
PROMPT_LEN = 96  # past original_max_position_embeddings, so llama3 scaling matters
HF_TOL = 1e-4
SELF_TOL = 1e-5


def randomize_vectors(path: str, seed: int = 1) -> None:
    """Give every 1-D tensor (norm weights, q/k/v biases) random values in place."""
    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if t.dim() == 1:
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            tensors[name] = (1.0 + 0.3 * noise if name.endswith("norm.weight") else 0.5 * noise).to(t.dtype)
    save_file(tensors, file, metadata={"format": "pt"})


_BUILT: dict[str, tuple] = {}


def build_variant(name: str, tmp_path_factory) -> tuple:
    """(name, hf_dir, config, float32 runtime weights, prompt ids, transformers' logits)."""
    if name in _BUILT:
        return _BUILT[name]
    path = make_tiny_hf(str(tmp_path_factory.mktemp(name)), scale=5.0, **VARIANTS[name])
    randomize_vectors(path)
    ckpt = read_hf_dir(path)
    weights = to_runtime_layout(ckpt, torch.float32)
    ids = torch.randint(3, ckpt.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(path, ids.tolist())  # [T, vocab]
    assert ref.std() > 0.5, "logits too flat for the tolerance to mean anything"
    _BUILT[name] = (name, path, ckpt.config, weights, ids, ref)
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    return build_variant(request.param, tmp_path_factory)


# ---- hand-built paged batches ------------------------------------------------------------

def forward_parts(decoder: Decoder, cache: PagedKVCache, parts: list[tuple[int, torch.Tensor]],
                  mask_none: bool = False) -> list[torch.Tensor]:
    """One forward over `parts` = [(seq_id, new token ids [n])], each continuing its own
    cached sequence. Returns logits [n, vocab] per part; commits the new lengths."""
    ids, pos, wslots, rslots, blocks = [], [], [], [], []
    t = s = 0
    for sid, toks in parts:
        if sid not in cache.seqs:
            cache.add(sid)
        past, n = cache.length(sid), len(toks)
        cache.reserve(sid, past + n)
        slots = cache.slots(sid, 0, past + n)
        ids.append(toks)
        pos.append(torch.arange(past, past + n))
        wslots.append(slots[past:])
        rslots.append(slots)
        blocks.append((t, s, past, n))
        t += n
        s += past + n
    mask = torch.zeros(t, s, dtype=torch.bool)
    for r0, c0, past, n in blocks:
        mask[r0:r0 + n, c0:c0 + past] = True
        mask[r0:r0 + n, c0 + past:c0 + past + n] = torch.ones(n, n, dtype=torch.bool).tril()
    batch = ForwardBatch(torch.cat(ids), torch.cat(pos), torch.cat(wslots), torch.cat(rslots),
                         None if mask_none else mask, torch.arange(t))
    logits = decoder.forward(batch, cache).logits  # [T, vocab]
    assert logits.shape == (t, decoder.config.vocab_size)
    for sid, toks in parts:
        cache.set_length(sid, cache.length(sid) + len(toks))
    out, r = [], 0
    for _, toks in parts:
        out.append(logits[r:r + len(toks)])
        r += len(toks)
    return out


def scattered_cache(decoder: Decoder, block_size: int = 4) -> PagedKVCache:
    """A cache whose free list is shuffled, so block tables are never contiguous."""
    cache = decoder.new_cache(num_blocks=128, block_size=block_size)
    gen = torch.Generator().manual_seed(3)
    cache.free = [cache.free[i] for i in torch.randperm(len(cache.free), generator=gen).tolist()]
    return cache


# ---- against transformers ---------------------------------------------------------------

def test_reference_forward_matches_transformers(variant):
    name, _, config, weights, ids, ref = variant
    got = reference_forward(config, weights, ids)
    assert (got - ref).abs().max() <= HF_TOL, name


def test_paged_decoder_matches_transformers(variant):
    name, _, config, weights, ids, ref = variant
    decoder = Decoder(config, weights, max_seq_len=256)
    cache = scattered_cache(decoder)
    (got,) = forward_parts(decoder, cache, [(1, ids)])
    table = cache.seqs[1].table
    assert any(b != a + 1 for a, b in zip(table, table[1:])), "blocks should be scattered"
    assert (got - ref).abs().max() <= HF_TOL, name


def test_llama3_scaling_is_applied(tmp_path_factory):
    """The rope-scaling variant must differ from the same weights without scaling."""
    name, _, config, weights, ids, ref = build_variant("llama3-rope", tmp_path_factory)
    assert config.rope_scaling["rope_type"] == "llama3"
    unscaled = reference_forward(dataclasses.replace(config, rope_scaling=None), weights, ids)
    assert (unscaled - ref).abs().max() > 100 * HF_TOL


def test_qwen2_biases_matter(tmp_path_factory):
    name, _, config, weights, ids, ref = build_variant("qwen2-bias", tmp_path_factory)
    assert config.attn_bias and config.architecture == "qwen2"
    no_bias = {k: (torch.zeros_like(v) if k.endswith("qkv_bias") else v) for k, v in weights.items()}
    assert (reference_forward(config, no_bias, ids) - ref).abs().max() > 100 * HF_TOL


# ---- the paged forward against itself ---------------------------------------------------

@pytest.mark.parametrize("splits", [(48, 48), (17, 40, 39), (1, 94, 1)])
def test_chunked_prefill_equals_one_forward(variant, splits):
    _, _, config, weights, ids, _ = variant
    decoder = Decoder(config, weights, max_seq_len=256)
    (whole,) = forward_parts(decoder, scattered_cache(decoder), [(1, ids)])
    cache = scattered_cache(decoder, block_size=8)
    chunks, start = [], 0
    for n in splits:
        chunks += forward_parts(decoder, cache, [(7, ids[start:start + n])])
        start += n
    assert start == len(ids) and cache.length(7) == len(ids)
    assert (torch.cat(chunks) - whole).abs().max() <= SELF_TOL


def test_ragged_batch_equals_separate_forwards(variant):
    """Decode tokens of two sequences, a fresh prefill chunk and a 3-token continuation
    (a verify window) in one forward give the rows of four separate forwards."""
    _, _, config, weights, ids, _ = variant
    decoder = Decoder(config, weights, max_seq_len=256)
    history = {1: ids[:20], 2: ids[30:37], 4: ids[50:59]}
    new = {1: ids[20:21], 3: ids[60:72], 2: ids[37:38], 4: ids[59:62]}
    caches = []
    for _ in range(2):
        cache = scattered_cache(decoder)
        for sid, toks in history.items():
            forward_parts(decoder, cache, [(sid, toks)])
        caches.append(cache)
    alone = {sid: forward_parts(decoder, caches[0], [(sid, toks)])[0] for sid, toks in new.items()}
    together = forward_parts(decoder, caches[1], list(new.items()))
    for (sid, _), rows in zip(new.items(), together):
        assert rows.shape == alone[sid].shape
        assert (rows - alone[sid]).abs().max() <= SELF_TOL, f"sequence {sid}"
    # and every row equals the cache-free reference on the sequence's whole text
    for sid, rows in zip(new, together):
        text = torch.cat([history.get(sid, ids[:0]), new[sid]])
        ref = reference_forward(config, weights, text)[-len(new[sid]):]
        assert (rows - ref).abs().max() <= SELF_TOL * 10, f"sequence {sid}"
    # the K/V written by the batched forward equals the K/V of the separate ones
    for sid in new:
        n = caches[0].length(sid)
        assert caches[1].length(sid) == n
        k0 = caches[0].rows(caches[0].slots(sid, 0, n))[0]
        k1 = caches[1].rows(caches[1].slots(sid, 0, n))[0]
        assert (k0 - k1).abs().max() <= SELF_TOL


def test_single_decode_row_without_mask(variant):
    """The scheduler passes mask=None for a lone decode token: everything visible."""
    _, _, config, weights, ids, _ = variant
    decoder = Decoder(config, weights, max_seq_len=256)
    caches = [scattered_cache(decoder), scattered_cache(decoder)]
    for cache in caches:
        forward_parts(decoder, cache, [(1, ids[:40])])
    (masked,) = forward_parts(decoder, caches[0], [(1, ids[40:41])])
    (unmasked,) = forward_parts(decoder, caches[1], [(1, ids[40:41])], mask_none=True)
    assert torch.equal(masked, unmasked)


def test_logit_rows_and_hidden(variant):
    _, _, config, weights, ids, ref = variant
    decoder = Decoder(config, weights, max_seq_len=256)
    cache = decoder.new_cache(num_blocks=32, block_size=16)
    cache.add(1)
    t = 33
    cache.reserve(1, t)
    slots = cache.slots(1, 0, t)
    rows = torch.tensor([0, 17, 32])
    batch = ForwardBatch(ids[:t], torch.arange(t), slots, slots, torch.ones(t, t, dtype=torch.bool).tril(), rows)
    out = decoder.forward(batch, cache, return_hidden=True)
    logits, hidden = out.logits, out.hidden
    assert logits.shape == (3, config.vocab_size) and hidden.shape == (3, config.hidden_size)
    assert (logits - ref[rows]).abs().max() <= HF_TOL
    lm_head = weights.get("lm_head", weights["embed"])
    assert (hidden @ lm_head.T - logits).abs().max() <= SELF_TOL


def test_row_invariant_attention_equals_each_row_alone():
    """paged_attention_rows: a row of a chain or tree verify gets bit for bit what a one-row
    decode over its visible keys gets (what half-precision bundles need to stay lossless)."""
    from specbuild.model.attention import paged_attention, paged_attention_rows, visible_columns

    g = torch.Generator().manual_seed(7)
    slots, heads, kv, d = 64, 6, 2, 16
    k_cache = torch.randn(slots, kv, d, generator=g).bfloat16()
    v_cache = torch.randn(slots, kv, d, generator=g).bfloat16()
    read = torch.randperm(slots, generator=g)[:40]
    ctx, t = 35, 5
    q = torch.randn(t, heads, d, generator=g).bfloat16()
    chain = torch.zeros(t, 40, dtype=torch.bool)
    chain[:, :ctx] = True
    chain[:, ctx:] = torch.ones(t, t, dtype=torch.bool).tril()
    tree = chain.clone()
    tree[3, ctx + 1:ctx + 3] = False  # node 3 hangs off node 0: it sees context, node 0 and itself
    for mask in (chain, tree):
        cols = visible_columns(mask)
        out = paged_attention_rows(q, k_cache, v_cache, read, cols, 0.25)
        for i in range(t):
            visible = read[mask[i].nonzero().squeeze(1)]
            alone = paged_attention(q[i:i + 1], k_cache, v_cache, visible, None, 0.25)
            assert torch.equal(out[i:i + 1], alone), i
    assert visible_columns(chain)[:2] == [ctx + 1, ctx + 2] and not isinstance(visible_columns(tree)[3], int)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batched_invariant_attention_gives_each_row_its_alone_bits(dtype):
    """paged_attention_invariant (one call per sequence): every row of a chain verify, a tree
    verify and a two-sequence batch, at widths 5 and 17 and contexts on both sides of a key
    chunk, gets bit for bit what a one-row decode step over its visible keys (in position
    order) gets, and agrees with the float64 reference."""
    from specbuild.model.attention import INVARIANT_CHUNK, InvariantPlan, paged_attention_invariant, \
        paged_attention_reference

    g = torch.Generator().manual_seed(11)
    heads, kv, d = 6, 2, 16
    for ctx in (3, INVARIANT_CHUNK - 2, INVARIANT_CHUNK, 2 * INVARIANT_CHUNK + 5):
        slots = 2 * (ctx + 20)
        k_cache = torch.randn(slots, kv, d, generator=g).to(dtype)
        v_cache = torch.randn(slots, kv, d, generator=g).to(dtype)
        for t in (5, 17):
            read = torch.randperm(slots, generator=g)[:2 * (ctx + t)]
            q = torch.randn(2 * t, heads, d, generator=g).to(dtype)
            chain = torch.zeros(t, ctx + t, dtype=torch.bool)
            chain[:, :ctx] = True
            chain[:, ctx:] = torch.ones(t, t, dtype=torch.bool).tril()
            tree = chain.clone()
            tree[3, ctx + 1:ctx + 3] = False  # node 3 hangs off node 0
            tree[4, ctx + 1:ctx + 4] = False  # node 4 too
            two = torch.zeros(2 * t, 2 * (ctx + t), dtype=torch.bool)  # two sequences side by side
            two[:t, :ctx + t], two[t:, ctx + t:] = chain, tree
            for mask in (chain, tree, two):
                rows, cols = mask.shape
                out = paged_attention_invariant(q[:rows], k_cache, v_cache, InvariantPlan(mask, read[:cols], rows), 0.25)
                ref = paged_attention_reference(q[:rows], k_cache, v_cache, read[:cols], mask, 0.25)
                assert (out.float() - ref.float()).abs().max() <= (2e-2 if dtype == torch.bfloat16 else 1e-5)
                for i in range(rows):
                    visible = read[:cols][mask[i].nonzero().squeeze(1)]
                    alone = paged_attention_invariant(q[i:i + 1], k_cache, v_cache, InvariantPlan(None, visible, 1), 0.25)
                    assert torch.equal(out[i:i + 1], alone), (ctx, t, i)


def test_row_invariance_is_on_exactly_for_half_precision_activations():
    from specbuild.compiler.quantize import quantize_int8
    from specbuild.model.decoder import row_invariant_needed
    from specbuild.model.qlinear import Int8Format, QLinear

    w32 = {"embed": torch.zeros(4, 4), "layers.0.qkv": torch.zeros(4, 4)}
    assert not row_invariant_needed(w32, torch.float32)
    assert row_invariant_needed({k: v.bfloat16() for k, v in w32.items()}, torch.bfloat16)
    q = QLinear(Int8Format(*quantize_int8(torch.randn(8, 16)), torch.bfloat16), torch.float32)
    assert row_invariant_needed({**w32, "layers.0.o": q}, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rms_norm_keeps_the_bits_of_the_spelled_out_formula(dtype):
    """decoder.rms_norm runs F.rms_norm (one op): it must give exactly what the five-op
    float32 formula (HF's: normalise in float32, cast, then scale) gives, at any width."""
    from specbuild.model.decoder import rms_norm

    g = torch.Generator().manual_seed(4)
    w = torch.randn(576, generator=g).to(dtype)
    for t in (1, 5, 17):
        x = (torch.randn(t, 576, generator=g) * 3).to(dtype)
        xf = x.float() if dtype != torch.float64 else x
        spelled = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        got = rms_norm(x, w, 1e-5)
        if dtype == torch.float64:  # rms_norm normalises in float32 (as before): close, not equal
            assert torch.allclose(got, spelled, atol=1e-5)
        else:
            assert torch.equal(got, spelled), (dtype, t)


def test_shared_key_products_keep_matmuls_bits_without_its_copies():
    """attention.shared_matmul (wide prefill and verify chunks over shared keys) gives bit for
    bit what torch.matmul's broadcast gives, for the score and the value products."""
    from specbuild.model.attention import shared_matmul

    g = torch.Generator().manual_seed(9)
    for n, nc in ((16, 1), (40, 3), (70, 2)):
        q = torch.randn(n, 3, 1, 3, 64, generator=g)
        k = torch.randn(1, 3, nc, 64, 128, generator=g)
        assert torch.equal(shared_matmul(q, k), torch.matmul(q, k))
        p = torch.rand(n, 3, nc, 3, 128, generator=g)
        v = torch.randn(1, 3, nc, 128, 64, generator=g)
        assert torch.equal(shared_matmul(p, v), torch.matmul(p, v))


@pytest.mark.parametrize("t", [20, 45])
def test_wide_invariant_attention_rows_equal_their_decode_step(t):
    """A prefill-wide chunk (through shared_matmul) still gives every row the bits of its one-row
    decode step, across a key-chunk boundary, in bfloat16."""
    from specbuild.model.attention import INVARIANT_CHUNK, InvariantPlan, paged_attention_invariant

    g = torch.Generator().manual_seed(12)
    heads, kv, d, ctx = 6, 2, 16, INVARIANT_CHUNK - 10
    slots = ctx + t + 8
    k_cache = torch.randn(slots, kv, d, generator=g).bfloat16()
    v_cache = torch.randn(slots, kv, d, generator=g).bfloat16()
    read = torch.randperm(slots, generator=g)[:ctx + t]
    q = torch.randn(t, heads, d, generator=g).bfloat16()
    mask = torch.zeros(t, ctx + t, dtype=torch.bool)
    mask[:, :ctx] = True
    mask[:, ctx:] = torch.ones(t, t, dtype=torch.bool).tril()
    out = paged_attention_invariant(q, k_cache, v_cache, InvariantPlan(mask, read, t), 0.25)
    for i in range(t):
        visible = read[mask[i].nonzero().squeeze(1)]
        alone = paged_attention_invariant(q[i:i + 1], k_cache, v_cache, InvariantPlan(None, visible, 1), 0.25)
        assert torch.equal(out[i:i + 1], alone), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_signed_rope_keeps_apply_ropes_bits(dtype):
    from specbuild.model.decoder import apply_rope, rope_signed, signed_sin

    g = torch.Generator().manual_seed(8)
    for t in (1, 5, 17):
        x = torch.randn(t, 12, 64, generator=g).to(dtype)
        cos, sin = torch.randn(t, 64, generator=g).to(dtype), torch.randn(t, 64, generator=g).to(dtype)
        assert torch.equal(rope_signed(x, cos.unsqueeze(1), signed_sin(sin).unsqueeze(1)), apply_rope(x, cos, sin))


def test_contiguous_slots_are_read_as_a_view_with_the_same_bits():
    from specbuild.model.attention import contiguous_range, gather_rows, paged_attention, paged_attention_rows

    assert contiguous_range(torch.arange(5, 12)) == (5, 12)
    assert contiguous_range(torch.tensor([5, 6, 8])) is None
    assert contiguous_range(torch.tensor([7, 6, 5])) is None  # a descending run is not a view
    assert contiguous_range(torch.tensor([3])) == (3, 4) and contiguous_range(torch.tensor([], dtype=torch.long)) is None
    torch.manual_seed(0)
    k, v = torch.randn(64, 2, 16), torch.randn(64, 2, 16)
    slots = torch.arange(10, 50)
    rng = contiguous_range(slots)
    view = gather_rows(k, slots, rng)
    assert view.data_ptr() == k[10].data_ptr() and torch.equal(view, k.index_select(0, slots))
    q = torch.randn(3, 4, 16)
    mask = torch.ones(3, 40, dtype=torch.bool).tril(37)
    assert torch.equal(paged_attention(q, k, v, slots, mask, 0.25, rng), paged_attention(q, k, v, slots, mask, 0.25))
    cols = [38, 39, 40]
    assert torch.equal(paged_attention_rows(q, k, v, slots, cols, 0.25, rng), paged_attention_rows(q, k, v, slots, cols, 0.25))


def test_rows_index_lists_each_rows_visible_slots_in_order():
    """attention.rows_index (numpy on the CPU): the rows' offsets, then row by row the read
    slots its mask shows, in column order; every slot for every row without a mask."""
    from specbuild.model.attention import rows_index

    gen = torch.Generator().manual_seed(3)
    read = torch.randperm(50, generator=gen)[:20]
    mask = torch.rand(4, 20, generator=gen) > 0.4
    mask[1] = False  # a row that sees nothing
    expected, offsets = [], [0]
    for t in range(4):
        expected += [int(read[j]) for j in range(20) if mask[t, j]]
        offsets.append(len(expected))
    got = rows_index(read, mask, 4)
    assert got.dtype == torch.int64 and got.tolist() == offsets + expected
    assert rows_index(read.to(torch.int32), None, 2).tolist() == [0, 20, 40] + read.tolist() * 2
