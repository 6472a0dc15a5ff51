"""The EAGLE training corpus: prompts from three sources, answered by the target itself.

`build_corpus(bundle, out_dir, cfg)` (scripts/build_eagle_corpus.py) writes, into `out_dir`:

- `prompts.jsonl` -- {"id", "source", "text"}, deduplicated (case and whitespace folded), from
  1. `spec_bench`: the packaged Spec-Bench **train** split (first turns; the eval split never
     enters: every prompt of every source whose folded text equals or contains an eval-split
     turn is dropped, and the count is in the manifest);
  2. `self_instruct`: tasks the target writes itself from seed instructions (questions,
     rewrites, summaries, code, math over a fixed topic list), sampled at T = 1.0, kept when
     they have 16..800 characters;
  3. `local`: text and code already on the machine (documentation and sources of the
     installed packages under `local_roots`, by default the interpreter's site-packages):
     a bounded excerpt (`excerpt_chars`) of a bounded number of files, each read only up to
     64 KB, wrapped in an "explain" / "summarise" / "continue" / "fix" instruction.
- `heldout.jsonl` + `answers_heldout.jsonl` -- a fixed held-out set: the first
  `heldout_prompts` Spec-Bench train-split prompts in train-eagle's seeded order (the same
  prompts train-eagle holds out from the packaged data), answered greedily; never trained on.
- `answers.jsonl` -- {"id", "prompt_id", "source", "temperature", "prompt_ids",
  "answer_ids"}: the target's answers to every training prompt, once per temperature in
  `temperatures` (0 = greedy), appended as they finish. A rerun skips every id already
  there, so a stopped build (--time-limit, Ctrl-C, a crash) continues where it stopped.
- `manifest.json` -- the sources with their prompt, answer and position counts, the files'
  sizes, what was dropped (duplicates, eval-split overlap, too long) and whether the build
  is complete.

Answers are generated through the Engine's public API (submit / step / Handle), `batch`
requests in flight at once (continuous batching), with a progress bar and its ETA. Use the
fastest lossless format the machine has (on CPU: the int4 bundle, `--compile`); the answers
are then the int4 target's -- the same weights as the float32 bundle compiled from the same
GGUF, so they are that model's answers up to float rounding.

Written by hand: no library builds self-distillation corpora against this engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass

import torch

from specbuild.errors import SpecbuildError

PROMPTS, HELDOUT, ANSWERS, HELDOUT_ANSWERS, MANIFEST = (
    "prompts.jsonl", "heldout.jsonl", "answers.jsonl", "answers_heldout.jsonl", "manifest.json")
SELF_INSTRUCT = "self_instruct.jsonl"
SELF_INSTRUCT_TOKENS = 160  # most tokens of a task the target writes
SOURCES = ("spec_bench", "self_instruct", "local")
LOCAL_SUFFIXES = {".py": "code", ".md": "text", ".rst": "text", ".txt": "text"}
MAX_FILE_BYTES = 1 << 20  # larger files are skipped
READ_BYTES = 1 << 16  # of a file, at most this much is read

TOPICS = ("photosynthesis", "the French Revolution", "black holes", "compound interest", "the water cycle",
          "machine learning", "the Roman Empire", "vaccines", "climate change", "chess openings",
          "the human heart", "volcanoes", "electric cars", "jazz music", "the stock market", "honeybees",
          "the printing press", "renewable energy", "sleep", "the Moon landing", "sorting algorithms",
          "prime numbers", "a small bakery", "job interviews", "healthy breakfasts", "the Amazon rainforest",
          "ancient Egypt", "recycling", "public libraries", "friendship", "earthquakes", "the internet",
          "coffee", "marathon training", "a city park", "plate tectonics", "budget travel", "DNA",
          "the Olympic Games", "remote work")
SEED_TASKS = {  # kind: (what the target is asked to write, the instruction appended to what it wrote)
    "question": ("Write one question that a curious student might ask about {topic}. Reply with the question only.",
                 ""),
    "rewrite": ("Write a short paragraph about {topic}. Reply with the paragraph only.",
                "\n\nRewrite the text above in a more formal style."),
    "summary": ("Write a paragraph of four sentences about {topic}. Reply with the paragraph only.",
                "\n\nSummarize the text above in one sentence."),
    "code": ("Write one short programming task in Python related to {topic} (a function to implement). Reply with "
             "the task only.", ""),
    "math": ("Write one arithmetic word problem about {topic} with numbers in it. Reply with the problem only.", ""),
}
LOCAL_TASKS = {
    "code": ("Explain what this Python code does:\n\n```python\n{x}\n```",
             "Summarise the purpose of this Python code in a few sentences:\n\n```python\n{x}\n```",
             "Continue this Python code:\n\n```python\n{x}\n```",
             "Find and fix any bugs in this Python code, or explain why it is correct:\n\n```python\n{x}\n```"),
    "text": ("Explain the following documentation in simple words:\n\n{x}",
             "Summarise the following text:\n\n{x}",
             "Continue the following text:\n\n{x}",
             "Fix the grammar and spelling of the following text:\n\n{x}"),
}


@dataclass(frozen=True)
class CorpusConfig:
    """What build_corpus makes; sizes in prompts, characters, tokens, minutes."""

    spec_bench: bool = True
    self_instruct: int = 400  # tasks requested from the target (before dedup)
    local_files: int = 400  # files excerpted (before dedup)
    local_roots: tuple[str, ...] = ()  # () = the interpreter's site-packages
    excerpt_chars: int = 1200
    heldout_prompts: int = 12
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)
    max_prompt_tokens: int = 512
    max_answer_tokens: int = 192
    limit: int | None = None  # training prompts answered (None: all)
    time_limit: float | None = None  # minutes; stop (resumable) after this long
    batch: int = 8
    seed: int = 0
    ignore_eos: bool = False  # answers run to max_answer_tokens (tests with tiny random models)
    data: str | None = None  # Spec-Bench-style jsonl instead of the packaged Spec-Bench

    def __post_init__(self) -> None:
        for name, value, lo, hi in (("self-instruct", self.self_instruct, 0, 1 << 20),
                                    ("local-files", self.local_files, 0, 1 << 20),
                                    ("excerpt-chars", self.excerpt_chars, 64, 1 << 16),
                                    ("heldout-prompts", self.heldout_prompts, 0, 4096),
                                    ("max-prompt-tokens", self.max_prompt_tokens, 8, 1 << 16),
                                    ("max-answer-tokens", self.max_answer_tokens, 2, 1 << 16),
                                    ("batch", self.batch, 1, 4096)):
            if not isinstance(value, int) or not lo <= value <= hi:
                raise SpecbuildError(f"--{name} {value!r} is out of range [{lo}, {hi}]")
        if not self.temperatures or any(not 0.0 <= t <= 2.0 for t in self.temperatures):
            raise SpecbuildError(f"--temperatures {self.temperatures!r}: each must be in [0, 2], at least one")
        if self.limit is not None and not (isinstance(self.limit, int) and self.limit >= 1):
            raise SpecbuildError(f"--limit {self.limit!r} must be a positive integer")
        if self.time_limit is not None and not self.time_limit > 0:
            raise SpecbuildError(f"--time-limit {self.time_limit!r} must be > 0 minutes")


def fold(text: str) -> str:
    """The dedup key's text: lower case, whitespace runs collapsed."""
    return " ".join(text.lower().split())


