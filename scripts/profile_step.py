#!/usr/bin/env python
"""Where a decode step's time goes: torch.profiler over forwards of N rows after 64 cached
tokens (N=1: the decode step), or over whole engine steps, top ops by self CPU time.

    python scripts/profile_step.py BUNDLE [--width 1] [--steps 20] [--threads 2] [--top 12]
        [--compile [--inductor JSON]] [--engine]

The share is of the profiled self CPU time of all ops (`self cpu` in torch's table), summed
over `--steps` forwards after 3 warm-up forwards; the wall time per forward with and without
the profiler and the load average are printed beside it. `--compile` profiles the compiled
layer stack (model/compiled.py; `--inductor` replaces its inductor config patches, e.g.
'{"cpp_wrapper": false}') and counts what its graph launches per forward, read from the code
inductor generated: extern kernel calls by op, generated C++ kernels, and how many of those
open an OpenMP parallel region. `--engine` profiles `--steps` greedy decode steps of the
engine (engine.generate: batch building, the forward, sampling, bookkeeping) instead of bare
forwards; the time outside the ops there is the Python of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from collections import Counter


def graph_launches(source: str) -> dict:
    """What one call of an inductor-generated module launches, read from its source: extern
    kernel calls by op and generated-kernel calls, from a Python wrapper (its kernels' C++ sits
    beside it: also how many of those calls open an OpenMP parallel region) or from a
    cpp_wrapper's C++ (its kernels are compiled apart: regions not counted)."""
    cpp = "cpp_wrapper_src" in source
    kernels = dict(re.findall(r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\(.*?'''(.*?)'''", source,
                              re.S | re.M))
    # a call is a statement line naming the kernel with an argument list (a C++ declaration
    # starts with `extern "C"`, so it does not match)
    calls = Counter(m.group(1) for m in re.finditer(r"^\s*(cpp_fused_\w+)\(", source, re.M)
                    if cpp or m.group(1) in kernels)
    externs = Counter(re.findall(r"torch\.ops\.([\w.]+)\.default\(", source))
    externs.update(re.findall(r'aoti_torch_call_dispatcher\("([\w:]+)"', source))
    externs.update(re.findall(r"aoti_torch_cpu_(_\w+)\(", source))
    out = {"wrapper": "C++ (cpp_wrapper)" if cpp else "Python", "generated_kernel_calls": sum(calls.values()),
           "extern_calls": dict(externs)}
    if not cpp:
        out["generated_calls_with_omp_region"] = sum(n for k, n in calls.items()
                                                     if "#pragma omp parallel" in kernels.get(k, ""))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--compile", action="store_true", help="the compiled layer stack (EngineConfig.compile)")
    ap.add_argument("--inductor", default=None, help="JSON: the compiled stack's inductor config patches")
    ap.add_argument("--engine", action="store_true", help="whole engine decode steps instead of bare forwards")
    args = ap.parse_args()
    if not 1 <= args.width <= 64 or not 1 <= args.steps <= 1000:
        raise SystemExit(f"error: --width {args.width} must be in [1, 64] and --steps {args.steps} in [1, 1000]")
    if args.engine and args.width != 1:
        raise SystemExit(f"error: --engine profiles decode steps (one row); --width {args.width} is for bare forwards")
    options = None
    if args.inductor is not None:
        options = json.loads(args.inductor)
        if not isinstance(options, dict):
            raise SystemExit(f"error: --inductor must be a JSON object, got {args.inductor!r}")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.model import compiled as compiled_mod
    from specbuild.model.threads import CHOSEN
    from specbuild.model.timing import scratch_sequence, verify_batch

    if options is not None:  # read by every CompiledStack made from here on
        compiled_mod.INDUCTOR_OPTIONS = options
    engine = Engine(args.bundle, EngineConfig(threads=args.threads, max_batch_size=1, compile=args.compile))
    model, cache = engine.model, engine.cache

    if args.engine:
        from specbuild.engine.sequence import Request
        from specbuild.sampling.params import SamplingParams
        from specbuild.speculation.config import SpeculationConfig

        prompt = engine.encode(engine.render_chat([{"role": "user", "content": "Tell me a story about a dragon."}]),
                               add_special_tokens=False)
        handle = engine.submit(Request(prompt_ids=prompt, speculation=SpeculationConfig.make(None, method="none"),
                                       sampling=SamplingParams(max_tokens=2 * args.steps + 8, ignore_eos=True)))
        while len(handle.seq.output_ids) < 4:  # the prefill and 3 warm-up decode steps
            engine.step()
        walls = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append((time.perf_counter() - t0) * 1e3)
        wall = statistics.median(walls)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(args.steps):
                engine.step()
        profiled = (time.perf_counter() - t0) * 1e3 / args.steps
        engine.abort(handle)
        what = "engine decode step (greedy, batch 1)"
    else:
        with torch.inference_mode(), scratch_sequence(cache, 64 + args.width) as slots:
            batch = verify_batch(slots, 64, args.width)
            for _ in range(3):
                model.forward(batch, cache)
            walls = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                model.forward(batch, cache)
                walls.append((time.perf_counter() - t0) * 1e3)
            wall = statistics.median(walls)
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for _ in range(args.steps):
                    model.forward(batch, cache)
            profiled = (time.perf_counter() - t0) * 1e3 / args.steps
        what = f"forward of {args.width} row(s) after 64 cached tokens"
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    if model.compiled is None:
        mode = "eager"
    elif hasattr(model.compiled, "options"):  # compiled.py's torch.compile'd stack
        mode = "compiled " + json.dumps(model.compiled.options)
    else:  # fused.py's one C++ call for the whole layer stack
        mode = f"compiled ({type(model.compiled).__name__})"
    print(f"{args.bundle}: {mode} {what}, {args.steps} profiled, {args.threads} thread(s), {CHOSEN.get('policy')}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"wall per step {wall:.2f} ms (median, unprofiled); profiled {profiled:.2f} ms; "
          f"self CPU of all ops {total / args.steps / 1e3:.2f} ms per step")
    print(f"{'op':48s} {'calls/step':>10s} {'ms/step':>8s} {'share':>6s}")
    for e in events[:args.top]:
        print(f"{e.key[:48]:48s} {e.count / args.steps:10.1f} {e.self_cpu_time_total / args.steps / 1e3:8.3f} "
              f"{e.self_cpu_time_total / total:6.1%}")
    if model.compiled is not None and hasattr(model.compiled, "direct"):
        for key, direct in model.compiled.direct.items():
            if direct is None or not hasattr(direct.compiled, "source_code"):
                continue
            print(f"graph {key[:3]} (format, aux layers, SDPA inline): "
                  f"{json.dumps(graph_launches(direct.compiled.source_code))}")


if __name__ == "__main__":
    main()
