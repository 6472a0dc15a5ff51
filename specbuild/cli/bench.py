"""`specbuild bench`: parse the options, build a BenchConfig, call `specbuild.bench.run.run_bench`
(or `run_formats` for `--formats`), print the report."""

from __future__ import annotations

import shlex
import sys

import click

from specbuild.bench.run import DEFAULT_PER_CATEGORY, BenchConfig, run_bench, run_formats
from specbuild.bench.specbench import SPLITS, format_table
from specbuild.cli.options import DrafterCommand, compile_option, gamma_options, shared, telemetry_option

def _csv(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(v.strip() for v in value.split(",") if v.strip())


@click.command(cls=DrafterCommand, drafter_settings=("suffix_corpus",),
               drafter_help={"suffix_corpus": " Every row's store starts from it (cold: empty)."})
@click.argument("bundle", type=click.Path())
@click.option("--workload", type=click.Choice(["spec-bench", "repeated"]), default="spec-bench", show_default=True,
              help="spec-bench: the Spec-Bench questions (or --dataset); repeated: multi-turn sessions editing and "
                   "re-asking about one document or code, and requests sharing templates (bench/repeated.py; all "
                   "of its questions).")
@click.option("--dataset", type=click.Path(), default=None,
              help="Spec-Bench style jsonl [default: the packaged Spec-Bench questions and split].")
@click.option("--split", type=click.Choice(SPLITS), default="eval", show_default=True,
              help="Which questions (the split is by question id, stratified by category).")
@click.option("--per-category", type=int, default=DEFAULT_PER_CATEGORY, show_default=True,
              help="Questions per task group (mt_bench, translation, summarization, qa, math_reasoning, rag); 0 = all.")
@shared("--max-tokens", default=128, show_default=True, help="New tokens per turn (greedy).")
@click.option("--speculation", default=None,
              help="Comma-separated methods, e.g. none,ngram,draft [default: ngram plus the bundle's drafters]; "
                   "plain decoding (none) always runs as the baseline.")
@gamma_options
@click.option("--batch-size", type=int, default=1, show_default=True, help="Questions per batch (same task group).")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed repeats; each turn's median counts.")
@shared("--threads", default=2, show_default=True, help="Torch CPU threads (every row).")
@shared("--device")
@click.option("--peers", default="", help="Peer rows, comma-separated: 'transformers' (plain, prompt lookup, "
                                         "assisted with a draft role; needs the bench extra), 'llama.cpp' (plain, on "
                                         "the bundle's GGUF source; needs llama-cpp-python).")
@click.option("--floor", is_flag=True, help="Also measure the decode step against the memory-bandwidth floor.")
@click.option("--floor-mib", type=int, default=256, show_default=True,
              help="Size of the tensor copied to measure memory bandwidth (well above the CPU caches).")
@click.option("--tree", "trees", default=None,
              help="Medusa rows: comma-separated trees (preset names, chain_<k> or JSON files), a row each "
                   "[default: the bundle's tree].")
@click.option("--verify-costs", is_flag=True,
              help="Also time one target forward per verify width: a decode step, a chain of 5 and each tree.")
@click.option("--formats", default=None,
              help="Instead of Spec-Bench rows: compile the bundle's target source in these weight formats "
                   "(comma-separated, e.g. float32,bfloat16,int8,int4) and report each one's step against its "
                   "memory floor, verify cost by width, perplexity and greedy agreement (llama.cpp as a peer row "
                   "where llama-cpp-python is installed).")
@compile_option(" Every row, the baseline too; with --formats add +compile to a format's name instead "
                "(e.g. int4,int4+compile).")
@shared("--json", help="Print the full report as JSON instead of the table.")
@shared("--no-progress")
@shared("--plot", help="Also draw each row's speedup by task group into this PNG file.")
@telemetry_option
def bench(bundle, workload, dataset, split, per_category, max_tokens, speculation, gamma, gamma_min, gamma_max, batch_size,
          repeats, threads, device, peers, floor, floor_mib, trees, verify_costs, formats, compile_, as_json,
          no_progress, plot, telemetry, drafters) -> None:
    """Spec-Bench style benchmark: tokens/s, speedup over plain decoding and mean accepted
    tokens per task group, greedy outputs checked against plain decoding.

    Defaults (eval split, 8 per group, 128 tokens, 3 repeats, none + ngram) take about 20
    minutes on SmolLM2-135M with 2 idle cores, longer on a busy machine; use --per-category 1
    for a quick look. Every row's weight format is named; the report records torch, threads,
    the CPU, the load average and the command line.
    """
    import json

    from specbuild.errors import SpecbuildError

    try:
        if formats is not None:
            report = run_formats(bundle, _csv(formats) or (), threads, repeats,
                                 None if no_progress else (lambda m: click.echo(m, err=True)))
            from specbuild.bench.formats import format_report

            click.echo(json.dumps(report, indent=2, default=str) if as_json else format_report(report))
            return
        from specbuild.bench.repeated import workload as workload_data

        dataset, split = workload_data(workload, dataset, split)
        cfg = BenchConfig(dataset=dataset, split=split, per_category=per_category or None, max_tokens=max_tokens,
                          methods=_csv(speculation), gamma=gamma, gamma_min=gamma_min, gamma_max=gamma_max,
                          batch_size=batch_size, repeats=repeats, threads=threads, device=device,
                          peers=_csv(peers) or (), floor=floor, floor_bytes=floor_mib << 20,
                          trees=_csv(trees), verify_costs=verify_costs, progress=not no_progress, telemetry=telemetry,
                          compile=compile_, suffix_corpus=drafters.get("suffix", {}).get("corpus"))
        report = run_bench(bundle, cfg, command=shlex.join(["specbuild"] + sys.argv[1:]))
    except (SpecbuildError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(json.dumps(report, indent=2) if as_json else format_table(report))
    if plot:
        from specbuild.bench.plot import plot_speedups

        click.echo(f"plot written to {plot_speedups(report, plot)}", err=True)
