"""A service's garbage collections in /metrics and its log (common/gc_watch.py), and the start-up heap frozen."""

from __future__ import annotations

import gc
import logging

from prometheus_client import CollectorRegistry

from common import gc_watch


def _count(reg: CollectorRegistry, generation: str) -> float:
    return reg.get_sample_value("tokenmill:gc_pause_seconds_count", {"generation": generation}) or 0.0


def test_every_collection_is_timed_and_a_long_one_logged(monkeypatch, caplog):
    reg = CollectorRegistry()
    w = gc_watch.GcWatch(reg, "svc-0")
    try:
        before = _count(reg, "2")
        gc.collect()
        assert _count(reg, "2") == before + 1
        assert reg.get_sample_value("tokenmill:gc_pause_seconds_sum", {"generation": "2"}) > 0
        monkeypatch.setattr(gc_watch, "LONG_PAUSE_S", 0.0)  # every pause counts as long
        with caplog.at_level(logging.WARNING, logger="common.gc_watch"):
            gc.collect(1)
        assert any("svc-0: garbage collection of generation 1 stood the process still" in r.getMessage()
                   for r in caplog.records), caplog.text
        assert w.longest > 0
    finally:
        w.close()
    n = _count(reg, "2")
    gc.collect()
    assert _count(reg, "2") == n  # closed: no longer called


def test_the_start_up_heap_is_frozen_out_of_later_collections():
    before = gc.get_freeze_count()
    try:
        frozen = gc_watch.freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > before + 1000  # this process's modules and objects, at least
        assert sum(gc.get_count()) < 100  # the generations start empty
    finally:
        gc.unfreeze()
