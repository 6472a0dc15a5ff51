#!/usr/bin/env python
"""The compiled decode step under inductor config candidates, interleaved in one process.

One engine loads the bundle compiled (EngineConfig.compile, model/compiled.py's
INDUCTOR_OPTIONS); every other candidate of `--variants` gets its own CompiledStack on the
same model, compiled at load. Each round (the candidates' order rotated per round) swaps each
stack in and times plain greedy decoding (engine.generate, ms/token over `--tokens` tokens,
prefill excluded) and one forward of 1 and 5 rows after 64 cached tokens (best and median of
`--repeats`); with `--pieces` the decode step is also timed by pieces (the scheduler's whole
step, the forward, the compiled stack with its Python around the graph, the graph call, the
per-sequence work after the forward). With `--replay N`, then N rounds in turn of: each
candidate's graph called alone on a decode step's inputs, its whole forward, and the int4 and
SDPA kernel calls of one graph call (recorded through the dispatcher) replayed alone, in CPU
ms of this process (with one thread, what other load's descheduling cannot add to), and the
Python-level calls (functions and builtins) one graph call makes. Prints
medians over rounds, ratios to the first candidate, whether each candidate's logits have the first one's bits, the CPU model and
flags, and the load average of every round.

    python scripts/bench_compiled_step.py BUNDLE [--variants base,noasserts,cpp_wrapper] [--threads 2]
        [--rounds 5] [--tokens 32] [--repeats 9] [--pieces] [--replay 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

NOASSERTS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
VARIANTS = {
    "default": None,  # compiled.INDUCTOR_OPTIONS, what the engine compiles with
    "base": {},  # inductor's own defaults
    "noasserts": NOASSERTS,
    "cpp_wrapper": {"cpp_wrapper": True},
    "cpp_wrapper+noasserts": {"cpp_wrapper": True, **NOASSERTS},
    # the generated glue kernels (norms, rope, residuals, SiLU, KV writes) single-threaded: no
    # OpenMP region around work of a few thousand floats; the weight and attention kernels
    # (extern ops) keep torch's thread pool
    "cpp_wrapper+glue1": {"cpp_wrapper": True, "cpp.threads": 1},
}


class Pieces:
    """Wall time per call of a few methods, by wrapping them on their classes."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.undo: list = []

    def wrap(self, cls, name: str, label: str) -> None:
        orig = getattr(cls, name)
        times = self.times.setdefault(label, [])

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                times.append((time.perf_counter() - t0) * 1e3)

        setattr(cls, name, timed)
        self.undo.append((cls, name, orig))

    def restore(self) -> None:
        for cls, name, orig in reversed(self.undo):
            setattr(cls, name, orig)
        self.undo.clear()

    def reset(self) -> None:
        for v in self.times.values():
            v.clear()


