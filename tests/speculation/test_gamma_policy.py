"""Gamma policies per content type: the classifier, the controller starting from a policy,
acceptance collapse, and the failure-mode events (KV desync repair, draft failure fallback).
Lossless: with any policy greedy output equals plain greedy token for token."""

from __future__ import annotations

import pytest

from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.events import NullSink
from specbuild.engine.sequence import Request
from specbuild.errors import RequestError
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig
from specbuild.speculation.policy import GammaPolicy, PolicyTable, check_content_type, classify_prompt, request_content_type
from tiny import draft_pair_bundle

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21], list(range(30, 90)) + list(range(30, 40))]


class ListSink(NullSink):
    enabled = True

    def __init__(self) -> None:
        self.started, self.steps, self.ended, self.events = [], [], [], []

    def on_session_start(self, seq):
        self.started.append(seq.seq_id)

    def on_step(self, seq, step):
        self.steps.append((seq.seq_id, step))

    def on_session_end(self, seq):
        self.ended.append(seq.seq_id)

    def on_event(self, seq, kind, detail):
        self.events.append((seq.seq_id, kind, detail))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return draft_pair_bundle(tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="module")
def engine(bundle):
    return Engine(bundle, EngineConfig(max_batch_size=4))


def run(engine, method, max_tokens=40, content_type=None, prompts=PROMPTS, **spec):
    s = SpeculationConfig.make(None, method=method, **spec)
    return engine.generate([Request(prompt_ids=p, speculation=s, content_type=content_type,
                                    sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts])


def test_classifier_rules():
    assert classify_prompt("Write a Python function that reverses a list.") == "code"
    assert classify_prompt("```\nprint(1)\n```\nWhat does this print?") == "code"
    assert classify_prompt('{"name": "a", "items": [1, 2]}') == "structured"
    assert classify_prompt("Return the answer as JSON with keys name: and age:") == "structured"
    assert classify_prompt("Summarize the following article in three sentences: ...") == "summarization"
    assert classify_prompt("Lorem ipsum dolor sit amet. " * 120) == "summarization"  # long documents
    assert classify_prompt("How are you today? Any plans for the weekend?") == "chat"
    templated = "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\ndef f(): return 1\nfix it<|im_end|>\n"
    assert classify_prompt(templated) == "code"


def test_content_type_validation():
    assert check_content_type("code") == "code" and check_content_type(None) is None
    assert request_content_type({"content_type": "legal-docs"}) == "legal-docs"
    assert request_content_type({"prompt": "x"}) is None
    for bad in ("", "Code", "x" * 33, 7, "a b"):
        with pytest.raises(RequestError, match="content_type="):
            check_content_type(bad)


def test_policy_table_lookup_most_specific_first():
    rows = [GammaPolicy(content_type="code", gamma_default=6), GammaPolicy(gamma_default=2),
            GammaPolicy(model_id="m", content_type="code", method="draft", gamma_default=7),
            GammaPolicy(model_id="other", content_type="chat", gamma_default=1)]
    t = PolicyTable(rows, "m")
    assert t.lookup("code", "draft").gamma_default == 7
    assert t.lookup("code", "ngram").gamma_default == 6
    assert t.lookup("chat", "ngram").gamma_default == 2  # the 'other' model's row does not apply
    assert PolicyTable([], "m").lookup("code", "draft") is None
    with pytest.raises(ValueError, match="gamma_default"):
        GammaPolicy(gamma_min=3, gamma_default=2)


def test_policy_start_and_bounds_are_lossless(engine):
    """Greedy output with any policy equals plain greedy; the first gamma is the policy's."""
    plain = run(engine, "none")
    policies = [GammaPolicy(gamma_default=1, prior_alpha=0.2), GammaPolicy(gamma_default=7, prior_alpha=0.9),
                GammaPolicy(gamma_min=2, gamma_max=3, gamma_default=3),
                GammaPolicy(alpha_threshold=0.99, collapse_steps=2, gamma_default=4)]  # collapses at once
    for policy in policies:
        engine.set_policies(PolicyTable([policy]))
        try:
            for method in ("draft", "ngram"):
                out = run(engine, method, content_type="chat")
                assert [r["token_ids"] for r in out] == [r["token_ids"] for r in plain], (policy, method)
                assert sum(r["stats"]["drafted"] for r in out) > 0 and sum(r["stats"]["accepted"] for r in out) > 0
                # the controller stays inside the policy's bounds
                assert max(r["stats"]["gamma"]["max"] for r in out) <= policy.gamma_max
        finally:
            engine.set_policies(None)


def test_first_gamma_comes_from_the_content_types_policy(engine):
    sink = ListSink()
    engine.set_sink(sink)
    engine.set_policies(PolicyTable([GammaPolicy(content_type="code", gamma_default=7),
                                     GammaPolicy(content_type="chat", gamma_default=1)]))
    try:
        for ctype, start in (("code", 7), ("chat", 1)):
            sink.steps.clear()
            run(engine, "draft", max_tokens=12, content_type=ctype)
            first = {}
            for sid, st in sink.steps:
                first.setdefault(sid, st)
            assert len(first) == len(PROMPTS)
            assert {st.gamma for st in first.values()} == {start}, ctype
            # the batch's fit (Speculator.fit_to_batch) may cut what the depth asked for, never
            # below the one node a sequence with no verified draft yet is sent to learn from
            assert all(1 <= st.drafted <= start for st in first.values()), [st.drafted for st in first.values()]
    finally:
        engine.set_sink(None)
        engine.set_policies(None)


def test_acceptance_collapse_switches_speculation_off_then_probes(engine):
    sink = ListSink()
    engine.set_sink(sink)
    engine.set_policies(PolicyTable([GammaPolicy(alpha_threshold=0.99, collapse_steps=3, gamma_default=4)]))
    try:
        # one sequence at a time: in a batch the batch's fit (Speculator.fit_to_batch) cuts
        # drafts that do not pay before the policy's threshold sees them
        plain = run(engine, "none", max_tokens=60)
        out = [r for p in PROMPTS for r in run(engine, "draft", max_tokens=60, prompts=[p])]
    finally:
        engine.set_sink(None)
        engine.set_policies(None)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in plain]
    collapses = [e for e in sink.events if e[1] == "acceptance_collapse" and e[2]["rule"] == "threshold"]
    assert collapses and all(e[2]["steps"] >= 3 for e in collapses)
    # after a collapse a sequence runs plain (fallback) except for probes every 16 steps
    sid = collapses[0][0]
    steps = [st for s, st in sink.steps if s == sid]
    assert sum(st.fallback for st in steps) > 0
    after = steps[next(i for i, st in enumerate(steps) if st.fallback):]
    assert sum(1 for st in after if st.drafted) <= len(after) // 16 + 1
    assert set(sink.started) == set(sink.ended) and len(sink.started) >= 2 * len(PROMPTS)


