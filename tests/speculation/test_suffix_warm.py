"""The suffix store's warm corpus (EngineConfig.suffix_corpus, `--suffix-corpus`): earlier
outputs of the target pre-fill the global store at load, so a first request that repeats one
drafts from it; greedy output still equals plain decoding; the store's cap holds (rows past it
are skipped, never a cut row), warm documents are evicted like any request, benchmarks'
cold starts come back to the warm state, and the corpus is read only from the server's own
configuration: a size limit, clear errors naming the value and the limit, and no request
field that names a path."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from specbuild.engine.engine import Engine, EngineConfig
from specbuild.speculation.proposers.suffix import CORPUS_MAX_BYTES, SuffixProposer, read_corpus

from test_suffix import FakeSeq, PROMPTS, run, tiny_bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return tiny_bundle(tmp_path_factory, "suffix_warm")


@pytest.fixture(scope="module")
def plain_outputs(bundle) -> list[list[int]]:
    """The target's own greedy outputs for PROMPTS (what a warm corpus holds)."""
    engine = Engine(bundle, EngineConfig(max_batch_size=4))
    return [r["token_ids"] for r in run(engine, "none")]


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_a_warm_store_drafts_a_first_request_losslessly(bundle, plain_outputs, tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"token_ids": ids} for ids in plain_outputs])
    cold = Engine(bundle, EngineConfig(max_batch_size=4))
    warm = Engine(bundle, EngineConfig(max_batch_size=4, suffix_corpus=corpus))
    prop = warm.speculator.proposers["suffix"]
    for e in (cold, warm):  # the same (flat) verify costs for both: the width cut is not what this compares
        _ = e.speculator.controller
        e.speculator.proposers["suffix"].verify_cost = lambda width: 1.0
    n = sum(len(ids) for ids in plain_outputs)
    assert prop.store.stats()["requests"] == len(PROMPTS) and prop.store.stats()["tokens"] == n
    assert warm.stats()["suffix_store_warm_tokens"] == n and warm.stats()["suffix_store_tokens"] == n
    assert cold.stats()["suffix_store_warm_tokens"] == 0
    out_cold, out_warm = run(cold, "suffix"), run(warm, "suffix")
    for c, w, p in zip(out_cold, out_warm, plain_outputs):
        assert c["token_ids"] == p and w["token_ids"] == p
    acc_cold = sum(r["stats"]["accepted"] for r in out_cold)
    acc_warm = sum(r["stats"]["accepted"] for r in out_warm)
    assert prop.from_global > 0 and acc_warm > acc_cold, (acc_cold, acc_warm)
    passes = lambda rs: sum(r["stats"]["target_passes"] for r in rs)  # noqa: E731
    assert passes(out_warm) < passes(out_cold)
    # hybrid shares the store: warm there too
    out_h = run(warm, "hybrid")
    assert [r["token_ids"] for r in out_h] == plain_outputs and sum(r["stats"]["accepted"] for r in out_h) > 0


def test_text_rows_are_tokenized_and_scoped(bundle, tmp_path):
    engine = Engine(bundle, EngineConfig(max_batch_size=1))
    text = "one two three four five six seven eight"
    ids = engine.encode(text, add_special_tokens=False)
    corpus = write_jsonl(tmp_path / "t.jsonl", [{"text": text, "content_type": "code"}, {"text": "nine ten"}])
    scoped = Engine(bundle, EngineConfig(max_batch_size=1, suffix_corpus=corpus, suffix_scope="content_type"))
    prop = scoped.speculator.proposers["suffix"]
    assert set(prop.store.indexes) == {"code", ""}
    d = prop.draft_for(FakeSeq([9] + ids[:3], content_type="code"), 8)
    assert d is not None and d.tokens[0] == ids[3] and prop.from_global == 1
    assert prop.draft_for(FakeSeq([9] + ids[:3], content_type="chat"), 8) is None


def test_the_cap_holds_with_a_warm_store_and_warm_documents_are_evicted():
    rows = [{"token_ids": list(range(1000 * k, 1000 * k + 20))} for k in range(1, 4)]  # 3 x 20 tokens
    prop = SuffixProposer(max_nodes=8, max_tokens=50)
    counts = prop.warm(rows + [{"token_ids": list(range(60))}], vocab_size=5000)
    # two rows fit the cap of 50; the third and the 60-token row are skipped, none is cut
    assert counts == {"warm_requests": 2, "warm_tokens": 40, "warm_skipped": 2}
    assert prop.stats()["tokens"] == 40 and prop.stats()["warm_tokens"] == 40
    first, second = list(prop.store.docs)
    # the second warm document is used by a draft: the first is now the least recently used
    assert prop.draft_for(FakeSeq([7, 2010, 2011]), 4).tokens[0] == 2012
    done = FakeSeq([1], list(range(4000, 4030)))  # a served request of 30 tokens joins the store
    prop.release(done)
    st = prop.store.stats()
    assert st["tokens"] <= 50 and st["evictions"] == 1 and first not in prop.store.docs and second in prop.store.docs
    assert prop.draft_for(FakeSeq([7, 1010, 1011]), 4) is None  # the evicted warm text is gone
    # a benchmark's cold start (restore(None)) comes back to the warm state, not to empty
    prop.restore(None)
    assert prop.store.stats()["tokens"] == 40 and prop.store.stats()["evictions"] == 0
    assert prop.draft_for(FakeSeq([7, 1010, 1011]), 4).tokens[0] == 1012


