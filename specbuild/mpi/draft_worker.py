"""The draft rank: the wire format of draft traffic, the worker that answers it, its MPI loop.

Everything travels as flat numpy buffers (no pickles):

request  int64 [REQ_HEAD + n * REQ_FIELDS + new tokens + releases]
         head: kind, step, n_seqs, n_release
         per sequence: seq_id, keep (KV length the target committed: roll the draft cache
         back to it), sent_before (text length the drafter should already hold), n_new
         (tokens that follow in the token area), gamma, top_k, seed, temperature and top_p
         (float64 bit patterns)
reply    int64 [REP_HEAD + n * REP_FIELDS + drafted tokens]
         head: step, n_seqs, draft time (seconds), total length, when the request was seen
         and when the reply was ready (time.monotonic of the draft rank: one clock per host);
         the times are float64 bit patterns
         per sequence: seq_id, status (OK / RESYNC / FAILED), n_tokens
probs    float32 [rows, vocab]: for each OK sampled sequence in order, its n_tokens rows
         (the distribution each draft token was sampled from; rejection sampling needs it)

The worker keeps a mirror of every sequence's text (prompt + accepted output), grown by
the new tokens each request carries, and drives the bundle's DraftModelProposer on it.
A text-length mismatch answers RESYNC (the verifier resends the whole text and the draft
cache re-prefills); a drafter exception answers FAILED for the sequences it touched, whose
state is dropped; the verifier decodes those plainly.

A PREFILL request (no reply) carries the prompts of sequences the target is prefilling: the
worker mirrors them and fills the draft cache with their K/V meanwhile, so the first draft
request of each only feeds its first output token. A failure there just drops the mirrors;
the next draft request then gets RESYNC and the whole text again.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from specbuild.sampling.params import SamplingParams
from specbuild.speculation.proposers.remote import FAILED, OK, RESYNC, Order, ReplyTiming

log = logging.getLogger("specbuild.draft_worker")

KIND_DRAFT, KIND_RELEASE, KIND_STOP, KIND_PREFILL = 1, 2, 3, 4
TAG_REQUEST, TAG_REPLY, TAG_PROBS, TAG_HELLO = 11, 12, 13, 14
REQ_HEAD, REQ_FIELDS = 4, 10
REP_HEAD, REP_FIELDS = 6, 3
HELLO_LEN = 4  # pid, vocab, draft cache blocks, 0
DRAFT_SEED_SALT = 0x5DEECE66D  # the drafter's uniforms: a stream apart from the verifier's


def f2i(x: float) -> int:
    return int(np.array([x], dtype=np.float64).view(np.int64)[0])


def i2f(x: int) -> float:
    return float(np.array([x], dtype=np.int64).view(np.float64)[0])


def encode_request(kind: int, step: int, orders: list[Order], releases: list[int]) -> np.ndarray:
    head = [kind, step, len(orders), len(releases)]
    fields, tokens = [], []
    for o in orders:
        fields += [o.seq_id, o.keep, o.sent_before, len(o.new_tokens), o.gamma, o.top_k, o.seed,
                   f2i(o.temperature), f2i(o.top_p), o.salt]
        tokens += o.new_tokens
    return np.array(head + fields + tokens + list(releases), dtype=np.int64)


def decode_request(buf: np.ndarray) -> tuple[int, int, list[Order], list[int]]:
    kind, step, n, n_release = (int(v) for v in buf[:REQ_HEAD])
    rows = buf[REQ_HEAD:REQ_HEAD + n * REQ_FIELDS].reshape(n, REQ_FIELDS).tolist()
    t = REQ_HEAD + n * REQ_FIELDS
    orders = []
    for seq_id, keep, sent_before, n_new, gamma, top_k, seed, temp, top_p, salt in rows:
        orders.append(Order(seq_id, keep, sent_before, buf[t:t + n_new].tolist(), gamma, top_k, seed,
                            i2f(temp), i2f(top_p), salt))
        t += n_new
    return kind, step, orders, buf[t:t + n_release].tolist()


def encode_reply(step: int, results: list[tuple[int, int, list[int], torch.Tensor | None]], vocab: int,
                 draft_seconds: float, seen_at: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """results: (seq_id, status, tokens, probs [k, vocab] or None). Returns (meta, probs)."""
    fields, tokens, prob_rows = [], [], []
    for seq_id, status, toks, probs in results:
        fields += [seq_id, status, len(toks)]
        tokens += toks
        if probs is not None:
            prob_rows.append(probs.float().numpy())
    probs = np.ascontiguousarray(np.concatenate(prob_rows)) if prob_rows else np.zeros((0, vocab), np.float32)
    meta = np.array([step, len(results), f2i(draft_seconds), 0, f2i(seen_at), 0] + fields + tokens, dtype=np.int64)
    meta[3] = len(meta)
    meta[5] = f2i(time.monotonic())
    return meta, probs


def decode_reply(meta: np.ndarray, probs: np.ndarray, sampled: set[int]) -> tuple[int, dict, ReplyTiming]:
    """-> (step, {seq_id: (status, tokens, probs [k, vocab] or None)}, timing).
    `sampled`: the seq_ids whose drafts carry probabilities (non-greedy requests)."""
    step, n = int(meta[0]), int(meta[1])
    timing = ReplyTiming(i2f(int(meta[2])), i2f(int(meta[4])), i2f(int(meta[5])))
    rows = meta[REP_HEAD:REP_HEAD + n * REP_FIELDS].reshape(n, REP_FIELDS).tolist()
    t, r, out = REP_HEAD + n * REP_FIELDS, 0, {}
    for seq_id, status, k in rows:
        toks = meta[t:t + k].tolist()
        t += k
        p = None
        if seq_id in sampled and status == OK:
            p = torch.from_numpy(probs[r:r + k].copy())
            r += k
        out[seq_id] = (status, toks, p)
    return step, out, timing


class MirrorSeq:
    """What DraftModelProposer needs of a sequence, kept on the draft rank."""

    def __init__(self, seq_id: int, params: SamplingParams, salt: int = 0) -> None:
        self.seq_id = seq_id
        self.params = params
        self.salt = salt  # the request's cache_salt (kv_cache.salt_key): the draft cache's prefix reuse
        self.all_ids: list[int] = []
        self.generator = torch.Generator().manual_seed((params.seed ^ DRAFT_SEED_SALT) % (1 << 63))

    def uniforms(self, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self.generator, dtype=torch.float64)


class DraftWorker:
    """Answers draft requests with a DraftModelProposer (transport-agnostic)."""

    def __init__(self, proposer, vocab: int) -> None:
        self.proposer = proposer
        self.vocab = vocab
        self.mirrors: dict[int, MirrorSeq] = {}
        self.requests = 0
        self.prefills = 0  # sequences whose prompt was prefilled ahead of their first draft

    def drop(self, seq_id: int) -> None:
        mirror = self.mirrors.pop(seq_id, None)
        if mirror is not None:
            self.proposer.release(mirror)

    def prefill(self, orders: list[Order]) -> None:
        """Mirror new sequences' prompts and prefill the draft cache with them (no reply)."""
        mirrors = []
        for o in orders:
            if o.sent_before != 0 or o.seq_id in self.mirrors:  # prefill only ever opens a sequence
                log.warning("sequence %d: prefill of a sequence the drafter already holds; dropping it", o.seq_id)
                self.drop(o.seq_id)
                continue
            params = SamplingParams(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, seed=o.seed)
            mirror = self.mirrors[o.seq_id] = MirrorSeq(o.seq_id, params, o.salt)
            mirror.all_ids.extend(o.new_tokens)
            mirrors.append(mirror)
        try:
            self.proposer.prefill(mirrors)
            self.prefills += len(mirrors)
        except Exception:  # the next draft request of each resyncs
            log.exception("prefilling sequences %s failed; they will be resent", [m.seq_id for m in mirrors])
            for mirror in mirrors:
                self.drop(mirror.seq_id)

    def handle(self, buf: np.ndarray, seen_at: float = 0.0) -> tuple[int, tuple[np.ndarray, np.ndarray] | None]:
        """One request -> (kind, (meta, probs) or None when no reply is due). seen_at: when
        it arrived (time.monotonic), reported back for the verifier's latency figures."""
        kind, step, orders, releases = decode_request(buf)
        for seq_id in releases:
            self.drop(seq_id)
        if kind == KIND_PREFILL:
            self.prefill(orders)
        if kind != KIND_DRAFT:
            return kind, None
        self.requests += 1
        t0 = time.perf_counter()
        status: dict[int, int] = {}
        ready: list[tuple[MirrorSeq, int]] = []
        for o in orders:
            mirror = self.mirrors.get(o.seq_id)
            if mirror is None and o.sent_before == 0:
                params = SamplingParams(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, seed=o.seed)
                mirror = self.mirrors[o.seq_id] = MirrorSeq(o.seq_id, params, o.salt)
            if mirror is None or len(mirror.all_ids) != o.sent_before:
                log.warning("sequence %d: drafter holds %s tokens, verifier expected %d; asking for a resync",
                            o.seq_id, None if mirror is None else len(mirror.all_ids), o.sent_before)
                self.drop(o.seq_id)
                status[o.seq_id] = RESYNC
                continue
            mirror.all_ids.extend(o.new_tokens)
            self.proposer.rollback(mirror, o.keep)
            ready.append((mirror, o.gamma))
            status[o.seq_id] = OK
        drafts: dict[int, object] = {}
        if ready:
            try:
                for (mirror, _), draft in zip(ready, self.proposer.propose([m for m, _ in ready],
                                                                             [g for _, g in ready])):
                    drafts[mirror.seq_id] = draft
            except Exception:  # degrade exactly the sequences this call touched
                log.exception("drafting failed for sequences %s; they continue without drafts",
                              [m.seq_id for m, _ in ready])
                for mirror, _ in ready:
                    self.drop(mirror.seq_id)
                    status[mirror.seq_id] = FAILED
        results = []
        for o in orders:
            d = drafts.get(o.seq_id)
            toks = list(d.tokens) if (d is not None and status[o.seq_id] == OK) else []
            probs = d.probs if (d is not None and status[o.seq_id] == OK and o.temperature > 0) else None
            if o.temperature > 0 and status[o.seq_id] == OK and probs is None:
                probs = torch.zeros(0, self.vocab)
            results.append((o.seq_id, status[o.seq_id], toks, probs))
        return kind, encode_reply(step, results, self.vocab, time.perf_counter() - t0, seen_at)


