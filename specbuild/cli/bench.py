"""`specbuild bench`: the Spec-Bench style benchmark (rows, the measuring loop, the report).

The library parts (data set, runners, aggregation, table) are in `specbuild.bench.specbench`; this
module builds the rows for one bundle and drives them, interleaved question by question.
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import click

from specbuild.cli.main import compile_option
from specbuild.bench import specbench as B

# 48 questions (one of each MT-bench category): with none + ngram, 128 tokens and 3 repeats about
# 2 x 3 x 6k tokens, ~20 min at SmolLM2-135M's ~30 tok/s plain on 2 idle cores.
DEFAULT_PER_CATEGORY = 8


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one benchmark run (all rows share them)."""

    dataset: str | None = None  # jsonl; None: the packaged Spec-Bench questions and split
    split: str = "eval"
    per_category: int | None = DEFAULT_PER_CATEGORY  # per task group; None: all
    max_tokens: int = 128
    methods: tuple[str, ...] | None = None  # None: none, ngram and the bundle's drafters
    gamma: int | None = None
    gamma_min: int | None = None
    gamma_max: int | None = None
    batch_size: int = 1
    repeats: int = 3
    threads: int | None = 2
    device: str = "cpu"
    peers: tuple[str, ...] = ()
    floor: bool = False
    floor_bytes: int = 256 << 20
    trees: tuple[str, ...] | None = None  # Medusa rows: one per tree (None: the bundle's tree)
    verify_costs: bool = False  # also time one forward per verify width (chain of 5 and each tree)
    progress: bool = True
    telemetry: str | None = None  # record the specbuild rows' sessions and steps into this store (path or DSN)
    compile: bool = False  # the target's layer stack compiled (EngineConfig.compile)

    def __post_init__(self) -> None:
        if self.split not in B.SPLITS:
            raise ValueError(f"split {self.split!r} is not one of {', '.join(B.SPLITS)}")
        for name, lo in (("max_tokens", 1), ("batch_size", 1), ("repeats", 1), ("floor_bytes", 1 << 20)):
            if getattr(self, name) < lo:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {lo}")
        if self.per_category is not None and self.per_category < 1:
            raise ValueError(f"per_category={self.per_category} must be >= 1 (or None for all)")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads} must be >= 1")
        bad = [p for p in self.peers if p not in ("transformers", "llama.cpp")]
        if bad:
            raise ValueError(f"peer {bad[0]!r} is not one of: transformers, llama.cpp")


def resolve_methods(requested: tuple[str, ...] | None, roles: dict) -> list[str]:
    """'none' first (the baseline), then the requested methods; drafters must be in the bundle."""
    from specbuild.speculation.config import METHODS

    if requested is None:
        requested = ("ngram",) + tuple(m for m in ("draft", "medusa") if m in roles)
    methods = ["none"]
    for m in requested:
        if m not in METHODS:
            raise ValueError(f"speculation method {m!r} is not one of {', '.join(METHODS)}")
        if m in ("draft", "medusa") and m not in roles:
            raise ValueError(f"speculation method {m!r} needs a {m!r} role; this bundle has {', '.join(sorted(roles))}")
        if m not in methods:
            methods.append(m)
    return methods


def environment(threads: int, command: str) -> dict:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:  # the version without importing transformers (seconds)
        from importlib.metadata import PackageNotFoundError, version
        tf_version = version("transformers")
    except PackageNotFoundError:
        tf_version = None
    from specbuild import __version__
    return {"specbuild": __version__, "torch": torch.__version__, "transformers": tf_version, "threads": threads,
            "cpu": cpu, "cpu_count": os.cpu_count(), "python": platform.python_version(), "command": command,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_start": list(os.getloadavg()),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT")}


def run_bench(bundle_dir: str, cfg: BenchConfig, command: str = "") -> dict:
    """Run every row on the same questions and return the report (JSON-ready)."""
    import torch

    if cfg.peers:
        try:
            import transformers
            transformers.logging.set_verbosity_error()
        except ImportError:
            raise ValueError("peer rows need transformers: pip install 'specbuild[bench]'") from None
    threads_before = torch.get_num_threads()
    try:  # the engine sets torch's (process-wide) thread count: give it back afterwards
        return _run(bundle_dir, cfg, command)
    finally:
        torch.set_num_threads(threads_before)


