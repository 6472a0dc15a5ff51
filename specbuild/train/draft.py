"""`specbuild train-draft`: a small draft model distilled from the bundle's target.

The draft is a Llama-family decoder of `layers` layers with the target's hidden size, so
that it can use the target's embedding as is (frozen, shared: the bundle stores it once).
Its output layer covers only the `draft_vocab` most frequent target tokens (the
`vocab_map`, [draft_vocab] target ids): its rows are the target's own output rows at those
ids, also frozen and shared, so the draft stores only its layers and final norm.

1. Self-distillation: the target answers train-split prompts through the Engine, greedy
   (`answers_greedy.jsonl`) and sampled (`answers_sampled.jsonl`, temperature
   `sample_temperature`); eval prompts greedy (`answers_eval.jsonl`). Reuses
   medusa_train's data loading, split and answer generation.
2. One target forward per sequence caches the final-normed hidden states of the rows that
   predict answer tokens, or with `prompt_positions` every row (`hidden_*.safetensors`);
   the target's soft labels over the vocab_map are these times the frozen output rows,
   computed per batch.
3. The draft's layers start as copies of target layers (`init_layers`: the first `layers`
   by default, an early exit: KL 13 to the target on SmolLM2's eval answers, where its
   first and last layer give KL 64) and train on KL(target || draft), the target's
   distribution renormalised over the vocab_map (the draft puts probability zero outside
   it; rejection sampling stays exact). AdamW, warmup + cosine, `checkpoint.pt` every few
   minutes; `--resume` continues from the answers, hidden caches and checkpoint.

Output directory (a "specbuild draft", which `compile --draft DIR` recognises):
`draft.json` (format, the draft's ModelConfig, shares, sizes, the target's tokenizer
fingerprint), `weights.safetensors` (runtime layout without embed / lm_head, `save_dtype`),
`vocab_map.safetensors` ({"vocab_map": [draft_vocab] int64}), `report.json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from specbuild.bundle import ModelConfig
# the output directory's format belongs to its reader, compile --draft
from specbuild.compiler.draft_role import DRAFT_JSON, FORMAT, VOCAB_MAP, WEIGHTS
from specbuild.errors import SpecbuildError
from specbuild.model.decoder import apply_rope, rms_norm, rope_tables
from specbuild.train import medusa as mt


@dataclass(frozen=True)
class DraftTrainConfig:
    """Settings of one train-draft run; sizes in layers, tokens, prompts, minutes."""

    layers: int = 2
    hidden: int | None = None  # MLP intermediate size; None: the target's
    draft_vocab: int = 8192
    tokens: int = 24000  # answer tokens to distil (greedy + sampled) in all
    sampled_share: float = 0.25  # of those tokens, the share from sampled answers
    prompt_positions: bool = True  # also learn the target's distributions over the prompt tokens
    init_layers: tuple[int, ...] | None = None  # target layers to copy; None: the first `layers`
    max_answer_tokens: int = 128
    max_prompt_tokens: int = 512
    eval_prompts: int = 12
    sample_temperature: float = 0.8
    epochs: float = 4.0
    batch_seqs: int = 4
    lr: float = 3e-4
    seed: int = 0
    checkpoint_minutes: float = 3.0
    train_minutes: float | None = None
    save_dtype: str = "bfloat16"
    ignore_eos: bool = False
    device: str = "cpu"

    def __post_init__(self) -> None:
        checks = (("layers", self.layers, 1, 8), ("draft-vocab", self.draft_vocab, 2, 1 << 20),
                  ("tokens", self.tokens, 1, 1 << 30), ("batch-seqs", self.batch_seqs, 1, 1024),
                  ("max-answer-tokens", self.max_answer_tokens, 4, 1 << 16))
        for name, value, lo, hi in checks:
            if not isinstance(value, int) or not lo <= value <= hi:
                raise SpecbuildError(f"--{name} {value!r} is out of range [{lo}, {hi}]")
        if self.hidden is not None and not (isinstance(self.hidden, int) and self.hidden >= 8):
            raise SpecbuildError(f"--hidden {self.hidden!r} must be an integer >= 8")
        if not 0 <= self.sampled_share <= 1:
            raise SpecbuildError(f"--sampled-share {self.sampled_share!r} is out of range [0, 1]")
        if self.save_dtype not in ("float32", "bfloat16", "float16"):
            raise SpecbuildError(f"save dtype {self.save_dtype!r} is not one of float32, bfloat16, float16")
        if not 0 < self.lr < 1:
            raise SpecbuildError(f"--lr {self.lr!r} is out of range (0, 1)")

    def answers_cfg(self, temperature: float) -> "mt.MedusaTrainConfig":
        """The medusa_train config that its `distill` / `split_records` read."""
        return mt.MedusaTrainConfig(max_answer_tokens=self.max_answer_tokens, max_prompt_tokens=self.max_prompt_tokens,
                                    eval_prompts=self.eval_prompts, temperature=temperature, seed=self.seed,
                                    ignore_eos=self.ignore_eos, device=self.device)


# ---- vocabulary map -----------------------------------------------------------------------------
def make_vocab_map(seqs: list[dict], vocab: int, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent tokens of the sequences' answer_ids (ties and the rest filled by lowest id, which
    for BPE vocabularies is merge order, roughly frequency), plus `always`; sorted [size]."""
    if size > vocab:
        raise SpecbuildError(f"--draft-vocab {size} exceeds the target's vocabulary {vocab}")
    counts = torch.zeros(vocab, dtype=torch.float64)
    for s in seqs:
        counts += torch.bincount(torch.tensor(s["answer_ids"], dtype=torch.int64), minlength=vocab).double()
    score = counts * vocab + (vocab - torch.arange(vocab, dtype=torch.float64))  # count first, then low id
    for t in always:
        if 0 <= t < vocab:
            score[t] = float("inf")
    return score.topk(size).indices.sort().values


