"""The repeated-work workload (bench/repeated.py): its questions expand from the package data
as intended, and `specbuild bench --workload repeated` runs them through the bench loop with
every category as a column, the suffix row lossless and speculating."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from specbuild.bench import repeated


def test_questions_expand_sessions_and_templates():
    qs = repeated.questions()
    assert len({q["question_id"] for q in qs}) == len(qs)
    assert {q["category"] for q in qs} == set(repeated.CATEGORIES)
    for q in qs:
        assert all(t and "{doc}" not in t and "{name}" not in t for t in q["turns"]), q["question_id"]
    sessions = [q for q in qs if q["category"].endswith("_session")]
    assert sum(len(q["turns"]) > 1 for q in sessions) >= 5  # multi-turn: edit, summarise, ask again
    # a document comes back in a later session (the global store's case)
    firsts = [q["turns"][0] for q in sessions]
    assert any(a != b and a.split("\n\n")[1] == b.split("\n\n")[1] for i, a in enumerate(firsts) for b in firsts[i + 1:])
    for cat in ("template_support", "template_extract", "template_code"):
        reqs = [q["turns"][0] for q in qs if q["category"] == cat]
        assert len(reqs) >= 4 and len(set(reqs)) == len(reqs)
        assert len(os.path.commonprefix(reqs)) >= 20, cat  # one template, different slots


def test_workload_choice():
    assert repeated.workload("spec-bench", None, "eval") == (None, "eval")
    path, split = repeated.workload("repeated", None, "eval")
    try:
        assert split == "all"
        with open(path, encoding="utf-8") as f:
            assert [json.loads(line) for line in f] == repeated.questions()
    finally:
        os.unlink(path)
    with pytest.raises(ValueError, match="drop --dataset"):
        repeated.workload("repeated", "x.jsonl", "eval")
    with pytest.raises(ValueError, match="'other' is not one of"):
        repeated.workload("other", None, "eval")


def test_bench_runs_the_repeated_workload(tmp_path):
    from specbuild.cli.main import main
    from specbuild.compiler.compile import CompileOptions, compile_bundle
    from tiny import make_tiny_hf

    src = make_tiny_hf(str(tmp_path / "hf"), scale=4.0)
    bundle = compile_bundle(src, str(tmp_path / "bundle"), CompileOptions(dtype="float64", max_seq_len=8192,
                                                                           max_batch_size=2))
    result = CliRunner().invoke(main, ["bench", bundle, "--workload", "repeated", "--per-category", "1",
                                       "--max-tokens", "6", "--repeats", "1", "--speculation", "suffix",
                                       "--threads", "1", "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["config"]["split"] == "all" and report["questions"] == len(repeated.CATEGORIES)
    plain, suffix = report["rows"]
    assert set(suffix["groups"]) == set(repeated.CATEGORIES) | {"overall"}
    o = suffix["groups"]["overall"]
    assert o["compared"] == plain["groups"]["overall"]["turns"] and o["mismatches"] == 0
    assert o["drafted"] > 0 and o["accepted"] > 0
