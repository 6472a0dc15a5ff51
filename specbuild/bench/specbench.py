"""Spec-Bench style benchmark: the held-out question set, runners, the report and its table.

Spec-Bench (480 questions, 13 categories) ships as package data with a train/eval split by
question id, stratified by category (`data/spec_bench/split.json`, written by
`scripts/make_spec_bench_split.py` from `make_split`). Results are reported per task group
the way Spec-Bench's leaderboard does: the 8 MT-bench categories form "mt_bench", the other
five categories are their own groups.

Every row (a specbuild speculation method or a transformers peer) runs the same chat
prompts, greedy, with the same token budget; multi-turn questions run as Spec-Bench runs
them: turn 2 follows the row's own turn-1 answer. Speedups compare tokens/s against plain
decoding of the same engine, measured in the same run (each turn's wall time is the median
over repeats; rows are interleaved per question so that load drift hits all of them alike).
Greedy outputs of every row are compared token for token with specbuild's plain decoding.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import resources
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
SPLIT_SALT = "specbuild-spec-bench-split-v1"
SPLITS = ("eval", "train", "all")
BASELINES = {"specbuild": "specbuild none", "transformers": "transformers plain", "llama.cpp": "llama.cpp plain"}


# ---- the data set -----------------------------------------------------------------------
def data_path(name: str) -> str:
    """Path of a file in the packaged Spec-Bench data (question.jsonl, split.json, LICENSE)."""
    return str(resources.files("specbuild").joinpath("data", "spec_bench", name))


def load_questions(path: str | None = None) -> list[dict]:
    """Read a Spec-Bench style jsonl (question_id, category, turns); the packaged file by default."""
    path = path or data_path("question.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"dataset {path!r} does not exist")
    questions, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
                ok = (isinstance(q.get("question_id"), int) and isinstance(q.get("category"), str)
                      and isinstance(q.get("turns"), list) and q["turns"]
                      and all(isinstance(t, str) and t for t in q["turns"]))
            except (json.JSONDecodeError, AttributeError):
                ok = False
            if not ok:
                raise ValueError(f"{path}:{n}: expected a JSON object with an int question_id, a category "
                                 "and a non-empty list of non-empty turns")
            if q["question_id"] in seen:
                raise ValueError(f"{path}:{n}: question_id {q['question_id']} appears twice")
            seen.add(q["question_id"])
            questions.append(q)
    if not questions:
        raise ValueError(f"dataset {path!r} has no questions")
    return questions


def task_group(category: str) -> str:
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def _rank(qid: int, salt: str) -> str:
    return hashlib.sha256(f"{salt}:{qid}".encode()).hexdigest()


def make_split(questions: list[dict], eval_fraction: float = 0.5, salt: str = SPLIT_SALT) -> dict:
    """Deterministic split by question id, stratified by category.

    Within each category the ids are ordered by sha256(salt:id); the first
    round(n * eval_fraction) (at least 1, at most n - 1) go to eval, the rest to train.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction} is out of range (0, 1)")
    by_cat: dict[str, list[int]] = {}
    for q in questions:
        by_cat.setdefault(q["category"], []).append(q["question_id"])
    train, evals, counts = [], [], {}
    for cat, ids in sorted(by_cat.items()):
        if len(ids) < 2:
            raise ValueError(f"category {cat!r} has {len(ids)} question(s); a stratified split needs >= 2")
        ids = sorted(ids, key=lambda i: _rank(i, salt))
        n_eval = min(max(round(len(ids) * eval_fraction), 1), len(ids) - 1)
        evals += ids[:n_eval]
        train += ids[n_eval:]
        counts[cat] = {"train": len(ids) - n_eval, "eval": n_eval}
    return {"version": 1, "salt": salt, "eval_fraction": eval_fraction, "categories": counts,
            "train": sorted(train), "eval": sorted(evals)}


def load_split(path: str | None = None) -> dict:
    with open(path or data_path("split.json"), encoding="utf-8") as f:
        return json.load(f)


