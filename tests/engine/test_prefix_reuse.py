"""Prefix caching through the engine: a chat's second turn, choices, prompt logprobs, structured
output and a soak, each compared with an engine that has it off.

The bundle is int4 with int8 activations: a row-invariant model (decoder.row_invariant_needed),
so a reused row holds the bits the request would have computed itself and output, logprobs
and sampled tokens must be identical, not merely close.
"""

from __future__ import annotations

import random

import pytest
from tiny import draft_pair_bundle

from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig

TURN1 = list(range(30, 90)) + [5, 6, 7, 8] * 6  # 84 tokens: 5 full blocks of 16
QUESTION = [41, 42, 43, 44, 45, 46, 47]
METHODS = ["none", "ngram", "draft", "suffix", "recycle", "auto"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return draft_pair_bundle(tmp_path_factory.mktemp("prefix"), noise=0.05, quantize="int4", activations="int8",
                             max_seq_len=512)


@pytest.fixture(scope="module")
def engines(bundle):
    on = Engine(bundle, EngineConfig(max_batch_size=4))
    off = Engine(bundle, EngineConfig(max_batch_size=4, prefix_cache=False))
    assert on.model.row_invariant, "the comparison needs a row-invariant bundle"
    return on, off


def request(prompt, method="none", max_tokens=24, logprobs=2, **fields) -> Request:
    sampling = {k: fields.pop(k) for k in ("temperature", "seed") if k in fields}
    spec = SpeculationConfig.make(None, method=method, gamma=None if method == "none" else 3)
    return Request(prompt_ids=list(prompt), speculation=spec, logprobs=logprobs,
                   sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling), **fields)


def run(engine, reqs: list[Request]) -> list[dict]:
    """Results with the raw (unrounded) logprobs and prompt logprobs beside them."""
    handles = [engine.submit(r) for r in reqs]
    engine.run_until_done()
    out = []
    for h in handles:
        r = h.result()
        r["raw_logprobs"], r["raw_prompt_logprobs"] = list(h.seq.scoring.logprobs), list(h.seq.scoring.prompt_logprobs)
        out.append(r)
    return out


def chat(engine, method, **fields) -> tuple[dict, dict]:
    """Turn 1, then turn 2 = turn 1's prompt + its reply + a new question."""
    first = run(engine, [request(TURN1, method, **fields)])[0]
    second = run(engine, [request(TURN1 + first["token_ids"] + QUESTION, method, **fields)])[0]
    return first, second


def same(a: dict, b: dict) -> None:
    assert a["token_ids"] == b["token_ids"]
    assert a["raw_logprobs"] == b["raw_logprobs"]
    assert a["raw_prompt_logprobs"] == b["raw_prompt_logprobs"]
    assert a["finish_reason"] == b["finish_reason"]


@pytest.mark.parametrize("method", METHODS)
def test_second_turn_is_identical_with_the_cache_and_reuses_the_first(engines, method):
    on, off = engines
    on1, on2 = chat(on, method)
    off1, off2 = chat(off, method)
    same(on1, off1)
    same(on2, off2)
    assert off2["stats"]["cached_tokens"] == 0
    # turn 2 reuses at least turn 1's prompt (its full blocks) and what the reply completed
    assert on2["stats"]["cached_tokens"] >= len(TURN1) // 16 * 16
    assert on2["stats"]["cached_tokens"] % 16 == 0 and on2["stats"]["cached_tokens"] < on2["stats"]["prompt_tokens"]
    if method == "draft":  # the draft model's own cache reuses its blocks of turn 1 too (drafts only)
        draft = on.speculator.proposers["draft"].cache
        assert draft.counters["hit_tokens"] > 0
        draft.check()
    if method not in ("none", "auto"):  # auto may measure plain decoding faster here and not draft
        drafted = on1["stats"]["drafted"] + on2["stats"]["drafted"]
        accepted = on1["stats"]["accepted"] + on2["stats"]["accepted"]
        assert drafted > 0 and accepted > 0, (method, drafted, accepted)
    for engine in engines:
        engine.cache.check()
        assert engine.cache.free_blocks == engine.cache.num_blocks
    stats = on.stats()["prefix_cache"]
    assert stats["enabled"] and stats["hit_tokens"] > 0 and 0 < stats["hit_rate"] <= 1 and stats["cached_blocks"] > 0
    off_stats = off.stats()["prefix_cache"]
    assert not off_stats["enabled"] and off_stats["hit_tokens"] == 0 and off_stats["cached_blocks"] == 0


