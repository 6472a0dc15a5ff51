"""Batch 1 in a fresh process, as a CLI user runs it: one `specbuild generate` call per
prompt and method (methods interleaved per prompt), each a new process that loads the
bundle, answers one chat prompt and exits. Reports per method the median time per output
token after the first (TPOT), the median time to first token, end-to-end tokens/s of the
generation (TTFT + decode, load excluded), accepted tokens per pass, the ratio to plain
decoding in the same run, and whether every greedy output equals plain decoding's.

    .venv/bin/python scripts/bench_fresh.py BUNDLE --prompts 6 --methods none,ngram,auto --threads 2

Prompts: the first turns of the packaged Spec-Bench eval split, one per task group in turn.
Load time is not counted (the cost calibration runs at load and is cached per machine and
bundle, so no request pays for it); `proc s` shows the whole process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run_one(bundle: str, prompt: str, method: str, max_tokens: int, threads: int, compiled: bool = False) -> dict:
    cmd = [os.path.join(os.path.dirname(sys.executable), "specbuild"), "generate", bundle, "--chat", "--json",
           "--prompt", prompt, "--speculation", method, "--max-tokens", str(max_tokens), "--temperature", "0",
           "--threads", str(threads)] + (["--compile"] if compiled else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    rec["process_s"] = wall
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--methods", default="none,ngram,auto")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="every process runs the layer stack compiled")
    ap.add_argument("--json", action="store_true", help="print the full report as JSON")
    args = ap.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "none" not in methods:
        methods.insert(0, "none")
    rows: dict[str, list[dict]] = {m: [] for m in methods}
    from specbuild.bench.specbench import held_out_questions, task_group

    chosen = [(task_group(q["category"]), q["turns"][0]) for q in held_out_questions(args.prompts)]
    for i, (group, text) in enumerate(chosen):
        for m in methods:
            rec = run_one(args.bundle, text, m, args.max_tokens, args.threads, args.compile)
            rec["group"] = group
            rows[m].append(rec)
            print(f"[{i + 1}/{len(chosen)}] {group:15s} {m:8s} tpot {rec['stats']['tpot_ms']:7.2f} ms  "
                  f"ttft {rec['stats']['ttft_ms']:7.1f} ms  accepted/pass {rec['stats'].get('mean_accepted_tokens', 1):.2f}",
                  file=sys.stderr, flush=True)
    base = rows["none"]
    report = {"bundle": args.bundle, "compile": args.compile, "threads": args.threads, "max_tokens": args.max_tokens, "prompts": len(chosen),
              "load_average": os.getloadavg(), "methods": {}}
    for m in methods:
        rs = rows[m]
        tpot = statistics.median(r["stats"]["tpot_ms"] for r in rs)
        ttft = statistics.median(r["stats"]["ttft_ms"] for r in rs)
        gen_s = sum(r["stats"]["ttft_ms"] + r["stats"]["tpot_ms"] * max(r["stats"]["generated_tokens"] - 1, 0)
                    for r in rs) / 1e3
        toks = sum(r["stats"]["generated_tokens"] for r in rs)
        # per prompt: plain's decode time over this method's (same prompt, same run)
        ratios = [b["stats"]["tpot_ms"] / r["stats"]["tpot_ms"] for b, r in zip(base, rs) if r["stats"]["tpot_ms"] > 0]
        report["methods"][m] = {
            "tpot_ms_median": round(tpot, 2), "ttft_ms_median": round(ttft, 1),
            "tokens_per_s": round(toks / gen_s, 1) if gen_s else None,
            "decode_speedup_median": round(statistics.median(ratios), 3) if ratios else None,
            "decode_speedup_min": round(min(ratios), 3) if ratios else None,
            "mean_accepted_per_pass": round(statistics.mean(r["stats"].get("mean_accepted_tokens", 1.0) for r in rs), 2),
            "greedy_equal": sum(r["token_ids"] == b["token_ids"] for b, r in zip(base, rs)),
            "process_s_median": round(statistics.median(r["process_s"] for r in rs), 2)}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"batch 1, one fresh `specbuild generate{' --compile' if args.compile else ''}` process per prompt and "
          f"method: {args.bundle}, {len(chosen)} "
          f"prompts, {args.max_tokens} tokens max, {args.threads} thread(s), load average {report['load_average'][0]:.1f}")
    print(f"{'method':8s} {'TPOT ms':>8s} {'TTFT ms':>8s} {'tok/s':>7s} {'decode x':>9s} {'min x':>6s} {'acc/pass':>8s} "
          f"{'greedy=':>7s} {'proc s':>6s}")
    for m, r in report["methods"].items():
        print(f"{m:8s} {r['tpot_ms_median']:8.2f} {r['ttft_ms_median']:8.1f} {r['tokens_per_s']:7.1f} "
              f"{r['decode_speedup_median']:8.2f}x {r['decode_speedup_min']:5.2f}x {r['mean_accepted_per_pass']:8.2f} "
              f"{r['greedy_equal']:>3d}/{len(chosen):<3d} {r['process_s_median']:6.2f}")
    print("decode x: plain TPOT / this method's TPOT per prompt (median, min); tok/s: generated tokens over "
          "TTFT + decode time (process start and bundle load excluded; proc s is the whole process)")


if __name__ == "__main__":
    main()
