#!/usr/bin/env python
"""Weight formats on one model: plain decoding speed against the memory floor, verify cost
by width, perplexity and greedy agreement with float32 (see specbuild/bench/formats.py).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/bench_formats.py --target smollm2-135m --threads 2

--kernels: only the linear kernels (torch's int4/int8 weight-only kernels, specbuild's at
each ISA level this CPU has, and specbuild's int4 x int8 kernel of the int4-a8 format on each
of its paths) over random weights of SmolLM2-135M's shapes, interleaved rounds,
GB/s at widths 1, 5, 17, with the CPU model and flags:

    .venv/bin/python scripts/bench_formats.py --kernels --threads 2 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import sys

from _common import cpu_info  # the lscpu model and flags line (scripts/ is on sys.path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m", help="HF directory, .gguf file or preset")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default=None,
                    help="comma-separated names from float32,bfloat16,int8,int4,int8-a8,int4-a8,int4-a8-h8,int4-bf16,int4-head4, "
                         "each optionally with +compile (the same bundle, its layer stack compiled); the first is "
                         "the baseline")
    ap.add_argument("--work-dir", default=None, help="where the bundles go (a temp dir by default)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--ppl-tokens", type=int, default=512)
    ap.add_argument("--json", default=None, help="also write the report here")
    ap.add_argument("--kernels", action="store_true", help="the linear kernels alone (see above)")
    ap.add_argument("--rounds", type=int, default=7, help="--kernels: interleaved rounds")
    ap.add_argument("--activations", default="bfloat16", choices=["bfloat16", "float32"], help="--kernels: input dtype")
    args = ap.parse_args()

    import torch

    if args.kernels:
        from specbuild.bench.formats import format_kernel_report, kernel_rounds
        from specbuild.model import cpu_kernels

        torch.set_num_threads(args.threads)
        report = kernel_rounds(rounds=args.rounds, act_dtype=getattr(torch, args.activations))
        report["cpu"] = cpu_info()
        report["kernel_status"] = cpu_kernels.status()
        print(f"CPU {report['cpu']['model']}; flags: {report['cpu']['flags']}")
        print(format_kernel_report(report))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
        return 0

    from specbuild.bench.formats import COMPILED, DEFAULT_FORMATS, format_report, run_formats_bench

    torch.set_num_threads(args.threads)
    names = args.formats.split(",") if args.formats else list(DEFAULT_FORMATS)
    if not args.formats:
        from specbuild.model import cpu_kernels

        if not cpu_kernels.int8_q8_available():  # named explicitly it loads, or says why it cannot
            names.remove("int4-a8-h8")
            print("int4-a8-h8 left out: its lm_head kernel needs AVX512-VNNI, which this CPU lacks", file=sys.stderr)
    unknown = [n for n in names if n.removesuffix(COMPILED) not in DEFAULT_FORMATS]
    if unknown:
        print(f"error: formats {unknown} are not among {', '.join(DEFAULT_FORMATS)} (each may end in {COMPILED})",
              file=sys.stderr)
        return 2
    report = run_formats_bench(args.target, {n: DEFAULT_FORMATS[n.removesuffix(COMPILED)] for n in names},
                               threads=args.threads,
                               work_dir=args.work_dir, ppl_tokens=args.ppl_tokens, prompts=args.prompts,
                               gen_tokens=args.gen_tokens, decode_tokens=args.decode_tokens, repeats=args.repeats,
                               progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
