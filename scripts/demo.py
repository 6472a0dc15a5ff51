"""Plain vs speculative decoding on a few held-out Spec-Bench prompts: a short table of
tokens/s, speedup, mean accepted tokens, and whether the greedy outputs are identical."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib import resources

from specbuild.engine.engine import Engine, EngineConfig
from specbuild.sampling.params import SamplingParams
from specbuild.engine.sequence import Request
from specbuild.speculation.config import SpeculationConfig

FALLBACK = [
    "Summarize the following text in two sentences: The city council met on Tuesday to discuss the new "
    "park. The city council agreed that the new park will open in May, and the new park will have a "
    "playground, a pond and a small library.",
    "Rewrite this sentence in the past tense: I walk to the store, I buy bread, and I walk back home.",
]


def prompts(n: int) -> list[str]:
    try:
        root = resources.files("specbuild") / "data" / "spec_bench"
        split = json.loads((root / "split.json").read_text())
        eval_ids = set(split["eval"])
        rows = [json.loads(line) for line in (root / "question.jsonl").read_text().splitlines() if line.strip()]
        picked = {}
        for r in rows:  # one per category from the eval split, summarisation/RAG first
            if r["question_id"] in eval_ids and r["category"] not in picked:
                picked[r["category"]] = r["turns"][0]
        order = ["summarization", "rag", "math_reasoning", "qa", "translation"]
        out = [picked[c] for c in order if c in picked]
        return (out or FALLBACK)[:n]
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return FALLBACK[:n]


def run(engine: Engine, chats: list[list[int]], method: str, max_tokens: int) -> tuple[float, list[dict]]:
    spec = SpeculationConfig.make(engine.default_speculation, method=method)
    t0 = time.perf_counter()
    results = []
    for ids in chats:  # batch 1, one after another, as a chat user sees it
        h = engine.submit(Request(prompt_ids=ids, sampling=SamplingParams(max_tokens=max_tokens), speculation=spec))
        results.append(h.result())
    return time.perf_counter() - t0, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("bundle")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    engine = Engine(args.bundle, EngineConfig(threads=args.threads))
    chats = [engine.encode(engine.render_chat([{"role": "user", "content": p}]), add_special_tokens=False)
             for p in prompts(args.prompts)]
    methods = [m for m in engine.methods if m != "none"]
    run(engine, chats[:1], "none", 8)  # warm-up
    fmt = engine.target_config.dtype
    base_time, base = run(engine, chats, "none", args.max_tokens)
    base_tokens = sum(r["stats"]["generated_tokens"] for r in base)
    print(f"\n{'method':8s} {'format':9s} {'tok/s':>7s} {'speedup':>8s} {'mean acc':>9s} {'identical':>10s}")
    print(f"{'none':8s} {fmt:9s} {base_tokens / base_time:7.1f} {1.0:8.2f} {1.0:9.2f} {'-':>10s}")
    for m in methods:
        t, res = run(engine, chats, m, args.max_tokens)
        tokens = sum(r["stats"]["generated_tokens"] for r in res)
        same = sum(r["token_ids"] == b["token_ids"] for r, b in zip(res, base))
        acc = statistics.mean(r["stats"]["mean_accepted_tokens"] for r in res)
        print(f"{m:8s} {fmt:9s} {tokens / t:7.1f} {(tokens / t) / (base_tokens / base_time):8.2f} {acc:9.2f} "
              f"{f'{same}/{len(res)}':>10s}")
    print(f"\n{len(chats)} held-out prompts, greedy, batch 1, {args.max_tokens} max tokens, {args.threads} threads")


if __name__ == "__main__":
    main()
