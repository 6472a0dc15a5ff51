"""Structured output benchmark: the Spec-Bench task set (bench/structured.py: each held-out
question with its category's JSON schema) answered with response_format json_schema, plain and
speculative, next to the same prompts unconstrained.

    python scripts/bench_structured.py BUNDLE [--per-category 1] [--methods none,ngram] [--max-tokens 128]

Prints the CPU model and flags, then per method: valid outputs (parse + validate against the
schema, checked by bench/structured.py's own validator), tokens/s constrained and
unconstrained, each method's speedup over plain in both, whether greedy outputs equal plain
decoding's, and the grammar's mask cost per token. Rows run interleaved per prompt (batch 1,
greedy), so a row's figure never depends on which rows ran before it in the pass.
"""

from __future__ import annotations

import argparse
import json
import time

from _common import lscpu  # scripts/_common.py
from specbuild.bench.structured import load_tasks, validates
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig


def cpu() -> str:
    return "\n".join(line for line in lscpu().splitlines() if line.startswith(("Model name", "Flags")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--methods", default="none,ngram")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    methods = args.methods.split(",")
    if methods[0] != "none":
        methods = ["none"] + [m for m in methods if m != "none"]
    engine = Engine(args.bundle, EngineConfig(prefix_cache=False, threads=args.threads, max_batch_size=1))
    tasks = load_tasks("eval", args.per_category)
    rows = {(m, c): {"tokens": 0, "seconds": 0.0, "valid": 0, "n": 0, "same": 0, "mask_ms": 0.0}
            for m in methods for c in (True, False)}
    plain_ids: dict = {}
    engine.generate([Request(prompt="warm up", sampling=SamplingParams(max_tokens=4))])
    for task in tasks:
        ids = engine.encode(engine.render_chat(task["messages"]), add_special_tokens=False)
        for constrained in (True, False):
            for m in methods:
                spec = SpeculationConfig.make(None, method=m)
                req = Request(prompt_ids=ids, speculation=spec, sampling=SamplingParams(max_tokens=args.max_tokens),
                              response_format=task["response_format"] if constrained else None)
                t0 = time.perf_counter()
                r = engine.generate([req])[0]
                dt = time.perf_counter() - t0
                row = rows[(m, constrained)]
                row["tokens"] += len(r["token_ids"])
                row["seconds"] += dt
                row["n"] += 1
                row["mask_ms"] += r["stats"].get("grammar_mask_ms", 0.0)
                if constrained:  # a complete answer must parse and validate; one cut at max tokens cannot
                    done = r["finish_reason"] == "stop"
                    row["complete"] = row.get("complete", 0) + done
                    row["valid"] += done and validates(r["text"], task["schema"])[0]
                key = (task["question_id"], constrained)
                if m == "none":
                    plain_ids[key] = r["token_ids"]
                row["same"] += r["token_ids"] == plain_ids[key]
    print(cpu())
    print(f"bundle {args.bundle}; {len(tasks)} tasks (Spec-Bench eval, {args.per_category} per group), greedy, batch 1, "
          f"max {args.max_tokens} tokens, {args.threads} threads")
    print(f"{'method':8s} {'json tok/s':>10s} {'speedup':>8s} {'free tok/s':>10s} {'speedup':>8s} "
          f"{'valid/complete':>14s} {'cut at max':>10s} {'= plain':>8s} {'mask ms/token':>13s}")
    base = {c: rows[("none", c)]["tokens"] / rows[("none", c)]["seconds"] for c in (True, False)}
    report = []
    for m in methods:
        con, free = rows[(m, True)], rows[(m, False)]
        tps_c, tps_f = con["tokens"] / con["seconds"], free["tokens"] / free["seconds"]
        complete = con.get("complete", 0)
        print(f"{m:8s} {tps_c:10.1f} {tps_c / base[True]:7.2f}x {tps_f:10.1f} {tps_f / base[False]:7.2f}x "
              f"{con['valid']:>9d}/{complete:<4d} {con['n'] - complete:>10d} {con['same'] + free['same']:>4d}/{2 * con['n']:<3d}"
              f" {con['mask_ms'] / max(con['tokens'], 1):13.4f}")
        report.append({"method": m, "constrained_tokens_per_s": tps_c, "unconstrained_tokens_per_s": tps_f,
                       "complete": complete, "valid": con["valid"], "tasks": con["n"],
                       "mask_ms_per_token": con["mask_ms"] / max(con["tokens"], 1)})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
