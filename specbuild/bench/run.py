"""The Spec-Bench style benchmark of one bundle: its rows (specbuild's methods, peers), the
measuring loop (interleaved question by question, so drift hits every row alike), the floor and
verify-cost measurements, and the report. `specbuild bench` parses its options into a
BenchConfig and calls `run_bench` (or `run_formats` for `--formats`).

The parts the rows are made of (data set, runners, aggregation, table) are in
`specbuild.bench.specbench`.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

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
    suffix_corpus: str | None = None  # the suffix store's warm corpus (EngineConfig.suffix_corpus): every row's
    # store starts from it at each row's first question, instead of empty

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

    from specbuild.engine.engine import Engine, EngineConfig

    engine = Engine(bundle_dir, EngineConfig(device=cfg.device, threads=cfg.threads, max_batch_size=cfg.batch_size,
                                             compile=cfg.compile, suffix_corpus=cfg.suffix_corpus))
    env = environment(torch.get_num_threads(), command)
    sink = None
    if cfg.telemetry:
        import uuid

        from specbuild.telemetry import attach

        sink = attach(engine, cfg.telemetry, source="bench", run_id=uuid.uuid4().hex[:12])
    methods = resolve_methods(cfg.methods, engine.meta.roles)
    render = lambda messages: engine.encode(engine.render_chat(messages), add_special_tokens=False)  # noqa: E731
    chosen, unfit = choose_questions(engine, cfg, render)
    fmt, target_format = describe_target(engine, bundle_dir)
    rows = specbuild_rows(engine, cfg, methods, fmt) + peer_rows(engine, cfg, bundle_dir, fmt, env["threads"])
    # specbuild's rows run as `serve` runs them: the engine loop in its own thread, the requests
    # handed to it and their results awaited (issue 50: the main-thread step was not what users got)
    engine.start()
    try:
        measure_rows(rows, chosen, cfg, render)
    finally:
        engine.stop()
    env["engine_threads"] = engine.stats().get("threads")
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
    charged = charged_costs(engine, methods)
    env["loadavg_end"] = list(os.getloadavg())
    return {"bundle": os.path.abspath(bundle_dir), "target_format": target_format, "env": env,
            "config": {**asdict(cfg), "methods": methods}, "questions": len(chosen),
            "question_ids": [q["question_id"] for q in chosen], "rows": summary,
            "peer_ratios": B.peer_ratios(summary), "floor": floor, "verify_costs": verify,
            "charged_costs": charged,
            "notes": report_notes(summary, env, cfg, unfit, engine.max_seq_len) + charged_note(charged),
            **({"telemetry": telemetry} if telemetry else {})}


def choose_questions(engine, cfg: BenchConfig, render) -> tuple[list[dict], int]:
    """The questions of the split that fit the engine's max_seq_len with every answer (per_category
    per task group), and how many of the split did not fit."""
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
    return chosen, unfit


def describe_target(engine, bundle_dir: str) -> tuple[str, str]:
    """The target's weight format as rows name it (`float32`, `int4/bf16`: weights / what they
    multiply) and the longer description with its source."""
    from specbuild.bench.formats import read_quant

    target = engine.meta.roles["target"]
    fmt = target.get("dtype", str(engine.model.dtype).replace("torch.", ""))
    quant = read_quant(os.path.join(bundle_dir, target["path"]))
    if quant and quant.get("quantize") not in (None, "none"):
        act = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int8": "a8"}.get(quant.get("activations"), "?")
        if quant.get("activations") == "auto":  # what it loaded as here
            act = "a8" if getattr(engine.model.w.get("layers.0.qkv"), "primary", "") == "int4-a8" else "bf16"
        fmt = f"{quant['quantize']}/{act}"
    return fmt, f"{fmt}, from {os.path.basename(target.get('source', '')) or '?'} ({target.get('source_format', '?')})"


def specbuild_rows(engine, cfg: BenchConfig, methods: list[str], fmt: str) -> list[tuple]:
    """(RowRecord, runner) per method, and per tree for Medusa rows."""
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
    return rows


def peer_rows(engine, cfg: BenchConfig, bundle_dir: str, fmt: str, threads: int) -> list[tuple]:
    """The peers' rows: transformers (plain, prompt lookup, assisted with the bundle's draft) and
    llama.cpp on the bundle's GGUF source."""
    roles = engine.meta.roles
    target = roles["target"]
    rows = []
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
            runner = B.LlamaCppRunner(source, threads, cfg.max_tokens, engine.eos_ids, n_ctx=engine.max_seq_len)
        except ImportError:
            raise ValueError("the llama.cpp peer needs llama-cpp-python (pip install llama-cpp-python; it builds "
                             "llama.cpp from source)") from None
        rows.append((B.RowRecord("llama.cpp plain", "llama.cpp", "plain", f"GGUF as is (llama-cpp-python "
                                 f"{runner.version}, n_batch {runner.n_batch})", 1), runner))
    return rows


