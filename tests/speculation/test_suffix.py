"""Suffix decoding (speculation/proposers/suffix.py): the index and its matches, the trees it
drafts, the global store's cap and LRU eviction, greedy equality with plain decoding (tiny
models and SmolLM2) with drafts proposed and accepted, a batch sharing the store, the sampled
distribution (chi-square) and a broken variant the same check rejects."""

from __future__ import annotations

import numpy as np
import pytest
from stats_util import broken_tree_rule

from specbuild.bench.verify_dist import check
from specbuild.compiler.compile import CompileOptions, compile_bundle
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.sampling.params import SamplingParams
from specbuild.speculation import speculator as speculator_mod
from specbuild.speculation.config import SpeculationConfig
from specbuild.speculation.state import SpecState
from specbuild.speculation.proposers.suffix import GlobalStore, SuffixProposer, TokenIndex, build_tree
from tiny import make_tiny_hf, rows_cost_nothing

# a repeated phrase (local matches), a short prompt, a long ramp
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21], list(range(30, 70))]


def tiny_bundle(tmp_path_factory, name: str) -> str:
    """The tiny float64 bundle these tests and the hybrid tests run on."""
    root = tmp_path_factory.mktemp(name)
    target = make_tiny_hf(str(root / "target"), scale=4.0, seed=3)
    return compile_bundle(target, str(root / "bundle"), CompileOptions(dtype="float64", max_draft_len=10))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return tiny_bundle(tmp_path_factory, "suffix")


def run(engine, method, prompts=PROMPTS, max_tokens=40, gamma=None, **sampling):
    spec = SpeculationConfig.make(None, method=method, gamma=gamma)
    reqs = [Request(prompt_ids=p, speculation=spec,
                    sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)) for p in prompts]
    return engine.generate(reqs)


class FakeSeq:
    _ids = iter(range(10_000, 1 << 30))

    def __init__(self, prompt, output=(), content_type=None, finish_reason="stop"):
        self.seq_id = next(self._ids)
        self.prompt_ids, self.output_ids = list(prompt), list(output)
        self.content_type, self.finish_reason = content_type, finish_reason
        self.spec = SpeculationConfig.make(None, method="suffix")
        self.spec_state = SpecState(uses=frozenset({"suffix"}))  # (the speculator sets it for a real sequence)


# ---- the index ------------------------------------------------------------------------------
def test_match_finds_the_longest_earlier_suffix_and_its_occurrences():
    ix = TokenIndex()
    text = [1, 2, 3, 4, 5, 9, 2, 3, 4, 5, 7, 3, 4, 5, 8, 2, 3, 4, 5]
    ix.extend(text)
    ctx = ix.buf[:ix.n]
    m, ends = ix.match(ctx)
    # "2 3 4 5" occurred twice before the end (followed by 9 and by 7); the end itself never counts
    assert m == 4 and ends.tolist() == [5, 10]
    assert ix.continuations(ends, 2).tolist() == [[9, 2], [7, 3]]
    # a short match (< 4 tokens) through the unigram index
    m, ends = ix.match(np.array([42, 4, 5], dtype=np.int64))
    assert m == 2 and ends.tolist() == [5, 10, 14, 19][:3]
    assert ix.match(np.array([99], dtype=np.int64))[0] == 0


def test_documents_do_not_run_into_each_other():
    ix = TokenIndex()
    ix.extend([1, 2, 3])
    ix.end_document()
    ix.extend([7, 1, 2, 3])
    ix.end_document()
    # "1 2 3" ends both documents: no continuation, no match
    assert ix.match(np.array([1, 2, 3], dtype=np.int64))[0] == 0
    m, ends = ix.match(np.array([5, 7], dtype=np.int64))
    assert m == 1 and ix.continuations(ends, 5).tolist() == [[1, 2, 3, -1, -1]]


def reference_match(arena: list[int], n: int, ctx: list[int]) -> tuple[int, list[int]]:
    """The match by its definition, by brute force: the longest suffix of ctx (at most
    MATCH_WINDOW tokens) that ends at an arena position e < n with a token after it (not a
    separator or evicted slot), and the most recent MAX_HITS such positions."""
    from specbuild.speculation.proposers import suffix as S

    best, ends = 0, []
    for e in range(1, n):
        if arena[e] < 0:
            continue
        k = 0
        while k < min(S.MATCH_WINDOW, len(ctx)) and k < e and arena[e - 1 - k] == ctx[-1 - k]:
            k += 1
        if k > best:
            best, ends = k, [e]
        elif k == best and k:
            ends.append(e)
    return best, ends[-S.MAX_HITS:]


