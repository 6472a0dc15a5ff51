#!/usr/bin/env python
"""Bounded soak of `specbuild serve` over loopback: mixed traffic from concurrent clients,
then the server's books are checked.

    .venv/bin/python scripts/soak_server.py [--bundle B] [--requests 200] [--clients 16]
        [--server-pythonpath DIR] [--label new] [--json out.json]

Without --bundle it builds a tiny float64 bundle (random Llama target, a perturbed copy as
draft model, Medusa heads trained for a few seconds) in a temp dir, so every speculation
method can be asked for. It starts the server (`python -c "from specbuild.cli import main;
main()" serve ...`, with PYTHONPATH=--server-pythonpath when given: that is how an older tree
is measured against this one, e.g. `git archive f20a636 | tar -x -C /tmp/old_tree`), sends
--requests requests from --clients threads and stops by itself.

The mix (drawn from --seed): greedy completions and chats, streamed and not, over every
speculation method (none, ngram, draft, medusa with preset trees, auto); sampled requests
with a seed; streams the client cuts after a few chunks; bad bodies (each must get a 4xx).
Checks, each a failure of the run (exit 1):
  - every request got exactly one answer (no 5xx, no connection error, no stream without
    its [DONE] unless the client cut it), and no response id came twice;
  - every greedy answer equals plain greedy `Engine.generate` token for token;
  - afterwards the server is idle with its KV pool whole (kv_blocks_used 0) and its
    requests_total grew by exactly the number of admitted requests.
Prints throughput (output tokens/s and requests/s over the run) and p50/p99 TTFT and TPOT
(ms, over streamed greedy and sampled requests), plus the machine (lscpu model, flags).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "helpers"))  # the tests' server process
from _common import get, lscpu, send, sse_events, tiny_bundle  # noqa: E402  (scripts/_common.py)
from http_client import ServerProcess  # noqa: E402
from specbuild.bench.served import pct  # noqa: E402
METHODS = ("none", "ngram", "draft", "medusa", "auto")
BAD_BODIES = [
    b"{not json", b"[1, 2]", b'{"prompt": "hi", "max_tokens": "ten"}', b'{"prompt": "hi", "repetition_penalty": 1.5}',
    b'{"prompt": "hi", "gamma": 99}', b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": [1, 2, 100000]}',
    b'{"prompt": "hi", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]}',
    b'{"messages": [{"role": "wizard", "content": "hi"}]}', b'{"prompt": "hi", "speculation": "telepathy"}',
    b'{"prompt": "hi", "max_tokens": 100000000}',
]
CHAT_BAD = {b'{"messages": [{"role": "wizard", "content": "hi"}]}'}


# ---- the bundle and the server ---------------------------------------------------------------
def build_bundle(root: str, say=print) -> str:
    """Tiny float64 target + perturbed draft + briefly trained Medusa heads (seconds)."""
    say("building a tiny bundle (target, draft, Medusa heads) ...")
    return tiny_bundle(root, draft_noise=0.08, medusa=True, seed=3, max_seq_len=1024)


class Server(ServerProcess):
    """`specbuild serve` in a subprocess (tests/helpers/http_client.ServerProcess), with
    PYTHONPATH=`pythonpath` when given (an older tree), and a graceful stop."""

    def __init__(self, bundle: str, log_path: str, pythonpath: str | None = None, extra: tuple[str, ...] = ()):
        env = dict(os.environ)
        env["PYTHONPATH"] = pythonpath or env.get("PYTHONPATH", REPO)
        env.setdefault("GOMP_SPINCOUNT", "10000")
        # cwd: `python -c` puts it first on sys.path, ahead of PYTHONPATH (an older tree's code must win)
        super().__init__(bundle, log_path, "--max-batch-size", "8", *extra, env=env, timeout=120,
                         cwd=pythonpath or REPO)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def requests_total(port: int) -> float:
    status, text = get(port, "/metrics")
    assert status == 200, status
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specbuild_requests_total{"))


# ---- the traffic ------------------------------------------------------------------------------
@dataclass
class Job:
    index: int
    kind: str  # greedy | stream | chat | chat_stream | sampled | cancel | bad
    path: str
    body: dict | None = None
    raw: bytes | None = None
    expect_key: tuple | None = None  # greedy: key into the expected answers


@dataclass
class Outcome:
    index: int
    kind: str
    status: int = 0
    ids: list[str] = field(default_factory=list)  # response ids seen (one per answer)
    token_ids: list[int] | None = None
    done: bool = False  # a stream ended with [DONE]
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str | None = None
    retries: int = 0


PROMPTS = ["word3 word10 word17 word1 word8 word15", "ab ab ab ab ab", "the quick brown fox jumps",
           "word1 word2 word3 word1 word2 word3", "once upon a time", "x y z x y z x y"]
CHATS = [[{"role": "user", "content": "hello there"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count: one two three"}]]


def make_jobs(n: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    kinds = ["greedy"] * 5 + ["stream"] * 5 + ["chat"] * 2 + ["chat_stream"] * 2 + ["sampled"] * 2 + ["cancel"] * 2 + \
        ["bad"] * 2
    for i in range(n):
        kind = rng.choice(kinds)
        method = METHODS[i % len(METHODS)]
        spec: dict = {} if method == "none" else {"speculation": method}
        if method in ("ngram", "draft"):
            spec["gamma"] = rng.choice([2, 4])
        if method == "medusa":
            spec["tree"] = rng.choice(["mc_sim_7b_top10", "chain_2", "chain_3"])
        max_tokens = rng.choice([12, 16, 24])
        common = {"max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True, "temperature": 0, **spec}
        if kind == "bad":
            raw = rng.choice(BAD_BODIES)
            path = "/v1/chat/completions" if raw in CHAT_BAD else "/v1/completions"
            jobs.append(Job(i, kind, path, raw=raw))
        elif kind in ("chat", "chat_stream"):
            c = rng.randrange(len(CHATS))
            body = {"messages": CHATS[c], **common, "stream": kind == "chat_stream"}
            jobs.append(Job(i, kind, "/v1/chat/completions", body, expect_key=("chat", c, max_tokens)))
        else:
            p = rng.randrange(len(PROMPTS))
            body = {"prompt": PROMPTS[p], **common, "stream": kind in ("stream", "sampled", "cancel")}
            if kind == "sampled":
                body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
            if kind == "cancel":
                body["max_tokens"] = 600
            key = ("prompt", p, max_tokens) if kind in ("greedy", "stream") else None
            jobs.append(Job(i, kind, "/v1/completions", body, expect_key=key))
    return jobs


def expected_answers(bundle: str, jobs: list[Job]) -> dict[tuple, list[int]]:
    """Plain greedy (no speculation) token ids for every greedy job's prompt and length."""
    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.engine.sequence import Request
    from specbuild.sampling.params import SamplingParams

    engine = Engine(bundle, EngineConfig(threads=1, load_draft=False))
    keys = sorted({j.expect_key for j in jobs if j.expect_key})
    requests = []
    for kind, i, max_tokens in keys:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if kind == "chat":
            ids = engine.encode(engine.render_chat(CHATS[i]), add_special_tokens=False)
            requests.append(Request(prompt_ids=ids, sampling=params, speculation={"method": "none"}))
        else:
            requests.append(Request(prompt=PROMPTS[i], sampling=params, speculation={"method": "none"}))
    return {k: r["token_ids"] for k, r in zip(keys, engine.generate(requests))}