def select_questions(questions: list[dict], split: dict, which: str = "eval",
                     per_category: int | None = None, fits: Callable[[dict], bool] | None = None) -> list[dict]:
    """The questions of one split, grouped in GROUPS order, at most `per_category` per group.

    Within a group, categories take turns (MT-bench: writing, roleplay, ... then again) and
    each category goes by question id, so a small per_category still spreads over them.
    Questions for which `fits` is false (too long for the bundle) are passed over.
    """
    if which not in SPLITS:
        raise ValueError(f"split {which!r} is not one of {', '.join(SPLITS)}")
    if per_category is not None and per_category < 1:
        raise ValueError(f"per_category={per_category} must be >= 1")
    keep = None if which == "all" else set(split[which])
    groups: dict[str, dict[str, list[dict]]] = {}
    for q in sorted(questions, key=lambda q: q["question_id"]):
        if keep is None or q["question_id"] in keep:
            groups.setdefault(task_group(q["category"]), {}).setdefault(q["category"], []).append(q)
    order = [g for g in GROUPS if g in groups] + sorted(set(groups) - set(GROUPS))
    chosen = []
    for g in order:
        cats = groups[g]
        names = [c for c in MT_BENCH_CATEGORIES if c in cats] + sorted(set(cats) - set(MT_BENCH_CATEGORIES))
        interleaved = [cats[c][i] for i in range(max(len(v) for v in cats.values())) for c in names
                       if i < len(cats[c])]
        picked = [q for q in interleaved if fits is None or fits(q)]
        chosen += picked[:per_category] if per_category else picked
    return chosen


def held_out_questions(n: int | None = None, max_chars: int | None = None, spread: bool = True) -> list[dict]:
    """Questions of the packaged held-out (eval) split whose first turn is at most `max_chars`
    long (None: any), the first `n` (None: all). `spread`: taken in turn from each task group
    (GROUPS order), so a few spread over the groups; else group after group as
    `select_questions` orders them. The scripts' and the served benchmark's prompt set."""
    fits = None if max_chars is None else (lambda q: len(q["turns"][0]) <= max_chars)
    chosen = select_questions(load_questions(), load_split(), "eval", fits=fits)
    if spread:
        by_group: dict[str, list[dict]] = {}
        for q in chosen:
            by_group.setdefault(task_group(q["category"]), []).append(q)
        chosen = [qs[i] for i in range(max((len(v) for v in by_group.values()), default=0))
                  for qs in by_group.values() if i < len(qs)]
    return chosen if n is None else chosen[:n]


# ---- multi-turn conversations -------------------------------------------------------------
def chat_messages(turns: list[str], answers: list[str]) -> list[dict]:
    """User turns interleaved with the answers so far, ending with the next user turn."""
    messages = []
    for i, turn in enumerate(turns[:len(answers) + 1]):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


@dataclass
class Turn:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    stats: dict[str, Any]


# generate(prompts) -> (one result {token_ids, text, stats} per prompt, wall seconds of the call)
Generate = Callable[[list[list[int]]], tuple[list[dict], float]]


def run_conversations(generate: Generate, render: Callable[[list[dict]], list[int]],
                      questions: list[dict]) -> tuple[list[list[Turn]], list[float]]:
    """Run every question's turns, turn j of all questions in one call (one batch).

    Turn j + 1's prompt holds this run's own answers to turns 1..j (as Spec-Bench does).
    Returns the turns of each question and the wall seconds of each round of turns.
    """
    answers: list[list[str]] = [[] for _ in questions]
    turns: list[list[Turn]] = [[] for _ in questions]
    seconds = []
    for j in range(max(len(q["turns"]) for q in questions)):
        active = [i for i, q in enumerate(questions) if len(q["turns"]) > j]
        prompts = [render(chat_messages(questions[i]["turns"], answers[i])) for i in active]
        results, secs = generate(prompts)
        assert len(results) == len(prompts)
        seconds.append(secs)
        for i, prompt, r in zip(active, prompts, results):
            turns[i].append(Turn(prompt, list(r["token_ids"]), r["text"], r.get("stats", {})))
            answers[i].append(r["text"].strip())
    return turns, seconds