# the drafters the draft rank serves: a draft model (with its own embedding/output rows or
# sharing the target's). Medusa and EAGLE heads read the target's hidden states of every
# step, so they stay on rank 0 and run there as ordinary speculation (mpi/minedraft.py).
DRAFT_RANK_METHODS = ("draft",)


def no_draft_message(bundle_dir: str, roles: dict) -> str:
    """Why --parallel-draft refuses a bundle without a draft model (on both ranks)."""
    others = [r for r in ("medusa", "eagle") if r in roles]
    hint = (f"; Medusa and EAGLE heads (this bundle has {', '.join(others)}) read the target's hidden states, so "
            "they run beside the target: serve it without mpirun and --parallel-draft") if others else ""
    return (f"bundle {bundle_dir!r} has no draft model, the only drafter the draft rank runs (--parallel-draft "
            f"needs one: compile with --draft){hint}")


def shared_target_names(role: dict) -> list[str]:
    """The target tensors a draft role's `shares` names ({"embed": "target/embed", ...})."""
    names = []
    for name, ref in (role.get("shares") or {}).items():
        owner, _, tensor = str(ref).partition("/")
        if owner != "target" or not tensor:
            from specbuild.errors import BundleError

            raise BundleError(f"draft role shares {name!r} from {ref!r}; the draft rank reads only the target's "
                              "tensors ('target/<name>')")
        if tensor not in names:
            names.append(tensor)
    return names


