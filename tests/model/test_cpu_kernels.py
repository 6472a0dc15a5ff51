"""specbuild's CPU int4/int8 kernels (model/cpu_kernels.py): against a float64 reference of
the dequantised weights, row invariance bit for bit across widths 1..17 and positions (every
ISA path this CPU runs), torch.compile calling them as opaque ops, the choice at load, the
fallback to torch's kernels when the extension cannot be built, and greedy speculation equal
to plain decoding with the kernel in use."""

from __future__ import annotations

import platform

import pytest
import torch

from specbuild.compiler.quantize import quantize_int4, quantize_int8
from specbuild.model import cpu_kernels
from specbuild.model.qlinear import Int4Format, Int8Format, dequantize_int4, pack_nibbles

from kernel_skip import kernels_or_skip

X86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(not X86, reason="specbuild's CPU kernels are x86-64 only")


def levels() -> list[int]:
    kernels_or_skip()
    st = cpu_kernels.status()
    # 3: the AVX-512 BF16 int4 path with its prefetch further ahead (int8 runs it as 2); 4: the
    # AVX-512 fp32 multiply-add int4 path for bfloat16 inputs (float32 inputs and int8 run the
    # CPU's own best path for it)
    return [lv for lv in (1, 2, 3) if min(lv, 2) <= st["isa"]] + [4] * cpu_kernels.has_isa4()


@pytest.fixture
def forced(monkeypatch):
    """Every int4/int8 format built in the test runs specbuild's kernel (not a measured choice)."""
    monkeypatch.setenv("SPECBUILD_CPU_KERNEL", "specbuild")
    cpu_kernels.reset_choices()
    yield
    cpu_kernels.reset_choices()