@pytest.mark.parametrize("method", ["none", "draft"])
def test_sampled_second_turn_draws_the_same_tokens(engines, method):
    on, off = engines
    on1, on2 = chat(on, method, temperature=0.9, seed=11)
    off1, off2 = chat(off, method, temperature=0.9, seed=11)
    same(on1, off1)
    same(on2, off2)
    assert on2["stats"]["cached_tokens"] > 0


def test_choices_share_blocks_on_top_of_the_reused_prefix(engines):
    """n > 1 of a second turn: choice 0 adopts the cached prefix, choices 1.. take choice 0's
    blocks (shared, not copied), and every choice equals what it gives without the cache."""
    on, off = engines
    prompt = TURN1 + [9, 9, 8] * 10

    def choices(engine):
        run(engine, [request(TURN1, max_tokens=4)])
        first = engine.submit(request(prompt, temperature=0.8, seed=1, max_tokens=12))
        others = [engine.submit(request(prompt, temperature=0.8, seed=1 + i, max_tokens=12, shares_prompt_with=first))
                  for i in (1, 2)]
        engine.run_until_done()
        return [h.result() for h in (first, *others)]

    got, want = choices(on), choices(off)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    assert [r["logprobs"] for r in got] == [r["logprobs"] for r in want]
    assert got[0]["stats"]["cached_tokens"] >= 80
    assert all(r["stats"]["stat_shared_prefill_tokens"] == len(prompt) - 1 for r in got[1:])
    on.cache.check()


def test_prompt_logprobs_come_from_the_requests_own_rows(engines):
    """A request asking for prompt logprobs (echo with logprobs) computes its whole prompt: each
    prompt position's logprob is identical to the uncached engine's, and nothing is reused."""
    on, off = engines
    run(on, [request(TURN1, max_tokens=2)])
    got = run(on, [request(TURN1 + QUESTION, max_tokens=6, prompt_logprobs=3)])[0]
    want = run(off, [request(TURN1 + QUESTION, max_tokens=6, prompt_logprobs=3)])[0]
    same(got, want)
    assert got["stats"]["cached_tokens"] == 0 and len(got["raw_prompt_logprobs"]) == len(TURN1 + QUESTION) - 1


@pytest.mark.parametrize("method", ["none", "draft"])
def test_structured_second_turn_is_identical(engines, method):
    pytest.importorskip("llguidance")
    on, off = engines
    fmt = {"type": "regex", "regex": "[a-z]{3,9}( [a-z]{2,7}){2,4}"}
    for engine in engines:
        run(engine, [request(TURN1, method, max_tokens=4)])
    got = run(on, [request(TURN1 + QUESTION, method, max_tokens=60, response_format=fmt)])[0]
    want = run(off, [request(TURN1 + QUESTION, method, max_tokens=60, response_format=fmt)])[0]
    same(got, want)
    assert got["stats"]["cached_tokens"] > 0 and got["finish_reason"] == "stop"


def test_salted_requests_share_only_with_their_own_salt(engines):
    on, _ = engines
    prompt = [11, 12, 13, 14] * 12 + [1, 2]
    run(on, [request(prompt, max_tokens=2, cache_salt="alice")])
    bob = run(on, [request(prompt, max_tokens=2, cache_salt="bob")])[0]
    nobody = run(on, [request(prompt, max_tokens=2)])[0]
    alice = run(on, [request(prompt, max_tokens=2, cache_salt="alice")])[0]
    assert bob["stats"]["cached_tokens"] == 0 and nobody["stats"]["cached_tokens"] == 0
    assert alice["stats"]["cached_tokens"] == 48
    assert alice["token_ids"] == bob["token_ids"] == nobody["token_ids"]


