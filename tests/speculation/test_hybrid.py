"""The merged tree (speculation/proposers/hybrid.py): suffix's and recycling's candidates in
one prefix-closed tree, a drafter whose candidates go unaccepted no longer asked, greedy
equality with drafts from both accepted, and the sampled distribution (chi-square) with a
broken variant the same check rejects."""

from __future__ import annotations

import types

import pytest

from specbuild.bench.verify_dist import check
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.speculation.config import SpeculationConfig
from specbuild.speculation.proposers.base import Observation
from specbuild.speculation.proposers.hybrid import PROBE, WINDOW, HybridProposer
from specbuild.speculation.proposers.suffix import tree_draft

# the tiny float64 bundle, prompts and runner the suffix tests use (one definition)
from test_suffix import PROMPTS, run, tiny_bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return tiny_bundle(tmp_path_factory, "hybrid")


class Fixed:
    """A stand-in drafter that always proposes the same tree."""

    def __init__(self, tokens, parents, source):
        self.tokens, self.parents, self.source, self.local = tokens, parents, source, {}

    def draft_for(self, seq, gamma):
        d = tree_draft(self.tokens, self.parents, [1] * len(self.tokens), "x")
        d.depths = [0] * len(self.tokens)
        for i, p in enumerate(self.parents[1:]):
            d.depths[i] = 1 if p == 0 else d.depths[p - 1] + 1
        d.sources = [self.source] * len(self.tokens)
        return d

    def propose(self, seqs, gammas):
        return [self.draft_for(s, g) for s, g in zip(seqs, gammas)]


def fake_seq():
    return types.SimpleNamespace(seq_id=1, spec_state=types.SimpleNamespace(candidate_sources=None, method="hybrid"))


def test_merge_dedupes_by_prefix_and_keeps_the_budget():
    suffix = Fixed([1, 2, 3], [-1, 0, 1, 2], "suffix:local")  # chain 1 2 3
    recycle = Fixed([1, 9, 4], [-1, 0, 1, 0], "recycle:table")  # 1 -> 9, and 4
    hyb = HybridProposer(suffix, recycle, max_nodes=4)
    hyb.verify_cost = lambda w: 1.0  # a flat verify cost: the whole budget pays
    d = hyb.draft_for(fake_seq(), 8)
    # the shared first token is one node; four nodes best-first: 1, then 2 / 9 / 4 (depth 1 before depth 3)
    assert d.tokens[0] == 1 and d.tokens.count(1) == 1 and len(d.tokens) == 4
    assert set(d.tokens) == {1, 2, 9, 4} and d.parents[0] == -1
    for i, p in enumerate(d.parents[1:], start=1):
        assert p < i
    assert d.sources[d.tokens.index(9)] == "recycle:table" and d.sources[d.tokens.index(2)] == "suffix:local"
    # a steep verify cost keeps the budget small
    hyb.verify_cost = lambda w: float(w) ** 2
    assert len(hyb.draft_for(fake_seq(), 8).tokens) == 1


def test_a_drafter_never_accepted_stops_being_asked_and_is_probed():
    suffix = Fixed([1, 2], [-1, 0, 1], "suffix:local")
    recycle = Fixed([7], [-1, 0], "recycle:table")
    hyb = HybridProposer(suffix, recycle, max_nodes=4)
    hyb.verify_cost = lambda w: 1.0
    seq = fake_seq()
    for _ in range(WINDOW):  # recycling's candidate is offered and never accepted; suffix's is
        hyb.draft_for(seq, 4)
        hyb.observe(seq, Observation(0, 0, "hybrid", sources={"suffix:local": [[1, 1], [1, 1]],
                                                              "recycle:table": [[1, 0]]}))
    asked = hyb.asked["recycle"]
    hyb.draft_for(seq, 4)  # WINDOW misses learned: recycling is not asked
    for _ in range(PROBE - 2):
        hyb.draft_for(seq, 4)
    assert hyb.asked["recycle"] == asked and hyb.asked["suffix"] == WINDOW + PROBE - 1
    hyb.draft_for(seq, 4)  # the probe
    assert hyb.asked["recycle"] == asked + 1


def test_greedy_hybrid_equals_plain_and_accepts_from_both(bundle):
    engine = Engine(bundle, EngineConfig(max_batch_size=4))
    assert "hybrid" in engine.methods
    plain = run(engine, "none")
    for _ in range(2):  # the second round also drafts from the first round's outputs
        spec = run(engine, "hybrid")
        for r, p in zip(spec, plain):
            assert r["token_ids"] == p["token_ids"]
        assert sum(r["stats"]["drafted"] for r in spec) > 0 and sum(r["stats"]["accepted"] for r in spec) > 0
    hyb = engine.speculator.proposers["hybrid"]
    assert hyb.asked["suffix"] > 0 and hyb.asked["recycle"] > 0 and hyb.tracks == {}
    assert engine.speculator.proposers["recycle"].observed_rows > 0  # recycling's table learns under hybrid
    assert engine.speculator.proposers["suffix"].store.stats()["requests"] == 2 * len(PROMPTS)
    assert engine.cache.free_blocks == engine.cache.num_blocks


def _warm(engine):
    """A flat verify cost (the whole node budget pays, so the check's power does not depend on
    this machine's measured costs), then earlier requests on the check prompt."""
    engine.speculator.proposers["hybrid"].verify_cost = lambda width: 1.0
    run(engine, "recycle", prompts=[PROMPTS[0]], max_tokens=30)  # recycling's table, as in test_recycling
    run(engine, "hybrid", prompts=[PROMPTS[0]] * 2, max_tokens=30)


def test_sampled_hybrid_matches_exact_distribution(bundle):
    engine = Engine(bundle, EngineConfig(max_batch_size=8))
    _warm(engine)
    r = check(engine, PROMPTS[0], 1.0, 3, SpeculationConfig.make(None, method="hybrid", gamma=3), 600)
    assert r.drafted > 0 and r.accepted > 0 and r.accepted < r.drafted, r
    assert r.p_value > 0.001, r
