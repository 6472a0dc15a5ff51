"""`specbuild train-eagle BUNDLE --out DIR`: an EAGLE-3 head by self-distillation.

1. Answers: the target's own greedy (and, with --sampled, sampled) answers to the
   training prompts (the packaged Spec-Bench **train** split; the eval split is never
   used), chat-rendered, cached in DIR (train/medusa.distill).
2. Features: one target forward per sequence gives, at every row, the residual stream
   entering the three aux layers (model/decoder.py `aux_layers`) and the final-normed
   hidden state, from which the target's soft labels over the draft vocabulary are
   computed on the fly (cached in DIR as bfloat16).
3. Training-time test (EAGLE-3): step 1 runs the head on the target's features; step j
   feeds the head its own step j - 1 outputs (one position earlier), with each query
   seeing the step-1 keys of its chain's start and earlier plus one key per later step on
   its own chain -- exactly what drafting at depth j sees. Loss: cross-entropy against
   the target's distribution renormalised over the draft vocabulary (= KL up to a
   constant), weight decay**(j - 1) per step.
4. Eval: on held-out answers (train-split prompts set aside, not the Spec-Bench eval
   split), the chain acceptance by position (greedy: position j accepted when steps 1..j
   all give the target's token) and the expected accepted tokens per pass.

Resumable (--resume: answers, features and the optimizer checkpoint are reused), a
progress bar, a time limit (--train-minutes). Output: DIR in the EAGLE-3 layout
(formats/eagle3.py) plus report.json.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

import torch

from specbuild.errors import SpecbuildError
from specbuild.formats import eagle3
from specbuild.train import medusa as mt

FEATURES = "features_{}.pt"


@dataclass
class EagleTrainConfig:
    draft_vocab: int = 8192
    ttt_steps: int = 3
    decay: float = 0.8
    lr: float = 1e-3
    epochs: float = 4.0
    steps: int | None = None
    max_prompts: int = 160
    eval_prompts: int = 12
    max_answer_tokens: int = 192
    max_prompt_tokens: int = 512
    sampled: bool = False  # also one sampled answer (T = 0.8) per prompt
    ignore_eos: bool = False
    max_rows: int = 384  # rows per training sequence (longer ones are cut into windows)
    seed: int = 0
    checkpoint_minutes: float = 5.0
    train_minutes: float | None = None

    def __post_init__(self) -> None:
        for name, value, lo, hi in (("draft-vocab", self.draft_vocab, 16, 1 << 20), ("ttt-steps", self.ttt_steps, 1, 8),
                                    ("max-prompts", self.max_prompts, 1, 1 << 20),
                                    ("eval-prompts", self.eval_prompts, 0, 1 << 20),
                                    ("max-rows", self.max_rows, 8, 1 << 16)):
            if not isinstance(value, int) or not lo <= value <= hi:
                raise SpecbuildError(f"--{name} {value!r} is out of range [{lo}, {hi}]")
        if not 0 < self.lr < 1:
            raise SpecbuildError(f"--lr {self.lr!r} is out of range (0, 1)")

    def answers_cfg(self, temperature: float) -> mt.MedusaTrainConfig:
        return mt.MedusaTrainConfig(max_prompts=max(1, self.max_prompts), eval_prompts=self.eval_prompts,
                                    max_answer_tokens=self.max_answer_tokens, max_prompt_tokens=self.max_prompt_tokens,
                                    temperature=temperature, ignore_eos=self.ignore_eos, seed=self.seed)


# ---- features ----------------------------------------------------------------------------
@torch.inference_mode()
def target_features(model, cache, ids: list[int], aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux features [T, 3H], final-normed hidden [T, H]) of one sequence, by a throwaway
    full forward (no request state)."""
    from specbuild.model.decoder import ForwardBatch

    n, seq_id = len(ids), -11
    cache.add(seq_id)
    try:
        cache.reserve(seq_id, n)
        slots = cache.slots(seq_id, 0, n)
        rows = torch.arange(n)
        batch = ForwardBatch(torch.tensor(ids), torch.arange(n), slots, slots,
                             torch.ones(n, n, dtype=torch.bool).tril(), rows)
        out = model.forward(batch, cache, return_hidden=True, aux_layers=aux_layers, aux_rows=rows)
        hidden, feats = out.hidden, out.aux
        return feats, hidden
    finally:
        cache.release(seq_id)