def prompt_id(source: str, text: str) -> str:
    return f"{source}:{hashlib.sha1(fold(text).encode()).hexdigest()[:16]}"


def stable_seed(key: str) -> int:
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:4], "little")


# ---- sources ------------------------------------------------------------------------------------
def spec_bench_split(cfg: CorpusConfig) -> tuple[list[dict], list[dict], list[str]]:
    """(train records in train-eagle's seeded order, eval records, every eval-split turn)."""
    from specbuild.train import medusa as mt

    records = mt.load_records(cfg.data)
    train, evals, _ = mt.split_records(records, mt.MedusaTrainConfig(seed=cfg.seed))
    eval_ids = {str(r["id"]) for r in evals}
    turns = [r["text"] for r in evals]
    path = cfg.data
    if path is None:
        from importlib import resources

        path = str(resources.files("specbuild").joinpath(mt.QUESTIONS_RESOURCE))
    with open(path, encoding="utf-8") as f:  # later turns of eval questions are eval text too
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if str(rec.get("question_id")) in eval_ids:
                    turns += [t for t in rec.get("turns", []) if isinstance(t, str)]
    return train, evals, turns


def local_files(roots: tuple[str, ...], count: int, seed: int) -> list[str]:
    """`count` files (a seeded sample, reproducible) with LOCAL_SUFFIXES under `roots`,
    at most MAX_FILE_BYTES each; this corpus's own output is never among them."""
    if count == 0:
        return []
    roots = roots or (sysconfig.get_paths()["purelib"],)
    found = []
    for root in roots:
        if not os.path.isdir(root):
            raise SpecbuildError(f"--local-root {root!r} is not a directory")
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            for name in sorted(filenames):
                if os.path.splitext(name)[1] in LOCAL_SUFFIXES:
                    path = os.path.join(dirpath, name)
                    try:
                        if 0 < os.path.getsize(path) <= MAX_FILE_BYTES:
                            found.append(path)
                    except OSError:
                        continue
    order = torch.randperm(len(found), generator=torch.Generator().manual_seed(seed)).tolist()
    return [found[i] for i in order[:count]]


