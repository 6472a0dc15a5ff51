"""Tool calling on the held-out prompt set (specbuild/data/tools/prompts.json: 30 requests, 1-3
functions each) with tool_choice "required", per speculation method: the share of answers
whose calls parse and validate against their function's schema, whether greedy tokens equal
plain decoding's, tokens per target pass, and the grammar's mask cost per token.

    python scripts/bench_tools.py BUNDLE [--methods unforced,none,draft,ngram] [--limit 30] [--max-tokens 200] [--out F.json]

`unforced` is plain decoding with no speculation at all: `none` still verifies the tokens the
call grammar forces as a free draft (Speculator.forced_draft), so `unforced` against `none`
measures what speculating on forced tokens gains.

An answer counts as valid when the message the client gets (`ToolUse.final_choice`) has at
least one call, no content, and every call validates against its function's schema;
finish reasons are counted too ("length": max_tokens cut the answer).

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


# a row with no speculation at all: method none with the grammar's forced tokens not drafted
# (by default every method, none included, verifies the tokens a grammar forces as a free draft)
UNFORCED = "unforced"


def check(message: dict, tools: list[dict]) -> tuple[bool, str]:
    """The answer as the client gets it: calls, no content, each valid against its schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = [c["function"] for c in message.get("tool_calls") or []]
    if not calls or message.get("content"):
        return False, f"no clean calls: content {str(message.get('content'))[:80]!r}, {len(calls)} calls"
    for call in calls:
        ok, why = validates(call["arguments"], schemas[call["name"]])
        if not ok:
            return False, f"{call['name']}: {why}"
    return True, ""


class Done:
    """The finished sequence as final_choice reads it."""

    def __init__(self, out: dict) -> None:
        self.text, self.output_ids, self.finish_reason = out["text"], out["token_ids"], out["finish_reason"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--methods", default="none,draft,ngram")
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-parallel", action="store_true", help="parallel_tool_calls false (one call per answer)")
    ap.add_argument("--out", help="write every answer (text, message, finish reason) to this JSON file")
    args = ap.parse_args()
    engine = Engine(args.bundle, EngineConfig(prefix_cache=False, threads=args.threads))
    server = OpenAIServer(engine)
    text = resources.files("specbuild").joinpath("data", "tools", "prompts.json").read_text(encoding="utf-8")
    prompts = json.loads(text)["prompts"][:args.limit]
    methods = args.methods.split(",")
    results: dict[str, list[dict]] = {m: [] for m in methods}
    for p in prompts:
        for method in methods:  # interleaved: drift on a shared host hits every method alike
            body = ChatRequest.model_validate({"messages": p["messages"], "tools": p["tools"], "tool_choice": "required",
                                               "parallel_tool_calls": not args.no_parallel, "max_tokens": args.max_tokens, "temperature": 0,
                                               "speculation": "none" if method == UNFORCED else method})
            call = server.parse(body, "chat")
            t0 = time.perf_counter()
            if method == UNFORCED:  # no speculation at all: the grammar's forced tokens are not drafted
                engine.speculator.forced_draft = lambda seq: None
            try:
                out = engine.generate([call.request])[0]
            finally:
                engine.speculator.__dict__.pop("forced_draft", None)
            wall = time.perf_counter() - t0
            answer = call.tools.final_choice(call, Done(out), 0, None)
            ok, why = check(answer["message"], p["tools"])
            st = out["stats"]
            print(f"{p['id']} {method:6s} valid={ok} calls={len(answer['message'].get('tool_calls') or [])} "
                  f"finish={answer['finish_reason']} tokens={st['generated_tokens']} wall={wall:.1f}s {why}", flush=True)
            results[method].append({"id": p["id"], "ok": ok, "why": why, "tokens": out["token_ids"], "wall": wall,
                                    "text": out["text"], "message": answer["message"],
                                    "finish": answer["finish_reason"],
                                    "gen": st["generated_tokens"], "passes": st["target_passes"],
                                    "mat": st["mean_accepted_tokens"], "mask_ms": st.get("grammar_mask_ms", 0.0),
                                    "rows": st.get("grammar_masked_rows", 0)})
    base = results[methods[0]]
    print(f"{len(prompts)} prompts, tool_choice required, parallel_tool_calls {not args.no_parallel}, greedy, max_tokens {args.max_tokens}, "
          f"threads {args.threads}, load {open('/proc/loadavg').read().split()[:3]}")
    print("method   valid   same-as-first  tokens/pass  mask ms/token  mask ms/row  tok/s (median)  finish reasons")
    for method in methods:
        rs = results[method]
        valid = sum(r["ok"] for r in rs)
        same = sum(r["tokens"] == b["tokens"] for r, b in zip(rs, base))
        gen = sum(r["gen"] for r in rs)
        decode_passes = sum(r["gen"] / r["mat"] for r in rs if r["mat"])
        mask = sum(r["mask_ms"] for r in rs)
        rows = sum(r["rows"] for r in rs)
        speed = statistics.median(r["gen"] / r["wall"] for r in rs)
        reasons = {f: sum(r["finish"] == f for r in rs) for f in sorted({r["finish"] for r in rs})}
        print(f"{method:8s} {valid:2d}/{len(rs):2d}   {same:2d}/{len(rs):2d}          {gen / decode_passes:6.2f}"
              f"       {mask / gen:8.4f}      {mask / max(rows, 1):8.4f}    {speed:7.1f}         {reasons}")
        for r in rs:
            if not r["ok"]:
                print(f"  {r['id']}: {r['why']}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({m: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for m, rs in results.items()},
                      f, indent=1)


if __name__ == "__main__":
    main()
