"""The batch's fit of the drafts (Speculator.fit_to_batch) and the row price it reads
(speculation/goodput.RowPrice): drafts are cut to the nodes that raise the whole step's tokens
per second of its cost by rows, most likely nodes first; each draft keeps a prefix of its
nodes (a tree keeps its parents); sampled requests and fixed depths are left whole; a sequence
cut to nothing still verifies one node now and then, so its acceptance can be learned. The
costs are given here (no clock): what is tested is the decision. That a batch's greedy output
stays plain decoding's with the fit on is tested over the engine in test_speculation and
test_fault_isolation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specbuild.speculation import goodput as G
from specbuild.speculation import speculator as S
from specbuild.speculation.config import SpeculationConfig
from specbuild.speculation.gamma import CostModel
from specbuild.speculation.proposers.base import Draft, DrafterBase
from specbuild.speculation.proposers.suffix import tree_draft
from specbuild.speculation.state import SpecState


def speculator(per_row: float, step: float = 1.0) -> S.Speculator:
    """A speculator whose start-up table says a forward of w rows costs step + per_row * (w - 1)."""
    table = {w: step + per_row * (w - 1) for w in (1, 2, 3, 5, 9, 17, 33)}
    return S.Speculator(None, None, {"ngram": DrafterBase()}, 8, 1000, costs={"ngram": CostModel(table)})


def seq(sid: int, greedy: bool = True, gamma: int = 4, gamma_min: int = 0, gamma_max: int = 8):
    return SimpleNamespace(seq_id=sid, num_cached=9, all_ids=list(range(10)), admission=None,
                           spec=SpeculationConfig(method="ngram", gamma=gamma, gamma_min=gamma_min, gamma_max=gamma_max),
                           params=SimpleNamespace(greedy=greedy), spec_state=SpecState(method="ngram"))


def scored_chain(scores: list[float]) -> Draft:
    return Draft(list(range(100, 100 + len(scores))), method="ngram", scores=list(scores))


def fit(sp: S.Speculator, drafts: dict, seqs: list) -> dict:
    drafts = dict(drafts)
    sp.fit_to_batch(drafts, {s.seq_id: s for s in seqs})
    return {sid: len(d) for sid, d in drafts.items()}


def test_cheap_rows_keep_every_draft_and_dear_rows_keep_only_likely_nodes():
    seqs = [seq(i) for i in range(4)]
    drafts = {0: scored_chain([0.95, 0.9, 0.3]), 1: scored_chain([0.5, 0.2]), 2: scored_chain([0.05]),
              3: scored_chain([0.99, 0.97, 0.95, 0.6])}
    cheap = speculator(per_row=0.001)
    for s in seqs:
        cheap.controller.record(s, "ngram", 2, 1)
    assert fit(cheap, drafts, seqs) == {0: 3, 1: 2, 2: 1, 3: 4}
    # a row costs a quarter of a one-row step: the nodes go most likely first while the step's
    # tokens per second rise (4 + 0.99 + 0.97 + 0.95 + 0.95 + 0.9 over 1.75 + 5 * 0.25; the
    # next, 0.6, would lower it), each draft a prefix; the others have verified drafts on
    # record (every sequence here), so nothing of theirs goes
    dear = speculator(per_row=0.25, step=1.0)
    for s in seqs:  # every sequence has verified drafts before (no learning probe)
        dear.controller.record(s, "ngram", 2, 1)
    kept = fit(dear, drafts, seqs)
    assert kept == {0: 2, 3: 3}, kept
    assert dear.fit_nodes == [10, 5]
    # one sequence alone, by the same rule: 0.1 does not pay for a quarter of a step, 0.9 does
    assert fit(dear, {0: scored_chain([0.1, 0.1])}, [seqs[0]]) == {}
    assert fit(dear, {0: scored_chain([0.9, 0.1])}, [seqs[0]]) == {0: 1}


def test_a_tree_keeps_its_first_nodes_with_their_parents():
    sp = speculator(per_row=0.25)
    seqs = [seq(0), seq(1)]
    for s in seqs:
        sp.controller.record(s, "ngram", 2, 1)
    # nodes best first: 1 (root's child), 2 (root's child), 3 (child of 1), 4 (child of 3)
    tree = tree_draft([11, 12, 13, 14], [-1, 0, 0, 1, 3], [1, 1, 2, 3], "suffix")
    tree.scores = [0.99, 0.9, 0.85, 0.1]
    drafts = {0: tree, 1: scored_chain([0.2])}
    sp.fit_to_batch(drafts, {s.seq_id: s for s in seqs})
    head = drafts[0]
    assert head.tokens == [11, 12, 13] and head.parents == (-1, 0, 0, 1) and head.depths == [1, 1, 2]
    assert tuple(head.tree_mask.shape) == (4, 4) and head.scores == [0.99, 0.9, 0.85]
    assert 1 not in drafts


def test_sampled_requests_and_fixed_depths_are_left_whole():
    sp = speculator(per_row=1.0)
    seqs = [seq(0, greedy=False), seq(1, gamma=3, gamma_min=3, gamma_max=3), seq(2), seq(3)]
    for s in seqs:
        sp.controller.record(s, "ngram", 2, 1)
    drafts = {i: scored_chain([0.1, 0.1, 0.1]) for i in range(4)}
    assert fit(sp, drafts, seqs) == {0: 3, 1: 3}


def test_chains_without_scores_use_the_controllers_acceptance():
    sp = speculator(per_row=0.5)
    good, bad = seq(0), seq(1)
    for _ in range(10):
        sp.controller.record(good, "ngram", 4, 4)
        sp.controller.record(bad, "ngram", 4, 0)
    drafts = {0: Draft([1, 2, 3, 4], method="ngram"), 1: Draft([5, 6, 7, 8], method="ngram")}
    kept = fit(sp, drafts, [good, bad])
    assert kept.get(0, 0) >= 3 and 1 not in kept, kept


def test_a_sequence_cut_to_nothing_still_verifies_one_node_now_and_then():
    sp = speculator(per_row=5.0)
    s0, s1 = seq(0), seq(1)
    fresh = fit(sp, {0: scored_chain([0.01, 0.01]), 1: scored_chain([0.01])}, [s0, s1])
    assert fresh == {0: 1, 1: 1}  # no verified draft on record yet: one node each, to learn from
    for s in (s0, s1):
        sp.controller.record(s, "ngram", 1, 0)
    runs = [fit(sp, {0: scored_chain([0.01, 0.01]), 1: scored_chain([0.01])}, [s0, s1])
            for _ in range(2 * S.FIT_PROBE_EVERY)]
    probes = [i for i, k in enumerate(runs) if k]
    assert probes == [S.FIT_PROBE_EVERY - 1, 2 * S.FIT_PROBE_EVERY - 1]
    assert all(k == {0: 1, 1: 1} for k in (runs[i] for i in probes))
    sp.release(s0)
    assert 0 not in sp._fit_streak


def test_the_row_price_learns_the_steps_cost_per_row_and_holds_to_the_table_until_it_can():
    price = G.RowPrice()
    prior = (0.010, 0.002)
    assert price.line(6, prior) == prior
    for _ in range(4):  # every step with the same rows: no slope to learn, the table's kept
        price.observe(6, 6, 0.030)
    a, b = price.line(6, prior)
    assert b == pytest.approx(0.002) and a + b * 6 == pytest.approx(0.030)
    for i in range(200):  # the steps say 3 ms a row over 20 ms
        rows = 6 + i % 8
        price.observe(6, rows, 0.020 + 0.003 * rows)
    a, b = price.line(7, prior)  # 5-8 share a bucket
    assert b == pytest.approx(0.003, rel=0.05) and a == pytest.approx(0.020, rel=0.1)
    assert price.line(2, prior) == prior
    assert price.describe()["5-8"]["ms_per_row"] == pytest.approx(3.0, rel=0.05)


def test_a_drafters_own_odds_are_scaled_by_what_the_target_accepted_of_them():
    sp = speculator(per_row=0.25)
    assert sp.odds_factor("ngram") == 1.0
    for _ in range(50):  # drafts whose odds say 2 nodes a draft; the target took 0.5
        d = scored_chain([0.9, 0.8, 0.3])
        sp.learn_odds(d, 1 if _ % 2 else 0)
    f = sp.odds_factor("ngram")
    assert 0.2 < f < 0.35
    s0, s1 = seq(0), seq(1)
    assert sp.node_odds(s0, scored_chain([0.9, 0.5])) == pytest.approx([0.9 * f, 0.5 * f])
    # the fit reads the scaled odds: 0.9 pays at face value here, not at a quarter of it
    for s in (s0, s1):
        sp.controller.record(s, "ngram", 2, 1)
    assert fit(sp, {0: scored_chain([0.9]), 1: scored_chain([0.9])}, [s0, s1]) == {}
    fresh = speculator(per_row=0.25)
    for s in (s0, s1):
        fresh.controller.record(s, "ngram", 2, 1)
    assert fit(fresh, {0: scored_chain([0.9]), 1: scored_chain([0.9])}, [s0, s1]) == {0: 1, 1: 1}
    # grammar-forced tokens teach nothing
    g = Draft([1, 2], method=S.GRAMMAR, scores=[1.0, 1.0])
    sp.learn_odds(g, 0)
    assert S.GRAMMAR not in sp.odds_seen


def test_autos_switch_sees_each_steps_tokens_over_the_modelled_cost_of_its_rows():
    """The switch's arms are compared on the row price's line through all the steps, plus each
    step's own drafting: a step's jitter does not move it, the steps' level does."""
    sp = speculator(per_row=0.25)
    hist = lambda arm: sp.goodput.buckets["1"].hist[arm]  # noqa: E731

    def step(kind, tokens, rows, wall, drafting=0.0):
        sp._auto_pure = True
        sp.goodput.choose(1, True)
        sp._draft_s = drafting
        sp.on_step(kind, 1, tokens, rows, wall)

    step("plain", 1, 1, 5.0)  # nothing learned yet: the start-up table's 1.0 s for one row
    assert hist("plain")[-1] == (1, pytest.approx(1.0))
    for i in range(300):  # the steps cost 2 s a row, jittering by +-0.5 s
        step("plain", 1, 1, 2.0 + (0.5 if i % 2 else -0.5))
    assert {t for t, _ in hist("plain")} == {1}
    assert [sec for _, sec in hist("plain")] == pytest.approx([2.0] * len(hist("plain")), rel=0.05)
    # a drafted step of 3 rows: the line's cost for 3 rows (the table's slope: its rows never
    # varied) plus its drafting, whatever its wall time
    a, b = sp.step_line(1, 1, 3)
    assert b == pytest.approx(0.25, rel=0.05)
    bucket = sp.goodput.buckets["1"]
    bucket.arm, bucket.probing, bucket.until_probe = "spec", 0, 100  # the next step speculates
    step("suffix", 2, 3, 9.0, drafting=0.1)
    assert hist("spec")[-1] == (2, pytest.approx(a + 3 * b + 0.1))
    # prefill steps are timed as they ran and teach the line nothing
    n = sp.row_price.fits["1"].n
    sp._prefilling = True
    step("plain", 1, 40, 7.0)
    assert sp.row_price.fits["1"].n == n
    # nor do steps on a threading under trial (Engine.step clears learn_costs for them)
    sp._prefilling = False
    sp.learn_costs = False
    step("plain", 1, 1, 40.0)
    assert sp.row_price.fits["1"].n == n
    sp.learn_costs = True
    step("plain", 1, 1, 2.0)
    assert sp.row_price.fits["1"].n > n
