#!/usr/bin/env python
"""The int4 x int8 kernel's paths through the whole compiled step, A/B in one engine.

    python scripts/bench_q8_paths.py BUNDLE [--paths 2,5] [--rounds 7] [--tokens 48] [--threads 2]

BUNDLE must load as int4-a8 in the fused C++ stack (`--activations auto` or `int8`). One engine
(`--compile`, thread governor off); each round switches the stack's path (`meta[6]`; every path
gives the same bits) in rotating order and measures plain decoding ms/token and the best of 5
verify passes at widths 1, 5 and 17. Prints medians per path, w5/w1 and w17/w1, and the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--paths", default="2,5")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import specbuild  # noqa: F401  (the wait policy, before torch loads OpenMP)
    from specbuild.bench.formats import decode_step_ms
    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.model import cpu_kernels
    from specbuild.model.fused import FusedStack
    from specbuild.model.threads import CHOSEN
    from specbuild.model.timing import forward_costs

    from _common import cpu_info  # scripts/ is on sys.path when a script runs

    paths = [int(p) for p in args.paths.split(",")]
    bad = [p for p in paths if p not in cpu_kernels.q8_paths()]
    if bad:
        sys.exit(f"error: path {bad[0]} is not one this CPU runs ({cpu_kernels.q8_paths()})")
    engine = Engine(args.bundle, EngineConfig(max_batch_size=1, compile=True, threads=args.threads, adapt_threads=False))
    fused = engine.model.compiled
    if not isinstance(fused, FusedStack) or fused.kind != "int4-a8":
        sys.exit(f"error: {args.bundle} does not run int4-a8 in the fused stack here ({engine.model.fused_why})")
    meta = list(fused.meta)
    prompt = engine.encode(engine.render_chat([{"role": "user", "content": "Tell me a story about a dragon."}]),
                           add_special_tokens=False)
    res = {p: {"decode": [], 1: [], 5: [], 17: []} for p in paths}
    for r in range(args.rounds):
        for p in paths[r % len(paths):] + paths[:r % len(paths)]:
            fused.meta = meta[:6] + [p] + meta[7:]
            res[p]["decode"].append(decode_step_ms(engine, prompt, args.tokens, 1)[0])
            costs = forward_costs(engine.model, engine.cache, [1, 5, 17], repeats=5)
            for w in (1, 5, 17):
                res[p][w].append(costs[w]["min_ms"])
    fused.meta = meta
    cpu = cpu_info()
    print(f"{args.bundle}: {args.rounds} interleaved rounds, medians, {args.threads} threads; CPU {cpu['model']}; "
          f"load average {os.getloadavg()[0]:.2f}; wait policy {CHOSEN.get('policy')} ({CHOSEN.get('reason')})")
    print(f"flags: {cpu['flags']}")
    print(f"{'path':28s} {'decode':>8s} {'w1':>8s} {'w5':>8s} {'w17':>8s} {'w5/w1':>6s} {'w17/w1':>7s}")
    for p in paths:
        m = {k: statistics.median(v) for k, v in res[p].items()}
        print(f"{p} {cpu_kernels.Q8_PATHS[p]:26s} {m['decode']:8.2f} {m[1]:8.2f} {m[5]:8.2f} {m[17]:8.2f} "
              f"{m[5] / m[1]:6.2f} {m[17] / m[1]:7.2f}")


if __name__ == "__main__":
    main()
