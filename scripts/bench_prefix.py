#!/usr/bin/env python
"""Time to first token of a chat's second turn with prefix caching: `specbuild serve` as users
start it (one server with the cache, one with --no-prefix-cache) and llama.cpp's llama-server on
the same GGUF (its prompt cache, one slot), each fresh, one request at a time, streamed chat
completions over HTTP.

For each held-out Spec-Bench question whose first turn renders to --min-tokens..--max-tokens-prompt
tokens (documents with a task: summarization, RAG; ~570 by default), turn 1 is sent, then turn 2
(turn 1, the server's own answer, the question's second turn or a fixed follow-up). Prints per server the median TTFT of each turn, the
second turn's cached tokens (usage.prompt_tokens_details), and the ratio the prefix cache buys:
turn 2's TTFT with the cache over turn 2's without it (the same prompt, the same length), with
the CPU model and flags.

    python scripts/bench_prefix.py BUNDLE                       # specbuild on/off and llama-server
    python scripts/bench_prefix.py BUNDLE --no-llama --conversations 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from specbuild.bench import served as S
from specbuild.bench.specbench import held_out_questions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import post  # noqa: E402  (scripts/_common.py)


FOLLOW_UP = "Thank you. Now say the most important point again in one short sentence."


def conversations(port: int, lo: int, hi: int, n: int) -> list[dict]:
    """Held-out conversations whose first turn renders to lo..hi tokens (the server's /tokenize,
    its chat template)."""
    out = []
    for q in held_out_questions(None, None, spread=True):
        status, body = post(port, "/tokenize", {"messages": [{"role": "user", "content": q["turns"][0]}]})
        if status != 200:
            raise RuntimeError(f"/tokenize answered {status}: {body}")
        if lo <= body["count"] <= hi:
            turns = q["turns"][:2] if len(q["turns"]) > 1 else [q["turns"][0], FOLLOW_UP]
            out.append({"id": q["question_id"], "turns": turns, "tokens": body["count"]})
        if len(out) == n:
            break
    return out


def run_server(name: str, cmd: list[str], port: int, chats, max_tokens: int, log: str, timeout: float,
               pick=None) -> dict:
    """One fresh server: warm-up, then each conversation's two turns. `pick(port)` chooses the
    conversations once the server is up (the first server's /tokenize) when chats is None."""
    server = S.Server(name, cmd, port, log_path=log)
    try:
        server.wait_ready(timeout)
        if chats is None:
            chats = pick(port)
        S.stream_chat(port, [{"role": "user", "content": "Say hello."}], 4, {}, timeout)  # warm-up, unshared
        rows = []
        for c in chats:
            first_msgs = [{"role": "user", "content": c["turns"][0]}]
            one = S.stream_chat(port, first_msgs, max_tokens, {}, timeout)
            second_msgs = first_msgs + [{"role": "assistant", "content": one["text"]},
                                        {"role": "user", "content": c["turns"][1]}]
            two = S.stream_chat(port, second_msgs, max_tokens, {}, timeout)
            rows.append({"id": c["id"], "prompt_tokens": c["tokens"], "ttft1": one["ttft"], "ttft2": two["ttft"],
                         "cached1": one.get("cached_tokens"), "cached2": two.get("cached_tokens")})
        return {"name": name, "rows": rows, "chats": chats}
    finally:
        server.stop()


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--min-tokens", type=int, default=450)
    ap.add_argument("--max-tokens-prompt", type=int, default=700, help="longest first turn, in tokens")
    ap.add_argument("--max-tokens", type=int, default=32, help="answer length of each turn")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--logs", default=".cache/bench_prefix")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not os.path.isfile(os.path.join(a.bundle, "bundle.json")):
        ap.error(f"{a.bundle} is not a bundle (no bundle.json)")
    os.makedirs(a.logs, exist_ok=True)
    m = S.machine()
    print(f"command: {' '.join(sys.argv)}")
    print(f"CPU: {m['cpu']}; flags: {m['flags']}", flush=True)
    cfg = S.ServedConfig(bundle=a.bundle, threads=a.threads, compile=not a.no_compile)
    servers = [("specbuild", []), ("specbuild --no-prefix-cache", ["--no-prefix-cache"])]
    results, chats = [], None

    def pick(port: int) -> list[dict]:
        found = conversations(port, a.min_tokens, a.max_tokens_prompt, a.conversations)
        if not found:
            raise SystemExit(f"no held-out conversation's first turn renders to {a.min_tokens}.."
                             f"{a.max_tokens_prompt} tokens")
        print(f"{len(found)} conversations, first turns of {min(c['tokens'] for c in found)}-"
              f"{max(c['tokens'] for c in found)} tokens, {a.max_tokens}-token answers, greedy", flush=True)
        return found

    for name, extra in servers:
        port = S.free_port()
        cmd = S.specbuild_command(cfg, port, 1) + extra
        print(f"{name}: starting", flush=True)
        results.append(run_server(name, cmd, port, chats, a.max_tokens, os.path.join(a.logs, name.split()[-1] + ".log"),
                                  cfg.start_timeout, pick))
        chats = results[-1]["chats"]
    binary, why = S.find_llama_server(a.llama_server)
    if not a.no_llama and binary:
        port = S.free_port()
        cmd = S.llama_command(binary, a.gguf or S.default_gguf(), port, a.threads, 1, "plain", a.max_tokens,
                              prompt_room=2048)
        print("llama-server: starting", flush=True)
        results.append(run_server("llama-server", cmd, port, chats, a.max_tokens, os.path.join(a.logs, "llama.log"),
                                  cfg.start_timeout))
    elif not a.no_llama:
        print(f"llama-server rows skipped: {why}")
    print(f"\n{'server':30s} {'turn 1 TTFT ms':>15s} {'turn 2 TTFT ms':>15s} {'turn 2 cached':>14s}")
    for r in results:
        t1, t2 = median([x["ttft1"] for x in r["rows"]]), median([x["ttft2"] for x in r["rows"]])
        cached = median([x["cached2"] for x in r["rows"]])
        r["median"] = {"ttft1_ms": t1 * 1e3, "ttft2_ms": t2 * 1e3, "cached2": cached}
        print(f"{r['name']:30s} {t1 * 1e3:15.1f} {t2 * 1e3:15.1f} {'-' if cached is None else int(cached):>14}")
    on, off = results[0]["rows"], results[1]["rows"]
    ratios = [x["ttft2"] / y["ttft2"] for x, y in zip(on, off)]
    print(f"\nturn 2 TTFT with the prefix cache / without it (same prompt): median {median(ratios):.3f} "
          f"(per conversation {', '.join(f'{v:.2f}' for v in ratios)})")
    print(f"uncached first turn (--no-prefix-cache, {median([c['tokens'] for c in chats]):.0f} tokens median): "
          f"{results[1]['median']['ttft1_ms']:.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": m, "command": sys.argv, "conversations": chats, "results": results,
                       "ratio_median": median(ratios)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
