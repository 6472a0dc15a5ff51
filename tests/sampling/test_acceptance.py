"""Forced-probability unit tests of the verification functions the engine calls (through
`Speculator.verify`, one sequence at a time)."""

from __future__ import annotations

import pytest
import torch

from specbuild.sampling.params import SamplingParams, sample_from, warp_probs
from specbuild.sampling.acceptance import ChainResult, TreeResult, verify_chain_greedy, verify_chain_sampled, verify_tree_greedy, verify_tree_sampled, verify_tree_typical

V = 6


def one_hot(*tokens: int) -> torch.Tensor:  # [len(tokens), V]
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def dist(**mass: float) -> torch.Tensor:  # [V] from {"t3": 0.5, ...}
    out = torch.zeros(V)
    for key, value in mass.items():
        out[int(key[1:])] = value
    return out


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.int64)


def u(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# ----------------------------------------------------------------------------- chain, greedy


def test_chain_greedy_all_accepted_gives_bonus():
    logits = torch.randn(4, V)
    best = logits.argmax(-1)
    result = verify_chain_greedy(best[:3], logits)
    assert result == ChainResult(3, int(best[3]), tuple(best.tolist()))


def test_chain_greedy_first_rejected_and_mid_mismatch():
    logits = torch.tensor([[0.0, 5, 1, 0, 0, 0], [3, 0, 0, 0, 0, 0], [0, 0, 0, 0, 9, 0]])
    assert verify_chain_greedy(ids(2, 0), logits) == ChainResult(0, 1, (1,))
    assert verify_chain_greedy(ids(1, 3), logits) == ChainResult(1, 0, (1, 0))
    assert verify_chain_greedy(ids(), logits[:1]) == ChainResult(0, 1, (1,))


def test_chain_greedy_tie_takes_lowest_id_like_warp_probs():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0, 0, 0], [0.0] * V])
    assert verify_chain_greedy(ids(1), logits).accepted == 1
    assert verify_chain_greedy(ids(2), logits) == ChainResult(0, 1, (1,))
    greedy = warp_probs(logits, SamplingParams(temperature=0.0))
    assert int(greedy[0].argmax()) == 1


# ----------------------------------------------------------------------------- chain, sampled


def test_chain_sampled_all_accepted_then_bonus_from_last_target_row():
    draft_probs = torch.stack([dist(t1=0.5, t2=0.5), dist(t3=1.0)])
    target_probs = torch.stack([dist(t1=0.6, t2=0.4), dist(t3=1.0), dist(t5=1.0)])
    # target >= draft at both drafts: accepted for any uniform, even 0.999
    result = verify_chain_sampled(ids(1, 3), draft_probs, target_probs, u(0.999, 0.999, 0.3))
    assert result == ChainResult(2, 5, (1, 3, 5))


def test_chain_sampled_first_rejected_recovers_from_residual():
    draft_probs = torch.stack([dist(t1=0.8, t2=0.2), dist(t3=1.0)])
    target_probs = torch.stack([dist(t1=0.4, t2=0.2, t4=0.4), dist(t3=1.0), dist(t5=1.0)])
    # ratio 0.5 at token 1: uniform 0.49 accepts, 0.51 rejects
    assert verify_chain_sampled(ids(1, 3), draft_probs, target_probs, u(0.49, 0.0, 0.0)).accepted == 2
    rejected = verify_chain_sampled(ids(1, 3), draft_probs, target_probs, u(0.51, 0.0, 0.0))
    # residual max(0, target - draft) = {4: 0.4}: the recovered token is 4 whatever the uniform
    assert rejected == ChainResult(0, 4, (4,))
    assert verify_chain_sampled(ids(1, 3), draft_probs, target_probs, u(0.51, 0.0, 0.999)).next_token == 4


def test_chain_sampled_zero_target_probability_always_rejected():
    draft_probs = dist(t2=1.0)[None]
    target_probs = torch.stack([dist(t0=0.5, t1=0.5), dist(t3=1.0)])
    for first in (0.0, 0.5, 0.999):  # uniform 0 is the most accepting value
        result = verify_chain_sampled(ids(2), draft_probs, target_probs, u(first, 0.2))
        assert result.accepted == 0 and result.next_token in (0, 1)
    assert verify_chain_sampled(ids(2), None, target_probs, u(0.0, 0.7)) == ChainResult(0, 1, (1,))