@pytest.mark.parametrize("in_python", [True, False])
def test_match_in_python_and_in_numpy_agree_with_the_definition(monkeypatch, in_python):
    """A match over a few hits runs in Python, over many in numpy (SCAN_IN_PYTHON): both give
    what the definition gives, on random texts over a small vocabulary (long and short
    matches, many hits), several documents and an evicted one."""
    from specbuild.speculation.proposers import suffix as S

    monkeypatch.setattr(S, "SCAN_IN_PYTHON", 10 ** 9 if in_python else 0)
    rng = np.random.default_rng(7)
    checked = long = 0
    for trial in range(40):
        ix = TokenIndex()
        vocab = int(rng.integers(2, 12))
        docs = []
        for _ in range(int(rng.integers(1, 4))):
            doc = rng.integers(0, vocab, int(rng.integers(1, 120))).tolist()
            if docs and rng.random() < 0.5:  # a copy of an earlier passage: long matches
                src = docs[-1][1]
                doc += src[: int(rng.integers(1, len(src) + 1))]
            start = ix.n
            ix.extend(doc)
            ix.end_document()
            docs.append((start, doc))
        if len(docs) > 1 and rng.random() < 0.5:
            start, doc = docs[0]
            ix.kill(start, start + len(doc))
        assert ix.toks == ix.buf[:ix.n].tolist()
        for _ in range(10):
            ctx = rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
            if rng.random() < 0.5:  # a context that ends like some stored text
                start, doc = docs[int(rng.integers(len(docs)))]
                cut = int(rng.integers(1, len(doc) + 1))
                ctx = ctx + doc[:cut]
            m, ends = ix.match(np.array(ctx, dtype=np.int64))
            want = reference_match(ix.toks, ix.n, ctx)
            assert (m, ends.tolist()) == want, (trial, ctx)
            checked += 1
            long += m >= 8
    assert checked == 400 and long > 20  # the long-match path was exercised


def test_the_local_text_is_no_occurrence_of_itself():
    """A request's own text: its end is never a match, its earlier occurrences are."""
    ix = TokenIndex()
    ix.extend([3, 1, 2, 3, 1, 2])
    assert ix.match_tail(ix.tail(), ix.n) == (3, [3])  # "3 1 2" ended at 3 (followed by 3); not at 6
    assert ix.rows([3], 4) == [(3, 1, 2, -1)]


def test_tree_is_best_first_by_share_within_budget_and_min_prob():
    rows = np.array([[1, 2, 3], [1, 2, 4], [1, 2, 3], [5, 6, -1], [1, 7, -1]])
    tokens, parents, depths, sources, _ = build_tree([(rows, "local")], budget=5, min_prob=0.1)
    # 1 (4/5), 2 (3/5), 3 (2/5), then 5, 4, 7 (1/5 each); the budget cuts after five nodes
    assert tokens[:3] == [1, 2, 3] and parents[:4] == [-1, 0, 1, 2] and depths[:3] == [1, 2, 3]
    assert len(tokens) == 5 and set(tokens[3:]) <= {4, 5, 7} and sources == ["local"] * 5
    for i, p in enumerate(parents[1:], start=1):
        assert p < i  # parents before children
    tokens, _, _, _, _ = build_tree([(rows, "local")], budget=10, min_prob=0.3)
    assert tokens == [1, 2, 3]
    # two parts: shares over all rows; where both propose a node it is "both"
    tokens, parents, _, sources, _ = build_tree([(rows[:2], "local"), (np.array([[1, 9, 9], [8, -1, -1]]), "global")],
                                             budget=4, min_prob=0.2)
    assert tokens == [1, 2, 3, 4] and sources == ["both", "local", "local", "local"]