def _run(bundle_dir: str, cfg: BenchConfig, command: str) -> dict:
    import torch
    from tqdm import tqdm

    from specbuild.engine.engine import Engine, EngineConfig

    engine = Engine(bundle_dir, EngineConfig(device=cfg.device, threads=cfg.threads, max_batch_size=cfg.batch_size,
                                             compile=cfg.compile))
    env = environment(torch.get_num_threads(), command)
    sink = None
    if cfg.telemetry:
        import uuid

        from specbuild.telemetry import attach

        sink = attach(engine, cfg.telemetry, source="bench", run_id=uuid.uuid4().hex[:12])
    roles = engine.meta.roles
    methods = resolve_methods(cfg.methods, roles)
    render = lambda messages: engine.encode(engine.render_chat(messages), add_special_tokens=False)  # noqa: E731
    questions = B.load_questions(cfg.dataset)
    split = B.load_split() if cfg.dataset is None else B.make_split(questions)

    def fits(q):  # the last turn's prompt plus every answer must fit max_seq_len
        skeleton = render(B.chat_messages(q["turns"], [""] * (len(q["turns"]) - 1)))
        return len(skeleton) + len(q["turns"]) * (cfg.max_tokens + 8) < engine.max_seq_len

    chosen = B.select_questions(questions, split, cfg.split, cfg.per_category, fits)
    unfit = sum(not fits(q) for q in B.select_questions(questions, split, cfg.split, None))
    if not chosen:
        raise ValueError(f"no question of the {cfg.split} split fits max_seq_len={engine.max_seq_len} "
                         f"with max_tokens={cfg.max_tokens}")
    target = roles["target"]
    fmt = target.get("dtype", str(engine.model.dtype).replace("torch.", ""))
    from specbuild.bench.formats import read_quant

    quant = read_quant(os.path.join(bundle_dir, target["path"]))
    if quant and quant.get("quantize") not in (None, "none"):  # e.g. int4/bf16: weights / what they multiply in
        act = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int8": "a8"}.get(quant.get("activations"), "?")
        fmt = f"{quant['quantize']}/{act}"
    target_format = f"{fmt}, from {os.path.basename(target.get('source', '')) or '?'} ({target.get('source_format', '?')})"
    from specbuild.speculation.tree import tree_argument

    spec_fields = {"gamma": cfg.gamma, "gamma_min": cfg.gamma_min, "gamma_max": cfg.gamma_max}
    if cfg.trees and "medusa" not in methods:
        raise ValueError("--tree applies to Medusa rows: add medusa to --speculation")
    rows = []
    for m in methods:
        for tree in (cfg.trees or (None,)) if m == "medusa" else (None,):
            name = f"specbuild {m}" + (f"[{tree}]" if tree and len(cfg.trees) > 1 else "")
            fields = {**spec_fields, "tree": tree_argument(tree)} if m == "medusa" else spec_fields if m != "none" else {}
            rows.append((B.RowRecord(name, "specbuild", m, fmt, cfg.batch_size),
                         B.SpecbuildRunner(engine, m, cfg.max_tokens, **fields)))
    if "transformers" in cfg.peers:
        hf = B.load_transformers_model(target.get("source", ""), engine.model.dtype).to(engine.model.device)
        peer = lambda mode, **kw: (B.RowRecord(f"transformers {mode}", "transformers", mode, fmt, 1),  # noqa: E731
                                   B.TransformersRunner(hf, engine.tokenizer, cfg.max_tokens, engine.eos_ids, mode, **kw))
        rows += [peer("plain"), peer("prompt_lookup")]
        if "draft" in roles:
            source = roles["draft"].get("source", "")
            if os.path.isfile(os.path.join(source, "draft.json")):  # a train-draft directory: export it for HF
                import tempfile

                from specbuild.compiler.draft_role import export_draft

                source = tempfile.mkdtemp(prefix="specbuild-draft-hf-")
                export_draft(bundle_dir, source)
            draft = B.load_transformers_model(source, engine.model.dtype)
            rows.append(peer("assisted", assistant=draft.to(engine.model.device)))
    if "llama.cpp" in cfg.peers:
        source = target.get("source", "")
        if not source.endswith(".gguf") or not os.path.isfile(source):
            raise ValueError(f"the llama.cpp peer runs the bundle's GGUF source, and this target came from {source!r}")
        try:
            runner = B.LlamaCppRunner(source, env["threads"], cfg.max_tokens, engine.eos_ids,
                                      n_ctx=engine.max_seq_len)
        except ImportError:
            raise ValueError("the llama.cpp peer needs llama-cpp-python (pip install llama-cpp-python; it builds "
                             "llama.cpp from source)") from None
        rows.append((B.RowRecord("llama.cpp plain", "llama.cpp", "plain", f"GGUF as is (llama-cpp-python "
                                 f"{runner.version}, n_batch {runner.n_batch})", 1), runner))
    chunks = []
    for g in dict.fromkeys(B.task_group(q["category"]) for q in chosen):
        qs = [q for q in chosen if B.task_group(q["category"]) == g]
        chunks += [(g, qs[i:i + cfg.batch_size]) for i in range(0, len(qs), cfg.batch_size)]
    bar = tqdm(total=len(chunks) * cfg.repeats * len(rows), file=sys.stderr, disable=not cfg.progress,
               desc="bench", unit="run")
    states: list = [None] * len(rows)  # per row: learning drafters' state after its earlier questions
    for group, qs in chunks:
        records = [{"group": group, "questions": qs, "turns": None, "seconds": []} for _ in rows]
        for rep in range(cfg.repeats):
            for i, ((record, runner), rec) in enumerate(zip(rows, records)):  # interleaved: drift hits every row alike
                B.restore_drafter_state(runner, states[i])
                turns, seconds = B.run_conversations(runner, render, qs)
                if rep == cfg.repeats - 1:
                    states[i] = B.drafter_state(runner)
                rec["turns"] = rec["turns"] or turns
                rec["seconds"].append(seconds)
                bar.set_postfix_str(f"{group} {record.name}", refresh=False)
                bar.update()
        for (record, _), rec in zip(rows, records):
            record.chunks.append(rec)
    bar.close()
    telemetry = None
    if sink is not None:
        from specbuild.telemetry.store import describe

        sink.close()
        engine.set_sink(None)
        telemetry = {"store": describe(cfg.telemetry), "run_id": sink.run_id, **sink.stats()}
    summary = B.summarize([r for r, _ in rows], gap_fn=lambda ids: B.top2_gap(engine, ids))
    floor = None
    if cfg.floor:
        floor = measure_floor(engine, render(B.chat_messages(chosen[0]["turns"], [])), cfg.max_tokens,
                                cfg.repeats, cfg.floor_bytes)
    verify = measure_verify_costs(engine, cfg.trees, cfg.repeats) if cfg.verify_costs else None
    env["loadavg_end"] = list(os.getloadavg())
    notes = []
    for r in summary:
        o = r["groups"]["overall"]
        if r["engine"] == "specbuild" and r["method"] != "none" and not o["drafted"]:
            notes.append(f"{r['name']} drafted no tokens: the engine did not speculate, so this row measures "
                         "plain decoding")
    if unfit:
        notes.append(f"{unfit} question(s) of the split passed over: prompt + answers exceed max_seq_len="
                     f"{engine.max_seq_len}")
    if cfg.batch_size > 1 and cfg.peers:
        notes.append("transformers rows run one prompt at a time (batch 1)")
    busy = max(env["loadavg_start"][0], env["loadavg_end"][0]) > (env["cpu_count"] or 1)
    if busy and env["threads"] > 1 and not (env["omp_wait_policy"] or env["gomp_spincount"]):
        notes.append("the machine was oversubscribed: spinning OpenMP threads stall each other there; "
                     "GOMP_SPINCOUNT=10000 or --threads 1 steadies multi-threaded timings")
    notes.append(f"load average {env['loadavg_start'][0]:.1f} at start, {env['loadavg_end'][0]:.1f} at end on "
                 f"{env['cpu_count']} logical CPUs (a shared machine adds noise)")
    return {"bundle": os.path.abspath(bundle_dir), "target_format": target_format, "env": env,
            "config": {**asdict(cfg), "methods": methods}, "questions": len(chosen),
            "question_ids": [q["question_id"] for q in chosen], "rows": summary,
            "peer_ratios": B.peer_ratios(summary), "floor": floor, "verify_costs": verify, "notes": notes,
            **({"telemetry": telemetry} if telemetry else {})}


