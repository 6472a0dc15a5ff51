"""Speculation inside the scheduler's step: which drafter, how deep, verification.

The step (engine/step.py) makes two calls per step: `propose(seqs)` -> a `Proposal` (the
drafts, and what the target's pass must return for the drafters: hidden states, auxiliary
layers), and, per sequence after the pass, `settle(seq, PassResult)` -> a `Verdict` (the
tokens to append, the drafts accepted, the rows that chose them, the K/V moves of a tree's
accepted path, the length the target's cache keeps), which the step applies. `settle`
also hands every drafter the sequence uses what it declared it reads (`Observation`) and
trims the drafters to the verdict's length. Two lifecycle calls remain: `release(seq)`
(a finished or failed request) and `rollback(seq, length)` (the scheduler re-prefills or
copies a prompt's K/V).

The drafters are named only by the registry (proposers/registry.py); here each is reached
through its declared `Needs` and the drafter contract (proposers/base.py). What speculation
costs is measured in speculation/calibration.py.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import torch

from specbuild.speculation.goodput import GoodputSwitch, RowPrice
from specbuild.speculation.gamma import CostModel, GammaController, TreeCostModel, best_gamma, expected_tokens
from specbuild.model.kv_cache import PagedKVCache
from specbuild.model.decoder import Decoder
from specbuild.sampling.params import checked_argmax, sample_from, warp_probs
from specbuild.speculation.proposers.base import Draft, Needs, Observation, candidate_sources
from specbuild.sampling.acceptance import verify_chain_greedy, verify_chain_sampled, verify_tree_greedy, verify_tree_sampled, verify_tree_typical

log = logging.getLogger("specbuild.speculator")
# `auto` drafts with the drafters that read nothing of the target's pass beyond its tokens and
# whose drafting costs at most this share of a plain step per token (measured at start-up): the
# others' bookkeeping (EAGLE's features of every row, recycling's logits) is paid on every step,
# drafting or not, and their drafting alone took 4-6 ms against a 6 ms step on a 2-core Xeon
# (2026-12-06). They stay one request field away (`"speculation": "eagle"`).
AUTO_DRAFT_SHARE = 0.15
# fit_to_batch keeps the first node of a draft it has cut to nothing this many steps in a row: a
# sequence's acceptance estimate is only learned from drafts it verifies
FIT_PROBE_EVERY = 16
ODDS_PRIOR = 4.0  # node odds a drafter's own scores are taken at face value for (odds_factor)
ODDS_DECAY = 0.99  # per verified draft


GRAMMAR = "grammar"  # Draft.method of the tokens a structured-output grammar forces
NO_NEEDS = Needs()  # a drafter that declares nothing reads nothing beyond the tokens


@dataclass
class Proposal:
    """What `propose` hands the step: the drafts, and what the target's pass must return."""

    drafts: dict = field(default_factory=dict)  # seq_id -> Draft
    hidden: bool = False  # final-normed hidden states of the logit rows (a drafter reads them)
    aux_layers: tuple[int, ...] = ()  # target layers whose inputs `feature_seqs`' rows return
    feature_seqs: frozenset[int] = frozenset()  # seq_ids whose every row's features a drafter reads
    draft_ms: dict[str, float] = field(default_factory=dict)  # method -> its propose call this step


@dataclass
class PassResult:
    """What the target's pass computed for one sequence, as `settle` reads it."""

    start: int  # cache length before the pass (position of chunk[0])
    chunk: list[int]  # the pending tokens this pass ran (then the draft's)
    draft: Draft | None = None
    logits: torch.Tensor | None = None  # [1 + k, vocab] raw; None: a prefill chunk that does not complete
    scores: torch.Tensor | None = None  # the same rows after penalties, logit_bias and the grammar
    hidden: torch.Tensor | None = None  # [1 + k, H] (Proposal.hidden)
    features: torch.Tensor | None = None  # [len(chunk) + k, F] (Proposal.feature_seqs)
    # each scores row's argmax, when the step took it for the whole group (params.argmax_rows:
    # rows checked, and scores are the raw rows: nothing adjusted them); None: settle takes it
    argmax: list[int] | None = None


