"""Suffix decoding's long drafts (speculation/proposers/suffix.py): a long match drafts past
the depth the controller chose (up to the request's gamma_max), nodes are scored by path
share times the measured per-match-length follow rate, the measured verify cost by width cuts
the tree where more nodes stop paying, the rates learn from verified passes, and greedy output
still equals plain decoding with drafts deeper than the controller's gamma accepted."""

from __future__ import annotations

import pytest

from specbuild.engine.engine import Engine, EngineConfig
from specbuild.speculation.proposers.base import Observation
from specbuild.speculation.proposers.hybrid import HybridProposer
from specbuild.speculation.proposers.suffix import MatchRates, SuffixProposer, build_tree

from test_suffix import FakeSeq, run, tiny_bundle

LONG = list(range(100, 140))  # 40 distinct tokens: once seen, a copy of it matches long


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return tiny_bundle(tmp_path_factory, "suffix_long")


def test_a_long_match_drafts_past_the_controllers_gamma_up_to_gamma_max():
    prop = SuffixProposer(max_nodes=8)
    seq = FakeSeq(LONG + [7] + LONG[:12])  # the text copies its own start: a 12-token match
    d = prop.draft_for(seq, 2)  # the controller asked for depth 2
    assert d.tokens == LONG[12:20] and max(d.depths) == 8  # the match pays for the whole chain
    assert prop.last_match == 12
    short = prop.draft_for(FakeSeq([5, 9, 1, 2, 3, 4, 1]), 2)  # a one-token match: two nodes (factor 2)
    assert short.tokens == [2, 3]
    # a fixed gamma (gamma_min == gamma_max) is the request's own choice: kept
    fixed = FakeSeq(LONG + [7] + LONG[:12])
    fixed.spec = fixed.spec.make(fixed.spec, gamma=2)
    assert max(prop.draft_for(fixed, 2).depths) == 2
    # gamma_max bounds it, and so does the sequence's room (its max tokens)
    capped = FakeSeq(LONG + [7] + LONG[:12])
    capped.spec = capped.spec.make(capped.spec, gamma_max=5)
    assert max(prop.draft_for(capped, 2).depths) == 5
    room = FakeSeq(LONG + [7] + LONG[:12])
    room.remaining = 4
    assert max(prop.draft_for(room, 2).depths) == 3


def test_scores_are_share_times_rate_per_depth_best_first():
    import numpy as np

    rows = np.array([[1, 2, 3], [1, 2, 3], [1, 2, 4], [5, 6, 7]])
    tokens, parents, depths, _, scores = build_tree([(rows, "local")], 8, 0.1, rate=0.5)
    # 1 (3/4 * 0.5), 2 (3/4 * 0.25), then the shallow 5 (1/4 * 0.5) before the deeper 3 (2/4 * 0.125)
    assert tokens[:4] == [1, 2, 5, 3] and depths[:4] == [1, 2, 1, 3]
    assert scores[:4] == pytest.approx([0.375, 0.1875, 0.125, 0.0625])
    assert scores == sorted(scores, reverse=True)
    for i, p in enumerate(parents[1:], start=1):
        assert p < i
    # rate 1 keeps the old order: by share alone
    assert build_tree([(rows, "local")], 8, 0.1)[4][:2] == [0.75, 0.75]


def test_the_measured_verify_cost_cuts_the_tree_where_it_stops_paying():
    prop = SuffixProposer(max_nodes=8)
    text = LONG + [7] + LONG[:12]
    prop.verify_cost = lambda w: 1.0  # flat: every node pays
    assert len(prop.draft_for(FakeSeq(text), 4).tokens) == 8
    prop.verify_cost = lambda w: 1.0 + 0.6 * (w - 1)  # steep: each node costs 0.6 of a step
    steep = prop.draft_for(FakeSeq(text), 4)
    assert 1 <= len(steep.tokens) < 8 and steep.scores == sorted(steep.scores, reverse=True)
    # (1 + sum of the n scores) / cost(n + 1) is highest at the chosen n
    rate = lambda n: (1 + sum(prop.rates.rate(12) ** k for k in range(1, n + 1))) / (1 + 0.6 * n)  # noqa: E731
    n = len(steep.tokens)
    assert rate(n) >= max(rate(k) for k in range(1, 9)) - 1e-12
    # a guess is still sent as one node when the controller asked for a draft
    prop.verify_cost = lambda w: 1.0 + 10.0 * (w - 1)
    assert len(prop.draft_for(FakeSeq([5, 9, 1, 2, 3, 4, 1]), 4).tokens) == 1


def test_match_rates_learn_from_verified_passes():
    rates = MatchRates()
    before_short, before_long = rates.rate(1), rates.rate(32)
    assert before_short < 0.5 < before_long < 1.0
    for _ in range(20):
        rates.learn(1, 0, 1)  # one-token matches: rejected
        rates.learn(32, 8, 8)  # long ones: followed to the end
    assert rates.rate(1) < before_short and rates.rate(32) > before_long
    assert rates.rate(2) == MatchRates().rate(2)  # other buckets untouched
    # through the proposer: the pass's candidate sources teach the draft's match length
    prop = SuffixProposer(max_nodes=8)
    seq = FakeSeq(LONG + [7] + LONG[:12])
    prop.draft_for(seq, 4)
    b = prop.rates.bucket(12)
    prop.observe(seq, Observation(0, 0, "suffix", sources={"suffix:local": [[1, 1], [1, 1], [1, 0]]}))
    assert prop.rates.acc[b] == 2 and prop.rates.rej[b] == 1 and seq.seq_id not in prop.pending


def test_hybrid_takes_suffix_scores_and_depth():
    """Hybrid merges suffix's deep chain past gamma and ranks its nodes by suffix's own scores."""
    suffix = SuffixProposer(max_nodes=8)

    class NoRecycle:
        def propose(self, seqs, gammas):
            return [None for _ in seqs]

    hybrid = HybridProposer(suffix, NoRecycle(), max_nodes=8)
    hybrid.verify_cost = lambda w: 1.0
    d = hybrid.draft_for(FakeSeq(LONG + [7] + LONG[:12]), 2)
    assert d.tokens == LONG[12:20] and max(d.depths) == 8


def test_greedy_long_drafts_past_a_low_gamma_are_accepted_and_lossless(bundle, monkeypatch):
    """The controller held at depth 2 (as after a stretch of rejected guesses): where the text
    repeats an earlier request's, suffix drafts deeper than 2 and the target accepts them;
    greedy output equals plain decoding."""
    engine = Engine(bundle, EngineConfig(max_batch_size=2, suffix_prompts=True))
    prompt = list(range(30, 70))
    plain = run(engine, "none", prompts=[prompt], max_tokens=40)
    run(engine, "suffix", prompts=[prompt], max_tokens=40)  # its prompt and output join the store
    controller = engine.speculator.controller
    monkeypatch.setattr(controller, "next", lambda seq, method, costs=None: 2)
    # flat verify costs: this test is about depth past gamma, not the (measured, so noisy) width cut
    engine.speculator.proposers["suffix"].verify_cost = lambda width: 1.0
    again = run(engine, "suffix", prompts=[prompt], max_tokens=40)
    assert again[0]["token_ids"] == plain[0]["token_ids"]
    st = again[0]["stats"]
    by_pos = st["acceptance_by_position"]
    assert len(by_pos) > 2 and any(a for a in by_pos[2:]), by_pos  # accepted at depth 3 and beyond
    assert st["accepted"] > 0 and st["mean_accepted_tokens"] > 3.0, st