def measure_verify_costs(engine, trees: tuple[str, ...] | None, repeats: int) -> dict:
    """One target forward per verify width, after 64 cached tokens: width 1 (a decode step),
    a chain of 5 drafts (width 6) and each tree (nodes + 1: the root is the last accepted
    token), in the bundle's format as the runtime runs it; best and median of 2 x repeats + 1."""
    from specbuild.bench.formats import forward_costs
    from specbuild.speculation.tree import load_tree

    shapes = [("decode step", 0), ("chain of 5", 5)]
    medusa = engine.meta.roles.get("medusa")
    if trees:
        shapes += [(n, load_tree(n, allow_files=True).num_drafts) for n in trees]
    elif medusa is not None and os.path.isfile(os.path.join(engine.bundle_dir, medusa["path"], "tree.json")):
        tree = load_tree(os.path.join(engine.bundle_dir, medusa["path"], "tree.json"), allow_files=True)
        shapes.append((str(medusa.get("tree") or tree.name), tree.num_drafts))
    widths = sorted({nodes + 1 for _, nodes in shapes})
    costs = forward_costs(engine.model, engine.cache, widths, repeats=2 * repeats + 1)
    one = costs[1]["min_ms"]
    return {"context": 64, "widths": {w: {"min_ms": round(c["min_ms"], 3), "median_ms": round(c["wall_ms"], 3)}
                                     for w, c in costs.items()},
            "shapes": [{"name": n, "nodes": k, "width": k + 1, "min_ms": round(costs[k + 1]["min_ms"], 3),
                        "x_step": round(costs[k + 1]["min_ms"] / one, 3)} for n, k in shapes]}


