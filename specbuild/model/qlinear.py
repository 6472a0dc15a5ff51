"""Runtime linear-layer formats: dense, int8 and int4 weight-only, and a format per width.

A `QLinear` is one weight [out_features, in_features] held in one or more formats:

    dense     a float32/bfloat16/float16 tensor, F.linear
    int8      int8 values [N, K] + a scale per row [N]; specbuild's CPU kernel or torch's
              `_weight_int8pack_mm` (chosen like int4's)
    int4      values 0..15 [N, K] with a scale and a zero per group of `group_size` inputs
              (weight = (q - 8) * scale + zero); on CPU specbuild's own kernel
              (model/cpu_kernels.py, where it measures faster at load) or torch's
              `_weight_int4pack_mm_for_cpu` (`_weight_int4pack_mm` on CUDA), packed at load
              into the chosen kernel's layout
    int4-a8   the int4 weights with each input row quantised to int8 blocks of 32 (one
              float32 scale per block) and integer dot products: specbuild's CPU kernel
              only (cpu_kernels.int4_q8_mm; opt-in, lossy like int8-a8)

Every format rounds its input to the weight's activation dtype (`act_dtype`) and its
output back to it, so an int4 weight and a float32 copy of its dequantised values give
the same numbers up to float32 summation order: the copies are interchangeable per
forward (`exact=True`). A copy that rounds the weights themselves (bfloat16 of an int4
weight) is `exact=False` and is chosen only when a plan allows inexact formats.

`linear(x, weight, fmt, bias)` is the one dispatch point of the decoder: a plain tensor
goes to F.linear unchanged. Each fast path has a plain dequantise-then-matmul
`reference`; tests compare them on random inputs.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from specbuild.model import cpu_kernels

ACT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RESCORE_TOP = 64  # lm_head outputs per row recomputed in float32 (see QLinear.rescored)


# ---- storage <-> values ----------------------------------------------------------------------
def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] values 0..15 (K even) -> [N, K / 2] uint8, low nibble = even column."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """packed: [N, K / 2] uint8 -> [N, K] uint8 values 0..15 (inverse of pack_nibbles)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def quantize_int8(w: torch.Tensor, act_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8. w: [N, K] -> (qweight int8 [N, K], scales float32 [N]) with
    scales representable in act_dtype and weight ~= qweight * scale."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).to(act_dtype).float()
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(w / safe.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """qweight: [N, K] int8; scales: [N]. Returns float32 [N, K] = q * scale."""
    return qweight.float() * scales.float().unsqueeze(1)


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """q: [N, K] values 0..15; scales, zeros: [N, K / group_size]. Returns float32 [N, K]
    = (q - 8) * scale + zero, one fused multiply-add per weight (one rounding, like the kernel)."""
    n, k = q.shape
    qg = (q.float() - 8.0).view(n, k // group_size, group_size)
    out = torch.addcmul(zeros.float().unsqueeze(-1), qg, scales.float().unsqueeze(-1))
    return out.view(n, k)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy in memory from torch's allocator (64-byte aligned)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def ensure_aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself when it is contiguous and 64-byte aligned, else an aligned copy (safetensors
    places tensors at their file offsets; oneDNN and torch's int8 kernel want aligned ones)."""
    return t if t.is_contiguous() and t.data_ptr() % 64 == 0 else aligned(t)


# ---- formats ---------------------------------------------------------------------------------
class DenseFormat:
    """weight: [N, K] in its storage dtype; inputs and outputs rounded to act_dtype.

    `kn`: stored transposed ([K, N] contiguous; `weight` is its [N, K] view), the layout
    whose matmul is cheaper on CPU for several rows at once (measured with torch 2.13 on
    2 cores, float32, all linears of SmolLM2-135M: 5 rows 30 ms instead of 42, 11 rows 45
    instead of 65; one row about the same). Same values, named `<dtype>.kn`."""

    kind = "dense"

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype, kn: bool = False) -> None:
        if kn:
            self.weight = aligned(weight.t()).t()
        else:  # already contiguous and aligned (e.g. a tensor the decoder holds): no copy
            self.weight = ensure_aligned(weight)
        self.act_dtype = act_dtype
        self.name = str(weight.dtype).removeprefix("torch.") + (".kn" if kn else "")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] act -> [T, N] act
        return F.linear(x.to(self.weight.dtype), self.weight).to(self.act_dtype)

    reference = __call__

    def dense(self) -> torch.Tensor:
        return self.weight.float()

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int8Format:
    """Per-row int8: qweight [N, K] int8, scales [N] (act dtype)."""

    kind = name = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, act_dtype: torch.dtype,
                 kernel: bool = True) -> None:
        # fresh (aligned) memory: safetensors maps tensors at any offset, and the kernel
        # crashes on unaligned weights (seen with torch 2.13 at 4 rows)
        self.qweight = ensure_aligned(qweight.to(torch.int8))
        self.scales = ensure_aligned(scales.to(act_dtype))
        self.act_dtype = act_dtype
        # specbuild's kernel (its ISA level) and its layout, or 0: torch's kernel
        self.kernel = cpu_kernels.choose("int8", act_dtype, self.qweight.device) if kernel else 0
        self.cpu_packed = cpu_kernels.repack_int8(self.qweight, self.scales) if self.kernel else None

    @property
    def float_sums(self) -> bool:
        """Whether a float32 input (holding act-dtype values) gets the float32 sums the kernel
        would round for an act-dtype input: specbuild's kernel converts every input to float32
        and runs one path per weight (its ISA level), whatever the input's dtype."""
        return bool(self.kernel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] act -> [T, N] act (float32 in: float32 out)
        if self.kernel:
            return torch.ops.specbuild_cpu.int8_mm(x, self.cpu_packed, self.qweight.shape[0], self.kernel)
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.dense()).to(self.act_dtype)

    def dense(self) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scales)

    @property
    def nbytes(self) -> int:
        if self.cpu_packed is not None:
            return self.cpu_packed.numel()
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()


