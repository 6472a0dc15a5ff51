#!/usr/bin/env python
"""Where a compiled int4 bundle's one-row decode step goes, in two views, interleaved rounds,
medians, with the CPU model and flags. A lab view (the main thread, no HTTP): the last line gives
the same generation in the engine loop's own thread, as the server runs it; the served figures
users get come from scripts/bench_serve.py.

1. The kernels: the whole forward (one row after 64 cached tokens, or each of `--widths`; the
   fused stack where it runs), the 30 layers' int4 linears alone (int4 or int4-a8, whichever the bundle loads) and
   the int8 lm_head alone on the same shapes; the rest of the forward (attention rows, norms,
   rope, glue, the embedding) is the forward less the two.
2. The engine's step (`--tokens N`, 0 to skip): plain greedy decoding through Engine.generate,
   as users run it, each part timed in place: building the forward batch, the layer stack
   (one fused C++ call where it runs), the final norm, the lm_head, the rest of the forward,
   and `finish` (the logits' checks, logits processing, choosing the token, appending and
   emitting it); "outside the forward and finish" is the scheduler, the drafters' planning
   (none here) and the loop around them.

    python scripts/step_parts.py BUNDLE [--threads 2] [--rounds 15] [--tokens 200] [--widths 1,5,17]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def engine_parts(eng, prompt: list[int], tokens: int) -> dict[str, float]:
    """One plain greedy generation of `tokens` tokens with every part timed; ms per decode step."""
    from specbuild.engine import step as step_mod
    from specbuild.engine.sequence import Request
    from specbuild.model import decoder
    from specbuild.sampling.params import SamplingParams
    from specbuild.speculation.config import SpeculationConfig

    from bench_compiled_step import Pieces  # scripts/ is on sys.path when a script runs

    model = eng.model
    tm = Pieces()
    tm.wrap(step_mod, "build_forward_batch", "build forward batch")
    tm.wrap(model, "forward", "forward (all)")
    if getattr(model.compiled, "run_final", None) is not None:
        # the fused stack: its inputs in one call, then the layers, final norm and (int8-q8) lm_head in one
        tm.wrap(model.compiled, "inputs", "stack inputs")
        tm.wrap(model.compiled, "run_final", "stack call (layers, end)")
    elif model.compiled is not None:
        tm.wrap(model.compiled, "run", "layer stack")
    # in a compiled forward the only rms_norm / linear calls outside the stack are the final
    # norm and the lm_head (eager: every layer's, so these rows then hold the whole stack)
    tm.wrap(decoder, "rms_norm", "final norm" if model.compiled is not None else "norms (all layers)")
    tm.wrap(decoder, "linear", "lm_head" if model.compiled is not None else "linears (all layers)")
    tm.wrap(step_mod.StepRunner, "finish", "finish")
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    plain = SpeculationConfig.make(None, method="none")
    try:
        t0 = time.perf_counter()
        out = eng.generate([Request(prompt_ids=prompt, sampling=params, speculation=plain)])[0]
        wall = time.perf_counter() - t0
    finally:
        tm.restore()
    steps = len(tm.times["forward (all)"])
    ms = {k: sum(v) / steps for k, v in tm.times.items()}  # Pieces keeps ms per call
    ms["step (tpot)"] = out["stats"]["tpot_ms"]
    ms["wall / forward"] = wall / steps * 1e3
    inner = sum(ms.get(k, 0.0) for k in ("stack inputs", "stack call (layers, end)", "layer stack", "final norm",
                                         "lm_head"))
    ms["rest of forward"] = ms["forward (all)"] - inner
    ms["outside forward and finish"] = ms["wall / forward"] - ms["forward (all)"] - ms["finish"] - ms["build forward batch"]
    return ms


def stack_phases(model, cache, width: int, forwards: int) -> dict[str, float]:
    """The fused C++ stack's own timers (cpu_kernels.stack_profile) over `forwards` forwards of
    `width` rows after 64 cached tokens: ms per forward by part; {} where the stack is not fused."""
    from specbuild.model import cpu_kernels
    from specbuild.model.timing import scratch_sequence, verify_batch

    if getattr(model.compiled, "run_final", None) is None:
        return {}
    with torch.inference_mode(), scratch_sequence(cache, 64 + width) as slots:
        model.forward(verify_batch(slots, 0, 64), cache)
        model.forward(verify_batch(slots, 64, width), cache)
        cpu_kernels.stack_profile(True)
        try:
            for _ in range(forwards):
                model.forward(verify_batch(slots, 64, width), cache)
        finally:
            parts = cpu_kernels.stack_profile(False)
    return parts


def main() -> None:
    from _common import cpu_info  # scripts/ is on sys.path when a script runs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=200, help="plain tokens per engine round (0: kernels only)")
    ap.add_argument("--engine-rounds", type=int, default=3)
    ap.add_argument("--widths", default="1", help="comma-separated rows of the kernels' view (a verify pass: 5, 17)")
    args = ap.parse_args()
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        raise SystemExit(f"error: --widths {args.widths!r} is not a comma-separated list of integers") from None
    if not widths or min(widths) < 1 or max(widths) > 64:
        raise SystemExit(f"error: --widths {args.widths!r}: each width must be 1 to 64")
    if args.rounds < 2 or args.tokens < 0 or args.engine_rounds < 1:
        raise SystemExit(f"error: --rounds {args.rounds} must be >= 2, --tokens {args.tokens} >= 0, "
                         f"--engine-rounds {args.engine_rounds} >= 1")
    torch.set_num_threads(args.threads)
    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.model.timing import scratch_sequence, verify_batch

    eng = Engine(args.bundle, EngineConfig(threads=args.threads, max_batch_size=1, compile=True))
    model, cache = eng.model, eng.cache
    impls = []
    for i in range(model.config.num_layers):
        for n in ("qkv", "o", "gate_up", "down"):
            fmts = getattr(model.w[f"layers.{i}.{n}"], "formats", {})
            impls.append(fmts.get("int4-a8") or fmts.get("int4"))
    if not all(i is not None and i.kernel for i in impls):
        raise SystemExit("error: this bundle's layers do not all run int4 or int4-a8 on specbuild's kernel here")
    lm = model.lm_head  # its primary format: int8 (float32 inputs) or int8-q8 (int8 input blocks)
    head = getattr(lm, "formats", {}).get(getattr(lm, "primary", None))
    act = impls[0].act_dtype
    cpu = cpu_info()
    print(f"CPU {cpu['model']}\nflags: {cpu['flags']}")
    fmt = "int4-a8" if act == torch.float32 else "int4"
    hname = f"{head.name} lm_head" if head is not None and getattr(head, "kernel", 0) else None
    mb = {"int4 layers": sum(i.cpu_packed.numel() * i.cpu_packed.element_size() for i in impls) / 1e6}
    if hname:
        mb[hname] = head.nbytes / 1e6
    print(f"{args.bundle}: {args.threads} thread(s), {args.rounds} interleaved rounds, medians; {fmt} level "
          f"{impls[0].kernel}, lm_head {head.name if head is not None else '-'} level "
          f"{getattr(head, 'kernel', '-')}; load average {os.getloadavg()[0]:.2f}")
    for w in widths:
        xs = {k: torch.randn(w, k).to(act) for k in {i.in_features for i in impls}}
        xh = torch.randn(w, model.config.hidden_size)
        parts: dict[str, list[float]] = {"forward": [], "int4 layers": []}
        if hname:
            parts[hname] = []
        with torch.inference_mode(), scratch_sequence(cache, 64 + w) as slots:
            model.forward(verify_batch(slots, 0, 64), cache)
            for _ in range(args.rounds + 1):
                t0 = time.perf_counter()
                model.forward(verify_batch(slots, 64, w), cache)
                parts["forward"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for i in impls:
                    i(xs[i.in_features])
                parts["int4 layers"].append(time.perf_counter() - t0)
                if hname:
                    t0 = time.perf_counter()
                    head(xh)
                    parts[hname].append(time.perf_counter() - t0)
        med = {k: statistics.median(v[1:]) * 1e3 for k, v in parts.items()}  # the first round warms up
        print(f"kernels, {w} row(s) after 64 cached tokens:")
        for k, v in med.items():
            extra = f"  {mb[k]:.1f} MB, {mb[k] / v:.1f} GB/s" if k in mb and w == 1 else ""
            print(f"  {k:28s} {v:7.2f} ms{extra}")
        rest = med["forward"] - sum(v for k, v in med.items() if k != "forward")
        print(f"  {'the rest':28s} {rest:7.2f} ms  (forward less the kernels: attention, norms, rope, glue)")
        phases = stack_phases(model, cache, w, args.rounds)
        if phases:
            print("  the fused stack's parts (C++ timers, ms per forward; the linears include the pool's hand-off):")
            for k, v in phases.items():
                print(f"    {k:26s} {v:7.3f}")
    if args.tokens == 0:
        return
    prompt = eng.encode(eng.render_chat([{"role": "user", "content": "Tell me a story about a dragon and a knight."}]),
                        add_special_tokens=False)
    engine_parts(eng, prompt, 16)  # warm-up
    runs = [engine_parts(eng, prompt, args.tokens) for _ in range(args.engine_rounds)]
    print(f"the engine's plain greedy step, {args.tokens} tokens after a {len(prompt)}-token prompt, "
          f"median of {args.engine_rounds} runs, ms per step (load average {os.getloadavg()[0]:.2f}):")
    order = ["step (tpot)", "wall / forward", "build forward batch", "forward (all)", "stack inputs",
             "stack call (layers, end)", "layer stack", "final norm",
             "lm_head", "norms (all layers)", "linears (all layers)", "rest of forward", "finish",
             "outside forward and finish"]
    for k in order:
        if k in runs[0] and (runs[0][k] or k not in ("final norm", "lm_head")):  # fused: both inside the stack call
            print(f"  {k:28s} {statistics.median(r[k] for r in runs):7.3f}")
    # the lab view above runs the step on this (main) thread; what users get runs it in the engine
    # loop's own thread (serve, Triton, bench): the same generation that way, for comparison
    from specbuild.engine.sequence import Request
    from specbuild.sampling.params import SamplingParams
    from specbuild.speculation.config import SpeculationConfig

    eng.start()
    try:
        served = []
        for _ in range(args.engine_rounds):
            h = eng.submit(Request(prompt_ids=prompt, speculation=SpeculationConfig.make(None, method="none"),
                                   sampling=SamplingParams(max_tokens=args.tokens, ignore_eos=True)))
            served.append(h.result()["stats"]["tpot_ms"])
    finally:
        eng.stop()
    main_step = statistics.median(r["step (tpot)"] for r in runs)
    print(f"  {'served step (engine thread)':28s} {statistics.median(served):7.3f}  ({statistics.median(served) / main_step:.2f}x "
          f"the main-thread step; the served figure with HTTP: scripts/bench_serve.py)")
    print(f"threads: {eng.stats()['threads'].get('decided')}")


if __name__ == "__main__":
    main()
