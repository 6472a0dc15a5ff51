"""Tool calling on the held-out prompt set (specbuild/data/tools/prompts.json: 30 requests, 1-3
functions each) with tool_choice "required", per speculation method: the share of answers
whose calls parse and validate against their function's schema, whether greedy tokens equal
plain decoding's, tokens per target pass, and the grammar's mask cost per token.

    python scripts/bench_tools.py BUNDLE [--methods none,draft,ngram] [--limit 30] [--max-tokens 200]

Requests are parsed exactly as `specbuild serve` parses them (OpenAIServer.parse on the chat
body: the built-in tool template, the call grammar) and run on the torch engine in-process,
one at a time, so the figures are the engine's own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from importlib import resources

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specbuild.bench.structured import validates  # noqa: E402
from specbuild.engine.engine import Engine, EngineConfig  # noqa: E402
from specbuild.serve.openai_http import ChatRequest, OpenAIServer  # noqa: E402
from specbuild.serve.tools import PARSERS  # noqa: E402


def load_prompts() -> list[dict]:
    text = resources.files("specbuild").joinpath("data", "tools", "prompts.json").read_text(encoding="utf-8")
    return json.loads(text)["prompts"]


def check(text: str, tools: list[dict]) -> tuple[bool, str]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    content, calls = PARSERS["hermes"].parse(text, set(schemas))
    if not calls or content:
        return False, f"no clean calls in {text[:80]!r}"
    for call in calls:
        ok, why = validates(call["arguments"], schemas[call["name"]])
        if not ok:
            return False, f"{call['name']}: {why}"
    return True, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--methods", default="none,draft,ngram")
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-parallel", action="store_true", help="parallel_tool_calls false (one call per answer)")
    args = ap.parse_args()
    engine = Engine(args.bundle, EngineConfig(threads=args.threads))
    server = OpenAIServer(engine)
    prompts = load_prompts()[:args.limit]
    methods = args.methods.split(",")
    results: dict[str, list[dict]] = {m: [] for m in methods}
    for p in prompts:
        for method in methods:  # interleaved: drift on a shared host hits every method alike
            body = ChatRequest.model_validate({"messages": p["messages"], "tools": p["tools"], "tool_choice": "required",
                                               "parallel_tool_calls": not args.no_parallel, "max_tokens": args.max_tokens, "temperature": 0, "speculation": method})
            call = server.parse(body, "chat")
            t0 = time.perf_counter()
            out = engine.generate([call.request])[0]
            wall = time.perf_counter() - t0
            ok, why = check(out["text"], p["tools"])
            st = out["stats"]
            print(f"{p['id']} {method:6s} valid={ok} tokens={st['generated_tokens']} wall={wall:.1f}s {why}",
                  flush=True)
            results[method].append({"id": p["id"], "ok": ok, "why": why, "tokens": out["token_ids"], "wall": wall,
                                    "gen": st["generated_tokens"], "passes": st["target_passes"],
                                    "mat": st["mean_accepted_tokens"], "mask_ms": st.get("grammar_mask_ms", 0.0),
                                    "rows": st.get("grammar_masked_rows", 0)})
    base = results[methods[0]]
    print(f"{len(prompts)} prompts, tool_choice required, parallel_tool_calls {not args.no_parallel}, greedy, max_tokens {args.max_tokens}, "
          f"threads {args.threads}, load {open('/proc/loadavg').read().split()[:3]}")
    print("method   valid   same-as-first  tokens/pass  mask ms/token  mask ms/row  tok/s (median)")
    for method in methods:
        rs = results[method]
        valid = sum(r["ok"] for r in rs)
        same = sum(r["tokens"] == b["tokens"] for r, b in zip(rs, base))
        gen = sum(r["gen"] for r in rs)
        decode_passes = sum(r["gen"] / r["mat"] for r in rs if r["mat"])
        mask = sum(r["mask_ms"] for r in rs)
        rows = sum(r["rows"] for r in rs)
        speed = statistics.median(r["gen"] / r["wall"] for r in rs)
        print(f"{method:8s} {valid:2d}/{len(rs):2d}   {same:2d}/{len(rs):2d}          {gen / decode_passes:6.2f}"
              f"       {mask / gen:8.4f}      {mask / max(rows, 1):8.4f}    {speed:7.1f}")
        for r in rs:
            if not r["ok"]:
                print(f"  {r['id']}: {r['why']}")


if __name__ == "__main__":
    main()
