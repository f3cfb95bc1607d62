"""Arrival processes: when each request is sent, as offsets in seconds from the start of a run.

Open loop: inter-arrival gaps drawn from a gamma law with shape ``burstiness`` and mean ``1 / rate`` (burstiness 1 is
Poisson; below 1 burstier, above 1 more regular: the gap variance is ``1 / (rate² · burstiness)``), as
``vllm bench serve`` does. An infinite rate sends everything at once. Closed loop (a concurrency cap) is not an
arrival process: the runner holds a semaphore, and with an infinite rate it keeps exactly that many in flight.
"""

from __future__ import annotations

import math

import numpy as np


def inter_arrivals(rate: float, burstiness: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` gaps in seconds; zeros for an infinite rate."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(rate: float, burstiness: float, seed: int, count: int | None = None,
                  duration: float | None = None) -> list[float]:
    """Send offsets (seconds): ``count`` of them, or as many as fall inside ``duration``. The first request goes at
    0 (a run starts with a request, not with an idle gap). Same arguments, same list."""
    if (count is None) == (duration is None):
        raise ValueError("give a request count or a duration, not both")
    rng = np.random.default_rng([seed, 0xA771])  # its own stream: the workload's draws do not shift it
    if count is not None:
        gaps = inter_arrivals(rate, burstiness, count, rng)
        gaps[0] = 0.0
        return np.cumsum(gaps).tolist()
    assert duration is not None
    if math.isinf(rate):
        raise ValueError("a duration needs a finite request rate or a concurrency (closed loop)")
    out: list[float] = []
    t = 0.0
    while t < duration:
        out.append(t)
        t += float(inter_arrivals(rate, burstiness, 1, rng)[0])
    return out