def main() -> None:
    from _common import cpu_info  # scripts/ is on sys.path when a script runs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--variants", default="default,cpp_wrapper")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--pieces", action="store_true")
    ap.add_argument("--replay", type=int, default=0, help="rounds of the graph against its kernels replayed alone")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not 0 <= args.replay <= 1000 or not 1 <= args.rounds <= 100 or not 1 <= args.tokens <= 1024 or not 1 <= args.repeats <= 100:
        raise SystemExit(f"error: variants {unknown} not in {sorted(VARIANTS)}, or --rounds {args.rounds} not in "
                         f"[1, 100], --tokens {args.tokens} not in [1, 1024], --repeats {args.repeats} not in [1, 100]")

    import torch

    from specbuild.bench.formats import decode_step_ms
    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.engine.scheduler import Scheduler
    from specbuild.engine.step import StepRunner
    from specbuild.model import compiled as compiled_mod
    from specbuild.model.decoder import Decoder, weight_bytes
    from specbuild.model.threads import CHOSEN
    from specbuild.model.timing import copy_bandwidth, forward_costs, scratch_sequence, verify_batch, warm_up_compiled

    engine = Engine(args.bundle, EngineConfig(prefix_cache=False, threads=args.threads, max_batch_size=1, compile=True))
    model, cache = engine.model, engine.cache
    stacks, compile_s = {}, {}
    engine_stack = model.compiled  # the engine's own (INDUCTOR_OPTIONS), before any candidate replaces it
    for name in names:
        if VARIANTS[name] is None:
            stacks[name], compile_s[name] = engine_stack, engine.compile_seconds
            continue
        model.compiled = stacks[name] = compiled_mod.CompiledStack(model, VARIANTS[name])
        compile_s[name] = round(warm_up_compiled(model, cache), 1)
        print(f"compiled {name} {VARIANTS[name]} in {compile_s[name]} s", file=sys.stderr, flush=True)

    # the same bits as the first candidate? (each candidate's own decode/verify contract is
    # tests/model/test_compiled.py's; this says whether a candidate changed the arithmetic)
    same = {}
    with torch.inference_mode(), scratch_sequence(cache, 64 + 5) as slots:
        ref = {}
        for name in names:
            model.compiled = stacks[name]
            got = {w: model.forward(verify_batch(slots, 64, w), cache).logits.clone() for w in (1, 5)}
            if not ref:
                ref = got
            same[name] = all(torch.equal(got[w], ref[w]) for w in got)

    prompt = engine.encode(engine.render_chat([{"role": "user", "content": "Tell me a story about a dragon and a knight."}]),
                           add_special_tokens=False)
    pieces = Pieces()
    if args.pieces:
        pieces.wrap(Scheduler, "step", "step")
        pieces.wrap(StepRunner, "forward", "batch + forward")
        pieces.wrap(Decoder, "forward", "forward")
        pieces.wrap(Decoder, "compiled_rows", "stack (with its Python)")
        pieces.wrap(compiled_mod.DirectCall, "__call__", "graph call")
        pieces.wrap(StepRunner, "finish", "after the forward")
    rows: dict[str, list] = {n: [] for n in names}
    loads, gbps = [], []
    for r in range(args.rounds):
        gbps.append(copy_bandwidth(256 << 20, repeats=3)["gb_per_s"])
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            model.compiled = stacks[name]
            pieces.reset()
            decode = statistics.median(decode_step_ms(engine, prompt, args.tokens, 2))
            split = {k: statistics.median(v) for k, v in pieces.times.items() if v}
            pieces.reset()
            costs = forward_costs(model, cache, (1, 5), repeats=args.repeats)
            rows[name].append({"decode_ms": decode, "w1_min": costs[1]["min_ms"], "w1_median": costs[1]["wall_ms"],
                               "w1_cpu": costs[1]["cpu_ms"],
                               "w5_min": costs[5]["min_ms"], **{f"piece {k}": v for k, v in split.items()}})
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {rows[n][-1]['decode_ms']:.2f}" for n in names)
              + f" ms/token; load {loads[-1]:.2f}", file=sys.stderr, flush=True)
    pieces.restore()
    replay = replay_rounds(model, cache, stacks, args.replay) if args.replay else None
    model.compiled = stacks[names[0]]
    floor = weight_bytes(model.w, engine.target_config.tie_word_embeddings) / (max(gbps) * 1e9) * 1e3
    medians = {n: {k: round(statistics.median(x[k] for x in v), 3) for k in v[0]} for n, v in rows.items()}
    first = medians[names[0]]
    report = {"bundle": args.bundle, "threads": args.threads, "policy": CHOSEN.get("policy"), "rounds": args.rounds,
              "tokens": args.tokens, "cpu": cpu_info(), "compile_s": compile_s, "same_bits_as_first": same, "replay_cpu_ms": replay,
              "load_average_per_round": loads, "loadavg_end": open("/proc/loadavg").read().strip(),
              "copy_gb_per_s": round(max(gbps), 2), "floor_ms": round(floor, 2), "medians": medians,
              "ratio_to_first": {n: {k: round(m[k] / first[k], 3) for k in m if first.get(k)} for n, m in medians.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{args.bundle}: {args.threads} thread(s) ({report['policy']}), {args.rounds} interleaved rounds, medians; "
          f"CPU {report['cpu']['model']}")
    print(f"flags: {report['cpu']['flags']}")
    print("load average per round " + " ".join(f"{x:.2f}" for x in loads) + f"; at end {report['loadavg_end']}")
    print(f"floor {report['floor_ms']} ms (weights over the best copy, {report['copy_gb_per_s']} GB/s)")
    for n in names:
        print(f"{n} (compile {compile_s[n]} s, same bits as {names[0]}: {same[n]}):")
        for k, v in medians[n].items():
            print(f"  {k:32s} {v:8.3f} ms  x{report['ratio_to_first'][n].get(k, float('nan')):.3f}"
                  + (f"  x floor {v / floor:.2f}" if k == "decode_ms" else ""))
    if replay:
        print(f"replay ({args.replay} rounds, CPU ms of this process: median / best):")
        for k, v in replay.items():
            calls = f"  ({v['python_calls']} Python-level calls)" if "python_calls" in v else ""
            print(f"  {k:40s} {v['median']:8.3f} / {v['best']:8.3f}{calls}")


def replay_rounds(model, cache, stacks: dict, rounds: int) -> dict:
    """CPU ms (median, best over `rounds` rounds in turn) of each stack's graph called alone
    with a decode step's inputs, of its whole Decoder.forward, and of the extern kernel calls
    one graph call made through the dispatcher (int4_mm; SDPA where the wrapper calls it
    through the dispatcher, as the Python one does), replayed alone on the same tensors."""
    import statistics
    import time
    from collections import Counter

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from specbuild.model import compiled as compiled_mod
    from specbuild.model.timing import scratch_sequence, verify_batch

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    fns: dict = {}
    python_calls: dict = {}  # per stack: Python-level calls (functions and builtins) in one graph call
    with torch.inference_mode(), scratch_sequence(cache, 65) as slots:
        batch = verify_batch(slots, 64, 1)
        for name, stack in stacks.items():
            model.compiled = stack
            seen: dict = {}
            orig = compiled_mod.DirectCall.__call__

            def spy(self, args, seen=seen, orig=orig):
                seen["call"], seen["args"] = self, args
                return orig(self, args)

            compiled_mod.DirectCall.__call__ = spy
            try:
                model.forward(batch, cache)
            finally:
                compiled_mod.DirectCall.__call__ = orig
            call, args = seen["call"], seen["args"]
            fns[f"{name}: graph"] = (stack, lambda call=call, args=args: call(args))
            fns[f"{name}: Decoder.forward"] = (stack, lambda: model.forward(batch, cache))
            events = Counter()
            sys.setprofile(lambda frame, event, arg: events.update((event,)))
            try:
                call(args)
            finally:
                sys.setprofile(None)
            python_calls[name] = events["call"] + events["c_call"]
            rec = Record()
            with rec:
                call(args)
            for op in ("int4_mm", "scaled_dot_product"):
                calls = [c for c in rec.calls if op in str(c[0])]
                if calls and not any(k.startswith(op) for k in fns):
                    fns[f"{op} alone ({len(calls)} calls)"] = (stack, lambda calls=calls: [f(*a, **k) for f, a, k in calls])
        times: dict = {k: [] for k in fns}
        for _ in range(rounds):
            for k, (stack, fn) in fns.items():
                model.compiled = stack
                c0 = time.process_time()
                fn()
                times[k].append((time.process_time() - c0) * 1e3)
    out = {k: {"median": round(statistics.median(v), 3), "best": round(min(v), 3)} for k, v in times.items()}
    for name, n in python_calls.items():
        out[f"{name}: graph"]["python_calls"] = n
    return out


if __name__ == "__main__":
    main()