def test_the_budget_grows_with_the_match_length():
    assert SuffixProposer().factor == 2.0  # the default: twice the match (measured best on --workload repeated)
    prop = SuffixProposer(max_nodes=8, factor=1.0)  # Arctic's rule: at most one node per matched token
    short = prop.draft_for(FakeSeq([9, 1, 2, 3, 4, 5, 6, 7, 8, 1]), 8)  # match "1": one node
    long = prop.draft_for(FakeSeq([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5]), 8)  # match of 5
    assert short.tokens == [2] and short.parents == (-1, 0)
    assert long.tokens == [6, 7, 8, 9, 1] and long.depths == [1, 2, 3, 4, 5]
    assert prop.draft_for(FakeSeq([1, 2, 3]), 8) is None  # nothing seen before


# ---- the global store -----------------------------------------------------------------------
def test_released_requests_feed_other_requests_and_scopes_keep_apart():
    prop = SuffixProposer(max_nodes=8, scope="content_type")
    done = FakeSeq([100, 101], [40, 41, 42, 43, 44, 45, 46], content_type="code")
    prop.draft_for(done, 4)
    prop.release(done)
    assert done.seq_id not in prop.local
    asks = FakeSeq([7, 40, 41, 42], content_type="code")
    d = prop.draft_for(asks, 8)
    assert d.tokens == [43, 44, 45, 46] and prop.from_global == 1  # the stored rest (budget 2 x 3)
    assert prop.draft_for(FakeSeq([7, 40, 41, 42], content_type="chat"), 8) is None
    aborted = FakeSeq([1], [60, 61, 62], content_type="code", finish_reason="abort")
    prop.release(aborted)
    assert prop.store.stats()["requests"] == 1  # nothing kept of an aborted request
    # prompts join only when asked
    with_prompts = SuffixProposer(include_prompts=True)
    with_prompts.release(FakeSeq([70, 71, 72], [73]))
    assert with_prompts.draft_for(FakeSeq([70, 71]), 4).tokens == [72, 73]


def test_a_prompt_asked_again_drafts_its_answer_from_the_first_token():
    """The store keeps a request's answer under its prompt's last 32 tokens: a prompt ending so
    again is drafted that answer before it has any output (an index match needs output first),
    as long as its output follows it; once they part, only the index's matches draft."""
    prop = SuffixProposer(max_nodes=8)
    history, question = list(range(500, 540)), list(range(100, 140))  # 40-token question
    answer = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    prop.release(FakeSeq(history + question, answer))
    again = FakeSeq(list(range(600, 610)) + question)  # other history, the same last 32 tokens
    d = prop.draft_for(again, 8)
    assert d is not None and d.tokens == answer[:8] and prop.from_global == 1
    assert prop.last_match == 32
    again.output_ids = answer[:5]
    assert prop.draft_for(again, 8).tokens == answer[5:12]
    again.output_ids = answer[:5] + [99]  # the answers part: the anchor is dropped for good
    assert prop.draft_for(again, 8) is None
    again.output_ids = answer[:5] + [99] + [8, 9]  # an index match (the stored 8, 9) drafts again, short
    assert prop.draft_for(again, 8).tokens[:1] == [10] and prop.last_match == 2
    # a prompt whose last 32 tokens differ finds no answer before it has output
    assert prop.draft_for(FakeSeq(history + question[:-1] + [1]), 8) is None
    # off: no answer is kept
    off = SuffixProposer(max_nodes=8, answers=False)
    off.release(FakeSeq(history + question, answer))
    assert off.draft_for(FakeSeq(question), 8) is None
    # a short prompt is its own key; an empty answer keeps nothing under it
    prop.release(FakeSeq([3, 4], []))
    assert prop.draft_for(FakeSeq([3, 4]), 8) is None
    prop.release(FakeSeq([3, 4], [70, 71, 72]))
    assert prop.draft_for(FakeSeq([3, 4]), 8).tokens == [70, 71, 72]


