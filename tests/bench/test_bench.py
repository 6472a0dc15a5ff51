"""specbuild bench: the packaged Spec-Bench data and split, multi-turn handling, aggregation,
the table, and an end-to-end run on a tiny bundle (with transformers peer rows)."""

from __future__ import annotations

import collections
import json
import os

import pytest
from click.testing import CliRunner

from specbuild.bench import specbench as B
from specbuild.bench.run import BenchConfig, copy_bandwidth, floor_summary, resolve_methods

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "benchmarks", "spec_bench", "question.jsonl")


def test_split_is_deterministic_disjoint_complete_and_stratified():
    questions = B.load_questions()
    split = B.load_split()
    assert {k: split[k] for k in ("train", "eval", "categories")} == \
        {k: v for k, v in B.make_split(questions).items() if k in ("train", "eval", "categories")}
    assert B.make_split(questions) == B.make_split(list(reversed(questions)))  # order-free
    train, evals = set(split["train"]), set(split["eval"])
    assert not train & evals
    assert train | evals == {q["question_id"] for q in questions} and len(train | evals) == 480
    cat = {q["question_id"]: q["category"] for q in questions}
    per_cat = collections.Counter(q["category"] for q in questions)
    assert len(per_cat) == 13
    for c, n in per_cat.items():
        n_eval = sum(cat[i] == c for i in evals)
        assert n_eval == n // 2 and sum(cat[i] == c for i in train) == n - n // 2, c
    # a different salt gives a different (still stratified) split: the salt really drives it
    assert B.make_split(questions, salt="other")["eval"] != split["eval"]


def test_packaged_questions_equal_the_shared_file():
    questions = B.load_questions()
    assert len(questions) == 480
    assert os.path.isfile(B.data_path("LICENSE"))
    if not os.path.isfile(SHARED):
        pytest.skip("no ../shared checkout")
    with open(SHARED, "rb") as a, open(B.data_path("question.jsonl"), "rb") as b:
        assert a.read() == b.read()


def test_select_questions_groups_and_interleaves():
    questions, split = B.load_questions(), B.load_split()
    chosen = B.select_questions(questions, split, "eval", per_category=8)
    groups = collections.Counter(B.task_group(q["category"]) for q in chosen)
    assert groups == {g: 8 for g in B.GROUPS}
    assert all(q["question_id"] in set(split["eval"]) for q in chosen)
    mt = [q["category"] for q in chosen if B.task_group(q["category"]) == "mt_bench"]
    assert sorted(mt) == sorted(B.MT_BENCH_CATEGORIES)  # one of each MT-bench category
    assert [B.task_group(q["category"]) for q in chosen] == [g for g in B.GROUPS for _ in range(8)]
    # questions that do not fit are passed over and the next one is taken
    no_rag = B.select_questions(questions, split, "eval", 2, fits=lambda q: q["question_id"] % 2 == 0)
    assert len(no_rag) == 12 and all(q["question_id"] % 2 == 0 for q in no_rag)
    assert len(B.select_questions(questions, split, "all")) == 480
    with pytest.raises(ValueError, match="per_category=0"):
        B.select_questions(questions, split, "eval", 0)


def test_turn_two_follows_the_runs_own_turn_one_answer():
    questions = [{"question_id": 1, "category": "writing", "turns": ["Write A.", "Now B."]},
                 {"question_id": 2, "category": "qa", "turns": ["Q?"]}]
    calls = []

    def render(messages):  # prompt ids that carry the messages, so the fake can read them back
        return list(json.dumps(messages).encode())

    def generate(prompts):
        calls.append([json.loads(bytes(p).decode()) for p in prompts])
        return [{"token_ids": [len(calls), i], "text": f"  answer {len(calls)}.{i}\n", "stats": {}}
                for i in range(len(prompts))], 0.5

    turns, seconds = B.run_conversations(generate, render, questions)
    assert seconds == [0.5, 0.5]
    assert len(calls) == 2 and len(calls[0]) == 2 and len(calls[1]) == 1  # turn 2 only for question 1
    assert calls[1][0] == [{"role": "user", "content": "Write A."},
                           {"role": "assistant", "content": "answer 1.0"},  # own answer, stripped
                           {"role": "user", "content": "Now B."}]
    assert [len(t) for t in turns] == [2, 1]
    assert turns[0][1].token_ids == [2, 0] and turns[1][0].text.strip() == "answer 1.1"


def _row(name, engine, group_turns, seconds, stats=None):
    """A RowRecord with one chunk per (group, token_lists) and the given per-repeat seconds."""
    row = B.RowRecord(name, engine, name.split()[1], "float32", 1)
    for (group, toks), secs in zip(group_turns, seconds):
        row.chunks.append({"group": group, "questions": [{"question_id": len(row.chunks)}],
                           "turns": [[B.Turn([1, 2], t, "", stats or {}) for t in toks]], "seconds": secs})
    return row


