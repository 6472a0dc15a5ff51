"""Numerics that cannot go NaN (sampling/params.py, sampling/acceptance.py): temperatures
below the floor are greedy, degenerate top_p / top_k keep the most likely token, and a
NaN/inf row reaching the sampler or any acceptance rule raises NumericsError (the engine
fails that one request) instead of an assertion or a silently wrong token. Property tests
(hypothesis) over extreme parameters, for the warping alone and through the engine for
every method the draft-pair bundle serves (Medusa and EAGLE: beside their bundles)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specbuild.errors import NumericsError, RequestError
from specbuild.sampling.acceptance import (verify_chain_greedy, verify_chain_sampled, verify_tree_greedy,
                                           verify_tree_sampled, verify_tree_typical)
from specbuild.sampling.params import TEMPERATURE_FLOOR, SamplingParams, argmax_ids, checked_argmax, sample_from, warp_probs

VOCAB = 24
FAST = settings(max_examples=60, deadline=None, derandomize=True, database=None)  # same examples every run: CI cannot flake


def params_or_none(**kw):
    try:
        return SamplingParams(**kw)
    except RequestError:
        return None


@st.composite
def logit_rows(draw):
    """[2, VOCAB] logits from tame to huge (|x| up to 1e30), some -inf, never all -inf."""
    scale = draw(st.sampled_from([1.0, 40.0, 1e4, 1e30]))
    vals = draw(st.lists(st.floats(-1.0, 1.0), min_size=2 * VOCAB, max_size=2 * VOCAB))
    x = torch.tensor(vals, dtype=torch.float32).reshape(2, VOCAB) * scale
    masked = draw(st.lists(st.integers(0, VOCAB - 1), max_size=VOCAB - 1))
    x[:, masked] = float("-inf")
    return x


@FAST
@given(x=logit_rows(),
       temperature=st.sampled_from([1e-45, 1e-38, 1e-20, 9.9e-6, 1e-5, 1e-3, 0.5, 1.0, 100.0]),
       top_p=st.sampled_from([1e-45, 1e-40, 1e-30, 1e-8, 0.3, 0.9, 1.0]), top_k=st.sampled_from([0, 1, 2, 5]))
def test_warped_rows_are_always_distributions(x, temperature, top_p, top_k):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    probs = warp_probs(x, params)
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
    assert torch.allclose(probs.sum(-1), torch.ones(2), atol=1e-5)
    best = x.argmax(-1)
    assert bool((probs.gather(-1, best[:, None]) > 0).all())  # the most likely token is never dropped
    if temperature < TEMPERATURE_FLOOR:
        assert params.greedy and params.temperature == 0.0
        assert torch.equal(probs, torch.nn.functional.one_hot(best, VOCAB).float())
    elif top_p <= 1e-30:  # below any token's mass: only the most likely token stays (ties: lowest id)
        tempered = torch.softmax(x / temperature, -1)
        kept = probs.argmax(-1)
        assert probs.max(-1).values.tolist() == [1.0, 1.0]
        assert torch.equal(tempered.gather(-1, kept[:, None])[:, 0], tempered.max(-1).values)
    elif top_k == 1:  # the top logit (and exact ties with it) only; top_p < 1 may drop some ties
        ties = x == x.max(-1, keepdim=True).values
        assert not bool(((probs > 0) & ~ties).any())
        if top_p == 1.0:
            assert bool(((probs > 0) == ties).all())

def test_the_floor_is_greedy_and_documented():
    for t in (1e-45, 1e-38, 1e-6, TEMPERATURE_FLOOR / 2):
        assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=TEMPERATURE_FLOOR).greedy
    x = torch.tensor([[40.0, 39.0, -3.0]])
    # the old overflow: logits / 1e-38 is inf - inf in the softmax
    assert math.isnan(torch.softmax(x / 1e-38, -1)[0, 0])
    assert warp_probs(x, SamplingParams(temperature=1e-38)).tolist() == [[1.0, 0.0, 0.0]]
    # a top_p below float32's smallest number compared as 0 and dropped every token (NaN)
    assert warp_probs(x, SamplingParams(temperature=1.0, top_p=1e-46)).tolist() == [[1.0, 0.0, 0.0]]
    for bad in (1e38, float("inf"), float("nan"), -1e-45):
        with pytest.raises(RequestError, match="temperature"):
            SamplingParams(temperature=bad)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_ties_keep_the_lowest_id_like_argmax():
    x = torch.tensor([[1.0, 5.0, 5.0, 5.0, 0.0]])
    assert warp_probs(x, SamplingParams(temperature=1.0, top_p=1e-45)).argmax().item() == 1


def nan_row(n: int, where: str) -> torch.Tensor:
    x = torch.randn(n, VOCAB).softmax(-1)
    if where == "nan":
        x[n - 1, 3] = float("nan")
    elif where == "inf":
        x[n - 1, 3] = float("inf")
    elif where == "empty":
        x[n - 1] = 0.0
    return x


@pytest.mark.parametrize("where", ["nan", "inf", "empty"])
def test_every_acceptance_rule_refuses_non_finite_rows(where):
    ids = torch.tensor([1, 2])
    parents = (-1, 0, 0)
    nodes = torch.tensor([0, 1, 2])
    u3 = torch.full((3,), 0.5, dtype=torch.float64)
    probs = nan_row(3, where)
    logits = probs.clone()
    if where == "empty":
        logits[2] = float("-inf")
    calls = [lambda: verify_chain_greedy(ids, logits),
             lambda: verify_chain_sampled(ids, None, probs, u3),
             lambda: verify_chain_sampled(ids, nan_row(2, where), nan_row(3, "none"), u3),
             lambda: verify_tree_greedy(parents, nodes, logits),
             lambda: verify_tree_sampled(parents, nodes, probs, u3),
             lambda: verify_tree_typical(parents, nodes, probs, u3),
             lambda: sample_from(probs, u3),
             lambda: warp_probs(logits, SamplingParams(temperature=0.8)),
             lambda: warp_probs(logits, SamplingParams())]
    for call in calls:
        with pytest.raises(NumericsError, match="row"):
            call()


def test_tree_rounding_never_asserts():
    """All residual mass on a child that a uniform at 1 - 2^-53 still rejects (rounding of
    u * sum against that mass): the step draws from the row instead of asserting."""
    probs = torch.zeros(2, VOCAB, dtype=torch.float64)
    probs[0, 5] = 1.0
    probs[1, 7] = 1.0
    u = torch.tensor([1.0 - 2 ** -53, 0.25], dtype=torch.float64)
    res = verify_tree_sampled((-1, 0), torch.tensor([0, 5]), probs, u)
    assert res.tokens[-1] in (5, 7)


# ---- through the engine -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tiny import draft_pair_bundle

    from specbuild.engine.engine import Engine, EngineConfig

    return Engine(draft_pair_bundle(tmp_path_factory.mktemp("numerics")), EngineConfig(max_batch_size=2))


def test_extreme_parameters_through_every_method(engine):
    from extreme import check_extreme

    seen = check_extreme(engine, ["none", "ngram", "draft", "recycle"], [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8],
                         examples=16)
    assert sum(seen.values()) >= 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_checked_argmax_picks_the_greedy_token_and_refuses_what_check_logits_refuses(dtype):
    """One pass gives the argmax and the check: a usable row gives argmax_ids' token (first of
    ties); a NaN anywhere, a +inf, or a row of -inf raise NumericsError naming the reason."""
    row = torch.randn(1000, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert checked_argmax(row) == argmax_ids(row)[0]
    tied = torch.zeros(10, dtype=dtype)
    tied[[4, 7]] = 2.0
    tied[0] = float("-inf")
    assert checked_argmax(tied) == 4
    for bad, why in ((999, "NaN"), (500, "+inf")):
        r = row.clone()
        r[bad] = float("nan") if why == "NaN" else float("inf")
        with pytest.raises(NumericsError, match=re.escape(why)):
            checked_argmax(r)
    with pytest.raises(NumericsError, match="no finite entry"):
        checked_argmax(torch.full((10,), float("-inf"), dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_rows_checks_every_row_as_check_logits_and_picks_torchs_argmax(dtype):
    """The step's one pass over a group's rows (StepRunner.pick): each row's flag is True
    exactly when check_logits accepts that row alone, and where it is, the token is torch's
    argmax (the first maximum on ties)."""
    from specbuild.sampling.params import argmax_rows, check_logits

    g = torch.Generator().manual_seed(5)
    rows = torch.randn(9, VOCAB, generator=g).to(dtype)
    rows[1, 3] = float("nan")
    rows[2, 5] = float("inf")
    rows[3] = float("-inf")
    rows[4, 2] = rows[4, 11] = 50.0  # a tie: the first wins
    rows[5, :] = float("-inf")
    rows[5, 17] = 0.0  # one possible token
    rows[6, 0] = float("-inf")  # -inf entries beside finite ones are fine
    ids, ok = argmax_rows(rows)
    assert len(ids) == len(ok) == 9
    for i in range(9):
        try:
            check_logits(rows[i])
            usable = True
        except NumericsError:
            usable = False
        assert ok[i] == usable, i
        if usable:
            assert ids[i] == int(rows[i].float().argmax()), i
    assert ok[:7] == [True, False, False, False, True, True, True]
    assert ids[4] == 2 and ids[5] == 17
    assert argmax_rows(rows[:0]) == ([], [])


def test_greedy_verification_with_the_steps_argmax_equals_its_own():
    """verify_chain_greedy / verify_tree_greedy given the rows' argmax (the step's pass) decide
    as they do when they take it themselves."""
    g = torch.Generator().manual_seed(6)
    for _ in range(30):
        rows = torch.randn(4, VOCAB, generator=g)
        best = rows.argmax(-1).tolist()
        for draft in ([best[0], best[1], 3], [best[0], 2, best[2]], [1, 2, 3], best[:3]):
            a = verify_chain_greedy(torch.tensor(draft), rows)
            b = verify_chain_greedy(draft, None, best)
            assert (a.accepted, a.next_token, a.tokens) == (b.accepted, b.next_token, b.tokens)
        parents = [-1, 0, 0, 1]
        nodes = torch.tensor([0, best[0], 7, best[1]])
        a = verify_tree_greedy(parents, nodes, rows)
        b = verify_tree_greedy(parents, nodes, None, best)
        assert a == b
    with pytest.raises(ValueError, match="expected 4"):
        verify_chain_greedy([1, 2, 3], None, [1, 2])
