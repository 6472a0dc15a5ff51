"""Runtime linear formats: every fast path against its dequantise-then-matmul reference on
random inputs (odd shapes, every group size), dense copies that give the same numbers, the
decoder's dispatch (plain tensors unchanged), and the per-width format plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specbuild.compiler.quantize import quantize_int4, quantize_int8
from specbuild.model.qlinear import DenseFormat, FormatPlan, fit_line, Int4Format, Int8DynFormat, Int8Format, QLinear, as_dense, dequantize_int4, embed_rows, linear, measure_plan, pack_nibbles, self_check, to_kn_layout, unpack_nibbles, usable_formats, weight_nbytes

SHAPES = [(64, 64), (40, 96), (200, 160), (24, 256), (7, 64)]  # N, K: N not a multiple of 16 included


def rel_err(fast: torch.Tensor, ref: torch.Tensor) -> float:
    return float((fast.float() - ref.float()).abs().max() / (ref.float().abs().max() + 1e-30))


def int4_linear(n: int, k: int, group: int, act=torch.bfloat16, seed: int = 0) -> tuple[Int4Format, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    q, scales, zeros = quantize_int4(w, group, act)
    return Int4Format(pack_nibbles(q), scales, zeros, group, act), w


def test_nibbles_round_trip():
    q = torch.randint(0, 16, (5, 38), dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.shape == (5, 19) and torch.equal(unpack_nibbles(packed), q)
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)  # low nibble = even column


@pytest.mark.parametrize("n,k,group", [(n, k, g) for n, k in SHAPES for g in (32, 64, 128) if k % g == 0])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_int4_kernel_matches_reference(n, k, group, rows):
    impl, _ = int4_linear(n, k, group, seed=n + k + group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    fast, ref = impl(x), impl.reference(x)
    assert fast.shape == (rows, n) and fast.dtype == torch.bfloat16
    # the same math up to float32 summation order; outputs are rounded to bfloat16 (2^-8)
    assert rel_err(fast, ref) < 2 ** -7


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_int8_kernel_matches_reference(n, k, act):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k))
    q, scales = quantize_int8(w, act)
    impl = Int8Format(q, scales, act)
    for rows in (1, 4, 17):
        x = torch.randn(rows, k).to(act)
        assert rel_err(impl(x), impl.reference(x)) < (2 ** -7 if act == torch.bfloat16 else 1e-5)


def test_int4_with_float32_activations_and_identity_reads_back_the_weights():
    impl, _ = int4_linear(48, 128, 32, act=torch.float32)
    eye = torch.eye(128)
    assert torch.equal(impl(eye).t(), impl.dense())  # one rounding per weight, as the reference


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_quantization_error_bound(group):
    w = torch.randn(96, 256)
    q, scales, zeros = quantize_int4(w, group, torch.bfloat16)
    err = (dequantize_int4(q, scales, zeros, group) - w).abs()
    step = scales.repeat_interleave(group, 1)
    # half a step, plus the zero's bfloat16 rounding (half an ulp of |zero|)
    bound = step / 2 + zeros.abs().repeat_interleave(group, 1) * 2 ** -8 + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.mean()) < float(step.mean()) / 3


def test_int8_quantization_error_bound():
    w = torch.randn(33, 70) * torch.linspace(0.1, 3, 33).unsqueeze(1)
    q, scales = quantize_int8(w, torch.bfloat16)
    err = (q.float() * scales.unsqueeze(1) - w).abs()
    amax = w.abs().amax(1, keepdim=True)
    assert bool((err <= amax / 127 * 0.51 + amax * 2 ** -8).all())


def test_constant_groups_quantize_exactly():
    w = torch.zeros(16, 64)
    w[3] = 0.5
    q, scales, zeros = quantize_int4(w, 32, torch.bfloat16)
    assert torch.equal(dequantize_int4(q, scales, zeros, 32), w)


def test_dense_copies_give_the_primary_numbers():
    rounded = QLinear(int4_linear(80, 128, 32)[0], torch.float32)  # bfloat16 inputs and outputs
    rounded.add_copy("float32")
    assert not rounded.exact["float32"] and usable_formats([rounded]) == ["int4"]  # ulp flips between widths
    impl, _ = int4_linear(80, 128, 32, act=torch.float32)
    q = QLinear(impl, torch.float32)
    q.add_copy("float32")
    q.add_copy("bfloat16")
    assert q.exact["float32"] and not q.exact["bfloat16"]
    x = torch.randn(6, 128)
    a, b = q(x, "int4"), q(x, "float32")
    assert a.dtype == torch.float32 and rel_err(a, b) < 2 ** -7
    assert usable_formats([q]) == ["int4", "float32"]
    assert usable_formats([q], allow_inexact=True) == ["int4", "float32", "bfloat16"]
    assert self_check(q) < 2 ** -6


def test_qlinear_rows_bytes_and_dense():
    impl, _ = int4_linear(32, 64, 32)
    q = QLinear(impl, torch.float32)
    ids = torch.tensor([3, 0, 31])
    assert torch.equal(embed_rows(q, ids), q.dense()[ids])
    assert torch.equal(as_dense(q), q.dense())
    assert weight_nbytes(q) == 32 * 32 + 2 * 2 * 32 * 2  # nibbles + bfloat16 scale/zero per group
    q8 = QLinear(Int8Format(*quantize_int8(torch.randn(10, 64)), torch.bfloat16), torch.bfloat16)
    assert torch.equal(embed_rows(q8, ids[:2]), q8.dense()[ids[:2]].bfloat16())
    dense = QLinear(DenseFormat(torch.randn(10, 64).bfloat16(), torch.bfloat16), torch.float32)
    assert dense(torch.randn(2, 64)).dtype == torch.float32 and weight_nbytes(dense) == 10 * 64 * 2


def test_dispatch_leaves_plain_tensors_to_f_linear():
    w, b, x = torch.randn(12, 8, dtype=torch.float64), torch.randn(12, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(linear(x, w, "int4", b), F.linear(x, w, b))
    impl, _ = int4_linear(16, 64, 32)
    q = QLinear(impl, torch.float32)
    bias = torch.randn(16)
    x = torch.randn(2, 64)
    assert torch.equal(linear(x, q, None, bias), q(x) + bias)


def test_plan_picks_the_cheapest_format_per_width():
    # int4 = 0.5 + 0.75 w, float32 = 2.5 + 0.0625 w: they cross at w = 2.9
    costs = {"int4": {1: 1.25, 2: 2.0, 4: 3.5, 8: 6.5}, "float32": {1: 2.5625, 2: 2.625, 4: 2.75, 8: 3.0}}
    plan = FormatPlan.from_costs(costs, max_width=64)
    assert plan.bounds == (2, 64) and plan.formats == ("int4", "float32")
    assert [plan.choose(w) for w in (1, 2, 3, 8, 100)] == ["int4", "int4", "float32", "float32", "float32"]
    assert plan.describe() == "int4 for widths 1-2, float32 for widths 3-64 and wider"
    noisy = {f: dict(c) for f, c in costs.items()}
    noisy["float32"][2] = 1.0  # one disturbed sample does not give width 2 to float32
    assert FormatPlan.from_costs(noisy, max_width=64).choose(2) == "int4"
    assert fit_line({3: 7.0}) == (7.0, 0.0) and fit_line({1: 3.0, 3: 2.0}) == (2.5, 0.0)  # slopes >= 0
    with pytest.raises(ValueError):
        FormatPlan((4, 2), ("a", "b"))


def test_unaligned_weights_are_copied_before_the_kernels():
    """safetensors maps tensors at any byte offset; torch's int8 kernel crashed on those."""
    buf = torch.randint(-127, 128, (320 * 64 + 8,), dtype=torch.int8)
    weight = buf[8:].view(320, 64)  # 8 bytes past an aligned start
    impl = Int8Format(weight, torch.rand(320), torch.bfloat16)
    assert impl.qweight.data_ptr() % 64 == 0
    x = torch.randn(4, 64).bfloat16()
    assert rel_err(impl(x), impl.reference(x)) < 2 ** -7