def test_summarize_uses_median_seconds_speedups_and_mismatches():
    plain = _row("specbuild none", "specbuild", [("qa", [[5] * 10]), ("rag", [[7] * 20])],
                 [[[1.0], [2.0], [9.0]], [[2.0], [2.0], [2.0]]])
    spec = _row("specbuild ngram", "specbuild", [("qa", [[5] * 10]), ("rag", [[7] * 19 + [8]])],
                [[[0.5], [0.5], [0.6]], [[1.0], [1.0], [1.0]]], stats={"mean_accepted_tokens": 3.0,
                                                                      "drafted": 12, "accepted": 6})
    out = {r["name"]: r for r in B.summarize([plain, spec], gap_fn=lambda ids: 0.25)}
    assert out["specbuild none"]["groups"]["qa"]["tokens_per_s"] == 5.0  # 10 tokens / median 2 s
    assert out["specbuild ngram"]["groups"]["qa"]["speedup"] == 4.0
    assert out["specbuild none"]["groups"]["overall"]["tokens_per_s"] == 7.5  # 30 tokens / 4 s
    assert out["specbuild ngram"]["groups"]["overall"]["mean_accepted_tokens"] == 3.0
    assert out["specbuild none"]["groups"]["overall"]["mean_accepted_tokens"] == 1.0
    assert out["specbuild ngram"]["groups"]["rag"]["mismatches"] == 1
    assert out["specbuild ngram"]["groups"]["overall"]["compared"] == 2
    assert out["specbuild ngram"]["mismatch_details"] == [
        {"question_id": 1, "turn": 1, "position": 19, "top2_logit_gap": 0.25}]
    assert B.divergence([1, 2], [1, 2, 3]) == 2 and B.divergence([1], [1]) is None


def test_floor_summary_and_copy_bandwidth():
    s = floor_summary(weight_bytes=500_000_000, gb_per_s=10.0, step_ms=75.0)
    assert s["floor_ms"] == 50.0 and s["ratio"] == 1.5
    bw = copy_bandwidth(8 << 20, repeats=3)
    assert bw["bytes"] == 8 << 20 and bw["gb_per_s"] > 0.01


def test_table_formatting():
    row = lambda name, engine, tps, speedup, mat, mism: {  # noqa: E731
        "name": name, "engine": engine, "method": name.split()[1], "format": "float32", "batch_size": 1,
        "mismatch_details": [{"question_id": 9, "turn": 2, "position": 3, "top2_logit_gap": 1e-6}] if mism else [],
        "groups": {g: {"tokens_per_s": tps, "speedup": speedup, "mean_accepted_tokens": mat, "compared": 4,
                       "mismatches": mism} for g in ("qa", "rag", "overall")}}
    report = {"bundle": "/b", "target_format": "float32, from m.gguf (gguf)", "questions": 4,
              "config": {"split": "eval", "per_category": 2, "max_tokens": 64, "repeats": 3},
              "env": {"threads": 2, "torch": "2.13.0", "transformers": None, "cpu": "X", "cpu_count": 2,
                      "command": "specbuild bench /b"},
              "rows": [row("specbuild none", "specbuild", 40.0, 1.0, 1.0, 0),
                       row("specbuild ngram", "specbuild", 61.23, 1.531, 2.5, 1),
                       row("transformers plain", "transformers", 20.0, 1.0, None, 0)],
              "peer_ratios": {"none/plain": 2.0},
              "floor": {"dtype": "float32", "samples": 3, "weight_bytes": 538e6, "copy_gb_per_s": 10.0,
                        "copy_bytes": 256 << 20, "floor_ms": 53.8, "step_ms": 70.0, "ratio": 1.3},
              "notes": ["load average 1.0"]}
    text = B.format_table(report)
    lines = text.splitlines()
    assert lines[4].split() == ["tokens/s", "format", "batch", "qa", "rag", "overall"]
    assert lines[6].split() == ["specbuild", "ngram", "float32", "1", "61.2", "61.2", "61.2"]
    grid = lines[4:8]
    assert len({len(ln) for ln in grid}) == 1  # columns aligned
    assert "1.53x" in text and "2.50" in text and "1/4" in text and "0/4" in text
    assert "transformers plain" in text and " - " in text  # no accepted-token figure for transformers
    assert "diverges at token 3 (top-2 logit gap there 1.00e-06)" in text
    assert "none/plain 2.00x" in text and "ratio 1.30x" in text
    assert text.endswith("command: specbuild bench /b") and "note: load average 1.0" in text


