"""Token recycling (speculation/proposers/recycling.py): the table, the trees it drafts,
greedy equality with drafts proposed and accepted, the sampled distribution (chi-square)
and a broken variant that the same check rejects."""

from __future__ import annotations

import pytest
from stats_util import broken_tree_rule
import torch

from specbuild.bench.verify_dist import check
from specbuild.compiler.compile import CompileOptions, compile_bundle
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.errors import RequestError
from specbuild.sampling.params import SamplingParams
from specbuild.speculation import speculator as speculator_mod
from specbuild.speculation.config import SpeculationConfig
from specbuild.speculation.proposers.recycling import RecyclingProposer
from specbuild.speculation.tree import TreeSpec
from tiny import make_tiny_hf

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21], list(range(30, 70))]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("recycle")
    target = make_tiny_hf(str(root / "target"), scale=4.0, seed=3)
    return compile_bundle(target, str(root / "bundle"), CompileOptions(dtype="float64", max_draft_len=10))


def run(engine, method, prompts=PROMPTS, max_tokens=40, tree=None, gamma=None, **sampling):
    spec = SpeculationConfig.make(None, method=method, tree=tree, gamma=gamma)
    reqs = [Request(prompt_ids=p, speculation=spec,
                    sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)) for p in prompts]
    return engine.generate(reqs)


def test_table_walk_builds_a_prefix_closed_tree():
    prop = RecyclingProposer(50, k=4)
    # rows: token 3 -> successors 7 > 9 > ..., token 7 -> 11 > ...; 9 never seen
    logits = torch.zeros(2, 50)
    logits[0, [7, 9, 1, 2]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    logits[1, [11, 12, 13, 14]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    prop.learn(torch.tensor([3, 7]), logits)
    assert prop.successors(3) == [7, 9, 1, 2] and prop.successors(9) == [-1] * 4
    tree = TreeSpec.from_paths([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    draft = prop.draft_tree(3, tree)
    # [1, 0] (after 9) and [0, 0, 0] (after 11) have no entry and are dropped
    assert draft.tokens == [7, 9, 11]
    assert draft.parents == (-1, 0, 0, 1) and draft.depths == [1, 1, 2]
    assert draft.tree_mask.tolist() == [[True, False, False, False], [True, True, False, False],
                                        [True, False, True, False], [True, True, False, True]]
    assert prop.draft_tree(9, tree) is None  # nothing known after 9
    # a prompt-lookup chain goes first; table nodes merge into it or fill the budget (5)
    merged = prop.draft_tree(3, tree, chain=[7, 12, 13])
    assert merged.tokens == [7, 12, 13, 9, 11] and merged.parents == (-1, 0, 1, 2, 0, 1)
    assert merged.depths == [1, 2, 3, 1, 2]
    assert merged.tree_mask[5].tolist() == [True, True, False, False, False, True]
    with pytest.raises(RequestError, match="rank 5"):
        prop.validate_tree(TreeSpec.from_paths([[5]]))


@pytest.mark.parametrize("tree", [None, "chain_4", "mc_sim_7b_top10"])
def test_greedy_recycling_equals_plain_and_accepts(bundle, tree):
    engine = Engine(bundle, EngineConfig(max_batch_size=4))
    plain = run(engine, "none")
    spec = run(engine, "recycle", tree=tree)
    for r, p in zip(spec, plain):
        assert r["token_ids"] == p["token_ids"], tree
    drafted = sum(r["stats"]["drafted"] for r in spec)
    accepted = sum(r["stats"]["accepted"] for r in spec)
    assert drafted > 0 and accepted > 0, (tree, drafted, accepted)
    assert engine.cache.free_blocks == engine.cache.num_blocks
    assert engine.speculator.proposers["recycle"].observed_rows > 0


def test_auto_mixes_in_recycling_losslessly(bundle):
    engine = Engine(bundle, EngineConfig(max_batch_size=4))
    assert "recycle" in engine.methods
    plain = run(engine, "none")
    auto = run(engine, "auto")
    assert [r["token_ids"] for r in auto] == [r["token_ids"] for r in plain]


def test_a_request_tree_too_large_for_the_bundle_is_refused(bundle):
    engine = Engine(bundle, EngineConfig(max_batch_size=1))
    with pytest.raises(RequestError, match="max_draft_len"):
        engine.submit(Request(prompt_ids=[5, 6], speculation=SpeculationConfig.make(
            None, method="recycle", tree="mc_sim_7b_top25")))


def _warm(engine):
    """Fill the table the way serving does: greedy recycle requests on the check prompt."""
    run(engine, "recycle", prompts=[PROMPTS[0]], max_tokens=30)


@pytest.mark.parametrize("tree", ["chain_3", "mc_sim_7b_top10"])
def test_sampled_recycling_matches_exact_distribution(bundle, tree):
    engine = Engine(bundle, EngineConfig(max_batch_size=8))
    _warm(engine)
    spec = SpeculationConfig.make(None, method="recycle", gamma=3, tree=tree)
    r = check(engine, PROMPTS[0], 1.0, 3, spec, 600)
    assert r.drafted > 0 and r.accepted > 0 and r.accepted < r.drafted, r
    assert r.p_value > 0.001, r


def test_the_check_rejects_a_broken_tree_rule(bundle, monkeypatch):
    """Recovery from the target instead of the residual must fail the same check."""
    monkeypatch.setattr(speculator_mod, "verify_tree_sampled", broken_tree_rule)
    engine = Engine(bundle, EngineConfig(max_batch_size=8))
    _warm(engine)
    r = check(engine, PROMPTS[0], 1.0, 3, SpeculationConfig.make(None, method="recycle", gamma=3, tree="chain_3"), 600)
    assert r.drafted > 0 and r.accepted < r.drafted
    assert r.p_value < 1e-4, r


def test_inline_tree_paths_are_read_as_the_readme_documents(bundle):
    """A request's `tree` may be inline paths (README, `tree`); recycling refused them as
    "not a preset". Greedy with an inline tree equals plain and drafts get accepted; a bad
    inline tree is refused naming the rank limit."""
    engine = Engine(bundle, EngineConfig(max_batch_size=4))
    plain = run(engine, "none")
    inline = ((0,), (0, 0), (1,), (0, 0, 0))
    spec = run(engine, "recycle", tree=inline)
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert sum(r["stats"]["drafted"] for r in spec) > 0 and sum(r["stats"]["accepted"] for r in spec) > 0
    with pytest.raises(RequestError, match="rank"):  # ranks fit 4 bits (tree.MAX_RANK)
        engine.submit(Request(prompt_ids=[5, 6], speculation={"method": "recycle", "tree": [[99]]}))