def test_measured_plan_uses_only_exact_copies():
    impl, _ = int4_linear(64, 128, 32, act=torch.float32)
    q = QLinear(impl, torch.float32)
    assert measure_plan([q], [1, 4]) is None  # one format: nothing to choose
    q.add_copy("bfloat16")
    assert measure_plan([q], [1, 4]) is None  # the bfloat16 copy rounds the weights
    q.add_copy("float32")
    plan = measure_plan([q], [1, 4], repeats=1)
    assert set(plan.formats) <= {"int4", "float32"} and set(plan.costs_ms) == {"int4", "float32"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA int4 kernel needs a GPU")
def test_int4_cuda_kernel_matches_reference():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=gen)
    q, scales, zeros = quantize_int4(w, 64, torch.bfloat16)
    impl = Int4Format(pack_nibbles(q).cuda(), scales.cuda(), zeros.cuda(), 64, torch.bfloat16)
    x = torch.randn(5, 512, device="cuda").bfloat16()
    assert rel_err(impl(x), impl.reference(x)) < 2 ** -6


def test_lm_head_rescoring_is_exact_at_the_top_and_width_invariant():
    w = torch.randn(500, 96, generator=torch.Generator().manual_seed(5))
    # torch's int8 kernel: the rescoring path (specbuild's returns its float32 sums, next test)
    head = QLinear(Int8Format(*quantize_int8(w, torch.bfloat16), torch.bfloat16, kernel=False), torch.float32)
    head.rescore_top = 16
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(6))
    logits = head(x)
    assert logits.dtype == torch.float32
    exact = x.bfloat16().double() @ head.dense().double().T  # [7, 500]
    top = exact.topk(3, dim=-1).indices
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    assert float((logits.gather(1, top).double() - exact.gather(1, top)).abs().max()) < 1e-4
    bf16_only = head.formats["int8"](x.bfloat16()).float()
    assert float((bf16_only.gather(1, top).double() - exact.gather(1, top)).abs().max()) > 1e-3  # what it fixes
    for t in range(1, 7):  # a row's logits do not depend on the rows beside it
        assert torch.equal(head(x[t:t + 1]), logits[t:t + 1])


