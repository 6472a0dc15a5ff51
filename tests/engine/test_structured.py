"""Structured output, penalties and logprobs through the engine (tiny float64 models, so a
batch's shape cannot change a greedy token):

- greedy constrained speculation equals greedy constrained plain decoding token for token, for
  every drafter, with drafts proposed and accepted; every output parses and validates;
- the tokens a grammar forces are proposed as free drafts and accepted;
- penalties and logit_bias: speculation equals plain decoding under them too;
- logprobs are identical with and without speculation;
- sampled constrained speculation matches the exact constrained distribution (chi-square,
  enumerated on the tiny model), and the test rejects a wrong distribution;
- bad values are refused with the limit named."""

from __future__ import annotations


import pytest
import torch
from scipy.stats import chisquare
from tiny import draft_pair_bundle

from specbuild.bench.structured import validates
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.errors import RequestError
from specbuild.sampling.constraint import ResponseFormat
from specbuild.sampling.params import SamplingParams, warp_probs
from specbuild.speculation.config import SpeculationConfig

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]},
    "tag": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    "note": {"type": "string", "maxLength": 12}},
    "required": ["ok", "n", "tag", "note"], "additionalProperties": False}
FMT = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8], [40, 41, 42], [7, 7, 7, 7, 7], list(range(30, 50))]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return draft_pair_bundle(tmp_path_factory.mktemp("structured"), noise=0.05, max_seq_len=512)


@pytest.fixture(scope="module")
def engine(bundle):
    return Engine(bundle, EngineConfig(max_batch_size=4))


def run(engine, method, prompts=PROMPTS, max_tokens=300, gamma=3, fmt=FMT, logprobs=None, **sampling):
    spec = SpeculationConfig.make(None, method=method, gamma=None if method == "none" else gamma)
    reqs = [Request(prompt_ids=p, speculation=spec, response_format=fmt, logprobs=logprobs,
                    sampling=SamplingParams(max_tokens=max_tokens, **sampling)) for p in prompts]
    return engine.generate(reqs)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_constrained_speculation_equals_constrained_plain(engine, method):
    plain = run(engine, "none")
    spec = run(engine, method)
    for p, s in zip(plain, spec):
        assert s["token_ids"] == p["token_ids"]
        assert p["finish_reason"] == "stop"  # the grammar completed, not the length limit
        ok, why = validates(p["text"], SCHEMA)
        assert ok, (why, p["text"])
    assert sum(r["stats"]["drafted"] for r in spec) > 0 and sum(r["stats"]["accepted"] for r in spec) > 0


def test_forced_tokens_are_free_drafts(engine):
    """With speculation off entirely, the grammar's forced runs ('{"ok": ', '"tag": "' ...) are
    still drafted and accepted, and the output is plain decoding's."""
    plain_none = run(engine, "none")
    forced = [r["stats"] for r in plain_none]
    assert sum(s["drafted"] for s in forced) > 0 and sum(s["accepted"] for s in forced) > 0
    assert all(s["target_passes"] < s["generated_tokens"] for s in forced)  # fewer passes than tokens


def test_unconstrained_output_is_unchanged_by_the_machinery(engine):
    a = run(engine, "none", fmt=None, max_tokens=30, ignore_eos=True)
    b = run(engine, "draft", fmt=None, max_tokens=30, ignore_eos=True)
    assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_penalties_and_bias_are_lossless_under_speculation(engine, method):
    kw = dict(fmt=None, max_tokens=40, ignore_eos=True, presence_penalty=0.6, frequency_penalty=0.4,
              logit_bias={5: 3.0, 9: -100.0})
    plain, spec = run(engine, "none", **kw), run(engine, method, **kw)
    assert [r["token_ids"] for r in plain] == [r["token_ids"] for r in spec]
    assert all(9 not in r["token_ids"] for r in plain)  # a -100 bias is a ban here
    free = run(engine, "none", fmt=None, max_tokens=40, ignore_eos=True)
    assert [r["token_ids"] for r in free] != [r["token_ids"] for r in plain]  # and the penalties did something
    assert sum(r["stats"]["accepted"] for r in spec) > 0


def test_logprobs_identical_with_and_without_speculation(engine):
    plain = run(engine, "none", fmt=None, max_tokens=24, ignore_eos=True, logprobs=3)
    spec = run(engine, "draft", fmt=None, max_tokens=24, ignore_eos=True, logprobs=3)
    assert sum(r["stats"]["accepted"] for r in spec) > 0
    for p, s in zip(plain, spec):
        assert len(p["logprobs"]) == len(p["token_ids"]) == len(s["logprobs"])
        for tok, a, b in zip(p["token_ids"], p["logprobs"], s["logprobs"]):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-9)
            assert [t["id"] for t in a["top_logprobs"]] == [t["id"] for t in b["top_logprobs"]]
            assert a["top_logprobs"][0]["id"] == tok  # greedy: the chosen token is the most likely
            assert a["logprob"] <= 0.0


