#!/usr/bin/env python
"""Chain acceptance of EAGLE-3 heads on the target's greedy answers to Spec-Bench **eval-split**
questions (the split no corpus and no head ever trains on), side by side on the same chains.

train-eagle's held-out set is 8 answers (857 chains): a difference of ~0.03 tokens per pass is
inside its noise. This script answers `--per-category` eval questions per Spec-Bench group
(greedy, `--max-tokens`), computes the target's features once, and evaluates every head given
with train-eagle's own `evaluate` (greedy chains, depth `--depth`), printing acceptance by
position, expected tokens per pass and the standard error of the latter.

    .venv/bin/python scripts/eagle_eval_split.py bundles/smollm2-135m \
        specbuild/data/drafters/smollm2-135m-eagle NEW_HEAD --per-category 6 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", help="the target's bundle (its features are what the heads read)")
    ap.add_argument("heads", nargs="+", help="EAGLE-3 head directories (train-eagle's output, the shipped one)")
    ap.add_argument("--per-category", type=int, default=6, help="eval questions per Spec-Bench group [6]")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per greedy answer [128]")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--depth", type=int, default=5, help="chain depth evaluated [5]")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    for name, value, lo, hi in (("per-category", args.per_category, 1, 1000), ("max-tokens", args.max_tokens, 2, 4096),
                                ("depth", args.depth, 1, 16)):
        if not lo <= value <= hi:
            print(f"error: --{name} {value} is out of range [{lo}, {hi}]", file=sys.stderr)
            return 2
    for h in args.heads:
        if not os.path.isfile(os.path.join(h, "config.json")):
            print(f"error: {h!r} is not an EAGLE-3 head directory (no config.json)", file=sys.stderr)
            return 2

    import torch

    from specbuild.bench import specbench as B
    from specbuild.engine.engine import Engine, EngineConfig, load_weights
    from specbuild.engine.sequence import Request
    from specbuild.formats import eagle3
    from specbuild.model.qlinear import as_dense
    from specbuild.sampling.params import SamplingParams
    from specbuild.train.eagle import EagleTrainConfig, evaluate, load_head_dir, target_features

    t0 = time.perf_counter()
    engine = Engine(args.bundle, EngineConfig(threads=args.threads))
    tc = engine.target_config

    def ids(q):
        return engine.encode(engine.render_chat([{"role": "user", "content": q["turns"][0]}]), add_special_tokens=False)

    questions = B.select_questions(B.load_questions(), B.load_split(), "eval", per_category=args.per_category,
                                   fits=lambda q: len(ids(q)) <= args.max_prompt_tokens)
    prompts = [ids(q) for q in questions]
    results = engine.generate([Request(prompt_ids=p, sampling=SamplingParams(max_tokens=args.max_tokens))
                               for p in prompts])
    aux = eagle3.default_aux_layers(tc.num_layers)
    data = []
    for p, r in zip(prompts, results):
        if len(r["token_ids"]) < 2:
            continue
        seq = p + r["token_ids"]
        feats, hidden = target_features(engine.model, engine.cache, seq, aux)
        # stored as train-eagle's shards store them (bfloat16), so the figures compare with its reports
        data.append({"ids": torch.tensor(seq), "feats": feats.to(torch.bfloat16), "hidden": hidden.to(torch.bfloat16),
                     "answer_start": len(p)})
    rows_w = load_weights(os.path.join(args.bundle, engine.meta.roles["target"]["path"]), "cpu")
    full_out = as_dense(rows_w.get("lm_head", rows_w["embed"])).float()
    embed = as_dense(rows_w["embed"]).float()
    cfg = EagleTrainConfig(max_rows=args.max_prompt_tokens + args.max_tokens)
    out = {"bundle": os.path.abspath(args.bundle), "questions": [q["question_id"] for q in questions],
           "answers": len(data), "max_tokens": args.max_tokens, "depth": args.depth, "heads": {}}
    print(f"{len(data)} eval-split answers ({args.per_category} per group, <= {args.max_tokens} tokens), "
          f"target {os.path.basename(os.path.normpath(args.bundle))}")
    for h in args.heads:
        head = load_head_dir(h, tc, embed, engine.max_seq_len + 64)
        ev = evaluate(head, data, full_out[head.draft_ids], full_out, cfg, args.depth)
        by = ev["acceptance_by_position"]
        # per chain the accepted count is a sum of nested indicators: its variance from the
        # by-position rates (P(N >= j) = by[j - 1]): E[N^2] = sum_j (2j - 1) by[j - 1]
        mean = sum(by)
        var = sum((2 * j - 1) * b for j, b in enumerate(by, start=1)) - mean * mean
        se = (max(var, 0.0) / max(ev["chains"], 1)) ** 0.5
        out["heads"][h] = {**ev, "tokens_per_pass_se": round(se, 4)}
        print(f"{h}: acceptance by position {by}, {ev['expected_accepted_per_pass']} tokens per pass "
              f"(+- {se:.3f} s.e. with chains taken as independent: a lower bound), {ev['chains']} chains")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