def test_salted_requests_draft_only_from_their_own_salt():
    """A request's cache_salt gives it a store of its own: its answer is drafted for a repeat of
    its prompt with the same salt only, never for another salt or none (nor theirs for it)."""
    import types

    def salted(prompt, output=(), salt=None):
        seq = FakeSeq(prompt, output)
        seq.request = types.SimpleNamespace(cache_salt=salt)
        return seq

    prop = SuffixProposer(max_nodes=8)
    prompt, answer = list(range(100, 140)), [7, 8, 9, 10, 11, 12]
    prop.release(salted(prompt, answer, salt="tenant-a"))
    assert prop.draft_for(salted(prompt, salt="tenant-b"), 8) is None
    assert prop.draft_for(salted(prompt), 8) is None
    assert prop.draft_for(salted(prompt, salt="tenant-a"), 8).tokens == answer
    # nor does an index match reach across: the unsalted store never saw tenant-a's answer
    assert prop.draft_for(salted([1, 7, 8, 9]), 8) is None
    assert prop.draft_for(salted([1, 7, 8, 9], salt="tenant-a"), 8).tokens == [10, 11, 12]


def test_answers_follow_eviction_and_compaction():
    """An evicted request's answer is gone with it; compaction moves the arena, and the answer
    found afterwards is still the request's own."""
    prop = SuffixProposer(max_nodes=8, max_tokens=60)
    prop.release(FakeSeq([1, 2, 3], [40, 41, 42, 43]))
    assert prop.store.answers
    for i in range(80):  # churn: every earlier request is evicted, the arena rebuilt
        prop.release(FakeSeq([900 + i, 5], [1000 + 3 * i + j for j in range(30)]))
    assert prop.store.compactions > 0 and prop.store.evictions > 0
    assert prop.draft_for(FakeSeq([1, 2, 3]), 8) is None
    assert len(prop.store.answers) == len(prop.store.docs)  # one per live request, none stale
    prop.release(FakeSeq([1, 2, 3], [40, 41, 42, 43]))
    for i in range(3):  # one eviction each, no compaction in between needed for the check
        prop.release(FakeSeq([700 + i, 6], [2000 + 3 * i + j for j in range(10)]))
    assert prop.draft_for(FakeSeq([1, 2, 3]), 8).tokens == [40, 41, 42, 43]
    copy = prop.store.copy()
    assert copy.answers == prop.store.answers


def test_the_cap_holds_and_eviction_is_lru_by_whole_request():
    store = GlobalStore(max_tokens=100)
    a = store.add(list(range(1000, 1040)))
    b = store.add(list(range(2000, 2040)))
    ix = store.indexes[""]
    m, ends = ix.match(np.array([1010, 1011, 1012, 1013], dtype=np.int64))
    assert m == 4
    store.touch("", ends)  # a used: b is now the least recently used
    c = store.add(list(range(3000, 3040)))
    assert list(store.docs) == [a, c] and b not in store.docs and store.live_tokens == 80 and store.evictions == 1
    assert ix.match(np.array([2010, 2011, 2012, 2013], dtype=np.int64))[0] == 0  # b's text is gone
    assert ix.match(np.array([1010, 1011, 1012, 1013], dtype=np.int64))[0] == 4
    assert store.add(list(range(101))) is None  # larger than the whole cap: not kept
    for i in range(200):  # churn: live tokens stay capped and the arena is rebuilt
        store.add([5000 + i] * 30 + list(range(i, i + 10)))
        s = store.stats()
        assert s["tokens"] <= 100 and s["arena_slots"] <= 2 * 100 + 1024 + 64
    assert s["compactions"] >= 1 and s["requests"] == 2
    last = [5000 + 199] * 30 + list(range(199, 209))
    m, ends = store.indexes[""].match(np.array(last[25:35], dtype=np.int64))
    assert m == 10 and store.indexes[""].continuations(ends, 3).tolist() == [last[35:38]]


def test_bad_settings_are_refused_with_the_value():
    with pytest.raises(ValueError, match="scope='tenant'"):
        SuffixProposer(scope="tenant")
    with pytest.raises(ValueError, match="max_tokens=-1"):
        GlobalStore(-1)


