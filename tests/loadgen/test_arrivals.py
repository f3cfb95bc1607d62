"""The arrival process has the asked rate and variance (statistically), and is reproducible."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.arrivals import arrival_times

N = 20_000


def _gaps(rate: float, burstiness: float, seed: int = 1) -> np.ndarray:
    t = np.asarray(arrival_times(rate, burstiness, seed, count=N + 1))
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    return np.diff(t)


def test_poisson_has_the_rate_the_variance_and_the_exponential_law():
    rate = 20.0
    g = _gaps(rate, 1.0)
    # mean gap 1/rate: the standard error of the mean is (1/rate)/sqrt(N) = 0.7 %; allow 4 of them
    assert abs(g.mean() * rate - 1) < 4 / math.sqrt(N)
    # variance 1/rate² (squared coefficient of variation 1); its relative standard error is sqrt(8/N) = 2 %
    assert abs(g.var() * rate**2 - 1) < 4 * math.sqrt(8 / N)
    # Kolmogorov–Smirnov against Exp(rate): D below the 1 % critical value 1.63/sqrt(N)
    x = np.sort(g)
    cdf = 1 - np.exp(-rate * x)
    d = max(np.max(np.arange(1, N + 1) / N - cdf), np.max(cdf - np.arange(N) / N))
    assert d < 1.63 / math.sqrt(N)
    # counts per 1 s window: Poisson, so their variance equals their mean (index of dispersion 1)
    t = np.cumsum(g)
    counts = np.bincount(t.astype(int))[:-1]
    assert abs(counts.mean() / rate - 1) < 0.03
    assert 0.85 < counts.var() / counts.mean() < 1.15


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_the_rate_and_sets_the_variance(burstiness):
    rate = 5.0
    g = _gaps(rate, burstiness, seed=2)
    assert abs(g.mean() * rate - 1) < 4 * math.sqrt(1 / burstiness / N)
    cv2 = g.var() * rate**2  # gamma(shape k): CV² = 1/k
    # relative standard error of a sample variance: sqrt((excess kurtosis 6/k + 2) / N)
    assert abs(cv2 * burstiness - 1) < 4 * math.sqrt((6 / burstiness + 2) / N)


def test_duration_mode_fills_the_window_at_the_rate():
    rate, dur = 50.0, 200.0
    t = arrival_times(rate, 1.0, 3, duration=dur)
    assert t[0] == 0 and t[-1] < dur
    assert abs(len(t) - rate * dur) < 4 * math.sqrt(rate * dur)


def test_same_seed_same_times_and_infinite_rate_sends_at_once():
    assert arrival_times(3.0, 0.5, 7, count=50) == arrival_times(3.0, 0.5, 7, count=50)
    assert arrival_times(3.0, 0.5, 7, count=50) != arrival_times(3.0, 0.5, 8, count=50)
    assert arrival_times(3.0, 1.0, 7, count=30)[:10] == arrival_times(3.0, 1.0, 7, count=10)  # a prefix
    assert arrival_times(math.inf, 1.0, 0, count=5) == [0.0] * 5
    for bad in ({"rate": 0.0}, {"burstiness": -1.0}):
        with pytest.raises(ValueError, match="must be > 0"):
            arrival_times(bad.get("rate", 1.0), bad.get("burstiness", 1.0), 0, count=3)
    with pytest.raises(ValueError, match="not both"):
        arrival_times(1.0, 1.0, 0, count=3, duration=1.0)
    with pytest.raises(ValueError, match="finite request rate"):
        arrival_times(math.inf, 1.0, 0, duration=1.0)