def measure_rows(rows: list[tuple], chosen: list[dict], cfg: BenchConfig, render) -> None:
    """Every row on every chunk of questions (a task group's questions, batch_size at a time),
    the rows interleaved within each repeat so drift hits every row alike; learning drafters
    start each repeat from their state after the earlier questions. Fills each RowRecord."""
    from tqdm import tqdm

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
            for i, ((record, runner), rec) in enumerate(zip(rows, records)):
                B.restore_drafter_state(runner, states[i])
                B.clear_prefix_cache(runner)
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


def report_notes(summary: list[dict], env: dict, cfg: BenchConfig, unfit: int, max_seq_len: int) -> list[str]:
    """What a reader of the table must know: rows that never drafted, questions passed over, the load."""
    notes = []
    for r in summary:
        o = r["groups"]["overall"]
        if r["engine"] == "specbuild" and r["method"] != "none" and not o["drafted"]:
            notes.append(f"{r['name']} drafted no tokens: the engine did not speculate, so this row measures "
                         "plain decoding")
    if unfit:
        notes.append(f"{unfit} question(s) of the split passed over: prompt + answers exceed max_seq_len="
                     f"{max_seq_len}")
    if cfg.batch_size > 1 and cfg.peers:
        notes.append("transformers rows run one prompt at a time (batch 1)")
    busy = max(env["loadavg_start"][0], env["loadavg_end"][0]) > (env["cpu_count"] or 1)
    if busy and env["threads"] > 1 and not (env["omp_wait_policy"] or env["gomp_spincount"]):
        notes.append("the machine was oversubscribed: spinning OpenMP threads stall each other there; "
                     "GOMP_SPINCOUNT=10000 or --threads 1 steadies multi-threaded timings")
    notes.append(f"load average {env['loadavg_start'][0]:.1f} at start, {env['loadavg_end'][0]:.1f} at end on "
                 f"{env['cpu_count']} logical CPUs (a shared machine adds noise)")
    return notes


def charged_costs(engine, methods: list[str]) -> dict:
    """What the depth controller charged in this run (the engine's calibrated costs, measured at
    load or read from the cost cache): the verify pass by width and, per drafting method, its cost
    per drafted token (a draft model's step, one level of an EAGLE head or Medusa's heads; 0 for
    the text-matching drafters). Milliseconds."""
    costs = engine.speculator.controller.costs
    from specbuild.speculation.calibration import MeasuredCosts

    verify = {int(w): round(c * 1e3, 3) for w, c in sorted(costs.verify.items())} if isinstance(costs, MeasuredCosts) \
        else {}
    drafts = {m: round(costs[m].draft_cost * 1e3, 3) for m in methods
              if m != "none" and m in engine.speculator.proposers}
    return {"verify_ms": verify, "draft_ms": drafts}


def charged_note(charged: dict) -> list[str]:
    paid = {m: ms for m, ms in charged["draft_ms"].items() if ms > 0}
    if not charged["verify_ms"] or not paid:
        return []
    v = charged["verify_ms"]
    widths = ", ".join(f"w{w} {ms:.2f}" for w, ms in v.items())
    return [f"costs the depth controller charged (ms): verify {widths}; per drafted token "
            + ", ".join(f"{m} {ms:.2f}" for m, ms in paid.items())]


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


def run_formats(bundle_dir: str, names: tuple[str, ...], threads: int, repeats: int, progress=None) -> dict:
    """`bench --formats`: the weight-formats benchmark (bench/formats.py) on the source the
    bundle's target was compiled from; `progress(message)` hears each step."""
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
                                 progress=progress)
    finally:
        torch.set_num_threads(threads_before)
