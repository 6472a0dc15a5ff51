"""`specbuild train-eagle BUNDLE --out DIR`: an EAGLE-3 head by self-distillation.

1. Answers: the target's own greedy (and, with --sampled, sampled) answers to the
   training prompts (the packaged Spec-Bench **train** split; the eval split is never
   used), chat-rendered, cached in DIR (train/medusa.distill) -- or, with --corpus, the
   answers of a corpus built by scripts/build_eagle_corpus.py (train/corpus.py), whose
   fixed held-out set is used for every evaluation.
2. Features: one target forward per sequence gives, at every row, the residual stream
   entering the three aux layers (model/decoder.py `aux_layers`) and the final-normed
   hidden state, from which the target's soft labels over the draft vocabulary are
   computed on the fly. They are written in bfloat16 safetensors shards of at most
   --shard-positions positions (DIR/features/), and training streams them: one shard in
   memory at a time, whatever the corpus size.
3. Training-time test (EAGLE-3): step 1 runs the head on the target's features; step j
   feeds the head its own step j - 1 outputs (one position earlier), with each query
   seeing the step-1 keys of its chain's start and earlier plus one key per later step on
   its own chain -- exactly what drafting at depth j sees. Loss: cross-entropy against
   the target's distribution renormalised over the draft vocabulary (= KL up to a
   constant), weight decay**(j - 1) per step. The window of step k is a fixed function
   of (seed, k) (ShardStream), so --resume continues exactly the uninterrupted run.
4. Eval: on held-out answers (train-split prompts set aside, not the Spec-Bench eval
   split), after each epoch and at the end: the chain acceptance by position (greedy:
   position j accepted when steps 1..j all give the target's token) and the expected
   accepted tokens per pass.
5. Ship (--ship HEAD_DIR): the head in HEAD_DIR (the shipped one) is evaluated on the
   same held-out chains; the new head replaces it only when it gives more expected tokens
   per pass (ties keep the old one).

Resumable (--resume: answers, feature shards and the optimizer checkpoint are reused), a
progress bar, a time limit (--train-minutes), a stop step (--stop-at-step). Output: DIR in
the EAGLE-3 layout (formats/eagle3.py) plus report.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass

import torch

from specbuild.errors import SpecbuildError
from specbuild.formats import eagle3
from specbuild.train import medusa as mt

FEATURES_DIR = "features"
SHARD_POSITIONS = 16384


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
    shard_positions: int = SHARD_POSITIONS  # positions per feature shard (one shard in memory at a time)
    max_positions: int | None = None  # train on a seeded subset of at most this many positions
    stop_step: int | None = None  # stop (checkpointed) at this step; --resume continues the same schedule

    def __post_init__(self) -> None:
        for name, value, lo, hi in (("draft-vocab", self.draft_vocab, 16, 1 << 20), ("ttt-steps", self.ttt_steps, 1, 8),
                                    ("max-prompts", self.max_prompts, 1, 1 << 20),
                                    ("eval-prompts", self.eval_prompts, 0, 1 << 20),
                                    ("max-rows", self.max_rows, 8, 1 << 16),
                                    ("shard-positions", self.shard_positions, 64, 1 << 24)):
            if not isinstance(value, int) or not lo <= value <= hi:
                raise SpecbuildError(f"--{name} {value!r} is out of range [{lo}, {hi}]")
        for name, value in (("max-positions", self.max_positions), ("stop-at-step", self.stop_step),
                            ("steps", self.steps)):
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise SpecbuildError(f"--{name} {value!r} must be a positive integer")
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
        dev = cache.device
        rows = torch.arange(n, device=dev)
        slots = slots.to(dev)
        batch = ForwardBatch(torch.tensor(ids, device=dev), torch.arange(n, device=dev), slots, slots,
                             torch.ones(n, n, dtype=torch.bool, device=dev).tril(), rows)
        out = model.forward(batch, cache, return_hidden=True, aux_layers=aux_layers, aux_rows=rows)
        hidden, feats = out.hidden, out.aux
        return feats, hidden
    finally:
        cache.release(seq_id)


def shard_groups(seqs: list[dict], shard_positions: int) -> list[list[int]]:
    """Consecutive runs of sequence indices of at most `shard_positions` positions (a longer
    sequence alone)."""
    groups, cur, n = [], [], 0
    for i, s in enumerate(seqs):
        length = len(s["prompt_ids"]) + len(s["answer_ids"])
        if cur and n + length > shard_positions:
            groups.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += length
    if cur:
        groups.append(cur)
    return groups


def features_fingerprint(bundle_dir: str, aux_layers) -> str:
    """What the features depend on beside the tokens: the bundle (its bundle.json: target,
    formats, dtype) and the aux layers."""
    with open(os.path.join(bundle_dir, "bundle.json"), "rb") as f:
        meta = f.read()
    return hashlib.sha1(meta + json.dumps(list(aux_layers)).encode()).hexdigest()[:16]


def write_shards(engine, seqs: list[dict], aux_layers, root: str, prefix: str, shard_positions: int, resume: bool,
                 progress: bool, desc: str, fingerprint: str = "") -> tuple[list[dict], int]:
    """Target features of `seqs` in safetensors shards `root/<prefix>_NNNNN.safetensors` of at
    most `shard_positions` positions each (ids int32, feats [N, 3H] and hidden [N, H] bfloat16,
    offsets, answer_start), so that training reads one shard at a time. A shard whose
    sequences (ids, a hash of their tokens, `fingerprint`: the bundle and aux layers; in its
    metadata) are unchanged is kept when resuming. Returns (the index: per shard {"file",
    "lengths", "positions", "seqs"}, also written to root/<prefix>.json; shards computed now)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    os.makedirs(root, exist_ok=True)
    groups = shard_groups(seqs, shard_positions)
    index, todo = [], []
    for k, group in enumerate(groups):
        name = f"{prefix}_{k:05d}.safetensors"
        tokens = hashlib.sha1(json.dumps([seqs[i]["prompt_ids"] + seqs[i]["answer_ids"] for i in group]).encode())
        key = json.dumps({"fingerprint": fingerprint, "tokens": tokens.hexdigest(),
                          "seqs": [[str(seqs[i]["id"]), len(seqs[i]["prompt_ids"]), len(seqs[i]["answer_ids"])]
                                   for i in group]})
        lengths = [len(seqs[i]["prompt_ids"]) + len(seqs[i]["answer_ids"]) for i in group]
        index.append({"file": name, "lengths": lengths, "positions": sum(lengths), "seqs": group})
        path = os.path.join(root, name)
        if resume and os.path.isfile(path):
            with safe_open(path, framework="pt") as f:
                if (f.metadata() or {}).get("key") == key:
                    continue
        todo.append((path, key, group))
    bar = tqdm(total=sum(len(seqs[i]["prompt_ids"]) + len(seqs[i]["answer_ids"]) for _, _, g in todo for i in g),
               desc=desc, unit="pos", unit_scale=True, disable=not progress or not todo)
    for path, key, group in todo:
        ids, feats, hidden, offsets, starts = [], [], [], [0], []
        for i in group:
            s = seqs[i]
            seq_ids = s["prompt_ids"] + s["answer_ids"]
            f, h = target_features(engine.model, engine.cache, seq_ids, aux_layers)
            ids.append(torch.tensor(seq_ids, dtype=torch.int32))
            feats.append(f.to(torch.bfloat16).cpu())
            hidden.append(h.to(torch.bfloat16).cpu())
            offsets.append(offsets[-1] + len(seq_ids))
            starts.append(len(s["prompt_ids"]))
            bar.update(len(seq_ids))
        tmp = path + ".tmp"
        save_file({"ids": torch.cat(ids), "feats": torch.cat(feats), "hidden": torch.cat(hidden),
                   "offsets": torch.tensor(offsets, dtype=torch.int64),
                   "answer_start": torch.tensor(starts, dtype=torch.int64)}, tmp, metadata={"key": key})
        os.replace(tmp, path)
    bar.close()
    for name in os.listdir(root):  # shards of an earlier, larger corpus
        if name.startswith(prefix + "_") and name not in {e["file"] for e in index}:
            os.remove(os.path.join(root, name))
    with open(os.path.join(root, prefix + ".json"), "w") as f:
        json.dump(index, f)
    return index, len(todo)


