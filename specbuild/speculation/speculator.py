"""Speculation inside the scheduler's step: which drafter, how deep, verify, commit.

The scheduler calls, per step: `propose(decoding seqs) -> {seq: Draft}`, `bins(items)`,
`verify(seq, draft, target_logits) -> (accepted, new tokens)` and `commit(seq, length)`,
which moves the target's and every drafter's cache to the same length in one call.
"""

from __future__ import annotations

import functools

import logging
import time

import torch

from specbuild.speculation.binning import BinCost, plan
from specbuild.speculation.gamma import CostModel, GammaController, TreeCostModel, best_gamma, expected_tokens
from specbuild.model.kv_cache import PagedKVCache
from specbuild.model.decoder import Decoder
from specbuild.sampling.params import warp_probs
from specbuild.speculation.proposers.base import Draft, candidate_sources
from specbuild.sampling.acceptance import verify_chain_greedy, verify_chain_sampled, verify_tree_greedy, verify_tree_sampled, verify_tree_typical

log = logging.getLogger("specbuild.speculator")
# a cached width-1 verify cost more than this many times one live forward was measured under a
# load that has gone (the issue-32 case: 466 ms cached against a 108 ms step): measured again
LIVE_CHECK_FACTOR = 3.0


GRAMMAR = "grammar"  # Draft.method of the tokens a structured-output grammar forces


class MeasuredCosts(dict):
    """method -> CostModel; a drafter added after calibration (at load) gets the measured
    verify costs and its own step measured on first use."""

    def __init__(self, verify: dict[int, float], speculator: "Speculator") -> None:
        super().__init__()
        self.verify, self.speculator = verify, speculator

    def __missing__(self, method: str) -> CostModel:
        from specbuild.model.timing import forward_costs

        prop = self.speculator.proposers[method]
        draft = forward_costs(prop.model, prop.cache, [1], repeats=3)[1]["wall_ms"] / 1e3 if hasattr(prop, "model") else 0.0
        self[method] = CostModel(self.verify, draft)
        return self[method]


@functools.lru_cache(maxsize=256)
def nodes_within_depth(tree) -> list[int]:
    """[d] = how many of the tree's nodes lie within depth d (d = 0 .. max depth); once per tree."""
    return [sum(1 for p in tree.paths if len(p) <= d) for d in range(tree.max_depth + 1)]