# ---- in the engine --------------------------------------------------------------------------
def test_greedy_suffix_equals_plain_and_accepts(bundle):
    engine = Engine(bundle, EngineConfig(max_batch_size=4))
    rows_cost_nothing(engine)  # the drafts and their verification, whatever this machine's step times
    assert "suffix" in engine.methods
    plain = run(engine, "none")
    spec = run(engine, "suffix")
    for r, p in zip(spec, plain):
        assert r["token_ids"] == p["token_ids"]
    drafted = sum(r["stats"]["drafted"] for r in spec)
    accepted = sum(r["stats"]["accepted"] for r in spec)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    assert engine.cache.free_blocks == engine.cache.num_blocks
    prop = engine.speculator.proposers["suffix"]
    # the suffix requests' outputs are stored, the plain ones' are not
    assert prop.local == {} and prop.store.stats()["requests"] == len(PROMPTS)
    snap = prop.snapshot()
    prop.restore(None)
    assert prop.store.stats()["requests"] == 0
    prop.restore(snap)
    assert prop.store.stats()["tokens"] == sum(len(r["token_ids"]) for r in spec)


def test_auto_drafts_a_repeated_prompt_with_its_stored_answer(bundle, monkeypatch):
    """Under `auto`, a request that settled on plain decoding still leaves its answer in the
    store (SpecState.keeps), and the same prompt asked again drafts it with suffix from its first
    decode step, whatever its acceptance estimates say (holds_continuation); output unchanged."""
    engine = Engine(bundle, EngineConfig(max_batch_size=1))
    rows_cost_nothing(engine)
    spec = engine.speculator
    prop = spec.proposers["suffix"]
    prompt = PROMPTS[2]
    plain = run(engine, "none", prompts=[prompt])[0]
    own = type(spec).choose_method

    def gives_up(self, seq):  # auto finds every drafter below plain decoding at once
        seq.spec_state.auto_plain = True
        return None

    monkeypatch.setattr(type(spec), "choose_method", gives_up)
    first = run(engine, "auto", prompts=[prompt])[0]
    assert first["token_ids"] == plain["token_ids"] and first["stats"]["drafted"] == 0
    from specbuild.speculation.proposers.suffix import prompt_key
    assert prop.store.answer("", prompt_key(prompt)) is not None  # kept though it never drafted
    chosen = []

    def records(self, seq):
        m = own(self, seq)
        chosen.append((len(seq.output_ids), m))
        return m

    monkeypatch.setattr(type(spec), "choose_method", records)
    # weighing alone would not choose suffix here: its estimate is as low as it goes
    monkeypatch.setattr(spec.controller, "alpha", lambda seq, name: 0.0)
    again = run(engine, "auto", prompts=[prompt])[0]
    assert again["token_ids"] == plain["token_ids"]
    assert chosen and chosen[0] == (1, "suffix"), chosen
    assert again["stats"]["drafted"] > 0 and again["stats"]["accepted"] == again["stats"]["drafted"]


def test_a_batch_shares_the_store_and_repeats_accept_more(bundle):
    """Concurrent sequences: the same prompts again, in one batch, find the first round's
    outputs in the global store; greedy output is unchanged and more is accepted."""
    engine = Engine(bundle, EngineConfig(max_batch_size=8))
    plain = run(engine, "none", prompts=PROMPTS * 2)
    first = run(engine, "suffix", prompts=PROMPTS * 2)
    prop = engine.speculator.proposers["suffix"]
    firsts: dict = {}  # seq_id -> (prompt length, output length, match) of its first draft
    own = prop.draft_for

    def draft_for(seq, gamma):
        d = own(seq, gamma)
        firsts.setdefault(seq.seq_id, (len(seq.prompt_ids), len(seq.output_ids), prop.last_match))
        return d

    prop.draft_for = draft_for
    second = run(engine, "suffix", prompts=PROMPTS * 2)
    del prop.draft_for
    for a, b, p in zip(first, second, plain):
        assert a["token_ids"] == p["token_ids"] and b["token_ids"] == p["token_ids"]
    assert prop.from_global > 0
    acc1 = sum(r["stats"]["accepted"] for r in first)
    acc2 = sum(r["stats"]["accepted"] for r in second)
    assert acc2 > acc1, (acc1, acc2)
    passes2 = sum(r["stats"]["target_passes"] for r in second)
    passes1 = sum(r["stats"]["target_passes"] for r in first)
    assert passes2 < passes1
    # each prompt asked again found its answer at its first draft: the match counts the prompt's
    # last tokens (at most 32) and the output so far
    assert len(firsts) == len(second)
    assert all(m == min(32, min(32, p) + n) for p, n, m in firsts.values()), firsts


