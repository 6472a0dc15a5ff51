"""Plain vs speculative decoding on a few held-out Spec-Bench prompts: a short table of
tokens/s, speedup, mean accepted tokens, and whether the greedy outputs are identical.

The methods are measured interleaved: every round runs each prompt once with every method
(the method order rotating from prompt to prompt), so a change of the machine's speed while
the demo runs hits every method alike. tokens/s is the median over rounds of each prompt's
rate, summed over the prompts' tokens; speedup is the median, over every (round, prompt), of
the method's rate over plain decoding's rate in that same round and prompt. The load average
and the CPU with its flags are printed beside the table (a shared machine adds noise). The engine
runs its loop in its own thread, as `specbuild serve` does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

FALLBACK = [
    "Summarize the following text in two sentences: The city council met on Tuesday to discuss the new "
    "park. The city council agreed that the new park will open in May, and the new park will have a "
    "playground, a pond and a small library.",
    "Rewrite this sentence in the past tense: I walk to the store, I buy bread, and I walk back home.",
]


def prompts() -> list[str]:
    """One eval-split Spec-Bench question per category (summarisation and RAG first), then FALLBACK."""
    try:
        from specbuild.bench.specbench import held_out_questions

        picked = {}
        for q in held_out_questions(spread=False):  # each category's first question by id
            picked.setdefault(q["category"], q["turns"][0])
        order = ["summarization", "rag", "math_reasoning", "qa", "translation"]
        return [picked[c] for c in order if c in picked] + FALLBACK
    except (OSError, ValueError, KeyError):
        return list(FALLBACK)


def schedule(methods: list[str], n_prompts: int, repeats: int) -> list[tuple[int, int, str]]:
    """(round, prompt, method) in the order they run: round by round, prompt by prompt, every
    method once per (round, prompt), the method order rotated by one at each step."""
    out, k = [], 0
    for rnd in range(repeats):
        for p in range(n_prompts):
            out += [(rnd, p, methods[(k + i) % len(methods)]) for i in range(len(methods))]
            k += 1
    return out


def summarize(runs: dict[tuple[int, int, str], dict], methods: list[str], base: str = "none") -> list[dict]:
    """Rows of the table from runs[(round, prompt, method)] = {"tokens", "seconds", "token_ids",
    "accepted"} (accepted: mean accepted tokens per target pass)."""
    rounds = sorted({r for r, _, _ in runs})
    prompts_ = sorted({p for _, p, _ in runs})
    rows = []
    for m in methods:
        tokens = sum(runs[(rounds[0], p, m)]["tokens"] for p in prompts_)
        seconds = sum(statistics.median(runs[(r, p, m)]["seconds"] for r in rounds) for p in prompts_)
        ratios = [(runs[(r, p, m)]["tokens"] / runs[(r, p, m)]["seconds"])
                  / (runs[(r, p, base)]["tokens"] / runs[(r, p, base)]["seconds"]) for r in rounds for p in prompts_]
        same = sum(runs[(rounds[0], p, m)]["token_ids"] == runs[(rounds[0], p, base)]["token_ids"] for p in prompts_)
        rows.append({"method": m, "tokens_per_s": tokens / seconds, "speedup": statistics.median(ratios),
                     "speedup_min": min(ratios), "speedup_max": max(ratios),
                     "mean_accepted": statistics.mean(runs[(r, p, m)]["accepted"] for r in rounds for p in prompts_),
                     "identical": f"{same}/{len(prompts_)}" if m != base else "-"})
    return rows


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def target_format(engine, bundle: str, compiled: bool) -> str:
    from specbuild.bench.run import describe_target

    return describe_target(engine, bundle)[0] + ("+compile" if compiled else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--prompts", type=int, default=3, help="How many prompts [3].")
    ap.add_argument("--prompt", action="append", default=None,
                    help="A prompt of your own (repeatable) instead of the held-out Spec-Bench ones.")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3, help="Rounds over every (prompt, method) [3].")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default=None, help="Comma-separated [the bundle's methods].")
    ap.add_argument("--compile", action="store_true", help="Run the layer stack compiled (torch.compile; CPU).")
    args = ap.parse_args()
    if args.prompts < 1 or args.repeats < 1 or args.max_tokens < 1:
        ap.error(f"--prompts {args.prompts}, --repeats {args.repeats} and --max-tokens {args.max_tokens} must be >= 1")

    from specbuild.bench.specbench import SpecbuildRunner
    from specbuild.engine.engine import Engine, EngineConfig

    engine = Engine(args.bundle, EngineConfig(threads=args.threads, compile=args.compile))
    engine.start()  # the steps run in the engine loop's own thread, handed requests as `serve` hands them
    chats = []
    for p in args.prompt or prompts():  # the prompts whose answer fits the bundle's max_seq_len
        ids = engine.encode(engine.render_chat([{"role": "user", "content": p}]), add_special_tokens=False)
        if len(ids) + args.max_tokens <= engine.max_seq_len and len(chats) < args.prompts:
            chats.append(ids)
    if not chats:
        ap.error(f"no prompt fits max_seq_len={engine.max_seq_len} with --max-tokens {args.max_tokens}")
    wanted = args.methods.split(",") if args.methods else [m for m in engine.methods if m != "none"]
    methods = ["none"] + [m for m in wanted if m != "none"]

    def one(ids: list[int], method: str, max_tokens: int) -> dict:
        # a row as `specbuild bench` runs it (its SpecbuildRunner: greedy, the method's settings),
        # from an empty prefix cache: each run computes its prompt, whatever ran before it
        engine.clear_prefix_cache()
        [res], seconds = SpecbuildRunner(engine, method, max_tokens)([ids])
        return {"seconds": seconds, "tokens": res["stats"]["generated_tokens"],
                "token_ids": res["token_ids"], "accepted": res["stats"].get("mean_accepted_tokens") or 1.0}

    print(f"warming up {len(methods)} methods", file=sys.stderr, flush=True)
    for m in methods:  # warm-up: each method's first use (its drafter's buffers, a compiled graph's variants)
        one(chats[0], m, 8)
    load_start = loadavg()
    runs = {}
    for r, p, m in schedule(methods, len(chats), args.repeats):
        if not any(key[0] == r for key in runs):  # a round's first run
            print(f"round {r + 1}/{args.repeats}: {len(chats)} prompts x {len(methods)} methods ({', '.join(methods)})",
                  file=sys.stderr, flush=True)
        runs[(r, p, m)] = one(chats[p], m, args.max_tokens)
    load_end = loadavg()
    fmt = target_format(engine, args.bundle, args.compile)
    print(f"\n{'method':8s} {'format':16s} {'tok/s':>7s} {'speedup':>8s} {'(min-max)':>12s} {'mean acc':>9s} "
          f"{'identical':>10s}")
    for row in summarize(runs, methods):
        spread = f"{row['speedup_min']:.2f}-{row['speedup_max']:.2f}"
        print(f"{row['method']:8s} {fmt:16s} {row['tokens_per_s']:7.1f} {row['speedup']:8.2f} {spread:>12s} "
              f"{row['mean_accepted']:9.2f} {row['identical']:>10s}")
    what = "prompts" if args.prompt else "held-out prompts"
    print(f"\n{len(chats)} {what} x {args.repeats} rounds, methods interleaved (medians), greedy, batch 1, "
          f"{args.max_tokens} max tokens, {args.threads} threads")
    print(f"load average (1, 5, 15 min) {load_start} at start, {load_end} at end, on {os.cpu_count()} logical CPUs")
    from specbuild.bench.served import machine

    m = machine()
    print(f"CPU: {m['cpu']}; flags: {m['flags']}")
    print("served figures with llama.cpp's server beside them: python scripts/bench_serve.py BUNDLE")
    engine.stop()


if __name__ == "__main__":
    main()