# ---- runners: one per row ---------------------------------------------------------------
class SpecbuildRunner:
    """Greedy generation on a specbuild Engine with one speculation method (a batch per call)."""

    def __init__(self, engine, method: str, max_tokens: int, ignore_eos: bool = False, **spec_fields) -> None:
        from specbuild.sampling.params import SamplingParams
        from specbuild.speculation.config import SpeculationConfig

        default = dict(engine.meta.default_speculation or {})
        base = None  # the bundle's recorded settings apply to its own default method only
        if method != "none" and default.get("method") == method:
            base = SpeculationConfig(**{k: v for k, v in default.items() if k in SpeculationConfig.__dataclass_fields__})
        limit = engine.meta.limits.max_draft_len
        if method != "none" and not any(v is not None for v in spec_fields.values()):
            # the depth bound a served request naming only its method gets (the engine's default:
            # the bundle's max_draft_len unless the bundle names one), within the bundle's limit
            served = getattr(getattr(engine, "default_speculation", None), "gamma_max", None)
            base = base or SpeculationConfig(method=method)
            bound = served if served is not None else base.gamma_max
            base = SpeculationConfig.make(base, gamma_max=min(bound, limit))  # fit the bundle
        self.engine = engine
        self.speculation = SpeculationConfig.make(base, method=method, **spec_fields)
        self.sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0, ignore_eos=ignore_eos)

    def __call__(self, prompts: list[list[int]]) -> tuple[list[dict], float]:
        from specbuild.engine.sequence import Request

        t0 = time.perf_counter()
        handles = [self.engine.submit(Request(prompt_ids=p, sampling=self.sampling, speculation=self.speculation))
                   for p in prompts]
        if not self.engine.background:  # else the engine loop's thread runs them, as under `serve`
            self.engine.run_until_done()
        results = [h.result() for h in handles]
        return results, time.perf_counter() - t0


def drafter_state(runner) -> dict | None:
    """Snapshots of the learning drafters' state (token recycling's table) behind a
    specbuild row, or None for rows without any."""
    engine = getattr(runner, "engine", None)
    props = getattr(getattr(engine, "speculator", None), "proposers", {}) if engine is not None else {}
    snaps = {name: snap for name, p in props.items() if (snap := p.snapshot()) is not None}
    return snaps or None


def restore_drafter_state(runner, state: dict | None) -> None:
    """Put back `drafter_state`'s snapshots (None: cold start) so that each row and repeat
    sees what its own earlier questions taught it, never another row's or its own repeat's."""
    engine = getattr(runner, "engine", None)
    props = getattr(getattr(engine, "speculator", None), "proposers", {}) if engine is not None else {}
    for name, p in props.items():
        p.restore((state or {}).get(name))


def clear_prefix_cache(runner) -> None:
    """Start a row's run with an empty prefix cache (Engine.clear_prefix_cache): a row reuses
    the KV of its own conversations' earlier turns, as a served chat does, never another row's
    or its own earlier repeat's prompts."""
    clear = getattr(getattr(runner, "engine", None), "clear_prefix_cache", None)
    if clear is not None:
        clear()


class TransformersRunner:
    """transformers' `generate`, greedy, one prompt at a time (prompt lookup and assisted
    generation take batch 1). mode: plain | prompt_lookup | assisted."""

    def __init__(self, model, tokenizer, max_tokens: int, eos_ids: tuple[int, ...], mode: str = "plain",
                 assistant=None) -> None:
        self.model, self.tokenizer, self.mode = model, tokenizer, mode
        self.kwargs: dict[str, Any] = {"do_sample": False, "max_new_tokens": max_tokens, "num_beams": 1,
                                       "eos_token_id": list(eos_ids) or None,
                                       "pad_token_id": eos_ids[0] if eos_ids else 0}
        if mode == "prompt_lookup":
            self.kwargs["prompt_lookup_num_tokens"] = 10
        elif mode == "assisted":
            self.kwargs["assistant_model"] = assistant
        elif mode != "plain":
            raise ValueError(f"transformers mode {mode!r} is not one of plain, prompt_lookup, assisted")

    def __call__(self, prompts: list[list[int]]) -> tuple[list[dict], float]:
        import torch

        results, total = [], 0.0
        for p in prompts:
            ids = torch.tensor([p], device=self.model.device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **self.kwargs)
            new = out[0, len(p):].tolist()  # on the host: the timing includes the device's work
            total += time.perf_counter() - t0
            results.append({"token_ids": new, "text": self.tokenizer.decode(new, skip_special_tokens=True),
                            "stats": {"generated_tokens": len(new)}})
        return results, total


