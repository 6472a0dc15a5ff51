"""The cost cache: entries record when and under what load they were measured; timings that
are old, measured on a busy machine that is now quiet, or contradicted by a live check are
measured again; facts (timing=False) are kept whatever the load."""

from __future__ import annotations

import json

import pytest

from specbuild.model import costcache
from specbuild.model.costcache import cached_costs, stale_reason


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPECBUILD_COST_CACHE", raising=False)
    monkeypatch.delenv("SPECBUILD_COST_MAX_AGE_S", raising=False)
    return tmp_path


def set_load(monkeypatch, load1: float, cpus: int = 2):
    monkeypatch.setattr(costcache, "load_now", lambda: {"load1": load1, "cpus": cpus})


def counting(value):
    calls = []
    return calls, lambda: calls.append(1) or {"ms": value + len(calls)}


def test_entries_record_time_and_load(cache, monkeypatch):
    set_load(monkeypatch, 0.3)
    calls, measure = counting(1)
    assert cached_costs({"k": 1}, measure, timing=True) == ({"ms": 2}, False)
    entry = json.loads(next(cache.glob("costs-*.json")).read_text())
    assert entry["measured"]["load1"] == 0.3 and entry["measured"]["cpus"] == 2 and entry["measured"]["time"] > 0
    assert cached_costs({"k": 1}, measure, timing=True) == ({"ms": 2}, True) and len(calls) == 1


def test_a_timing_measured_under_load_is_measured_again_once_the_machine_is_quiet(cache, monkeypatch):
    calls, measure = counting(10)
    set_load(monkeypatch, 6.0)  # 3 runnable tasks per CPU
    cached_costs({"k": 2}, measure, timing=True)
    set_load(monkeypatch, 5.0)  # still busy: a new measurement would be no better
    assert cached_costs({"k": 2}, measure, timing=True)[1] and len(calls) == 1
    set_load(monkeypatch, 0.5)
    costs, cached = cached_costs({"k": 2}, measure, timing=True)
    assert not cached and len(calls) == 2 and costs == {"ms": 12}
    assert cached_costs({"k": 2}, measure, timing=True) == ({"ms": 12}, True)  # the quiet one stands
    # a fact (row classes, say) is not a timing: kept whatever the load it was found at
    set_load(monkeypatch, 9.0)
    cached_costs({"k": 3}, measure)
    set_load(monkeypatch, 0.1)
    assert cached_costs({"k": 3}, measure)[1]


def test_an_old_or_unrecorded_timing_is_measured_again(cache, monkeypatch):
    set_load(monkeypatch, 0.2)
    calls, measure = counting(0)
    cached_costs({"k": 4}, measure, timing=True)
    path = next(cache.glob("costs-*.json"))
    entry = json.loads(path.read_text())
    entry["measured"]["time"] -= 8 * 24 * 3600
    path.write_text(json.dumps(entry))
    assert not cached_costs({"k": 4}, measure, timing=True)[1] and len(calls) == 2
    del entry["measured"]  # written before entries recorded it
    path.write_text(json.dumps(entry))
    assert not cached_costs({"k": 4}, measure, timing=True)[1] and len(calls) == 3
    monkeypatch.setenv("SPECBUILD_COST_MAX_AGE_S", "0.000001")
    assert not cached_costs({"k": 4}, measure, timing=True)[1] and len(calls) == 4


def test_a_live_check_can_reject_a_cached_timing(cache, monkeypatch):
    set_load(monkeypatch, 0.2)
    calls, measure = counting(100)
    cached_costs({"k": 5}, measure, timing=True)
    seen = []
    assert cached_costs({"k": 5}, measure, timing=True, check=lambda c: seen.append(c) and None)[1]
    assert seen == [{"ms": 101}]
    costs, cached = cached_costs({"k": 5}, measure, timing=True, check=lambda c: "live 20 ms, cached 101 ms")
    assert not cached and costs == {"ms": 102} and len(calls) == 2


def test_stale_reason_names_the_figures():
    load = {"load1": 0.4, "cpus": 2}
    assert stale_reason({"measured": {"time": 100.0, "load1": 7.5, "cpus": 2}}, 160.0, load, 3600) == \
        "measured at load 7.5 on 2 CPUs, now 0.4"
    assert stale_reason({"measured": {"time": 100.0, "load1": 0.5, "cpus": 2}}, 160.0, load, 3600) is None
    assert "h ago" in stale_reason({"measured": {"time": 0.0, "load1": 0.5}}, 7200.0, load, 3600)