def excerpt(path: str, chars: int, seed: int) -> str | None:
    """Whole lines of `path` (from a seeded line, at most `chars` characters, at least a
    quarter of that), or None when the file is not mostly printable text."""
    try:
        with open(path, "rb") as f:
            raw = f.read(READ_BYTES)
    except OSError:
        return None
    text = raw.decode("utf-8", errors="ignore")
    if not text or sum(c.isprintable() or c in "\n\t" for c in text) < 0.97 * len(text):
        return None
    lines = text.splitlines()
    if not lines:
        return None
    start = stable_seed(f"{path}:{seed}") % max(1, len(lines) - 4) if len(lines) > 8 else 0
    out, n = [], 0
    for line in lines[start:]:
        if n + len(line) + 1 > chars:
            break
        out.append(line)
        n += len(line) + 1
    body = "\n".join(out).strip()
    return body if len(body) >= min(chars // 4, 200) else None


def local_prompts(cfg: CorpusConfig) -> list[dict]:
    out = []
    for path in local_files(cfg.local_roots, cfg.local_files, cfg.seed):
        body = excerpt(path, cfg.excerpt_chars, cfg.seed)
        if body is None:
            continue
        tasks = LOCAL_TASKS[LOCAL_SUFFIXES[os.path.splitext(path)[1]]]
        # the instruction follows from the excerpt, so the same text in two files dedups
        out.append({"source": "local", "text": tasks[stable_seed(body) % len(tasks)].format(x=body), "origin": path})
    return out


def self_instruct_jobs(cfg: CorpusConfig) -> list[dict]:
    """The requests that make the target write tasks: seed instruction x topic, round robin."""
    kinds = list(SEED_TASKS)
    jobs = []
    for i in range(cfg.self_instruct):
        kind, topic = kinds[i % len(kinds)], TOPICS[(i // len(kinds)) % len(TOPICS)]
        jobs.append({"id": f"si{i}", "text": SEED_TASKS[kind][0].format(topic=topic), "temperature": 1.0,
                     "kind": kind, "max_tokens": min(SELF_INSTRUCT_TOKENS, cfg.max_answer_tokens)})
    return jobs


def clean_task(record: dict) -> str | None:
    """The task the target wrote (16..800 characters), with its kind's instruction appended."""
    text = record.get("answer_text", "").strip().strip('"').strip()
    if not 16 <= len(text) <= 800:
        return None
    return text + SEED_TASKS.get(record.get("kind"), ("", ""))[1]


# ---- generation -----------------------------------------------------------------------------------
def read_jsonl(path: str) -> list[dict]:
    """The records of `path`; a torn last line (a killed run) is dropped."""
    if not os.path.isfile(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break
    return out


def repair_jsonl(path: str) -> None:
    """Cut a torn last line (a killed run) so appends start on a fresh line."""
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        with open(path, "wb") as f:
            f.write(data[:data.rfind(b"\n") + 1])


class Deadline:
    def __init__(self, minutes: float | None) -> None:
        self.end = None if minutes is None else time.monotonic() + 60 * minutes

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


def generate_jobs(engine, jobs: list[dict], path: str, cfg: CorpusConfig, deadline: Deadline, progress: bool,
                  desc: str, gen: "HFGenerator | None" = None) -> bool:
    """Answer every job {"id", "prompt_ids", "temperature", ...} not yet in `path` (jsonl);
    each finished answer is appended at once. Returns True when all are done, False when the
    deadline stopped it (a rerun redoes what was in flight). The engine keeps `cfg.batch`
    requests in flight (aborted at the deadline); with `gen` (HFGenerator) the jobs go as
    padded batches of `cfg.batch`, grouped by temperature and answer length and sorted by
    prompt length."""
    from tqdm import tqdm

    repair_jsonl(path)
    done = {str(r["id"]) for r in read_jsonl(path)}
    todo = [j for j in jobs if str(j["id"]) not in done]
    if not todo:
        return True
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc=desc, unit="answer", disable=not progress,
               smoothing=0.05)
    with open(path, "a", encoding="utf-8") as out:

        def write(job: dict, answer_ids: list[int], text: str) -> None:
            out.write(json.dumps({**{k: v for k, v in job.items() if k != "text"}, "answer_ids": answer_ids,
                                  "answer_text": text}) + "\n")
            out.flush()
            bar.update(1)

        finished = (_answer_hf if gen is not None else _answer_engine)(engine, gen, todo, cfg, deadline, write)
    bar.close()
    return finished


def _answer_engine(engine, gen, todo: list[dict], cfg: CorpusConfig, deadline: Deadline, write) -> bool:
    from specbuild.engine.sequence import Request
    from specbuild.sampling.params import SamplingParams

    width = min(cfg.batch, engine.max_batch_size)
    queue, flying = list(reversed(todo)), []
    while queue or flying:
        if deadline.passed():
            for _, h in flying:
                engine.abort(h)
            return False
        while queue and len(flying) < width:
            job = queue.pop()
            sampling = SamplingParams(max_tokens=job.get("max_tokens", cfg.max_answer_tokens),
                                      temperature=job["temperature"],
                                      seed=stable_seed(f"{job['id']}:{cfg.seed}"), ignore_eos=cfg.ignore_eos)
            flying.append((job, engine.submit(Request(prompt_ids=job["prompt_ids"], sampling=sampling))))
        engine.step()
        for item in [f for f in flying if f[1].done.is_set()]:
            flying.remove(item)
            job, h = item
            res = h.result()
            if res.get("error"):
                raise SpecbuildError(f"the target failed on {job['id']}: {res['error']}")
            write(job, res["token_ids"], res["text"])
    return True


def _answer_hf(engine, gen: "HFGenerator", todo: list[dict], cfg: CorpusConfig, deadline: Deadline, write) -> bool:
    groups: dict[tuple[float, int], list[dict]] = {}
    for j in todo:
        groups.setdefault((j["temperature"], j.get("max_tokens", cfg.max_answer_tokens)), []).append(j)
    for (temp, max_tokens), group in groups.items():
        group.sort(key=lambda j: len(j["prompt_ids"]))
        for k in range(0, len(group), cfg.batch):
            if deadline.passed():
                return False
            batch = group[k:k + cfg.batch]
            answers = gen.answer(batch, engine.eos_ids, max_tokens, temp, stable_seed(f"{batch[0]['id']}:{cfg.seed}"))
            for job, ans in zip(batch, answers):
                write(job, ans, engine.tokenizer.decode([t for t in ans if t not in engine.eos_ids]))
    return True


class HFGenerator:
    """Bulk answers from Hugging Face transformers' `generate` over the same weights (`source`:
    the GGUF, preset or directory the bundle was compiled from), for a GPU: the engine's CUDA
    step costs 36 ms at batch 1 and ~140 ms at batch 8 on an H200 (per-sequence work and device
    syncs; docs/gpu-check.md), so at batch 256 it wrote 153 short tasks in 3 minutes, while
    `generate` runs a padded batch as a few kernels per layer. A well-kept library does this
    job, so none is written here. Sampling is plain (temperature only: top-k and top-p off),
    the distribution the target's answers are drawn from; each batch is seeded from its first
    job's id. Answers end at (and include) the first EOS token, as the engine's do. In float32
    its greedy answers equal the float32 engine's token for token (tests/train/test_eagle_scale.py)."""

    def __init__(self, source: str, device: str, dtype: str = "float32", log=print) -> None:
        import tempfile

        from transformers import AutoModelForCausalLM

        from specbuild.formats.checkpoints import read_checkpoint
        from specbuild.formats.hf_export import write_hf_dir

        with tempfile.TemporaryDirectory() as tmp:
            write_hf_dir(read_checkpoint(source), tmp, dtype)
            self.model = AutoModelForCausalLM.from_pretrained(tmp, dtype=getattr(torch, dtype)).to(device).eval()
        self.device = device
        log(f"generator: transformers generate over {source} ({dtype}, {device})")

    @torch.inference_mode()
    def answer(self, jobs: list[dict], eos_ids: tuple[int, ...], max_tokens: int, temperature: float,
               seed: int) -> list[list[int]]:
        """One padded batch (left padding); returns each job's answer ids."""
        width = max(len(j["prompt_ids"]) for j in jobs)
        pad = eos_ids[0] if eos_ids else 0
        ids = torch.full((len(jobs), width), pad, dtype=torch.int64)
        att = torch.zeros((len(jobs), width), dtype=torch.int64)
        for i, j in enumerate(jobs):
            n = len(j["prompt_ids"])
            ids[i, width - n:] = torch.tensor(j["prompt_ids"])
            att[i, width - n:] = 1
        torch.manual_seed(seed)
        sample = temperature > 0
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                                  max_new_tokens=max_tokens, do_sample=sample,
                                  temperature=temperature if sample else None, top_k=0 if sample else None,
                                  top_p=1.0 if sample else None, eos_token_id=list(eos_ids) or None,
                                  pad_token_id=pad)
        answers = []
        for row in out[:, width:].tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in eos_ids), len(row))
            answers.append(row[:cut])
        return answers