def collect(engine, seqs: list[dict], aux_layers, path: str, resume: bool, progress: bool, desc: str) -> list[dict]:
    from tqdm import tqdm

    key = [[str(s["id"]), len(s["prompt_ids"]), len(s["answer_ids"])] for s in seqs]
    if resume and os.path.isfile(path):
        data = torch.load(path, weights_only=False)
        if data.get("key") == key:
            return data["seqs"]
    out = []
    for s in tqdm(seqs, desc=desc, unit="seq", disable=not progress):
        ids = s["prompt_ids"] + s["answer_ids"]
        feats, hidden = target_features(engine.model, engine.cache, ids, aux_layers)
        out.append({"ids": torch.tensor(ids), "feats": feats.to(torch.bfloat16), "hidden": hidden.to(torch.bfloat16),
                    "answer_start": len(s["prompt_ids"])})
    torch.save({"key": key, "seqs": out}, path)
    return out


def make_draft_ids(seqs: list[dict], vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent target tokens of the training text (ties: lower id), sorted."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    for s in seqs:
        counts += torch.bincount(s["ids"], minlength=vocab).double()
    score = counts * vocab + (vocab - torch.arange(vocab, dtype=torch.float64))
    return torch.sort(score.topk(min(size, vocab)).indices).values


# ---- the model under training -------------------------------------------------------------
class TrainHead(torch.nn.Module):
    def __init__(self, head) -> None:
        super().__init__()
        self.head = head
        self.params = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v.float().clone())
                                              for k, v in head.w.items()})
        self.sync()

    def sync(self) -> None:
        self.head.w = {k.replace("__", "."): p for k, p in self.params.items()}

    def export(self, dtype=torch.float32) -> dict[str, torch.Tensor]:
        return {k.replace("__", "."): p.detach().to(dtype).contiguous().clone() for k, p in self.params.items()}