def test_lm_head_on_specbuilds_int8_kernel_returns_its_float32_sums():
    """With specbuild's int8 kernel the lm_head returns the kernel's float32 sums of the rounded
    inputs (no top-k rescoring): rounded to bfloat16 they are the kernel's bfloat16 output, the
    greedy token is the exact one's, and a row's logits do not depend on the rows beside it."""
    w = torch.randn(700, 96, generator=torch.Generator().manual_seed(7))
    impl = Int8Format(*quantize_int8(w, torch.bfloat16), torch.bfloat16)
    if not impl.float_sums:
        pytest.skip("specbuild's CPU kernel is not available here (no compiler or no AVX2)")
    head = QLinear(impl, torch.float32)
    head.rescore_top = 16
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(8))
    logits = head(x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits.bfloat16(), impl(x.bfloat16()))  # the same sums, unrounded
    exact = x.bfloat16().double() @ head.dense().double().T
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    assert float(((logits.double() - exact).abs() / exact.abs().clamp_min(1)).max()) < 1e-5  # float32, everywhere
    for t in range(9):
        assert torch.equal(head(x[t:t + 1]), logits[t:t + 1])
    assert torch.equal(head(x.flip(0)), logits.flip(0))


def test_plan_does_not_extrapolate_a_format_measured_only_narrow():
    costs = {"float32": {1: 10.0, 4: 11.0, 16: 14.0}, "int4": {1: 300.0}}  # int4 dropped after width 1
    plan = FormatPlan.from_costs(costs, max_width=64)
    assert plan.formats == ("float32",)


