"""The merged tree's sampled check has the power to see a wrong rule: with recovery drawn from
the target instead of the residual (stats_util.broken_tree_rule), the same chi-square that
passes for `hybrid` (test_hybrid.py) must fail. Over the top 2 tokens (8 cells for 3 positions)
600 samples fill each cell enough to see the error; over the top 3 (27 cells) they do not
(p 0.18-0.24 with the broken rule), which is why this check uses 2.

The broken rule shows only where a recovery is drawn: where the tree's siblings already hold
both of the top 2 tokens, nothing is left to recover. Suffix's default budget (two nodes per
matched token) drafts such pairs on this prompt often enough that the broken rule's p stays at
0.23 at 600 samples; the power check therefore drafts suffix's part with one node per matched
token (factor 1.0, Arctic's rule), where recoveries are frequent, and without the stored answers
(the check asks one prompt 600 times, and each sample would be drafted the last one's answer
whole: p 0.008 with the broken rule). The correct rule passes with the defaults
(test_hybrid_passes_the_two_token_check) and with factor 1.0 and no answers."""

from __future__ import annotations

from stats_util import broken_tree_rule
from test_hybrid import _warm, bundle  # noqa: F401  (the tiny bundle fixture)
from test_suffix import PROMPTS

from specbuild.bench.verify_dist import check
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.speculation import speculator as speculator_mod
from specbuild.speculation.config import SpeculationConfig


def _hybrid_check(bundle_dir, suffix_factor: float | None = None):
    engine = Engine(bundle_dir, EngineConfig(max_batch_size=8))
    if suffix_factor is not None:
        engine.speculator.proposers["suffix"].factor = suffix_factor
        engine.speculator.proposers["suffix"].answers = False
    _warm(engine)
    return check(engine, PROMPTS[0], 1.0, 2, SpeculationConfig.make(None, method="hybrid", gamma=3), 600)


def test_hybrid_passes_the_two_token_check(bundle):  # noqa: F811
    for factor in (None, 1.0):
        r = _hybrid_check(bundle, factor)
        assert r.drafted > 0 and 0 < r.accepted < r.drafted, (factor, r)
        assert r.p_value > 0.001, (factor, r)


def test_the_check_rejects_a_broken_rule_on_hybrid_trees(bundle, monkeypatch):  # noqa: F811
    monkeypatch.setattr(speculator_mod, "verify_tree_sampled", broken_tree_rule)
    r = _hybrid_check(bundle, suffix_factor=1.0)
    assert r.drafted > 0 and 0 < r.accepted < r.drafted, r
    assert r.p_value < 1e-4, r