def test_bad_values_are_refused(engine):
    with pytest.raises(RequestError, match=r"logprobs=21 must be an integer in \[0, 20\]"):
        engine.submit(Request(prompt_ids=[1, 2], logprobs=21))
    with pytest.raises(RequestError, match="response_format.type='yaml'"):
        engine.submit(Request(prompt_ids=[1, 2], response_format={"type": "yaml"}))
    with pytest.raises(RequestError, match="does not compile"):
        engine.submit(Request(prompt_ids=[1, 2], response_format={"type": "regex", "regex": "(("}))


# ---- sampled: the exact constrained distribution -------------------------------------------------
def exact_two_chars(engine, prompt: list[int], allowed: list[int], temperature: float) -> dict:
    """P(x1, x2) when x1, x2 are restricted to `allowed` (the regex [ab][ab]) under plain
    sampling at `temperature`: the mask, renormalised, at each position."""
    from specbuild.bench.verify_dist import last_logits

    params = SamplingParams(temperature=temperature)
    keep = torch.zeros(engine.target_config.vocab_size, dtype=torch.bool)
    keep[allowed] = True
    out = {}
    p1 = warp_probs(last_logits(engine, prompt).masked_fill(~keep, float("-inf")).unsqueeze(0), params)[0]
    for a in allowed:
        p2 = warp_probs(last_logits(engine, prompt + [a]).masked_fill(~keep, float("-inf")).unsqueeze(0), params)[0]
        for b in allowed:
            out[(a, b)] = float(p1[a] * p2[b])
    return out


def test_sampled_constrained_speculation_matches_the_exact_distribution(engine):
    tok = engine.tokenizer
    allowed = [tok.token_to_id("a"), tok.token_to_id("b")]
    prompt, n = [5, 6, 7, 8, 5, 6, 7], 600
    fmt = ResponseFormat.parse({"type": "regex", "regex": "[ab][ab]"})
    counts: dict = {}
    drafted = accepted = 0
    for base in range(0, n, 50):
        reqs = [Request(prompt_ids=prompt, response_format=fmt, speculation=SpeculationConfig.make(None, method="draft", gamma=2),
                        sampling=SamplingParams(temperature=1.0, max_tokens=8, seed=base + i)) for i in range(50)]
        for r in engine.generate(reqs):
            key = tuple(r["token_ids"][:2])
            counts[key] = counts.get(key, 0) + 1
            drafted += r["stats"]["drafted"]
            accepted += r["stats"]["accepted"]
            assert r["finish_reason"] == "stop" and len(r["token_ids"]) == 2  # two letters: the grammar is complete
    assert drafted > 0 and accepted > 0
    exact = exact_two_chars(engine, prompt, allowed, 1.0)
    assert set(counts) <= set(exact)
    cells = sorted(exact)
    observed = [counts.get(c, 0) for c in cells]

    def expected(dist):  # normalised in float64 so the totals agree exactly
        total = sum(dist[c] for c in cells)
        return [dist[c] / total * n for c in cells]

    assert chisquare(observed, expected(exact)).pvalue > 1e-4
    wrong = exact_two_chars(engine, prompt, allowed, 0.5)  # the test has the power to see a wrong distribution
    assert chisquare(observed, expected(wrong)).pvalue < 1e-4


@pytest.mark.parametrize("method", ["none", "draft"])
def test_choices_share_the_prompts_prefill(engine, method):
    """n > 1: choices 1.. copy choice 0's prompt K/V instead of prefilling again, and give
    exactly what they give when each prefills alone: seeded sampled plain decoding, and greedy
    speculation. (Sampled speculation stays exact in distribution, but a shared choice drafts
    on its first step, which a prefilling one cannot, so its random stream is consumed in
    another order.)"""
    prompt = list(range(30, 90)) * 2  # 120 tokens
    spec = SpeculationConfig.make(None, method=method, gamma=None if method == "none" else 3)
    temperature = 1.0 if method == "none" else 0.0

    def req(seed, share=None):
        return Request(prompt_ids=prompt, speculation=spec, shares_prompt_with=share,
                       sampling=SamplingParams(temperature=temperature, seed=seed, max_tokens=16, ignore_eos=True))

    alone = engine.generate([req(7 + i) for i in range(3)])
    first = engine.submit(req(7))
    others = [engine.submit(req(7 + i, share=first)) for i in (1, 2)]
    engine.run_until_done()
    shared = [h.result() for h in [first, *others]]
    assert [r["token_ids"] for r in shared] == [r["token_ids"] for r in alone]
    assert "stat_shared_prefill_tokens" not in shared[0]["stats"]
    assert all(r["stats"]["stat_shared_prefill_tokens"] == len(prompt) - 1 for r in shared[1:])
    if method == "draft":
        assert sum(r["stats"]["accepted"] for r in shared) > 0