def test_engine_cap_counts_the_warm_corpus(bundle, plain_outputs, tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"token_ids": ids} for ids in plain_outputs])
    engine = Engine(bundle, EngineConfig(max_batch_size=1, suffix_corpus=corpus, suffix_store_tokens=60))
    prop = engine.speculator.proposers["suffix"]
    assert prop.store.stats()["tokens"] == 40 and prop.warm_state[1]["warm_skipped"] == 2  # 40 of 3 x 40 fit
    run(engine, "suffix", prompts=[PROMPTS[1]])  # 40 more: the warm document is evicted for it
    assert prop.store.stats()["tokens"] <= 60 and engine.stats()["suffix_store_evictions"] == 1


def test_bad_corpora_are_refused_with_the_value_and_the_limit(bundle, tmp_path):
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(CORPUS_MAX_BYTES + 1)  # sparse: nothing written
    with pytest.raises(ValueError, match=rf"is {CORPUS_MAX_BYTES + 1} bytes, over the limit of {CORPUS_MAX_BYTES}"):
        read_corpus(str(big))
    with pytest.raises(ValueError, match="not a file"):
        read_corpus(str(tmp_path / "missing.jsonl"))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"token_ids": [1, 2]}, {"text": 5}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object"):
        read_corpus(bad)
    both = write_jsonl(tmp_path / "both.jsonl", [{"text": "a", "token_ids": [1]}])
    with pytest.raises(ValueError, match=r"both.jsonl:1"):
        read_corpus(both)
    vocab = write_jsonl(tmp_path / "vocab.jsonl", [{"token_ids": [1, 99999]}])
    with pytest.raises(ValueError, match=r"token id 99999 is outside the target's vocabulary \[0, 320\)"):
        Engine(bundle, EngineConfig(suffix_corpus=vocab))
    with pytest.raises(ValueError, match="suffix_corpus=''"):
        EngineConfig(suffix_corpus="")
    # the CLI says it in one line and exits 2
    from specbuild.cli.main import main

    r = CliRunner().invoke(main, ["generate", bundle, "--prompt", "hi", "--max-tokens", "2", "--suffix-corpus",
                                  str(big)])
    assert r.exit_code == 2 and "over the limit of" in r.output, r.output


def test_the_corpus_is_server_configuration_never_a_request_field(bundle, plain_outputs, tmp_path):
    """Over a real HTTP server started with --suffix-corpus: /metrics counts the warm tokens; a
    request naming a corpus path (inside `speculation` or at the top level) reads nothing."""
    from http_client import ServerProcess, metric, post, wait_until

    corpus = write_jsonl(tmp_path / "c.jsonl", [{"token_ids": ids} for ids in plain_outputs])
    secret = write_jsonl(tmp_path / "other.jsonl", [{"token_ids": list(range(5, 300))}])
    n = sum(len(ids) for ids in plain_outputs)
    srv = ServerProcess(bundle, str(tmp_path / "serve.log"), "--max-batch-size", "2", "--suffix-corpus", corpus,
                        "--suffix-store-tokens", "1000")
    try:
        assert metric(srv.port, "specbuild_suffix_store_warm_tokens") == n
        assert metric(srv.port, "specbuild_suffix_store_tokens") == n
        body = {"prompt": PROMPTS[0], "max_tokens": 8, "ignore_eos": True,
                "speculation": {"method": "suffix", "suffix_corpus": secret}}
        status, _, full = post(srv.port, "/v1/completions", body)
        assert status == 400 and "suffix_corpus" in json.dumps(full), full
        status, headers, full = post(srv.port, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8,
                                                                   "ignore_eos": True, "speculation": "suffix",
                                                                   "suffix_corpus": secret})
        assert status == 200, full
        assert metric(srv.port, "specbuild_suffix_store_warm_tokens") == n  # nothing more was read
        # only the request's own output joins (released as it finishes: a bounded wait for that)
        wait_until(lambda: metric(srv.port, "specbuild_suffix_store_tokens") == n + 8, 30, "the output stored")
        assert metric(srv.port, "specbuild_suffix_store_warm_tokens") == n
    finally:
        srv.stop()
    assert os.path.getsize(secret) > 0


def test_build_suffix_corpus_keeps_train_answers_and_refuses_eval_ones(tmp_path):
    """scripts/build_suffix_corpus.py: answers to Spec-Bench train questions become corpus rows;
    an answer to an eval question stops it (the eval split measures the store)."""
    import subprocess
    import sys

    from specbuild.bench.specbench import load_split

    split = load_split()
    train, evals = split["train"][:2], split["eval"][:1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "scripts", "build_suffix_corpus.py")
    good = tmp_path / "good"
    good.mkdir()
    write_jsonl(good / "prompts.jsonl", [{"id": "p1", "source": "spec_bench", "qid": str(train[0])},
                                         {"id": "p2", "source": "local", "text": "x"}])
    write_jsonl(good / "answers.jsonl", [{"id": "a1", "prompt_id": "p1", "answer_ids": list(range(10, 30))},
                                         {"id": "a2", "prompt_id": "p2", "answer_ids": list(range(10, 30))}])
    write_jsonl(good / "answers_greedy.jsonl", [{"id": str(train[1]), "answer_ids": list(range(40, 60))}])
    out = tmp_path / "warm.jsonl"
    done = subprocess.run([sys.executable, script, str(good), "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = read_corpus(str(out))
    assert [r["token_ids"][0] for r in rows] == [10, 40]  # the local-source answer is left out
    bad = tmp_path / "bad"
    bad.mkdir()
    write_jsonl(bad / "answers_greedy.jsonl", [{"id": str(evals[0]), "answer_ids": list(range(40, 60))}])
    done = subprocess.run([sys.executable, script, str(bad), "--out", str(tmp_path / "x.jsonl")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and f"id {evals[0]} is a Spec-Bench eval question" in done.stderr