def test_auto_may_pick_suffix_losslessly(bundle):
    """auto weighs suffix beside the other drafters (fixed verify costs of a pass that barely
    grows with width, so the choice does not depend on this machine's timings)."""
    from specbuild.speculation.gamma import CostModel, GammaController

    engine = Engine(bundle, EngineConfig(max_batch_size=4))
    engine.speculator._controller = GammaController(
        {name: CostModel({1: 1.0, 2: 1.02, 5: 1.05, 11: 1.1}) for name in engine.speculator.proposers})
    plain = run(engine, "none")
    auto = run(engine, "auto")
    assert [r["token_ids"] for r in auto] == [r["token_ids"] for r in plain]
    assert engine.speculator.proposers["suffix"].drafts > 0  # auto's choice includes suffix


def _warm(engine):
    """Fill the store the way serving does: earlier requests on the check prompt."""
    run(engine, "suffix", prompts=[PROMPTS[0]] * 2, max_tokens=30)


def test_sampled_suffix_matches_exact_distribution(bundle):
    engine = Engine(bundle, EngineConfig(max_batch_size=8))
    _warm(engine)
    spec = SpeculationConfig.make(None, method="suffix", gamma=3)
    r = check(engine, PROMPTS[0], 1.0, 3, spec, 600)
    assert r.drafted > 0 and r.accepted > 0 and r.accepted < r.drafted, r
    assert r.p_value > 0.001, r


def test_the_check_rejects_a_broken_tree_rule(bundle, monkeypatch):
    """Recovery from the target instead of the residual must fail the same check."""
    monkeypatch.setattr(speculator_mod, "verify_tree_sampled", broken_tree_rule)
    engine = Engine(bundle, EngineConfig(max_batch_size=8))
    _warm(engine)
    r = check(engine, PROMPTS[0], 1.0, 3, SpeculationConfig.make(None, method="suffix", gamma=3), 600)
    assert r.drafted > 0 and r.accepted < r.drafted
    assert r.p_value < 1e-4, r


def test_smollm2_greedy_suffix_equals_plain(smollm2_bundle):
    engine = Engine(smollm2_bundle, EngineConfig(max_batch_size=2))
    doc = ("The lighthouse keeper wrote in the log every night: wind from the north, sea calm, "
           "lamp lit at dusk. The lighthouse keeper wrote in the log every night: ")
    prompts = [engine.encode(doc), engine.encode("Repeat exactly: one two three four five six. "
                                                 "Repeat exactly: one two three four five six.")]
    plain = run(engine, "none", prompts=prompts, max_tokens=32)
    spec = run(engine, "suffix", prompts=prompts, max_tokens=32)
    again = run(engine, "suffix", prompts=prompts, max_tokens=32)
    for a, b, p in zip(spec, again, plain):
        assert a["token_ids"] == p["token_ids"] and b["token_ids"] == p["token_ids"]
    assert sum(r["stats"]["accepted"] for r in spec + again) > 0
    assert sum(r["stats"]["accepted"] for r in again) >= sum(r["stats"]["accepted"] for r in spec)


def test_cli_generate_serves_suffix_and_hybrid_by_name(bundle):
    import json

    from click.testing import CliRunner

    from specbuild.cli.main import main

    prompt = "one two three one two three one two three"
    outs = {}
    for method in ("none", "suffix", "hybrid"):
        r = CliRunner().invoke(main, ["generate", bundle, "--prompt", prompt, "--max-tokens", "24", "--ignore-eos",
                                      "--speculation", method, "--threads", "1", "--json"])
        assert r.exit_code == 0, r.output
        outs[method] = json.loads(r.output.strip().splitlines()[-1])
    for method in ("suffix", "hybrid"):
        assert outs[method]["token_ids"] == outs["none"]["token_ids"], method
        assert outs[method]["stats"]["drafted"] > 0 and outs[method]["stats"]["accepted"] > 0, method