def run_job(port: int, job: Job) -> Outcome:
    out = Outcome(job.index, job.kind)
    stream = bool(job.body and job.body.get("stream"))
    for attempt in range(50):  # 429: retry after its Retry-After (bounded)
        conn = None
        try:
            t0 = time.perf_counter()
            conn, resp = send(port, job.path, job.body, job.raw)
            out.status = resp.status
            if resp.status == 429:
                resp.read()
                out.retries += 1
                time.sleep(float(resp.getheader("Retry-After", "1")) * 0.1)
                continue
            if not stream or resp.status != 200:
                body = json.loads(resp.read())
                if resp.status == 200:
                    out.ids.append(body["id"])
                    choice = body["choices"][0]
                    out.token_ids = choice.get("token_ids")
                    out.tokens = body["usage"]["completion_tokens"]
                return out
            times, tokens, chunks = [], [], 0
            for at, event in sse_events(resp):
                if event == "[DONE]":
                    out.done = True
                    break
                if "error" in event:
                    out.error = str(event["error"])
                    continue
                if event["id"] not in out.ids:
                    out.ids.append(event["id"])
                for c in event["choices"]:
                    new = c.get("token_ids") or []
                    if new:
                        times.append(at)
                        tokens += new
                chunks += 1
                if job.kind == "cancel" and chunks >= 3:
                    break  # the client leaves mid-stream
            out.token_ids, out.tokens = tokens, len(tokens)
            if times:
                out.ttft = times[0] - t0
                if len(tokens) > 1:
                    out.tpot = (times[-1] - times[0]) / (len(tokens) - 1)
            return out
        except (OSError, ValueError, KeyError) as e:
            out.error = f"{type(e).__name__}: {e}"
            return out
        finally:
            if conn is not None:
                conn.close()
    out.error = "still 429 after 50 tries"
    return out


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process, all its threads (Linux /proc), or None."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return None