class LlamaCppRunner:
    """llama.cpp (llama-cpp-python) on the bundle's GGUF source as it is (its own quantized
    weights and kernels), greedy, one prompt at a time, from the same prompt ids. The KV
    cache is cleared before each prompt (no prefix reuse across turns or repeats, as for
    every other row). n_batch: llama.cpp's batched prompt evaluation when a probe in a
    child process survives it (its native build crashes there on some CPUs), else 1."""

    def __init__(self, gguf: str, threads: int, max_tokens: int, eos_ids: tuple[int, ...], n_ctx: int = 4096) -> None:
        import llama_cpp

        self.n_batch = 512 if llama_cpp_batch_ok(gguf, threads) else 1
        self.llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                   n_batch=self.n_batch, verbose=False)
        self.max_tokens, self.eos = max_tokens, set(eos_ids) | {self.llm.token_eos()}
        self.version = getattr(llama_cpp, "__version__", "")

    def __call__(self, prompts: list[list[int]]) -> tuple[list[dict], float]:
        results, total = [], 0.0
        for p in prompts:
            t0 = time.perf_counter()
            self.llm.reset()
            new: list[int] = []
            for tok in self.llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
                if tok in self.eos:
                    break
                new.append(int(tok))
                if len(new) >= self.max_tokens:
                    break
            total += time.perf_counter() - t0
            text = self.llm.detokenize(new).decode("utf-8", errors="replace")
            results.append({"token_ids": new, "text": text, "stats": {"generated_tokens": len(new)}})
        return results, total


