"""The binnings measured against the engine's ragged step (specbuild/bench/binning.py,
scripts/bench_binning.py): greedy output under padded and bins equals plain decoding, the
padded batch builder's filler rows, and the micro-batch planner against brute force."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from specbuild.bench.binning import BinCost, padded_batch, plan_bins, use
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.step import WorkItem, build_forward_batch
from specbuild.model.kv_cache import PagedKVCache
from specbuild.speculation.proposers.base import Draft
from tiny import SPEC_PROMPTS, check_drafters_equal_plain, draft_pair_bundle, spec_run

PROMPTS = SPEC_PROMPTS


@pytest.fixture(scope="module")
def spec_bundle(tmp_path_factory) -> str:
    return draft_pair_bundle(tmp_path_factory.mktemp("spec"))


run = spec_run


@pytest.mark.parametrize("binning", ["padded", "bins"])
def test_greedy_equals_plain_for_every_drafter_and_gamma(spec_bundle, binning):
    """tests/speculation/test_speculation.py's test of the engine's ragged step, under the
    measured binnings (fewer gammas: each is a whole engine run)."""
    engine = Engine(spec_bundle, EngineConfig(max_batch_size=4))
    use(engine, binning)
    check_drafters_equal_plain(engine, [3, None])


@pytest.mark.parametrize("prompt_logprobs", [None, 2])
def test_padded_batch_adds_filler_rows_only(prompt_logprobs):
    """Every decode item (plain, chain, tree) runs as wide as the widest, its filler after its own
    rows at the next positions; a prefill chunk is not padded; the logit rows are the items' own."""
    def seq(i):
        return SimpleNamespace(seq_id=i, prompt_ids=list(range(10)), scoring=SimpleNamespace(prompt_scored=0),
                               request=SimpleNamespace(prompt_logprobs=prompt_logprobs))

    tree = Draft(tokens=[7, 8, 9], parents=(-1, 0, 0, 1), depths=[1, 1, 2],
                 tree_mask=torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool))

    def items():
        return [WorkItem(seq(0), [3], None, 12, completes=True),
                WorkItem(seq(1), [4], Draft(tokens=[1, 2]), 15, completes=True),
                WorkItem(seq(2), [5], tree, 11, completes=True),
                WorkItem(seq(3), [1, 2, 3, 4], None, 2, completes=False),
                WorkItem(seq(4), [6], Draft(tokens=[1, 2, 3, 4, 5]), 10, completes=True)]

    def cache():
        c = PagedKVCache(1, 1, 4, 64, 4)
        for i in range(5):
            c.add(i)
        return c

    ragged_items, padded_items = items(), items()
    ragged = build_forward_batch(ragged_items, cache(), fast=False)
    padded = padded_batch(padded_items, cache())
    widths = [6, 6, 6, 4, 6]
    assert [it.row0 for it in padded_items] == [sum(widths[:i]) for i in range(5)]
    assert padded.input_ids.shape[0] == sum(widths)
    for r, p in zip(ragged_items, padded_items):
        own = slice(p.row0, p.row0 + p.width)
        assert torch.equal(padded.input_ids[own], ragged.input_ids[r.row0:r.row0 + r.width])
        assert torch.equal(padded.positions[own], ragged.positions[r.row0:r.row0 + r.width])
        fill = slice(p.row0 + p.width, p.row0 + (6 if p.completes else p.width))
        assert (padded.input_ids[fill] == p.chunk[-1]).all()
        assert padded.positions[fill].tolist() == list(range(p.start + p.width, p.start + fill.stop - p.row0))
    shift = torch.tensor([p.row0 - r.row0 for r, p in zip(ragged_items, padded_items)])
    owner = torch.tensor([i for i, it in enumerate(ragged_items) for _ in range(it.width)])
    assert torch.equal(padded.logit_rows, ragged.logit_rows + shift[owner[ragged.logit_rows]])
    # a batch whose decode items are equally wide is the engine's own
    same = padded_batch(items()[:1], cache())
    assert torch.equal(same.input_ids, build_forward_batch(items()[:1], cache()).input_ids)


def test_bin_planner_is_optimal_against_brute_force():
    rng = random.Random(0)
    cost = BinCost(pass_overhead=0.01, token_cost=0.001, padded=True)

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for p in partitions(rest):
            for i in range(len(p)):
                yield p[:i] + [[first] + p[i]] + p[i + 1:]
            yield [[first]] + p

    for _ in range(30):
        widths = [rng.randint(1, 9) for _ in range(rng.randint(1, 6))]
        groups = plan_bins(widths, cost, max_bins=len(widths))
        assert sorted(i for g in groups for i in g) == list(range(len(widths)))
        got = sum(cost.cost([widths[i] for i in g]) for g in groups)
        best = min(sum(cost.cost([widths[i] for i in g]) for g in p) for p in partitions(list(range(len(widths)))))
        assert got <= best + 1e-12
    # cheap passes, costly padding: widths far apart go to different bins
    groups = plan_bins([1, 1, 1, 9, 9], BinCost(0.0001, 0.01), max_bins=4)
    assert len(groups) == 2