def soak(port: int, jobs: list[Job], expect: dict[tuple, list[int]], clients: int, pid: int | None = None) -> dict:
    """Run the jobs from `clients` threads; return the figures and the list of failures.
    With the server's pid, also its CPU seconds over the run (a cost that, unlike wall time,
    other load on a shared machine barely moves)."""
    before = requests_total(port)
    cpu_before = cpu_seconds(pid)
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    queue = list(reversed(jobs))

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                job = queue.pop()
            result = run_job(port, job)
            with lock:
                outcomes.append(result)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    wall = time.perf_counter() - t0
    cpu_after = cpu_seconds(pid)
    failures = []
    if any(t.is_alive() for t in threads):
        failures.append("clients still running after 600 s")
    by_index = {o.index: o for o in outcomes}
    failures += [f"request {j.index} ({j.kind}) got no outcome" for j in jobs if j.index not in by_index]
    seen: dict[str, int] = {}
    admitted = 0
    for job in jobs:
        o = by_index.get(job.index)
        if o is None:
            continue
        for rid in o.ids:
            if rid in seen:
                failures.append(f"response id {rid} answered requests {seen[rid]} and {job.index}")
            seen[rid] = job.index
        if o.error:
            failures.append(f"request {job.index} ({job.kind}): {o.error}")
        if job.kind == "bad":
            if not 400 <= o.status < 500:
                failures.append(f"bad body {job.raw[:50]!r} got HTTP {o.status}")
            continue
        if o.status != 200:
            failures.append(f"request {job.index} ({job.kind}) got HTTP {o.status}")
            continue
        admitted += 1
        if len(o.ids) != 1:
            failures.append(f"request {job.index} ({job.kind}) had {len(o.ids)} response ids")
        if job.body.get("stream") and job.kind != "cancel" and not o.done:
            failures.append(f"stream {job.index} ({job.kind}) ended without [DONE]")
        if job.expect_key is not None and o.token_ids != expect[job.expect_key]:
            failures.append(f"greedy request {job.index} ({job.kind}, {job.body.get('speculation', 'none')}) "
                            f"differs from generate: {o.token_ids} != {expect[job.expect_key]}")
    # the books, once the server is idle (bounded wait for a state, not a fixed sleep)
    deadline = time.monotonic() + 30
    health: dict = {}
    while time.monotonic() < deadline:
        health = json.loads(get(port, "/health")[1] or "{}")
        idle = health.get("running") == 0 and health.get("queue_depth") == 0 and health.get("kv_blocks_used") == 0
        if idle and requests_total(port) - before >= admitted:  # an abort is counted just after it frees
            break
        time.sleep(0.05)
    else:
        failures.append(f"the server did not return to idle with its KV pool whole: {health}")
    counted = requests_total(port) - before
    if counted != admitted:
        failures.append(f"requests_total grew by {counted:g}, but {admitted} requests were admitted")
    ttft = [o.ttft for o in outcomes if o.ttft is not None and o.kind != "cancel"]
    tpot = [o.tpot for o in outcomes if o.tpot is not None and o.kind != "cancel"]
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    return {"requests": len(jobs), "clients": clients, "wall_s": round(wall, 2),
            "requests_per_s": round(len(jobs) / wall, 2),
            "output_tokens_per_s": round(sum(o.tokens for o in outcomes) / wall, 1),
            "ttft_p50_ms": ms(pct(ttft, 0.5)), "ttft_p99_ms": ms(pct(ttft, 0.99)),
            "tpot_p50_ms": ms(pct(tpot, 0.5)), "tpot_p99_ms": ms(pct(tpot, 0.99)),
            "server_cpu_s": None if cpu_before is None or cpu_after is None else round(cpu_after - cpu_before, 2),
            "admitted": admitted, "bad": sum(j.kind == "bad" for j in jobs),
            "cancelled": sum(j.kind == "cancel" for j in jobs), "retries_429": sum(o.retries for o in outcomes),
            "kinds": {k: sum(j.kind == k for j in jobs) for k in sorted({j.kind for j in jobs})},
            "failures": failures}