def read_shard(path: str, device: str = "cpu") -> list[dict]:
    """The sequences of one shard: {"ids" int64, "feats", "hidden" (bfloat16), "answer_start"},
    on `device`."""
    from safetensors.torch import load_file

    t = {k: v.to(device) if k in ("ids", "feats", "hidden") else v for k, v in load_file(path).items()}
    off = t["offsets"].tolist()
    return [{"ids": t["ids"][a:b].long(), "feats": t["feats"][a:b], "hidden": t["hidden"][a:b],
             "answer_start": int(st)} for a, b, st in zip(off[:-1], off[1:], t["answer_start"].tolist())]


class ShardStream:
    """Training windows over feature shards on disk, one shard in memory at a time.

    Epoch e visits the shards in a seeded order and, inside each, its windows (<= max_rows
    positions of one sequence) in a seeded order; step k is a fixed function of (seed, k),
    so a resumed run sees the same windows as an uninterrupted one. `chosen` (global sequence
    indices) restricts training to a subset (--max-positions)."""

    def __init__(self, root: str, index: list[dict], max_rows: int, seed: int, chosen: set[int] | None = None,
                 device: str = "cpu") -> None:
        self.root, self.index, self.seed, self.device = root, index, seed, device
        self.windows = []  # per shard: [(local seq, start)]
        for entry in index:
            w = [(j, st) for j, (g, length) in enumerate(zip(entry["seqs"], entry["lengths"]))
                 if chosen is None or g in chosen for st in range(0, max(1, length - 1), max_rows)]
            self.windows.append(w)
        self.per_epoch = sum(map(len, self.windows))
        if self.per_epoch == 0:
            raise SpecbuildError("no training windows: the corpus or --max-positions selects no sequence")
        self._plan: tuple[int, list] | None = None
        self._shard: tuple[int, list[dict]] | None = None
        self.loads = 0

    def plan(self, epoch: int) -> list[tuple[int, int, int]]:
        if self._plan is None or self._plan[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            out = []
            for k in torch.randperm(len(self.windows), generator=gen).tolist():
                w = self.windows[k]
                out += [(k, *w[i]) for i in torch.randperm(len(w), generator=gen).tolist()]
            self._plan = (epoch, out)
        return self._plan[1]

    def shard(self, k: int) -> list[dict]:
        if self._shard is None or self._shard[0] != k:
            self._shard = None  # the previous one is freed before the next is read
            self._shard = (k, read_shard(os.path.join(self.root, self.index[k]["file"]), self.device))
            self.loads += 1
        return self._shard[1]

    def item(self, step: int) -> tuple[dict, int]:
        epoch, off = divmod(step, self.per_epoch)
        k, j, start = self.plan(epoch)[off]
        return self.shard(k)[j], start


def make_draft_ids(seqs: list[dict], vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent target tokens of the training text (ties: lower id), sorted."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    for s in seqs:
        ids = s["ids"] if "ids" in s else torch.tensor(s["prompt_ids"] + s["answer_ids"])
        counts += torch.bincount(ids, minlength=vocab).double()
    score = counts * vocab + (vocab - torch.arange(vocab, dtype=torch.float64))
    return torch.sort(score.topk(min(size, vocab)).indices).values


def choose_positions(seqs: list[dict], max_positions: int | None, seed: int) -> list[int]:
    """Global indices of the sequences trained on: all, or a seeded sample's prefix of at most
    `max_positions` positions (the same order for every size, so smaller sets are subsets of
    larger ones)."""
    if max_positions is None:
        return list(range(len(seqs)))
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed + 104729)).tolist()
    out, n = [], 0
    for i in order:
        length = len(seqs[i]["prompt_ids"]) + len(seqs[i]["answer_ids"])
        if n + length > max_positions:
            continue
        out.append(i)
        n += length
    return sorted(out)