def test_charged_costs_note_names_what_each_drafted_token_cost():
    from specbuild.bench.run import charged_note

    note = charged_note({"verify_ms": {1: 10.0, 4: 21.5}, "draft_ms": {"eagle": 1.7, "ngram": 0.0}})
    assert note == ["costs the depth controller charged (ms): verify w1 10.00, w4 21.50; per drafted token eagle 1.70"]
    assert charged_note({"verify_ms": {1: 10.0}, "draft_ms": {"ngram": 0.0}}) == []


def test_config_and_method_errors():
    with pytest.raises(ValueError, match="repeats=0"):
        BenchConfig(repeats=0)
    with pytest.raises(ValueError, match="peer 'vllm'"):
        BenchConfig(peers=("vllm",))
    assert resolve_methods(None, {"target": {}}) == ["none", "ngram"]
    assert resolve_methods(("draft",), {"target": {}, "draft": {}}) == ["none", "draft"]
    with pytest.raises(ValueError, match="needs a 'draft' role"):
        resolve_methods(("draft",), {"target": {}})


@pytest.fixture(scope="module")
def bench_bundle(tmp_path_factory):
    """A tiny bundle whose max_seq_len holds Spec-Bench's longest prompts (byte-level tokens).
    float64, so that batch shape (a verify window against one token) cannot flip a greedy token."""
    from specbuild.compiler.compile import CompileOptions, compile_bundle
    from tiny import make_tiny_hf

    root = tmp_path_factory.mktemp("bench")
    src = make_tiny_hf(str(root / "hf"), scale=4.0)
    return compile_bundle(src, str(root / "bundle"), CompileOptions(dtype="float64", max_seq_len=8192,
                                                                      max_batch_size=2))