def test_a_batch_with_one_system_prompt_computes_it_once(bundle, engines):
    """Prompts admitted together that begin alike: the later ones take the blocks the first
    computes (prefill chunks of 64 here), then compute their own ends."""
    _, off = engines
    system = list(range(100, 260))  # 160 tokens: 10 blocks
    prompts = [system + [5 + i, 6, 7] for i in range(3)]
    engine = Engine(bundle, EngineConfig(max_batch_size=4, prefill_chunk=64))
    got = run(engine, [request(p, max_tokens=6) for p in prompts])
    want = run(off, [request(p, max_tokens=6) for p in prompts])
    for a, b in zip(got, want):
        same(a, b)
    assert got[0]["stats"]["cached_tokens"] == 0
    assert all(r["stats"]["cached_tokens"] >= 128 for r in got[1:]), [r["stats"]["cached_tokens"] for r in got]
    engine.cache.check()


def test_soak_of_mixed_requests_leaks_nothing(bundle, engines):
    """1,000 requests: shared and unshared beginnings, four drafters, choices, prompt logprobs,
    aborts at random moments, a KV cache small enough to evict. No block leaks, the pool's
    invariant holds, the hit rate is reported, and the greedy shared-prefix requests give what
    the uncached engine gives."""
    _, off = engines
    rng = random.Random(5)
    engine = Engine(bundle, EngineConfig(max_batch_size=6, kv_cache_tokens=1200, prefill_chunk=96))
    heads = [[rng.randrange(3, 300) for _ in range(rng.randrange(20, 90))] for _ in range(6)]
    methods = ["none", "ngram", "draft", "suffix"]
    submitted, aborted, compare = 0, 0, []
    live: list = []
    while submitted < 1000 or live:
        while submitted < 1000 and len(live) < 10:
            shared = rng.random() < 0.7
            prompt = (rng.choice(heads) if shared else []) + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))]
            kind = rng.random()
            req = request(prompt, rng.choice(methods), max_tokens=rng.randrange(1, 12), logprobs=None,
                          prompt_logprobs=2 if kind < 0.05 else None,
                          **({"temperature": 0.7, "seed": submitted} if kind > 0.8 else {}))
            h = engine.submit(req)
            live.append(h)
            if 0.05 <= kind < 0.1:  # a second choice of the same prompt
                live.append(engine.submit(request(prompt, max_tokens=3, logprobs=None, shares_prompt_with=h)))
                submitted += 1
            elif shared and kind < 0.3 and len(compare) < 40:
                compare.append((h, req))
            submitted += 1
        engine.step()
        if live and rng.random() < 0.04:
            victim = rng.choice(live)
            if victim not in (h for h, _ in compare):
                engine.abort(victim)
                aborted += 1
        live = [h for h in live if not h.seq.finished]
        if submitted % 100 == 0:
            engine.cache.check()
    engine.cache.check()
    assert engine.cache.free_blocks == engine.cache.num_blocks and not engine.cache.seqs
    draft_cache = engine.speculator.proposers["draft"].cache
    assert draft_cache.free_blocks == draft_cache.num_blocks
    stats = engine.stats()["prefix_cache"]
    assert stats["hit_rate"] > 0.2 and stats["evicted_blocks"] > 0, stats
    assert aborted > 10
    results = [h.result() for h, _ in compare]
    assert all("error" not in r for r in results)
    assert sum(r["stats"]["cached_tokens"] > 0 for r in results) > len(results) // 2
    want = off.generate([req for _, req in compare])
    assert [r["token_ids"] for r in results] == [r["token_ids"] for r in want]


@pytest.fixture(scope="module")
def agree_bundle(tmp_path_factory) -> str:
    """float32 int4 with int8 activations, as the quickstart's bundle: every row's attention
    through the C++ rows kernel (Decoder.rows_agree), so replies are reused too."""
    from specbuild.compiler.compile import CompileOptions, compile_bundle
    from tiny import make_tiny_hf

    root = tmp_path_factory.mktemp("prefix_agree")
    target = make_tiny_hf(str(root / "target"), scale=4.0, seed=3)
    return compile_bundle(target, str(root / "bundle"), CompileOptions(dtype="float32", quantize="int4",
                                                                       activations="int8", max_seq_len=512))


