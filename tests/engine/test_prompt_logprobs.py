"""Request.prompt_logprobs (completions' echo + logprobs): computed by the request's own
prefill in the step loop, so it is validated first, queued, batched, chunked and aborted like
any request. Compared with an independent reading (one full forward per prefix)."""

from __future__ import annotations

import pytest
import torch

from specbuild.bench.verify_dist import last_logits
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.errors import RequestError
from specbuild.sampling.params import SamplingParams

PROMPT = [(7 * i + 3) % 300 + 5 for i in range(40)]  # 40 tokens: three prefill chunks of 16


@pytest.fixture(scope="module")
def engine(tiny_bundle_f64):
    return Engine(tiny_bundle_f64, EngineConfig(threads=1, prefill_chunk=16))


def scored(prompt_ids, top_n=2, max_tokens=3, **sampling) -> Request:
    return Request(prompt_ids=list(prompt_ids), prompt_logprobs=top_n,
                   sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))


def plain(prompt_ids, max_tokens=12) -> Request:
    return Request(prompt_ids=list(prompt_ids), sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_prompt_logprobs_by_the_prefill_equal_one_forward_per_prefix(engine):
    other = [11, 12, 13, 14, 15, 16]
    alone = engine.generate([plain(other)])[0]["token_ids"]
    h = engine.submit(scored(PROMPT))
    beside = engine.submit(plain(other))  # batched with the scored prefill
    engine.run_until_done()
    seq = h.seq
    assert len(seq.scoring.prompt_logprobs) == len(PROMPT) - 1 and seq.scoring.prompt_scored == len(PROMPT) - 1
    for i in range(1, len(PROMPT)):
        logp = torch.log_softmax(last_logits(engine, PROMPT[:i]).double(), -1)
        lp, top = seq.scoring.prompt_logprobs[i - 1]
        assert lp == pytest.approx(float(logp[PROMPT[i]]), abs=1e-5), i  # float32 warping, as every logprob
        assert [t for t, _ in top] == logp.topk(2).indices.tolist()
    # plain numbers only: no row of logits outlives the step that made it
    assert all(isinstance(lp, float) and all(isinstance(t, int) and isinstance(v, float) for t, v in top)
               for lp, top in seq.scoring.prompt_logprobs)
    assert beside.result()["token_ids"] == alone  # its neighbour's answer did not change
    assert h.result()["token_ids"] == engine.generate([plain(PROMPT, 3)])[0]["token_ids"]
    assert engine.cache.used_blocks == 0


def test_bad_prompts_are_refused_before_any_forward(engine, monkeypatch):
    calls = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    vocab, limit = engine.target_config.vocab_size, engine.max_seq_len
    with pytest.raises(RequestError, match=f"out of range \\[0, {vocab}\\)"):
        engine.submit(scored([5, 6, vocab + 3]))
    with pytest.raises(RequestError, match=f"max_seq_len is {limit}"):
        engine.submit(scored([5] * (limit + 10)))
    with pytest.raises(RequestError, match="prompt_logprobs=21"):
        engine.submit(scored([5, 6], top_n=21))
    assert calls == [] and not engine.waiting and engine.cache.used_blocks == 0


def test_an_aborted_scored_prefill_frees_everything(engine):
    h = engine.submit(scored(PROMPT * 3, max_tokens=8))
    engine.step()  # the first chunk of three
    assert 0 < h.seq.scoring.prompt_scored < len(PROMPT) * 3 - 1 and engine.cache.used_blocks > 0
    engine.abort(h)
    assert h.seq.finish_reason == "abort" and engine.cache.used_blocks == 0 and not engine.has_work()


def test_choices_that_share_a_prefill_share_its_logprobs(engine):
    first = engine.submit(scored(PROMPT, max_tokens=2))
    second = engine.submit(Request(prompt_ids=list(PROMPT), prompt_logprobs=2, shares_prompt_with=first,
                                   sampling=SamplingParams(max_tokens=2, ignore_eos=True, seed=3, temperature=0.7)))
    engine.run_until_done()
    assert second.seq.tally.extra.get("stat_shared_prefill_tokens") == len(PROMPT) - 1  # it did not prefill
    assert len(first.seq.scoring.prompt_logprobs) == len(PROMPT) - 1
    assert second.seq.scoring.prompt_logprobs == first.seq.scoring.prompt_logprobs