@dataclass
class Verdict:
    """What `settle` decided for one sequence; the step applies it."""

    tokens: list[int]  # to append: the accepted drafts then the target's own next token
    accepted: int  # drafts accepted
    rows: list[int]  # rows of PassResult.scores that chose `tokens`, in order (logprobs)
    length: int  # tokens whose K/V the target's cache keeps (chunk + accepted drafts)
    kv_moves: list[tuple[int, int]] = field(default_factory=list)  # (from, to) cache positions, applied first
    method: str | None = None  # the drafter whose draft was verified (None: plain or a prefill chunk)
    # what the sequence's statistics count (SeqStats.on_pass, engine/sequence.py):
    verify_pass: bool = False  # a decode pass: it chose tokens after the prompt (each yields accepted + 1)
    gamma: int | None = None  # the depth plan_draft chose for this pass (None: none planned)
    drafted: int = 0  # draft tokens verified (a tree's: its nodes)
    depth_counts: list[int] = field(default_factory=list)  # drafts verified per position (a tree's: 1 per depth)


def plain_next_token(seq, scores: torch.Tensor, best: list[int] | None = None) -> int:
    """Sample one token from scores [vocab] (already `process_logits`ed) with the request's
    params and generator; best: the row's argmax when the step took it (greedy)."""
    if seq.params.greedy:
        return best[0] if best is not None else checked_argmax(scores)
    probs = warp_probs(scores.unsqueeze(0), seq.params)
    return int(sample_from(probs, seq.uniforms(1))[0])


@functools.lru_cache(maxsize=256)
def nodes_within_depth(tree) -> list[int]:
    """[d] = how many of the tree's nodes lie within depth d (d = 0 .. max depth); once per tree."""
    return [sum(1 for p in tree.paths if len(p) <= d) for d in range(tree.max_depth + 1)]