def test_chain_sampled_empty_draft_samples_the_target():
    target_probs = dist(t0=0.25, t2=0.5, t5=0.25)[None]
    for value, token in ((0.0, 0), (0.24, 0), (0.26, 2), (0.74, 2), (0.76, 5), (0.999, 5)):
        assert verify_chain_sampled(ids(), None, target_probs, u(value)) == ChainResult(0, token, (token,))


def test_chain_sampled_deterministic_draft_counts_as_one_hot():
    target_probs = torch.stack([dist(t1=0.3, t2=0.3, t3=0.4), dist(t4=1.0)])
    assert verify_chain_sampled(ids(3), None, target_probs, u(0.39, 0.0)).accepted == 1
    rejected = verify_chain_sampled(ids(3), None, target_probs, u(0.41, 0.9))
    # residual: target with the draft token removed = {1: 0.3, 2: 0.3}; uniform 0.9 -> 2
    assert rejected == ChainResult(0, 2, (2,))
    explicit = verify_chain_sampled(ids(3), one_hot(3), target_probs, u(0.41, 0.9))
    assert explicit == rejected


def test_chain_sampled_recovered_token_follows_the_normalised_residual():
    gen = torch.Generator().manual_seed(3)
    target_probs = torch.softmax(torch.randn(2, V, generator=gen), -1)
    draft_probs = torch.softmax(torch.randn(1, V, generator=gen), -1)
    token = int((draft_probs[0] - target_probs[0]).argmax())  # draft > target there: can reject
    residual = (target_probs[0] - draft_probs[0]).clamp(min=0)
    residual = (residual / residual.sum())[None]
    for value in torch.linspace(0, 0.999, 23):
        result = verify_chain_sampled(ids(token), draft_probs, target_probs, u(0.9999, float(value)))
        assert result.accepted == 0
        assert result.next_token == int(sample_from(residual, value[None].float()))


def test_chain_sampled_with_greedy_target_is_greedy():
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):
        logits = torch.randn(4, V, generator=gen)
        greedy = warp_probs(logits, SamplingParams(temperature=0.0))
        drafts = torch.where(torch.rand(3, generator=gen) < 0.6, logits[:3].argmax(-1), torch.randint(0, V, (3,), generator=gen))
        draft_probs = torch.softmax(torch.randn(3, V, generator=gen), -1)
        sampled = verify_chain_sampled(drafts, draft_probs, greedy, torch.rand(4, generator=gen))
        assert sampled == verify_chain_greedy(drafts, logits)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(target_probs=torch.rand(2, V)), "target_probs has shape"),
        (dict(uniforms=u(0.1, 0.2)), "uniforms has shape"),
        (dict(uniforms=u(0.1, 0.2, 1.0)), "uniforms must lie in"),
        (dict(draft_ids=torch.tensor([0.0, 1.0])), "integer token ids"),
        (dict(draft_ids=ids(0, V)), "vocab is 6"),
        (dict(draft_probs=torch.rand(2, V + 1)), "draft_probs has shape"),
        (dict(draft_ids=ids(0, 1)[None]), "expected draft_ids"),
    ],
)
def test_chain_sampled_shape_errors(change, message):
    args = dict(draft_ids=ids(0, 1), draft_probs=torch.rand(2, V), target_probs=torch.rand(3, V), uniforms=u(0.1, 0.2, 0.3))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        verify_chain_sampled(**args)


def test_chain_greedy_shape_errors():
    with pytest.raises(ValueError, match="target_logits has shape"):
        verify_chain_greedy(ids(1, 2), torch.randn(2, V))
    with pytest.raises(ValueError, match="expected draft_ids"):
        verify_chain_greedy(ids(1, 2)[None], torch.randn(3, V))


# ----------------------------------------------------------------------------- trees

TREE = (-1, 0, 0, 1, 1, 2)  # root; A, B; A's children C, D; B's child E


