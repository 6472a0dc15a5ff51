"""OpenAI's logit adjustments and logprobs (specbuild.sampling.params): limits, the definitions
on small examples, and the property speculation needs: a verify row scores exactly as the
same position decoded plainly after the draft's earlier tokens."""

from __future__ import annotations

import math

import pytest
import torch

from specbuild.errors import RequestError
from specbuild.sampling.params import MAX_LOGIT_BIAS, SamplingParams, adjust_logits, token_logprobs, warp_probs


def test_limits_name_the_value():
    with pytest.raises(RequestError, match=r"presence_penalty=3 is out of range \[-2, 2\]"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(RequestError, match=r"frequency_penalty=True"):
        SamplingParams(frequency_penalty=True)
    with pytest.raises(RequestError, match=rf"at most {MAX_LOGIT_BIAS}"):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})
    with pytest.raises(RequestError, match=r"biases in \[-100, 100\]"):
        SamplingParams(logit_bias={"5": 101})
    with pytest.raises(RequestError, match="must map token ids to numbers"):
        SamplingParams(logit_bias={"x": 1})
    assert SamplingParams(logit_bias={"7": -1, 2: 3}).logit_bias == ((2, 3.0), (7, -1.0))  # JSON keys are strings
    assert SamplingParams.from_dict({"presence_penalty": 0.5}).adjusts and not SamplingParams().adjusts


def test_definitions_on_a_small_example():
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={1: 2.0})
    logits = torch.zeros(1, 4)
    out = adjust_logits(logits, p, history=[3, 3, 0])
    assert out.tolist() == [[-0.75, 2.0, 0.0, -1.0]]  # 0: once (0.5 + 0.25); 3: twice (0.5 + 0.5)
    assert adjust_logits(logits, SamplingParams(), [3]) is logits  # nothing set: untouched


def test_verify_rows_score_as_plain_positions():
    torch.manual_seed(0)
    p = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3, logit_bias={4: -5.0, 9: 1.5})
    history, draft = [1, 5, 5, 9], [9, 2, 5]
    logits = torch.randn(len(draft) + 1, 16)
    rows = adjust_logits(logits, p, history, [draft[:i] for i in range(len(draft) + 1)])
    for i in range(len(draft) + 1):
        plain = adjust_logits(logits[i:i + 1], p, history + draft[:i])
        assert torch.equal(rows[i], plain[0]), i


def test_logprobs_follow_the_sampling_distribution():
    torch.manual_seed(1)
    logits = torch.randn(2, 10)
    greedy = token_logprobs(logits, SamplingParams(), [3, 4], top_n=3)
    ref = torch.log_softmax(logits, -1)
    assert math.isclose(greedy[0][0], float(ref[0, 3]), rel_tol=1e-5)
    top = greedy[1][1]
    assert [t for t, _ in top] == torch.topk(ref[1], 3).indices.tolist()
    p = SamplingParams(temperature=0.5, top_k=2, seed=0)
    lp = token_logprobs(logits, p, [int(logits[0].argmax()), int(logits[0].argmin())], top_n=2)
    assert lp[1][0] == -math.inf  # excluded by top-k
    probs = warp_probs(logits, p)
    assert math.isclose(math.exp(lp[0][0]), float(probs[0, logits[0].argmax()]), rel_tol=1e-5)
    assert math.isclose(sum(math.exp(v) for _, v in lp[0][1]), 1.0, rel_tol=1e-5)


def test_repetition_penalty_is_vllms():
    """vLLM's repetition_penalty: a token seen in the prompt (repetition_ids) or the output has
    its logit divided by the penalty when positive, multiplied when negative; applied after
    logit_bias and before the frequency/presence penalties; verify rows count their path."""
    with pytest.raises(RequestError, match=r"repetition_penalty=0 is out of range \(0, 100\]"):
        SamplingParams(repetition_penalty=0)
    assert SamplingParams(repetition_penalty=1.2).adjusts and not SamplingParams(repetition_penalty=1.0).adjusts
    p = SamplingParams(repetition_penalty=2.0, repetition_ids=(1, 1, 4), logit_bias={2: 1.0}, presence_penalty=0.5)
    logits = torch.tensor([[3.0, 2.0, -1.0, 4.0, -6.0, 5.0]])
    out = adjust_logits(logits, p, history=[2])
    # 1, 4: the prompt's; 2: generated (bias first: -1 + 1 = 0, * 2 = 0, then presence -0.5); 0, 3, 5 untouched
    assert out.tolist() == [[3.0, 1.0, -0.5, 4.0, -12.0, 5.0]]
    rows = torch.tensor([[3.0, 2.0, -1.0, 4.0, -6.0, 5.0]] * 3)
    verify = adjust_logits(rows, p, history=[2], row_prefixes=[[], [5], [5, 0]])
    for i, prefix in enumerate([[], [5], [5, 0]]):
        assert torch.equal(verify[i], adjust_logits(rows[:1], p, history=[2] + prefix)[0])
    assert verify[1, 5] == 5 / 2 - 0.5 and verify[2, 0] == 3 / 2 - 0.5 and verify[0, 5] == 5.0  # path tokens are output
