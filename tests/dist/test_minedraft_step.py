"""MineDraft's verification is `Scheduler.step` itself (it passes the batch being drafted as
`exclude`), so everything the plain step does happens on MineDraft steps too: Medusa and
`auto` requests get the target's hidden state and keep drafting; and the running set is
never swapped for a subset while a step plans, so `stats()` (read without the lock, e.g.
by /health) always counts every running request. In process, over the loopback drafter."""

from __future__ import annotations

import pytest
import torch

from specbuild.compiler.medusa_role import add_medusa, parse_heads
from specbuild.dist import draft_worker as W
from specbuild.dist import minedraft as M
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig
from tiny import draft_pair_bundle

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21], [40, 41, 42], [7, 7, 7, 7]]
HIDDEN, VOCAB = 64, 320  # tests/helpers/tiny.py defaults


def shared_heads(lm_head: torch.Tensor, num_heads: int = 2) -> dict[str, torch.Tensor]:
    """Medusa heads in FasterDecoding layout: a small residual block over the target's own
    lm_head (so their guesses are the target's, a step late: accepted on repetitive text)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for h in range(num_heads):
        out[f"{h}.0.linear.weight"] = torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.01
        out[f"{h}.0.linear.bias"] = torch.zeros(HIDDEN)
        out[f"{h}.1.weight"] = lm_head.clone()
    return out


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    """A target with both drafters: a draft model (MineDraft's) and Medusa heads."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("minedraft_medusa")
    out = draft_pair_bundle(root, max_seq_len=512, max_batch_size=8)
    lm_head = load_file(f"{out}/target/weights.safetensors")["lm_head"].float()
    add_medusa(out, parse_heads(shared_heads(lm_head), "shared"), "chain_2")
    return out


def loopback_engine(bundle: str):
    engine = Engine(bundle, EngineConfig(max_batch_size=4, threads=1))
    proposer, vocab = W.load_draft_proposer(bundle, EngineConfig(max_batch_size=4, threads=1))
    return engine, M.install(engine, M.LoopbackTransport(W.DraftWorker(proposer, vocab)))


def request(prompt: list[int], method: str, max_tokens: int = 40) -> Request:
    return Request(prompt_ids=prompt, speculation=SpeculationConfig.make(None, method=method, gamma=2),
                   sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_medusa_requests_draft_on_minedraft_steps(bundle):
    plain = Engine(bundle, EngineConfig(max_batch_size=4, threads=1))
    methods = ["draft", "draft", "medusa", "medusa"]
    expect = plain.generate([request(p, "none") for p in PROMPTS])
    engine, scheduler = loopback_engine(bundle)
    handles = [engine.submit(request(p, m)) for p, m in zip(PROMPTS, methods)]
    engine.run_until_done()
    results = [h.result() for h in handles]
    assert [r["token_ids"] for r in results] == [r["token_ids"] for r in expect]  # lossless
    assert scheduler.stats["minedraft_steps"] > 10, scheduler.stats  # the two batches alternated
    for h, method in zip(handles, methods):
        seq, stats = h.seq, h.result()["stats"]
        assert stats["drafted"] > 0, (method, stats)
        if method == "medusa":
            # every decode step after the first drafts a tree: the hidden state was there on
            # MineDraft steps too (before the fix, only ordinary steps carried it)
            drafted_steps = seq.drafted_by_pos[0] if seq.drafted_by_pos else 0  # tree steps with drafts
            assert drafted_steps >= seq.verify_passes - 1, (drafted_steps, seq.verify_passes)
    assert sum(r["stats"]["accepted"] for r, m in zip(results, methods) if m == "medusa") > 0


def test_stats_count_every_running_request_during_a_minedraft_step(bundle):
    engine, scheduler = loopback_engine(bundle)
    handles = [engine.submit(request(p, "draft", max_tokens=30)) for p in PROMPTS]
    seen: list[tuple[int, int]] = []

    def spy(fn):  # inside the step (planning, forward), as a lock-free reader would see it
        def wrapped(*args, **kwargs):
            admitted = sum(1 for h in handles if h.seq.t_admit is not None and not h.seq.finished)
            seen.append((engine.stats()["running"], admitted))
            return fn(*args, **kwargs)
        return wrapped

    engine.model.forward = spy(engine.model.forward)
    engine.speculator.propose = spy(engine.speculator.propose)
    engine.run_until_done()
    assert all(h.result()["finish_reason"] == "length" for h in handles)
    assert scheduler.stats["minedraft_steps"] > 5, scheduler.stats
    assert seen and all(r == n for r, n in seen), [s for s in seen if s[0] != s[1]][:5]