def test_tree_greedy_follows_the_argmax_path():
    tokens = ids(0, 1, 2, 3, 4, 5)
    target = torch.zeros(6, V)
    target[0, 2] = target[2, 5] = target[5, 0] = 1.0  # root wants B (2), B wants E (5), E wants 0
    assert verify_tree_greedy(TREE, tokens, target) == TreeResult((2, 5), 0, (2, 5, 0))
    target[2] = 0.0
    target[2, 4] = 1.0  # after B the target wants 4: no child of B has it
    assert verify_tree_greedy(TREE, tokens, target) == TreeResult((2,), 4, (2, 4))
    target[0] = 0.0
    target[0, 5] = 1.0  # root wants 5: neither A nor B
    assert verify_tree_greedy(TREE, tokens, target) == TreeResult((), 5, (5,))


def test_tree_greedy_with_the_steps_argmax_takes_the_tokens_as_ints():
    """The engine's greedy walk: the rows' argmax from the step (best) and the node tokens as a
    list of ints give what the tensor form gives; a length that disagrees with the tree is named."""
    tokens = ids(0, 1, 2, 3, 4, 5)
    target = torch.zeros(6, V)
    target[0, 2] = target[2, 5] = target[5, 0] = 1.0
    best = target.argmax(-1).tolist()
    assert verify_tree_greedy(TREE, tokens.tolist(), target, best) == verify_tree_greedy(TREE, tokens, target) \
        == TreeResult((2, 5), 0, (2, 5, 0))
    with pytest.raises(ValueError, match="node_tokens 5 entries, expected 6"):
        verify_tree_greedy(TREE, tokens.tolist()[:5], target, best)


def test_tree_sampled_rejected_child_leaves_the_residual_renormalised():
    tokens = ids(0, 1, 2, 3, 4, 5)
    target = torch.stack([dist(t1=0.5, t2=0.25, t3=0.25)] + [dist(t0=1.0)] * 5)
    # A (token 1) accepted with prob 0.5: uniform 0.6 rejects; then B (token 2) has prob
    # 0.25 / 0.5 = 0.5 under the renormalised residual: uniform 0.45 accepts it.
    uniforms = u(0.6, 0.45, 0.0, 0.0, 0.0, 0.3)
    # B's only child E (token 5) has zero probability after B: rejected; next token from the rest
    assert verify_tree_sampled(TREE, tokens, target, uniforms) == TreeResult((2,), 0, (2, 0))
    assert verify_tree_sampled(TREE, tokens, target, u(0.6, 0.55, 0, 0, 0, 0.3)) == TreeResult((), 3, (3,))


def test_tree_sampled_leaf_gives_bonus_and_zero_probability_child_is_rejected():
    tokens = ids(0, 1, 2, 3, 4, 5)
    target = torch.stack([dist(t2=1.0), dist(t0=1.0), dist(t5=1.0), dist(t0=1.0), dist(t0=1.0), dist(t4=1.0)])
    # A has zero target probability (rejected even at uniform 0); B then has all the mass.
    result = verify_tree_sampled(TREE, tokens, target, u(0.0, 0.999, 0.0, 0.0, 0.999, 0.5))
    assert result == TreeResult((2, 5), 4, (2, 5, 4))  # E is a leaf: bonus from target after E


def test_tree_sampled_all_children_rejected_samples_what_is_left():
    tokens = ids(0, 1, 2, 3, 4, 5)
    target = torch.stack([dist(t1=0.25, t2=0.25, t3=0.25, t4=0.25)] + [dist(t0=1.0)] * 5)
    for value, expected in ((0.2, 3), (0.7, 4)):
        result = verify_tree_sampled(TREE, tokens, target, u(0.99, 0.99, 0, 0, 0, value))
        assert result == TreeResult((), expected, (expected,))


def test_tree_single_node_just_samples_the_target():
    target = dist(t1=0.5, t4=0.5)[None]
    assert verify_tree_sampled((-1,), ids(0), target, u(0.7)) == TreeResult((), 4, (4,))
    assert verify_tree_greedy((-1,), ids(0), target).next_token == 1


