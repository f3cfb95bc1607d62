"""Python's garbage collector in a service: every collection's pause in ``/metrics``, a log line for a long one, and
the heap that start-up built frozen out of later collections.

A collection of the oldest generation scans every tracked object the process holds, and the event loop (or the
engine thread) stands still meanwhile: in a gateway that allocates for hundreds of requests a second, such pauses
are a latency outlier that no span shows (the request waits before its handler runs). ``gc.freeze()`` once a
service is ready moves the objects of start-up (modules, the model's Python objects, the servers) to a permanent
generation that collections skip, so a full collection scans only what serving allocated since (vLLM's API
server freezes its start-up heap the same way).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger(__name__)

LONG_PAUSE_S = 0.05  # a collection that stood the process still this long is logged
BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class GcTimer:
    """Times every collection through ``gc.callbacks``: ``observe(generation, seconds)``, and a log line for one of
    ``LONG_PAUSE_S`` or more."""

    def __init__(self, name: str, observe: Callable[[int, float], None]) -> None:
        self.name = name
        self._observe = observe
        self.longest = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        pause = time.perf_counter() - self._t0
        self._observe(info["generation"], pause)
        if pause >= LONG_PAUSE_S:
            self.longest = max(self.longest, pause)
            log.warning("%s: garbage collection of generation %d stood the process still %.0f ms (%d objects "
                        "collected)", self.name, info["generation"], pause * 1e3, info.get("collected", 0))

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class GcWatch(GcTimer):
    """Every collection of this process into ``tokenmill:gc_pause_seconds{generation}``."""

    def __init__(self, registry: CollectorRegistry, name: str) -> None:
        self.pauses = Histogram("tokenmill:gc_pause_seconds", "Garbage collection pauses, by generation collected",
                                ["generation"], registry=registry, buckets=BUCKETS)
        super().__init__(name, lambda generation, pause: self.pauses.labels(str(generation)).observe(pause))


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive now out of later collections; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