# ---- the command -------------------------------------------------------------------------------------
def build_corpus(bundle_dir: str, out_dir: str, cfg: CorpusConfig = CorpusConfig(), *, compile: bool = False,
                 threads: int | None = None, progress: bool = True, log=print, device: str = "cpu",
                 prefill_chunk: int = 256, hf_source: str | None = None) -> dict:
    """Build or continue the corpus in `out_dir` (module docstring); returns the manifest.
    `device` and `prefill_chunk` (prompt tokens prefilled per engine step) go to the Engine. On a
    GPU the engine's step is overhead-bound (docs/gpu-check.md), so there pass `hf_source` (the
    model the bundle was compiled from): the answers then come from HFGenerator on `device`
    (float32: measured equal to the float32 engine's greedy answers token for token), and the
    engine serves the chat template and the tokenizer only (docs/eagle-training.md, section 6)."""
    from specbuild.engine.engine import Engine, EngineConfig

    t0 = time.perf_counter()
    deadline = Deadline(cfg.time_limit)
    os.makedirs(out_dir, exist_ok=True)
    engine = Engine(bundle_dir, EngineConfig(compile=compile, threads=threads, device=device,
                                             prefill_chunk=prefill_chunk))
    gen = HFGenerator(hf_source, device, log=log) if hf_source is not None else None
    if cfg.batch > engine.max_batch_size and hf_source is None:
        log(f"--batch {cfg.batch} is above the bundle's max batch size {engine.max_batch_size}: "
            f"{engine.max_batch_size} requests in flight (compile with --max-batch-size {cfg.batch} for more)")

    def chat_ids(text: str) -> list[int]:
        return engine.encode(engine.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)

    train, _, eval_turns = spec_bench_split(cfg)
    eval_keys = [fold(t) for t in eval_turns if t.strip()]
    eval_set = set(eval_keys)
    heldout = [{"source": "spec_bench_heldout", "text": r["text"], "qid": str(r["id"])}
               for r in train[:cfg.heldout_prompts]]
    sb = [{"source": "spec_bench", "text": r["text"], "qid": str(r["id"])} for r in train[cfg.heldout_prompts:]]

    # self-instruct: the target writes tasks (resumable like the answers)
    si_path = os.path.join(out_dir, SELF_INSTRUCT)
    si_jobs = [{**j, "prompt_ids": chat_ids(j["text"])} for j in self_instruct_jobs(cfg)]
    if not generate_jobs(engine, si_jobs, si_path, cfg, deadline, progress, "self-instruct tasks", gen):
        log(f"--time-limit {cfg.time_limit} reached while the target wrote tasks; run again to continue")
        return write_manifest(out_dir, bundle_dir, cfg, [], [], {}, False, compile, time.perf_counter() - t0)
    written = sorted(read_jsonl(si_path), key=lambda r: int(str(r["id"])[2:]))
    si = [{"source": "self_instruct", "text": t} for t in map(clean_task, written) if t]

    # round robin over the sources, so that --limit takes some of each
    lists = [lst for lst in ((sb if cfg.spec_bench else []), si, local_prompts(cfg)) if lst]
    candidates = [lst[i] for i in range(max(map(len, lists), default=0)) for lst in lists if i < len(lst)]
    dropped = {"duplicate": 0, "eval_split": 0, "too_long": 0}
    seen = {fold(h["text"]) for h in heldout}
    prompts = []
    for c in candidates:
        key = fold(c["text"])
        if key in eval_set or any(e in key for e in eval_keys if len(e) >= 24):
            dropped["eval_split"] += 1
            continue
        if key in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(key)
        ids = chat_ids(c["text"])
        if len(ids) > cfg.max_prompt_tokens or len(ids) + cfg.max_answer_tokens > engine.max_seq_len:
            dropped["too_long"] += 1
            continue
        prompts.append({"id": prompt_id(c["source"], c["text"]), **c, "prompt_ids": ids})
    if cfg.limit is not None:
        prompts = prompts[:cfg.limit]
    held = []
    for h in heldout:  # the same length rule as the training prompts (and train-eagle's held-out set)
        ids = chat_ids(h["text"])
        if len(ids) <= cfg.max_prompt_tokens and len(ids) + cfg.max_answer_tokens <= engine.max_seq_len:
            held.append({"id": prompt_id(h["source"], h["text"]), **h, "prompt_ids": ids})
    for name, rows in ((PROMPTS, prompts), (HELDOUT, held)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            for p in rows:
                f.write(json.dumps({k: v for k, v in p.items() if k != "prompt_ids"}) + "\n")

    def jobs_of(rows, temps):
        return [{"id": f"{p['id']}@{t:g}", "prompt_id": p["id"], "source": p["source"], "temperature": t,
                 "prompt_ids": p["prompt_ids"]} for p in rows for t in temps]

    complete = generate_jobs(engine, jobs_of(held, (0.0,)), os.path.join(out_dir, HELDOUT_ANSWERS), cfg,
                             deadline, progress, "held-out answers", gen)
    if complete:
        complete = generate_jobs(engine, jobs_of(prompts, cfg.temperatures), os.path.join(out_dir, ANSWERS), cfg,
                                 deadline, progress, "target answers", gen)
    if not complete:
        log(f"--time-limit {cfg.time_limit} reached; run again to continue")
    return write_manifest(out_dir, bundle_dir, cfg, prompts, held, dropped, complete, compile,
                          time.perf_counter() - t0)


def write_manifest(out_dir: str, bundle_dir: str, cfg: CorpusConfig, prompts: list[dict], held: list[dict],
                   dropped: dict, complete: bool, compile: bool, seconds: float) -> dict:
    answers = read_jsonl(os.path.join(out_dir, ANSWERS))
    held_answers = read_jsonl(os.path.join(out_dir, HELDOUT_ANSWERS))
    sources = {}
    for s in SOURCES:
        mine = [p for p in prompts if p["source"] == s]
        ans = [a for a in answers if a["source"] == s]
        sources[s] = {"prompts": len(mine), "prompt_tokens": sum(len(p["prompt_ids"]) for p in mine),
                      "answers": len(ans), "answer_tokens": sum(len(a["answer_ids"]) for a in ans),
                      "positions": sum(len(a["prompt_ids"]) + len(a["answer_ids"]) for a in ans)}
    by_temp = {}
    for a in answers:
        key = f"{a['temperature']:g}"
        by_temp[key] = by_temp.get(key, 0) + 1
    files = {n: os.path.getsize(os.path.join(out_dir, n)) for n in sorted(os.listdir(out_dir))
             if os.path.isfile(os.path.join(out_dir, n)) and n != MANIFEST}
    manifest = {"bundle": os.path.abspath(bundle_dir), "complete": complete, "compile": compile,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": sys.version.split()[0],
                "config": asdict(cfg), "sources": sources,
                "answers_by_temperature": by_temp, "dropped": dropped,
                "heldout": {"prompts": len(held), "answers": len(held_answers),
                            "positions": sum(len(a["prompt_ids"]) + len(a["answer_ids"]) for a in held_answers)},
                "totals": {"prompts": len(prompts), "answers": len(answers),
                           "positions": sum(v["positions"] for v in sources.values())},
                "files": files, "seconds": round(seconds, 1)}
    tmp = os.path.join(out_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, MANIFEST))
    return manifest


