#!/usr/bin/env python
"""Where a compiled int4 bundle's one-row decode step goes: the whole forward (one row after 64
cached tokens, the fused stack where it runs), the 30 layers' int4 linears alone and the int8
lm_head alone, on the same inputs' shapes, interleaved rounds, medians. The rest of the step
(attention rows, norms, rope, the glue, the embedding) is the forward less the two. Prints the
CPU model and flags and the kernels' load lines.

    python scripts/step_parts.py BUNDLE [--threads 2] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    from bench_compile import cpu_info  # scripts/ is on sys.path when a script runs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.model.timing import scratch_sequence, verify_batch

    eng = Engine(args.bundle, EngineConfig(max_batch_size=1, compile=True))
    model, cache = eng.model, eng.cache
    impls = [model.w[f"layers.{i}.{n}"].formats.get("int4") for i in range(model.config.num_layers)
             for n in ("qkv", "o", "gate_up", "down")]
    if not all(i is not None and i.kernel for i in impls):
        raise SystemExit("this bundle's layers do not all run int4 on specbuild's kernel here")
    head = getattr(model.w.get("lm_head"), "formats", {}).get("int8") or \
        getattr(model.w.get("embed"), "formats", {}).get("int8")
    xs = {k: torch.randn(1, k).bfloat16() for k in {i.in_features for i in impls}}
    xh = torch.randn(1, model.config.hidden_size).bfloat16()
    parts: dict[str, list[float]] = {"forward": [], "int4 layers": []}
    if head is not None and head.kernel:
        parts["int8 lm_head"] = []
    print(cpu_info())
    with torch.inference_mode(), scratch_sequence(cache, 80) as slots:
        model.forward(verify_batch(slots, 0, 64), cache)
        for _ in range(args.rounds + 1):
            t0 = time.perf_counter()
            model.forward(verify_batch(slots, 64, 1), cache)
            parts["forward"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i in impls:
                torch.ops.specbuild_cpu.int4_mm(xs[i.in_features], i.cpu_packed, i.out_features, i.group_size,
                                                i.act_dtype != torch.bfloat16, i.kernel)
            parts["int4 layers"].append(time.perf_counter() - t0)
            if "int8 lm_head" in parts:
                t0 = time.perf_counter()
                torch.ops.specbuild_cpu.int8_mm(xh, head.cpu_packed, head.qweight.shape[0], head.kernel)
                parts["int8 lm_head"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) * 1e3 for k, v in parts.items()}  # the first round warms up
    mb = {"int4 layers": sum(i.cpu_packed.numel() for i in impls) / 1e6}
    if "int8 lm_head" in med:
        mb["int8 lm_head"] = head.cpu_packed.numel() / 1e6
    print(f"{args.bundle}: {args.threads} thread(s), {args.rounds} interleaved rounds, medians; int4 level "
          f"{impls[0].kernel}, int8 level {head.kernel if head is not None else '-'}")
    for k, v in med.items():
        extra = f"  {mb[k]:.1f} MB, {mb[k] / v:.1f} GB/s" if k in mb else ""
        print(f"  {k:14s} {v:7.2f} ms{extra}")
    rest = med["forward"] - med["int4 layers"] - med.get("int8 lm_head", 0.0)
    print(f"  {'the rest':14s} {rest:7.2f} ms  (forward less the kernels: attention, norms, rope, glue)")


if __name__ == "__main__":
    main()