def test_grammars_are_bounded_at_admission(engine):
    """A grammar the grammar engine gives up on at its first token ("Too many items"), and a
    regex whose language is empty, are refused at submit naming response_format (HTTP 400),
    with nothing queued; they used to fail at the first token (500 for the whole batch) and
    answer 200 with empty text. A language holding only the empty string is still served."""
    cases = [({"type": "grammar", "grammar": 'start: "a"{100000}'}, "exceeds the grammar engine's limits"),
             ({"type": "regex", "regex": r"[^\s\S]"}, "matches no text"),
             ({"type": "regex", "regex": "[a&&b]"}, "matches no text")]
    for fmt, why in cases:
        with pytest.raises(RequestError, match=f"^response_format {fmt['type']} .*{why}"):
            engine.submit(Request(prompt_ids=[5, 6], response_format=fmt))
    assert not engine.waiting and engine.cache.used_blocks == 0
    empty = engine.generate([Request(prompt_ids=[5, 6], response_format={"type": "regex", "regex": "a{0}"},
                                     sampling=SamplingParams(max_tokens=8))])[0]
    assert empty["text"] == "" and empty["finish_reason"] == "stop" and "error" not in empty
    ok = engine.generate([Request(prompt_ids=[5, 6], response_format={"type": "grammar", "grammar": 'start: "a"{40}'},
                                  sampling=SamplingParams(max_tokens=60))])[0]
    assert ok["text"] == "a" * 40 and ok["finish_reason"] == "stop"


def test_a_repeated_tool_call_ends_the_output_losslessly(engine):
    """The tool-call grammar of tool_choice required (serve/tools.py) with `calls` set: the
    tiny model repeats its calls until max_tokens without it; with it, the output stops at
    the first call that repeats an earlier one (finish "stop"), a prefix of the unstopped
    output, and speculation stops at the same token."""
    from specbuild.serve.tools import HermesParser, call_grammar

    tools = [{"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}}},
        {"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["n"],
            "additionalProperties": False}}}]
    grammar = call_grammar(tools, "required", parallel=True)
    stopped = ResponseFormat("grammar", grammar, calls=(HermesParser.OPEN, HermesParser.CLOSE))
    free = run(engine, "none", fmt=ResponseFormat("grammar", grammar), max_tokens=400)
    plain = run(engine, "none", fmt=stopped, max_tokens=400)
    spec = run(engine, "draft", fmt=stopped, max_tokens=400)
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert sum(r["stats"]["drafted"] for r in spec) > 0 and sum(r["stats"]["accepted"] for r in spec) > 0
    assert all(r["finish_reason"] == "length" for r in free)  # the repeats the stop prevents
    for p, f in zip(plain, free):
        assert p["finish_reason"] == "stop" and f["token_ids"][:len(p["token_ids"])] == p["token_ids"]
        bodies = HermesParser.PATTERN.findall(p["text"])
        assert bodies[-1] in bodies[:-1] and len(set(bodies)) == len(bodies) - 1  # ends at the first repeat


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_repetition_penalty_is_lossless_under_speculation(engine, method):
    """vLLM's repetition_penalty over the prompt (repetition_ids) and the output: speculation
    equals plain decoding under it, and it changes the output (the prompt's tokens count)."""
    def go(m, penalty=1.0, with_prompt=True):
        spec = SpeculationConfig.make(None, method=m, gamma=None if m == "none" else 3)
        return engine.generate([Request(prompt_ids=p, speculation=spec, sampling=SamplingParams(
            max_tokens=40, ignore_eos=True, repetition_penalty=penalty,
            repetition_ids=tuple(p) if with_prompt else ())) for p in PROMPTS])

    ids = {}
    for with_prompt in (True, False):
        plain, spec = go("none", 1.15, with_prompt), go(method, 1.15, with_prompt)
        assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
        assert sum(r["stats"]["drafted"] for r in spec) > 0 and sum(r["stats"]["accepted"] for r in spec) > 0
        ids[with_prompt] = [r["token_ids"] for r in plain]
    free = [r["token_ids"] for r in go("none")]
    assert ids[True] != free and ids[False] != free and ids[True] != ids[False]
