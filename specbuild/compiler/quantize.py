"""Weight-only quantization at compile time: int8 per row, int4 grouped (scale + zero), and
GGUF blocks carried over (Q4_1 onto int4 exactly; Q8_0 converted).

Stored in the bundle unpacked (torch's packed layouts depend on the device and torch
version, so the runtime packs at load), under the runtime name plus a suffix:

    int8   <name>.qweight  int8  [N, K]        <name>.scales  float32 [N]
    int4   <name>.qweight  uint8 [N, K / 2]    values 0..15 two per byte, low nibble = even column
           <name>.scales   float32 [N, K / G]  <name>.zeros   float32 [N, K / G]
           weight = (q - 8) * scale + zero
    dense in another dtype than the bundle's: <name> in that dtype

Scales and zeros are stored already rounded to the activation dtype, so what the runtime
multiplies is what was measured here. Each converted tensor reports its largest weight
change against the source's own values (a GGUF's dequantised blocks, or the float
checkpoint), and how it got there:

    exact      the source's values, bit for bit (Q4_1 -> int4 with float32 activations)
    rounded    the source's codes with scales/zeros rounded to the activation dtype
    converted  re-quantised from a quantized source (Q8_0 -> int8, Q4_1 -> int4 group 64)
    quantized  quantised from float weights
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbuild.errors import SpecbuildError
# quantize_int8 lives beside its inverse in the model layer (the runtime quantizes the EAGLE head too)
from specbuild.model.qlinear import ACT_DTYPES, dequantize_int4, dequantize_int8, pack_nibbles, quantize_int8

LINEAR_FORMATS = ("dense", "float32", "bfloat16", "float16", "int8", "int4")
GROUP_SIZES = (32, 64, 128)
Q4_1_BLOCK, Q4_1_BYTES = 32, 20  # 32 weights: fp16 d, fp16 m, 16 bytes of nibbles
Q8_0_BLOCK, Q8_0_BYTES = 32, 34  # 32 weights: fp16 d, 32 int8


@dataclass(frozen=True)
class Quantized:
    """One tensor in its bundle format: the tensors to store and what happened to it."""

    format: str  # int8 | int4 | float32 | bfloat16 | float16
    tensors: dict[str, torch.Tensor]  # suffix ("" for dense, ".qweight", ...) -> tensor
    conversion: str  # exact | rounded | converted | quantized
    max_abs_change: float  # largest |new - source| over the weights
    group_size: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


# ---- quantizers --------------------------------------------------------------------------
def quantize_int4(w: torch.Tensor, group_size: int, act_dtype: torch.dtype = torch.bfloat16
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group_size` inputs. w: [N, K] -> (q uint8 [N, K] values
    0..15, scales float32 [N, K / G], zeros float32 [N, K / G]); weight ~= (q - 8) * scale + zero,
    scale and zero representable in act_dtype (the codes are chosen after that rounding)."""
    n, k = w.shape
    if k % group_size:
        raise SpecbuildError(f"group_size {group_size} does not divide in_features {k}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15.0).to(act_dtype).float()
    zeros = (lo + 8.0 * scales).to(act_dtype).float()
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round((g - zeros.unsqueeze(-1)) / safe.unsqueeze(-1)) + 8.0
    q = torch.where(scales.unsqueeze(-1) == 0, torch.full_like(q, 8.0), q)
    return q.clamp_(0, 15).to(torch.uint8).reshape(n, k), scales, zeros


# ---- GGUF blocks -------------------------------------------------------------------------
def q4_1_codes(raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows raw: [N, K / 32 * 20] uint8 -> (q uint8 [N, K] 0..15, d float32 [N, K / 32],
    m float32 [N, K / 32]) with gguf's value d * q + m. Block: fp16 d, fp16 m, then 16 bytes
    whose low nibbles are weights 0..15 and high nibbles weights 16..31."""
    n, nb = raw.shape[0], k // Q4_1_BLOCK
    if raw.shape[1] != nb * Q4_1_BYTES or k % Q4_1_BLOCK:
        raise SpecbuildError(f"Q4_1 rows of {raw.shape[1]} bytes do not hold {k} weights")
    blocks = raw.reshape(n, nb, Q4_1_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, nb).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, nb).float()
    qs = blocks[..., 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k)
    return q, d, m


def q8_0_values(raw: torch.Tensor, k: int) -> torch.Tensor:
    """Q8_0 rows raw: [N, K / 32 * 34] uint8 -> float32 [N, K] = d * q (gguf's values)."""
    n, nb = raw.shape[0], k // Q8_0_BLOCK
    if raw.shape[1] != nb * Q8_0_BYTES or k % Q8_0_BLOCK:
        raise SpecbuildError(f"Q8_0 rows of {raw.shape[1]} bytes do not hold {k} weights")
    blocks = raw.reshape(n, nb, Q8_0_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [N, nb, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).reshape(n, k)


def carry_q4_1(raw: torch.Tensor, k: int, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Q4_1 -> int4 group 32: same codes, scale = d, zero = m + 8 d (exact in float32: both
    are fp16 values), rounded to act_dtype. Returns (q, scales, zeros, exact)."""
    q, d, m = q4_1_codes(raw, k)
    zeros = m + 8.0 * d
    scales_a, zeros_a = d.to(act_dtype).float(), zeros.to(act_dtype).float()
    return q, scales_a, zeros_a, bool(torch.equal(scales_a, d) and torch.equal(zeros_a, zeros))


# ---- one tensor ----------------------------------------------------------------------------
def convert_tensor(w: torch.Tensor, fmt: str, act: str, group_size: int,
                   raw: tuple[str, torch.Tensor] | None = None) -> Quantized:
    """w: the source's float32 values [N, K]; raw: (GGUF type, rows' bytes) when the source
    was quantized. Returns the tensor in format `fmt` with its report."""
    # int8 activations (and auto, which may load as them): float32 scales, as exact as the source
    act_dtype = torch.float32 if act in ("int8", "auto") else ACT_DTYPES[act]
    w = w.float()
    source_type = raw[0] if raw is not None else None
    if fmt == "int4":
        if source_type == "Q4_1" and group_size == Q4_1_BLOCK:
            q, scales, zeros, exact = carry_q4_1(raw[1], w.shape[1], act_dtype)
            how = "exact" if exact else "rounded"
        else:
            q, scales, zeros = quantize_int4(w, group_size, act_dtype)
            how = "converted" if source_type in ("Q4_1", "Q8_0") else "quantized"
        change = float((dequantize_int4(q, scales, zeros, group_size) - w).abs().max())
        if how == "exact" and change != 0.0:
            raise AssertionError(f"Q4_1 carried exactly but changed a weight by {change}")
        tensors = {".qweight": pack_nibbles(q), ".scales": scales, ".zeros": zeros}
        return Quantized("int4", tensors, how, change, group_size)
    if fmt == "int8":
        q, scales = quantize_int8(w, act_dtype)
        change = float((dequantize_int8(q, scales) - w).abs().max())
        how = "converted" if source_type in ("Q4_1", "Q8_0") else "quantized"
        return Quantized("int8", {".qweight": q, ".scales": scales}, how, change)
    if fmt in ("float32", "bfloat16", "float16"):
        dense = w.to(ACT_DTYPES[fmt])
        change = float((dense.float() - w).abs().max())
        return Quantized(fmt, {"": dense}, "exact" if change == 0.0 else "converted", change)
    raise SpecbuildError(f"weight format {fmt!r} is not one of {', '.join(LINEAR_FORMATS)}")


def fused_raw(raw_quant: dict, parts: list[str]) -> tuple[str, torch.Tensor] | None:
    """The raw blocks of HF tensors fused by rows (q/k/v, gate/up), when all share a type."""
    got = [raw_quant.get(p) for p in parts]
    if any(g is None for g in got) or len({g[0] for g in got}) != 1:
        return None
    return got[0][0], torch.cat([g[1] for g in got])


def runtime_raw(raw_quant: dict, num_layers: int, tied: bool) -> dict[str, tuple[str, torch.Tensor]]:
    """HF-named raw GGUF blocks -> runtime names (fused like checkpoints.to_runtime_layout)."""
    out = {}
    for hf, rt in (("model.embed_tokens.weight", "embed"), ("lm_head.weight", "lm_head")):
        if hf in raw_quant and not (rt == "lm_head" and tied):
            out[rt] = (raw_quant[hf][0], raw_quant[hf][1])
    for i in range(num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for rt, parts in ((".qkv", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                          (".o", [a + "o_proj.weight"]), (".gate_up", [m + "gate_proj.weight", m + "up_proj.weight"]),
                          (".down", [m + "down_proj.weight"])):
            fused = fused_raw(raw_quant, parts)
            if fused is not None:
                out[f"layers.{i}{rt}"] = fused
    return out


def tensor_formats(names: list[str], quantize: str, embedding_format: str, lm_head_format: str,
                   tied: bool) -> dict[str, str]:
    """Runtime weight name -> format for every 2-D weight ("dense" = the bundle dtype)."""
    linear = "dense" if quantize == "none" else quantize
    out = {}
    for n in names:
        if n == "embed":
            if tied and embedding_format != "dense" and lm_head_format != "dense" and embedding_format != lm_head_format:
                raise SpecbuildError(f"embeddings are tied to the lm_head: --embedding-format {embedding_format} "
                                     f"and --lm-head-format {lm_head_format} must agree (one tensor)")
            out[n] = (lm_head_format if lm_head_format != "dense" else embedding_format) if tied else embedding_format
        elif n == "lm_head":
            out[n] = lm_head_format
        elif n.rsplit(".", 1)[-1] in ("qkv", "o", "gate_up", "down"):
            out[n] = linear
    return out


def check_quant_options(options) -> None:
    """Validate CompileOptions' quantization fields (errors name the value and the choices)."""
    if options.quantize not in ("none", "int8", "int4"):
        raise SpecbuildError(f"--quantize {options.quantize!r} is not one of none, int8, int4")
    if options.group_size not in GROUP_SIZES:
        raise SpecbuildError(f"--group-size {options.group_size} is not one of {', '.join(map(str, GROUP_SIZES))}")
    if options.activations not in ("bfloat16", "float32", "int8", "auto"):
        raise SpecbuildError(f"activations {options.activations!r} is not one of bfloat16, float32, int8, auto")
    if options.activations == "auto" and options.quantize != "int4":
        # auto picks at load between int4-a8 and int4 with bfloat16 inputs: both read the same
        # int4 values (scales kept exact, rounded to bfloat16 at load where that path runs)
        raise SpecbuildError(f"--activations auto needs --quantize int4 (it chooses the int4 layers' input "
                             f"format at load), got --quantize {options.quantize!r}")
    if options.activations == "int8":
        # int8-a8 (--quantize int8) runs through torch._int_mm (int8 x int8 -> int32); int4-a8
        # (--quantize int4) through specbuild's own int4 x int8 CPU kernel (model/cpu_kernels.py;
        # torch has none for x86: _dyn_quant_matmul_4bit is KleidiAI, ARM only), whose int8 input
        # blocks are 32 inputs, so a group must hold whole blocks (every GROUP_SIZES entry does)
        if options.quantize not in ("int8", "int4"):
            raise SpecbuildError(f"--activations int8 needs --quantize int8 or int4, got --quantize "
                                 f"{options.quantize!r}")
        if options.quantize == "int8":
            for flag, value in (("--embedding-format", options.embedding_format),
                                ("--lm-head-format", options.lm_head_format)):
                if value == "int4":
                    raise SpecbuildError(f"--activations int8 with --quantize int8 runs int8 weights only; {flag} "
                                         "int4 is not one of them (--quantize int4 runs int4 with int8 inputs)")
    for flag, value in (("--embedding-format", options.embedding_format), ("--lm-head-format", options.lm_head_format)):
        if value not in LINEAR_FORMATS:
            raise SpecbuildError(f"{flag} {value!r} is not one of {', '.join(LINEAR_FORMATS)}")
    lm_acts = getattr(options, "lm_head_activations", "float32")
    if lm_acts not in ("float32", "int8", "auto"):
        raise SpecbuildError(f"--lm-head-activations {lm_acts!r} is not one of float32, int8, auto")
    if lm_acts != "float32" and options.lm_head_format != "int8":
        raise SpecbuildError(f"--lm-head-activations {lm_acts} rounds the inputs of an int8 lm_head; it needs "
                             f"--lm-head-format int8, got --lm-head-format {options.lm_head_format!r}")
    bad = [f for f in options.formats if f not in ("float32", "bfloat16")]
    if bad:
        raise SpecbuildError(f"formats {bad} are not among float32, bfloat16")


def quantize_role(ckpt, weights: dict[str, torch.Tensor], dtype: str, options) -> dict | None:
    """Replace the weights that options put in another format by their stored tensors (in
    place) and return quant.json's content; None when every weight stays a plain `dtype` one."""
    from specbuild.formats.checkpoints import to_runtime_layout

    c = ckpt.config
    formats = tensor_formats(list(weights), options.quantize, options.embedding_format, options.lm_head_format,
                             c.tie_word_embeddings)
    convert = {n: f for n, f in formats.items() if f not in ("dense", dtype)}
    if not convert:
        return None
    for name, fmt in convert.items():
        k = weights[name].shape[1]
        if fmt == "int4" and k % options.group_size:
            raise SpecbuildError(f"--group-size {options.group_size} does not divide the {k} inputs of {name}; "
                                 f"use one of {', '.join(str(g) for g in GROUP_SIZES if k % g == 0) or 'none'}")
    source = weights if dtype == "float32" else to_runtime_layout(ckpt, torch.float32)
    raw = runtime_raw(getattr(ckpt, "raw_quant", {}), c.num_layers, c.tie_word_embeddings)
    entries: dict[str, dict] = {}
    for name, fmt in formats.items():
        src_type = ckpt.quant_types.get(_hf_name(name), "F32") if ckpt.source_format == "gguf" else "float"
        if name not in convert:
            w = weights[name]
            same = w is source[name] or torch.equal(w.float(), source[name].float())
            entries[name] = {"format": "dense", "source_type": src_type, "conversion": "exact" if same else "converted",
                             "bytes": w.numel() * w.element_size()}
            continue
        q = convert_tensor(source[name], fmt, options.activations, options.group_size, raw.get(name))
        del weights[name]
        for suffix, t in q.tensors.items():
            weights[name + suffix] = t.contiguous()
        entries[name] = {"format": fmt, "source_type": src_type, "conversion": q.conversion,
                         "max_abs_change": q.max_abs_change, "bytes": q.nbytes}
        if q.group_size is not None:
            entries[name]["group_size"] = q.group_size
    by_format: dict[str, int] = {}
    for name, t in weights.items():
        fmt = formats.get(name.rsplit(".", 1)[0] if name not in formats else name, "dense")
        key = dtype if fmt == "dense" else fmt
        by_format[key] = by_format.get(key, 0) + t.numel() * t.element_size()
    conversions: dict[str, int] = {}
    for e in entries.values():
        conversions[e["conversion"]] = conversions.get(e["conversion"], 0) + 1
    quantized = any(f in ("int8", "int4") for f in convert.values())
    return {"version": 1, "quantize": options.quantize, "group_size": options.group_size,
            "activations": options.activations,
            # written only when opted in: bundles without it load as before
            **({"lm_head_activations": options.lm_head_activations}
               if getattr(options, "lm_head_activations", "float32") != "float32" else {}),
            "formats": list(options.formats) if quantized and options.activations != "int8" else [],
            "bytes_by_format": by_format, "conversions": conversions, "tensors": entries}


def _hf_name(runtime_name: str) -> str:
    """The HF tensor whose source type stands for a runtime weight (the first of a fused set)."""
    if runtime_name == "embed":
        return "model.embed_tokens.weight"
    if runtime_name == "lm_head":
        return "lm_head.weight"
    i, part = runtime_name.split(".")[1:3]
    return f"model.layers.{i}." + {"qkv": "self_attn.q_proj.weight", "o": "self_attn.o_proj.weight",
                                   "gate_up": "mlp.gate_proj.weight", "down": "mlp.down_proj.weight"}[part]