class Speculator:
    def __init__(self, target: Decoder, cache: PagedKVCache, proposers: dict, max_draft_len: int,
                 max_seq_len: int, binning: str = "ragged", costs: dict[str, CostModel] | None = None) -> None:
        self.target = target
        self.cache = cache
        self.proposers = proposers  # method name -> proposer
        self.max_draft_len = max_draft_len
        self.max_seq_len = max_seq_len
        self.binning = binning
        self._costs = costs
        self._controller: GammaController | None = None
        self.bin_cost: BinCost | None = None
        self.emit = None  # callable(seq, kind, detail): failure-mode events (Engine.set_sink)
        self.last_draft_ms: dict[str, float] = {}  # method -> its last propose call, milliseconds

    # ---- costs, measured once on first use ---------------------------------------------------
    @property
    def controller(self) -> GammaController:
        if self._controller is None:
            if self._costs is None:
                self._costs = self.calibrate()
            self._controller = GammaController(self._costs)
            self._controller.emit = self.emit
        return self._controller

    def calibrate(self) -> dict[str, CostModel]:
        """Verify cost by width (and each drafter model's step), measured once per machine and
        bundle and kept in the cost cache (model/timing.cached_costs: keyed by CPU, flags,
        torch version, threads and the models' fingerprints), so a fresh process reads them
        instead of timing ~20 forwards. The engine calibrates at load, before any request."""
        from specbuild.model.timing import cached_costs, forward_costs, machine_key, model_fingerprint, warm_up

        t0 = time.perf_counter()
        widths = sorted({1, 2, 3, 5, self.max_draft_len + 1})
        drafters = {name: prop for name, prop in self.proposers.items() if hasattr(prop, "model")}
        levels = {name: prop for name, prop in self.proposers.items() if hasattr(prop, "level_cost")}

        def measure() -> dict:
            verify = forward_costs(self.target, self.cache, widths, repeats=3)
            drafts = {name: forward_costs(prop.model, prop.cache, [1], repeats=3)[1]["wall_ms"] / 1e3
                      for name, prop in drafters.items()}
            drafts.update({name: prop.level_cost() for name, prop in levels.items()})  # EAGLE, Medusa: per depth
            return {"verify": {str(w): c["wall_ms"] / 1e3 for w, c in verify.items()}, "draft": drafts}

        key = {"what": "speculation costs v1 (median seconds, 64 cached tokens)", "widths": widths,
               "machine": machine_key(self.target.device), "target": model_fingerprint(self.target),
               "drafters": {name: model_fingerprint(prop.model) for name, prop in drafters.items()},
               "levels": {name: prop.cost_key() for name, prop in levels.items()}}
        def check(cached: dict) -> str | None:  # one live width-1 forward against the cached cost
            live = forward_costs(self.target, self.cache, [1], repeats=1)[1]["min_ms"] / 1e3
            then = float(cached["verify"]["1"])
            return f"cached width-1 cost {then * 1e3:.2f} ms, live {live * 1e3:.2f} ms" \
                if then > LIVE_CHECK_FACTOR * live else None

        measured, cached = cached_costs(key, measure, timing=True, check=check)
        if cached:  # no forwards ran: set the kernels up now, not in the first request
            warm_up(self.target, self.cache, widths)
            for prop in drafters.values():
                warm_up(prop.model, prop.cache, [1])
        verify = {int(w): float(c) for w, c in measured["verify"].items()}
        costs = MeasuredCosts(verify, self)
        costs.update({name: CostModel(verify, float(measured["draft"].get(name, 0.0))) for name in self.proposers})
        for name, prop in self.proposers.items():
            if hasattr(prop, "verify_cost"):  # the EAGLE tree's node budget
                prop.verify_cost = costs[name].verify
        w1, wn = verify[1], verify[max(widths)]
        self.bin_cost = BinCost(pass_overhead=max(w1 - (wn - w1) / max(max(widths) - 1, 1), 1e-4),
                                token_cost=max((wn - w1) / max(max(widths) - 1, 1), 1e-6))
        log.info("speculation costs %s in %.2fs: verify %s", "read from the cache" if cached else "calibrated",
                 time.perf_counter() - t0, {k: round(v * 1e3, 2) for k, v in verify.items()})
        return costs

    def set_emit(self, emit) -> None:
        """Route failure-mode events (controller, drafters) to emit(seq, kind, detail); None: off."""
        self.emit = emit
        if self._controller is not None:
            self._controller.emit = emit
        for prop in self.proposers.values():
            if hasattr(prop, "emit"):
                prop.emit = emit

    # ---- per-step hooks ------------------------------------------------------------------------
    @property
    def wants_hidden(self) -> bool:
        """Medusa heads read the target's hidden state of the row that chose each root."""
        return "medusa" in self.proposers and hasattr(self.proposers["medusa"], "observe")

    def observe_hidden(self, seq, hidden_row: torch.Tensor) -> None:
        self.proposers["medusa"].observe(seq, hidden_row)

    def observe_logits(self, seq, tokens: list[int], rows: torch.Tensor) -> None:
        """Token recycling's table learns from every verified row (tokens[i] is row i's
        input token); only for requests that may draft with it (recycle, auto)."""
        rec = self.proposers.get("recycle")
        if rec is not None and seq.spec is not None and (seq.spec.method in ("recycle", "hybrid") or (
                seq.spec.method == "auto" and not seq.spec_state.auto_plain)):
            rec.observe(torch.tensor(tokens, dtype=torch.int64), rows)

    # EAGLE-3 heads read three of the target's hidden states (model/decoder.py aux_layers)
    @property
    def aux_layers(self) -> tuple[int, ...]:
        prop = self.proposers.get("eagle")
        return tuple(getattr(prop, "aux_layers", ()))

    def aux_rows(self, items: list) -> torch.Tensor | None:
        """Rows of the batch whose features the EAGLE head needs (call after the batch is
        built): every row of items whose request may draft with it (eagle, auto); None
        when there are none, so other requests pay nothing."""
        if not self.aux_layers:
            return None
        rows: list[int] = []
        for it in items:
            spec = getattr(it.seq, "spec", None)
            if spec is not None and (spec.method == "eagle" or (spec.method == "auto" and not it.seq.spec_state.auto_plain)):
                it.aux0 = len(rows)
                rows.extend(range(it.row0, it.row0 + it.width))
            else:
                it.aux0 = None
        return torch.tensor(rows, dtype=torch.int64) if rows else None

    def observe_features(self, seq, it, aux: torch.Tensor, accepted: int = 0) -> None:
        """Hand the head the features of seq's rows that are now part of its text: the
        chunk, then the accepted drafts in path order (before `compact` moves them)."""
        if getattr(it, "aux0", None) is None:
            return
        base = aux[it.aux0:it.aux0 + it.width]
        c = len(it.chunk)
        if it.n_draft and it.completes:
            nodes = list(seq.spec_state.accepted_nodes) if it.draft.parents is not None \
                else list(range(1, accepted + 1))
            feats = torch.cat([base[:c], base[torch.tensor(nodes, dtype=torch.int64) + c - 1]]) if nodes \
                else base[:c]
        else:
            feats = base[:c]
        self.proposers["eagle"].observe(seq, it.start, feats)

    def max_extra_tokens(self, seq) -> int:
        return self.max_draft_len + 1

    def on_admit(self, seq) -> None:
        pass

    def on_release(self, seq) -> None:
        for prop in self.proposers.values():
            prop.release(seq)

    def choose_method(self, seq) -> str | None:
        method = seq.spec.method if seq.spec is not None else "none"
        if method == "none" or method in seq.spec_state.draft_failed:
            return None
        if method != "auto":
            return method
        if seq.spec_state.auto_plain:
            return None
        best, best_rate = None, 0.0
        for name in self.proposers:
            if name in seq.spec_state.draft_failed:
                continue
            cm = self.cost_model(seq, name)
            alpha = self.controller.alpha(seq, name)
            g = best_gamma(alpha, max(1, seq.spec.gamma_min), max(1, seq.spec.gamma_max), cm)
            rate = expected_tokens(alpha, g) / (g * cm.draft_cost + cm.verify(g + 1))
            if rate > best_rate:
                best, best_rate = name, rate
        plain_rate = 1.0 / self.controller.costs[next(iter(self.proposers))].verify(1)
        if best_rate > plain_rate:
            return best
        seq.spec_state.auto_plain = True  # final: see SpecState.auto_plain
        return None

    def cost_model(self, seq, method: str):
        """The measured costs of `method` for seq; for Medusa, depth g verifies all of the
        request's tree within depth g (gamma.TreeCostModel)."""
        cm = self.controller.costs[method]
        validate = getattr(self.proposers.get(method), "validate_tree", None) if method in ("medusa", "recycle") \
            else None
        if validate is None:  # a chain drafter (or a tree proposer that does not name its tree)
            return cm
        return TreeCostModel(cm, nodes_within_depth(validate(getattr(seq.spec, "tree", None))))

    def propose(self, seqs: list, on_error=None) -> dict:
        """{seq: Draft} for the sequences that draft this step. A drafter that raises on a
        batch is retried one sequence at a time, so only the sequence it fails on loses its
        drafts (and decodes plainly from then on: see draft_failed); on_error(seq, exc,
        while_) takes a sequence's own failure (its grammar) and that sequence is left out;
        without on_error such a failure raises."""
        by_method: dict[str, list] = {}
        out = {}
        for seq in seqs:
            try:
                choice = self.plan_draft(seq)
            except Exception as e:
                if on_error is None:
                    raise
                on_error(seq, e, "choosing its drafts (its grammar's forced tokens, method, depth)")
                continue
            if isinstance(choice, Draft):  # the grammar's forced tokens: a free draft, whatever the method
                out[seq] = choice
            elif choice is not None:
                by_method.setdefault(choice[0], []).append((seq, choice[1]))
        for method, pairs in by_method.items():
            t0 = time.perf_counter()
            try:
                drafts = self.proposers[method].propose([s for s, _ in pairs], [g for _, g in pairs])
            except Exception as e:  # noqa: BLE001 - find the sequence it belongs to
                drafts = self.propose_apart(method, pairs, e)
            self.last_draft_ms[method] = (time.perf_counter() - t0) * 1e3
            for (seq, gamma), draft in zip(pairs, drafts):
                try:
                    draft = self.within_grammar(seq, draft)
                except Exception as e:
                    if on_error is None:
                        raise
                    on_error(seq, e, "checking its drafts against its grammar")
                    continue
                if draft is not None and len(draft) > 0:
                    out[seq] = draft
                else:
                    self.controller.record(seq, method, 0, 0)
        return out

    def plan_draft(self, seq) -> "Draft | tuple[str, int] | None":
        """seq's drafting this step: the grammar's forced tokens (a Draft), (method, gamma > 0),
        or None (plain). Records the choice (spec_state.method, gammas)."""
        forced = self.forced_draft(seq)
        if forced is not None:
            seq.gammas.append(len(forced))
            return forced
        method = self.choose_method(seq)
        seq.spec_state.method = method
        if method is None:
            seq.gammas.append(0)
            return None
        gamma = self.controller.next(seq, method, self.cost_model(seq, method))
        # never draft past the sequence's room (its max tokens or the context limit)
        gamma = max(0, min(gamma, self.max_draft_len, seq.remaining - 1))
        seq.gammas.append(gamma)
        return (method, gamma) if gamma > 0 else None

    def propose_apart(self, method: str, pairs: list, batch_error: Exception) -> list:
        """The drafter `method` raised on a batch: every sequence's drafter state goes back to
        what the target holds, then each is drafted alone. A sequence it fails on alone gets
        no draft and drafts no more with `method` (a plain step is lossless; a drafter that
        keeps failing on one sequence would otherwise cost every step a retry); its state is
        freed. The others get their drafts."""
        prop = self.proposers[method]
        log.warning("drafter %s failed on a batch of %d (%s: %s); drafting each alone", method, len(pairs),
                    type(batch_error).__name__, str(batch_error)[:200])
        for seq, _ in pairs:
            prop.rollback(seq, seq.num_cached)
        drafts = []
        for seq, gamma in pairs:
            try:
                drafts.append(prop.propose([seq], [gamma])[0])
                continue
            except Exception as e:  # noqa: BLE001 - this sequence's drafter failure only
                rid = seq.handle.request_id if getattr(seq, "handle", None) is not None else f"seq-{seq.seq_id}"
                log.error("drafter %s failed on request %s; it decodes plainly from here", method, rid, exc_info=e)
                error = e
            drafts.append(None)
            try:
                prop.rollback(seq, seq.num_cached)
                prop.release(seq)
            except Exception:  # noqa: BLE001 - logged; the sequence no longer uses this drafter
                log.exception("drafter %s could not drop request %s's state", method, rid)
            seq.spec_state.draft_failed = seq.spec_state.draft_failed | {method}
            if self.emit is not None:
                self.emit(seq, "draft_failure", {"method": method, "error": f"{type(error).__name__}: {error}"[:200],
                                                 "fallback": "plain"})
        return drafts

    def within_grammar(self, seq, draft: Draft | None) -> Draft | None:
        """A chain draft cut at its first token the request's grammar refuses (that token and
        what follows would be rejected anyway: the target's row there gives them probability
        0). Trees are left whole: verification never reaches their refused nodes."""
        if draft is None or seq.constraint is None or draft.parents is not None or not len(draft):
            return draft
        _, valid = seq.constraint.masks_along(draft.tokens)
        if valid == len(draft):
            return draft
        if valid == 0:
            return None
        draft.tokens = draft.tokens[:valid]
        if draft.probs is not None:
            draft.probs = draft.probs[:valid]
        return draft

    def forced_draft(self, seq) -> Draft | None:
        """The tokens a structured-output grammar forces from here, as a one-hot chain draft
        (None when it forces nothing): the target still verifies them, so a forced spelling the
        model would not choose is only rejected, never emitted."""
        if seq.constraint is None:
            return None
        tokens = seq.constraint.forced(max(0, min(self.max_draft_len, seq.remaining - 1)))
        return Draft(tokens, method=GRAMMAR) if tokens else None

    def bins(self, items: list) -> list[list]:
        if self.binning == "ragged" or len(items) <= 1:
            return [items]
        if self.binning == "padded":  # one pass, decode items padded to the widest
            widest = max((it.width for it in items if it.completes and len(it.chunk) == 1), default=0)
            for it in items:
                if it.completes and len(it.chunk) == 1:
                    it.pad = widest - it.width
            return [items]
        _ = self.controller  # make sure bin costs are calibrated
        groups = plan([it.width for it in items], self.binning, self.bin_cost)
        return [[items[i] for i in g] for g in groups]

    def verify(self, seq, draft, target_logits: torch.Tensor) -> tuple[int, list[int]]:
        """target_logits: [k + 1, vocab]. Returns (accepted drafts, tokens to append)."""
        k = len(draft.tokens)
        ids = torch.tensor(draft.tokens, dtype=torch.int64)
        if draft.parents is not None:
            res = self.verify_tree(seq, draft, target_logits)
            a = len(res.accepted_nodes)
            seq.spec_state.accepted_nodes = res.accepted_nodes
            draft.last_row = res.accepted_nodes[-1] if res.accepted_nodes else 0
            seq.spec_state.candidate_sources = candidate_sources(draft, a, res.accepted_nodes)
            # by depth: the fraction of tree steps whose accepted path reached depth d + 1
            self.record(seq, draft, k, a, depth_counts=[1] * max(draft.depths))
            return a, list(res.tokens)
        if seq.params.greedy:
            res = verify_chain_greedy(ids, target_logits)
        else:
            target_probs = warp_probs(target_logits, seq.params)  # [k + 1, vocab]
            draft_probs = draft.probs
            if draft_probs is not None:
                draft_probs = draft_probs.to(target_probs.device)
            res = verify_chain_sampled(ids, draft_probs, target_probs, seq.uniforms(k + 1))
        a = res.accepted
        seq.spec_state.candidate_sources = candidate_sources(draft, a)
        self.record(seq, draft, k, a)
        return a, list(res.tokens)

    def verify_tree(self, seq, draft, target_logits: torch.Tensor):
        """target_logits: [n + 1, vocab], row i = the target after tree node i (0 = root)."""
        node_tokens = torch.tensor([0, *draft.tokens], dtype=torch.int64)
        if seq.params.greedy:
            return verify_tree_greedy(draft.parents, node_tokens, target_logits)
        target_probs = warp_probs(target_logits, seq.params)
        uniforms = seq.uniforms(len(draft.parents))
        if seq.spec.typical:  # LOSSY, opt-in: Medusa's typical acceptance
            return verify_tree_typical(draft.parents, node_tokens, target_probs, uniforms)
        return verify_tree_sampled(draft.parents, node_tokens, target_probs, uniforms)

    def record(self, seq, draft, k: int, a: int, depth_counts: list[int] | None = None) -> None:
        """Acceptance statistics: drafted tokens (tree: nodes), accepted, and by position."""
        seq.drafted += k
        seq.accepted += a
        seq.count_by_position(depth_counts or [1] * k, a)
        if draft.method == GRAMMAR:  # free drafts say nothing about the drafters' acceptance
            return
        method = seq.spec_state.method or draft.method
        # a tree's "drafted" for the depth controller is its depth, not its node count
        depth = len(depth_counts) if depth_counts else k
        self.controller.record(seq, method, depth, a)

    def compact(self, seq, item, cache: PagedKVCache, accepted: int) -> None:
        """After a tree step, move the accepted path's K/V into contiguous positions right
        after the root; the other nodes' entries are dropped by the following commit."""
        nodes, seq.spec_state.accepted_nodes = seq.spec_state.accepted_nodes, ()
        assert len(nodes) == accepted
        root = item.start + len(item.chunk) - 1  # cache index of the root token
        moves = [(root + node, root + 1 + j) for j, node in enumerate(nodes) if node != j + 1]
        if not moves:
            return
        slots = cache.slots(seq.seq_id, 0, root + 1 + max(nodes))
        src = slots[torch.tensor([m[0] for m in moves])]
        dst = slots[torch.tensor([m[1] for m in moves])]
        cache.copy_slots(src.to(cache.device), dst.to(cache.device))

    def commit(self, seq, length: int) -> None:
        """Target and every drafter hold `length` valid tokens of seq after this call."""
        self.cache.set_length(seq.seq_id, length)
        for prop in self.proposers.values():
            prop.rollback(seq, length)
