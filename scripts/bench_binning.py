"""Ragged-accept verification: one padded batch vs flattened ragged tokens vs planned
micro-batches, measured in one run on the same prompts (batched, prompt lookup).

    python scripts/bench_binning.py BUNDLE [--batch-size 8] [--max-tokens 64] [--threads 2] [--repeats 3]

Prints tokens/s per strategy (median of repeats), target passes, and checks that every
strategy's greedy output equals plain decoding. The engine runs ragged only; padded and bins
run through its step's two seams (specbuild/bench/binning.use).
"""

from __future__ import annotations

import argparse

import statistics
import time


from specbuild.bench import specbench as B  # noqa: E402
from specbuild.bench.binning import STRATEGIES, use  # noqa: E402
from specbuild.engine.engine import Engine, EngineConfig  # noqa: E402
from specbuild.sampling.params import SamplingParams  # noqa: E402
from specbuild.engine.sequence import Request  # noqa: E402
from specbuild.speculation.config import SpeculationConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gamma", type=int, default=4, help="fixed draft length (0: dynamic)")
    args = ap.parse_args()
    engines = {s: Engine(args.bundle, EngineConfig(prefix_cache=False, threads=args.threads, max_batch_size=args.batch_size))
               for s in STRATEGIES}
    for s, engine in engines.items():
        use(engine, s)
    any_engine = engines["ragged"]
    questions = B.select_questions(B.load_questions(), B.load_split(), "eval", per_category=2)[:args.batch_size]
    prompts = [any_engine.encode(any_engine.render_chat([{"role": "user", "content": q["turns"][0]}]),
                                 add_special_tokens=False)[-400:] for q in questions]

    def run(engine, method):
        spec = SpeculationConfig.make(None, method=method, gamma=args.gamma or None)
        t0 = time.perf_counter()
        passes0 = engine.scheduler.passes
        res = engine.generate([Request(prompt_ids=p, speculation=spec, sampling=SamplingParams(max_tokens=args.max_tokens))
                               for p in prompts])
        return time.perf_counter() - t0, res, engine.scheduler.passes - passes0

    plain_t, plain, plain_passes = run(any_engine, "none")
    rows = {}
    for _ in range(args.repeats):  # interleaved so load drift hits every strategy alike
        for name, engine in engines.items():
            t, res, passes = run(engine, "ngram")
            rows.setdefault(name, []).append((t, res, passes))
    tokens = sum(len(r["token_ids"]) for r in plain)
    print(f"{len(prompts)} eval prompts batched, prompt lookup gamma={args.gamma or 'dynamic'}, "
          f"{args.max_tokens} tokens, {args.threads} threads, median of {args.repeats}")
    print(f"{'strategy':8s} {'tok/s':>8s} {'passes':>7s} {'mean acc':>9s} {'identical':>10s}")
    print(f"{'plain':8s} {tokens / plain_t:8.1f} {plain_passes:7d} {1.0:9.2f} {'-':>10s}")
    for name, runs in rows.items():
        t = statistics.median(r[0] for r in runs)
        res = runs[0][1]
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(res, plain))
        acc = statistics.mean(r["stats"]["mean_accepted_tokens"] for r in res)
        print(f"{name:8s} {tokens / t:8.1f} {runs[0][2]:7d} {acc:9.2f} {f'{same}/{len(res)}':>10s}")


if __name__ == "__main__":
    main()
