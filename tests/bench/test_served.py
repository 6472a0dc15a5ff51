"""The served benchmark's machinery (specbuild/bench/served.py, scripts/bench_serve.py): a real
`specbuild serve` subprocess on a tiny bundle, streamed chat completions over a socket at a
concurrency, the report, and the llama-server peer's command and its absence."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specbuild.bench import served as S


def test_a_fresh_server_serves_the_load_and_the_report_names_machine_and_identity(tiny_bundle, tmp_path):
    cfg = S.ServedConfig(bundle=tiny_bundle, methods=("none", "ngram"), concurrency=(2,), max_tokens=12,
                         compile=False, llama_rows=(), guard=None, texts=("a b c a b c a b", "hello there", "1 2 3 1 2 3"))
    report = S.run_served(cfg, str(tmp_path / "logs"), say=lambda line: None)
    rows = {r["row"]: r for r in report["rows"]}
    assert set(rows) == {"none", "ngram"}
    for r in rows.values():
        assert not r.get("failed") and not r["errors"], r
        assert r["requests"] == 3 and r["output_tokens"] > 0 and r["tokens_per_s"] > 0
        assert r["ttft_p50_ms"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"]
        assert len(r["texts"]) == 3
        assert os.path.exists(r["log"])  # each row's server log is kept
    # greedy: prompt lookup's text is plain decoding's (the report checks it per prompt)
    assert rows["ngram"]["identical"] == "3/3" and "vs_plain" in rows["ngram"]
    text = S.format_report(report)
    assert "CPU:" in text and "flags:" in text and "specbuild ngram" in text and "=3/3" in text
    # the served steps' parts, read from the server's /health after its load (engine/stepparts.py)
    parts = {p["kind"] for p in rows["none"]["step_parts"]}
    assert "plain" in parts and all(p["step_ms"] > 0 for p in rows["none"]["step_parts"])
    assert "the served steps' parts" in text and "prompts seen for the first time" in text
    # the kernels' threading as the server ran it (/health's threads: the governor's choice and,
    # on the kernels' own pool, its jobs)
    threads = rows["none"]["threads"]
    assert threads["threads"] >= 1 and "why" in threads
    if "kernels_pool" in threads:
        assert threads["kernels_pool"]["jobs"] >= 0 and "waits" in threads["kernels_pool"]


def test_the_repeated_workload_answers_the_prompts_once_before_the_counted_run(tiny_bundle, tmp_path):
    cfg = S.ServedConfig(bundle=tiny_bundle, methods=("none",), concurrency=(1,), max_tokens=8, compile=False,
                         llama_rows=(), guard=None, texts=("a b c a b c a b", "hello there"), repeat=True)
    report = S.run_served(cfg, str(tmp_path / "logs"), say=lambda line: None)
    row = report["rows"][0]
    assert not row.get("failed") and row["requests"] == 2
    # the server chose tokens for the warm-up, the uncounted pass and the counted one
    chosen = sum(p["tokens_per_step"] * p["steps"] for p in row["step_parts"] if p["kind"] != "prefill")
    assert chosen >= 2 * row["output_tokens"]
    assert "REPEATED content" in S.format_report(report)


def test_interleaved_rows_take_the_prompts_slice_by_slice_in_turn(tiny_bundle, tmp_path, monkeypatch):
    """--interleave: both servers up at once, each prompt (C=1) sent to every server in turn, the
    order rotated by slice; each row's result covers all the prompts, as in a row of its own."""
    calls = []
    real = S.run_load

    def run_load(port, prompts, *args, **kwargs):
        calls.append((port, [p[0]["content"] for p in prompts]))
        return real(port, prompts, *args, **kwargs)

    monkeypatch.setattr(S, "run_load", run_load)
    texts = ("a b c a b c a b", "hello there", "1 2 3 1 2 3")
    cfg = S.ServedConfig(bundle=tiny_bundle, methods=("none", "ngram"), concurrency=(1,), max_tokens=10,
                         compile=False, llama_rows=(), guard=None, texts=texts, interleave=True)
    report = S.run_served(cfg, str(tmp_path / "logs"), say=lambda line: None)
    rows = {r["row"]: r for r in report["rows"]}
    for r in rows.values():
        assert not r.get("failed") and not r["errors"], r
        assert r["requests"] == 3 and r["slices"] == 3 and len(r["texts"]) == 3 and r["tokens_per_s"] > 0
        assert r["step_parts"]
    assert rows["ngram"]["identical"] == "3/3"
    ports = list(dict.fromkeys(port for port, _ in calls))
    assert len(ports) == 2
    a, b = ports
    assert calls == [(a, [texts[0]]), (b, [texts[0]]), (b, [texts[1]]), (a, [texts[1]]),
                     (a, [texts[2]]), (b, [texts[2]])]
    assert "INTERLEAVED" in S.format_report(report) and "one slice" not in S.format_report(report)
    report["config"]["concurrency"] = (1, 4)
    report["rows"] += [dict(r, concurrency=4) for r in report["rows"]]
    assert "at C=4 the 3 prompts make one slice" in S.format_report(report)
    assert [list(r) for r in S.slices(10, 4)] == [list(range(8)), [8, 9]]
    assert S.specbuild_extra("none@2") == {"speculation": "none"}  # an A/A row: the same method again


