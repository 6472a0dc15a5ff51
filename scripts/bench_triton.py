#!/usr/bin/env python3
"""Triton's path against `specbuild serve`: throughput, TTFT and TPOT on the same bundle and load.

    python scripts/bench_triton.py --tiny --requests 16 --concurrency 4 --max-tokens 32
    python scripts/bench_triton.py --bundle bundles/smollm2 --speculation ngram --json out.json

Both servers are up at once with the same engine settings (threads, batch), but only one
is loaded at a time; measured rounds alternate between front ends so that drift in the
machine's load hits each alike, and the median round is reported. The load is
closed-loop: `concurrency` clients each send streamed greedy requests back to back until
`requests` are done, prompts cycling through a fixed list. Front ends measured:

  serve        specbuild serve, POST /v1/completions with stream (SSE)
  triton-sse   tritonserver, POST /v2/models/<m>/generate_stream (SSE)
  triton-grpc  tritonserver, one gRPC stream (tritonclient) for all clients

TTFT: send to the first chunk with text; TPOT: (last chunk - first chunk) / (tokens - 1);
throughput: generated tokens / wall time of the whole load. Token counts come from serve's
usage for the same prompt (greedy: the texts must match, and the script checks they do).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from urllib.parse import urlparse

from _common import get, send, sse_events, tiny_bundle  # scripts/_common.py
from specbuild.bench.served import pct, stop_process_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN = float("nan")  # a percentile of no values
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three laws of thermodynamics are", "Hello world, hello world, hello", "A list of prime numbers: 2, 3, 5,",
           "The quick brown fox jumps over", "In 1969, the first humans to walk on the Moon"]


def load_getter():
    spec = importlib.util.spec_from_file_location("get_tritonserver", os.path.join(ROOT, "scripts", "get_tritonserver.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def request_serve(host: str, port: int, prompt: str, args) -> tuple:
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "speculation": args.speculation}
    t0 = time.perf_counter()
    conn, resp = send(port, "/v1/completions", body, timeout=600, host=host)
    first = last = None
    text, tokens = [], None
    for now, obj in sse_events(resp):
        if obj == "[DONE]":
            break
        if "error" in obj:
            raise RuntimeError(obj["error"])
        for c in obj.get("choices", []):
            if c.get("text"):
                first = first or now
                last = now
                text.append(c["text"])
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
    conn.close()
    return t0, first, last, "".join(text), tokens


def request_triton_sse(host: str, port: int, prompt: str, args) -> tuple:
    body = {"text_input": prompt, "max_tokens": args.max_tokens, "stream": True, "temperature": 0.0,
            "speculation": args.speculation}
    t0 = time.perf_counter()
    conn, resp = send(port, f"/v2/models/{args.model_name}/generate_stream", body, timeout=600, host=host)
    first = last = None
    text = []
    for now, obj in sse_events(resp):
        if obj == "[DONE]":
            break
        if "error" in obj:
            raise RuntimeError(obj["error"])
        if obj.get("text_output"):
            first = first or now
            last = now
            text.append(obj["text_output"])
    conn.close()
    return t0, first, last, "".join(text), None


class GrpcStream:
    """One gRPC stream shared by all client threads (requests told apart by id), as a
    TensorRT-LLM streaming client does it. (Separate clients per thread share gRPC's global
    subchannel: closing one broke the others' streams.)"""

    def __init__(self, port: int, args) -> None:
        import tritonclient.grpc as grpc

        self.grpc, self.args = grpc, args
        self.client = grpc.InferenceServerClient(f"127.0.0.1:{port}")
        self.queues: dict[str, queue.Queue] = {}
        self.ids = iter(range(1 << 62))
        self.lock = threading.Lock()
        self.client.start_stream(callback=self.on_response)

    def on_response(self, result, error) -> None:
        now = time.perf_counter()
        if error is not None:  # the stream's errors carry no request id: fail every waiter
            for q in list(self.queues.values()):
                q.put((now, None, error))
            return
        self.queues[result.get_response().id].put((now, result, None))

    def inputs(self, prompt: str) -> list:
        import numpy as np

        out = []
        for name, arr, dtype in (("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                                 ("max_tokens", np.array([self.args.max_tokens], dtype=np.int32), "INT32"),
                                 ("stream", np.array([True]), "BOOL"),
                                 ("temperature", np.array([0.0], dtype=np.float32), "FP32"),
                                 ("speculation", np.array([self.args.speculation.encode()], dtype=np.object_), "BYTES")):
            tensor = self.grpc.InferInput(name, list(arr.shape), dtype)
            tensor.set_data_from_numpy(arr)
            out.append(tensor)
        return out

    def __call__(self, prompt: str) -> tuple:
        with self.lock:
            request_id = f"r{next(self.ids)}"
        responses = self.queues[request_id] = queue.Queue()
        t0 = time.perf_counter()
        self.client.async_stream_infer(self.args.model_name, self.inputs(prompt), request_id=request_id,
                                       enable_empty_final_response=True)
        first = last = None
        text = []
        try:
            while True:
                now, result, error = responses.get(timeout=600)
                if error is not None:
                    raise RuntimeError(str(error))
                out = result.as_numpy("text_output")
                piece = b"".join(out.reshape(-1)).decode() if out is not None else ""
                if piece:
                    first = first or now
                    last = now
                    text.append(piece)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return t0, first, last, "".join(text), None
        finally:
            self.queues.pop(request_id, None)

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def run_load(make_sender, prompts: list[str], concurrency: int) -> tuple[float, list[tuple]]:
    """Closed loop: `concurrency` threads take prompts in order until all are sent."""
    jobs: queue.Queue = queue.Queue()
    for i, p in enumerate(prompts):
        jobs.put((i, p))
    results: list = [None] * len(prompts)
    errors: list = []

    def worker():
        send, close = make_sender()
        try:
            while True:
                try:
                    i, p = jobs.get_nowait()
                except queue.Empty:
                    return
                try:
                    results[i] = send(p)
                except Exception as e:  # report, keep the load going
                    errors.append(f"{p!r}: {e}")
        finally:
            close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return time.perf_counter() - t0, results


def summarize(name: str, wall: float, results: list[tuple], tokens: list[int]) -> dict:
    ttft = [(r[1] - r[0]) * 1e3 for r in results if r[1] is not None]
    tpot = [(r[2] - r[1]) * 1e3 / (n - 1) for r, n in zip(results, tokens) if r[1] is not None and n > 1]
    e2e = [((r[2] or r[0]) - r[0]) * 1e3 for r in results]
    return {"front_end": name, "requests": len(results), "wall_s": round(wall, 3),
            "tokens_per_s": round(sum(tokens) / wall, 2), "ttft_ms_p50": round(pct(ttft, 0.5, NAN), 2),
            "ttft_ms_p90": round(pct(ttft, 0.9, NAN), 2), "tpot_ms_p50": round(pct(tpot, 0.5, NAN), 2),
            "tpot_ms_p90": round(pct(tpot, 0.9, NAN), 2), "e2e_ms_p50": round(pct(e2e, 0.5, NAN), 2),
            "e2e_ms_mean": round(statistics.fmean(e2e), 2)}


# ---- the servers --------------------------------------------------------------------------------
def start_serve(bundle: str, args, log) -> tuple[subprocess.Popen, str, int]:
    cmd = [sys.executable, "-c", "from specbuild.cli import main; main()", "serve", bundle, "--host", "127.0.0.1",
           "--port", "0", "--log-level", "warning", "--max-queue", "1024"] + engine_flags(args)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = re.search(r"on (http://\S+) \(", line or "")
        if m:
            url = urlparse(m.group(1))
            return proc, url.hostname, url.port
        if proc.poll() is not None:
            break
    raise RuntimeError("specbuild serve did not start")


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def engine_flags(args) -> list[str]:
    out = ["--max-batch-size", str(args.max_batch_size)]
    return out + (["--threads", str(args.threads)] if args.threads else [])


def start_triton(bundle: str, args, workdir: str, log) -> tuple[subprocess.Popen, int, int, float]:
    from specbuild.serve.tritonserver import RepoConfig, server_command, write_repository

    paths = load_getter().ensure()
    repo = os.path.join(workdir, "repo")
    write_repository(bundle, repo, RepoConfig(model_name=args.model_name, python_env=paths["python_env"],
                                              threads=args.threads, max_batch_size=args.max_batch_size,
                                              max_queue=1024, plain=False))
    ports = [args.base_port, args.base_port + 1, args.base_port + 2] if args.base_port else free_ports(3)
    argv, env = server_command(paths, repo, *ports)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    while time.monotonic() - t0 < 300:
        if proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with {proc.returncode} (log: {log.name})")
        if get(ports[0], "/v2/health/ready", timeout=2)[0] == 200:
            return proc, ports[0], ports[1], time.monotonic() - t0
        time.sleep(0.1)
    stop_process_group(proc)
    raise RuntimeError("tritonserver did not become ready in 300 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", help="bundle directory")
    ap.add_argument("--tiny", action="store_true", help="build and use a tiny random bundle instead")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--speculation", default="ngram", help="method for every request [%(default)s]")
    ap.add_argument("--threads", type=int, default=None, help="torch threads in both servers")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--model-name", default="specbuild")
    ap.add_argument("--base-port", type=int, default=0, help="Triton's HTTP port, +1 gRPC, +2 metrics [free ports]")
    ap.add_argument("--front-ends", default="serve,triton-sse,triton-grpc")
    ap.add_argument("--rounds", type=int, default=3, help="alternating measured rounds per front end")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if bool(args.bundle) == args.tiny:
        ap.error("give exactly one of --bundle or --tiny")
    workdir = tempfile.mkdtemp(prefix="bench_triton_")
    bundle = tiny_bundle(workdir) if args.tiny else os.path.abspath(args.bundle)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    warm = PROMPTS[: min(args.concurrency, len(PROMPTS))]
    fronts = [f for f in ("serve", "triton-sse", "triton-grpc") if f in args.front_ends.split(",")]
    log = open(os.path.join(workdir, "servers.log"), "w")
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # both servers: see specbuild/__init__.py

    # both servers stay up; only one is loaded at a time, rounds alternate so drift hits both
    serve_proc, host, port = start_serve(bundle, args, log)
    procs = [serve_proc]
    closers: list = []
    try:
        senders = {"serve": lambda: (lambda p: request_serve(host, port, p, args), lambda: None)}
        if {"triton-sse", "triton-grpc"} & set(fronts):
            proc, http_port, grpc_port, startup = start_triton(bundle, args, workdir, log)
            procs.append(proc)
            print(f"tritonserver ready in {startup:.1f}s", file=sys.stderr)
            senders["triton-sse"] = lambda: (lambda p: request_triton_sse("127.0.0.1", http_port, p, args),
                                             lambda: None)
            grpc_stream = GrpcStream(grpc_port, args)
            closers.append(grpc_stream.close)
            senders["triton-grpc"] = lambda: (grpc_stream, lambda: None)
        _, results = run_load(senders["serve"], prompts, args.concurrency)  # token counts (serve's usage)
        tokens_by_prompt = {p: r[4] for p, r in zip(prompts, results)}
        tokens = [tokens_by_prompt[p] for p in prompts]
        for front in fronts:
            run_load(senders[front], warm, args.concurrency)
        per_round: dict[str, list[dict]] = {f: [] for f in fronts}
        texts: dict[str, list[str]] = {}
        for _ in range(args.rounds):
            for front in fronts:
                wall, results = run_load(senders[front], prompts, args.concurrency)
                per_round[front].append(summarize(front, wall, results, tokens))
                texts[front] = [r[3] for r in results]
                texts.setdefault("reference", texts[front])
    finally:
        for close in closers:
            close()
        for proc in procs:
            stop_process_group(proc)
    rows = []
    for front in fronts:  # the median round by throughput
        runs = sorted(per_round[front], key=lambda r: r["tokens_per_s"])
        row = dict(runs[len(runs) // 2])
        row["tokens_per_s_rounds"] = [r["tokens_per_s"] for r in per_round[front]]
        row["same_text"] = sum(a == b for a, b in zip(texts[front], texts["reference"]))
        rows.append(row)
    base = next((r for r in rows if r["front_end"] == "serve"), None)
    print(f"bundle {bundle}; {args.requests} requests, concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
          f"speculation {args.speculation}, threads {args.threads}, {sum(tokens)} tokens per run, "
          f"median of {args.rounds} alternating rounds")
    print(f"{'front end':12} {'tok/s':>8} {'wall s':>7} {'TTFT p50':>9} {'p90':>8} {'TPOT p50':>9} {'p90':>8} "
          f"{'time vs serve':>14}  same text")
    for r in rows:
        overhead = f"{(base['tokens_per_s'] / r['tokens_per_s'] - 1) * 100:+.1f}%" if base else "-"
        print(f"{r['front_end']:12} {r['tokens_per_s']:8.1f} {r['wall_s']:7.2f} {r['ttft_ms_p50']:9.1f} "
              f"{r['ttft_ms_p90']:8.1f} {r['tpot_ms_p50']:9.2f} {r['tpot_ms_p90']:8.2f} {overhead:>14}  "
              f"{r['same_text']}/{len(prompts)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "bundle": bundle, "rows": rows}, f, indent=2)
    return 0 if all(r["same_text"] == len(prompts) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