# ---- the memory-bandwidth floor ---------------------------------------------------------
def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5, device: str = "cpu") -> dict:
    """timing.copy_bandwidth (imported on use: the CLI loads without torch)."""
    from specbuild.model.timing import copy_bandwidth as measure

    return measure(nbytes, repeats, device)


def floor_summary(weight_bytes: int, gb_per_s: float, step_ms: float) -> dict:
    """floor_ms = weight bytes read per step / bandwidth; ratio = measured step / floor."""
    floor_ms = weight_bytes / (gb_per_s * 1e9) * 1e3

    def sig(x: float) -> float:  # 4 significant digits: tiny models have floors of ~0.02 ms
        return float(f"{x:.4g}")

    return {"weight_bytes": weight_bytes, "copy_gb_per_s": sig(gb_per_s), "floor_ms": sig(floor_ms),
            "step_ms": sig(step_ms), "ratio": sig(step_ms / floor_ms)}


def measure_floor(engine, prompt_ids: list[int], max_tokens: int, repeats: int, nbytes: int = 256 << 20) -> dict:
    """Plain decode at batch 1 (EOS ignored) against the floor, bandwidth measured in between
    (timing.copy_bandwidth, best of all copies: the floor is what the machine can do)."""
    from specbuild.model.decoder import weight_bytes

    runner = B.SpecbuildRunner(engine, "none", max(max_tokens, 16), ignore_eos=True)
    steps, bws = [], []
    for _ in range(max(repeats, 3)):
        bws.append(copy_bandwidth(nbytes, device=str(engine.model.device))["gb_per_s"])
        steps.append(runner([prompt_ids])[0][0]["stats"]["tpot_ms"])
    wb = weight_bytes(engine.model.w, engine.target_config.tie_word_embeddings)
    out = floor_summary(wb, max(bws), statistics.median(steps))  # the best copy: the machine's bandwidth
    out.update({"dtype": str(engine.model.dtype).replace("torch.", ""), "copy_bytes": nbytes,
                "samples": len(steps), "step_ms_samples": steps, "copy_gb_per_s_samples": [round(b, 3) for b in bws]})
    return out