def load_target_tensors(target_dir: str, names: list[str], device: str) -> dict:
    """Only the target tensors `names` (runtime names), as engine.load_weights would give
    them (plain tensors, or QLinear objects where the target's quant.json lists a format),
    without reading the target's other weights: the draft rank holds the draft model and the
    rows it shares, not a second target (SmolLM2-135M: 113 MB of embedding, not 538 MB)."""
    import json

    from safetensors import safe_open

    from specbuild.errors import BundleError
    from specbuild.model.qlinear import build_qlinears, ensure_aligned

    path = os.path.join(target_dir, "weights.safetensors")
    if not os.path.isfile(path):
        raise BundleError(f"{target_dir!r} has no weights.safetensors")
    quant = None
    quant_path = os.path.join(target_dir, "quant.json")
    if os.path.isfile(quant_path):
        with open(quant_path) as f:
            quant = json.load(f)
    entries = (quant or {}).get("tensors", {})
    with safe_open(path, framework="pt", device=device) as f:
        keys = set(f.keys())
        wanted = []
        for name in names:
            fmt = entries.get(name, {}).get("format", "dense")
            parts = [name] if name in keys else [f"{name}.{s}" for s in ("qweight", "scales", "zeros")
                                                  if f"{name}.{s}" in keys]
            if not parts:
                raise BundleError(f"the draft shares target/{name}, which the target's weights do not hold "
                                  f"({path!r}, format {fmt!r})")
            wanted += parts
        if quant is not None and "norm" in keys:  # build_qlinears takes the hidden dtype from it
            wanted.append("norm")
        tensors = {k: ensure_aligned(f.get_tensor(k)) for k in wanted}
    if quant is not None:
        tensors = build_qlinears(tensors, {**quant, "tensors": {n: e for n, e in entries.items() if n in names}})
        embed = tensors.get("embed")
        if embed is not None and not isinstance(embed, torch.Tensor) and ("lm_head" in entries or "lm_head" in keys):
            embed.rescore_top = 0  # as the whole target builds it: an untied embedding is not an output layer
    return {n: tensors[n] for n in names}


