"""The telemetry store through a real engine: SQLite always, PostgreSQL when its server
binaries are installed (started here); the bounded writer (drops counted, never blocking),
crash safety, migrations, the report, plots and the telemetry CLI."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from specbuild.cli.main import main as cli
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig
from specbuild.telemetry import attach
from specbuild.telemetry.report import report
from specbuild.telemetry.schema import SCHEMA_VERSION
from specbuild.telemetry.store import Store, TelemetryError
from specbuild.telemetry.writer import TelemetrySink
from tiny import draft_pair_bundle

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21], list(range(30, 90)) + list(range(30, 40))]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return draft_pair_bundle(tmp_path_factory.mktemp("telemetry"))


@pytest.fixture(scope="module")
def engine(bundle) -> Engine:
    return Engine(bundle, EngineConfig(max_batch_size=4))


def run(engine, method, prompts=PROMPTS, max_tokens=32, content_type=None):
    spec = SpeculationConfig.make(None, method=method)
    return engine.generate([Request(prompt_ids=p, speculation=spec, content_type=content_type,
                                    sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts])


def record(engine, target, methods=("none", "ngram", "draft"), **sink_options):
    sink = attach(engine, target, source="test", **sink_options)
    try:
        out = {m: run(engine, m) for m in methods}
    finally:
        sink.close()
        engine.set_sink(None)
        engine.set_policies(None)
    return sink, out


def check_store(store: Store, out: dict) -> None:
    n_sessions = sum(len(v) for v in out.values())
    rows = store.query("SELECT status, method, generated_tokens, total_drafted, total_accepted, content_type, "
                       "prompt_token_count FROM speculation_sessions")
    assert len(rows) == n_sessions
    assert {r[0] for r in rows} == {"completed"}
    results = [r for v in out.values() for r in v]
    assert sorted(r[2] for r in rows) == sorted(r["stats"]["generated_tokens"] for r in results)
    assert sum(r[3] for r in rows) == sum(r["stats"]["drafted"] for r in results) > 0
    assert sum(r[4] for r in rows) == sum(r["stats"]["accepted"] for r in results) > 0
    assert all(r[5] for r in rows)  # classified
    # one step row per decode pass, and its counts add up to the sessions'
    steps = store.query("SELECT COUNT(*), SUM(n_drafted), SUM(n_accepted) FROM speculation_steps")[0]
    assert steps[0] == sum(r["stats"]["generated_tokens"] - 1 for r in results
                           if r["stats"]["generated_tokens"] > 1) - sum(r["stats"]["accepted"] for r in results)
    assert steps[1] == sum(r["stats"]["drafted"] for r in results)
    assert steps[2] == sum(r["stats"]["accepted"] for r in results)
    rep = report(store)
    assert set(rep["by_method"]) >= {"plain", "ngram", "draft"}
    assert rep["by_method"]["draft"]["acceptance"] > 0
    assert rep["by_position"]["draft"][0]["offered"] > 0
    assert rep["gamma_histogram"]["none"] == {"0": sum(r["stats"]["generated_tokens"] - 1 for r in out["none"])}


def test_sqlite_store_records_what_the_engine_did(engine, tmp_path):
    db = str(tmp_path / "t.db")
    plain = run(engine, "none")
    sink, out = record(engine, db)
    assert sink.stats()["telemetry_rows_dropped"] == 0 and sink.stats()["telemetry_write_errors"] == 0
    # telemetry does not change a token
    assert [r["token_ids"] for r in out["none"]] == [r["token_ids"] for r in plain]
    assert [r["token_ids"] for r in out["draft"]] == [r["token_ids"] for r in plain]
    store = Store(db)
    assert store.query("PRAGMA journal_mode")[0][0] == "wal"
    assert store.version() == SCHEMA_VERSION
    check_store(store, out)


def test_full_queue_drops_and_counts_rows_without_blocking(engine, tmp_path):
    db = str(tmp_path / "slow.db")
    plain = run(engine, "draft")
    # a writer that sleeps 0.5 s per batch behind a queue of 4 rows: nearly everything is dropped
    sink, out = record(engine, db, methods=("draft",), queue_size=4, batch_size=2, delay_s=0.5)
    assert [r["token_ids"] for r in out["draft"]] == [r["token_ids"] for r in plain]
    st = sink.stats()
    assert st["telemetry_rows_dropped"] > 0
    # every row that found room in the queue was written at close; the others are counted as dropped
    assert st["telemetry_rows_written"] == sink._queued_n
    store = Store(db)
    written = sum(store.query(f"SELECT COUNT(*) FROM {t}")[0][0] for t in
                  ("speculation_sessions", "speculation_steps", "speculation_events"))
    # rows of a session's start and end share one table row: written counts both inserts
    n_session_rows = store.query("SELECT COUNT(*) FROM speculation_sessions")[0][0]
    assert written <= st["telemetry_rows_written"] and written >= st["telemetry_rows_written"] - n_session_rows
    assert sum(sink.dropped.values()) == st["telemetry_rows_dropped"]


def test_engine_stats_and_metric_report_drops(engine, tmp_path):
    from specbuild.serve.metrics import ServerMetrics

    metrics = ServerMetrics(engine)
    assert "\nspecbuild_telemetry_rows_dropped_total " not in metrics.render()  # telemetry off: no sample
    sink = attach(engine, str(tmp_path / "m.db"), queue_size=1, delay_s=0.3)
    try:
        run(engine, "ngram", prompts=PROMPTS[:1], max_tokens=16)
        dropped = engine.stats()["telemetry_rows_dropped"]
        assert dropped > 0
        assert f"\nspecbuild_telemetry_rows_dropped_total {dropped}\n" in metrics.render()
    finally:
        sink.close()
        engine.set_sink(None)


CRASH = textwrap.dedent('''
    import os, signal, sys, time
    from types import SimpleNamespace
    from specbuild.engine.events import StepRecord
    from specbuild.telemetry.writer import TelemetrySink

    sink = TelemetrySink(sys.argv[1], "m", source="test", queue_size=5000, batch_size=100)
    tally = SimpleNamespace(gammas=[2], drafted=0, accepted=0, target_passes=1, verify_passes=1, t_first=None)
    seq = SimpleNamespace(seq_id=1, spec=None, tally=tally, request=SimpleNamespace(request_id="r"),
                          admission=SimpleNamespace(content_type="chat", content_type_source="request"),
                          prompt_ids=[1, 2], output_ids=[3], num_cached=2,
                          finished=False, finish_reason=None, stats=lambda: {}, spec_state=SimpleNamespace(candidate_sources=None))
    sink.on_session_start(seq)
    step = StepRecord(1, "draft", 2, 2, 1, 2, 2, 0.1, 0.2, 1, False)
    for _ in range(1000):
        sink.on_step(seq, step)
    assert sink.flush(60)
    sink.delay_s = 30  # the writer now holds its next batch: rows stay queued
    for _ in range(1000):
        sink.on_step(seq, step)
    time.sleep(0.5)
    print("queued", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
''')


def test_a_crash_loses_only_the_queued_rows(tmp_path):
    db = str(tmp_path / "crash.db")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", CRASH, db], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == -9, proc.stderr
    assert "queued" in proc.stdout
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("SELECT COUNT(*) FROM speculation_steps").fetchone()[0] == 1000
    assert conn.execute("SELECT COUNT(*) FROM speculation_sessions").fetchone()[0] == 1


def test_migrations_upgrade_an_old_store_and_refuse_a_newer_one(tmp_path):
    db = str(tmp_path / "old.db")
    old = Store(db, migrate=False)
    assert old.migrate(upto=1) == 1
    old.execute("INSERT INTO speculation_sessions (session_id, created_at, model_id, prompt_token_count) "
                "VALUES ('s1', 1.0, 'm', 3)")
    assert old.query("SELECT name FROM sqlite_master WHERE name = 'speculation_events'") == []
    old.close()
    new = Store(db)
    assert new.version() == SCHEMA_VERSION == 3
    assert new.query("SELECT session_id FROM speculation_sessions") == [("s1",)]
    assert new.query("SELECT COUNT(*) FROM speculation_events") == [(0,)]
    assert new.query("SELECT COUNT(candidate_sources) FROM speculation_steps") == [(0,)]  # migration 3's column
    new.execute("INSERT INTO schema_version (version, applied_at) VALUES (99, 0)")
    new.close()
    with pytest.raises(TelemetryError, match="schema version 99, newer"):
        Store(db)


def test_bad_targets_fail_with_a_clear_error(tmp_path, engine):
    with pytest.raises(TelemetryError, match="does not exist"):
        Store(str(tmp_path / "no" / "such" / "dir.db"))
    with pytest.raises(ValueError, match="queue_size=0"):
        TelemetrySink(str(tmp_path / "q.db"), "m", queue_size=0)
    r = CliRunner().invoke(cli, ["telemetry", str(tmp_path / "nodir" / "x.db")])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_report_plot_and_policy_cli(engine, tmp_path):
    db = str(tmp_path / "cli.db")
    record(engine, db)
    runner = CliRunner()
    r = runner.invoke(cli, ["telemetry", db])
    assert r.exit_code == 0, r.output
    assert "by content type" in r.output and "acceptance by position" in r.output
    r = runner.invoke(cli, ["telemetry", db, "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["overall"]["steps"] > 0 and rep["by_method"]["draft"]["tokens_per_pass"] > 1.0
    assert set(rep) >= {"by_method", "by_content_type", "by_prompt_length", "by_hour_utc", "by_position",
                        "gamma_histogram", "fallback_share", "events"}
    png = str(tmp_path / "t.png")
    r = runner.invoke(cli, ["telemetry", db, "--plot", png])
    assert r.exit_code == 0, r.output
    from PIL import Image

    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 600 and im.size[1] > 200
        colors = im.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colors is None or len(colors) > 20  # drawn, not blank
    r = runner.invoke(cli, ["telemetry", "policy", "set", db, "--content-type", "code", "--gamma-default", "6",
                            "--alpha-threshold", "0.4"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["telemetry", "policy", "set", db, "--content-type", "Bad Type!"])
    assert r.exit_code == 2 and "content_type='Bad Type!'" in r.output
    r = runner.invoke(cli, ["telemetry", "policy", "set", db, "--gamma-default", "9", "--gamma-max", "8"])
    assert r.exit_code == 2 and "gamma_default (9)" in r.output
    r = runner.invoke(cli, ["telemetry", "policy", "learn", db, "--min-steps", "4", "--json"])
    assert r.exit_code == 0, r.output
    learned = json.loads(r.output)
    assert learned["policies"], learned
    for p in learned["policies"]:
        assert p["source"] == "learned" and 0 < p["alpha_threshold"] < 1 and 0 <= p["prior_alpha"] <= 1
        assert p["gamma_min"] <= p["gamma_default"] <= p["gamma_max"]
    r = runner.invoke(cli, ["telemetry", "policy", "list", db, "--json"])
    rows = json.loads(r.output)
    assert {"code"} <= {p["content_type"] for p in rows if p["source"] == "set"}
    assert len(rows) == 1 + len(learned["policies"])


def test_generate_writes_telemetry(bundle, tmp_path):
    db = str(tmp_path / "gen.db")
    r = CliRunner().invoke(cli, ["generate", bundle, "--prompt", "def f(x):\n    return x", "--max-tokens", "8",
                                 "--speculation", "ngram", "--telemetry", db, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["stats"]["content_type"] == "code"
    store = Store(db)
    assert store.query("SELECT source, content_type, content_type_source, generated_tokens FROM speculation_sessions") \
        == [("generate", "code", "classifier", out["stats"]["generated_tokens"])]
    r = CliRunner().invoke(cli, ["generate", bundle, "--prompt", "hi", "--max-tokens", "4", "--telemetry", db,
                                 "--content-type", "legal", "--json"])
    assert r.exit_code == 0, r.output
    assert ("legal", "request") in store.query("SELECT content_type, content_type_source FROM speculation_sessions")


@pytest.fixture(scope="module")
def postgres():
    from postgres import TempPostgres, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    pg = TempPostgres()
    try:
        yield pg.start()
    finally:
        pg.stop()


def test_postgresql_store_same_schema_and_report(engine, postgres):
    sink, out = record(engine, postgres)
    assert sink.stats()["telemetry_write_errors"] == 0 and sink.stats()["telemetry_rows_dropped"] == 0
    store = Store(postgres)
    assert store.dialect == "postgresql" and store.version() == SCHEMA_VERSION
    check_store(store, out)
    r = CliRunner().invoke(cli, ["telemetry", postgres, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["store"]["dialect"] == "postgresql"
    r = CliRunner().invoke(cli, ["telemetry", "policy", "learn", postgres, "--min-steps", "4"])
    assert r.exit_code == 0 and "stored" in r.output, r.output
    assert store.policies()


def test_bench_writes_its_runs_to_the_store(bundle, tmp_path):
    db = str(tmp_path / "bench.db")
    r = CliRunner().invoke(cli, ["bench", bundle, "--per-category", "1", "--max-tokens", "8", "--repeats", "1",
                                 "--speculation", "ngram", "--threads", "1", "--json", "--no-progress",
                                 "--telemetry", db])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    tel = rep["telemetry"]
    assert tel["telemetry_rows_dropped"] == 0 and tel["telemetry_rows_written"] > 0
    store = Store(db)
    rows = store.query("SELECT source, run_id, method, COUNT(*), SUM(generated_tokens), SUM(total_drafted) "
                       "FROM speculation_sessions GROUP BY source, run_id, method ORDER BY method")
    by_method = {m: (src, run, n, gen, drafted) for src, run, m, n, gen, drafted in rows}
    assert set(by_method) == {"none", "ngram"}
    assert all(v[0] == "bench" and v[1] == tel["run_id"] for v in by_method.values())
    ngram = next(x for x in rep["rows"] if x["method"] == "ngram")["groups"]["overall"]
    assert by_method["ngram"][2] == ngram["turns"] and by_method["ngram"][3] == ngram["generated_tokens"]
    assert by_method["ngram"][4] == ngram["drafted"] > 0
    assert report(store, run_id=tel["run_id"])["by_method"]["ngram"]["acceptance"] > 0


def test_learned_cost_line_and_break_even():
    from specbuild.telemetry.learn import break_even, fit_cost

    assert fit_cost([(0, 10, 1.0), (4, 10, 1.4)]) == pytest.approx((1.0, 0.1))
    assert fit_cost([(3, 5, 2.0)]) is None  # one depth: no line
    assert break_even((1.0, 0.1), 8) == pytest.approx(0.1, abs=2e-3)  # g = 1 pays once (1 + a) / 1.1 > 1
    assert break_even((1.0, 1.0), 8) == 1.0  # a draft as dear as the target never pays


def test_serve_records_sessions_and_takes_content_type(bundle, tmp_path):
    """`serve --telemetry DB` over a real socket: a request's content_type reaches the store;
    a bad one is a 400 naming the field."""
    import sqlite3
    import time

    from http_client import ServerProcess, post

    db = str(tmp_path / "serve.db")
    srv = ServerProcess(bundle, str(tmp_path / "serve.log"), "--telemetry", db)
    try:
        status, _, body = post(srv.port, "/v1/completions", {"prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 12,
                                                             "ignore_eos": True, "speculation": "ngram",
                                                             "content_type": "legal"})
        assert status == 200, body
        status, _, bad = post(srv.port, "/v1/completions", {"prompt": "x", "max_tokens": 2, "content_type": "Bad!"})
        assert status == 400 and "content_type" in bad["error"]["message"], bad
        deadline, row = time.monotonic() + 30, None
        while row is None and time.monotonic() < deadline:  # the writer commits in the background
            with sqlite3.connect(db, timeout=5) as conn:
                row = conn.execute("SELECT source, content_type_source, generated_tokens FROM speculation_sessions "
                                   "WHERE content_type = 'legal' AND status = 'completed'").fetchone()
            time.sleep(0.1)
        assert row == ("serve", "request", 12)
    finally:
        srv.stop()
