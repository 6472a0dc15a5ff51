#!/usr/bin/env python
"""Copy Spec-Bench into the package and write its train/eval split (deterministic).

    python scripts/make_spec_bench_split.py [--source SPEC_BENCH_DIR] [--eval-fraction 0.5]

Writes specbuild/data/spec_bench/{question.jsonl, LICENSE, split.json}. The split is by
question id, stratified by category (see specbuild.bench.specbench.make_split): rerunning it gives
the same file byte for byte, and tests/bench/test_bench.py checks the shipped split against it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from specbuild.bench.specbench import load_questions, make_split  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default=os.path.join(ROOT, "..", "shared", "benchmarks", "spec_bench"),
                    help="directory with Spec-Bench's question.jsonl and LICENSE")
    ap.add_argument("--eval-fraction", type=float, default=0.5)
    args = ap.parse_args()
    out = os.path.join(ROOT, "specbuild", "data", "spec_bench")
    os.makedirs(out, exist_ok=True)
    for name in ("question.jsonl", "LICENSE"):
        src = os.path.join(args.source, name)
        if not os.path.isfile(src):
            sys.exit(f"error: {src} does not exist (give --source)")
        if os.path.abspath(src) != os.path.abspath(os.path.join(out, name)):
            shutil.copyfile(src, os.path.join(out, name))
    qpath = os.path.join(out, "question.jsonl")
    questions = load_questions(qpath)
    split = make_split(questions, args.eval_fraction)
    with open(qpath, "rb") as f:
        split["source"] = {"name": "Spec-Bench question.jsonl (Apache-2.0, see LICENSE)",
                           "sha256": hashlib.sha256(f.read()).hexdigest(), "questions": len(questions)}
    with open(os.path.join(out, "split.json"), "w") as f:
        json.dump(split, f, indent=1)
        f.write("\n")
    print(f"{len(split['train'])} train / {len(split['eval'])} eval questions in {len(split['categories'])} "
          f"categories -> {os.path.join(out, 'split.json')}")


if __name__ == "__main__":
    main()