def test_draft_failure_falls_back_to_plain(engine, monkeypatch):
    prop = engine.speculator.proposers["draft"]
    real = prop.propose
    calls = {"n": 0}

    def flaky(seqs, gammas):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("simulated draft OOM")
        return real(seqs, gammas)

    plain = run(engine, "none")
    sink = ListSink()
    engine.set_sink(sink)
    monkeypatch.setattr(prop, "propose", flaky)
    try:
        out = run(engine, "draft", gamma=3)
    finally:
        engine.set_sink(None)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in plain]
    failures = [e for e in sink.events if e[1] == "draft_failure"]
    assert failures and failures[0][2]["fallback"] == "plain" and "simulated draft OOM" in failures[0][2]["error"]
    assert any(st.fallback for _, st in sink.steps) and any(st.accepted for _, st in sink.steps)


def test_kv_desync_is_detected_repaired_and_recorded(engine):
    plain = run(engine, "none", max_tokens=20)
    sink = ListSink()
    engine.set_sink(sink)
    try:
        spec = SpeculationConfig.make(None, method="draft", gamma=3)
        h = engine.submit(Request(prompt_ids=PROMPTS[0], speculation=spec,
                                  sampling=SamplingParams(max_tokens=20, ignore_eos=True)))
        while len(h.seq.output_ids) < 5:
            engine.step()
        engine.cache.set_length(h.seq.seq_id, h.seq.num_cached - 2)  # corrupt the target cache
        r = h.result()
    finally:
        engine.set_sink(None)
    assert r["token_ids"] == plain[0]["token_ids"]
    desync = [e for e in sink.events if e[1] == "kv_desync"]
    assert desync and desync[0][2]["cache"] == "target" and desync[0][2]["repair"] == "re-prefill"
    assert desync[0][2]["have"] == desync[0][2]["expected"] - 2
