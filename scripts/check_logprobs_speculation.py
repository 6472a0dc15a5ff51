"""Do a bundle's logprobs depend on speculation? Greedy tokens and their logprobs with each
method against none, on three prompts (docs/clients.md, "Logprobs with speculation").

    python scripts/check_logprobs_speculation.py BUNDLE [--methods draft,ngram] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specbuild.engine.engine import Engine, EngineConfig  # noqa: E402
from specbuild.engine.sequence import Request  # noqa: E402
from specbuild.sampling.params import SamplingParams  # noqa: E402
from specbuild.speculation.config import SpeculationConfig  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "1, 2, 3, 4, 5,"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--methods", default="draft,ngram")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    engine = Engine(args.bundle, EngineConfig(prefix_cache=False, threads=1))

    def run(method: str) -> list[dict]:
        return engine.generate([Request(prompt=p, logprobs=0, sampling=SamplingParams(max_tokens=args.max_tokens),
                                        speculation=SpeculationConfig.make(engine.default_speculation, method=method))
                                for p in PROMPTS])

    base = run("none")
    for method in args.methods.split(","):
        out = run(method)
        worst, same, n = 0.0, 0, 0
        for a, b in zip(base, out):
            if a["token_ids"] != b["token_ids"]:
                print(f"{method}: TOKENS DIFFER (not lossless)")
                sys.exit(1)
            for x, y in zip(a["logprobs"], b["logprobs"]):
                d = abs(x["logprob"] - y["logprob"])
                worst, same, n = max(worst, d), same + (d == 0), n + 1
        accepted = sum(o["stats"]["accepted"] for o in out)
        print(f"{method}: tokens equal; logprobs bit-identical at {same}/{n} positions, max |diff| {worst:.3g}; "
              f"{accepted} draft tokens accepted")


if __name__ == "__main__":
    main()
