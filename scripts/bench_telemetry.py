"""Telemetry goals of issue 20, measured in one run on Spec-Bench questions (greedy):

  overhead   tokens/s with and without a SQLite telemetry sink (interleaved repeats, medians)
  slow       a writer slowed to ~delay per batch behind a small queue: tokens/s unchanged,
             dropped rows counted
  warmup     tokens/s on the first 32 tokens of each eval turn, with the gamma priors that
             `policy learn` fitted from steps recorded on the train split, and without

    python scripts/bench_telemetry.py BUNDLE [--method draft] [--per-category 1] [--repeats 3]
        [--threads 1] [--max-tokens 64] [--warmup-tokens 32] [--train-per-category 2] [--out DIR]

Every mode's greedy output is checked against the others (telemetry and priors change only
timing and how much is drafted). Prints a JSON report (CPU model and flags included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

from _common import lscpu  # scripts/_common.py
from specbuild.bench import specbench as B
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.speculation.policy import PolicyTable
from specbuild.telemetry import attach
from specbuild.telemetry.learn import learn
from specbuild.telemetry.store import Store


def machine_info() -> dict:
    out = lscpu()
    if not out:
        return {"machine": platform.machine()}
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = info.get("Flags", "").split()
    return {"model": info.get("Model name", "").strip(), "cpus": info.get("CPU(s)", "").strip(),
            "flags": [f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma"))], "loadavg": os.getloadavg()}


def conversations(engine, runner, questions, counts: dict | None = None) -> tuple[float, int, list]:
    """Each question alone (batch 1), all its turns. Returns (seconds, tokens, token ids);
    adds drafted / accepted / target_passes into `counts` (load-independent figures)."""
    render = lambda messages: engine.encode(engine.render_chat(messages), add_special_tokens=False)  # noqa: E731
    seconds, tokens, ids = 0.0, 0, []
    for q in questions:
        turns, secs = B.run_conversations(runner, render, [q])
        seconds += sum(secs)
        for t in turns[0]:
            tokens += len(t.token_ids)
            ids.append(t.token_ids)
            if counts is not None:
                for k in ("drafted", "accepted", "target_passes"):
                    counts[k] = counts.get(k, 0) + t.stats.get(k, 0)
    return seconds, tokens, ids


def timed(engine, method, max_tokens, questions, repeats, modes: dict) -> dict:
    """modes: name -> (setup(), teardown() -> dict or None). Interleaved repeats; medians of tokens/s."""
    runner = B.SpecbuildRunner(engine, method, max_tokens)
    rates: dict[str, list[float]] = {m: [] for m in modes}
    outputs: dict[str, list] = {}
    extra: dict[str, list] = {m: [] for m in modes}
    counts: dict[str, dict] = {}
    for _ in range(repeats):
        for name, (setup, teardown) in modes.items():
            setup()
            c: dict = {}
            secs, toks, ids = conversations(engine, runner, questions, c)
            counts[name] = c
            info = teardown()
            if info:
                extra[name].append({**info, "sink_share_of_run_percent": round(100 * info.pop("sink_seconds") / secs, 3)}
                                   if "sink_seconds" in info else info)
            rates[name].append(toks / secs)
            outputs.setdefault(name, ids)
            assert ids == outputs[name], f"{name}: output changed between repeats"
    first = next(iter(outputs.values()))
    same = all(o == first for o in outputs.values())
    return {"tokens_per_s_median": {m: round(statistics.median(r), 3) for m, r in rates.items()},
            "tokens_per_s_all": {m: [round(x, 3) for x in r] for m, r in rates.items()},
            "outputs_identical": same, "counts_last_repeat": counts, "extra": {m: v for m, v in extra.items() if v}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--method", default="draft")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--train-per-category", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warmup-tokens", type=int, default=32)
    ap.add_argument("--slow-delay", type=float, default=1.0,
                    help="seconds the slowed writer sleeps per batch (of 4 rows, behind a queue of 16)")
    ap.add_argument("--only", default="overhead,slow,warmup")
    ap.add_argument("--out", default=None, help="directory for the databases [a temp dir]")
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="specbuild-telemetry-bench-")
    os.makedirs(out, exist_ok=True)
    engine = Engine(args.bundle, EngineConfig(prefix_cache=False, threads=args.threads, max_batch_size=1))
    questions = B.load_questions()
    split = B.load_split()
    evalq = B.select_questions(questions, split, "eval", args.per_category)
    report = {"bundle": os.path.abspath(args.bundle), "method": args.method, "cpu": machine_info(),
              "threads": args.threads, "eval_questions": [q["question_id"] for q in evalq], "results": {}}
    only = set(args.only.split(","))
    off = (lambda: None, lambda: None)
    sinks = {}

    def with_sink(name, **options):
        def setup():
            sink = sinks[name] = attach(engine, os.path.join(out, f"{name}.db"), source="bench", policies=False,
                                        **options)
            sink.sink_seconds = 0.0
            for hook in ("on_session_start", "on_step", "on_session_end", "on_event"):  # time the step loop's calls
                def timed_hook(*a, _f=getattr(sink, hook)):
                    t0 = time.perf_counter()
                    _f(*a)
                    sink.sink_seconds += time.perf_counter() - t0
                setattr(sink, hook, timed_hook)
            engine.set_sink(sink)

        def teardown():
            sink = sinks.pop(name)
            engine.set_sink(None)
            stats = sink.stats()  # before close: what the step loop saw
            sink.close()
            return {**stats, "written_after_close": sink.stats()["telemetry_rows_written"],
                    "sink_seconds": sink.sink_seconds}
        return setup, teardown

    engine.speculator.controller  # calibrate once, outside the timings
    if "overhead" in only:
        report["results"]["overhead"] = r = timed(engine, args.method, args.max_tokens, evalq, args.repeats,
                                                  {"off": off, "sqlite": with_sink("overhead")})
        med = r["tokens_per_s_median"]
        r["cost_percent"] = round(100 * (1 - med["sqlite"] / med["off"]), 2)
    if "slow" in only:
        report["results"]["slow_writer"] = r = timed(
            engine, args.method, args.max_tokens, evalq, args.repeats,
            {"off": off, "slowed": with_sink("slow", queue_size=16, batch_size=4, delay_s=args.slow_delay)})
        med = r["tokens_per_s_median"]
        r["cost_percent"] = round(100 * (1 - med["slowed"] / med["off"]), 2)
        r["dropped_per_repeat"] = [x["telemetry_rows_dropped"] for x in r["extra"]["slowed"]]
    if "warmup" in only:
        db = os.path.join(out, "train.db")
        trainq = B.select_questions(questions, split, "train", args.train_per_category)
        sink = attach(engine, db, source="bench", run_id="train", policies=False)
        t0 = time.perf_counter()
        conversations(engine, B.SpecbuildRunner(engine, args.method, args.max_tokens), trainq)
        sink.close()
        engine.set_sink(None)
        store = Store(db)
        fitted, skipped = learn(store, model=engine.model_id, min_steps=16)
        for p in fitted:
            store.set_policy(p)
        table = PolicyTable(store.policies(engine.model_id), engine.model_id)
        store.close()
        report["results"]["learned_policies"] = {
            "train_questions": len(trainq), "train_seconds": round(time.perf_counter() - t0, 1),
            "policies": [{k: getattr(p, k) for k in ("content_type", "method", "gamma_default", "alpha_threshold",
                                                      "prior_alpha", "n_steps")} for p in fitted], "skipped": skipped}
        r = timed(engine, args.method, args.warmup_tokens, evalq, args.repeats,
                  {"global_prior": (lambda: engine.set_policies(None), lambda: None),
                   "learned_priors": (lambda: engine.set_policies(table), lambda: engine.set_policies(None))})
        med = r["tokens_per_s_median"]
        r["speedup"] = round(med["learned_priors"] / med["global_prior"], 4)
        report["results"]["warmup_first_tokens"] = r
    report["cpu"]["loadavg_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