def machine() -> str:
    text = lscpu()
    if not text:
        return "lscpu unavailable"
    model = re.search(r"Model name:\s*(.*)", text)
    flags = re.search(r"Flags:\s*(.*)", text)
    wanted = [f for f in (flags.group(1).split() if flags else []) if f.startswith(("avx512", "amx", "avx2"))]
    return f"{model.group(1).strip() if model else '?'}; {os.cpu_count()} CPUs; flags: {' '.join(wanted)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", help="a bundle with draft and Medusa roles [build a tiny one]")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-pythonpath", action="append", default=[],
                    help="PYTHONPATH of a server to run (repeat: one run per tree, same bundle and jobs) "
                         "[this tree]; LABEL=DIR names the row")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if not 1 <= args.requests <= 100_000 or not 1 <= args.clients <= 256:
        ap.error(f"--requests {args.requests} must be in [1, 100000] and --clients {args.clients} in [1, 256]")
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        bundle = args.bundle or build_bundle(tmp)
        jobs = make_jobs(args.requests, args.seed)
        expect = expected_answers(bundle, jobs)
        rows = {}
        for spec in args.server_pythonpath or [f"this={REPO}"]:
            label, _, path = spec.rpartition("=") if "=" in spec else (spec, "", spec)
            server = Server(bundle, os.path.join(tmp, f"{label}.log"), pythonpath=path)
            try:
                rows[label] = result = soak(server.port, jobs, expect, args.clients, pid=server.proc.pid)
            finally:
                server.stop()
            print(f"[{label}] PYTHONPATH={path}")
            print(f"  {result['requests']} requests ({result['kinds']}) from {result['clients']} clients in "
                  f"{result['wall_s']} s: {result['requests_per_s']} req/s, {result['output_tokens_per_s']} tok/s; "
                  f"server CPU {result['server_cpu_s']} s")
            print(f"  TTFT p50 {result['ttft_p50_ms']} ms, p99 {result['ttft_p99_ms']} ms; "
                  f"TPOT p50 {result['tpot_p50_ms']} ms, p99 {result['tpot_p99_ms']} ms; 429 retries "
                  f"{result['retries_429']}")
            for failure in result["failures"][:20]:
                print(f"  FAIL {failure}")
            print(f"  {'FAILED' if result['failures'] else 'OK'}: {len(result['failures'])} failures")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine(), "rows": rows}, f, indent=1)
    return 1 if any(r["failures"] for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