class Int8DynFormat(Int8Format):
    """Per-row int8 weights with per-row dynamic int8 activations (W8A8): each input row is
    rounded to int8 with its own scale (amax / 127), the product runs in int32 through
    torch's `_int_mm` (oneDNN/VNNI on x86), and the result is scaled back in float32. Integer
    sums are exact in any order and every other step is per element or per row, so a row's
    output is the same bits whatever other rows share the forward (no per-tensor scale:
    that would make a row depend on the others). Inputs and outputs are float32.

    The weight is held twice, [N, K] and [K, N] (measured with torch 2.13 on 2 cores, all
    linears of SmolLM2-135M: one row 2.7 ms through the [N, K] one, 4.3 through [K, N]; 5
    rows 6.2 and 4.4; 17 rows 8.9 and 6.6); both give the same integers."""

    name = "int8-a8"
    quantizes_inputs = True

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__(qweight, scales.float(), torch.float32, kernel=False)
        self.qweight_kn = aligned(self.qweight.t())  # [K, N]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] float32 -> [T, N] float32
        x = x.float()
        step = x.abs().amax(1, keepdim=True).clamp_min_(1e-30).div_(127.0)  # [T, 1]
        xq = torch.round(x / step).to(torch.int8)
        w = self.qweight.t() if x.shape[0] == 1 else self.qweight_kn
        return torch._int_mm(xq, w).float().mul_(step).mul_(self.scales)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic spelled out: rows rounded to int8, an int64 product, scaled."""
        x = x.float()
        step = x.abs().amax(1, keepdim=True).clamp_min_(1e-30).div_(127.0)
        xq = torch.round(x / step).to(torch.int64)
        return (xq @ self.qweight.to(torch.int64).t()).float().mul_(step).mul_(self.scales)


class Int8Q8Format(Int8Format):
    """Per-row int8 weights (the Int8Format values) with int8 inputs in blocks of 32, for the
    lm_head (compile --lm-head-activations int8; opt-in, lossy against float32 inputs): each
    input row is quantised on its own as Int4Q8Format quantises the layers' (d = amax / 127 per
    block of 32, q = nearest(x / d)), the exact integer block sums sum(w * q) enter a float32
    accumulator in block order (acc = fma(isum, d, acc)) and the output is acc * scale
    (cpu_kernels.cpp, int8_q8_mm). Integer sums are exact in any order and nothing is shared
    between rows, so a row's output is the same bits whatever other rows share the call.
    Inputs and outputs are float32. Runs on specbuild's kernel only (AVX512-VNNI, or AVX2: the
    same bits); a CPU without either cannot load it (the arithmetic defines the target, so there
    is no silent fallback to another)."""

    name = "int8-q8"
    quantizes_inputs = True

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        from specbuild.errors import BundleError

        super().__init__(qweight, scales.float(), torch.float32, kernel=False)
        if qweight.device.type != "cpu" or not cpu_kernels.int8_q8_available():
            why = (f"the weights are on {qweight.device}" if qweight.device.type != "cpu" else
                   cpu_kernels.status()["reason"] or "this CPU lacks AVX2 + FMA")
            raise BundleError("this bundle's lm_head takes int8 input blocks (compiled with --lm-head-activations "
                              "int8), which run on specbuild's int8 x int8 CPU kernel only (AVX512-VNNI or AVX2), "
                              f"not available here: {why}; recompile without --lm-head-activations int8")
        if self.qweight.shape[1] % cpu_kernels.Q8_BLOCK:
            raise BundleError(f"an lm_head with int8 input blocks needs in_features a multiple of "
                              f"{cpu_kernels.Q8_BLOCK}, got {self.qweight.shape[1]}")
        self.path = cpu_kernels.int8_q8_path()  # AVX512-VNNI or AVX2: the same bits
        self.kernel = self.path
        self.q8_packed = cpu_kernels.repack_int8_q8(self.qweight, self.scales)

    @property
    def float_sums(self) -> bool:
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] float32 -> [T, N] float32
        return cpu_kernels.int8_q8_mm(x.float().contiguous(), self.q8_packed, self.qweight.shape[0], self.path)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic spelled out in torch: rows rounded to int8 per block of 32 (the
        kernel's own quantiser), exact integer block sums (int64), combined in float64."""
        x = x.float()
        t, k = x.shape
        q, d, _ = torch.ops.specbuild_cpu.q8_quantize(x)
        n = self.qweight.shape[0]
        isum = torch.einsum("tbk,nbk->tnb", q.view(t, k // 32, 32).to(torch.int64),
                            self.qweight.view(n, k // 32, 32).to(torch.int64)).double()
        return ((isum * d.double().unsqueeze(1)).sum(-1) * self.scales.double()).float()

    @property
    def nbytes(self) -> int:
        return self.q8_packed.numel()


class Int4Format:
    """Grouped int4 with scale and zero. Keeps the portable nibbles [N, K / 2] for the
    reference and for copies; packs at construction into the layout of the kernel that runs
    it: specbuild's CPU kernel (cpu_kernels.choose: where it measured faster at load) or
    torch's (whose layout depends on the device and the torch version). N is padded to a
    multiple of 16 for either kernel."""

    kind = name = "int4"

    def __init__(self, nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 act_dtype: torch.dtype) -> None:
        n, half_k = nibbles.shape
        k = 2 * half_k
        if k % group_size or scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
            raise ValueError(f"int4 weight [{n}, {k}] with group_size {group_size} needs scales and zeros "
                             f"[{n}, {k // group_size}], got {tuple(scales.shape)} / {tuple(zeros.shape)}")
        self.out_features, self.in_features, self.group_size = n, k, group_size
        self.nibbles = nibbles.contiguous()
        self.scales, self.zeros = scales.to(act_dtype).contiguous(), zeros.to(act_dtype).contiguous()
        self.act_dtype = act_dtype
        q = unpack_nibbles(self.nibbles)
        self.kernel = cpu_kernels.choose("int4", act_dtype, q.device) if group_size % 8 == 0 else 0
        self.cpu_packed = self.packed = self.scales_zeros = None
        if self.kernel:  # specbuild's kernel: its layout only
            self.cpu_packed = cpu_kernels.repack_int4(q, self.scales, self.zeros, group_size,
                                                      act_dtype != torch.bfloat16)
            return
        pad = -n % 16
        scales_zeros = torch.stack([self.scales, self.zeros], dim=-1)  # [N, K / G, 2]
        if pad:
            q = torch.cat([q, torch.full((pad, k), 8, dtype=q.dtype, device=q.device)])
            scales_zeros = torch.cat([scales_zeros, scales_zeros.new_zeros(pad, *scales_zeros.shape[1:])])
        self.scales_zeros = aligned(scales_zeros.transpose(0, 1))  # [K / G, N_pad, 2]
        if q.device.type == "cuda":
            # CUDA takes the high nibble first and K in tiles of 16 * innerKTiles (8, 4 or 2);
            # untested here (no GPU): build_qlinears' self-check compares it with the reference
            hi_lo = (q[:, 0::2] << 4 | q[:, 1::2]).to(torch.uint8)
            tiles = next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)
            if tiles is None:
                raise ValueError(f"the CUDA int4 kernel needs in_features divisible by 32, got {k}")
            self.packed = torch.ops.aten._convert_weight_to_int4pack(hi_lo.contiguous(), tiles)
            self._mm = torch.ops.aten._weight_int4pack_mm
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
            self._mm = torch.ops.aten._weight_int4pack_mm_for_cpu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] act -> [T, N] act
        if self.kernel:
            return torch.ops.specbuild_cpu.int4_mm(x, self.cpu_packed, self.out_features, self.group_size,
                                                   self.act_dtype != torch.bfloat16, self.kernel)
        out = self._mm(x.contiguous(), self.packed, self.group_size, self.scales_zeros)
        return out[:, : self.out_features] if out.shape[1] != self.out_features else out

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.dense()).to(self.act_dtype)

    def dense(self) -> torch.Tensor:
        return dequantize_int4(unpack_nibbles(self.nibbles), self.scales, self.zeros, self.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads: the packed values and the scales/zeros."""
        if self.cpu_packed is not None:
            return self.cpu_packed.numel()
        return self.packed.numel() * self.packed.element_size() + \
            self.scales_zeros.numel() * self.scales_zeros.element_size()


class Int4Q8Format:
    """int4 weights (the Int4Format values: grouped scale + zero, GGUF Q4_1-derived) with
    int8 inputs: each input row is quantised on its own, per block of 32 inputs, to int8 with
    one float32 scale (d = amax / 127, q = nearest(x / d)), and per block the exact integer
    sums sum(v * q) and sum(q) enter a float32 accumulator through one fixed sequence of
    float operations (cpu_kernels.cpp, int4_q8_mm). Integer sums are exact in any order and
    nothing is shared between rows, so a row's output is the same bits whatever other rows
    share the call, and every ISA path (AVX512-VNNI, AVX-VNNI, AVX2) gives the same bits.
    Inputs and outputs are float32. Runs on specbuild's CPU kernel only: torch 2.13 has no
    x86 int4 x int8 kernel (`_dyn_quant_matmul_4bit` is ARM KleidiAI only)."""

    kind = "int4"
    name = "int4-a8"
    quantizes_inputs = True

    def __init__(self, nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> None:
        from specbuild.errors import BundleError

        n, half_k = nibbles.shape
        k = 2 * half_k
        if k % group_size or scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
            raise ValueError(f"int4 weight [{n}, {k}] with group_size {group_size} needs scales and zeros "
                             f"[{n}, {k // group_size}], got {tuple(scales.shape)} / {tuple(zeros.shape)}")
        if group_size % cpu_kernels.Q8_BLOCK:
            raise BundleError(f"int4 with int8 activations needs groups of a multiple of {cpu_kernels.Q8_BLOCK} "
                              f"inputs, got group_size {group_size}")
        self.out_features, self.in_features, self.group_size = n, k, group_size
        self.nibbles = nibbles.contiguous()
        self.scales, self.zeros = scales.float().contiguous(), zeros.float().contiguous()
        self.act_dtype = torch.float32
        self.path = cpu_kernels.q8_path() if nibbles.device.type == "cpu" else 0
        if not self.path:
            why = cpu_kernels.status()["reason"] if nibbles.device.type == "cpu" else f"the weights are on {nibbles.device}"
            raise BundleError("int4 weights with int8 activations run on specbuild's CPU kernel only (x86-64 with "
                              f"AVX2; torch has no int4 x int8 kernel for it), which cannot run here: {why}")
        self.kernel = self.path
        # fp16 scales where that is exact (GGUF Q4_1 weights): a sixth fewer bytes per step, same bits
        self.f16_scales = cpu_kernels.q8_fp16_exact(self.scales, self.zeros)
        self.cpu_packed = cpu_kernels.repack_int4_q8(unpack_nibbles(self.nibbles), self.scales, self.zeros,
                                                     group_size, self.f16_scales)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] float32 -> [T, N] float32
        return torch.ops.specbuild_cpu.int4_q8_mm(x, self.cpu_packed, self.out_features, self.group_size,
                                                  self.f16_scales, self.path)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic spelled out in torch: rows rounded to int8 per block of 32,
        exact integer block sums (int64), combined with the block scales in float64."""
        x = x.float()
        t, k = x.shape
        blocks = x.view(t, k // 32, 32)
        d = blocks.abs().amax(-1) / 127.0  # float32 division, like the kernel
        q = torch.where(d.unsqueeze(-1) > 0, torch.round(blocks / d.clamp_min(1e-38).unsqueeze(-1)).clamp_(-127, 127),
                        torch.zeros_like(blocks)).to(torch.int64)
        v = unpack_nibbles(self.nibbles).to(torch.int64).view(self.out_features, k // 32, 32)
        isum = torch.einsum("tbk,nbk->tnb", q, v).double()  # [T, N, blocks]
        per = self.group_size // 32
        s = self.scales.double().repeat_interleave(per, 1)  # [N, blocks]
        m = self.zeros.double().repeat_interleave(per, 1) - 8.0 * s
        out = (isum * s + q.sum(-1).double().unsqueeze(1) * m) * d.double().unsqueeze(1)
        return out.sum(-1).float()

    def dense(self) -> torch.Tensor:
        return dequantize_int4(unpack_nibbles(self.nibbles), self.scales, self.zeros, self.group_size)

    @property
    def nbytes(self) -> int:
        return self.cpu_packed.numel()


# ---- one weight, several formats ------------------------------------------------------------
class QLinear:
    """A weight [N, K] in a primary format plus optional copies for other widths.

    `dtype` is the dtype of the decoder's hidden states (outputs are cast to it);
    `exact[name]` says whether a copy gives the primary's numbers (up to summation order).
    """

    def __init__(self, primary, dtype: torch.dtype) -> None:
        self.primary = primary.name
        self.formats = {primary.name: primary}
        self.exact = {primary.name: True}
        self.dtype = dtype
        self.act_dtype = primary.act_dtype
        self.shape = tuple(primary.weight.shape) if primary.kind == "dense" else (
            (primary.out_features, primary.in_features) if primary.kind == "int4" else tuple(primary.qweight.shape))
        self.quantizes_inputs = getattr(primary, "quantizes_inputs", False)  # int8 activations (W8A8)
        self.rescore_top = 0  # lm_head: outputs recomputed in float32 for each row's top-k
        self.narrow: str | None = None  # the format width-1 forwards run in (set with a plan)

    def add_copy(self, name: str, kn: bool = False) -> None:
        """Add a dense copy (`float32`, `bfloat16`, `float16`; `<dtype>.kn` or kn=True: stored
        transposed, see DenseFormat; kn=True keeps the plain name) of the dequantised primary."""
        if name in self.formats:
            return
        kn = kn or name.endswith(".kn")
        dtype = ACT_DTYPES[name.removesuffix(".kn")]
        dense = self.formats[self.primary].dense()  # float32
        copy = DenseFormat(dense.to(dtype), self.act_dtype, kn=kn)
        copy.name = name
        self.formats[name] = copy
        # interchangeable per width only with float32 inputs and outputs: rounded to bfloat16, a
        # copy's other summation order flips whole ulps (measured: SmolLM2 int4 whose plan ran
        # widths >= 2 in the float32 copy diverged from plain decoding at a 6e-3 top-2 gap)
        self.exact[name] = bool(torch.equal(copy.weight.float(), dense)) and self.act_dtype == torch.float32

    def __call__(self, x: torch.Tensor, fmt: str | None = None, reference: bool = False) -> torch.Tensor:
        """x: [T, K] (any float dtype) -> [T, N] in self.dtype, through format `fmt` (the
        primary when None or not held)."""
        impl = self.formats.get(fmt) or self.formats[self.primary]
        xa = x.to(self.act_dtype)
        if self.rescore_top and self.act_dtype != torch.float32:
            if not reference and getattr(impl, "float_sums", False):
                # specbuild's int8 kernel: its float32 sums (fixed order per row, any width) as
                # they are, from the rounded inputs held in float32: every logit at float32
                # precision and row-invariant, so no top-k rescoring (~0.4 ms of a 2-thread step)
                return impl(xa.float())
            return self.rescored(xa, impl.reference(xa) if reference else impl(xa))
        out = impl.reference(xa) if reference else impl(xa)
        return out.to(self.dtype)

    def rescored(self, xa: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Logits [T, N] float32: the kernel's (rounded to the activation dtype: 3 digits,
        so ties and 1-ulp flips between widths decide greedy tokens) with each row's top
        `rescore_top` recomputed in float32 from the dequantised rows, one fixed-order dot
        product per entry, so a row's values do not depend on how many rows ran with it."""
        logits = out.float()
        if logits.shape[0] == 0:  # a forward that wants no logits (a prefill chunk)
            return logits
        idx = logits.topk(min(self.rescore_top, logits.shape[1]), dim=-1).indices  # [T, k]
        rows = self.rows(idx.reshape(-1), torch.float32).view(*idx.shape, -1)  # [T, k, K]
        exact = (rows * xa.float().unsqueeze(1)).sum(-1)  # [T, k]
        return logits.scatter_(1, idx, exact)

    def dense(self) -> torch.Tensor:
        """The weight's values as the primary format holds them: float32 [N, K]."""
        return self.formats[self.primary].dense()

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Embedding lookup: rows `ids` [T] dequantised -> [T, K] in dtype (self.dtype)."""
        impl, dtype = self.formats[self.primary], dtype or self.dtype
        if impl.kind == "dense":
            return impl.weight.index_select(0, ids).to(dtype)
        if impl.kind == "int8":
            return dequantize_int8(impl.qweight.index_select(0, ids), impl.scales.index_select(0, ids)).to(dtype)
        q = unpack_nibbles(impl.nibbles.index_select(0, ids))
        return dequantize_int4(q, impl.scales.index_select(0, ids), impl.zeros.index_select(0, ids),
                               impl.group_size).to(dtype)

    def nbytes(self, fmt: str | None = None) -> int:
        return (self.formats.get(fmt) or self.formats[self.primary]).nbytes

    def to(self, device) -> "QLinear":
        if _device(self) != torch.device(device):
            raise ValueError(f"a QLinear is built on its device at load; it is on {_device(self)}, not {device}")
        return self


def linear(x: torch.Tensor, weight, fmt: str | None = None, bias: torch.Tensor | None = None,
           rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The decoder's one linear dispatch. x: [T, K]; weight: a tensor [N, K] (F.linear,
    unchanged) or a QLinear (run through `fmt`). Returns [T, N]. `rows`: (min, max) rows per
    call (rows_policy): fewer rows are padded with copies of the last, more are cut."""
    if rows is not None:
        t, (lo, hi) = x.shape[0], rows
        if t > hi:
            return torch.cat([linear(x[i:i + hi], weight, fmt, bias, rows) for i in range(0, t, hi)])
        if 0 < t < lo:
            padded = torch.cat([x, x[-1:].expand(lo - t, x.shape[1])])
            return linear(padded, weight, fmt, bias)[:t]
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    out = weight(x, fmt)
    return out + bias if bias is not None else out


def embed_rows(embed, ids: torch.Tensor) -> torch.Tensor:
    """Embedding rows for token ids [T] -> [T, hidden]."""
    if isinstance(embed, torch.Tensor):
        return embed.index_select(0, ids)
    return embed.rows(ids)


def as_dense(weight) -> torch.Tensor:
    """A tensor as is; a QLinear as its dequantised values in its hidden dtype."""
    return weight if isinstance(weight, torch.Tensor) else weight.dense().to(weight.dtype)


def weight_nbytes(weight) -> int:
    """Bytes a narrow (width-1) step reads for this weight: those of the format a plan runs
    width 1 in, else the primary format's."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return weight.nbytes(weight.narrow)


# ---- a format per width, from costs measured at start-up -----------------------------------
class FormatPlan:
    """Which format to run a forward of T rows in: `formats[i]` for T <= bounds[i] (the last
    beyond). `costs_ms[fmt][width]` keeps what was measured (for reports)."""

    def __init__(self, bounds: tuple[int, ...], formats: tuple[str, ...],
                 costs_ms: dict[str, dict[int, float]] | None = None) -> None:
        if len(bounds) != len(formats) or not formats or list(bounds) != sorted(bounds):
            raise ValueError(f"a FormatPlan needs ascending bounds, one per format: {bounds} / {formats}")
        self.bounds, self.formats, self.costs_ms = tuple(bounds), tuple(formats), costs_ms or {}

    def choose(self, width: int) -> str:
        for bound, fmt in zip(self.bounds, self.formats):
            if width <= bound:
                return fmt
        return self.formats[-1]

    @classmethod
    def from_costs(cls, costs_ms: dict[str, dict[int, float]], max_width: int = 4096) -> "FormatPlan":
        """Fit cost = a + b * width to each format's measurements (least squares, so one
        noisy sample cannot flip a width), then take the cheapest line at every width up to
        max_width among the formats measured that wide (measure_costs stops measuring a
        format that fell far behind); neighbouring widths with the same choice merge."""
        lines = {f: fit_line(c) for f, c in costs_ms.items() if c}
        reach = {f: max(c) for f, c in costs_ms.items() if c}  # widths beyond: no extrapolating
        widest = max(reach.values())
        bounds: list[int] = []
        formats: list[str] = []
        for w in range(1, max_width + 1):
            known = [f for f in lines if reach[f] >= min(w, widest)]
            best = min(known, key=lambda f: (lines[f][0] + lines[f][1] * w, f))
            if formats and formats[-1] == best:
                bounds[-1] = w
            else:
                bounds.append(w)
                formats.append(best)
        return cls(tuple(bounds), tuple(formats), costs_ms)

    def describe(self) -> str:
        lo, parts = 1, []
        for bound, fmt in zip(self.bounds, self.formats):
            parts.append(f"{fmt} for widths {lo}-{bound}" if bound > lo else f"{fmt} for width {lo}")
            lo = bound + 1
        parts[-1] += " and wider"
        return ", ".join(parts)


def fit_line(costs: dict[int, float]) -> tuple[float, float]:
    """Least-squares (intercept, slope >= 0) of cost against width; one point: flat."""
    if len(costs) == 1:
        return next(iter(costs.values())), 0.0
    ws, cs = list(costs), list(costs.values())
    mw, mc = sum(ws) / len(ws), sum(cs) / len(cs)
    var = sum((w - mw) ** 2 for w in ws)
    slope = max(sum((w - mw) * (c - mc) for w, c in zip(ws, cs)) / var, 0.0) if var else 0.0
    return mc - slope * mw, slope


def usable_formats(linears: list[QLinear], allow_inexact: bool = False) -> list[str]:
    """Formats every QLinear holds (exact copies of its primary only, unless allowed)."""
    names = [f for f in linears[0].formats if all(f in q.formats for q in linears)]
    return [f for f in names if allow_inexact or all(q.exact[f] for q in linears)]


def measure_costs(linears: list[QLinear], formats: list[str], widths: list[int], repeats: int = 5) -> dict[str, dict[int, float]]:
    """Milliseconds to run every linear once at each width, per format: the best of
    `repeats` rounds (formats interleaved within a round), which other load on a shared
    machine can only make worse, never better."""
    import time

    costs: dict[str, dict[int, float]] = {f: {} for f in formats}
    live = list(formats)
    for w in widths:
        inputs = [torch.randn(w, q.shape[1]).to(device=_device(q), dtype=q.act_dtype) for q in linears]
        best = {f: float("inf") for f in live}
        for r in range(repeats + 1):
            for f in live:
                if r and best[f] > 0.05:  # a slow format (e.g. int4 with float32 inputs): once is enough
                    continue
                impls = [q.formats[f] for q in linears]
                t0 = time.perf_counter()
                for impl, x in zip(impls, inputs):
                    impl(x)
                best[f] = min(best[f], time.perf_counter() - t0)
        for f in live:
            costs[f][w] = best[f] * 1e3
        cheapest = min(best.values())
        live = [f for f in live if best[f] <= 4 * cheapest]  # 4x behind: not measured wider
    return costs


def measure_plan(linears: list[QLinear], widths: list[int], repeats: int = 5,
                 allow_inexact: bool = False) -> FormatPlan | None:
    """A plan for these linears (e.g. a few layers' worth: costs scale with the count), or
    None when they hold a single usable format."""
    formats = usable_formats(linears, allow_inexact) if linears else []
    if len(formats) < 2:
        return None
    return FormatPlan.from_costs(measure_costs(linears, formats, sorted(set(widths)), repeats))


def self_check(q: QLinear, rows: int = 3, seed: int = 0) -> float:
    """Run every format of q against its reference on random input; returns the largest
    error relative to the output's magnitude. A packed layout that this torch build reads
    differently shows up here as an O(1) error."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, q.shape[1], generator=gen).to(device=_device(q))
    worst = 0.0
    for name in q.formats:
        fast, ref = q(x, name).float(), q(x, name, reference=True).float()
        worst = max(worst, float((fast - ref).abs().max()) / (float(ref.abs().max()) + 1e-30))
    return worst


def _device(q: QLinear) -> torch.device:
    impl = q.formats[q.primary]
    return (impl.weight if impl.kind == "dense" else impl.qweight if impl.kind == "int8" else impl.nibbles).device


# ---- load: bundle tensors -> QLinear objects ---------------------------------------------------
_auto_said: set[str] = set()


def auto_activations(device: torch.device) -> str:
    """What an `--activations auto` int4 bundle's layers multiply in here: "int8" (int4-a8:
    input blocks of 32 rounded to int8, specbuild's int4 x int8 kernel; the faster verify passes,
    perplexity +0.07-0.26% of float32's, docs/cpu-kernels.md) where that kernel runs, else
    "bfloat16" (the int4 kernels with bfloat16 inputs). Says which and why once per process."""
    path = cpu_kernels.q8_path() if device.type == "cpu" else 0
    if path:
        choice = "int8"
        why = f"this CPU runs specbuild's int4 x int8 kernel ({cpu_kernels.Q8_PATHS[path]})"
    else:
        choice = "bfloat16"
        why = (f"the weights are on {device}" if device.type != "cpu" else
               f"specbuild's int4 x int8 kernel cannot run here: {cpu_kernels.status()['reason']}")
    line = f"specbuild: --activations auto: the int4 layers take {'int8 input blocks (int4-a8)' if path else 'bfloat16 inputs'} ({why})"
    if line not in _auto_said:
        _auto_said.add(line)
        print(line, file=sys.stderr)
    return choice


def build_qlinears(tensors: dict[str, torch.Tensor], quant: dict, check: bool = True) -> dict:
    """weights.safetensors' tensors + quant.json (compiler/quantize.py) -> the decoder's weight
    dict: plain tensors as they are, every other weight a QLinear (packed here), quantized
    ones with the dense copies quant.json's `formats` names. `check` runs each kind of fast
    path once against its reference (a torch whose packed layout differs fails here)."""
    from specbuild.errors import BundleError

    dtype = tensors["norm"].dtype  # the hidden states' dtype (norms stay plain)
    requested = quant.get("activations", "bfloat16")
    if requested == "auto":
        requested = auto_activations(tensors["norm"].device)
    # int8 activations: int8-a8 (int8 weights, per-row int8 inputs) or int4-a8 (int4 weights,
    # int8 input blocks of 32; its int8 lm_head stays weight-only with float32 inputs)
    dynamic = requested == "int8"
    int8_dynamic = dynamic and quant.get("quantize") != "int4"
    act = torch.float32 if dynamic else ACT_DTYPES[requested]
    out = dict(tensors)
    checked: set[str] = set()
    # the lm_head's inputs: int8 blocks of 32 (int8, or auto where specbuild's int8 x int8 kernel
    # runs: AVX512-VNNI or AVX2, the same bits) or float32
    head_acts = quant.get("lm_head_activations", "float32")
    head_q8 = head_acts == "int8" or (head_acts == "auto" and tensors["norm"].device.type == "cpu"
                                      and cpu_kernels.int8_q8_available())
    if head_acts != "float32" and check:
        how = f"--lm-head-activations {head_acts}"
        if head_q8:
            path = cpu_kernels.INT8_Q8_PATHS.get(cpu_kernels.int8_q8_path(), "?")
            print(f"specbuild: {how}: the lm_head takes int8 input blocks of 32 (perplexity within 1% of float32's, "
                  f"docs/cpu-kernels.md) through specbuild's int8 x int8 kernel ({path})", file=sys.stderr)
        else:
            print(f"specbuild: {how}: the lm_head takes float32 inputs (specbuild's int8 x int8 kernel "
                  "cannot run here)", file=sys.stderr)
    for name, entry in quant.get("tensors", {}).items():
        fmt = entry["format"]
        if fmt == "dense":
            continue
        if fmt == "int4" and dynamic:
            impl = Int4Q8Format(out.pop(name + ".qweight"), out.pop(name + ".scales"), out.pop(name + ".zeros"),
                                int(entry["group_size"]))
        elif fmt == "int4":
            impl = Int4Format(out.pop(name + ".qweight"), out.pop(name + ".scales"), out.pop(name + ".zeros"),
                              int(entry["group_size"]), act)
        elif fmt == "int8" and int8_dynamic:
            impl = Int8DynFormat(out.pop(name + ".qweight"), out.pop(name + ".scales"))
        elif fmt == "int8" and head_q8 and _is_lm_head(name, quant, out):
            impl = Int8Q8Format(out.pop(name + ".qweight"), out.pop(name + ".scales"))
        elif fmt == "int8":
            impl = Int8Format(out.pop(name + ".qweight"), out.pop(name + ".scales"), act)
        elif fmt in ACT_DTYPES:
            impl = DenseFormat(out.pop(name), ACT_DTYPES[fmt])
        else:
            raise BundleError(f"quant.json: {name} has format {fmt!r}; this specbuild reads "
                              f"int4, int8, {', '.join(ACT_DTYPES)}")
        q = QLinear(impl, dtype)
        if _is_lm_head(name, quant, out):
            q.rescore_top = RESCORE_TOP
        if fmt in ("int4", "int8") and not dynamic and not getattr(impl, "quantizes_inputs", False):
            # (a dense copy would skip the input rounding)
            for copy in quant.get("formats", []):  # the wide-step copies: transposed on CPU (cheaper there)
                q.add_copy(copy, kn=dtype != torch.float64 and tensors["norm"].device.type == "cpu")
        if check and fmt not in checked:
            err = self_check(q)
            if err > 2e-2:
                raise BundleError(f"{name}: the {fmt} kernel of torch {torch.__version__} disagrees with its "
                                  f"reference by {err:.3g} (relative); this torch packs differently")
            checked.add(fmt)
        out[name] = q
    return out


def _is_lm_head(name: str, quant: dict, weights: dict) -> bool:
    """Whether weight `name` serves as the lm_head: the lm_head, or a tied embedding."""
    return name == "lm_head" or (name == "embed" and "lm_head" not in quant["tensors"] and "lm_head" not in weights)


LINEAR_SUFFIXES = (".qkv", ".o", ".gate_up", ".down")


def _plain_linears(weights: dict) -> list[str]:
    """Names of the plain float linears a layout choice may move: the layers', the lm_head
    and the embedding (the lm_head when tied)."""
    return [name for name, t in weights.items()
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.is_floating_point() and
            (name in ("embed", "lm_head") or (name.startswith("layers.") and name.endswith(LINEAR_SUFFIXES)))]


def to_kn_layout(weights: dict, dtypes: set | None = None) -> int:
    """Store every plain float linear of a runtime weight dict (the layers', the lm_head and
    the embedding, which is the lm_head when tied) transposed: [K, N] contiguous, kept as
    its [N, K] view, so every user still sees the same shape and values and F.linear runs
    the other kernel (see DenseFormat). Only tensors of `dtypes` when given. In place;
    returns the number of tensors moved."""
    count = 0
    for name in _plain_linears(weights):
        t = weights[name]
        if t.is_contiguous() and (dtypes is None or t.dtype in dtypes):
            weights[name] = aligned(t.t()).t()
            count += 1
    return count


LAYOUT_WIDTHS = (1, 5)  # a decode step and a typical verify pass weigh equally in the choice


def layout_costs(weights: dict, sample_layers: int = 2, repeats: int = 5) -> dict[str, dict[str, float]]:
    """Per dtype of the plain layer linears: milliseconds to run the first `sample_layers`
    layers' linears once at each of LAYOUT_WIDTHS, stored as rows ([N, K], "nk") and
    transposed ([K, N], "kn"): the best of `repeats` rounds, layouts interleaved."""
    import time

    names = [n for n in _plain_linears(weights) if n.startswith("layers.") and int(n.split(".")[1]) < sample_layers]
    out: dict[str, dict[str, float]] = {}
    for dtype in sorted({weights[n].dtype for n in names}, key=str):
        group = [weights[n] for n in names if weights[n].dtype == dtype]
        layouts = {"nk": [aligned(t) for t in group], "kn": [aligned(t.t()).t() for t in group]}
        total = {k: 0.0 for k in layouts}
        for w in LAYOUT_WIDTHS:
            xs = [torch.randn(w, t.shape[1], dtype=dtype, device=t.device) for t in group]
            t_w = {k: float("inf") for k in layouts}
            for r in range(repeats + 1):
                for k, ws in layouts.items():
                    t0 = time.perf_counter()
                    for x, t in zip(xs, ws):
                        F.linear(x, t)
                    if r:  # the first round warms up each kernel
                        t_w[k] = min(t_w[k], time.perf_counter() - t0)
            for k in layouts:
                total[k] += t_w[k] * 1e3
        out[str(dtype).removeprefix("torch.")] = {k: round(v, 4) for k, v in total.items()}
    return out


def choose_layouts(weights: dict, costs: dict[str, dict[str, float]] | None = None) -> dict:
    """Store each dtype's plain linears in the layout measured cheaper on this machine
    (layout_costs, or `costs` given): transposed where "kn" costs less than "nk" (float32 on
    the machines measured so far), as they are otherwise (bfloat16 through oneDNN: measured on
    a 2-core EPYC with AVX-512 BF16, SmolLM2-135M's linears, one thread, one row 18.6 ms as
    rows and 29.3 transposed). In place; returns {dtype: {"nk", "kn", "chosen"}}."""
    costs = costs if costs is not None else layout_costs(weights)
    chosen = {}
    for name, c in costs.items():
        chosen[name] = {**c, "chosen": "kn" if c["kn"] < c["nk"] else "nk"}
    kn = {getattr(torch, n) for n, c in chosen.items() if c["chosen"] == "kn"}
    if kn:
        to_kn_layout(weights, kn)
    return chosen


# ---- row invariance --------------------------------------------------------------------------
INVARIANT_PROBE_ROWS = 64


def _probe_pair(shape: tuple, transposed: bool, dtype: torch.dtype, device, cancel: bool, rows: int, seed: int):
    """A probe weight of `shape` stored like the real one ([K, N] contiguous when
    `transposed`) and probe inputs [rows, K]. cancel=True: weight rows [u, u] against inputs
    [v, -v], whose exact products are 0, so what is left is rounding that depends on the
    summation order and survives a half-precision output (random values hide most order
    differences under the output's rounding: measured, ~1 output in 5,000)."""
    n, k = shape
    gen = torch.Generator().manual_seed(seed)
    if cancel and k % 2 == 0:
        u, v = torch.randn(n, k // 2, generator=gen), torch.randn(rows, k // 2, generator=gen)
        w, x = torch.cat([u, u], 1), torch.cat([v, -v], 1)
    else:
        w, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    w = w.to(device=device, dtype=dtype)
    w = aligned(w.t()).t() if transposed else aligned(w)
    return w, x.to(device=device, dtype=dtype)


def width_classes(shape: tuple, transposed: bool, dtype: torch.dtype, device="cpu", bias: bool = False,
                  max_rows: int = INVARIANT_PROBE_ROWS, rows: int = 32) -> list[int]:
    """For each width m in 1..max_rows, the smallest width whose F.linear results equal m's
    on the first `rows` probe rows (run in calls of m rows), on two probes (cancelling and
    random, see _probe_pair): widths in one class give a row the same bits. Kernel libraries
    switch kernels, and so summation orders, with the row count: oneDNN's bfloat16 matmul
    with torch 2.13 on a 2-core EPYC (AVX-512 BF16) runs one row differently from 2 or more
    when K = 1536 (SmolLM2's down projection), not when K = 576; float32 splits 1 / 2-3 /
    4+ rows."""
    outs = []
    for cancel in (True, False):
        w, x = _probe_pair(shape, transposed, dtype, device, cancel, max(rows, max_rows), 1)
        b = torch.randn(shape[0]).to(device=device, dtype=dtype) if bias else None
        per = []
        for m in range(1, max_rows + 1):
            n = max(rows, m)
            per.append(torch.cat([F.linear(x[i:i + m], w, b) for i in range(0, n, m)])[:rows])
        outs.append(per)
    classes: list[int] = []
    for m in range(max_rows):
        same = next(j for j in range(m + 1) if all(torch.equal(o[j], o[m]) for o in outs))
        classes.append(same + 1)
    return classes


def rows_policy(classes: list[int]) -> tuple[int, int]:
    """(min_rows, max_rows) for a weight whose widths 1..len(classes) fall into `classes`
    (width_classes): every call padded to at least min_rows and cut into pieces of at most
    max_rows rows sees one kernel, so a row's bits never depend on the others. Chunking at
    the width-1 class's reach when that covers verify passes (17 rows), else padding up to
    where the widest class starts (one row padded to two costs little where the cost is
    flat in the width, as bfloat16's is)."""
    top = len(classes)
    if all(c == classes[0] for c in classes):
        return 1, top
    reach = next((m for m in range(top) if classes[m] != classes[0]), top)  # widths 1..reach share width 1's
    start = top
    while start > 1 and classes[start - 2] == classes[-1]:
        start -= 1  # widths start..top share the widest one's
    if reach >= 17 or start * 2 > top:
        return 1, reach
    return start, top


def attach_plans(decoder, widths: list[int], sample_layers: int = 4, allow_inexact: bool = False) -> dict:
    """Measure and set `decoder.plans` (format per width for the layers and the lm_head)
    when its QLinear weights hold more than one usable format. Costs are measured over the
    first `sample_layers` layers (they scale with the count). Returns the plans."""
    w = decoder.w
    layer = [v for k, v in w.items() if isinstance(v, QLinear) and k.startswith("layers.")
             and int(k.split(".")[1]) < sample_layers]
    plans = {}
    groups = {"layers": [v for k, v in w.items() if isinstance(v, QLinear) and k.startswith("layers.")],
              "lm_head": [decoder.lm_head] if isinstance(decoder.lm_head, QLinear) else []}
    for group, sample in (("layers", layer), ("lm_head", groups["lm_head"])):
        plan = measure_plan(sample, widths, allow_inexact=allow_inexact) if sample else None
        if plan is not None:
            plans[group] = plan
            for q in groups[group]:
                q.narrow = plan.choose(1)
    decoder.plans = plans
    return plans
