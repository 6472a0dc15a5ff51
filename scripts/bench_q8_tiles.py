#!/usr/bin/env python
"""A lab view of two kernels at the widths the product runs them: the int4 x int8 linear
(int4_q8_mm) over one [3072, 576] layer (SmolLM2-135M's gate_up) and causal rows_attention over a
prompt, with the CPU model and flags. A diagnostic: served figures come from scripts/bench_serve.py.
Where `bench_formats.py --kernels` times every format over SmolLM2's shapes with the weights as
the loop leaves them, this one separates weights from memory (a decode step) and weights in cache
(prefill's later row tiles), the two cases plain AVX2's tile choice by width is about.

- linear: random int4 weights (Q4_1-like, fp16 scales where exact), each width timed with the
  weights hot (one matrix, called again and again) and cold (60 copies in turn, ~80 MB: from
  memory, as in a decode step); medians of --rounds; ms per call and G int8 multiply-adds/s.
- attention: 30 calls (a model's layers) of rows_attention over --prompt rows, each row over its
  own prefix (9 query heads, 3 kv heads, head dim 64); median of --rounds.

    python scripts/bench_q8_tiles.py [--threads 2] [--mode pool|openmp] [--widths 1,2,3,4,8,16,64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_info  # noqa: E402  (scripts/_common.py)


def timed(fn, calls: int, rounds: int) -> float:
    """Median seconds per call over `rounds` rounds of `calls` calls (after one warm-up round)."""
    for _ in range(calls):
        fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", choices=("pool", "openmp"), default="pool")
    ap.add_argument("--widths", default="1,2,3,4,5,8,16,64")
    ap.add_argument("--path", type=int, default=0, help="int4_q8_mm path (0: the one this CPU runs)")
    ap.add_argument("--prompt", type=int, default=640, help="attention rows (0: skip)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import specbuild  # noqa: F401  (the wait policy, before torch loads OpenMP)
    import torch

    from specbuild.model import cpu_kernels as ck

    torch.manual_seed(0)
    ck.kernels_mode(args.mode, args.threads)
    torch.set_num_threads(1 if args.mode == "pool" else args.threads)
    path = args.path or ck.q8_path()
    cpu = cpu_info()
    print(f"CPU {cpu['model']}\nflags: {cpu['flags']}")
    print(f"{args.mode} x{args.threads}, int4_q8_mm path {path} ({ck.Q8_PATHS.get(path, path)}), "
          f"load average {os.getloadavg()[0]:.2f}")
    n, k, g = 3072, 576, 32
    q = torch.randint(0, 16, (n, k))
    scales = (torch.rand(n, k // g) * 0.01 + 0.001).half().float()
    m = (torch.rand(n, k // g) * 0.01).half().float()  # zero - 8 * scale, fp16 values
    zeros = m + 8 * scales
    f16 = ck.q8_fp16_exact(scales, zeros)
    packed = ck.repack_int4_q8(q, scales, zeros, g, f16)
    cold = [packed.clone() for _ in range(60)]
    print(f"linear [{n}, {k}], group {g}, {'fp16' if f16 else 'fp32'} scales, {packed.numel() / 1e6:.2f} MB a copy")
    for w in (int(v) for v in args.widths.split(",")):
        x = torch.randn(w, k)
        hot = timed(lambda: ck.int4_q8_mm(x, packed, n, g, f16, path), 60, args.rounds)
        it = iter(range(1 << 62))
        cold_s = timed(lambda: ck.int4_q8_mm(x, cold[next(it) % 60], n, g, f16, path), 60, args.rounds)
        macs = w * n * k
        print(f"  {w:>3} rows: hot {hot * 1e3:7.3f} ms {macs / hot / 1e9:6.1f} G/s   "
              f"cold {cold_s * 1e3:7.3f} ms {macs / cold_s / 1e9:6.1f} G/s")
    if args.prompt:
        t, h, kv, d = args.prompt, 9, 3, 64
        kc, vc, qr = torch.randn(t + 64, kv, d), torch.randn(t + 64, kv, d), torch.randn(t, h, d)
        offsets, slots = [0], []
        for r in range(t):
            slots.extend(range(r + 1))
            offsets.append(len(slots))
        index = torch.tensor(offsets + slots, dtype=torch.int64)
        s = timed(lambda: [ck.rows_attention(qr, kc, vc, index, d ** -0.5) for _ in range(30)], 1, args.rounds)
        print(f"attention: 30 layers of causal rows_attention over {t} rows: {s * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
