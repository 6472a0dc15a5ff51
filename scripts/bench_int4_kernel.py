#!/usr/bin/env python
"""specbuild's int4 kernel alone over a bundle's 120 layer weights (4 linears x 30 layers for
SmolLM2-135M), at 1, 5 and 17 bfloat16 rows, for each AVX-512 level the CPU has (2: BF16 dot
products, prefetch 512 bytes ahead; 3: the same, 2048 ahead, the same bits; 4: fp32 multiply-adds,
its own bits), interleaved rounds, medians. Prints the CPU model and flags.

    python scripts/bench_int4_kernel.py BUNDLE [--threads 2] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    from _common import cpu_info  # scripts/ is on sys.path when a script runs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.model import cpu_kernels

    model = Engine(args.bundle, EngineConfig(max_batch_size=1)).model
    impls = [model.w[f"layers.{i}.{n}"].formats["int4"] for i in range(model.config.num_layers)
             for n in ("qkv", "o", "gate_up", "down")]
    if not all(i.kernel and i.act_dtype == torch.bfloat16 for i in impls):
        raise SystemExit("this bundle's int4 layers do not run specbuild's kernel with bfloat16 inputs here")
    levels = [lv for lv in (2, 3) if cpu_kernels.isa() >= 2] + [4] * cpu_kernels.has_isa4()
    if not levels:
        raise SystemExit("this CPU has no AVX-512 path")
    nbytes = sum(i.cpu_packed.numel() for i in impls)
    print(cpu_info())
    for w in (1, 5, 17):
        xs = {k: torch.randn(w, k).bfloat16() for k in {i.in_features for i in impls}}
        res: dict[int, list[float]] = {lv: [] for lv in levels}
        for r in range(args.rounds):
            for lv in (levels if r % 2 == 0 else levels[::-1]):
                t0 = time.perf_counter()
                for i in impls:
                    torch.ops.specbuild_cpu.int4_mm(xs[i.in_features], i.cpu_packed, i.out_features, i.group_size,
                                                    False, lv)
                res[lv].append(time.perf_counter() - t0)
        print(f"{w} row(s): " + ", ".join(
            f"level {lv} {statistics.median(v) * 1e3:.2f} ms ({nbytes / statistics.median(v) / 1e9:.1f} GB/s)"
            for lv, v in res.items()))


if __name__ == "__main__":
    main()
