#!/usr/bin/env python
"""Build (or continue) an EAGLE training corpus: prompts from the Spec-Bench train split, tasks
the target writes itself and excerpts of text and code installed on this machine, answered by
the target at each temperature (specbuild/train/corpus.py; docs/eagle-training.md).

    .venv/bin/python scripts/build_eagle_corpus.py BUNDLE --out CORPUS --compile --time-limit 60
    # stopped (time limit, Ctrl-C)? the same command continues where it stopped
    specbuild train-eagle BUNDLE --corpus CORPUS --out HEAD --ship specbuild/data/drafters/smollm2-135m-eagle

Nothing is downloaded. The eval split of Spec-Bench never enters the corpus.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    from specbuild.errors import SpecbuildError
    from specbuild.train.corpus import CorpusConfig, build_corpus

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", help="the target's bundle (the fastest lossless format here: int4 on CPU)")
    ap.add_argument("--out", required=True, help="corpus directory (created, or continued)")
    ap.add_argument("--data", default=None, help="Spec-Bench-style jsonl [the packaged Spec-Bench; train split only]")
    ap.add_argument("--no-spec-bench", action="store_true", help="leave the Spec-Bench train prompts out")
    ap.add_argument("--self-instruct", type=int, default=400, help="tasks the target is asked to write")
    ap.add_argument("--local-files", type=int, default=400, help="installed text/code files excerpted")
    ap.add_argument("--local-root", action="append", default=[],
                    help="where to look for them (repeatable) [the interpreter's site-packages]")
    ap.add_argument("--excerpt-chars", type=int, default=1200, help="most characters of one excerpt")
    ap.add_argument("--heldout-prompts", type=int, default=12, help="train-split prompts held out for evaluation")
    ap.add_argument("--temperatures", default="0,0.7,1.0", help="one answer per prompt at each (0 = greedy)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-answer-tokens", type=int, default=192)
    ap.add_argument("--limit", type=int, default=None, help="most training prompts answered")
    ap.add_argument("--time-limit", type=float, default=None, help="minutes; stop (a rerun continues)")
    ap.add_argument("--batch", type=int, default=8, help="requests in flight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="run the target's layer stack compiled (CPU)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="where the target runs: cpu, cuda, cuda:N [cpu]")
    ap.add_argument("--hf-generate", default=None, metavar="SOURCE",
                    help="answer with transformers' generate over SOURCE (the model BUNDLE was compiled from: a "
                         "preset, .gguf or HF directory) on --device, --batch prompts per padded batch (a GPU)")
    ap.add_argument("--prefill-chunk", type=int, default=256,
                    help="prompt tokens prefilled per engine step [256]; thousands on a GPU")
    ap.add_argument("--ignore-eos", action="store_true", help="answers run to --max-answer-tokens (tests)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        temps = tuple(float(t) for t in args.temperatures.split(",") if t.strip())
    except ValueError:
        print(f"error: --temperatures {args.temperatures!r} is not a comma-separated list of numbers", file=sys.stderr)
        return 2
    try:
        cfg = CorpusConfig(spec_bench=not args.no_spec_bench, self_instruct=args.self_instruct,
                           local_files=args.local_files, local_roots=tuple(args.local_root),
                           excerpt_chars=args.excerpt_chars, heldout_prompts=args.heldout_prompts, temperatures=temps,
                           max_prompt_tokens=args.max_prompt_tokens, max_answer_tokens=args.max_answer_tokens,
                           limit=args.limit, time_limit=args.time_limit, batch=args.batch, seed=args.seed,
                           ignore_eos=args.ignore_eos, data=args.data)
        manifest = build_corpus(args.bundle, args.out, cfg, compile=args.compile, threads=args.threads,
                                progress=not args.no_progress, log=lambda m: print(m, file=sys.stderr),
                                device=args.device, prefill_chunk=args.prefill_chunk, hf_source=args.hf_generate)
    except (SpecbuildError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({k: manifest[k] for k in ("complete", "totals", "sources", "heldout", "dropped", "seconds")},
                     indent=2))
    return 0 if manifest["complete"] else 3


if __name__ == "__main__":
    sys.exit(main())
