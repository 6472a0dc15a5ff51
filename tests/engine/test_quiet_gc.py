"""engine/base.quiet_gc: a serving process's loaded objects are frozen out of the collector's
walks and young collections come less often; SPECBUILD_GC=default leaves Python's settings."""

from __future__ import annotations

import gc

from specbuild.engine.base import GC_GEN0, quiet_gc


def test_quiet_gc_freezes_the_loaded_objects_and_spaces_young_collections(monkeypatch):
    before = gc.get_threshold()
    monkeypatch.delenv("SPECBUILD_GC", raising=False)
    try:
        held = [[i] for i in range(1000)]  # live, tracked objects: what a loaded engine holds
        assert quiet_gc() is True
        assert gc.get_freeze_count() >= len(held) and gc.get_threshold()[0] == max(before[0], GC_GEN0)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_specbuild_gc_default_leaves_the_collector_alone(monkeypatch):
    before = gc.get_threshold()
    monkeypatch.setenv("SPECBUILD_GC", "default")
    frozen = gc.get_freeze_count()
    assert quiet_gc() is False
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
