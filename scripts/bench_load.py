#!/usr/bin/env python
"""Load benchmark over loopback HTTP: plain decoding, standard speculation on one rank,
MineDraft on two ranks, each served by `specbuild serve` and hit by N concurrent
streaming clients over Spec-Bench eval prompts.

    .venv/bin/python scripts/bench_load.py [--bundle B] [--clients 8] [--requests 24]
        [--max-tokens 64] [--gamma 4] [--rows plain,standard,minedraft,standard-2t] [--repeats 3]
        [--json out.json]

Without --bundle it builds a synthetic pair in a temp dir: a Llama target whose layers past
the first `--draft-layers` add only small corrections (their output projections are scaled
by `--tail-scale`), and a draft made of the target's first layers. The draft is
`draft-layers / layers` of the target's layer cost and agrees with it often: the regime
MineDraft is about (drafting time comparable to verification time).

Rows (threads are torch threads per rank):
    plain         1 rank x 1 thread, no speculation
    standard      1 rank x 1 thread, draft model, gamma fixed
    minedraft     2 ranks x 1 thread (`mpirun -n 2 ... --parallel-draft`), same gamma
    standard-2t   1 rank x 2 threads (the equal-core comparison for minedraft)

Reported per row: output tokens/s over the run, p50/p99 TTFT and TPOT (ms), mean end-to-end
latency (s), mean accepted tokens per target pass, and for MineDraft the time the verifier
waited for drafts, the draft rank's compute time, the round trip and the batch imbalance.
Every row's server is started once and kept up; the rows then run one after another in
each of `--repeats` rounds (the order rotated per round), so they share the same machine
state; the summary gives per-row medians and the per-round MineDraft/standard throughput
ratios (their spread is the noise). Comparisons are worded by bench/compare.py, whose words
follow the numbers' sign. Every wait is bounded; servers are killed (process group) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from _common import get_json, send, sse_events, tiny_bundle, tiny_hf  # scripts/_common.py
from specbuild.bench.served import pct

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN = float("nan")  # a percentile of no values
PY = sys.executable
MPIRUN = os.path.join(os.path.dirname(PY), "mpirun")
CLI = [PY, "-c", "from specbuild.cli import main; main()"]
ROWS = {"plain": (1, 1, "none"), "standard": (1, 1, "draft"), "minedraft": (2, 1, "draft"),
        "standard-2t": (1, 2, "draft"), "plain-2t": (1, 2, "none")}


def build_pair(root: str, layers: int, draft_layers: int, hidden: int, tail_scale: float) -> str:
    """Synthetic target + draft (see the module doc), compiled into a float32 bundle."""
    from safetensors.torch import load_file, save_file

    target = tiny_hf(os.path.join(root, "target"), hidden=hidden, layers=layers, heads=8, kv_heads=4,
                     inter=hidden * 3, scale=4.0, seed=11)
    path = os.path.join(target, "model.safetensors")
    tensors = load_file(path)
    for name in list(tensors):
        m = re.match(r"model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\.down_proj)\.weight", name)
        if m and int(m.group(1)) >= draft_layers:
            tensors[name] = tensors[name] * tail_scale
    save_file(tensors, path, metadata={"format": "pt"})
    draft = os.path.join(root, "draft")
    tiny_hf(draft, hidden=hidden, layers=draft_layers, heads=8, kv_heads=4, inter=hidden * 3, seed=11)
    kept = {k: v for k, v in tensors.items()
            if not (m := re.match(r"model\.layers\.(\d+)\.", k)) or int(m.group(1)) < draft_layers}
    save_file(kept, os.path.join(draft, "model.safetensors"), metadata={"format": "pt"})
    return tiny_bundle(root, target, draft, dtype="float32", max_seq_len=1024, max_batch_size=16)


def eval_prompts(n: int, max_chars: int) -> list[str]:
    """The held-out questions' first turns (cut to `max_chars`) in the split's order, cycled to `n`."""
    from specbuild.bench.specbench import held_out_questions

    prompts = [q["turns"][0][:max_chars] for q in held_out_questions(spread=False)]
    return [prompts[i % len(prompts)] for i in range(n)]


class Server:
    def __init__(self, bundle: str, ranks: int, threads: int, batch: int, log_path: str) -> None:
        args = ["serve", bundle, "--port", "0", "--threads", str(threads), "--max-batch-size", str(batch),
                "--log-level", "warning", "--max-queue", "1024"]
        cmd = CLI + args
        if ranks == 2:
            cmd = [MPIRUN, "-disable-auto-cleanup", "-n", "2", *CLI, *args, "--parallel-draft"]
        self.log_path = log_path
        self.log = open(log_path, "w")
        env = dict(os.environ)  # the wait policy: specbuild's choice at start (model/threads.py) unless set here
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + 180
        while not (m := re.search(r"on http://127\.0\.0\.1:(\d+)", open(log_path).read())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{open(log_path).read()[-3000:]}")
            time.sleep(0.1)
        self.port = int(m.group(1))

    def get_json(self, path: str) -> dict:
        return get_json(self.port, path)

    def stop(self) -> None:
        from specbuild.bench.served import stop_process_group

        stop_process_group(self.proc)
        self.log.close()


def one_request(port: int, prompt: str, body: dict, timeout: float) -> dict:
    """Stream one completion; returns times (perf_counter seconds), tokens and usage."""
    t0 = time.perf_counter()
    conn, resp = send(port, "/v1/completions", {**body, "prompt": prompt, "stream": True}, timeout=timeout)
    assert resp.status == 200, resp.read()
    first = last = None
    tokens, usage = 0, {}
    for at, chunk in sse_events(resp):
        if chunk == "[DONE]":
            break
        ids = chunk["choices"][0].get("token_ids") or []
        if ids:
            first = first or at
            last = at
            tokens += len(ids)
        usage = chunk.get("usage") or usage
    conn.close()
    return {"start": t0, "first": first, "last": last, "end": time.perf_counter(), "tokens": tokens, "usage": usage}


def run_load(port: int, prompts: list[str], clients: int, body: dict, timeout: float) -> tuple[list[dict], float]:
    todo = list(enumerate(prompts))
    lock = threading.Lock()
    results: list[dict] = []

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                _, prompt = todo.pop(0)
            r = one_request(port, prompt, body, timeout)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return results, time.perf_counter() - t0


def summarize(name: str, results: list[dict], wall: float, health: dict) -> dict:
    ttft = [(r["first"] - r["start"]) * 1e3 for r in results if r["first"]]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) * 1e3 for r in results if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in results)
    passes = sum(r["tokens"] / max(r["usage"].get("mean_accepted_tokens", 1.0), 1e-9) for r in results)
    row = {"row": name, "requests": len(results), "tokens": tokens, "wall_s": round(wall, 2),
           "tokens_per_s": round(tokens / wall, 1), "ttft_p50_ms": round(pct(ttft, 0.5, NAN), 1),
           "ttft_p99_ms": round(pct(ttft, 0.99, NAN), 1), "tpot_p50_ms": round(pct(tpot, 0.5, NAN), 2),
           "tpot_p99_ms": round(pct(tpot, 0.99, NAN), 2),
           "e2e_mean_s": round(statistics.mean(r["end"] - r["start"] for r in results), 3),
           "mean_accepted_tokens": round(tokens / passes, 3) if passes else None}
    dr = health.get("draft_rank")
    if dr:
        steps = max(dr["minedraft_steps"], 1)
        row["minedraft"] = {
            "minedraft_steps": dr["minedraft_steps"], "ordinary_steps": dr["ordinary_steps"],
            "verify_ms_per_step": round(dr["verify_seconds"] / steps * 1e3, 2),
            "wait_ms_per_step": round(dr["wait_seconds"] / steps * 1e3, 2),
            "draft_ms_per_request": round(dr["draft_seconds"] / max(dr["requests"], 1) * 1e3, 2),
            "request_latency_ms": round(dr["request_latency_seconds"] / max(dr["requests"], 1) * 1e3, 3),
            "reply_latency_ms": round(dr["reply_latency_seconds"] / max(dr["requests"], 1) * 1e3, 3),
            "codec_ms_per_request": round(dr["codec_seconds"] / max(dr["requests"], 1) * 1e3, 3),
            "mean_imbalance": round(dr["imbalance_sum"] / steps, 2),
            "mean_batch": round(dr["batch_sum"] / steps, 2), "state": dr["state"],
            "sync_drafted_sequences": dr.get("sync_drafted_sequences"),
            "prefilled_sequences": dr.get("prefilled_sequences")}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", help="bundle with a draft role [a synthetic pair is built]")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--tail-scale", type=float, default=0.05)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-chars", type=int, default=300)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--rows", default="plain,standard,minedraft,standard-2t")
    ap.add_argument("--timeout", type=float, default=600, help="bound on each row's load (seconds)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats of every row (medians reported)")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    rows = args.rows.split(",")
    bad = [r for r in rows if r not in ROWS]
    if bad:
        sys.exit(f"error: unknown row {bad[0]!r}; rows: {', '.join(ROWS)}")
    if not 1 <= args.repeats <= 50:
        sys.exit(f"error: --repeats {args.repeats} is out of range [1, 50]")
    if "minedraft" in rows and not os.access(MPIRUN, os.X_OK):
        sys.exit(f"error: {MPIRUN} missing; pip install mpi4py mpich")
    work = tempfile.mkdtemp(prefix="specbuild_bench_load_")
    bundle = args.bundle or build_pair(work, args.layers, args.draft_layers, args.hidden, args.tail_scale)
    prompts = eval_prompts(args.requests, args.prompt_chars)
    servers: dict[str, Server] = {}
    bodies: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {name: [] for name in rows}
    try:
        for name in rows:  # every row's server is up for the whole run, so rows interleave
            ranks, threads, method = ROWS[name]
            bodies[name] = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0,
                            "speculation": method, "return_token_ids": True,
                            **({"gamma": args.gamma} if method != "none" else {})}
            servers[name] = Server(bundle, ranks, threads, args.clients, os.path.join(work, f"{name}.log"))
            run_load(servers[name].port, prompts[:2], 2, bodies[name], args.timeout)  # warm-up (calibration)
        for rep in range(args.repeats):
            order = rows[rep % len(rows):] + rows[:rep % len(rows)]  # rotate: no row always goes first
            for name in order:
                srv, (ranks, threads, _) = servers[name], ROWS[name]
                before = srv.get_json("/health").get("draft_rank") if ranks == 2 else None
                results, wall = run_load(srv.port, prompts, args.clients, bodies[name], args.timeout)
                health = srv.get_json("/health")
                if before:  # this run's share of the draft rank's counters
                    for key, value in before.items():
                        if isinstance(value, (int, float)) and key in health["draft_rank"] and not key.endswith("pid"):
                            health["draft_rank"][key] -= value
                row = summarize(name, results, wall, health)
                row.update(ranks=ranks, threads_per_rank=threads, repeat=rep)
                runs[name].append(row)
                print(json.dumps(row), flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    report = [median_row(runs[name]) for name in rows]
    print(f"medians over {args.repeats} interleaved repeat(s):")
    for row in report:
        print(json.dumps(row), flush=True)
    for line in comparison_lines(runs):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": report, "runs": runs}, f, indent=1)


MEDIAN_KEYS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_mean_s",
               "mean_accepted_tokens", "wall_s")


def median_row(runs: list[dict]) -> dict:
    """One row's figures as medians over its repeats (the MineDraft counters of the median-
    throughput repeat)."""
    row = {"row": runs[0]["row"], "repeats": len(runs), "ranks": runs[0]["ranks"],
           "threads_per_rank": runs[0]["threads_per_rank"]}
    for key in MEDIAN_KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        row[key] = round(statistics.median(values), 3) if values else None
    mid = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
    if "minedraft" in mid:
        row["minedraft"] = mid["minedraft"]
    return row


def comparison_lines(runs: dict[str, list[dict]]) -> list[str]:
    """MineDraft against each standard row: the medians' comparison in words that follow the
    numbers' sign (bench/compare.py), and the per-repeat throughput ratios (how noisy it was)."""
    from specbuild.bench.compare import compare, ratio_phrase

    lines = []
    for base, label in (("standard", "one extra core"), ("standard-2t", "equal cores")):
        if base not in runs or "minedraft" not in runs:
            continue
        m, s = median_row(runs["minedraft"]), median_row(runs[base])
        per_rep = [ratio_phrase(a["tokens_per_s"], b["tokens_per_s"]) for a, b in zip(runs["minedraft"], runs[base])]
        lines.append(f"minedraft vs {base} ({label}), medians: throughput {ratio_phrase(m['tokens_per_s'], s['tokens_per_s'])} "
                     f"(per repeat: {', '.join(per_rep)})")
        lines.append("  " + compare("throughput", m["tokens_per_s"], s["tokens_per_s"], "tok/s", better="higher"))
        lines.append("  " + compare("mean e2e latency", m["e2e_mean_s"], s["e2e_mean_s"], "s"))
        lines.append("  " + compare("TTFT p50", m["ttft_p50_ms"], s["ttft_p50_ms"], "ms"))
        lines.append("  " + compare("TPOT p50", m["tpot_p50_ms"], s["tpot_p50_ms"], "ms"))
    return lines


if __name__ == "__main__":
    main()