# ---- the draft being trained ------------------------------------------------------------------------
def draft_config(target: ModelConfig, cfg: DraftTrainConfig) -> ModelConfig:
    """The draft's ModelConfig: the target's shapes, `layers` layers, its own MLP size,
    the target's full vocabulary for the (shared) embedding, an untied output layer."""
    return dataclasses.replace(target, num_layers=cfg.layers, intermediate_size=cfg.hidden or target.intermediate_size,
                               tie_word_embeddings=False, dtype="float32")


def init_from_target(target_w: dict, target: ModelConfig, draft: ModelConfig, layers: tuple[int, ...]) -> dict:
    """Runtime-layout draft weights (no embed / lm_head) copied from target layers; an MLP
    narrower than the target's keeps the first `intermediate_size` units."""
    from specbuild.model.qlinear import as_dense

    out, m = {}, draft.intermediate_size
    for i, src in enumerate(layers):
        if not 0 <= src < target.num_layers:
            raise SpecbuildError(f"init layer {src} is out of range [0, {target.num_layers})")
        g = lambda n: as_dense(target_w[f"layers.{src}.{n}"]).float().clone()  # noqa: E731
        gate, up = g("gate_up").chunk(2, 0)
        out.update({f"layers.{i}.attn_norm": g("attn_norm"), f"layers.{i}.qkv": g("qkv"), f"layers.{i}.o": g("o"),
                    f"layers.{i}.mlp_norm": g("mlp_norm"),
                    f"layers.{i}.gate_up": torch.cat([gate[:m], up[:m]]).contiguous(),
                    f"layers.{i}.down": g("down")[:, :m].contiguous()})
        if f"layers.{src}.qkv_bias" in target_w:
            out[f"layers.{i}.qkv_bias"] = g("qkv_bias")
    out["norm"] = as_dense(target_w["norm"]).float().clone()
    return out