def ttt_forward(head, ids: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Logits [T - j, N] of TTT step j (j = 1..steps) for one sequence: step j's row r is
    head position p = r + j - 1, predicting token p + 2 (label: target row p + 1)."""
    t = ids.shape[0] - 1  # head positions 0 .. T - 2
    emb = head.embed_tokens(ids[1:])  # [t, H]: embedding of token p + 1
    pos = torch.arange(t)
    out, k1, v1 = head.layer(emb, head.project(feats[:t]), pos, None, None, None)
    outs, logits = [out], [head.logits(out)]
    keys, vals = [k1], [v1]  # step i's keys for positions i - 1 .. t - 1
    for j in range(2, steps + 1):
        n = t - (j - 1)
        if n <= 0:
            break
        p = torch.arange(j - 1, t)  # query positions
        hid = outs[-1][:-1]  # step j - 1's output at p - 1
        # visible: step-1 keys at q <= p - j + 1; step-i keys (2 <= i < j) at q = p - j + i; own diagonal
        cols = []
        q1 = torch.arange(t)
        cols.append(q1[None, :] <= (p - j + 1)[:, None])
        for i in range(2, j):
            qi = torch.arange(i - 1, t)
            cols.append(qi[None, :] == (p - j + i)[:, None])
        mask = torch.cat(cols + [torch.eye(n, dtype=torch.bool)], dim=1)
        out, k, v = head.layer(emb[j - 1:], hid, p, torch.cat(keys), torch.cat(vals), mask)
        outs.append(out)
        logits.append(head.logits(out))
        keys.append(k)
        vals.append(v)
    return logits


def seq_loss(head, s: dict, out_rows: torch.Tensor, cfg: EagleTrainConfig, start: int = 0):
    """(loss, step-1 agreement) on one sequence window [start, start + max_rows]."""
    ids = s["ids"][start:start + cfg.max_rows + 1]
    feats = s["feats"][start:start + cfg.max_rows + 1].float()
    hidden = s["hidden"][start:start + cfg.max_rows + 1].float()
    with torch.no_grad():
        target = (hidden[1:] @ out_rows.T).softmax(-1)  # [T - 1, N]: label of head position p is row p + 1
    logits = ttt_forward(head, ids, feats, cfg.ttt_steps)
    loss, agree = 0.0, None
    for j, lg in enumerate(logits, start=1):
        tgt = target[j - 1:]
        ce = -(tgt * lg.log_softmax(-1)).sum(-1).mean()
        loss = loss + cfg.decay ** (j - 1) * ce
        if j == 1:
            agree = (lg.argmax(-1) == tgt.argmax(-1)).float().mean().detach()
    return loss, agree


@torch.no_grad()
def evaluate(head, seqs: list[dict], vocab_out: torch.Tensor, full_out: torch.Tensor, cfg: EagleTrainConfig,
             steps: int) -> dict:
    """Chain acceptance by position on answers (greedy: the target's argmax over the full
    vocabulary must equal the head's draft-vocabulary argmax mapped to target ids)."""
    hits = torch.zeros(steps)
    starts = 0
    for s in seqs:
        a0 = s["answer_start"]
        ids = s["ids"][: a0 + cfg.max_rows + 1]
        feats = s["feats"][: a0 + cfg.max_rows + 1].float()
        hidden = s["hidden"][: a0 + cfg.max_rows + 1].float()
        logits = ttt_forward(head, ids, feats, steps)
        target_tok = (hidden[1:] @ full_out.T).argmax(-1)  # [T - 1]
        correct = [head.draft_ids[lg.argmax(-1)] == target_tok[j:] for j, lg in enumerate(logits)]
        t = ids.shape[0] - 1
        # chains start at head positions s0 >= answer start - 1 (drafting inside answers)
        for s0 in range(max(a0 - 1, 0), t):
            ok = True
            starts += 1
            for j in range(min(len(correct), t - s0)):
                ok = ok and bool(correct[j][s0])  # step j + 1 at position s0 + j is row s0 of step j + 1
                if not ok:
                    break
                hits[j] += 1
    by_pos = (hits / max(starts, 1)).tolist()
    return {"acceptance_by_position": [round(x, 4) for x in by_pos],
            "expected_accepted_per_pass": round(1.0 + sum(by_pos), 4), "chains": starts}


# ---- the command -------------------------------------------------------------------------------
def train_eagle(bundle_dir: str, data_path: str | None, out_dir: str, cfg: EagleTrainConfig = EagleTrainConfig(),
                resume: bool = False, progress: bool = True, log=print) -> dict:
    from specbuild.engine.engine import Engine, EngineConfig, load_weights
    from specbuild.model.qlinear import as_dense
    from specbuild.speculation.eagle_head import EagleHead, HeadConfig, init_head_weights

    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    engine = Engine(bundle_dir, EngineConfig())
    tc = engine.target_config
    aux = eagle3.default_aux_layers(tc.num_layers)
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(out_dir, "checkpoint.pt")
    if not resume:
        for name in ("answers_greedy.jsonl", "answers_sampled.jsonl", "answers_eval.jsonl", FEATURES.format("train"),
                     FEATURES.format("eval"), "checkpoint.pt"):
            if os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
    acfg = cfg.answers_cfg(0.0)
    train_recs, eval_recs, how = mt.split_records(mt.load_records(data_path), acfg)
    n_eval = min(cfg.eval_prompts, max(0, len(train_recs) // 5))
    held, train_recs = train_recs[:n_eval], train_recs[n_eval:]  # held-out answers from the train split
    log(f"data: {how}; {len(train_recs)} training prompts, {len(held)} held out (Spec-Bench eval split unused: "
        f"{len(eval_recs)} prompts)")
    seqs = mt.distill(engine, train_recs, cfg.max_prompts, acfg, os.path.join(out_dir, "answers_greedy.jsonl"), progress)
    if cfg.sampled:
        sampled = mt.distill(engine, train_recs, cfg.max_prompts, cfg.answers_cfg(0.8),
                             os.path.join(out_dir, "answers_sampled.jsonl"), progress)
        seqs += [{**s, "id": f"{s['id']}~s"} for s in sampled]
    eval_seqs = mt.distill(engine, held, len(held), acfg, os.path.join(out_dir, "answers_eval.jsonl"), progress) \
        if held else []
    data = collect(engine, seqs, aux, os.path.join(out_dir, FEATURES.format("train")), resume, progress, "features")
    eval_data = collect(engine, eval_seqs, aux, os.path.join(out_dir, FEATURES.format("eval")), resume, progress,
                        "eval features")
    rows_w = load_weights(os.path.join(bundle_dir, engine.meta.roles["target"]["path"]), "cpu")
    draft_ids = make_draft_ids(data, tc.vocab_size, cfg.draft_vocab)
    full_out = as_dense(rows_w.get("lm_head", rows_w["embed"])).float()
    out_rows = full_out[draft_ids].contiguous()
    head_cfg = HeadConfig(tc.hidden_size, tc.intermediate_size, tc.num_heads, tc.num_kv_heads, tc.head_dim,
                          tc.rms_norm_eps, tc.rope_theta, tc.rope_scaling, tc.vocab_size, aux)
    head = EagleHead(head_cfg, init_head_weights(rows_w, tc, draft_ids, aux, cfg.seed),
                     as_dense(rows_w["embed"]).float(), draft_ids, engine.max_seq_len + 64)
    model = TrainHead(head)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    windows = [(i, st) for i, s in enumerate(data) for st in range(0, max(1, s["ids"].shape[0] - 1), cfg.max_rows)]
    total = cfg.steps or max(1, int(cfg.epochs * len(windows)))
    step, history = mt.resume_state(model, optim, ckpt, resume, total, log)
    model.sync()
    before = evaluate(head, eval_data, out_rows, full_out, cfg, cfg.ttt_steps) if eval_data else None
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(len(windows), generator=gen).tolist()

    def batch_loss(k: int):
        i, st = windows[order[k % len(order)]]
        loss, agree = seq_loss(head, data[i], out_rows, cfg, st)
        return loss, {"agree": f"{float(agree):.2f}"}

    t_train = time.perf_counter()
    step = mt.train_loop(model, optim, step, total, history, batch_loss, peak_lr=cfg.lr, ckpt_path=ckpt,
                         config=asdict(cfg), checkpoint_minutes=cfg.checkpoint_minutes,
                         train_minutes=cfg.train_minutes, desc="train-eagle", progress=progress, log=log,
                         smoothing=0.98)
    train_seconds = time.perf_counter() - t_train
    after = evaluate(head, eval_data, out_rows, full_out, cfg, cfg.ttt_steps + 2) if eval_data else None
    weights = model.export()
    weights["d2t"] = eagle3.d2t_from_ids(draft_ids)
    weights["t2d"] = eagle3.t2d_from_ids(draft_ids, tc.vocab_size)
    config = eagle3.make_config(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                                num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
                                rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta, rope_scaling=tc.rope_scaling,
                                vocab_size=tc.vocab_size, draft_vocab_size=int(draft_ids.numel()),
                                max_position_embeddings=tc.max_position_embeddings, aux_layers=aux)
    eagle3.write_eagle3(out_dir, config, weights)
    report = {"data": how, "train_sequences": len(data), "train_rows": sum(int(s["ids"].shape[0]) for s in data),
              "eval_sequences": len(eval_data), "steps": step, "total_steps": total,
              "train_seconds": round(train_seconds, 1), "seconds": round(time.perf_counter() - t_start, 1),
              "aux_layers": list(aux), "draft_vocab": int(draft_ids.numel()), "config": asdict(cfg),
              "eval_before": before, "eval_after": after, "final_loss": history[-1] if history else None}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report