class Speculator:
    def __init__(self, target: Decoder, cache: PagedKVCache, proposers: dict, max_draft_len: int,
                 max_seq_len: int, costs: dict[str, CostModel] | None = None) -> None:
        self.target = target
        self.cache = cache
        self.proposers = proposers  # method name -> proposer (proposers/registry.py's order)
        self.max_draft_len = max_draft_len
        self.max_seq_len = max_seq_len
        self.draft_room = max_draft_len + 1  # KV positions a step may need past a sequence's text
        self._costs = costs
        self._controller: GammaController | None = None
        self._auto_methods: tuple[str, ...] | None = None
        self._auto_uses: frozenset[str] = frozenset()
        # auto's batch-wide switch, learned from the steps' own wall time (speculation/goodput.py)
        self.goodput = GoodputSwitch()
        self._auto_spec = True  # this step, auto's sequences may speculate
        self._auto_sure: dict[int, str] = {}  # this step, auto's sequences whose drafter holds their continuation
        self._auto_pure = False  # this step, every decoding sequence is auto's and nothing prefills
        self.row_price = RowPrice()  # a decode step's cost per forward row, learned from the steps (fit_to_batch)
        self.learn_costs = True  # False for a step whose wall time is not the kept threading's (a thread trial)
        self._prefilling = False  # this step prefills a prompt too (its rows teach row_price nothing)
        self._draft_s = 0.0  # this step's drafting, seconds (on_step)
        self.fit_nodes = [0, 0]  # draft nodes fit_to_batch was offered, and kept
        self._fit_streak: dict[int, int] = {}  # seq_id -> steps in a row fit_to_batch cut its draft to nothing
        # method -> [its drafts' summed node odds, the nodes accepted], decayed: how far a drafter's
        # own odds are from what the target accepts (node_odds scales them by it)
        self.odds_seen: dict[str, list[float]] = {}
        self.emit = None  # callable(seq, kind, detail): failure-mode events (Engine.set_sink)
        # the target layers some drafter reads (one drafter's, in its order: EAGLE-3's three)
        self.aux_layers: tuple[int, ...] = next((tuple(self.needs(n).aux_layers) for n in proposers
                                                 if self.needs(n).aux_layers), ())

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
        """The measured costs (speculation/calibration.calibrate: verify cost by width and each
        drafter's, cached per machine and bundle). The engine calibrates at load, before any
        request."""
        from specbuild.speculation.calibration import calibrate

        return calibrate(self)

    @property
    def auto_methods(self) -> tuple[str, ...]:
        """The drafters `auto` chooses among (AUTO_DRAFT_SHARE): those that need nothing of the
        target's pass beyond its tokens, draft cheaply, and merge only such drafters."""
        if self._auto_methods is None:
            costs = self.controller.costs
            plain = costs[next(iter(self.proposers))].verify(1) if self.proposers else 0.0

            def cheap(name: str, seen: tuple = ()) -> bool:
                n = self.needs(name)
                if n.hidden or n.aux_layers or n.logits or name in seen:
                    return False
                if costs[name].draft_cost > AUTO_DRAFT_SHARE * plain:
                    return False
                return all(p in self.proposers and cheap(p, seen + (name,)) for p in n.parts)

            chosen = [name for name in self.proposers if cheap(name)]
            # a drafter another of auto's covers only splits each sequence's estimates between two
            # drafters of the same text: under auto, prompt lookup beside suffix was chosen on its
            # prior and kept (first-time chat, served: its steps 1.70-1.86 tokens against suffix's
            # 1.96-1.98 at as many rows)
            covered = {c for name in chosen for c in getattr(self.proposers[name], "covers", ())}
            self._auto_methods = tuple(name for name in chosen if name not in covered)
            self._auto_uses = frozenset(n for m in self._auto_methods for n in (m, *self.needs(m).parts))
            log.info("auto drafts with %s (of %s)", ", ".join(self._auto_methods) or "nothing",
                     ", ".join(self.proposers))
        return self._auto_methods

    @property
    def auto_uses(self) -> frozenset[str]:
        """auto's drafters with the drafters they merge (what an auto sequence's passes teach):
        computed with auto_methods, once, not per sequence and step."""
        _ = self.auto_methods
        return self._auto_uses

    def set_emit(self, emit) -> None:
        """Route failure-mode events (controller, drafters) to emit(seq, kind, detail); None: off."""
        self.emit = emit
        if self._controller is not None:
            self._controller.emit = emit
        for prop in self.proposers.values():
            prop.set_emit(emit)

    # ---- who reads what ----------------------------------------------------------------------
    def needs(self, name: str) -> Needs:
        return getattr(self.proposers.get(name), "needs", None) or NO_NEEDS

    def uses(self, seq) -> frozenset[str]:
        """The drafters seq may draft with, so the ones that learn from its passes: its
        method's (with the drafters that method merges), `auto`'s drafters (auto_methods)
        until auto_plain, none for plain decoding. Kept in seq.spec_state.uses."""
        spec = getattr(seq, "spec", None)
        method = spec.method if spec is not None else "none"
        if method == "auto":
            names = frozenset() if seq.spec_state.auto_plain else self.auto_uses
            seq.spec_state.keeps = self.auto_uses
        elif method in self.proposers:
            names = seq.spec_state.keeps = frozenset((method, *self.needs(method).parts))
        else:
            names = frozenset()
        seq.spec_state.uses = names
        return names

    def row_readers(self, seq) -> list:
        """The drafters seq may use that read the target's features at every row of its text
        (EAGLE-3's aux layers)."""
        return [self.proposers[n] for n in self.uses(seq) if self.needs(n).aux_layers and n in self.proposers]

    def prefix_limit(self, seq, limit: int) -> int:
        """How many leading tokens of seq's prompt (at most `limit`) may come from the prefix
        cache: all, unless a drafter it may use reads every row's features; then only those
        whose features every such drafter keeps (stored_prefix)."""
        for prop in self.row_readers(seq):
            limit = min(limit, prop.stored_prefix(seq, limit))
        return limit

    def adopted(self, seq, start: int, end: int) -> None:
        """The target took positions start..end of seq from the prefix cache: the drafters that
        read every row's features are handed those positions' kept features."""
        for prop in self.row_readers(seq):
            prop.adopt(seq, start, end)

    # ---- the step: propose ---------------------------------------------------------------------
    def propose(self, seqs: list, on_error=None) -> Proposal:
        """Drafts for the sequences of `seqs` that decode this step (one pending token), and
        what the pass must return for the drafters of all of them. A drafter that raises on a
        batch is retried one sequence at a time, so only the sequence it fails on loses its
        drafts (and decodes plainly from then on: see draft_failed); on_error(seq, exc,
        while_) takes a sequence's own failure (its grammar) and that sequence is left out;
        without on_error such a failure raises."""
        out = Proposal()
        features, hidden = set(), False
        by_method: dict[str, list] = {}
        self.switch_auto(seqs)
        for seq in seqs:
            uses = self.uses(seq)
            hidden = hidden or any(self.needs(n).hidden for n in uses)
            if self.aux_layers and any(self.needs(n).aux_layers for n in uses):
                features.add(seq.seq_id)
            if seq.num_cached < len(seq.all_ids) - 1:
                continue  # still prefilling: nothing to draft from
            try:
                choice = self.plan_draft(seq)
            except Exception as e:
                if on_error is None:
                    raise
                on_error(seq, e, "choosing its drafts (its grammar's forced tokens, method, depth)")
                continue
            if isinstance(choice, Draft):  # the grammar's forced tokens: a free draft, whatever the method
                out.drafts[seq.seq_id] = choice
            elif choice is not None:
                by_method.setdefault(choice[0], []).append((seq, choice[1]))
        for method, pairs in by_method.items():
            t0 = time.perf_counter()
            try:
                drafts = self.proposers[method].propose([s for s, _ in pairs], [g for _, g in pairs])
            except Exception as e:  # noqa: BLE001 - find the sequence it belongs to
                drafts = self.propose_apart(method, pairs, e)
            out.draft_ms[method] = (time.perf_counter() - t0) * 1e3
            self._draft_s += out.draft_ms[method] / 1e3
            for (seq, gamma), draft in zip(pairs, drafts):
                try:
                    draft = self.within_grammar(seq, draft)
                except Exception as e:
                    if on_error is None:
                        raise
                    on_error(seq, e, "checking its drafts against its grammar")
                    continue
                found = draft is not None and len(draft) > 0
                self.controller.found(seq, method, found)
                if found:
                    out.drafts[seq.seq_id] = draft
                else:
                    self.controller.record(seq, method, 0, 0)
        self.fit_to_batch(out.drafts, {seq.seq_id: seq for seq in seqs})
        out.hidden = hidden
        if features:
            out.aux_layers, out.feature_seqs = self.aux_layers, frozenset(features)
        return out

    def node_odds(self, seq, draft: Draft) -> list[float] | None:
        """Each drafted node's chance to be accepted, as its drafter or the depth controller
        estimates it: a drafter's own per-node scores (suffix: the path's share of the
        occurrences, times its match length's acceptance rate), else for a chain alpha^j at
        position j (the controller's per-token acceptance of the method on seq). None where
        neither exists (trees without scores, grammar-forced tokens): left whole."""
        if draft.method == GRAMMAR:
            return None
        if draft.scores is not None and len(draft.scores) == len(draft):
            f = self.odds_factor(draft.method)
            return [min(1.0, f * p) for p in draft.scores]
        if draft.is_tree:
            return None
        alpha = self.controller.alpha(seq, seq.spec_state.method or draft.method)
        return [alpha ** (j + 1) for j in range(len(draft))]

    def odds_factor(self, method: str) -> float:
        """How many nodes the target accepted of `method`'s drafts per node its own odds expected
        (decayed over its recent verified drafts, held toward 1 until ODDS_PRIOR nodes were
        expected). Suffix's odds are the share of earlier occurrences that continued so, and
        on text seen for the first time its matches are short and its odds run high; `/health`'s
        `row_price.odds_factor` gives the factor per drafter."""
        seen = self.odds_seen.get(method)
        if seen is None:
            return 1.0
        return (seen[1] + ODDS_PRIOR) / (seen[0] + ODDS_PRIOR)

    def learn_odds(self, draft: Draft, accepted: int) -> None:
        """A verified draft with the drafter's own node odds: what they expected, what was accepted."""
        if draft.scores is None or draft.method == GRAMMAR or len(draft.scores) != len(draft):
            return
        seen = self.odds_seen.setdefault(draft.method, [0.0, 0.0])
        seen[0] = seen[0] * ODDS_DECAY + float(sum(draft.scores))
        seen[1] = seen[1] * ODDS_DECAY + accepted

    def fit_stats(self) -> dict:
        """What the batch's fit learned and did: the row price by batch size, the draft nodes it
        was offered and kept, and each drafter's odds factor (Engine.stats' `row_price`)."""
        return {"by_batch": self.row_price.describe(), "nodes_offered": self.fit_nodes[0],
                "nodes_kept": self.fit_nodes[1],
                "odds_factor": {m: round(self.odds_factor(m), 3) for m in self.odds_seen}}

    def plain_costs(self) -> CostModel | None:
        """The start-up table of the target's forward cost by width."""
        return self.controller.costs.get(next(iter(self.proposers)), None) if self.proposers else None

    def step_line(self, batch: int, lo: int, hi: int) -> tuple[float, float]:
        """(seconds, seconds per row) of a decode step of `batch` sequences, drafting aside:
        the line the row price learned from the steps run at this batch size, the start-up
        table's line through widths lo..hi until they tell."""
        costs = self.plain_costs()
        if costs is None:
            return self.row_price.line(batch, (0.0, 0.0))
        hi = max(hi, lo + 1)
        slope = (costs.verify(hi) - costs.verify(lo)) / (hi - lo)
        return self.row_price.line(batch, (costs.verify(lo) - slope * lo, slope))

    def fit_to_batch(self, drafts: dict, seqs: dict) -> None:
        """Cut the step's drafts to what pays for the whole batch. Every drafted node is one
        more row of the step's forward, and the step's goodput is its tokens over its cost by
        rows: (B + the kept nodes' odds) / (a + b * rows) for B decoding sequences, (a, b) the
        row price's line (step_line). The nodes of all drafts are taken most likely first and
        the count that maximises that goodput is kept; each draft keeps its first nodes
        (drafters order them best first, parents before children). A lone sequence is cut by
        the same rule: the suffix drafter's own cut, on the learned costs and scaled odds
        (served, fixed suffix went from 1.11x to 1.25x plain at one sequence, AMD EPYC,
        2026-12-06). In a batch a row costs as much as ever but a token costs less (on a
        2-core AMD EPYC a row ~1.4-2 ms, against ~6.5 ms a token alone and ~2.6-2.9 ms at 4-8
        sequences), so drafts shrink as the batch grows and stop where no node is likely
        enough. Drafts only shrink: lossless. Left whole: requests that fixed their depth, and
        sampled ones (a sampled request's exact tokens follow its drafts, and its seed must
        give them again whatever batch it lands in)."""
        decoding = sum(1 for seq in seqs.values() if seq.num_cached >= len(seq.all_ids) - 1)
        if not decoding or not drafts or self.plain_costs() is None:
            return
        nodes: list[tuple[float, int, int]] = []  # (-odds, node index, seq_id)
        for sid, draft in drafts.items():
            seq = seqs.get(sid)
            spec = getattr(seq, "spec", None)
            if seq is None or spec is None or not spec.dynamic or not seq.params.greedy:
                continue
            odds = self.node_odds(seq, draft)
            if odds is None:
                continue
            nodes.extend((-p, j, sid) for j, p in enumerate(odds))
        if not nodes:
            return
        scored = {sid for _, _, sid in nodes}
        fixed = sum(len(d) for sid, d in drafts.items() if sid not in scored)  # rows kept whole
        nodes.sort()
        base = decoding + fixed
        a, b = self.step_line(decoding, base, base + len(nodes))
        best_n, best_rate, gain = 0, decoding / max(1e-9, a + b * base), 0.0
        for n, (neg, _, _) in enumerate(nodes, start=1):
            gain -= neg
            rate = (decoding + gain) / max(1e-9, a + b * (base + n))
            if rate > best_rate:
                best_n, best_rate = n, rate
        self.fit_nodes[0] += len(nodes)
        keep = dict.fromkeys(scored, 0)
        for _, _, sid in nodes[:best_n]:
            keep[sid] += 1
        for sid, n in keep.items():
            draft = drafts[sid]
            if n == 0:
                # a sequence is never cut off from learning: with no verified draft of its method
                # on record, or after FIT_PROBE_EVERY steps cut to nothing, its first node goes
                # (one row), so its acceptance estimate can rise when its text turns predictable
                seq = seqs[sid]
                streak = self._fit_streak.get(sid, 0) + 1
                if streak >= FIT_PROBE_EVERY or not self.controller.state(seq).of(seq.spec_state.method or draft.method):
                    n, streak = 1, 0
                self._fit_streak[sid] = streak
            else:
                self._fit_streak.pop(sid, None)
            if n == 0:
                del drafts[sid]
            elif n < len(draft):
                drafts[sid] = draft.head(n)
            self.fit_nodes[1] += n

    def switch_auto(self, seqs: list) -> None:
        """This step's batch-wide switch for `auto`'s sequences (speculation/goodput.py): decided
        from the goodput each arm gave at this many decoding sequences."""
        decoding = auto = prefilling = 0
        self._auto_sure = {}
        for seq in seqs:
            if seq.num_cached < len(seq.all_ids) - 1:
                prefilling += 1
                continue
            decoding += 1
            spec = getattr(seq, "spec", None)
            if spec is not None and spec.method == "auto" and not seq.spec_state.auto_plain:
                sure = self.sure_method(seq)
                if sure is None:
                    auto += 1
                else:  # it drafts whatever the arm, as a neighbour with a method of its own would
                    self._auto_sure[seq.seq_id] = sure
        self._prefilling = prefilling > 0
        if not auto or decoding == 1:
            # a lone sequence: the batch's fit alone decides, step by step, on the same learned
            # costs and its drafter's odds for that step (fit_to_batch), where the switch judged
            # speculation on probes of 3 steps of bimodal acceptance and ran plain decoding on
            # 16% of a served run's steps at C=1, first-time prompts, whose fixed suffix row
            # served 1.28x plain against `auto`'s 1.20x (AMD EPYC, 2026-12-07)
            self._auto_spec, self._auto_pure = True, False
            self.goodput.current = None
            return
        self._auto_pure = auto == decoding and not prefilling
        self._auto_spec = self.goodput.choose(decoding, self._auto_pure) == "spec"

    def on_step(self, kind: str, batch: int, tokens: int, rows: int, seconds: float) -> None:
        """One engine step ended (Scheduler.step): what it did (plain, prefill, or the drafter
        verified), its decode sequences, tokens chosen, forward rows and wall seconds. The row
        price learns what its rows cost (its drafting aside); `auto`'s switch learns the goodput
        of the arm it ran, its tokens over the step's cost as the row price models it for its
        rows, plus its drafting as timed. A step's wall time jitters by more than the arms differ
        (served at one sequence the switch flipped 14 times in 774 steps and ran plain on half of
        them, 2026-12-06); the line through all the steps does not, and the tokens, the rows and
        the drafting are each step's own."""
        draft_s = self._draft_s
        self._draft_s = 0.0
        decode = batch > 0 and kind != "prefill" and not self._prefilling
        if self.goodput.current is not None:
            modelled = seconds
            if decode:  # on the line through the steps before this one
                a, b = self.step_line(batch, batch, rows)
                modelled = max(1e-9, a + b * rows) + draft_s
            self.goodput.observe(tokens, modelled, self._auto_pure and kind != "prefill")
        if decode and self.learn_costs:
            self.row_price.observe(batch, rows, max(0.0, seconds - draft_s))

    def sure_method(self, seq) -> str | None:
        """The first of auto's drafters that holds seq's continuation (holds_continuation: an
        earlier answer to the same prompt end that its output still follows), or None. Such a
        sequence drafts with it without weighing and whatever the batch-wide switch's arm:
        per-sequence estimates could not see it (on 24 prompts asked again, `auto` took 518
        target passes against suffix's 247), and the switch's arm is the batch's average."""
        for name in self.auto_methods:
            if name not in seq.spec_state.draft_failed and self.proposers[name].holds_continuation(seq):
                return name
        return None

    def choose_method(self, seq) -> str | None:
        method = seq.spec.method if seq.spec is not None else "none"
        if method == "none" or method in seq.spec_state.draft_failed:
            return None
        if method != "auto":
            return method
        if seq.spec_state.auto_plain:
            return None
        if self._auto_sure and seq.seq_id in self._auto_sure:  # switch_auto: its drafter holds its continuation
            return self._auto_sure[seq.seq_id]
        if not self._auto_spec:
            return None
        best, best_rate = None, 0.0
        for name in self.auto_methods:
            if name in seq.spec_state.draft_failed:
                continue
            cm = self.cost_model(seq, name)
            alpha = self.controller.alpha(seq, name)
            g = best_gamma(alpha, max(1, seq.spec.gamma_min), max(1, seq.spec.gamma_max), cm)
            # a drafter that often finds nothing (no match) gives a plain step those times: its
            # rate is the mix, so one that never matches loses to one that does
            hit = self.controller.hit_rate(seq, name)
            rate = (hit * expected_tokens(alpha, g) + (1 - hit)) / \
                (hit * (g * cm.draft_cost + cm.verify(g + 1)) + (1 - hit) * cm.verify(1))
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
        prop = self.proposers.get(method)
        if prop is None or not prop.request_tree:  # a chain drafter (or a tree drafter that grows its own)
            return cm
        return TreeCostModel(cm, nodes_within_depth(prop.validate_tree(getattr(seq.spec, "tree", None))))

    def depth_for(self, seq, method: str) -> int | None:
        """The depth seq would draft with `method` now, None when its method (or `auto`) would
        not choose it (MineDraft's planning orders the other batch's drafts with it); records
        nothing."""
        if self.choose_method(seq) != method:
            return None
        gamma = self.controller.next(seq, method)
        return max(0, min(gamma, self.max_draft_len, seq.remaining - 1))

    def plan_draft(self, seq) -> "Draft | tuple[str, int] | None":
        """seq's drafting this step: the grammar's forced tokens (a Draft), (method, gamma > 0),
        or None (plain). Records the choice (spec_state.method, spec_state.planned_gamma: settle
        hands it to the pass's Verdict)."""
        forced = self.forced_draft(seq)
        if forced is not None:
            seq.spec_state.planned_gamma = len(forced)
            return forced
        method = self.choose_method(seq)
        seq.spec_state.method = method
        if method is None:
            seq.spec_state.planned_gamma = 0
            return None
        gamma = self.controller.next(seq, method, self.cost_model(seq, method))
        # never draft past the sequence's room (its max tokens or the context limit)
        gamma = max(0, min(gamma, self.max_draft_len, seq.remaining - 1))
        seq.spec_state.planned_gamma = gamma
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

    # ---- the step: settle ----------------------------------------------------------------------
    def settle(self, seq, res: PassResult) -> Verdict:
        """Verify res.draft against the target's rows (or sample the next token of a plain
        pass), hand the sequence's drafters what they read of the pass, trim them to the
        kept length, and return the verdict. A prefill chunk that does not complete
        (res.scores None) chooses nothing: its drafters read its features only."""
        uses = self.uses(seq)  # (auto may have settled on plain decoding while planning this step)
        c = len(res.chunk)
        if res.scores is None:
            length = res.start + c
            self._observe(seq, uses, Observation(length, res.start, None, features=None if res.features is None
                                                 else res.features[:c]))
            return Verdict([], 0, [], length)
        draft = res.draft if res.draft is not None and len(res.draft) else None
        nodes: tuple[int, ...] = ()
        depth_counts: list[int] = []
        best = res.argmax if seq.params.greedy else None
        if draft is None:
            tokens = [plain_next_token(seq, res.scores[0], best)]
            accepted, rows = 0, [0]
        elif draft.is_tree:
            verdict = self.verify_tree(seq, draft, res.scores, best)
            nodes = tuple(verdict.accepted_nodes)
            tokens, accepted, rows = list(verdict.tokens), len(nodes), [0, *nodes]
            seq.spec_state.candidate_sources = candidate_sources(draft, accepted, nodes)
            self.learn_odds(draft, accepted)
            # by depth: the fraction of tree steps whose accepted path reached depth d + 1
            depth_counts = [1] * max(draft.depths)
            self.record(seq, draft, accepted, len(depth_counts))
        else:
            accepted, tokens = self.verify_chain(seq, draft, res.scores, best)
            rows = list(range(len(tokens)))
            seq.spec_state.candidate_sources = candidate_sources(draft, accepted)
            self.learn_odds(draft, accepted)
            depth_counts = [1] * len(draft)
            self.record(seq, draft, accepted, len(draft))
        gamma, seq.spec_state.planned_gamma = seq.spec_state.planned_gamma, None
        length = res.start + c + accepted
        root = res.start + c - 1  # cache position of the root (the chunk's last token)
        # a tree's accepted path moves into the positions right after the root; the other
        # nodes' K/V are dropped by the commit to `length`
        moves = [(root + node, root + 1 + j) for j, node in enumerate(nodes) if node != j + 1]
        kept = list(range(c)) + ([c - 1 + n for n in nodes] if draft is not None and draft.is_tree
                                 else list(range(c, c + accepted)))
        last_row = rows[len(tokens) - 1] if draft is not None else 0  # the row that chose the new last token
        self._observe(seq, uses, Observation(
            length, res.start, draft.method if draft is not None else None,
            tokens=[res.chunk[-1], *(draft.tokens if draft is not None else ())], logits=res.logits,
            hidden=None if res.hidden is None else res.hidden[last_row],
            features=None if res.features is None else res.features[torch.tensor(kept, dtype=torch.int64)],
            sources=seq.spec_state.candidate_sources if draft is not None else None))
        return Verdict(tokens, accepted, rows, length, moves, (seq.spec_state.method or draft.method) if draft
                       is not None else None, verify_pass=draft is not None or (c == 1 and len(seq.output_ids) > 0),
                       gamma=gamma, drafted=len(draft) if draft is not None else 0, depth_counts=depth_counts)

    def _observe(self, seq, uses: frozenset[str], obs: Observation) -> None:
        """The sequence's drafters read what they declared; then every drafter is trimmed to
        the kept length (a drafter's state for a sequence it does not serve is empty)."""
        for name in uses:
            prop = self.proposers.get(name)
            if prop is not None:
                needs = self.needs(name)
                prop.observe(seq, Observation(obs.length, obs.start, obs.method,
                                              tokens=obs.tokens if needs.logits else [],
                                              logits=obs.logits if needs.logits else None,
                                              hidden=obs.hidden if needs.hidden else None,
                                              features=obs.features if needs.aux_layers else None,
                                              sources=obs.sources))
        self.rollback(seq, obs.length)

    def verify_chain(self, seq, draft: Draft, scores: torch.Tensor, best: list[int] | None = None) -> tuple[int, list[int]]:
        """scores: [k + 1, vocab]; best: their argmax when the step took it (greedy). Returns
        (accepted drafts, tokens to append)."""
        k = len(draft.tokens)
        if seq.params.greedy:
            res = verify_chain_greedy(list(draft.tokens) if best is not None else
                                      torch.tensor(draft.tokens, dtype=torch.int64), scores, best)
        else:
            ids = torch.tensor(draft.tokens, dtype=torch.int64)
            target_probs = warp_probs(scores, seq.params)  # [k + 1, vocab]
            draft_probs = draft.probs
            if draft_probs is not None:
                draft_probs = draft_probs.to(target_probs.device)
            res = verify_chain_sampled(ids, draft_probs, target_probs, seq.uniforms(k + 1))
        return res.accepted, list(res.tokens)

    def verify_tree(self, seq, draft, target_logits: torch.Tensor, best: list[int] | None = None):
        """target_logits: [n + 1, vocab], row i = the target after tree node i (0 = root);
        best: their argmax when the step took it (greedy)."""
        if seq.params.greedy:  # the walk reads plain ints (a tensor's making and reading cost ~60 us a step)
            return verify_tree_greedy(draft.parents, [0, *draft.tokens] if best is not None else
                                      torch.tensor([0, *draft.tokens], dtype=torch.int64), target_logits, best)
        node_tokens = torch.tensor([0, *draft.tokens], dtype=torch.int64)
        target_probs = warp_probs(target_logits, seq.params)
        uniforms = seq.uniforms(len(draft.parents))
        if seq.spec.typical:  # LOSSY, opt-in: Medusa's typical acceptance
            return verify_tree_typical(draft.parents, node_tokens, target_probs, uniforms)
        return verify_tree_sampled(draft.parents, node_tokens, target_probs, uniforms)

    def record(self, seq, draft, a: int, depth: int) -> None:
        """The depth controller learns of a verified draft: `a` of `depth` accepted (a tree's
        depth, not its node count). The sequence's own statistics come with the Verdict."""
        if draft.method == GRAMMAR:  # free drafts say nothing about the drafters' acceptance
            return
        self.controller.record(seq, seq.spec_state.method or draft.method, depth, a)

    # ---- lifecycle ------------------------------------------------------------------------------
    def rollback(self, seq, length: int) -> None:
        """The target's cache holds `length` tokens of seq: every drafter keeps at most that."""
        for prop in self.proposers.values():
            prop.rollback(seq, length)

    def release(self, seq) -> None:
        self._fit_streak.pop(seq.seq_id, None)
        for prop in self.proposers.values():
            prop.release(seq)