def test_a_labelled_row_serves_its_own_bundle(tiny_bundle, tmp_path, monkeypatch):
    """--row-bundle LABEL=DIR: a row `method@LABEL` is served from DIR, in the same interleaved
    run as the rest, its greedy output checked against plain decoding's like any row's; and
    --row-arg LABEL=ARG starts that row's server alone with ARG."""
    import shutil

    other = str(tmp_path / "other")
    shutil.copytree(tiny_bundle, other)
    served, args = [], []
    real = S.specbuild_command

    def specbuild_command(cfg, port, max_batch, bundle=None, row=None):
        cmd = real(cfg, port, max_batch, bundle, row)
        served.append(cmd[cmd.index("serve") + 1])
        args.append(cmd[cmd.index("--log-level") + 2:])
        return cmd

    monkeypatch.setattr(S, "specbuild_command", specbuild_command)
    texts = ("a b c a b c a b", "hello there")
    cfg = S.ServedConfig(bundle=tiny_bundle, methods=("none", "ngram", "ngram@b"), concurrency=(1,), max_tokens=8,
                         compile=False, llama_rows=(), guard=None, texts=texts, interleave=True,
                         row_bundles={"b": other}, row_args={"b": ["--kv-cache-dtype=float32"]})
    report = S.run_served(cfg, str(tmp_path / "logs"), say=lambda line: None)
    assert served == [tiny_bundle, tiny_bundle, other]  # rows in order: none, ngram, ngram@b
    assert args == [[], [], ["--kv-cache-dtype=float32"]]  # --row-arg: the labelled row's server alone
    rows = {r["row"]: r for r in report["rows"]}
    assert rows["ngram@b"]["identical"] == "2/2" and not rows["ngram@b"]["errors"]
    assert f"rows method@LABEL serve b: {other}" in S.format_report(report)
    with pytest.raises(ValueError, match="label 'c' names no row"):
        S.ServedConfig(bundle=tiny_bundle, methods=("none", "ngram@b"), row_bundles={"b": other, "c": other})
    with pytest.raises(ValueError, match="row argument label 'c' names no row"):
        S.ServedConfig(bundle=tiny_bundle, methods=("none", "ngram@b"), row_args={"c": ["--x"]})


def test_a_labelled_row_runs_with_its_own_environment(tiny_bundle, tmp_path, monkeypatch):
    """--row-env LABEL=KEY=VALUE: the server of row `method@LABEL` (alone) runs with KEY=VALUE
    over --env, in the same interleaved run, its output checked like any row's."""
    envs = {}
    real = S.Server.__init__

    def init(self, name, cmd, port, env=None, **kw):
        envs[name] = dict(env or {})
        real(self, name, cmd, port, env=env, **kw)

    monkeypatch.setattr(S.Server, "__init__", init)
    cfg = S.ServedConfig(bundle=tiny_bundle, methods=("none", "none@off"), concurrency=(1,), max_tokens=6,
                         compile=False, llama_rows=(), guard=None, texts=("a b c a b c", "hello there"),
                         interleave=True, env={"SPECBUILD_X": "1"},
                         row_env={"off": {"SPECBUILD_FUSED_ENDS": "0", "SPECBUILD_X": "2"}})
    report = S.run_served(cfg, str(tmp_path / "logs"), say=lambda line: None)
    assert envs["specbuild serve (none)"] == {"SPECBUILD_X": "1"}
    assert envs["specbuild serve (none@off)"] == {"SPECBUILD_X": "2", "SPECBUILD_FUSED_ENDS": "0"}
    rows = {r["row"]: r for r in report["rows"]}
    assert rows["none@off"]["identical"] == "2/2" and not rows["none@off"]["errors"]
    assert "rows method@LABEL run with off: SPECBUILD_FUSED_ENDS=0 SPECBUILD_X=2" in S.format_report(report)
    with pytest.raises(ValueError, match="environment label 'c' names no row"):
        S.ServedConfig(bundle=tiny_bundle, methods=("none", "none@b"), row_env={"c": {"A": "1"}})


def test_a_server_that_cannot_start_fails_its_row_only(tmp_path):
    server = S.Server("broken", [sys.executable, "-c", "import sys; print('no such bundle'); sys.exit(3)"],
                      S.free_port(), log_path=str(tmp_path / "x.log"))
    with pytest.raises(RuntimeError, match="exited with status 3.*no such bundle"):
        server.wait_ready(30)
    server.stop()