def load_draft_proposer(bundle_dir: str, config):
    """The bundle's draft model behind a DraftModelProposer, built as Engine.make_speculator
    builds it (same cache size, the same shared embedding / output rows and vocab_map, read
    from the target's file). config: EngineConfig. Returns (proposer, target vocab)."""
    from specbuild.bundle import read_meta, read_model_config
    from specbuild.errors import BundleError
    from specbuild.engine.engine import attach_format_plans, load_weights, shared_draft_weights
    from specbuild.model.decoder import Decoder
    from specbuild.speculation.proposers.draft_model import DraftModelProposer

    if config.threads:
        torch.set_num_threads(config.threads)
    meta = read_meta(bundle_dir)
    if "draft" not in meta.roles:
        raise BundleError(no_draft_message(bundle_dir, meta.roles))
    limits = meta.limits
    max_batch = config.max_batch_size or limits.max_batch_size
    kv_tokens = config.kv_cache_tokens or max_batch * (limits.max_seq_len + limits.max_draft_len + 16)
    num_blocks = -(-kv_tokens // config.block_size)
    target_dir = os.path.join(bundle_dir, meta.roles["target"]["path"])
    target_vocab = read_model_config(target_dir).vocab_size
    role = meta.roles["draft"]
    draft_dir = os.path.join(bundle_dir, role["path"])
    shared = load_target_tensors(target_dir, shared_target_names(role), config.device)
    weights, vocab_map = shared_draft_weights(bundle_dir, role, load_weights(draft_dir, config.device), shared)
    model = Decoder(read_model_config(draft_dir), weights, limits.max_seq_len + limits.max_draft_len + 2,
                    device=config.device)
    attach_format_plans(model, limits.max_draft_len)
    return DraftModelProposer(model, num_blocks, target_vocab, config.block_size, vocab_map=vocab_map,
                              prefix_cache=config.prefix_cache), target_vocab


def run_draft_rank(ctx, bundle_dir: str, config, timeout_s: float) -> int:
    """Rank 1's life: load the drafter, say hello, answer requests until STOP or the
    verifier is gone. Returns an exit status (the caller leaves with os._exit)."""
    proposer, vocab = load_draft_proposer(bundle_dir, config)
    worker = DraftWorker(proposer, vocab)
    parent = os.getppid()
    hello = np.array([os.getpid(), vocab, proposer.cache.num_blocks, 0], dtype=np.int64)
    if not ctx.notify(hello, TAG_HELLO, deadline_s=600):
        log.error("the verifier rank never took the hello: %s", ctx.reason)
        return 1
    log.info("draft rank ready (pid %d, vocab %d)", os.getpid(), vocab)

    def orphaned() -> bool:
        return os.getppid() != parent  # our guard died: nobody will ever stop us

    while True:
        count = ctx.probe(TAG_REQUEST, stop=orphaned)
        if count is None:
            log.info("draft rank leaving: %s", ctx.reason or "orphaned")
            return 0
        seen_at = time.monotonic()
        buf = ctx.recv_now(count, TAG_REQUEST, seen_at + timeout_s)
        if buf is None:
            return 0
        kind, reply = worker.handle(buf, seen_at)
        if kind == KIND_STOP:
            log.info("draft rank stopping (%d requests served)", worker.requests)
            return 0
        if reply is not None:
            meta, probs = reply
            if not ctx.wait([ctx.isend(meta, TAG_REPLY), ctx.isend(probs, TAG_PROBS)], None, stop=orphaned):
                return 0