def test_telemetry_shows_acceptance_by_drafter_source_and_position(bundle, tmp_path):
    from click.testing import CliRunner

    from specbuild.cli.main import main
    from specbuild.telemetry import attach
    from specbuild.telemetry.report import report
    from specbuild.telemetry.store import Store

    engine = Engine(bundle, EngineConfig(max_batch_size=4))
    db = str(tmp_path / "tel.db")
    sink = attach(engine, db, source="bench")
    run(engine, "suffix")
    run(engine, "suffix")  # the second round also drafts from the first round's outputs
    run(engine, "recycle")
    sink.close()
    engine.set_sink(None)
    rep = report(Store(db))
    src = rep["by_source"]
    assert {"suffix:local", "recycle:table"} <= set(src) and ({"suffix:global", "suffix:both"} & set(src)), src
    for name, positions in src.items():
        assert positions[0]["offered"] > 0 and all(p["accepted"] <= p["offered"] for p in positions), name
    assert sum(p["accepted"] for name in src if name.startswith("suffix") for p in src[name]) > 0
    # per position, the sources of one method add up to the offered candidates of its steps
    rows = Store(db).query("SELECT SUM(n_drafted) FROM speculation_steps WHERE method = 'suffix'")
    assert sum(p["offered"] for name in src if name.startswith("suffix:") for p in src[name]) == rows[0][0]
    out = CliRunner().invoke(main, ["telemetry", "report", db])
    assert out.exit_code == 0, out.output
    assert "acceptance by drafter source and position" in out.output and "suffix:local" in out.output


def test_engine_config_sets_the_store_and_its_cap_evicts(bundle):
    engine = Engine(bundle, EngineConfig(max_batch_size=1, suffix_store_tokens=50, suffix_scope="content_type"))
    prop = engine.speculator.proposers["suffix"]
    assert prop.store.max_tokens == 50 and prop.scope == "content_type"
    for _ in range(3):  # 40 tokens each: every request after the first evicts the one before
        run(engine, "suffix", prompts=[PROMPTS[2]])
        assert prop.store.stats()["tokens"] <= 50
    assert prop.store.stats()["evictions"] == 2 and prop.store.stats()["requests"] == 1
    assert engine.stats()["suffix_store_tokens"] == 40 and engine.stats()["suffix_store_evictions"] == 2
    with pytest.raises(ValueError, match="suffix_scope='tenant'"):
        EngineConfig(suffix_scope="tenant")
    with pytest.raises(ValueError, match="suffix_store_tokens=-5"):
        EngineConfig(suffix_store_tokens=-5)


def test_a_bundle_drafts_as_deep_as_it_was_compiled_for(bundle, tmp_path):
    """A bundle compiled with --max-draft-len 10 that names no gamma_max bounds requests that do
    not name one by its 10, not the config's 8: a prompt asked again drafts its stored answer 10
    deep. A bundle whose default names a gamma_max keeps it."""
    import json
    import shutil

    engine = Engine(bundle, EngineConfig(max_batch_size=1))
    assert engine.meta.limits.max_draft_len == 10 and engine.default_speculation.gamma_max == 10
    rows_cost_nothing(engine)
    prop = engine.speculator.proposers["suffix"]
    depths = []
    own = prop.draft_for

    def draft_for(seq, gamma):
        d = own(seq, gamma)
        if d is not None:
            depths.append(max(d.depths))
        return d

    prompt = PROMPTS[2]

    def ask():
        req = Request(prompt_ids=prompt, speculation={"method": "suffix"},
                      sampling=SamplingParams(max_tokens=40, ignore_eos=True))
        return engine.generate([req])[0]

    plain = run(engine, "none", prompts=[prompt])[0]
    ask()
    prop.draft_for = draft_for
    again = ask()
    del prop.draft_for
    assert again["token_ids"] == plain["token_ids"]
    assert depths and max(depths) == 10, depths
    assert again["stats"]["accepted"] >= 10
    from specbuild.bench.specbench import SpecbuildRunner

    assert SpecbuildRunner(engine, "suffix", 8).speculation.gamma_max == 10  # bench rows as served ones

    named = tmp_path / "named"
    shutil.copytree(bundle, named)
    meta = json.loads((named / "bundle.json").read_text())
    meta["default_speculation"] = {"method": "none", "gamma_max": 6}
    (named / "bundle.json").write_text(json.dumps(meta))
    assert Engine(str(named), EngineConfig(max_batch_size=1)).default_speculation.gamma_max == 6