def load_head_dir(path: str, target_config, embed: torch.Tensor, max_pos: int):
    """An EAGLE-3 checkpoint directory (train-eagle's output, the shipped head) as an EagleHead
    in float32 over the target's embedding."""
    from specbuild.compiler.eagle_role import check_against_target
    from specbuild.speculation.eagle_head import EagleHead, HeadConfig

    config, tensors = eagle3.read_eagle3(path)
    aux = check_against_target(config, target_config)
    draft_ids = eagle3.ids_from_d2t(tensors.pop("d2t")) if "d2t" in tensors else torch.arange(target_config.vocab_size)
    w = {k: v.float().to(embed.device) for k, v in tensors.items() if k not in ("t2d", "embed_tokens.weight")}
    return EagleHead(HeadConfig.from_eagle3(config, aux), w, embed, draft_ids, max_pos)


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
        return {k.replace("__", "."): p.detach().to("cpu", dtype).contiguous().clone() for k, p in self.params.items()}


def ttt_forward(head, ids: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Logits [T - j, N] of TTT step j (j = 1..steps) for one sequence: step j's row r is
    head position p = r + j - 1, predicting token p + 2 (label: target row p + 1)."""
    t = ids.shape[0] - 1  # head positions 0 .. T - 2
    dev = ids.device
    emb = head.embed_tokens(ids[1:])  # [t, H]: embedding of token p + 1
    pos = torch.arange(t, device=dev)
    out, k1, v1 = head.layer(emb, head.project(feats[:t]), pos, None, None, None)
    outs, logits = [out], [head.logits(out)]
    keys, vals = [k1], [v1]  # step i's keys for positions i - 1 .. t - 1
    for j in range(2, steps + 1):
        n = t - (j - 1)
        if n <= 0:
            break
        p = torch.arange(j - 1, t, device=dev)  # query positions
        hid = outs[-1][:-1]  # step j - 1's output at p - 1
        # visible: step-1 keys at q <= p - j + 1; step-i keys (2 <= i < j) at q = p - j + i; own diagonal
        cols = []
        q1 = torch.arange(t, device=dev)
        cols.append(q1[None, :] <= (p - j + 1)[:, None])
        for i in range(2, j):
            qi = torch.arange(i - 1, t, device=dev)
            cols.append(qi[None, :] == (p - j + i)[:, None])
        mask = torch.cat(cols + [torch.eye(n, dtype=torch.bool, device=dev)], dim=1)
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
        correct = [(head.draft_ids[lg.argmax(-1)] == target_tok[j:]).cpu() for j, lg in enumerate(logits)]
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
def beats(new: dict, old: dict) -> bool:
    """Whether held-out evaluation `new` beats `old` (same chains, same depth): more expected
    tokens per pass, ties going to the old head."""
    return new["expected_accepted_per_pass"] > old["expected_accepted_per_pass"]


def train_eagle(bundle_dir: str, data_path: str | None, out_dir: str, cfg: EagleTrainConfig = EagleTrainConfig(),
                resume: bool = False, progress: bool = True, log=print, corpus: str | None = None,
                ship: str | None = None, features_dir: str | None = None, init: str | None = None,
                device: str = "cpu") -> dict:
    """Answers (or a built corpus), feature shards, training with held-out evaluation after
    each epoch, the head in DIR; with `ship`, the head also replaces the one in `ship` when
    its held-out acceptance beats that one's on the same held-out chains (module docstring).
    With `init`, training starts from that head directory's weights and draft vocabulary
    (a warm start: the shipped head adapted to another format's features). `device`: where the
    target computes the features and the head trains (a CUDA device makes the full run a matter of
    minutes; the bundle's arithmetic there is that device's, docs/eagle-training.md)."""
    import shutil

    from specbuild.engine.engine import Engine, EngineConfig, load_weights
    from specbuild.model.qlinear import as_dense
    from specbuild.speculation.eagle_head import EagleHead, HeadConfig, init_head_weights

    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    engine = Engine(bundle_dir, EngineConfig(device=device))
    tc = engine.target_config
    aux = eagle3.default_aux_layers(tc.num_layers)
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(out_dir, "checkpoint.pt")
    # a shared features_dir (several runs over one corpus: a scale curve) keeps every shard whose
    # sequences are unchanged (their ids and lengths are in its metadata)
    feat_dir = features_dir or os.path.join(out_dir, FEATURES_DIR)
    reuse = resume or features_dir is not None
    if not resume:
        for name in ("answers_greedy.jsonl", "answers_sampled.jsonl", "answers_eval.jsonl", "checkpoint.pt"):
            if os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
        if features_dir is None:
            shutil.rmtree(feat_dir, ignore_errors=True)
    if corpus is not None:
        from specbuild.train.corpus import load_corpus

        seqs, eval_seqs = load_corpus(corpus, tc.vocab_size)
        how = f"corpus {os.path.abspath(corpus)}"
        log(f"data: {how}; {len(seqs)} training answers, {len(eval_seqs)} held-out answers")
    else:
        acfg = cfg.answers_cfg(0.0)
        train_recs, eval_recs, how = mt.split_records(mt.load_records(data_path), acfg)
        n_eval = min(cfg.eval_prompts, max(0, len(train_recs) // 5))
        held, train_recs = train_recs[:n_eval], train_recs[n_eval:]  # held-out answers from the train split
        log(f"data: {how}; {len(train_recs)} training prompts, {len(held)} held out (Spec-Bench eval split unused: "
            f"{len(eval_recs)} prompts)")
        seqs = mt.distill(engine, train_recs, cfg.max_prompts, acfg, os.path.join(out_dir, "answers_greedy.jsonl"),
                          progress)
        if cfg.sampled:
            sampled = mt.distill(engine, train_recs, cfg.max_prompts, cfg.answers_cfg(0.8),
                                 os.path.join(out_dir, "answers_sampled.jsonl"), progress)
            seqs += [{**s, "id": f"{s['id']}~s"} for s in sampled]
        eval_seqs = mt.distill(engine, held, len(held), acfg, os.path.join(out_dir, "answers_eval.jsonl"), progress) \
            if held else []
    if not seqs:
        raise SpecbuildError("no training answers: every prompt was too long or the target answered with < 2 tokens")
    fp = features_fingerprint(bundle_dir, aux)
    index, written = write_shards(engine, seqs, aux, feat_dir, "shard", cfg.shard_positions, reuse, progress,
                                  "features", fp)
    eval_data = []
    if eval_seqs:
        held_index, _ = write_shards(engine, eval_seqs, aux, feat_dir, "heldout", cfg.shard_positions, reuse, progress,
                                     "held-out features", fp)
        for entry in held_index:
            eval_data += read_shard(os.path.join(feat_dir, entry["file"]), device)
    chosen = choose_positions(seqs, cfg.max_positions, cfg.seed)
    train_positions = sum(len(seqs[i]["prompt_ids"]) + len(seqs[i]["answer_ids"]) for i in chosen)
    rows_w = load_weights(os.path.join(bundle_dir, engine.meta.roles["target"]["path"]), "cpu")
    full_out = as_dense(rows_w.get("lm_head", rows_w["embed"])).float().to(device)
    embed = as_dense(rows_w["embed"]).float().to(device)
    max_pos = engine.max_seq_len + 64
    if init is not None:  # warm start: the given head's weights and its draft vocabulary
        start = load_head_dir(init, tc, embed, max_pos)
        if tuple(start.config.aux_layers) != tuple(aux):
            raise SpecbuildError(f"--init {init!r}: its head reads aux layers {tuple(start.config.aux_layers)}, "
                                 f"this target's default is {tuple(aux)}")
        draft_ids = start.draft_ids
        head = EagleHead(start.config, {k: v.clone() for k, v in start.w.items()}, embed, draft_ids, max_pos)
        log(f"starting from the head in {init} ({int(draft_ids.numel())} draft tokens)")
    else:
        draft_ids = make_draft_ids([seqs[i] for i in chosen], tc.vocab_size, cfg.draft_vocab)
        head_cfg = HeadConfig(tc.hidden_size, tc.intermediate_size, tc.num_heads, tc.num_kv_heads, tc.head_dim,
                              tc.rms_norm_eps, tc.rope_theta, tc.rope_scaling, tc.vocab_size, aux)
        init_w = {k: v.to(device) for k, v in init_head_weights(rows_w, tc, draft_ids, aux, cfg.seed).items()}
        head = EagleHead(head_cfg, init_w, embed, draft_ids, max_pos)
    draft_ids = head.draft_ids.cpu()
    out_rows = full_out[head.draft_ids].contiguous()
    del engine
    model = TrainHead(head)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    stream = ShardStream(feat_dir, index, cfg.max_rows, cfg.seed, set(chosen) if cfg.max_positions else None,
                         device)
    total = cfg.steps or max(1, int(cfg.epochs * stream.per_epoch))
    log(f"training on {len(chosen)} sequences, {train_positions} positions in {len(index)} feature shards: "
        f"{total} steps, {stream.per_epoch} windows per epoch")
    step, history = mt.resume_state(model, optim, ckpt, resume, total, log)
    epochs = torch.load(ckpt, map_location="cpu", weights_only=False).get("epochs", []) \
        if resume and os.path.isfile(ckpt) else []
    model.sync()
    depth = cfg.ttt_steps + 2
    before = evaluate(head, eval_data, out_rows, full_out, cfg, depth) if eval_data else None  # as eval_after

    def batch_loss(k: int):
        s, st = stream.item(k)
        loss, agree = seq_loss(head, s, out_rows, cfg, st)
        return loss, {"agree": f"{float(agree):.2f}"}

    def after_step(k: int) -> bool:
        if eval_data and k % stream.per_epoch == 0:
            ev = evaluate(head, eval_data, out_rows, full_out, cfg, depth)
            epochs.append({"epoch": k // stream.per_epoch, "step": k, **ev})
            log(f"epoch {k // stream.per_epoch} (step {k}): held-out acceptance by position "
                f"{ev['acceptance_by_position']}, {ev['expected_accepted_per_pass']} tokens per pass")
        return cfg.stop_step is not None and k >= cfg.stop_step

    t_train = time.perf_counter()
    step = mt.train_loop(model, optim, step, total, history, batch_loss, peak_lr=cfg.lr, ckpt_path=ckpt,
                         config=asdict(cfg), checkpoint_minutes=cfg.checkpoint_minutes,
                         train_minutes=cfg.train_minutes, desc="train-eagle", progress=progress, log=log,
                         smoothing=0.98, after_step=after_step, extra_state=lambda: {"epochs": epochs})
    train_seconds = time.perf_counter() - t_train
    after = evaluate(head, eval_data, out_rows, full_out, cfg, depth) if eval_data else None
    weights = model.export()
    weights["d2t"] = eagle3.d2t_from_ids(draft_ids)
    weights["t2d"] = eagle3.t2d_from_ids(draft_ids, tc.vocab_size)
    config = eagle3.make_config(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                                num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
                                rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta, rope_scaling=tc.rope_scaling,
                                vocab_size=tc.vocab_size, draft_vocab_size=int(draft_ids.numel()),
                                max_position_embeddings=tc.max_position_embeddings, aux_layers=aux)
    eagle3.write_eagle3(out_dir, config, weights)
    report = {"data": how, "train_sequences": len(chosen), "train_rows": train_positions,
              "corpus_sequences": len(seqs), "feature_shards": len(index), "shards_computed": written,
              "shard_loads": stream.loads,
              "eval_sequences": len(eval_data), "steps": step, "total_steps": total,
              "windows_per_epoch": stream.per_epoch, "train_seconds": round(train_seconds, 1),
              "seconds": round(time.perf_counter() - t_start, 1), "aux_layers": list(aux),
              "draft_vocab": int(draft_ids.numel()), "init": os.path.abspath(init) if init else None,
              "config": asdict(cfg), "eval_before": before,
              "eval_after": after, "epochs": epochs, "final_loss": history[-1] if history else None}
    if ship is not None:
        report["ship"] = ship_decision(ship, out_dir, report, eval_data, tc, embed, max_pos, out_rows, full_out, cfg,
                                       depth, log)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    if report.get("ship", {}).get("shipped"):
        shutil.copyfile(os.path.join(out_dir, "report.json"), os.path.join(ship, "train_report.json"))
    return report


def ship_decision(ship: str, out_dir: str, report: dict, eval_data: list[dict], tc, embed, max_pos: int,
                  out_rows, full_out, cfg: EagleTrainConfig, depth: int, log) -> dict:
    """Evaluate the head in `ship` on the same held-out chains; copy the new head's files
    there only when it beats that one (or `ship` holds no head yet)."""
    import shutil

    if not eval_data:
        raise SpecbuildError("--ship needs held-out answers to compare on (--eval-prompts > 0 or a corpus with "
                             "held-out prompts)")
    new = report["eval_after"]
    old = None
    if os.path.isfile(os.path.join(ship, eagle3.CONFIG)):
        old_head = load_head_dir(ship, tc, embed, max_pos)
        if tuple(old_head.config.aux_layers) != tuple(report["aux_layers"]):
            raise SpecbuildError(f"--ship {ship!r}: its head reads aux layers {old_head.config.aux_layers}, the new "
                                 f"one {report['aux_layers']}; held-out features differ, so they cannot be compared")
        old = evaluate(old_head, eval_data, out_rows, full_out, cfg, depth)
    wins = old is None or beats(new, old)
    if wins:
        os.makedirs(ship, exist_ok=True)
        for name in (eagle3.CONFIG, eagle3.WEIGHTS):
            shutil.copyfile(os.path.join(out_dir, name), os.path.join(ship, name))
    log(f"--ship {ship}: new head {new['expected_accepted_per_pass']} tokens per pass on the held-out chains, "
        f"{'no head there' if old is None else 'the one there ' + str(old['expected_accepted_per_pass'])}: "
        f"{'shipped' if wins else 'kept the one there'}")
    return {"dir": os.path.abspath(ship), "baseline_eval": old, "new_eval": new, "shipped": wins}