def test_the_peer_is_skipped_with_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    binary, why = S.find_llama_server(str(tmp_path / "nope"))
    assert binary is None and "not an executable" in why
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert S.find_llama_server(str(fake)) == (str(fake), "")
    cmd = S.llama_command("/x/llama-server", "/m.gguf", 8080, 2, 8, "ngram", 96)
    assert cmd[:3] == ["/x/llama-server", "-m", "/m.gguf"] and "-np" in cmd and cmd[cmd.index("-np") + 1] == "8"
    assert S.LLAMA_NGRAM_ARGS[0] in cmd
    assert "--spec-default" in S.llama_command("b", "m", 1, 2, 1, "spec-default", 8)


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match="concurrency"):
        S.ServedConfig(bundle="b", concurrency=(0,))
    with pytest.raises(ValueError, match="'turbo'"):
        S.ServedConfig(bundle="b", llama_rows=("turbo",))
    out = subprocess.run([sys.executable, "scripts/bench_serve.py", "/nonexistent"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 2 and "/nonexistent is not a bundle" in out.stderr


def test_held_out_prompts_come_from_the_eval_split():
    from specbuild.bench import specbench as B

    prompts = S.held_out_prompts(12)
    assert len(prompts) == 12 and all(p[0]["role"] == "user" and p[0]["content"] for p in prompts)
    split = B.load_split()
    first_turns = {q["turns"][0]: q["question_id"] for q in B.load_questions()}
    assert all(first_turns[p[0]["content"]] in set(split["eval"]) for p in prompts)


def test_the_guard_alternates_served_and_main_thread_rounds_and_can_fail(tiny_bundle, tmp_path):
    texts = ("a b c a b c a b", "hello there")
    cfg = S.ServedConfig(bundle=tiny_bundle, compile=False, llama_rows=(), guard=1000.0, main_tokens=16, texts=texts)
    prompts = [[{"role": "user", "content": t}] for t in texts]
    said = []
    g = S.run_guard(cfg, str(tmp_path), prompts, rounds=2, say=said.append)
    assert g["ok"] and len(g["ratios"]) == 2 * len(prompts) and g["served_tpot_ms"] > 0 and g["main_thread_step_ms"] > 0
    assert [line.split(":")[0] for line in said] == ["guard round 1/2", "guard round 2/2"]
    strict = S.ServedConfig(bundle=tiny_bundle, compile=False, llama_rows=(), guard=1e-6, main_tokens=16, texts=texts)
    assert S.run_guard(strict, str(tmp_path), prompts, rounds=1, say=said.append)["ok"] is False


def test_rows_are_also_compared_with_plain_round_by_round():
    """Each round's row over plain decoding's in the same round (failed rounds left out), and
    the report prints the median and every round's ratio where there are two or more."""
    runs = [{"tokens_per_s": 110.0}, {"failed": "boom"}, {"tokens_per_s": 90.0}]
    plain = [{"tokens_per_s": 100.0}, {"tokens_per_s": 100.0}, {"tokens_per_s": 100.0}]
    assert S.paired_ratios(runs, plain) == [1.1, 0.9]
    assert S.paired_ratios(runs[:1], [{"failed": "x"}]) == []
    row = lambda name, tps, **kw: {"engine": "specbuild", "row": name, "concurrency": 4,  # noqa: E731
                                   "tokens_per_s": tps, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0,
                                   "tpot_p50_ms": 1.0, "tpot_p99_ms": 2.0, **kw}
    report = {"machine": {"cpu": "cpu", "logical_cpus": 2, "load_average": [0, 0, 0], "date": "d", "flags": "f"},
              "rows": [row("none", 100.0), row("suffix", 100.0, vs_plain=1.0, vs_plain_rounds=[1.1, 0.9, 1.02])],
              "skipped": [], "rounds": 3}
    text = S.format_report(report)
    assert "round by round" in text and "1.02x (1.10/0.90/1.02)" in text


def test_the_switch_line_names_each_batch_sizes_arm_rates_probes_and_challenges():
    row = {"engine": "specbuild", "row": "auto", "concurrency": 8, "step_parts": [],
           "auto_switch": {"5-8": {"arm": "plain", "switches": 2, "probes": 5, "challenges": 1,
                                   "plain_tokens_per_s": 650.0, "spec_tokens_per_s": 530.5, "plain_steps": 16,
                                   "spec_steps": 3, "plain_ran": 200, "spec_ran": 40}}}
    (line,) = [x for x in S.format_step_parts([row]) if "auto's switch" in x]
    assert line.startswith("auto C=8") and "b=5-8: plain (plain 200 / spec 40 steps" in line
    assert "650.0 / 530.5 tok/s, 5 probes, 1 early)" in line