def test_kn_layout_keeps_shapes_and_values_and_moves_only_linears():
    g = torch.Generator().manual_seed(3)
    w = {"embed": torch.randn(50, 16, generator=g), "layers.0.qkv": torch.randn(48, 16, generator=g),
         "layers.0.down": torch.randn(16, 40, generator=g), "layers.0.attn_norm": torch.randn(16, generator=g),
         "norm": torch.randn(16, generator=g)}
    before = {k: v.clone() for k, v in w.items()}
    assert to_kn_layout(w) == 3
    for k, v in w.items():
        assert v.shape == before[k].shape and torch.equal(v, before[k])
    for k in ("embed", "layers.0.qkv", "layers.0.down"):  # stored [K, N]: the view's strides are (1, N)
        assert w[k].stride() == (1, w[k].shape[0]) and w[k].t().is_contiguous()
    assert w["norm"].is_contiguous() and w["layers.0.attn_norm"].is_contiguous()
    x = torch.randn(5, 16, generator=g)
    assert torch.allclose(F.linear(x, w["layers.0.qkv"]), F.linear(x, before["layers.0.qkv"]), atol=1e-5)
    ids = torch.tensor([0, 49, 7])
    assert torch.equal(embed_rows(w["embed"], ids), before["embed"][ids])


def test_kn_dense_copy_is_exact_and_named():
    impl, _ = int4_linear(48, 64, 32, act=torch.float32)
    q = QLinear(impl, torch.float32)
    q.add_copy("float32.kn")
    assert q.exact["float32.kn"] and q.formats["float32.kn"].name == "float32.kn"
    x = torch.randn(7, 64)
    assert rel_err(q(x, "float32.kn"), q(x, "int4")) < 2 ** -12


def test_lm_head_rescoring_with_no_rows():
    """A prefill chunk asks for no logits: a rescored (half-precision) lm_head returns [0, N]."""
    q = QLinear(Int8Format(*quantize_int8(torch.randn(40, 64)), torch.bfloat16), torch.float32)
    q.rescore_top = 8
    out = q(torch.zeros(0, 64))
    assert out.shape == (0, 40)


@pytest.mark.parametrize("n,k", [(96, 64), (576, 1536), (1024, 576)])
def test_int8_dynamic_activations_are_per_row_and_bit_identical_in_any_batch(n, k):
    """W8A8 (per-row int8 inputs, torch._int_mm): a row's output is the same bits alone or
    inside a batch of 5 or 17 (the other rows, even one 1000x larger, change nothing), and
    equals the int64 reference exactly."""
    g = torch.Generator().manual_seed(n + k)
    fmt = Int8DynFormat(*quantize_int8(torch.randn(n, k, generator=g) * 0.05, torch.float32))
    q = QLinear(fmt, torch.float32)
    assert q.quantizes_inputs and q.primary == "int8-a8" and q.act_dtype == torch.float32
    for rows in (5, 17):
        x = torch.randn(rows, k, generator=g)
        x[-1] *= 1000.0  # a per-tensor scale would squash every other row
        batch = q(x)
        assert torch.equal(batch, fmt.reference(x))
        for i in range(rows):
            assert torch.equal(batch[i:i + 1], q(x[i:i + 1])), (rows, i)
    x = torch.randn(3, k, generator=g)
    dense = F.linear(x, fmt.dense())
    assert rel_err(q(x), dense) < 2e-2  # input rounding to 8 bits: small, not zero
    assert torch.equal(q(torch.zeros(2, k)), torch.zeros(2, n))  # an all-zero row has no scale to divide by


