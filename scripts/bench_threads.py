#!/usr/bin/env python
"""Plain decoding ms/token with the machine idle and beside a second CPU-bound process, per
thread policy, interleaved.

    python scripts/bench_threads.py BUNDLE [--rounds 3] [--tokens 32] [--policies ...]
        [--neighbour torch|busy] [--compile] [--json out.json]

One persistent worker process per policy loads the bundle once (a wait policy is read when
OpenMP loads, so each needs its own process); in every round the parent runs each worker's
decode with nothing of its own running ("idle"), then starts the neighbour (`torch`: one
process running 2-thread float32 matmuls under libgomp's default wait policy, the co-located
torch job of the issue; `busy`: two processes spinning in Python) and runs them all again
("loaded"), the phase order and the worker order rotated per round. Policies:

    libgomp      torch imported before specbuild: libgomp's default wait policy, 2 threads
    default      specbuild's default: GOMP_SPINCOUNT=10000, the kernels' pool, OpenMP or one
                 thread as timed in the stepping thread, the pool under others' load
                 (specbuild/model/threads.py, model/threads.ThreadGovernor)
    fixed        the default's spin count, 2 threads on OpenMP always (SPECBUILD_ADAPT_THREADS=0)
    omp          the kernels' loops always on torch's OpenMP (SPECBUILD_POOL=0: the default
                 before the kernels' pool; the governor then runs its thread-count trials)
    pool         the kernels' loops always on their own pool (SPECBUILD_POOL=1); the default
                 (SPECBUILD_POOL=auto) moves them there only while others' load is seen
    pool-spin0   the pool with helpers that sleep at once (SPECBUILD_POOL_SPIN_US=0; -spin200,
                 -spin1000: 200, 1000 us on free cores)
    spin-100k    GOMP_SPINCOUNT=100000 (OpenMP's workers spin ~10x longer between regions), 2 threads
    spin         GOMP_SPINCOUNT=10000 (specbuild's choice on a quiet machine), 2 threads
    passive      OMP_WAIT_POLICY=PASSIVE, 2 threads
    spin-1000    GOMP_SPINCOUNT=1000, 2 threads (spin-100: 100)
    spin-1t      GOMP_SPINCOUNT=10000, 1 thread

Prints per policy the median ms/token idle and loaded, loaded/idle, and loaded over the
specbuild default's idle figure (the goal: at most 2.2x), the CPU model and flags, and the
load average of each phase. The machine's other jobs are not stopped: "idle" means this
benchmark adds nothing; the load average says what else ran.

scripts/bench_load.py measures something else: an HTTP server under concurrent clients.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

POLICIES = {  # name -> (environment, threads, import torch before specbuild)
    "libgomp": ({}, 2, True),
    "default": ({}, 2, False),
    "spin": ({"GOMP_SPINCOUNT": "10000"}, 2, False),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, 2, False),
    "spin-1000": ({"GOMP_SPINCOUNT": "1000"}, 2, False),
    "spin-100": ({"GOMP_SPINCOUNT": "100"}, 2, False),
    "spin-1t": ({"GOMP_SPINCOUNT": "10000"}, 1, False),
    "fixed": ({"SPECBUILD_ADAPT_THREADS": "0"}, 2, False),
    "omp": ({"SPECBUILD_POOL": "0"}, 2, False),
    "pool": ({"SPECBUILD_POOL": "1"}, 2, False),
    "pool-spin0": ({"SPECBUILD_POOL": "1", "SPECBUILD_POOL_SPIN_US": "0"}, 2, False),
    "pool-spin200": ({"SPECBUILD_POOL": "1", "SPECBUILD_POOL_SPIN_US": "200"}, 2, False),
    "pool-spin1000": ({"SPECBUILD_POOL": "1", "SPECBUILD_POOL_SPIN_US": "1000"}, 2, False),
    "spin-100k": ({"GOMP_SPINCOUNT": "100000"}, 2, False),
}
NEIGHBOURS = {
    "torch": [["-c", "import torch\ntorch.set_num_threads(2)\na = torch.randn(768, 768)\nwhile True:\n    a @ a"]],
    "busy": [["-c", "while True:\n    pass"]] * 2,
}


def worker(bundle: str, threads, torch_first: bool, tokens: int) -> None:
    """Line protocol on stdin/stdout: 'decode' -> {"ms": ms/token, "threads": n}; 'quit'."""
    if torch_first:
        import torch  # libgomp starts before specbuild/__init__.py can set its wait policy
    import specbuild  # noqa: F401  (its wait policy, before torch loads OpenMP, unless torch came first)
    import torch

    from specbuild.bench.formats import decode_step_ms
    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.model.threads import CHOSEN

    compile_ = os.environ.get("SPECBUILD_BENCH_THREADS_COMPILE") == "1"  # --compile, from the parent
    engine = Engine(bundle, EngineConfig(prefix_cache=False, threads=threads, max_batch_size=1, compile=compile_))
    prompt = engine.encode(engine.render_chat([{"role": "user", "content": "Tell me a story about a dragon."}]),
                           add_special_tokens=False)
    decode_step_ms(engine, prompt, 8, 1)  # warm-up
    policy = {"policy": "libgomp's default", "reason": "torch loaded before specbuild"} if torch_first else CHOSEN
    print(json.dumps({"ready": True, "policy": policy}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            return
        ms = decode_step_ms(engine, prompt, tokens, 1)[0]
        gov = engine.threads_governor
        print(json.dumps({"ms": ms, "threads": torch.get_num_threads(),
                          "governor": gov.describe() if gov is not None else engine.threads_why}), flush=True)


class Worker:
    def __init__(self, name: str, bundle: str, tokens: int, kernel: str) -> None:
        env_extra, threads, torch_first = POLICIES[name]
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SPECBUILD_POOL", "SPECBUILD_POOL_SPIN_US")}
        env.update(env_extra, SPECBUILD_CPU_KERNEL=kernel)
        cmd = [sys.executable, os.path.abspath(__file__), bundle, "--worker", name, "--tokens", str(tokens)]
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.policy = self.read()["policy"]

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited with {self.proc.wait()}")
        return json.loads(line)

    def decode(self) -> dict:
        self.proc.stdin.write("decode\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def start_neighbour(kind: str) -> list[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return [subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL) for args in NEIGHBOURS[kind]]


def stop_neighbour(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--policies", default="default,fixed,libgomp,spin,passive,spin-100,spin-1t")
    ap.add_argument("--neighbour", default="torch", choices=sorted(NEIGHBOURS))
    ap.add_argument("--kernel", default="specbuild",
                    help="SPECBUILD_CPU_KERNEL for every worker (fixed: a choice timed under load could differ between them)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    ap.add_argument("--compile", action="store_true", help="the workers run the compiled (fused) layer stack")
    args = ap.parse_args()
    if args.compile:
        os.environ["SPECBUILD_BENCH_THREADS_COMPILE"] = "1"  # the workers inherit it
    if args.worker:
        _, threads, torch_first = POLICIES[args.worker]
        worker(args.bundle, threads, torch_first, args.tokens)
        return
    names = args.policies.split(",")
    bad = [n for n in names if n not in POLICIES]
    if bad:
        sys.exit(f"error: unknown policy {bad[0]!r}; policies: {', '.join(POLICIES)}")
    if not 1 <= args.rounds <= 20:
        sys.exit(f"error: --rounds {args.rounds} is out of range [1, 20]")
    from _common import cpu_info  # scripts/ is on sys.path when a script runs

    workers = []
    results = {n: {"idle": [], "loaded": []} for n in names}
    threads_seen = {n: {"idle": [], "loaded": []} for n in names}
    governors = {n: {"idle": [], "loaded": []} for n in names}  # the thread governor's state after each decode
    loads = {"idle": [], "loaded": []}
    try:
        for n in names:
            workers.append(Worker(n, args.bundle, args.tokens, args.kernel))
        for r in range(args.rounds):
            phases = ("idle", "loaded") if r % 2 == 0 else ("loaded", "idle")
            order = workers[r % len(workers):] + workers[:r % len(workers)]
            for phase in phases:
                neighbour = start_neighbour(args.neighbour) if phase == "loaded" else []
                try:
                    time.sleep(1.0 if neighbour else 0.0)  # the neighbour's threads are up and computing
                    for w in order:
                        got = w.decode()
                        results[w.name][phase].append(got["ms"])
                        threads_seen[w.name][phase].append(got["threads"])
                        governors[w.name][phase].append(got.get("governor"))
                    loads[phase].append(os.getloadavg()[0])
                finally:
                    stop_neighbour(neighbour)
                print(f"round {r + 1}/{args.rounds} {phase}: " + ", ".join(
                    f"{n} {results[n][phase][-1]:.1f}" for n in names) + f" ms/token; load {loads[phase][-1]:.2f}",
                    file=sys.stderr, flush=True)
    finally:
        for w in workers:
            w.close()
    cpu = cpu_info()
    base = statistics.median(results["default"]["idle"]) if "default" in results else None
    rows = []
    for n in names:
        idle, loaded = statistics.median(results[n]["idle"]), statistics.median(results[n]["loaded"])
        rows.append({"policy": n, "idle_ms": round(idle, 2), "loaded_ms": round(loaded, 2),
                     "loaded_over_idle": round(loaded / idle, 2),
                     "loaded_over_default_idle": round(loaded / base, 2) if base else None,
                     "wait_policy": next(w.policy for w in workers if w.name == n),
                     "threads": threads_seen[n], "governor": governors[n], "samples": results[n]})
    print(f"{args.bundle}: plain decoding ms/token over {args.tokens} tokens, {args.rounds} interleaved rounds, "
          f"medians; neighbour: {args.neighbour}; kernel {args.kernel}; {'compiled' if args.compile else 'eager'}; CPU {cpu['model']}")
    print(f"flags: {cpu['flags']}")
    print("load average per phase: idle " + " ".join(f"{x:.2f}" for x in loads["idle"])
          + "; loaded " + " ".join(f"{x:.2f}" for x in loads["loaded"]))
    print(f"{'policy':10s} {'threads':>9s} {'idle':>8s} {'loaded':>8s} {'loaded/idle':>11s} {'/default idle':>13s}  wait policy (why)")
    for row in rows:
        th = f"{statistics.median(row['threads']['idle']):.0f}/{statistics.median(row['threads']['loaded']):.0f}"
        print(f"{row['policy']:10s} {th:>9s} {row['idle_ms']:8.2f} {row['loaded_ms']:8.2f} {row['loaded_over_idle']:11.2f} "
              f"{row['loaded_over_default_idle'] or float('nan'):13.2f}  {row['wait_policy'].get('policy')} "
              f"({row['wait_policy'].get('reason')})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu": cpu, "loads": loads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
