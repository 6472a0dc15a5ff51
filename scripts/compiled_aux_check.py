"""Does the compiled layer stack give the same logits when it also returns EAGLE-3's auxiliary
layers? (Why the EAGLE head is not served under --compile: proposers/eagle.py build.)

    python scripts/compiled_aux_check.py BUNDLE [--widths 1,3,5,8,9,12,16,17] [--length 60] [--threads 2]

For each width w it prefills `length - w` tokens, then runs a w-row verify-shaped pass twice
through the compiled stack, without and with aux layers, and prints whether the logits are
bit-identical and the largest difference per row. Plain decoding and speculation are lossless
under --compile only if every forward shares one arithmetic, so any False here means a
request whose step asks for aux layers can leave plain decoding's output.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from specbuild.engine.engine import Engine, EngineConfig  # noqa: E402
from specbuild.model.decoder import ForwardBatch  # noqa: E402


def verify_pass(model, cache, ids: list[int], w: int, aux: tuple[int, ...]) -> torch.Tensor:
    n, p = len(ids), len(ids) - w
    cache.add(1)
    try:
        cache.reserve(1, n)
        s = cache.slots(1, 0, n)
        model.forward(ForwardBatch(torch.tensor(ids[:p]), torch.arange(p), s[:p], s[:p],
                                   torch.ones(p, p, dtype=torch.bool).tril(), torch.tensor([p - 1])), cache)
        mask = torch.ones(w, n, dtype=torch.bool)
        mask[:, p:] = torch.ones(w, w, dtype=torch.bool).tril()
        batch = ForwardBatch(torch.tensor(ids[p:]), torch.arange(p, n), s[p:], s, mask, torch.arange(w))
        return model.forward(batch, cache, aux_layers=aux, aux_rows=torch.arange(w) if aux else None).logits
    finally:
        cache.release(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--widths", default="1,3,5,8,9,12,16,17")
    ap.add_argument("--length", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    engine = Engine(args.bundle, EngineConfig(compile=True, threads=args.threads))
    model = engine.model
    layers = model.config.num_layers
    aux = (1, layers // 2 - 1, layers - 4)  # EAGLE-3's default choice of three layers
    cache = model.new_cache(-(-args.length // 16) + 2, 16)
    ids = [100 + (i * 7) % 400 for i in range(args.length)]
    print(f"{args.bundle}: compiled, {args.threads} threads, aux layers {aux}, text length {args.length}")
    for w in (int(x) for x in args.widths.split(",")):
        plain, with_aux = verify_pass(model, cache, ids, w, ()), verify_pass(model, cache, ids, w, aux)
        rows = [round((plain[i] - with_aux[i]).abs().max().item(), 4) for i in range(w)]
        print(f"width {w:2d}: identical {torch.equal(plain, with_aux)}; max |diff| per row {rows}")


if __name__ == "__main__":
    main()