def llama_cpp_batch_ok(gguf: str, threads: int) -> bool:
    """Whether llama.cpp evaluates a 64-token prompt in one batch without crashing, tried in
    a child process (a crash there must not take the benchmark down)."""
    import subprocess
    import sys

    code = ("import llama_cpp, sys; llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), "
            "n_batch=512, n_ctx=256, verbose=False); llm.eval(list(range(100, 164))); print('ok')")
    try:
        done = subprocess.run([sys.executable, "-c", code, gguf, str(threads)], capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0 and done.stdout.strip().endswith("ok")


def load_transformers_model(source: str, dtype):
    """The HF model for a bundle role's source: a HF directory or a GGUF file (dequantised)."""
    import transformers

    if not source or not os.path.exists(source):
        raise ValueError(f"peer rows need the bundle's source checkpoint, and {source!r} does not exist")
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}
    if not source.endswith(".gguf"):
        return transformers.AutoModelForCausalLM.from_pretrained(source, **kw).eval()
    # What from_pretrained(dir, gguf_file=name) runs (transformers' own GGUF reader and
    # dequantisation), without the `accelerate` package that from_pretrained demands for GGUF.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(os.path.dirname(source), gguf_file=os.path.basename(source))
    model = transformers.AutoModelForCausalLM.from_config(config, **kw)
    tensors = load_gguf_checkpoint(source, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if result.unexpected_keys or missing:
        raise ValueError(f"transformers' GGUF reader gave unexpected {result.unexpected_keys[:3]} / missing "
                         f"{sorted(missing)[:3]} tensors for {source!r}")
    model.tie_weights()
    return model.eval()


# ---- aggregation ------------------------------------------------------------------------
def divergence(baseline: list[int], other: list[int]) -> int | None:
    """First index where two token lists differ (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(baseline, other)):
        if a != b:
            return i
    return None if len(baseline) == len(other) else min(len(baseline), len(other))


def top2_gap(engine, ids: list[int]) -> float:
    """Gap between the two largest next-token logits after `ids`, under specbuild's model."""
    import torch

    from specbuild.model.decoder import reference_forward

    logits = reference_forward(engine.target_config, engine.model.w, torch.tensor(ids))[-1]  # [vocab]
    top = logits.topk(2).values
    return float(top[0] - top[1])


@dataclass
class RowRecord:
    """What one row measured: per chunk of questions, the turns (repeat 0) and the seconds of
    each round of turns in every repeat."""

    name: str
    engine: str  # specbuild | transformers
    method: str
    format: str
    batch_size: int
    chunks: list[dict] = field(default_factory=list)  # {group, questions, turns, seconds: [[per round]]}


def summarize(rows: list[RowRecord], gap_fn: Callable[[list[int]], float] | None = None) -> list[dict]:
    """Per group and overall: tokens/s (tokens / median seconds), speedup over the engine's
    plain row, mean accepted tokens, and greedy mismatches against 'specbuild none'."""
    by_name = {r.name: r for r in rows}
    reference = by_name.get("specbuild none")
    out = []
    for row in rows:
        acc: dict[str, dict[str, Any]] = {}
        details, per_chunk = [], []
        for ci, chunk in enumerate(row.chunks):
            secs = [statistics.median(rep[k] for rep in chunk["seconds"]) for k in range(len(chunk["seconds"][0]))]
            per_chunk.append({"group": chunk["group"], "question_ids": [q["question_id"] for q in chunk["questions"]],
                              "round_seconds": [round(x, 4) for x in secs],
                              "generated_tokens": [[len(t.token_ids) for t in ts] for ts in chunk["turns"]],
                              "mean_accepted_tokens": [[t.stats.get("mean_accepted_tokens") for t in ts]
                                                       for ts in chunk["turns"]]})
            for g in (chunk["group"], "overall"):
                a = acc.setdefault(g, {"questions": 0, "turns": 0, "generated_tokens": 0, "seconds": 0.0,
                                       "drafted": 0, "accepted": 0, "decode_tokens": 0.0, "decode_passes": 0.0,
                                       "compared": 0, "mismatches": 0})
                a["questions"] += len(chunk["questions"])
                a["seconds"] += sum(secs)
            for qi, (q, turns) in enumerate(zip(chunk["questions"], chunk["turns"])):
                ref_turns = reference.chunks[ci]["turns"][qi] if reference is not None else None
                for j, t in enumerate(turns):
                    st, n = t.stats, len(t.token_ids)
                    mat = float(st.get("mean_accepted_tokens") or 1.0)
                    decode = max(n - 1, 0)  # the first token comes from prefill
                    for g in (chunk["group"], "overall"):
                        a = acc[g]
                        a["turns"] += 1
                        a["generated_tokens"] += n
                        a["drafted"] += int(st.get("drafted", 0))
                        a["accepted"] += int(st.get("accepted", 0))
                        a["decode_tokens"] += decode
                        a["decode_passes"] += decode / mat
                    if ref_turns is not None and ref_turns[j].prompt_ids == t.prompt_ids:
                        pos = divergence(ref_turns[j].token_ids, t.token_ids)
                        for g in (chunk["group"], "overall"):
                            acc[g]["compared"] += 1
                            acc[g]["mismatches"] += pos is not None
                        if pos is not None:
                            d = {"question_id": q["question_id"], "turn": j + 1, "position": pos}
                            if gap_fn is not None:
                                d["top2_logit_gap"] = round(gap_fn(t.prompt_ids + ref_turns[j].token_ids[:pos]), 6)
                            details.append(d)
        stats = {}
        for g, a in acc.items():
            tps = a["generated_tokens"] / a["seconds"] if a["seconds"] > 0 else 0.0
            stats[g] = {"questions": a["questions"], "turns": a["turns"], "generated_tokens": a["generated_tokens"],
                        "seconds": round(a["seconds"], 4), "tokens_per_s": round(tps, 3),
                        "mean_accepted_tokens": round(a["decode_tokens"] / a["decode_passes"], 3)
                        if row.engine == "specbuild" and a["decode_passes"] else None,
                        "drafted": a["drafted"] if row.engine == "specbuild" else None,
                        "accepted": a["accepted"] if row.engine == "specbuild" else None,
                        "compared": a["compared"], "mismatches": a["mismatches"]}
        out.append({"name": row.name, "engine": row.engine, "method": row.method, "format": row.format,
                    "batch_size": row.batch_size, "groups": stats, "mismatch_details": details, "chunks": per_chunk})
    for r in out:  # speedups against the same engine's plain row, group by group
        base = next((b for b in out if b["name"] == BASELINES[r["engine"]]), None)
        for g, s in r["groups"].items():
            bt = base["groups"].get(g, {}).get("tokens_per_s") if base else None
            s["speedup"] = round(s["tokens_per_s"] / bt, 3) if bt else None
    return out


def peer_ratios(rows: list[dict]) -> dict[str, float]:
    """specbuild tokens/s over transformers' for the matching method, and over llama.cpp's
    plain decoding (plain and the best specbuild row), overall."""
    by = {r["name"]: r["groups"].get("overall", {}).get("tokens_per_s") for r in rows}
    pairs = {"none/plain": ("specbuild none", "transformers plain"),
             "ngram/prompt_lookup": ("specbuild ngram", "transformers prompt_lookup"),
             "draft/assisted": ("specbuild draft", "transformers assisted")}
    out = {k: round(by[a] / by[b], 3) for k, (a, b) in pairs.items() if by.get(a) and by.get(b)}
    if by.get("llama.cpp plain"):
        if by.get("specbuild none"):
            out["none/llama.cpp"] = round(by["specbuild none"] / by["llama.cpp plain"], 3)
        best = max((r for r in rows if r["engine"] == "specbuild" and r["groups"].get("overall", {}).get("tokens_per_s")),
                   key=lambda r: r["groups"]["overall"]["tokens_per_s"], default=None)
        if best is not None:
            out[f"best ({best['name']})/llama.cpp"] = round(best["groups"]["overall"]["tokens_per_s"]
                                                           / by["llama.cpp plain"], 3)
    return out


# ---- the table ---------------------------------------------------------------------------
def _grid(title: str, rows: list[dict], cols: list[str], cell: Callable[[dict, str], str]) -> list[str]:
    header = [title, "format", "batch"] + cols
    body = [[r["name"], r["format"], str(r["batch_size"])] + [cell(r, c) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    fmt = lambda line: "  ".join(s.ljust(w) if i == 0 else s.rjust(w) for i, (s, w) in enumerate(zip(line, widths)))
    return [fmt(header)] + [fmt(line) for line in body]


def _num(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(report: dict) -> str:
    """The plain-text Spec-Bench table of a report made by the bench command."""
    rows, env, cfg = report["rows"], report["env"], report["config"]
    cols = [g for g in GROUPS if any(g in r["groups"] for r in rows)]
    cols += sorted({g for r in rows for g in r["groups"]} - set(cols) - {"overall"}) + ["overall"]
    get = lambda r, c, k: r["groups"].get(c, {}).get(k)
    lines = [f"specbuild bench {report['bundle']}  target {report['target_format']}",
             f"Spec-Bench {cfg['split']} split: {report['questions']} questions ({cfg['per_category'] or 'all'} per "
             f"group), greedy, max {cfg['max_tokens']} new tokens, median of {cfg['repeats']} repeat(s), "
             f"{env['threads']} threads",
             f"torch {env['torch']}, transformers {env.get('transformers') or '-'}, CPU {env['cpu']} "
             f"({env['cpu_count']} logical)", ""]
    lines += _grid("tokens/s", rows, cols, lambda r, c: _num(get(r, c, "tokens_per_s"), ".1f")) + [""]
    lines += _grid("speedup (vs same engine's plain)", rows, cols, lambda r, c: _num(get(r, c, "speedup"), ".2f", "x"))
    lines += [""] + _grid("mean accepted tokens", rows, cols,
                          lambda r, c: _num(get(r, c, "mean_accepted_tokens"), ".2f")) + [""]
    lines += _grid("greedy mismatches vs specbuild none", rows, cols,
                   lambda r, c: "-" if get(r, c, "compared") is None else f"{get(r, c, 'mismatches')}/{get(r, c, 'compared')}")
    for r in rows:
        for d in r["mismatch_details"][:5]:
            gap = d.get("top2_logit_gap")
            lines.append(f"  {r['name']}: question {d['question_id']} turn {d['turn']} diverges at token "
                         f"{d['position']}" + ("" if gap is None else f" (top-2 logit gap there {gap:.2e})"))
    if report.get("peer_ratios"):
        lines += ["", "specbuild / peer tokens/s (overall): " +
                  ", ".join(f"{k} {v:.2f}x" for k, v in report["peer_ratios"].items())]
    fl = report.get("floor")
    if fl:
        lines += ["", f"decode step vs memory-bandwidth floor ({fl['dtype']}, plain, batch 1, median of {fl['samples']}):",
                  f"  weights read per step {fl['weight_bytes'] / 1e6:.1f} MB; copy bandwidth {fl['copy_gb_per_s']:.2f} GB/s "
                  f"(copy of {fl['copy_bytes'] >> 20} MiB, read + write counted)",
                  f"  floor {fl['floor_ms']:.2f} ms/token; measured {fl['step_ms']:.2f} ms/token; ratio {fl['ratio']:.2f}x"]
    vc = report.get("verify_costs")
    if vc:
        lines += ["", f"verify cost by width (one target forward after {vc['context']} cached tokens, best wall time):"]
        lines += [f"  {v['name']:18s} {v['nodes']:3d} drafts  width {v['width']:3d}  {v['min_ms']:8.2f} ms  "
                  f"{v['x_step']:5.2f}x the decode step" for v in vc["shapes"]]
    lines += [f"note: {n}" for n in report.get("notes", [])]
    lines.append(f"command: {env['command']}")
    return "\n".join(lines)