@pytest.mark.parametrize("sampled", [False, True])
def test_where_rows_agree_the_reply_is_reused_too(agree_bundle, sampled):
    on = Engine(agree_bundle, EngineConfig(max_batch_size=4))
    if not on.model.rows_agree:
        pytest.skip("specbuild's C++ rows attention kernel is not usable here (cpu_kernels.rows_attention_usable)")
    off = Engine(agree_bundle, EngineConfig(max_batch_size=4, prefix_cache=False))
    fields = {"temperature": 0.9, "seed": 4} if sampled else {}
    on1, on2 = chat(on, "ngram", **fields)
    off1, off2 = chat(off, "ngram", **fields)
    same(on1, off1)
    same(on2, off2)
    # the reply's full blocks too: turn 1's 84 prompt tokens + 24 generated = 108 -> 6 blocks
    assert on2["stats"]["cached_tokens"] == 96
    on.cache.check()


def test_clear_prefix_cache_starts_cold(bundle):
    """What `specbuild bench` calls before each row: the next request computes its prompt."""
    engine = Engine(bundle, EngineConfig(max_batch_size=2))
    run(engine, [request(TURN1, max_tokens=2)])
    assert run(engine, [request(TURN1 + [1], max_tokens=2)])[0]["stats"]["cached_tokens"] == 80
    assert engine.clear_prefix_cache() > 0
    assert run(engine, [request(TURN1 + [1], max_tokens=2)])[0]["stats"]["cached_tokens"] == 0
    engine.cache.check()
    assert engine.cache.free_blocks == engine.cache.num_blocks


def test_a_batch_of_one_keeps_earlier_chats_for_their_next_turn(bundle):
    """The KV pool has room for the bundle's full batch even when the engine runs one sequence at
    a time: eight chats' first turns (more than one request's room) stay cached for their second
    turns, oldest first. A pool sized for one request evicted every chat but the last."""
    engine = Engine(bundle, EngineConfig(max_batch_size=1))
    firsts = [list(range(30 + 7 * i, 90 + 7 * i)) + [5, 6, 7, 8] * 6 for i in range(8)]
    replies = [run(engine, [request(p, max_tokens=24, logprobs=None)])[0]["token_ids"] for p in firsts]
    assert sum(len(p) + 24 for p in firsts) > engine.max_seq_len  # more than one request's room
    for p, reply in zip(firsts, replies):
        second = run(engine, [request(p + reply + QUESTION, max_tokens=4, logprobs=None)])[0]
        assert second["stats"]["cached_tokens"] >= len(p) // 16 * 16
    engine.cache.check()
    assert engine.cache.free_blocks == engine.cache.num_blocks


@pytest.mark.parametrize("method", ["none", "draft"])
def test_tool_call_second_turn_is_identical(engines, method):
    """An agent's next call: the tool-call grammar of tool_choice required (serve/tools.py) on a
    prompt that begins with the previous turn; the same calls with the cache on and off."""
    pytest.importorskip("llguidance")
    from specbuild.sampling.constraint import ResponseFormat
    from specbuild.serve.tools import HermesParser, call_grammar

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["n"],
        "additionalProperties": False}}}]
    fmt = ResponseFormat("grammar", call_grammar(tools, "required", parallel=False),
                         calls=(HermesParser.OPEN, HermesParser.CLOSE))
    on, off = engines
    for engine in engines:
        run(engine, [request(TURN1, method, max_tokens=4)])
    got = run(on, [request(TURN1 + QUESTION, method, max_tokens=120, response_format=fmt)])[0]
    want = run(off, [request(TURN1 + QUESTION, method, max_tokens=120, response_format=fmt)])[0]
    same(got, want)
    assert got["stats"]["cached_tokens"] >= 80 and HermesParser.PATTERN.findall(got["text"])