def _bench_json(args):
    from specbuild.cli.main import main

    # one thread: two OpenMP threads on a loaded shared CPU stall each other
    result = CliRunner().invoke(main, ["bench"] + args + ["--threads", "1", "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _check_rows(report, names, turns, max_tokens):
    assert [r["name"] for r in report["rows"]] == names
    for r in report["rows"]:
        o = r["groups"]["overall"]
        assert o["turns"] == turns and 0 < o["generated_tokens"] <= turns * max_tokens and o["tokens_per_s"] > 0
        assert o["compared"] >= 1 and o["speedup"] > 0 and o["seconds"] > 0
    plain = report["rows"][0]["groups"]["overall"]
    assert plain["speedup"] == 1.0 and plain["mismatches"] == 0 and plain["mean_accepted_tokens"] == 1.0


def test_bench_end_to_end_on_a_tiny_bundle(bench_bundle):
    report = _bench_json([bench_bundle, "--per-category", "1", "--max-tokens", "8", "--repeats", "1",
                          "--speculation", "ngram", "--gamma", "3", "--floor", "--floor-mib", "16"])
    _check_rows(report, ["specbuild none", "specbuild ngram"], turns=7, max_tokens=8)
    assert report["questions"] == 6 and len(report["question_ids"]) == 6
    assert set(report["question_ids"]) <= set(B.load_split()["eval"])
    for r in report["rows"]:
        assert set(r["groups"]) == set(B.GROUPS) | {"overall"}, r["name"]
    ngram = report["rows"][1]["groups"]["overall"]
    assert ngram["compared"] == 7 and ngram["mismatches"] == 0  # lossless greedy, every turn compared
    assert ngram["drafted"] > ngram["accepted"] > 0 and ngram["mean_accepted_tokens"] > 1.0  # it speculated
    assert not any("drafted no tokens" in n for n in report["notes"])
    charged = report["charged_costs"]  # what the depth controller charged: prompt lookup drafts for free
    assert charged["verify_ms"]["1"] > 0 and charged["draft_ms"] == {"ngram": 0.0}
    assert not any("costs the depth controller charged" in n for n in report["notes"])
    fl = report["floor"]
    assert fl["weight_bytes"] > 0 and fl["step_ms"] > 0 and fl["dtype"] == "float64" and fl["copy_bytes"] == 16 << 20
    assert fl["ratio"] == pytest.approx(fl["step_ms"] / fl["floor_ms"], rel=1e-2)
    env = report["env"]
    assert env["threads"] == 1 and env["torch"] and env["cpu"] and env["command"].startswith("specbuild")
    assert report["config"]["methods"] == ["none", "ngram"]
    assert B.format_table(report).count("specbuild ngram") == 4


def test_bench_peer_rows_on_a_small_dataset(bench_bundle, tmp_path):
    data = tmp_path / "q.jsonl"
    qs = [{"question_id": i, "category": c, "turns": t} for i, c, t in [
        (1, "writing", ["Write the theme.", "Again, shorter."]), (2, "writing", ["Say it.", "Once more."]),
        (3, "qa", ["Who is there?"]), (4, "qa", ["The the the?"])]]
    data.write_text("".join(json.dumps(q) + "\n" for q in qs))
    report = _bench_json([bench_bundle, "--dataset", str(data), "--split", "all", "--max-tokens", "6",
                          "--repeats", "2", "--speculation", "none", "--peers", "transformers"])
    _check_rows(report, ["specbuild none", "transformers plain", "transformers prompt_lookup"], turns=6,
                max_tokens=6)
    assert sorted(report["question_ids"]) == [1, 2, 3, 4]
    assert set(report["rows"][0]["groups"]) == {"mt_bench", "qa", "overall"}
    tf = {r["name"]: r["groups"]["overall"] for r in report["rows"][1:]}
    assert tf["transformers plain"]["mean_accepted_tokens"] is None
    assert tf["transformers plain"]["speedup"] == 1.0 and tf["transformers prompt_lookup"]["speedup"] > 0
    assert set(report["peer_ratios"]) == {"none/plain"}
    assert "transformers prompt_lookup" in B.format_table(report)


def test_bench_refuses_bad_input(bench_bundle):
    from specbuild.cli.main import main

    result = CliRunner().invoke(main, ["bench", bench_bundle, "--speculation", "draft", "--no-progress"])
    assert result.exit_code == 2 and "needs a 'draft' role" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["bench", bench_bundle, "--batch-size", "4", "--no-progress"])
    assert result.exit_code == 2 and "max_batch_size=4" in result.output


def test_bench_formats_mode_on_the_bundles_source(bench_bundle):
    """`bench --formats`: the weight-formats table for the bundle's own source, each format
    against its floor with verify cost by width; unknown names refused."""
    from specbuild.cli.main import main

    result = CliRunner().invoke(main, ["bench", bench_bundle, "--formats", "float32,int8", "--threads", "1",
                                       "--repeats", "1", "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {r["format"]: r for r in report["rows"]}
    assert list(rows) == ["float32", "int8"]
    assert rows["int8"]["weight_mb"] < rows["float32"]["weight_mb"]
    for r in rows.values():
        assert r["floor_ms"] > 0 and r["step_over_floor"] > 0 and r["perplexity"] > 1
    result = CliRunner().invoke(main, ["bench", bench_bundle, "--formats", "float32,int3", "--no-progress"])
    assert result.exit_code == 2 and "int3" in result.output and "Traceback" not in result.output


def test_llama_cpp_peer_needs_a_gguf_source(bench_bundle):
    from specbuild.cli.main import main

    result = CliRunner().invoke(main, ["bench", bench_bundle, "--peers", "llama.cpp", "--no-progress"])
    assert result.exit_code == 2 and "GGUF source" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["bench", bench_bundle, "--peers", "vllm", "--no-progress"])
    assert result.exit_code == 2 and "'vllm' is not one of: transformers, llama.cpp" in result.output


@pytest.mark.integration
def test_llama_cpp_peer_row_on_the_default_model(smollm2_bundle, tmp_path):
    """Where llama-cpp-python is installed: llama.cpp plain decoding on the same GGUF is a peer
    row, and the report gives specbuild's tokens/s over it."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional peer)")
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [t]}) + "\n"
                            for i, t in ((1, "Name three colours."), (2, "What is two plus two?"))))
    report = _bench_json([smollm2_bundle, "--dataset", str(data), "--split", "all", "--max-tokens", "16",
                          "--repeats", "1", "--speculation", "none", "--peers", "llama.cpp"])
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"specbuild none", "llama.cpp plain"}
    peer = rows["llama.cpp plain"]["groups"]["overall"]
    assert peer["generated_tokens"] > 0 and peer["tokens_per_s"] > 0 and peer["speedup"] == 1.0
    assert "GGUF as is" in rows["llama.cpp plain"]["format"]
    assert report["peer_ratios"]["none/llama.cpp"] > 0


def test_bench_plot_draws_the_speedups(bench_bundle, tmp_path):
    from PIL import Image

    from specbuild.cli.main import main

    png = tmp_path / "speedup.png"
    result = CliRunner().invoke(main, ["bench", bench_bundle, "--per-category", "1", "--max-tokens", "6",
                                       "--repeats", "1", "--speculation", "ngram", "--threads", "1", "--no-progress",
                                       "--plot", str(png)])
    assert result.exit_code == 0, result.output
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size[0] >= 600 and img.size[1] >= 400
        assert len(set(img.convert("RGB").getdata())) > 10  # bars, not a blank canvas