def load_corpus(out_dir: str, vocab: int) -> tuple[list[dict], list[dict]]:
    """(training sequences, held-out sequences) of a built corpus, as train-eagle takes them
    ({"id", "prompt_ids", "answer_ids"}); refuses a held-out prompt among the training ones."""
    if not os.path.isfile(os.path.join(out_dir, MANIFEST)):
        raise SpecbuildError(f"--corpus {out_dir!r} has no {MANIFEST} (build it with scripts/build_eagle_corpus.py)")
    train = read_jsonl(os.path.join(out_dir, ANSWERS))
    held = read_jsonl(os.path.join(out_dir, HELDOUT_ANSWERS))
    held_ids = {a["prompt_id"] for a in held}
    for a in train + held:
        if any(not 0 <= t < vocab for t in a["prompt_ids"] + a["answer_ids"]):
            raise SpecbuildError(f"--corpus {out_dir!r}: {a['id']} has a token outside the target's vocabulary "
                                 f"[0, {vocab}) (built with another model?)")
    leak = [a["id"] for a in train if a["prompt_id"] in held_ids]
    if leak:
        raise SpecbuildError(f"--corpus {out_dir!r}: held-out prompt {leak[0]} is among the training answers")

    def seq(a):
        return {"id": a["id"], "prompt_ids": a["prompt_ids"], "answer_ids": a["answer_ids"]}
    return [seq(a) for a in train if len(a["answer_ids"]) >= 2], [seq(a) for a in held if len(a["answer_ids"]) >= 2]