# ---- row-count invariance of half-precision linears (width_classes / rows_policy) ----------
def test_rows_policy_pads_or_chunks_to_stay_inside_one_kernel():
    from specbuild.model.qlinear import rows_policy

    assert rows_policy([1] * 64) == (1, 64)  # one kernel for every width
    assert rows_policy([1] + [2] * 63) == (2, 64)  # one row alone differs: pad single rows to two
    assert rows_policy([1] * 20 + [21] * 44) == (1, 20)  # widths 1-20 agree: cut wider calls at 20
    assert rows_policy([1, 2, 2] + [4] * 61) == (4, 64)  # float32's 1 / 2-3 / 4+ split: pad to 4
    assert rows_policy([1, 2] + [3] * 30 + [33] * 32) == (1, 1)  # no wide class: one row per call


@pytest.mark.parametrize("shape", [(64, 1536), (96, 576)])
def test_linear_under_its_measured_policy_gives_each_row_its_alone_bits(shape):
    """Whatever kernels this machine's oneDNN switches between (one row vs several at K = 1536
    on the development machine), a bfloat16 linear run under the measured (min, max) rows per
    call gives every row of a 1..70-row call the bits that row gets in a one-row forward
    under the same policy, on inputs whose exact products cancel (so any change of summation
    order shows through the bfloat16 rounding)."""
    from specbuild.model.qlinear import _probe_pair, rows_policy, width_classes

    policy = rows_policy(width_classes(shape, False, torch.bfloat16))
    w, x = _probe_pair(shape, False, torch.bfloat16, "cpu", True, 70, seed=5)
    alone = torch.cat([linear(x[i:i + 1], w, rows=policy) for i in range(70)])
    for t in (2, 3, 5, 9, 15, 17, 33, 64, 70):
        assert torch.equal(linear(x[:t], w, rows=policy), alone[:t]), (shape, policy, t)
    w2, x2 = _probe_pair(shape, False, torch.bfloat16, "cpu", False, 40, seed=6)  # plain random values too
    alone2 = torch.cat([linear(x2[i:i + 1], w2, rows=policy) for i in range(40)])
    assert torch.equal(linear(x2, w2, rows=policy), alone2)


def test_cancelling_probe_sees_summation_order_that_random_values_hide():
    """The probe's point: on cancelling inputs, two summation orders of the same products give
    different bits (float32 sums of a different association), where rounding to bfloat16
    hides most differences on random values. Checked without any kernel switch: one sum in
    two association orders."""
    from specbuild.model.qlinear import _probe_pair

    w, x = _probe_pair((8, 1536), False, torch.float32, "cpu", True, 4, seed=1)
    prod = x[:, None, :] * w[None, :, :]  # exact products, float32
    a = prod.sum(-1)  # one order
    b = prod.view(4, 8, 3, 512).sum(-1).sum(-1)  # blocks of 512, then their sum
    assert not torch.equal(a.bfloat16(), b.bfloat16())  # the order shows in bfloat16
    assert a.abs().max() < 1e-3 * prod.abs().sum(-1).max()  # what is left is rounding, not signal


def test_layouts_are_chosen_by_measurement_per_dtype():
    from specbuild.model.qlinear import choose_layouts

    g = torch.Generator().manual_seed(2)
    w = {"layers.0.qkv": torch.randn(48, 16, generator=g), "layers.0.down": torch.randn(16, 40, generator=g).bfloat16(),
         "norm": torch.randn(16, generator=g)}
    before = {k: v.clone() for k, v in w.items()}
    chosen = choose_layouts(w, {"float32": {"nk": 2.0, "kn": 1.0}, "bfloat16": {"nk": 1.0, "kn": 3.0}})
    assert chosen["float32"]["chosen"] == "kn" and chosen["bfloat16"]["chosen"] == "nk"
    assert not w["layers.0.qkv"].is_contiguous() and w["layers.0.qkv"].t().is_contiguous()  # float32 moved
    assert w["layers.0.down"].is_contiguous()  # bfloat16 kept as rows
    assert all(torch.equal(w[k], before[k]) for k in w)
    measured = choose_layouts(dict(before))  # a real measurement picks one of the two per dtype
    assert {c["chosen"] for c in measured.values()} <= {"nk", "kn"} and set(measured) == {"float32", "bfloat16"}