def run_formats(bundle_dir: str, names: tuple[str, ...], threads: int, repeats: int, progress: bool) -> dict:
    """`bench --formats`: the weight-formats benchmark (formats_bench) on the source the
    bundle's target was compiled from."""
    import torch

    from specbuild.bundle import read_meta
    from specbuild.bench.formats import COMPILED, DEFAULT_FORMATS, run_formats_bench

    unknown = [n for n in names if n.removesuffix(COMPILED) not in DEFAULT_FORMATS]
    if not names or unknown:
        raise ValueError(f"--formats {','.join(unknown or names) or '(empty)'}: each must be one of "
                         f"{', '.join(DEFAULT_FORMATS)}, optionally with {COMPILED} (its layer stack compiled)")
    source = read_meta(bundle_dir).roles["target"].get("source")
    if not source:
        raise ValueError(f"bundle {bundle_dir!r} does not record its target's source; run "
                         "scripts/bench_formats.py --target SOURCE instead")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run_formats_bench(source, {n: DEFAULT_FORMATS[n.removesuffix(COMPILED)] for n in names}, threads=threads, repeats=repeats,
                                 progress=(lambda m: click.echo(m, err=True)) if progress else None)
    finally:
        torch.set_num_threads(threads_before)


def _csv(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(v.strip() for v in value.split(",") if v.strip())


@click.command()
@click.argument("bundle", type=click.Path())
@click.option("--workload", type=click.Choice(["spec-bench", "repeated"]), default="spec-bench", show_default=True,
              help="spec-bench: the Spec-Bench questions (or --dataset); repeated: multi-turn sessions editing and "
                   "re-asking about one document or code, and requests sharing templates (bench/repeated.py; all "
                   "of its questions).")
@click.option("--dataset", type=click.Path(), default=None,
              help="Spec-Bench style jsonl [default: the packaged Spec-Bench questions and split].")
@click.option("--split", type=click.Choice(B.SPLITS), default="eval", show_default=True,
              help="Which questions (the split is by question id, stratified by category).")
@click.option("--per-category", type=int, default=DEFAULT_PER_CATEGORY, show_default=True,
              help="Questions per task group (mt_bench, translation, summarization, qa, math_reasoning, rag); 0 = all.")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="New tokens per turn (greedy).")
@click.option("--speculation", default=None,
              help="Comma-separated methods, e.g. none,ngram,draft [default: ngram plus the bundle's drafters]; "
                   "plain decoding (none) always runs as the baseline.")
@click.option("--gamma", type=int, default=None, help="Fixed draft length for speculative rows.")
@click.option("--gamma-min", type=int, default=None, help="Lower bound of the dynamic draft length.")
@click.option("--gamma-max", type=int, default=None, help="Upper bound of the dynamic draft length.")
@click.option("--batch-size", type=int, default=1, show_default=True, help="Questions per batch (same task group).")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed repeats; each turn's median counts.")
@click.option("--threads", type=int, default=2, show_default=True, help="Torch CPU threads (every row).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N.")
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
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON instead of the table.")
@click.option("--no-progress", is_flag=True, help="No progress bar on stderr.")
@click.option("--plot", "plot", type=click.Path(dir_okay=False), default=None,
              help="Also draw each row's speedup by task group into this PNG file.")
@click.option("--telemetry", default=None, metavar="DB",
              help="Record the specbuild rows' sessions and steps into DB (SQLite file or postgresql:// DSN).")
def bench(bundle, workload, dataset, split, per_category, max_tokens, speculation, gamma, gamma_min, gamma_max, batch_size,
          repeats, threads, device, peers, floor, floor_mib, trees, verify_costs, formats, compile_, as_json,
          no_progress, plot, telemetry) -> None:
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
            report = run_formats(bundle, _csv(formats) or (), threads, repeats, not no_progress)
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
                          compile=compile_)
        report = run_bench(bundle, cfg, command=shlex.join(["specbuild"] + sys.argv[1:]))
    except (SpecbuildError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(json.dumps(report, indent=2) if as_json else B.format_table(report))
    if plot:
        from specbuild.bench.plot import plot_speedups

        click.echo(f"plot written to {plot_speedups(report, plot)}", err=True)
