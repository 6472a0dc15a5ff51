#!/usr/bin/env python
"""Write a warm corpus for the suffix store (`--suffix-corpus FILE.jsonl`) from the target's
own earlier answers: a scripts/build_eagle_corpus.py directory (answers.jsonl and
answers_heldout.jsonl, whose "prompt_id" names a prompts.jsonl / heldout.jsonl row with its
"source" and Spec-Bench "qid"), or a `specbuild train-eagle` output directory
(answers_greedy.jsonl, answers_sampled.jsonl, answers_eval.jsonl, whose "id" is the Spec-Bench
question id). Every answer row has "answer_ids".

    .venv/bin/python scripts/build_eagle_corpus.py BUNDLE --out CORPUS --no-progress --limit 200
    .venv/bin/python scripts/build_suffix_corpus.py CORPUS --out warm.jsonl
    specbuild serve BUNDLE --suffix-corpus warm.jsonl          # or bench / generate / triton-repo

Only answers to questions of the Spec-Bench TRAIN split are kept (an answer whose id is a
Spec-Bench eval question is refused: the eval split measures the store, it must not be in
it); --all-sources also keeps the corpus's self-written tasks and file excerpts (ids that are
not Spec-Bench question ids). Each output line is {"token_ids": [...]} (the answer's tokens,
as the target produced them) with "source" naming the file and id.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specbuild.bench.specbench import load_split  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", help="a build_eagle_corpus.py directory (answers_*.jsonl)")
    ap.add_argument("--out", required=True, help="the warm corpus jsonl to write")
    ap.add_argument("--files", default="answers*.jsonl", help="which answer files of the directory (glob)")
    ap.add_argument("--all-sources", action="store_true", help="also keep answers that are not Spec-Bench questions")
    ap.add_argument("--min-tokens", type=int, default=8, help="shorter answers are left out")
    args = ap.parse_args(argv)
    split = load_split()
    train, evals = set(split["train"]), set(split["eval"])
    prompts = {}  # build_eagle_corpus's prompt id -> its Spec-Bench question id (None: another source)
    for name in ("prompts.jsonl", "heldout.jsonl"):
        path = os.path.join(args.corpus, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        r = json.loads(line)
                        q = r.get("qid") if str(r.get("source", "")).startswith("spec_bench") else None
                        prompts[str(r["id"])] = int(q) if q is not None and str(q).isdigit() else None
    paths = sorted(glob.glob(os.path.join(args.corpus, args.files)))
    if not paths:
        print(f"error: no {args.files} in {args.corpus!r}", file=sys.stderr)
        return 2
    kept = skipped = 0
    with open(args.out, "w", encoding="utf-8") as out:
        for path in paths:
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    rid, ids = row.get("id"), row.get("answer_ids")
                    if "prompt_id" in row:  # build_eagle_corpus: the question id is the prompt's
                        pid = str(row["prompt_id"])
                        head, _, tail = pid.rpartition(":")
                        qid = prompts[pid] if pid in prompts else \
                            int(tail) if head.startswith("spec_bench") and tail.isdigit() and len(tail) <= 6 else None
                    else:  # train-eagle: the row's id is the question id
                        qid = int(rid) if isinstance(rid, (int, str)) and str(rid).isdigit() else None
                    if qid is not None and qid in evals:
                        print(f"error: {path}:{n}: id {qid} is a Spec-Bench eval question", file=sys.stderr)
                        return 2
                    if (qid not in train and not args.all_sources) or not isinstance(ids, list) \
                            or len(ids) < args.min_tokens:
                        skipped += 1
                        continue
                    out.write(json.dumps({"token_ids": [int(t) for t in ids],
                                          "source": f"{os.path.basename(path)}:{rid}"}) + "\n")
                    kept += 1
    print(f"wrote {args.out}: {kept} answers ({skipped} left out) from {len(paths)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