def test_chain_shaped_tree_equals_chain_with_deterministic_draft():
    gen = torch.Generator().manual_seed(8)
    parents = (-1, 0, 1, 2)
    for _ in range(200):
        target = warp_probs(torch.randn(4, V, generator=gen) * 2, SamplingParams(temperature=1.0))
        drafts = torch.where(torch.rand(3, generator=gen) < 0.7, target[:3].argmax(-1), torch.randint(0, V, (3,), generator=gen))
        uniforms = torch.rand(4, generator=gen)
        tree = verify_tree_sampled(parents, torch.cat([ids(0), drafts]), target, uniforms)
        chain = verify_chain_sampled(drafts, None, target, uniforms)
        assert tree.tokens == chain.tokens and len(tree.accepted_nodes) == chain.accepted


def test_tree_typical_is_greedy_on_one_hot_targets_and_lossy_otherwise():
    gen = torch.Generator().manual_seed(9)
    for _ in range(30):
        logits = torch.randn(6, V, generator=gen)
        tokens = torch.where(torch.rand(6, generator=gen) < 0.7, logits[[0, 0, 0, 1, 1, 2]].argmax(-1),
                             torch.randint(0, V, (6,), generator=gen))
        greedy = warp_probs(logits, SamplingParams(temperature=0.0))
        typical = verify_tree_typical(TREE, tokens, greedy, torch.rand(6, generator=gen))
        assert typical == verify_tree_greedy(TREE, tokens, logits)
    # LOSSY: a candidate with target probability 0.5 passes the typical threshold and is
    # accepted for every uniform; lossless verification accepts it only half the time.
    target = torch.stack([dist(t1=0.5, t3=0.5)] + [dist(t0=1.0)] * 5)
    tokens = ids(0, 1, 2, 3, 4, 5)
    assert verify_tree_typical(TREE, tokens, target, u(0.9, 0.9, 0.9, 0.9, 0.9, 0.9)).accepted_nodes[:1] == (1,)
    assert verify_tree_sampled(TREE, tokens, target, u(0.9, 0.9, 0.9, 0.9, 0.9, 0.9)).accepted_nodes == ()


def test_tree_typical_prefers_deeper_then_more_likely_paths():
    target = torch.stack([dist(t1=0.5, t2=0.5), dist(t3=0.6, t4=0.4), dist(t5=0.9, t0=0.1)] + [dist(t0=1.0)] * 3)
    tokens = ids(0, 1, 2, 3, 4, 5)
    # depth-2 candidates C (0.6 after A), D (0.4 after A), E (0.9 after B): E has the best path
    result = verify_tree_typical(TREE, tokens, target, u(0, 0, 0, 0, 0, 0.0))
    assert result == TreeResult((2, 5), 0, (2, 5, 0))
    with pytest.raises(ValueError, match="posterior_alpha"):
        verify_tree_typical(TREE, tokens, target, u(0, 0, 0, 0, 0, 0), posterior_alpha=0.0)


@pytest.mark.parametrize(
    "parents, message", [((0, 0), "must start with -1"), ((-1, 1), "parent of node 1 is 1"), ((-1, 0, 3, 1), "parent of node 2")]
)
def test_tree_bad_parents(parents, message):
    n = len(parents)
    with pytest.raises(ValueError, match=message):
        verify_tree_sampled(parents, torch.zeros(n, dtype=torch.int64), torch.full((n, V), 1 / V), torch.zeros(n))


def test_tree_shape_errors():
    target = torch.full((6, V), 1 / V)
    with pytest.raises(ValueError, match="node_tokens has shape"):
        verify_tree_sampled(TREE, ids(0, 1, 2), target, torch.zeros(6))
    with pytest.raises(ValueError, match="target_probs has shape"):
        verify_tree_greedy(TREE, ids(0, 1, 2, 3, 4, 5), target[:5])
    with pytest.raises(ValueError, match="uniforms has shape"):
        verify_tree_sampled(TREE, ids(0, 1, 2, 3, 4, 5), target, torch.zeros(5))
    with pytest.raises(ValueError, match="node_tokens has shape"):
        verify_tree_sampled(TREE, ids(0, 1, 2, 3, 4, 5)[None], target, torch.zeros(6))
    with pytest.raises(ValueError, match="target_probs has shape"):
        verify_tree_sampled(TREE, ids(0, 1, 2, 3, 4, 5), target[None], torch.zeros(6))
