"""Eager vs compiled layer stack (EngineConfig.compile), per linear kernel, interleaved in one process.

A lab view: the steps run on the main thread. The figures users get come from the product path,
scripts/bench_serve.py (`specbuild serve` over HTTP, llama-server beside it, and the served step
against this main-thread one).

One engine per candidate kernel of the int4/int8 weights (`--kernels`: torch's, specbuild's:
SPECBUILD_CPU_KERNEL while it loads) loads the bundle with compile=True; each round times every
engine with its compiled stack switched off (eager) and on, then llama.cpp on the bundle's GGUF
source when llama-cpp-python imports (bench/formats.LlamaCppPeer; without it the rows are
skipped with a line saying why), so all see the same machine state (this 2-core VM's
timings drift by 20% between processes). Per round: a copy of 256 MB (the memory floor's
bandwidth), plain greedy ms/token over `--tokens` tokens (engine.generate, method none;
prefill excluded; llama.cpp: one-token evals) and one forward (llama.cpp: one batched eval)
of N rows after 64 cached tokens (best of 7). Prints medians over rounds, each row's bytes
read per step, its floor (those bytes over the best copy bandwidth) and decode over it, the
CPU model and its flags, and the load average of every round.

    python scripts/bench_compile.py BUNDLE [--rounds 5] [--threads 2] [--tokens 64] [--kernels torch,specbuild]
        [--no-compile] [--no-llama-cpp] [--llama-batch N] [--also OTHER_BUNDLE] [--json]

(`--also bundles/smollm2-135m-spec-int4a8` adds another format of the same model to the same
rounds, rows labelled with its directory's name.)

(`--kernels specbuild,specbuild+sdpa` compares the C++ attention rows kernel with per-row SDPA calls;
`--kernels specbuild,specbuild+pool` the kernels' loops on OpenMP, as on free cores by default, with
the same loops on the kernels' own pool, as under others' load.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from _common import cpu_info  # scripts/_common.py

WIDTHS = (1, 2, 3, 5, 9, 17)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--llama-batch", type=int, default=None,
                    help="llama.cpp's n_batch [64 where a batched eval survives a probe, else 1]")
    ap.add_argument("--kernels", default="torch,specbuild",
                    help="comma-separated: torch, specbuild, avx2; NAME+sdpa: attention by per-row SDPA calls "
                         "instead of specbuild's C++ rows kernel")
    ap.add_argument("--no-compile", action="store_true", help="eager rows only (no compile at load)")
    ap.add_argument("--also", action="append", default=[], metavar="BUNDLE",
                    help="another bundle of the same model (another format: int4-a8, ...) measured in the same "
                         "rounds with each kernel; repeatable")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from specbuild.bench.formats import LlamaCppPeer, decode_step_ms, llama_cpp_missing
    from specbuild.bundle import read_meta
    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.model import cpu_kernels
    from specbuild.model.decoder import weight_bytes
    from specbuild.model.timing import copy_bandwidth, forward_costs

    engines, pooled = {}, {}
    for path in [args.bundle, *args.also]:
        for kernel in args.kernels.split(","):
            # NAME+sdpa: that linear kernel with attention as one SDPA call per row instead of
            # specbuild's C++ rows kernel (decoder.rows_attention_enabled); NAME+pool: the
            # kernels' loops on their own pool (SPECBUILD_POOL=1) while this row is timed, not
            # on OpenMP as on free cores by default
            base, *extras = kernel.split("+")
            bad = [x for x in extras if x not in ("sdpa", "pool")]
            if bad:
                sys.exit(f"error: --kernels {kernel!r}: unknown option +{bad[0]} (options: +sdpa, +pool)")
            os.environ["SPECBUILD_CPU_KERNEL"] = base
            os.environ["SPECBUILD_ROWS_ATTENTION"] = "0" if "sdpa" in extras else "1"
            cpu_kernels.reset_choices()
            label = kernel if path == args.bundle else f"{os.path.basename(path.rstrip('/'))} {kernel}"
            engines[label] = Engine(path, EngineConfig(prefix_cache=False, threads=args.threads, max_batch_size=1,
                                                       compile=not args.no_compile))
            pooled[label] = "pool" in extras
    os.environ.pop("SPECBUILD_ROWS_ATTENTION", None)
    engine = next(iter(engines.values()))
    prompt_text = engine.render_chat([{"role": "user", "content": "Tell me a story about a dragon and a knight."}])
    prompt = engine.encode(prompt_text, add_special_tokens=False)
    source = read_meta(args.bundle).roles["target"].get("source") or ""
    llama, llama_note = None, None
    if args.no_llama_cpp:
        llama_note = "llama.cpp: not measured (--no-llama-cpp)"
    elif not source.endswith(".gguf") or not os.path.isfile(source):
        llama_note = f"llama.cpp: not measured (the bundle's source {source!r} is not a GGUF file here)"
    elif (why := llama_cpp_missing()) is not None:
        llama_note = f"llama.cpp: not measured ({why})"
    else:
        llama = LlamaCppPeer(source, args.threads, n_batch=args.llama_batch)
        llama_prompt = llama.tokenize(prompt_text)
        llama_context = (llama_prompt * 64)[:64]
    compiled = {k: e.model.compiled for k, e in engines.items()}
    modes = ("eager",) if args.no_compile else ("eager", "compiled")
    rows: dict[str, list] = {f"{k} {m}": [] for k in engines for m in modes}
    rows["llama.cpp"] = []
    copy_gbps, loads = [], []
    for r in range(args.rounds):
        copy_gbps.append(copy_bandwidth(256 << 20, repeats=3)["gb_per_s"])
        for kernel, engine in engines.items():
            cpu_kernels.pool_config(mode=1 if pooled[kernel] else cpu_kernels.pool_mode())
            for mode in modes:
                engine.model.compiled = None if mode == "eager" else compiled[kernel]
                decode = statistics.median(decode_step_ms(engine, prompt, args.tokens, 2))
                costs = forward_costs(engine.model, engine.cache, WIDTHS, repeats=7)
                rows[f"{kernel} {mode}"].append({"decode_ms": decode, **{f"w{w}": costs[w]["min_ms"] for w in WIDTHS}})
        if llama is not None:
            decode = statistics.median(llama.decode_ms(llama_prompt, args.tokens) for _ in range(2))
            costs = llama.width_costs(llama_context, WIDTHS, repeats=7)
            rows["llama.cpp"].append({"decode_ms": decode, **{f"w{w}": costs[w] for w in WIDTHS}})
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]['decode_ms']:.2f}" for k, v in rows.items() if v)
              + f" ms/token; copy {copy_gbps[-1]:.1f} GB/s; load {loads[-1]:.2f}", file=sys.stderr, flush=True)
    cpu_kernels.pool_config(mode=cpu_kernels.pool_mode())
    for kernel, engine in engines.items():
        engine.model.compiled = compiled[kernel]
    gbps = max(copy_gbps)  # what the machine can do; other load only slows a copy down
    nbytes = {f"{k} {m}": weight_bytes(e.model.w, e.target_config.tie_word_embeddings) for k, e in engines.items()
              for m in modes}
    if llama is not None:
        nbytes["llama.cpp"] = llama.weight_bytes
    medians = {m: {k: round(statistics.median(x[k] for x in v), 2) for k in v[0]} for m, v in rows.items() if v}
    for m, med in medians.items():
        med["weight_mb"] = round(nbytes[m] / 1e6, 1)
        med["floor_ms"] = round(nbytes[m] / (gbps * 1e9) * 1e3, 2)
        med["decode_over_floor"] = round(med["decode_ms"] / med["floor_ms"], 2)
    report = {"bundle": args.bundle, "also": args.also, "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
              "compile_s": {k: e.compile_seconds for k, e in engines.items()}, "cpu": cpu_info(),
              "kernel_status": cpu_kernels.status(), "load_average_per_round": loads,
              "loadavg_end": open("/proc/loadavg").read().strip(), "copy_gb_per_s": round(gbps, 2),
              "llama_cpp": None if llama is None else {"version": llama.version, "n_batch": llama.n_batch},
              "llama_cpp_note": llama_note, "medians": medians}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    cpu = report["cpu"]
    print(f"{args.bundle}: {args.threads} thread(s), {args.rounds} interleaved rounds, medians; CPU {cpu['model']}")
    print(f"flags: {cpu['flags']}")
    print(f"compile at load: {report['compile_s']} s; load average per round "
          + " ".join(f"{x:.2f}" for x in loads) + f"; /proc/loadavg at end: {report['loadavg_end']}")
    if llama is not None:
        print(f"llama.cpp: llama-cpp-python {llama.version}, n_batch {llama.n_batch}, n_threads {args.threads}")
    else:
        print(llama_note)
    print(f"floor = weight bytes read per step / copy bandwidth ({gbps:.1f} GB/s: best copy of 256 MB of the run)")
    width = max(20, *(len(m) for m in report["medians"]))
    print(f"{'':{width}s} {'decode ms/token':>16s} {'MB':>6s} {'floor':>6s} {'xfloor':>6s} "
          + " ".join(f"{'w' + str(w):>7s}" for w in WIDTHS) + "  w5/w1  w17/w1")
    for mode, med in report["medians"].items():
        line = f"{mode:{width}s} {med['decode_ms']:16.2f} {med['weight_mb']:6.1f} {med['floor_ms']:6.2f} {med['decode_over_floor']:6.2f} "
        if "w1" in med:
            line += " ".join(f"{med['w' + str(w)]:7.2f}" for w in WIDTHS)
            line += f"  {med['w5'] / med['w1']:5.2f}  {med['w17'] / med['w1']:6.2f}"
        print(line)
    print("(a lab view: the engine's step on this process's main thread, no HTTP. What users get, `specbuild "
          "serve` with llama.cpp's server beside it and the served step against this one: "
          "python scripts/bench_serve.py BUNDLE)")


if __name__ == "__main__":
    main()