def int4_case(n, k, group, act, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, scales, zeros = quantize_int4(torch.randn(n, k, generator=gen), group, act)
    w64 = dequantize_int4(q, scales, zeros, group).double()
    return q, scales, zeros, w64


@pytest.mark.parametrize("n,k,group", [(40, 96, 32), (200, 256, 64), (7, 128, 128), (576, 576, 32)])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_int4_matches_a_float64_reference(n, k, group, act):
    q, scales, zeros, w64 = int4_case(n, k, group, act, seed=n + k)
    x = torch.randn(9, k).to(act)
    ref = x.double() @ w64.T
    for level in levels():
        packed = cpu_kernels.repack_int4(q, scales, zeros, group, act != torch.bfloat16)
        out = cpu_kernels.int4_mm(x, packed, n, group, act != torch.bfloat16, level)
        assert out.dtype == act and out.shape == (9, n)
        err = float((out.double() - ref).abs().max() / ref.abs().max())
        # bfloat16 outputs are rounded to 8 bits; float32 ones only by summation order
        assert err < (2 ** -7 if act == torch.bfloat16 else 1e-5), (level, err)


@pytest.mark.parametrize("n,k", [(40, 96), (200, 257), (49152 // 64, 576)])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_int8_matches_a_float64_reference(n, k, act):
    q, scales = quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(k)), act)
    ref_w = q.double() * scales.double().unsqueeze(1)
    x = torch.randn(5, k).to(act)
    ref = x.double() @ ref_w.T
    for level in levels():
        out = cpu_kernels.int8_mm(x, cpu_kernels.repack_int8(q, scales), n, level)
        err = float((out.double() - ref).abs().max() / ref.abs().max())
        assert err < (2 ** -7 if act == torch.bfloat16 else 1e-5), (level, err)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_rows_are_invariant_to_width_and_position(kind, act):
    """Each row of a call of w rows (w = 1..17, at every offset) equals that row computed alone,
    bit for bit: the kernels' tiles of 8/4/2/1 rows and 1..8 column blocks never change a row's
    arithmetic."""
    n, k = 72, 192
    x = torch.randn(17, k).to(act)
    if kind == "int4":
        q, scales, zeros, _ = int4_case(n, k, 32, act)
        packed = cpu_kernels.repack_int4(q, scales, zeros, 32, act != torch.bfloat16)
        def run(xs, level):
            return cpu_kernels.int4_mm(xs, packed, n, 32, act != torch.bfloat16, level)
    else:
        q, scales = quantize_int8(torch.randn(n, k), act)
        packed = cpu_kernels.repack_int8(q, scales)
        def run(xs, level):
            return cpu_kernels.int8_mm(xs, packed, n, level)
    for level in levels():
        alone = torch.cat([run(x[i:i + 1], level) for i in range(17)])
        for w in range(1, 18):
            for start in range(0, 17 - w + 1):
                assert torch.equal(run(x[start:start + w], level), alone[start:start + w]), (level, w, start)


def test_the_int8_paths_give_the_same_bits():
    """int8 level 2 runs one-row tiles through the AVX2 code, level 3 through the AVX-512 code
    (whichever is faster on the CPU is chosen at load); that is safe only because both do the
    same operations per output element: every level, every width, the same bits."""
    if 2 not in levels():
        pytest.skip("needs AVX-512 BF16")
    q, scales = quantize_int8(torch.randn(200, 577), torch.bfloat16)
    packed = cpu_kernels.repack_int8(q, scales)
    for act in (torch.bfloat16, torch.float32):
        x = torch.randn(17, 577).to(act)
        for width in (1, 3, 17):
            avx2 = cpu_kernels.int8_mm(x[:width], packed, 200, 1)
            for level in (2, 3):
                assert torch.equal(cpu_kernels.int8_mm(x[:width], packed, 200, level), avx2), (act, width, level)


def test_bad_inputs_name_the_value():
    levels()
    q, scales, zeros, _ = int4_case(32, 64, 32, torch.bfloat16)
    packed = cpu_kernels.repack_int4(q, scales, zeros, 32, False)
    with pytest.raises(RuntimeError, match="packed has"):
        cpu_kernels.int4_mm(torch.randn(2, 96).bfloat16(), packed, 32, 32, False, 1)
    with pytest.raises(RuntimeError, match="isa must be"):
        cpu_kernels.int4_mm(torch.randn(2, 64).bfloat16(), packed, 32, 32, False, 7)
    with pytest.raises(ValueError, match="group_size 12"):
        cpu_kernels.repack_int4(q, scales, zeros, 12, False)


def test_formats_run_the_kernel_and_compile_calls_it_as_an_opaque_op(forced):
    levels()
    q, scales, zeros, _ = int4_case(48, 128, 32, torch.bfloat16)
    int4 = Int4Format(pack_nibbles(q), scales, zeros, 32, torch.bfloat16)
    q8, s8 = quantize_int8(torch.randn(80, 48), torch.bfloat16)
    int8 = Int8Format(q8, s8, torch.bfloat16)
    assert int4.kernel and int8.kernel and int4.packed is None
    assert int4.nbytes == 48 * 128 // 2 + 48 * (128 // 32) * 2 * 2  # nibbles + a bf16 scale and zero per group

    def f(x):
        return int8(torch.nn.functional.silu(int4(x)[:, :48]))

    x = torch.randn(5, 128).bfloat16()
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(x), f(x))
    assert torch.equal(compiled(x[:3]), f(x[:3]))


def test_torch_mode_and_the_load_line(monkeypatch, capsys):
    monkeypatch.setenv("SPECBUILD_CPU_KERNEL", "torch")
    cpu_kernels.reset_choices()
    try:
        q, scales, zeros, _ = int4_case(48, 128, 32, torch.bfloat16)
        impl = Int4Format(pack_nibbles(q), scales, zeros, 32, torch.bfloat16)
        Int4Format(pack_nibbles(q), scales, zeros, 32, torch.bfloat16)
        assert impl.kernel == 0 and impl.packed is not None
        lines = [l for l in capsys.readouterr().err.splitlines() if "int4 linears" in l]
        assert lines == ["specbuild: int4 linears (bfloat16 inputs) run torch's kernel (SPECBUILD_CPU_KERNEL=torch)"]
    finally:
        cpu_kernels.reset_choices()


def test_without_a_compiler_the_formats_fall_back_to_torch(monkeypatch, tmp_path, capsys):
    """The extension cannot be built (no compiler, nothing built before): int4 and int8 run
    torch's kernels and still match their references; asking for specbuild's kernel is a
    clear error."""
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpu_kernels, "_choices", {})
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    monkeypatch.setenv("SPECBUILD_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("SPECBUILD_CPU_KERNEL", "auto")
    st = cpu_kernels.status()
    assert not st["available"] and "no C++ compiler" in st["reason"]
    q, scales, zeros, w64 = int4_case(40, 96, 32, torch.bfloat16)
    impl = Int4Format(pack_nibbles(q), scales, zeros, 32, torch.bfloat16)
    assert impl.kernel == 0
    x = torch.randn(3, 96).bfloat16()
    assert float((impl(x).double() - x.double() @ w64.T).abs().max()) < 0.05 * float((x.double() @ w64.T).abs().max())
    q8, s8 = quantize_int8(torch.randn(40, 96), torch.bfloat16)
    assert Int8Format(q8, s8, torch.bfloat16).kernel == 0
    assert "torch's kernel (no C++ compiler" in capsys.readouterr().err
    monkeypatch.setenv("SPECBUILD_CPU_KERNEL", "specbuild")
    monkeypatch.setattr(cpu_kernels, "_choices", {})
    with pytest.raises(cpu_kernels.KernelBuildError, match=r"no C\+\+ compiler"):
        cpu_kernels.choose("int4", torch.bfloat16)
    monkeypatch.setenv("SPECBUILD_CPU_KERNEL", "fastest")
    with pytest.raises(Exception, match="'fastest' is not one of auto, torch, specbuild, avx2"):
        cpu_kernels.choose("int8", torch.bfloat16)


def test_greedy_speculation_equals_plain_decoding_on_the_kernel(forced, tmp_path):
    from specbuild.compiler.compile import CompileOptions, compile_bundle
    from specbuild.engine.engine import Engine, EngineConfig
    from tiny import make_tiny_hf, perturbed_copy

    levels()
    target = make_tiny_hf(str(tmp_path / "target"), scale=4.0, seed=3)
    draft = perturbed_copy(target, str(tmp_path / "draft"), noise=0.08)
    bundle = compile_bundle(target, str(tmp_path / "int4"), CompileOptions(
        max_draft_len=8, dtype="float32", quantize="int4", lm_head_format="int8"), draft=draft)
    engine = Engine(bundle, EngineConfig(max_batch_size=4))
    qlinears = [v for v in engine.model.w.values() if hasattr(v, "formats")]
    assert qlinears and all(v.formats[v.primary].kernel for v in qlinears)
    assert_speculation_equals_plain(engine)


# ---- int4 weights x int8 input blocks (int4_q8_mm, the int4-a8 format) ------------------------
def q8_paths() -> list[int]:
    levels()  # fails when a compiler exists but the kernels did not build
    paths = cpu_kernels.q8_paths()
    assert 1 in paths, "every CPU that runs the kernels runs the AVX2 path"
    return paths


def q8_inputs(t, k, seed=0):
    """Rows with a wide dynamic range, a block of zeros and exact halves (ties of the rounding)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen) * torch.logspace(-3, 2, t).unsqueeze(1)
    x[0, :32] = 0.0
    x[1, :32] = 1e-44  # amax / 127 underflows to 0: the block is read as zeros
    if k >= 64:
        x[-1, 32:64] = torch.arange(32) - 15.5  # amax 16.5 -> d = 16.5 / 127; not all ties, some
    return x


def q8_reference_blocks(x):
    t, k = x.shape
    b = x.view(t, k // 32, 32)
    d = b.abs().amax(-1) / 127.0
    q = torch.where(d.unsqueeze(-1) > 0, torch.round(b / d.clamp_min(1e-38).unsqueeze(-1)).clamp(-127, 127),
                    torch.zeros_like(b))
    return q.view(t, k).to(torch.int8), d, q.sum(-1)


def q4_1_case(n, k, group, seed=0):
    """int4 weights as GGUF Q4_1 carries them: fp16 d and m per group (scale = d, zero = m + 8 d)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // group, generator=gen) * 0.02).half().float()
    m = (-torch.rand(n, k // group, generator=gen) * 0.15).half().float()
    return q, d, m + 8.0 * d, dequantize_int4(q, d, m + 8.0 * d, group).double()


def test_q8_quantize_is_the_documented_rounding():
    q8_paths()
    x = q8_inputs(7, 160)
    q, dx, qs = cpu_kernels.q8_quantize(x)
    rq, rd, rs = q8_reference_blocks(x)
    assert torch.equal(q, rq) and torch.equal(dx, rd) and torch.equal(qs, rs)
    assert int(q.abs().max()) == 127 and torch.equal(dx[0, 0], torch.tensor(0.0))
    assert torch.equal(cpu_kernels.q8_quantize(x.bfloat16())[0], q8_reference_blocks(x.bfloat16().float())[0])


def test_q8_quantize_splits_rows_without_changing_a_byte_and_passes_nan_over():
    """Calls of more than 8 rows quantise their rows on several threads: each row's bytes, scale
    and sum are those of the row quantised alone. A NaN does not take its block's scale: the
    largest |x| is taken over the other lanes (the NaN itself clamps to -127)."""
    q8_paths()
    x = q8_inputs(41, 1536, seed=3)
    x[5, 40] = float("nan")
    x[6, 64:96] = float("nan")  # a block of NaN only: scale 0, read as zeros
    q, dx, qs = cpu_kernels.q8_quantize(x)
    for t in range(41):
        qt, dt, st = cpu_kernels.q8_quantize(x[t:t + 1])
        assert torch.equal(q[t:t + 1], qt) and torch.equal(dx[t:t + 1], dt) and torch.equal(qs[t:t + 1], st), t
    rest = x[5, 32:64].clone()
    rest[8] = 0.0
    assert torch.equal(dx[5, 1], rest.abs().max() / 127.0) and int(q[5, 40]) == -127
    assert float(dx[6, 2]) == 0.0 and not q[6, 64:96].any()
    assert torch.equal(q[7:], q8_reference_blocks(x[7:])[0]) and torch.equal(dx[7:], q8_reference_blocks(x[7:])[1])


@pytest.mark.parametrize("n,k,group", [(40, 96, 32), (200, 256, 64), (7, 128, 128), (576, 576, 32), (33, 1536, 32)])
def test_int4_q8_matches_a_float64_reference_and_every_path_gives_the_same_bits(n, k, group):
    """Against float64 products of the int8 blocks (as dequantised values) and the dequantised
    weights: only the float32 epilogue rounds. AVX512-VNNI, the VNNI ymm paths and AVX2
    (maddubs) form the same integers and run the same epilogue: identical bits."""
    paths = q8_paths()
    x = q8_inputs(9, k, seed=k)
    rq, rd, _ = q8_reference_blocks(x)
    xd = (rq.double().view(9, -1, 32) * rd.double().unsqueeze(-1)).view(9, k)
    for case in (int4_case(n, k, group, torch.float32, seed=n + k), q4_1_case(n, k, group, seed=n)):
        q, scales, zeros, w64 = case
        ref = xd @ w64.T
        layouts = [False] + ([True] if cpu_kernels.q8_fp16_exact(scales, zeros) else [])
        outs = {}
        for f16 in layouts:
            packed = cpu_kernels.repack_int4_q8(q, scales, zeros, group, f16)
            assert packed.numel() == -(-n // 16) * 16 * (k // 2 + (k // group) * 2 * (2 if f16 else 4))
            for p in paths:
                outs[(f16, p)] = cpu_kernels.int4_q8_mm(x, packed, n, group, f16, p)
        for (f16, p), out in outs.items():
            assert out.dtype == torch.float32 and out.shape == (9, n)
            err = ((out.double() - ref).abs() / (ref.abs().amax(1, keepdim=True) + 1e-30)).max()
            assert float(err) < 2e-6, (f16, p, float(err))
            assert torch.equal(out, outs[(False, 1)]), f"path {cpu_kernels.Q8_PATHS[p]}, fp16 {f16} differs"
    assert len(layouts) == 2, "Q4_1 weights fit the fp16 layout"
    # bfloat16 inputs are read as their float32 values
    assert torch.equal(cpu_kernels.int4_q8_mm(x.bfloat16(), packed, n, group, True, paths[-1]).float(),
                       cpu_kernels.int4_q8_mm(x.bfloat16().float(), packed, n, group, True, paths[-1]).bfloat16().float())


def test_int4_q8_rows_are_invariant_to_width_and_position():
    """Each row of a call of w rows (w = 1..17, at every offset) equals that row computed alone,
    bit for bit, on every path this CPU runs (tiles of 1-8 rows on the VNNI-512 paths, 2/1 on the
    VNNI ymm ones, 1-4 on plain AVX2: both halves at once in calls of up to 4 rows, one half at a
    time in wider ones; and 1..4 column blocks)."""
    paths = q8_paths()
    n, k = 88, 192  # 6 column blocks: full and partial units of 4
    x = q8_inputs(17, k, seed=5)
    for f16 in (False, True):
        q, scales, zeros, _ = q4_1_case(n, k, 32) if f16 else int4_case(n, k, 32, torch.float32)
        packed = cpu_kernels.repack_int4_q8(q, scales, zeros, 32, f16)
        alone = torch.cat([cpu_kernels.int4_q8_mm(x[i:i + 1], packed, n, 32, f16, 1) for i in range(17)])
        for p in paths:
            for w in range(1, 18):
                for start in range(0, 17 - w + 1):
                    got = cpu_kernels.int4_q8_mm(x[start:start + w], packed, n, 32, f16, p)
                    assert torch.equal(got, alone[start:start + w]), (cpu_kernels.Q8_PATHS[p], f16, w, start)


def test_int4_q8_bad_inputs_name_the_value():
    paths = q8_paths()
    q, scales, zeros, _ = int4_case(32, 64, 32, torch.float32)
    packed = cpu_kernels.repack_int4_q8(q, scales, zeros, 32)
    with pytest.raises(RuntimeError, match="packed has"):
        cpu_kernels.int4_q8_mm(torch.randn(2, 96), packed, 32, 32, False, 1)
    with pytest.raises(RuntimeError, match="packed has .* fp16 scales"):
        cpu_kernels.int4_q8_mm(torch.randn(2, 64), packed, 32, 32, True, 1)
    with pytest.raises(RuntimeError, match="path must be 1"):
        cpu_kernels.int4_q8_mm(torch.randn(2, 64), packed, 32, 32, False, 9)
    missing = [p for p in cpu_kernels.Q8_PATHS if p not in paths]
    if missing:
        with pytest.raises(RuntimeError, match=f"cannot run path {missing[0]}"):
            cpu_kernels.int4_q8_mm(torch.randn(2, 64), packed, 32, 32, False, missing[0])
    with pytest.raises(ValueError, match="f16_scales needs"):
        cpu_kernels.repack_int4_q8(q, scales * (1 + 2 ** -20), zeros, 32, True)
    with pytest.raises(RuntimeError, match="K = 48 must be a multiple of 32"):
        cpu_kernels.q8_quantize(torch.randn(2, 48))
    with pytest.raises(ValueError, match="group_size 16 must be a multiple of 32"):
        cpu_kernels.repack_int4_q8(q, scales, zeros, 16)


def test_int4_q8_format_reference_and_compile():
    """Int4Q8Format: its torch reference (int64 block sums, float64 epilogue) agrees with the
    kernel; torch.compile calls the op as an opaque extern and gets the same bits."""
    from specbuild.model.qlinear import Int4Q8Format

    q8_paths()
    q, scales, zeros, _ = int4_case(48, 128, 32, torch.float32)
    fmt = Int4Q8Format(pack_nibbles(q), scales, zeros, 32)
    assert fmt.quantizes_inputs and fmt.path == cpu_kernels.q8_path() and not fmt.f16_scales
    assert fmt.nbytes == 48 * 128 // 2 + 48 * (128 // 32) * 2 * 4  # nibbles + a float32 scale and m per group
    q16, s16, z16, _ = q4_1_case(48, 128, 32)
    fmt16 = Int4Q8Format(pack_nibbles(q16), s16, z16, 32)
    assert fmt16.f16_scales and fmt16.nbytes == 48 * 128 // 2 + 48 * (128 // 32) * 2 * 2  # Q4_1: fp16 d and m
    x = q8_inputs(5, 128)
    ref = fmt.reference(x)
    assert float((fmt(x) - ref).abs().max()) <= 1e-5 * float(ref.abs().max())

    def f(x):
        return fmt(torch.nn.functional.silu(x) * 2.0)

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(x), f(x))
    assert torch.equal(compiled(x[:3]), f(x[:3]))


@pytest.mark.parametrize("compiled", [False, True])
def test_int4_a8_greedy_speculation_equals_plain_decoding(tmp_path, compiled):
    """An int4-a8 bundle (`--quantize int4 --activations int8`): every layer linear runs
    int4_q8_mm; greedy speculation (draft model, prompt lookup) equals plain decoding, eager
    and with the layer stack compiled (`--compile`: the op is an opaque extern call there)."""
    from specbuild.compiler.compile import CompileOptions, compile_bundle
    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.model.qlinear import Int4Q8Format
    from tiny import make_tiny_hf, perturbed_copy

    q8_paths()
    target = make_tiny_hf(str(tmp_path / "target"), scale=4.0, seed=3)
    draft = perturbed_copy(target, str(tmp_path / "draft"), noise=0.08)
    bundle = compile_bundle(target, str(tmp_path / "int4a8"), CompileOptions(
        max_draft_len=8, dtype="float32", quantize="int4", lm_head_format="int8", activations="int8"), draft=draft)
    engine = Engine(bundle, EngineConfig(max_batch_size=4, compile=compiled))
    layers = [v for k, v in engine.model.w.items() if k.startswith("layers.") and hasattr(v, "formats")]
    assert layers and all(isinstance(v.formats[v.primary], Int4Q8Format) for v in layers)
    assert engine.model.row_invariant and (engine.model.compiled is not None) == compiled
    assert_speculation_equals_plain(engine)


def test_int4_a8_without_the_kernel_is_a_clear_error(monkeypatch, tmp_path):
    """No compiler (nothing built before): an int4-a8 weight cannot run (torch has no int4 x
    int8 kernel to fall back on), and the error says why."""
    from specbuild.errors import BundleError
    from specbuild.model.qlinear import Int4Q8Format

    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    monkeypatch.setenv("SPECBUILD_KERNEL_DIR", str(tmp_path))
    q, scales, zeros, _ = int4_case(32, 64, 32, torch.float32)
    assert cpu_kernels.q8_paths() == [] and cpu_kernels.q8_path() == 0
    with pytest.raises(BundleError, match=r"specbuild's CPU kernel only .*no C\+\+ compiler"):
        Int4Q8Format(pack_nibbles(q), scales, zeros, 32)


# ---- int8_q8_mm: an int8 lm_head with int8 input blocks (--lm-head-activations int8) ---------

def int8_q8_or_skip() -> None:
    q8_paths()
    if not cpu_kernels.int8_q8_available():
        pytest.skip("the int8 x int8 kernel needs AVX2 + FMA (or AVX512-VNNI), which this CPU lacks")


@pytest.mark.parametrize("n,k", [(40, 96), (37, 64), (200, 576), (49152 // 64, 576)])
def test_int8_q8_matches_a_float64_reference_and_rows_are_invariant(n, k):
    """The kernel's output against exact integer block sums combined in float64 (the only
    difference is the fp32 accumulation, so a few ulps), on the documented input rounding;
    every row the same bits whatever rows share the call (1 to 17, any position)."""
    int8_q8_or_skip()
    gen = torch.Generator().manual_seed(n)
    qw = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-4
    packed = cpu_kernels.repack_int8_q8(qw, scales)
    x = q8_inputs(17, k)
    q, d, _ = q8_reference_blocks(x)
    isum = torch.einsum("tbk,nbk->tnb", q.view(17, k // 32, 32).long(), qw.view(n, k // 32, 32).long()).double()
    ref = (isum * d.double().unsqueeze(1)).sum(-1) * scales.double()
    out = cpu_kernels.int8_q8_mm(x, packed, n)
    assert out.dtype == torch.float32 and out.shape == (17, n)
    scale = ref.abs().amax(1, keepdim=True).clamp_min(1e-30)
    assert float(((out.double() - ref).abs() / scale).max()) < 1e-5
    for rows in [[3], [16], [2, 9]] + [list(range(w)) for w in range(1, 18)] + [list(range(17 - w, 17)) for w in range(1, 17)]:
        assert torch.equal(cpu_kernels.int8_q8_mm(x[rows], packed, n), out[rows]), rows


def test_int8_q8_paths_give_the_same_bits():
    """AVX2 (vpmaddubsw on |w| and q signed by w) forms the integers the AVX512-VNNI tile forms
    (vpdpbusd on w + 128, less 128 * qsum), with the same epilogue: the same bits at every width
    and position; the default path is the best the CPU runs, and a path it cannot run is refused
    by name."""
    int8_q8_or_skip()
    gen = torch.Generator().manual_seed(5)
    n, k = 77, 160
    qw = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    qw[0, :32] = -128  # |w| = 128: the largest unsigned operand vpmaddubsw sees
    packed = cpu_kernels.repack_int8_q8(qw, torch.rand(n, generator=gen) + 1e-3)
    x = q8_inputs(17, k)
    best = cpu_kernels.int8_q8_path()
    assert best in cpu_kernels.INT8_Q8_PATHS
    out = cpu_kernels.int8_q8_mm(x, packed, n)
    assert torch.equal(cpu_kernels.int8_q8_mm(x, packed, n, best), out)
    runs = [p for p in cpu_kernels.INT8_Q8_PATHS if p == 1 or p in cpu_kernels.q8_paths()]
    for path in runs:
        for rows in [list(range(w)) for w in range(1, 18)] + [[16], [2, 9, 11]]:
            assert torch.equal(cpu_kernels.int8_q8_mm(x[rows], packed, n, path), out[rows]), (path, rows)
    with pytest.raises(RuntimeError, match="path must be 0 .* got 3"):
        cpu_kernels.int8_q8_mm(x, packed, n, 3)
    if 2 not in runs:
        with pytest.raises(RuntimeError, match=r"path 2 \(AVX512-VNNI\) cannot run on this CPU"):
            cpu_kernels.int8_q8_mm(x, packed, n, 2)


def test_int8_q8_bad_inputs_name_the_value():
    int8_q8_or_skip()
    qw = torch.zeros(32, 64, dtype=torch.int8)
    packed = cpu_kernels.repack_int8_q8(qw, torch.ones(32))
    with pytest.raises(RuntimeError, match="packed has"):
        cpu_kernels.int8_q8_mm(torch.randn(2, 96), packed, 32)
    with pytest.raises(RuntimeError, match="K = 48 must be a multiple of 32"):
        cpu_kernels.int8_q8_mm(torch.randn(2, 48), packed, 32)
    with pytest.raises(ValueError, match="in_features 48 must be a multiple of 32"):
        cpu_kernels.repack_int8_q8(torch.zeros(16, 48, dtype=torch.int8), torch.ones(16))


@pytest.mark.parametrize("compiled", [False, True])
def test_int8_inputs_lm_head_greedy_speculation_equals_plain_decoding(tmp_path, compiled, capsys):
    """`--lm-head-activations int8`: the (tied) lm_head runs int8_q8_mm, said in one line at
    load; greedy speculation equals plain decoding, eager and compiled."""
    from specbuild.compiler.compile import CompileOptions, compile_bundle
    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.model.qlinear import Int8Q8Format
    from tiny import make_tiny_hf, perturbed_copy

    int8_q8_or_skip()
    target = make_tiny_hf(str(tmp_path / "target"), scale=4.0, seed=3)
    draft = perturbed_copy(target, str(tmp_path / "draft"), noise=0.08)
    bundle = compile_bundle(target, str(tmp_path / "h8"), CompileOptions(
        max_draft_len=8, dtype="float32", quantize="int4", lm_head_format="int8", activations="int8",
        lm_head_activations="int8"), draft=draft)
    engine = Engine(bundle, EngineConfig(max_batch_size=4, compile=compiled))
    head = engine.model.lm_head
    assert isinstance(head.formats[head.primary], Int8Q8Format)
    assert "the lm_head takes int8 input blocks of 32" in capsys.readouterr().err
    x = torch.randn(3, head.shape[1])
    assert torch.allclose(head(x), head(x, reference=True), rtol=1e-4, atol=1e-4)
    assert engine.model.row_invariant
    assert_speculation_equals_plain(engine)


def test_lm_head_activations_auto_chooses_by_the_cpu_at_load(tmp_path, monkeypatch, capsys):
    """`--lm-head-activations auto` (the quickstart's): int8 input blocks where the AVX512-VNNI
    kernel runs, float32 inputs where it does not, said in one line either way."""
    from specbuild.compiler.compile import CompileOptions, compile_bundle
    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.model.qlinear import Int8Q8Format
    from tiny import make_tiny_hf

    q8_paths()
    bundle = compile_bundle(make_tiny_hf(str(tmp_path / "target"), scale=4.0, seed=3), str(tmp_path / "auto"),
                            CompileOptions(dtype="float32", quantize="int4", lm_head_format="int8",
                                           activations="auto", lm_head_activations="auto"))
    head = Engine(bundle, EngineConfig(max_batch_size=1)).model.lm_head
    runs = cpu_kernels.int8_q8_available()
    assert isinstance(head.formats[head.primary], Int8Q8Format) == runs
    assert ("the lm_head takes int8 input blocks" if runs else "the lm_head takes float32 inputs") \
        in capsys.readouterr().err
    monkeypatch.setattr(cpu_kernels, "int8_q8_available", lambda: False)
    head = Engine(bundle, EngineConfig(max_batch_size=1)).model.lm_head
    assert not isinstance(head.formats[head.primary], Int8Q8Format)
    assert "--lm-head-activations auto: the lm_head takes float32 inputs" in capsys.readouterr().err


def test_int8_inputs_lm_head_without_vnni_is_a_clear_error(monkeypatch):
    from specbuild.errors import BundleError
    from specbuild.model.qlinear import Int8Q8Format

    monkeypatch.setattr(cpu_kernels, "int8_q8_available", lambda: False)
    with pytest.raises(BundleError, match="--lm-head-activations int8.*int8 x int8 CPU kernel only"):
        Int8Q8Format(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16))


def assert_speculation_equals_plain(engine) -> None:
    """Greedy draft-model and prompt-lookup speculation give plain decoding's tokens, with
    drafts proposed and some accepted."""
    from specbuild.engine.sequence import Request
    from specbuild.sampling.params import SamplingParams
    from specbuild.speculation.config import SpeculationConfig

    prompts = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10], [20, 21, 22, 20, 21, 22, 20], list(range(30, 70))]

    def generate(method):
        return engine.generate([Request(prompt_ids=p, speculation=SpeculationConfig.make(None, method=method, gamma=4),
                                        sampling=SamplingParams(max_tokens=24, ignore_eos=True)) for p in prompts])

    plain = [r["token_ids"] for r in generate("none")]
    for method in ("draft", "ngram"):
        out = generate(method)
        assert [r["token_ids"] for r in out] == plain, method
        assert sum(r["stats"]["drafted"] for r in out) > 0 and sum(r["stats"]["accepted"] for r in out) > 0


# ---- rows_attention: each query row over its own cache slots ---------------------------------

def attention_case(heads=9, kv=3, d=64, slots=700, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, kv, d, generator=g)
    v = torch.randn(slots, kv, d, generator=g)
    return k, v, torch.randperm(slots, generator=g)


@pytest.mark.parametrize("d", [16, 64, 128])
def test_rows_attention_matches_a_float64_reference(d):
    from specbuild.model.attention import paged_attention_reference, rows_index

    levels()
    k, v, perm = attention_case(d=d)
    read = perm[:300]
    lens = [1, 7, 8, 9, 100, 300]  # key counts around the 4-key and 8-lane steps
    mask = torch.zeros(len(lens), 300, dtype=torch.bool)
    for t, n in enumerate(lens):
        mask[t, :n] = True
    mask[2, 3] = False  # a tree row: its keys are not a prefix
    q = torch.randn(len(lens), 9, d)
    out = cpu_kernels.rows_attention(q, k, v, rows_index(read, mask, len(lens)), d ** -0.5)
    ref = paged_attention_reference(q, k, v, read, mask, d ** -0.5)
    assert (out - ref).abs().max().item() < 1e-5


def test_rows_attention_reads_a_head_major_cache_with_the_same_bits():
    """The KV cache's default layout keeps each kv head's rows of all slots together (kv_cache.py):
    the same values there give the same bits as the contiguous [slots, KV, D] caches, for short
    rows and for rows long enough to be attended in segments; any other strides are refused."""
    from specbuild.model.attention import rows_index

    levels()
    k, v, perm = attention_case(slots=1400)

    def head_major(t):
        out = torch.empty_strided(t.shape, (t.shape[2], t.shape[0] * t.shape[2], 1))
        out.copy_(t)
        return out

    hk, hv = head_major(k), head_major(v)
    assert torch.equal(hk, k) and hk.stride() == (64, 1400 * 64, 1)
    lens = [1, 5, 64, 513, 1200]
    read = perm[:1200]
    mask = torch.zeros(len(lens), 1200, dtype=torch.bool)
    for t, n in enumerate(lens):
        mask[t, :n] = True
    q = torch.randn(len(lens), 9, 64)
    index = rows_index(read, mask, len(lens))
    assert torch.equal(cpu_kernels.rows_attention(q, hk, hv, index, 0.125),
                       cpu_kernels.rows_attention(q, k, v, index, 0.125))
    with pytest.raises(RuntimeError, match="slot-major .* or head-major"):
        cpu_kernels.rows_attention(q, k[::2], v[::2], index, 0.125)
    with pytest.raises(RuntimeError, match="both alike"):
        cpu_kernels.rows_attention(q, hk, v, index, 0.125)


def test_rows_attention_reads_float16_caches_as_their_float32_values():
    """A float16 KV cache (EngineConfig.kv_cache_dtype) is widened exactly before the same
    arithmetic: the bits of float32 caches holding the same values, slot-major and head-major,
    short rows and rows attended in segments; mixed dtypes are refused."""
    from specbuild.model.attention import rows_index

    levels()
    k, v, perm = attention_case(slots=1400)
    k16, v16 = (k * 4).half(), v.half()
    lens = [1, 3, 8, 64, 513, 1200]
    mask = torch.zeros(len(lens), 1200, dtype=torch.bool)
    for t, n in enumerate(lens):
        mask[t, :n] = True
    q = torch.randn(len(lens), 9, 64)
    index = rows_index(perm[:1200], mask, len(lens))
    want = cpu_kernels.rows_attention(q, k16.float(), v16.float(), index, 0.125)
    assert torch.equal(cpu_kernels.rows_attention(q, k16, v16, index, 0.125), want)
    hk = torch.empty_strided(k16.shape, (64, 1400 * 64, 1), dtype=torch.float16)
    hv = torch.empty_strided(v16.shape, (64, 1400 * 64, 1), dtype=torch.float16)
    hk.copy_(k16)
    hv.copy_(v16)
    assert torch.equal(cpu_kernels.rows_attention(q, hk, hv, index, 0.125), want)
    with pytest.raises(RuntimeError, match="two float32 or two float16"):
        cpu_kernels.rows_attention(q, k16, v, index, 0.125)


@pytest.mark.parametrize("heads,kv,d", [(9, 3, 64), (8, 2, 64), (10, 2, 32), (6, 3, 24), (16, 2, 128)])
def test_rows_attention_gives_each_query_head_its_bits_alone(heads, kv, d):
    """The kernel loads each key and value chunk once for up to three query heads of a kv head;
    every head must still get exactly the bits of a call that holds that head alone (one query
    head over its kv head): groups of 2-8 heads, D with and without the four-chunk value path."""
    from specbuild.model.attention import rows_index

    levels()
    k, v, perm = attention_case(heads=heads, kv=kv, d=d)
    read = perm[:400]
    mask = torch.rand(3, 400, generator=torch.Generator().manual_seed(2)) > 0.25
    index = rows_index(read, mask, 3)
    q = torch.randn(3, heads, d, generator=torch.Generator().manual_seed(4))
    grouped = cpu_kernels.rows_attention(q, k, v, index, d ** -0.5)
    g = heads // kv
    for h in range(heads):
        kh, vh = k[:, h // g:h // g + 1].contiguous(), v[:, h // g:h // g + 1].contiguous()
        alone = cpu_kernels.rows_attention(q[:, h:h + 1].contiguous(), kh, vh, index, d ** -0.5)
        assert torch.equal(grouped[:, h:h + 1], alone), f"head {h}"


@pytest.mark.parametrize("n,where", [(5, 3), (9, 0), (9, 8), (40, 0), (40, 17), (40, 39), (43, 41)])
def test_rows_attention_subtracts_the_largest_score_wherever_it_is(n, where):
    """The softmax subtracts each row's largest score before exp: with one key scoring ~300 (exp
    overflows float32 past ~88) the output must be that key's value, found among the vector
    lanes, the first key or the tail."""
    from specbuild.model.attention import rows_index

    levels()
    g = torch.Generator().manual_seed(n + where)
    k = torch.randn(64, 1, 64, generator=g) * 0.01
    v = torch.randn(64, 1, 64, generator=g)
    q = torch.ones(1, 3, 64)
    read = torch.arange(n)
    k[int(read[where]), 0] = 300.0 / 64 / 0.125  # q . k * scale = 300
    out = cpu_kernels.rows_attention(q, k, v, rows_index(read, None, 1), 0.125)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[0], v[int(read[where]), 0].expand(3, 64), atol=1e-5)


def test_rows_attention_rows_are_invariant_to_their_neighbours_and_threads():
    """A row's output has the same bits alone, beside other rows (any order), and at 1 or 2
    threads: what lets the decode step and a verify pass share one kernel losslessly."""
    from specbuild.model.attention import rows_index

    levels()
    k, v, perm = attention_case()
    read = perm[:400]
    q = torch.randn(17, 9, 64)
    lens = [40 + 21 * t for t in range(17)]
    mask = torch.zeros(17, 400, dtype=torch.bool)
    for t, n in enumerate(lens):
        mask[t, :n] = True
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        both = cpu_kernels.rows_attention(q, k, v, rows_index(read, mask, 17), 0.125)
        flipped = cpu_kernels.rows_attention(q.flip(0), k, v, rows_index(read, mask.flip(0), 17), 0.125).flip(0)
        torch.set_num_threads(1)
        for t in range(17):
            alone = cpu_kernels.rows_attention(q[t:t + 1], k, v, rows_index(read[:lens[t]], None, 1), 0.125)
            assert torch.equal(alone[0], both[t]) and torch.equal(flipped[t], both[t]), t
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("d", [16, 64])
def test_rows_attention_long_rows_in_segments_match_a_float64_reference(d):
    """A row over more than 512 keys is attended in segments combined afterwards (the two threads
    then share a decode row): at and around the split points the result stays the attention."""
    from specbuild.model.attention import paged_attention_reference, rows_index

    levels()
    k, v, perm = attention_case(d=d, slots=1400)
    lens = [511, 512, 513, 700, 1025, 1400]
    mask = torch.zeros(len(lens), 1400, dtype=torch.bool)
    for t, n in enumerate(lens):
        mask[t, :n] = True
    mask[3, 600] = False  # a tree row: its keys are not a prefix
    q = torch.randn(len(lens), 9, d, generator=torch.Generator().manual_seed(5))
    out = cpu_kernels.rows_attention(q, k, v, rows_index(perm, mask, len(lens)), d ** -0.5)
    ref = paged_attention_reference(q, k, v, perm, mask, d ** -0.5)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("n,where", [(600, 0), (600, 299), (600, 300), (600, 599), (1100, 1099), (1100, 550)])
def test_rows_attention_long_rows_combine_around_the_largest_score(n, where):
    """A score of ~300 (exp overflows float32 past ~88) in any segment of a long row: the
    segments are combined around the largest score of all, so the output is that key's value."""
    from specbuild.model.attention import rows_index

    levels()
    g = torch.Generator().manual_seed(n + where)
    k = torch.randn(n, 1, 64, generator=g) * 0.01
    v = torch.randn(n, 1, 64, generator=g)
    k[where, 0] = 300.0 / 64 / 0.125  # q . k * scale = 300
    out = cpu_kernels.rows_attention(torch.ones(1, 3, 64), k, v, rows_index(torch.arange(n), None, 1), 0.125)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[0], v[where, 0].expand(3, 64), atol=1e-5)


def test_rows_attention_long_rows_keep_their_bits_alone_per_head_and_per_row():
    """Segments depend on a row's key count alone: a long row gives the same bits beside other
    rows or alone, at 1 or 2 threads, and each query head the bits of a call that holds it alone."""
    from specbuild.model.attention import rows_index

    levels()
    k, v, perm = attention_case(slots=1200)
    lens = [1200, 513, 300, 900]
    mask = torch.zeros(len(lens), 1200, dtype=torch.bool)
    for t, n in enumerate(lens):
        mask[t, :n] = True
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(6))
    index = rows_index(perm, mask, len(lens))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        both = cpu_kernels.rows_attention(q, k, v, index, 0.125)
        for h in range(9):
            kh, vh = k[:, h // 3:h // 3 + 1].contiguous(), v[:, h // 3:h // 3 + 1].contiguous()
            alone = cpu_kernels.rows_attention(q[:, h:h + 1].contiguous(), kh, vh, index, 0.125)
            assert torch.equal(both[:, h:h + 1], alone), f"head {h}"
        torch.set_num_threads(1)
        for t, n in enumerate(lens):
            alone = cpu_kernels.rows_attention(q[t:t + 1], k, v, rows_index(perm[:n], None, 1), 0.125)
            assert torch.equal(alone[0], both[t]), t
    finally:
        torch.set_num_threads(threads)


def test_a_decode_rows_few_attention_items_go_to_the_pool_with_their_bits():
    """One row over a few keys (a decode step early in a chat): on the kernels' pool its three kv
    heads are a job of their own (inside the stack its keys come from memory, so each head waits
    on loads longer than a hand-off takes); under OpenMP it stays on the calling thread. The
    same bits either way."""
    from specbuild.model.attention import rows_index

    levels()
    k, v, perm = attention_case()
    q = torch.randn(1, 9, 64)
    index = rows_index(perm[:40], None, 1)
    threads, mode = torch.get_num_threads(), cpu_kernels.pool_stats()["mode"]
    try:
        torch.set_num_threads(1)
        cpu_kernels.kernels_mode("pool", 2)
        jobs = cpu_kernels.pool_stats()["jobs"]
        pooled = cpu_kernels.rows_attention(q, k, v, index, 0.125)
        assert cpu_kernels.pool_stats()["jobs"] == jobs + 1
        torch.set_num_threads(2)
        cpu_kernels.kernels_mode("openmp")
        jobs = cpu_kernels.pool_stats()["jobs"]
        inline = cpu_kernels.rows_attention(q, k, v, index, 0.125)
        assert cpu_kernels.pool_stats()["jobs"] == jobs
    finally:
        cpu_kernels.kernels_mode("openmp")  # the pool's width back to torch's thread count
        cpu_kernels.pool_config(mode)
        torch.set_num_threads(threads)
    assert torch.equal(pooled, inline)


def test_row_argmax_is_numpys_on_ties_infinities_nans_and_signed_zeros():
    """The fused stack's argmax (row_argmax): the first maximum, the first NaN where a row has
    one, 0 for a row of -inf: numpy's argmax, which the step took before, on every length
    (the vector body and the tail)."""
    import numpy as np

    levels()
    g = torch.Generator().manual_seed(3)
    inf, nan = float("inf"), float("nan")
    rows = []
    for n in (1, 7, 8, 9, 17, 49152):
        base = torch.randn(n, generator=g)
        rows.append(base)
        tie = base.clone()
        tie[n // 2:] = tie.max()  # ties from the middle on
        rows.append(tie)
        for at_ in {0, n // 3, n - 1}:
            r = base.clone()
            r[at_] = nan
            rows.append(r)
            r = base.clone()
            r[at_] = inf
            rows.append(r)
        rows.append(torch.full((n,), -inf))
        z = torch.zeros(n)
        z[: n // 2] = -0.0
        rows.append(z)
        both = base.clone()
        both[n - 1], both[0] = nan, inf
        rows.append(both)
    for r in rows:
        got = torch.ops.specbuild_cpu.row_argmax(r.view(1, -1))
        assert int(got[0]) == int(np.argmax(r.numpy())), r[:9]
    x = torch.randn(6, 1000, generator=g)
    assert torch.ops.specbuild_cpu.row_argmax(x).tolist() == np.argmax(x.numpy(), axis=1).tolist()
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.specbuild_cpu.row_argmax(x.double())


def test_rows_attention_refuses_a_bad_index():
    levels()
    k, v, _ = attention_case(slots=50)
    q = torch.randn(2, 9, 64)
    op = cpu_kernels.rows_attention
    with pytest.raises(RuntimeError, match="slot 50 outside the cache's 50 rows"):
        op(q, k, v, torch.tensor([0, 1, 2, 0, 50]), 0.125)
    with pytest.raises(RuntimeError, match="offsets must not decrease"):
        op(q, k, v, torch.tensor([0, 2, 1, 0]), 0.125)
    with pytest.raises(RuntimeError, match="index holds 5 entries, its offsets say 3 \\+ 3"):
        op(q, k, v, torch.tensor([0, 1, 3, 0, 1]), 0.125)
    with pytest.raises(RuntimeError, match="head_dim 20 is not a multiple of 8"):
        op(torch.randn(1, 2, 20), torch.randn(5, 1, 20), torch.randn(5, 1, 20), torch.tensor([0, 1, 0]), 0.1)
    # a row with no keys comes out zero (as SDPA's)
    out = op(q, k, v, torch.tensor([0, 0, 1, 3]), 0.125)
    assert torch.equal(out[0], torch.zeros(9, 64)) and out[1].abs().sum() > 0


def test_q8_path_is_a_runnable_path_and_can_be_forced(monkeypatch):
    """q8_path() picks among the paths this CPU runs (AVX512-VNNI near or far prefetch by a
    measurement: the same bits, tested above); SPECBUILD_Q8_PATH forces one, and a path this CPU
    cannot run is refused with the runnable ones named."""
    paths = q8_paths()
    assert cpu_kernels.q8_path() in paths
    monkeypatch.setenv("SPECBUILD_Q8_PATH", str(paths[0]))
    assert cpu_kernels.q8_path() == paths[0]
    monkeypatch.setenv("SPECBUILD_Q8_PATH", "9")
    with pytest.raises(cpu_kernels.KernelBuildError, match=r"SPECBUILD_Q8_PATH='9' is not a path this CPU runs: 1 \(AVX2\)"):
        cpu_kernels.q8_path()


@pytest.mark.parametrize("four_rows,expect", [({2: 2.4, 5: 2.3, 7: 3.6, 8: 2.2}, 8), ({2: 2.4, 5: 2.3, 7: 2.0, 8: 2.5}, 7),
                                             ({2: 1.9, 5: 2.3, 7: 2.0, 8: 2.2}, 2)])
def test_q8_path_takes_the_least_time_for_one_row_and_four(monkeypatch, capsys, four_rows, expect):
    """Each candidate path is measured on one row and on four (they differ in how few-row and
    wide tiles prefetch), interleaved, once; the least sum of the medians wins, so one-row times
    within each other's noise no longer decide alone; the lm_head stays on 7's tiles where 7 or 8
    runs; the line on stderr gives both measurements."""
    calls = []

    def costs(paths, repeats=9):
        calls.append(paths)
        return {p: ({2: 1.05, 5: 1.07, 7: 1.02, 8: 1.03}[p], four_rows[p]) for p in paths}

    monkeypatch.delenv("SPECBUILD_Q8_PATH", raising=False)
    monkeypatch.setenv("SPECBUILD_CPU_KERNEL", "auto")
    monkeypatch.setattr(cpu_kernels, "_choices", {})
    monkeypatch.setattr(cpu_kernels, "q8_paths", lambda: [1, 2, 4, 5, 6, 7, 8])
    monkeypatch.setattr(cpu_kernels, "int8_q8_available", lambda: True)
    monkeypatch.setattr(cpu_kernels, "_q8_stream_costs", costs)
    assert cpu_kernels.q8_path() == expect and cpu_kernels.q8_path() == expect  # measured once
    assert calls == [(2, 5, 7, 8)]  # both widths of every candidate in one measurement
    assert cpu_kernels.int8_q8_path() == (7 if expect in (7, 8) else 2)
    err = capsys.readouterr().err
    assert f"kernel's {cpu_kernels.Q8_PATHS[expect]} path (medians" in err and "four rows: " in err


def test_the_path_measurement_times_both_widths_of_every_candidate():
    """_q8_stream_costs gives each candidate its median one-row and four-row milliseconds over
    the rounds (real passes over the sample weights; what q8_path sums)."""
    paths = tuple(p for p in q8_paths() if p in (1, 2, 5, 6))[:2]
    if not paths:
        pytest.skip("no int4 x int8 path runs on this CPU")
    out = cpu_kernels._q8_stream_costs(paths, repeats=2)
    assert set(out) == set(paths)
    for one, four in out.values():
        assert 0 < one < 1e4 and 0 < four < 1e4