class TrainDraft(torch.nn.Module):
    """The draft decoder over padded batches (same math as runtime.model.reference_forward).
    embed [V, H] and out_rows [N, H] are frozen buffers (shared with the target)."""

    def __init__(self, config: ModelConfig, weights: dict, embed: torch.Tensor, out_rows: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        self.names = sorted(weights)
        self.params = torch.nn.ParameterDict({n.replace(".", "__"): torch.nn.Parameter(w.float().clone())
                                              for n, w in weights.items()})
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("out_rows", out_rows.float(), persistent=False)

    def w(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] (right-padded; padding only ever sees itself causally) -> final-normed [B, T, H]."""
        c = self.config
        b, t = ids.shape
        cos, sin = rope_tables(c, t, torch.float32)
        x = self.embed[ids]
        for i in range(c.num_layers):
            p = f"layers.{i}."
            h = rms_norm(x, self.w(p + "attn_norm"), c.rms_norm_eps)
            qkv = h @ self.w(p + "qkv").T
            if p + "qkv_bias" in self.names:
                qkv = qkv + self.w(p + "qkv_bias")
            kv = c.num_kv_heads * c.head_dim
            q, k, v = qkv.split([c.num_heads * c.head_dim, kv, kv], -1)
            q = apply_rope(q.reshape(b * t, c.num_heads, c.head_dim), cos.repeat(b, 1), sin.repeat(b, 1))
            k = apply_rope(k.reshape(b * t, c.num_kv_heads, c.head_dim), cos.repeat(b, 1), sin.repeat(b, 1))
            q = q.view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
            k = k.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
            v = v.reshape(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
            group = c.num_heads // c.num_kv_heads
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
            x = x + attn @ self.w(p + "o").T
            h = rms_norm(x, self.w(p + "mlp_norm"), c.rms_norm_eps)
            gate, up = (h @ self.w(p + "gate_up").T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ self.w(p + "down").T
        return rms_norm(x, self.w("norm"), c.rms_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> logits over the vocab_map [B, T, N]
        return self.hidden(ids) @ self.out_rows.T

    def export(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {n: self.w(n).detach().to(dtype).contiguous().clone() for n in self.names}


def pad_batch(seqs: list[dict]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """ids [B, T] right-padded with 0; rows [R, 2] (b, t) of the positions that predict
    answer tokens (P-1 .. T-2, in the order collect_hidden keeps them); lengths."""
    full = [s["prompt_ids"] + s["answer_ids"] for s in seqs]
    t = max(len(f) for f in full)
    ids = torch.zeros(len(full), t, dtype=torch.int64)
    rows = []
    for b, (s, f) in enumerate(zip(seqs, full)):
        ids[b, :len(f)] = torch.tensor(f)
        p = len(s["prompt_ids"])
        rows += [(b, i) for i in range(p - 1, len(f) - 1)]
    return ids, torch.tensor(rows), [len(f) for f in full]


def batch_loss(model: TrainDraft, seqs: list[dict], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(target || draft) over the vocab_map (the target's distribution renormalised over
    it), mean over answer positions; hidden: the target's cached rows [R, H] for these seqs.
    Returns (loss, top-1 agreement with the target's argmax over the map)."""
    ids, rows, _ = pad_batch(seqs)
    logits = model.hidden(ids)[rows[:, 0], rows[:, 1]] @ model.out_rows.T  # [R, N]: only the answer rows
    with torch.no_grad():
        target_logp = (hidden.float() @ model.out_rows.T).log_softmax(-1)  # [R, N]
        target_probs = target_logp.exp()
    loss = (target_probs * (target_logp - logits.log_softmax(-1))).sum(-1).mean()
    agree = (logits.argmax(-1) == target_probs.argmax(-1)).float().mean()
    return loss, agree.detach()


def seq_hidden(data: dict, i: int) -> torch.Tensor:
    off = data["offsets"]
    return data["hidden"][int(off[i]):int(off[i + 1])]


@torch.no_grad()
def evaluate(model: TrainDraft, seqs: list[dict], data: dict | None) -> dict:
    """Top-1 agreement with the target's choice over the vocab_map and mean KL on the eval
    answers (acceptance itself is measured by `specbuild bench`)."""
    if not seqs or data is None:
        return {}
    agree, kl, n = 0.0, 0.0, 0
    for i, s in enumerate(seqs):
        loss, a = batch_loss(model, [s], seq_hidden(data, i))
        agree += float(a) * len(s["answer_ids"])
        kl += float(loss) * len(s["answer_ids"])
        n += len(s["answer_ids"])
    return {"top1_agreement": round(agree / max(n, 1), 4), "kl": round(kl / max(n, 1), 4), "positions": n}


# ---- the command -------------------------------------------------------------------------------------
def _answers(engine, recs: list[dict], limit: int, cfg: DraftTrainConfig, temperature: float, path: str,
             progress: bool) -> list[dict]:
    if limit <= 0:
        return []
    return mt.distill(engine, recs, limit, cfg.answers_cfg(temperature), path, progress)


def train_draft(bundle_dir: str, data_path: str | None, out_dir: str, cfg: DraftTrainConfig = DraftTrainConfig(),
                resume: bool = False, progress: bool = True, log=print) -> dict:
    """Run the three phases (module docstring); returns the report (also `<out>/report.json`)."""
    from safetensors.torch import save_file

    from specbuild.bundle import tokenizer_fingerprint
    from specbuild.engine.engine import Engine, EngineConfig

    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    train_recs, eval_recs, how = mt.split_records(mt.load_records(data_path), cfg.answers_cfg(0.0))
    os.makedirs(out_dir, exist_ok=True)
    ckpt_path = os.path.join(out_dir, "checkpoint.pt")
    caches = ("answers_greedy.jsonl", "answers_sampled.jsonl", "answers_eval.jsonl", "hidden_train.safetensors",
              "hidden_eval.safetensors", "checkpoint.pt")
    if not resume:
        for name in caches:
            if os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
    engine = Engine(bundle_dir, EngineConfig(device=cfg.device))
    # Sampled answers may outnumber the prompts: a prompt is then answered again with another
    # seed (its record id gets a ~k suffix), since one prompt has many answers worth learning.
    n_sampled = math.ceil(cfg.tokens * cfg.sampled_share / cfg.max_answer_tokens) if train_recs else 0
    reps = -(-n_sampled // len(train_recs)) if train_recs else 0
    sampled_recs = [dict(r, id=f"{r['id']}~{k}") if k else r for k in range(reps) for r in train_recs]
    n_greedy = min(len(train_recs), math.ceil(cfg.tokens * (1 - cfg.sampled_share) / cfg.max_answer_tokens))
    log(f"prompts: {n_greedy} of {len(train_recs)} train answered greedy, {n_sampled} sampled "
        f"(T={cfg.sample_temperature}), {cfg.eval_prompts} eval ({how}); {cfg.tokens} answer tokens wanted")
    seqs = _answers(engine, train_recs, n_greedy, cfg, 0.0, os.path.join(out_dir, "answers_greedy.jsonl"), progress)
    sampled_cfg = dataclasses.replace(cfg, seed=cfg.seed + 7919)
    seqs += _answers(engine, sampled_recs, n_sampled, sampled_cfg, cfg.sample_temperature,
                     os.path.join(out_dir, "answers_sampled.jsonl"), progress)
    eval_seqs = _answers(engine, eval_recs, cfg.eval_prompts, cfg, 0.0, os.path.join(out_dir, "answers_eval.jsonl"),
                         progress)
    if not seqs:
        raise SpecbuildError("no training answers: every prompt was too long or the target answered with < 2 tokens")
    for i, s in enumerate(seqs):
        s["id"] = f"{s['id']}#{i}"  # greedy and sampled answers of one prompt are distinct sequences
    vocab_seqs = list(seqs)
    if cfg.prompt_positions:  # every position but the first predicts a token: rows 0 .. T-2
        seqs = [{"id": s["id"], "prompt_ids": (s["prompt_ids"] + s["answer_ids"])[:1],
                 "answer_ids": (s["prompt_ids"] + s["answer_ids"])[1:]} for s in seqs]
    t_distill = time.perf_counter()
    train = mt._hidden_cache(engine, seqs, os.path.join(out_dir, "hidden_train.safetensors"), resume, progress,
                             "target hidden states (train)")
    evals = mt._hidden_cache(engine, eval_seqs, os.path.join(out_dir, "hidden_eval.safetensors"), resume, progress,
                             "target hidden states (eval)") if eval_seqs else None
    t_hidden = time.perf_counter()

    target_cfg = engine.target_config
    from specbuild.model.qlinear import as_dense

    embed = as_dense(engine.model.w["embed"]).float()
    lm_head = as_dense(engine.model.lm_head).float()
    shares_head = "lm_head" if "lm_head" in engine.model.w else "embed"
    vocab_map = make_vocab_map([{"answer_ids": s["prompt_ids"] + s["answer_ids"]} for s in vocab_seqs],
                               target_cfg.vocab_size, cfg.draft_vocab, engine.eos_ids)
    dcfg = draft_config(target_cfg, cfg)
    layers = cfg.init_layers or tuple(range(min(cfg.layers, target_cfg.num_layers)))
    if len(layers) != cfg.layers:
        raise SpecbuildError(f"--init-layers names {len(layers)} layers; the draft has --layers {cfg.layers}")
    model = TrainDraft(dcfg, init_from_target(engine.model.w, target_cfg, dcfg, tuple(layers)), embed,
                       lm_head[vocab_map])
    fingerprint = tokenizer_fingerprint(engine.tokenizer.to_str())
    del engine
    answer_tokens = sum(len(s["answer_ids"]) for s in vocab_seqs)
    positions = sum(len(s["answer_ids"]) for s in seqs)
    coverage = float(torch.isin(torch.tensor([t for s in eval_seqs for t in s["answer_ids"]] or [0]), vocab_map)
                     .float().mean()) if eval_seqs else None
    per_epoch = -(-len(seqs) // cfg.batch_seqs)
    total = max(1, int(math.ceil(cfg.epochs * per_epoch)))
    before = evaluate(model, eval_seqs, evals)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    step, history = mt.resume_state(model, optim, ckpt_path, resume, total, log)
    log(f"training a {cfg.layers}-layer draft (init from target layers {list(layers)}, MLP {dcfg.intermediate_size}, "
        f"draft vocabulary {cfg.draft_vocab}) on {len(seqs)} answers / {answer_tokens} answer tokens, "
        f"{positions} positions: {total} steps")

    def one_batch(step: int):
        epoch, offset = divmod(step, per_epoch)
        order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch)).tolist()
        idx = order[offset * cfg.batch_seqs:(offset + 1) * cfg.batch_seqs]
        loss, agree = batch_loss(model, [seqs[i] for i in idx], torch.cat([seq_hidden(train, i) for i in idx]))
        return loss, {"top1": f"{float(agree):.2f}"}

    step = mt.train_loop(model, optim, step, total, history, one_batch, peak_lr=cfg.lr, ckpt_path=ckpt_path,
                         config=asdict(cfg), checkpoint_minutes=cfg.checkpoint_minutes, train_minutes=cfg.train_minutes,
                         desc="training draft", progress=progress, log=log, smoothing=0.9)
    t_done = time.perf_counter()
    after = evaluate(model, eval_seqs, evals)
    save_file(model.export(getattr(torch, cfg.save_dtype)), os.path.join(out_dir, WEIGHTS),
              metadata={"format": FORMAT})
    save_file({"vocab_map": vocab_map.contiguous()}, os.path.join(out_dir, VOCAB_MAP))
    meta = {"format": FORMAT, "config": asdict(dcfg), "draft_vocab": cfg.draft_vocab,
            "shares": {"embed": "target/embed", "lm_head": f"target/{shares_head}[vocab_map]"},
            "init_layers": list(layers), "target_tokenizer_fingerprint": fingerprint,
            "target_vocab_size": target_cfg.vocab_size, "dtype": cfg.save_dtype,
            "base_model_name_or_path": os.path.abspath(bundle_dir)}
    with open(os.path.join(out_dir, DRAFT_JSON), "w") as f:
        json.dump(meta, f, indent=2)
    report = {
        "config": asdict(cfg), "split": how, "train_answers": len(seqs), "answer_tokens": answer_tokens,
        "train_positions": positions,
        "eval_prompts": len(eval_seqs), "eval_tokens_in_vocab_map": coverage, "steps": step,
        "first_losses": history[:10], "last_losses": history[-10:], "eval_before": before, "eval_after": after,
        "seconds": {"distill": round(t_distill - t_start, 1), "hidden": round(t_hidden - t_distill, 1),
                    "train": round(t_done - t_hidden, 1), "total": round(time.perf_counter() - t_start, 1)},
    }
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report
