"""`specbuild train-medusa`: Medusa heads trained on the target's own outputs (Medusa-1).

1. Self-distillation: the bundle's target answers each prompt (chat template, greedy by
   default) through the Engine, batched; answers go to `<out>/answers_<split>.jsonl` as
   they finish (a resumed run skips those written).
2. One forward of the target over prompt + answer per sequence collects the final-normed
   hidden states (the lm_head's input) of the rows t = P-1 .. T-2 (P prompt tokens, T in
   all): `<out>/hidden_<split>.safetensors`. Only these rows are ever used at run time.
3. The heads train on these frozen hidden states: the row at position t feeds head k,
   whose target is token t + 2 + k (FasterDecoding's convention; see
   speculation/proposers/medusa.py), only where that token is part of the answer. Loss =
   sum_k 0.8^k * CE_k (hard labels: the target's tokens) or KL to the target's own
   distribution at t + 1 + k (soft labels, computed on the fly from the cached hidden
   states through the frozen lm_head). AdamW, warmup + cosine; the frozen lm_head matmul
   runs in bfloat16 only where that measures faster (it is 3x slower on CPUs without
   native bf16). Residual weights start at zero, so every head starts as the target's
   lm_head.
4. Checkpoints (`<out>/checkpoint.pt`) every few minutes and at the end; `--resume`
   continues from the answers, the hidden cache and the checkpoint.

Output (`<out>`): `medusa_lm_head.safetensors` in FasterDecoding names (no lm_head tensors
when `shared_lm_head`), `config.json` (medusa_num_heads, medusa_num_layers, hidden_size,
vocab_size, shared_lm_head), `report.json` (head-wise top-1 / top-5 accuracy on the eval
prompts before and after training, timings).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from specbuild.errors import SpecbuildError
from specbuild.compiler.medusa_role import FD_FILE

IGNORE = -100
SPLIT_RESOURCE = "data/spec_bench/split.json"
QUESTIONS_RESOURCE = "data/spec_bench/question.jsonl"


@dataclass(frozen=True)
class MedusaTrainConfig:
    """Settings of one train-medusa run; sizes in prompts, tokens, positions, minutes."""

    num_heads: int = 4
    num_layers: int = 1
    steps: int | None = None  # None: `epochs` passes over the training positions
    epochs: float = 4.0
    batch_positions: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.0
    decay: float = 0.8  # loss weight of head k is decay ** k
    shared_lm_head: bool = True
    soft_labels: bool = False
    extra_answers: tuple[str, ...] = ()  # jsonl files of {"id", "prompt_ids", "answer_ids"} added to training
    max_prompts: int = 128
    eval_prompts: int = 16
    max_answer_tokens: int = 128
    max_prompt_tokens: int = 1024
    temperature: float = 0.0
    ignore_eos: bool = False  # answers run to max_answer_tokens (tests with tiny random models)
    seed: int = 0
    checkpoint_minutes: float = 5.0
    train_minutes: float | None = None  # stop training (and save) after this long
    bf16: str = "auto"  # auto | on | off: the frozen lm_head matmul in bfloat16
    device: str = "cpu"

    def __post_init__(self) -> None:
        checks = (("heads", self.num_heads, 1, 16), ("layers", self.num_layers, 0, 8),
                  ("batch-positions", self.batch_positions, 1, 1 << 16), ("max-prompts", self.max_prompts, 1, 1 << 20),
                  ("eval-prompts", self.eval_prompts, 0, 1 << 20), ("max-answer-tokens", self.max_answer_tokens, 4, 1 << 16))
        for name, value, lo, hi in checks:
            if not isinstance(value, int) or not lo <= value <= hi:
                raise SpecbuildError(f"--{name} {value!r} is out of range [{lo}, {hi}]")
        if self.steps is not None and not (isinstance(self.steps, int) and self.steps >= 1):
            raise SpecbuildError(f"--steps {self.steps!r} must be a positive integer")
        if self.bf16 not in ("auto", "on", "off"):
            raise SpecbuildError(f"--bf16 {self.bf16!r} is not one of auto, on, off")
        if not 0 < self.lr < 1:
            raise SpecbuildError(f"--lr {self.lr!r} is out of range (0, 1)")


# ---- data ------------------------------------------------------------------------------------
def load_records(path: str | None) -> list[dict]:
    """Spec-Bench-style jsonl: {"turns": [...]} (the first turn is the prompt) or
    {"prompt": ...}; question_id kept when present. None: the packaged Spec-Bench."""
    if path is None:
        from importlib import resources

        path = str(resources.files("specbuild").joinpath(QUESTIONS_RESOURCE))
    if not os.path.isfile(path):
        raise SpecbuildError(f"--data {path!r} does not exist")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise SpecbuildError(f"{path}:{lineno} is not JSON: {err}") from None
            text = rec.get("prompt") if isinstance(rec, dict) else None
            if text is None and isinstance(rec, dict) and rec.get("turns"):
                text = rec["turns"][0]
            if not isinstance(text, str) or not text.strip():
                raise SpecbuildError(f"{path}:{lineno} has neither a 'prompt' string nor a non-empty 'turns' list")
            out.append({"id": rec.get("question_id", f"line{lineno}"), "text": text})
    if not out:
        raise SpecbuildError(f"--data {path!r} holds no prompts")
    return out


def _package_split() -> dict | None:
    from importlib import resources

    try:
        data = json.loads(resources.files("specbuild").joinpath(SPLIT_RESOURCE).read_text(encoding="utf-8"))
    except (FileNotFoundError, OSError, json.JSONDecodeError):
        return None
    out = {}
    for name in ("train", "eval"):
        ids = data.get(name, data.get("test") if name == "eval" else None)
        if isinstance(ids, dict):
            ids = ids.get("question_ids", ids.get("ids"))
        if isinstance(ids, list):
            out[name] = {str(i) for i in ids}
    return out if len(out) == 2 else None


def split_records(records: list[dict], cfg: MedusaTrainConfig) -> tuple[list[dict], list[dict], str]:
    """(train, eval, how): the package's Spec-Bench split by question id when every record
    has one in it, else a seeded 90/10 split of the file; both in a seeded random order
    (`distill` takes the first ones that fit)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    split = _package_split()
    if split and all(str(r["id"]) in split["train"] | split["eval"] for r in records):
        train = [r for r in records if str(r["id"]) in split["train"]]
        evals = [r for r in records if str(r["id"]) in split["eval"]]
        how = "Spec-Bench split (package data)"
    else:
        n_eval = min(cfg.eval_prompts, max(1, len(records) // 10)) if len(records) > 1 else 0
        order = torch.randperm(len(records), generator=gen).tolist()
        evals = [records[i] for i in order[:n_eval]]
        train = [records[i] for i in order[n_eval:]]
        how = "seeded 90/10 split of the file"

    def shuffled(rs):
        return [rs[i] for i in torch.randperm(len(rs), generator=gen).tolist()]
    return shuffled(train), shuffled(evals), how


def distill(engine, records: list[dict], limit: int, cfg: MedusaTrainConfig, path: str,
            progress: bool) -> list[dict]:
    """The target's answers to the first `limit` records whose prompt fits (chat template,
    <= max_prompt_tokens), appended to `path` (jsonl) as they finish; lines already there
    (same id) are reused. Returns [{"id", "prompt_ids", "answer_ids"}]."""
    from tqdm import tqdm

    from specbuild.sampling.params import SamplingParams
    from specbuild.engine.sequence import Request

    done = {}
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    done[str(rec["id"])] = rec
    todo, chosen = [], []
    for i, r in enumerate(records):
        if len(chosen) == limit:
            break
        if str(r["id"]) in done:
            chosen.append(r)
            continue
        ids = engine.encode(engine.render_chat([{"role": "user", "content": r["text"]}]), add_special_tokens=False)
        if len(ids) > cfg.max_prompt_tokens or len(ids) + cfg.max_answer_tokens > engine.max_seq_len:
            continue
        chosen.append(r)
        todo.append((r, ids, cfg.seed + i))
    bar = tqdm(total=len(todo), desc="target answers", unit="prompt", disable=not progress or not todo)
    with open(path, "a") as out:
        handles = [(r, ids, engine.submit(Request(prompt_ids=ids, sampling=SamplingParams(
            max_tokens=cfg.max_answer_tokens, temperature=cfg.temperature, seed=seed,
            ignore_eos=cfg.ignore_eos))))
            for r, ids, seed in todo]
        pending = list(handles)
        while pending:
            engine.step()
            for item in [p for p in pending if p[2].seq.finished]:
                r, ids, h = item
                pending.remove(item)
                res = h.result()
                if res.get("error"):
                    raise SpecbuildError(f"the target failed on prompt {r['id']}: {res['error']}")
                rec = {"id": r["id"], "prompt_ids": ids, "answer_ids": res["token_ids"]}
                out.write(json.dumps(rec) + "\n")
                out.flush()
                done[str(r["id"])] = rec
                bar.update(1)
    bar.close()
    wanted = [done[str(r["id"])] for r in chosen]
    return [w for w in wanted if len(w["answer_ids"]) >= 2]


def load_answers(paths: tuple[str, ...], vocab: int, eval_ids: set[str]) -> list[dict]:
    """Training sequences from jsonl files of {"id", "prompt_ids", "answer_ids"} (as distill
    writes them), ids made unique per file; a sequence of an eval prompt (its id before any
    "~k" suffix) is refused, so the accuracy report stays held out."""
    out = []
    for n, path in enumerate(paths):
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    ids = [int(t) for t in rec["prompt_ids"] + rec["answer_ids"]]
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                    raise SpecbuildError(f"{path}:{line_no}: expected {{\"id\", \"prompt_ids\", \"answer_ids\"}} "
                                         f"with integer token ids ({err})") from None
                if any(not 0 <= t < vocab for t in ids):
                    raise SpecbuildError(f"{path}:{line_no}: token id outside the target's vocabulary [0, {vocab})")
                if str(rec.get("id", "")).split("~")[0].split("#")[0] in eval_ids:
                    raise SpecbuildError(f"{path}:{line_no}: id {rec.get('id')!r} is an eval prompt; "
                                         "extra answers must come from training prompts")
                if len(rec["answer_ids"]) >= 2:
                    out.append({"id": f"x{n}:{rec.get('id', line_no)}", "prompt_ids": rec["prompt_ids"],
                                "answer_ids": rec["answer_ids"]})
    return out


@torch.inference_mode()
def collect_hidden(model, seqs: list[dict], progress: bool, desc: str) -> dict[str, torch.Tensor]:
    """One forward per sequence; keeps hidden [A, H] of rows P-1 .. T-2 and the answer
    tokens [A] (A = answer length). Returns {"hidden" [N, H] float32, "tokens" [N],
    "offsets" [S + 1]}."""
    from tqdm import tqdm

    from specbuild.model.decoder import ForwardBatch

    longest = max(len(s["prompt_ids"]) + len(s["answer_ids"]) for s in seqs)
    cache = model.new_cache(-(-longest // 16) + 1, 16)
    dev = model.device
    hiddens, tokens, offsets = [], [], [0]
    for s in tqdm(seqs, desc=desc, unit="seq", disable=not progress):
        ids = s["prompt_ids"] + s["answer_ids"]
        p, t = len(s["prompt_ids"]), len(ids)
        slots = torch.arange(t, device=dev)
        batch = ForwardBatch(torch.tensor(ids, device=dev), slots, slots, slots,
                             torch.ones(t, t, dtype=torch.bool, device=dev).tril(), torch.arange(p - 1, t - 1, device=dev))
        hidden = model.forward(batch, cache, return_hidden=True).hidden  # [T - P, H]
        hiddens.append(hidden.float().cpu())
        tokens.append(torch.tensor(s["answer_ids"], dtype=torch.int64))
        offsets.append(offsets[-1] + t - p)
    return {"hidden": torch.cat(hiddens), "tokens": torch.cat(tokens), "offsets": torch.tensor(offsets)}


def make_examples(data: dict[str, torch.Tensor], num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [M] into data["hidden"], targets [M, heads] token ids or IGNORE). Row r of a
    sequence (position P-1+r) and head k target answer[r + k + 1]."""
    rows, targets = [], []
    offsets = data["offsets"].tolist()
    tok = data["tokens"]
    for start, end in zip(offsets[:-1], offsets[1:]):
        a = end - start
        for r in range(a - 1):
            t = torch.full((num_heads,), IGNORE, dtype=torch.int64)
            k_max = min(num_heads, a - r - 1)
            t[:k_max] = tok[start + r + 1:start + r + 1 + k_max]
            rows.append(start + r)
            targets.append(t)
    if not rows:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, num_heads, dtype=torch.int64)
    return torch.tensor(rows), torch.stack(targets)


# ---- the heads being trained --------------------------------------------------------------------
class TrainHeads(torch.nn.Module):
    """Trainable Medusa heads; the same math as runtime.medusa_heads.MedusaHeads.
    lm_head: the target's [V, H], frozen and shared, or copied per head when own_lm_head."""

    def __init__(self, num_heads: int, num_layers: int, lm_head: torch.Tensor, own_lm_head: bool,
                 lm_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        vocab, hidden = lm_head.shape
        self.num_heads, self.num_layers = num_heads, num_layers
        self.weight = torch.nn.Parameter(torch.zeros(num_layers, num_heads, hidden, hidden))
        self.bias = torch.nn.Parameter(torch.zeros(num_layers, num_heads, hidden))
        self.own_lm_head = own_lm_head
        self.register_buffer("target_lm", lm_head.to(lm_dtype), persistent=False)  # frozen
        if own_lm_head:
            self.lm_head = torch.nn.Parameter(lm_head.float().unsqueeze(0).repeat(num_heads, 1, 1))
        self.lm_dtype = lm_dtype

    def body(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, heads, H]
        x = hidden.unsqueeze(1).expand(-1, self.num_heads, -1)
        for l in range(self.num_layers):
            x = x + F.silu(torch.einsum("bhi,hoi->bho", x, self.weight[l]) + self.bias[l])
        return x

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, heads, V] float32
        x = self.body(hidden)
        if self.own_lm_head:
            return torch.einsum("bhi,hvi->bhv", x, self.lm_head)
        b = x.shape[0]
        return F.linear(x.reshape(b * self.num_heads, -1).to(self.lm_dtype), self.target_lm).float().view(b, self.num_heads, -1)

    def export(self) -> dict[str, torch.Tensor]:
        """FasterDecoding names, float32; lm_heads only when they are the heads' own."""
        out = {}
        for h in range(self.num_heads):
            for l in range(self.num_layers):
                out[f"{h}.{l}.linear.weight"] = self.weight[l, h].detach().float().contiguous().clone()
                out[f"{h}.{l}.linear.bias"] = self.bias[l, h].detach().float().contiguous().clone()
            if self.own_lm_head:
                out[f"{h}.{self.num_layers}.weight"] = self.lm_head[h].detach().float().contiguous().clone()
        return out


def bf16_faster(hidden: int, vocab: int) -> bool:
    """Whether a [256, H] x [H, V] matmul runs faster in bfloat16 than float32 here."""
    import time as _t

    x, w = torch.randn(256, hidden), torch.randn(min(vocab, 16384), hidden)
    timings = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = x.to(dtype), w.to(dtype)
        F.linear(a, b)
        t0 = _t.perf_counter()
        for _ in range(3):
            F.linear(a, b)
        timings[dtype] = _t.perf_counter() - t0
    return timings[torch.bfloat16] < 0.8 * timings[torch.float32]


def head_losses(model: TrainHeads, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                soft: bool, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted loss, per-head mean loss [heads]) of a batch: rows [B], targets [B, heads]."""
    logits = model(hidden[rows])  # [B, heads, V]
    valid = targets != IGNORE  # [B, heads]
    b, n, v = logits.shape
    if soft:  # the target's own distribution at position t + 1 + k: lm_head(hidden[row + 1 + k])
        k = torch.arange(n)
        future = hidden[(rows.unsqueeze(1) + 1 + k).clamp(max=hidden.shape[0] - 1)]  # [B, heads, H]
        with torch.no_grad():
            target_logp = F.log_softmax(F.linear(future.reshape(b * n, -1).to(model.lm_dtype),
                                                 model.target_lm).float(), -1)
        per = F.kl_div(F.log_softmax(logits.reshape(b * n, v), -1), target_logp, log_target=True,
                       reduction="none").sum(-1).view(b, n)
    else:
        per = F.cross_entropy(logits.reshape(b * n, v), targets.reshape(-1).clamp(min=0), reduction="none").view(b, n)
    per = per * valid
    counts = valid.sum(0).clamp(min=1)
    head_mean = per.sum(0) / counts  # [heads]
    weights = decay ** torch.arange(n, dtype=torch.float32)
    return (head_mean * weights * (valid.sum(0) > 0)).sum(), head_mean.detach()


@torch.no_grad()
def evaluate(model: TrainHeads, data: dict[str, torch.Tensor], batch: int = 256, topk: int = 5) -> list[dict]:
    """Head-wise top-1 / top-k accuracy against the target's own tokens."""
    rows, targets = make_examples(data, model.num_heads)
    hits1 = torch.zeros(model.num_heads)
    hitsk = torch.zeros(model.num_heads)
    counts = torch.zeros(model.num_heads)
    for i in range(0, rows.shape[0], batch):
        r, t = rows[i:i + batch], targets[i:i + batch]
        top = model(data["hidden"][r]).topk(topk, dim=-1).indices  # [B, heads, k]
        valid = t != IGNORE
        hits1 += ((top[..., 0] == t) & valid).sum(0)
        hitsk += ((top == t.unsqueeze(-1)).any(-1) & valid).sum(0)
        counts += valid.sum(0)
    return [{"head": h, "top1": round(float(hits1[h] / max(counts[h], 1)), 4),
             f"top{topk}": round(float(hitsk[h] / max(counts[h], 1)), 4), "positions": int(counts[h])}
            for h in range(model.num_heads)]


@torch.inference_mode()
def rank_accuracy(model: TrainHeads, data: dict[str, torch.Tensor], ranks: int = 10, batch: int = 256) -> list[list[float]]:
    """[heads][ranks]: how often head h's rank-k guess is the target's token (the input of
    plugins.tree.sparse_tree)."""
    rows, targets = make_examples(data, model.num_heads)
    hits = torch.zeros(model.num_heads, ranks)
    counts = torch.zeros(model.num_heads)
    for i in range(0, rows.shape[0], batch):
        r, t = rows[i:i + batch], targets[i:i + batch]
        top = model(data["hidden"][r]).topk(ranks, dim=-1).indices  # [B, heads, ranks]
        valid = t != IGNORE
        hits += ((top == t.unsqueeze(-1)) & valid.unsqueeze(-1)).sum(0).float()
        counts += valid.sum(0)
    return [[round(float(hits[h, k] / max(counts[h], 1)), 5) for k in range(ranks)] for h in range(model.num_heads)]


SPARSE_SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32)


def write_sparse_trees(rank_acc: list[list[float]], out_dir: str) -> list[dict]:
    """Trees of SPARSE_SIZES nodes built from measured head accuracies, as JSON files in
    `<out>/trees/` (for `bench --tree`), with each one's expected accepted drafts."""
    from specbuild.speculation.tree import expected_accepted, sparse_tree

    os.makedirs(os.path.join(out_dir, "trees"), exist_ok=True)
    out = []
    for n in SPARSE_SIZES:
        try:
            tree = sparse_tree(rank_acc, n)
        except ValueError:
            continue
        path = os.path.join(out_dir, "trees", f"sparse_{n}.json")
        with open(path, "w") as f:
            json.dump({"name": tree.name, "paths": [list(p) for p in tree.paths]}, f)
        out.append({"tree": tree.name, "file": path, "drafts": n,
                    "expected_accepted": round(expected_accepted(tree, rank_acc), 4)})
    return out


def lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, min(50, total // 10))
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# ---- the command -------------------------------------------------------------------------------
def resume_state(model, optim, ckpt_path: str, resume: bool, total: int, log) -> tuple[int, list[float]]:
    """(step, loss history) from `ckpt_path` when resuming (model and optimizer restored), else (0, [])."""
    if not (resume and os.path.isfile(ckpt_path)):
        return 0, []
    state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"], strict=False)
    optim.load_state_dict(state["optim"])
    log(f"resumed at step {state['step']} of {total}")
    return state["step"], state["history"]


def train_loop(model, optim, step: int, total: int, history: list[float], batch_loss, *, peak_lr: float,
               ckpt_path: str, config: dict, checkpoint_minutes: float, train_minutes: float | None, desc: str,
               progress: bool, log, smoothing: float, after_step=None, extra_state=None) -> int:
    """The optimizer loop train-medusa, train-draft and train-eagle share: warmup + cosine
    learning rate, a progress bar with the running loss, a checkpoint every
    `checkpoint_minutes` and at the end, a stop after `train_minutes`. batch_loss(step) ->
    (loss, {name: bar value}); after_step(step) -> True stops the loop (after evaluating,
    say); extra_state() -> a dict saved into the checkpoint beside the model and optimizer.
    Appends to `history`; returns the step reached."""
    from tqdm import tqdm

    def save() -> None:
        _save_atomic({"step": step, "model": model.state_dict(), "optim": optim.state_dict(),
                      "history": history, "config": config, **(extra_state() if extra_state else {})}, ckpt_path)

    bar = tqdm(total=total, initial=step, desc=desc, unit="step", disable=not progress)
    t_train, t_ckpt, running = time.perf_counter(), time.perf_counter(), None
    while step < total:
        for group in optim.param_groups:
            group["lr"] = lr_at(step, total, peak_lr)
        loss, shown = batch_loss(step)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        step += 1
        value = float(loss.detach())
        running = value if running is None else smoothing * running + (1 - smoothing) * value
        history.append(round(value, 5))
        bar.set_postfix(loss=f"{running:.3f}", **shown)
        bar.update(1)
        if after_step is not None and after_step(step):
            break
        if time.perf_counter() - t_ckpt > 60 * checkpoint_minutes:
            save()
            t_ckpt = time.perf_counter()
        if train_minutes is not None and time.perf_counter() - t_train > 60 * train_minutes:
            log(f"--train-minutes {train_minutes} reached at step {step}")
            break
    bar.close()
    save()
    return step


def _save_atomic(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _hidden_cache(engine, seqs: list[dict], path: str, resume: bool, progress: bool, desc: str) -> dict:
    from safetensors.torch import load_file, save_file

    key = json.dumps([[s["id"], len(s["prompt_ids"]), len(s["answer_ids"])] for s in seqs])
    if resume and os.path.isfile(path):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            if (f.metadata() or {}).get("key") == key:
                return load_file(path)
    data = collect_hidden(engine.model, seqs, progress, desc)
    save_file(data, path, metadata={"key": key})
    return data


def train_medusa(bundle_dir: str, data_path: str | None, out_dir: str, cfg: MedusaTrainConfig = MedusaTrainConfig(),
                 resume: bool = False, progress: bool = True, log=print) -> dict:
    """Run the four phases (module docstring); returns the report (also `<out>/report.json`)."""
    from safetensors.torch import save_file

    from specbuild.engine.engine import Engine, EngineConfig

    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    records = load_records(data_path)
    train_recs, eval_recs, how = split_records(records, cfg)
    os.makedirs(out_dir, exist_ok=True)
    ckpt_path = os.path.join(out_dir, "checkpoint.pt")
    if not resume:
        for name in ("answers_train.jsonl", "answers_eval.jsonl", "hidden_train.safetensors",
                     "hidden_eval.safetensors", "checkpoint.pt"):
            if os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
    engine = Engine(bundle_dir, EngineConfig(device=cfg.device))
    log(f"prompts: up to {cfg.max_prompts} of {len(train_recs)} train, {cfg.eval_prompts} of {len(eval_recs)} "
        f"eval ({how}); the target answers {engine.max_batch_size} at a time")
    train_seqs = distill(engine, train_recs, cfg.max_prompts, cfg, os.path.join(out_dir, "answers_train.jsonl"),
                         progress)
    eval_seqs = distill(engine, eval_recs, cfg.eval_prompts, cfg, os.path.join(out_dir, "answers_eval.jsonl"),
                        progress)
    train_seqs = train_seqs + load_answers(cfg.extra_answers, engine.target_config.vocab_size,
                                           {str(r["id"]) for r in eval_recs})
    t_distill = time.perf_counter()
    if not train_seqs:
        raise SpecbuildError("no training answers: every prompt was too long or the target answered with < 2 tokens")
    train = _hidden_cache(engine, train_seqs, os.path.join(out_dir, "hidden_train.safetensors"), resume, progress,
                          "hidden states (train)")
    evals = _hidden_cache(engine, eval_seqs, os.path.join(out_dir, "hidden_eval.safetensors"), resume, progress,
                          "hidden states (eval)") if eval_seqs else None
    t_hidden = time.perf_counter()

    from specbuild.model.qlinear import as_dense

    lm_head = as_dense(engine.model.lm_head).float().cpu()
    vocab, hidden_size = lm_head.shape
    del engine
    use_bf16 = cfg.bf16 == "on" or (cfg.bf16 == "auto" and bf16_faster(hidden_size, vocab))
    model = TrainHeads(cfg.num_heads, cfg.num_layers, lm_head, not cfg.shared_lm_head,
                       torch.bfloat16 if use_bf16 and cfg.shared_lm_head else torch.float32)
    rows, targets = make_examples(train, cfg.num_heads)
    if rows.numel() == 0:
        raise SpecbuildError("the answers are too short to give any training position")
    per_epoch = -(-rows.shape[0] // cfg.batch_positions)
    total = cfg.steps or max(1, int(math.ceil(cfg.epochs * per_epoch)))
    before = evaluate(model, evals) if evals is not None else []
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                              weight_decay=cfg.weight_decay)
    step, history = resume_state(model, optim, ckpt_path, resume, total, log)
    log(f"training {cfg.num_heads} heads x {cfg.num_layers} layers on {rows.shape[0]} positions "
        f"({'shared' if cfg.shared_lm_head else 'own'} lm_head, {'soft' if cfg.soft_labels else 'hard'} labels, "
        f"lm_head matmul in {'bfloat16' if use_bf16 else 'float32'}): {total} steps of {cfg.batch_positions}")

    def batch_loss(step: int):
        epoch, offset = divmod(step, per_epoch)
        order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        idx = order[offset * cfg.batch_positions:(offset + 1) * cfg.batch_positions]
        loss, per_head = head_losses(model, train["hidden"], rows[idx], targets[idx], cfg.soft_labels, cfg.decay)
        return loss, {"head0": f"{float(per_head[0]):.3f}"}

    step = train_loop(model, optim, step, total, history, batch_loss, peak_lr=cfg.lr, ckpt_path=ckpt_path,
                      config=asdict(cfg), checkpoint_minutes=cfg.checkpoint_minutes, train_minutes=cfg.train_minutes,
                      desc="training heads", progress=progress, log=log, smoothing=0.95)
    t_done = time.perf_counter()
    after = evaluate(model, evals) if evals is not None else []
    ranks = rank_accuracy(model, evals) if evals is not None else None
    trees = write_sparse_trees(ranks, out_dir) if ranks else []
    save_file(model.export(), os.path.join(out_dir, FD_FILE), metadata={"format": "pt"})
    config = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
              "hidden_size": hidden_size, "vocab_size": vocab, "shared_lm_head": cfg.shared_lm_head,
              "base_model_name_or_path": os.path.abspath(bundle_dir)}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    report = {
        "config": asdict(cfg), "split": how, "train_prompts": len(train_seqs), "eval_prompts": len(eval_seqs),
        "train_positions": int(rows.shape[0]), "steps": step, "bf16_lm_head": use_bf16,
        "first_losses": history[:10], "last_losses": history[-10:],
        "accuracy_before": before, "accuracy_after": after, "rank_accuracy": ranks, "sparse_trees": trees,
        "seconds": {"distill": round(t_distill - t_start, 1), "hidden": round(t_hidden - t_distill, 1),
                    "train": round(t_done - t_hidden, 1), "total": round(time.perf_counter() - t_start, 1)},
    }
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report
