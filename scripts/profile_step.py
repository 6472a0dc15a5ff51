#!/usr/bin/env python
"""Where a decode step's time goes: torch.profiler over eager forwards of N rows after 64
cached tokens (N=1: the decode step), top ops by self CPU time and their share.

    python scripts/profile_step.py BUNDLE [--width 1] [--steps 20] [--threads 2] [--top 12]

The share is of the profiled self CPU time of all ops (`self cpu` in torch's table), summed
over `--steps` forwards after 3 warm-up forwards; the load average is printed beside it.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    if not 1 <= args.width <= 64 or not 1 <= args.steps <= 1000:
        raise SystemExit(f"error: --width {args.width} must be in [1, 64] and --steps {args.steps} in [1, 1000]")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.model.threads import CHOSEN
    from specbuild.model.timing import scratch_sequence, verify_batch

    engine = Engine(args.bundle, EngineConfig(threads=args.threads, max_batch_size=1))
    model, cache = engine.model, engine.cache
    with torch.inference_mode(), scratch_sequence(cache, 64 + args.width) as slots:
        batch = verify_batch(slots, 64, args.width)
        for _ in range(3):
            model.forward(batch, cache)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                model.forward(batch, cache)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    print(f"{args.bundle}: eager forward of {args.width} row(s) after 64 cached tokens, {args.steps} forwards, "
          f"{args.threads} thread(s), {CHOSEN.get('policy')}; load average {os.getloadavg()[0]:.2f}")
    print(f"self CPU per forward {total / args.steps / 1e3:.2f} ms")
    print(f"{'op':48s} {'calls/fwd':>9s} {'ms/fwd':>8s} {'share':>6s}")
    for e in events[:args.top]:
        print(f"{e.key[:48]:48s} {e.count / args.steps:9.1f} {e.self_cpu_time_total / args.steps / 1e3:8.3f} "
              f"{e.self_cpu_time_total / total:6.1%}")


if __name__ == "__main__":
    main()
