"""Client-side serving metrics: one record per request, and the summary people compare.

Definitions (as ``vllm bench serve`` uses them, so the two can be cross-checked):

- TTFT: send → the first chunk that carries output (text or token ids).
- ITL: the gaps between consecutive output-carrying chunks (a chunk that carries several tokens is one gap).
- TPOT: (e2e − TTFT) / (output tokens − 1); 0 for a one-token answer (it then meets any TPOT SLO).
- e2e: send → the last output-carrying chunk.
- Output tokens: the server's usage count when it sends one, else the token ids (gRPC) or chunks counted.
- Duration: the first send → the last request's end, over the measured requests (warm-up excluded).
- Throughput: completed requests (and their tokens) / duration. Goodput: requests meeting every SLO bound / duration;
  attainment: those requests / all measured requests (errors count as misses).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

OK = "ok"
CANCELLED = "cancelled"


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request. Times are seconds; ``start`` is from the start of the run, chunk times are
    from ``start``. ``outcome`` is ``ok``, ``cancelled`` or ``error`` (then ``error_kind`` says which)."""

    index: int
    input_len: int  # what the workload asked for
    output_len: int  # max_tokens asked for
    scheduled: float = 0.0  # planned send offset (open loop)
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end: float | None = None  # end of the stream, from start
    outcome: str = OK
    error_kind: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None  # the server's usage
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    tenant: str | None = None
    priority: int | None = None
    group: int | None = None
    warmup: bool = False
    request_id: str | None = None  # sent with the request (gRPC): the id of its trace's root span too
    start_wall_ns: int | None = None  # ``start`` on the wall clock (time.time_ns), to line up with server spans
    text: str | None = None  # the output text, kept for a request with an output constraint
    structured_valid: bool | None = None  # that text is what the constraint asked for (None: no constraint)

    @property
    def ok(self) -> bool:
        return self.outcome == OK and bool(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def e2e(self) -> float | None:
        return self.chunk_times[-1] if self.chunk_times else None

    @property
    def output_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return sum(self.chunk_tokens)

    @property
    def tpot(self) -> float | None:
        if not self.chunk_times:
            return None
        n = self.output_tokens
        return (self.chunk_times[-1] - self.chunk_times[0]) / (n - 1) if n > 1 else 0.0

    @property
    def finished_at(self) -> float:
        """Run time at which the request ended (its last chunk, else its stream end, else its start)."""
        if self.chunk_times:
            return self.start + self.chunk_times[-1]
        return self.start + (self.end or 0.0)

    def to_json(self) -> dict[str, Any]:
        """The record with its derived figures; times rounded to the microsecond. ITLs are the differences of
        ``chunk_times`` (not stored twice: a long run has millions)."""
        d = asdict(self)
        d.update(ttft=self.ttft, e2e=self.e2e, tpot=self.tpot, output_tokens=self.output_tokens)
        for k in ("scheduled", "start", "end", "ttft", "e2e", "tpot"):
            if d[k] is not None:
                d[k] = round(d[k], 6)
        d["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        return d


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objective bounds in milliseconds; None = no bound."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, items: Sequence[str] | str | None) -> Slo | None:
        """``["ttft:500", "tpot:50"]`` or ``"ttft:500 tpot:50 e2e:10000"`` → Slo."""
        if not items:
            return None
        if isinstance(items, str):
            items = items.split()
        got: dict[str, float] = {}
        for it in items:
            for part in it.replace(",", " ").split():
                k, sep, v = part.partition(":")
                key = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "e2el": "e2e_ms"}.get(k.lower())
                if not sep or key is None:
                    raise ValueError(f"SLO item {part!r}: use ttft:MS, tpot:MS or e2e:MS")
                val = float(v)
                if not val > 0:
                    raise ValueError(f"SLO item {part!r}: the bound must be > 0 ms")
                got[key] = val
        return cls(**got)

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft_ms, r.ttft), (self.tpot_ms, r.tpot), (self.e2e_ms, r.e2e))
        return all(v is not None and v * 1000 <= bound for bound, v in checks if bound is not None)

    def __str__(self) -> str:
        parts = [f"{k}:{v:g}" for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2e", self.e2e_ms))
                 if v is not None]
        return " ".join(parts)


def stats(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, p50, p90, p99, min, max (linear-interpolated percentiles, numpy's default), times ``scale``."""
    if not values:
        return dict.fromkeys(("mean", "p50", "p90", "p99", "min", "max"))
    a = np.asarray(values, dtype=float) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "min": float(a.min()), "max": float(a.max())}


def ratio_interval(before: Sequence[float], after: Sequence[float], q: float, level: float = 0.9,
                   resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """How far the ratio of ``after``'s ``q`` percentile to ``before``'s can move from sampling alone: the central
    ``level`` interval of that ratio over bootstrap resamples of each side (percentile bootstrap). A p99 of a few
    hundred requests is their second- or third-worst, and the interval says when such a ratio cannot tell a target
    of +10% or +20% apart. It covers sampling only: runs on a shared machine differ by its state too."""
    a, b = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    if not a.size or not b.size:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    qa = np.percentile(a[rng.integers(0, a.size, (resamples, a.size))], q, axis=1)
    qb = np.percentile(b[rng.integers(0, b.size, (resamples, b.size))], q, axis=1)
    lo, hi = np.percentile(qb / qa, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def summarize(records: Sequence[RequestRecord], slo: Slo | None = None) -> dict[str, Any]:
    """The summary of the measured (non-warm-up) records. Latencies in ms."""
    rs = [r for r in records if not r.warmup]
    done = [r for r in rs if r.ok]
    errors = Counter(r.error_kind or r.outcome for r in rs if not r.ok)
    if rs:
        t0 = min(r.start for r in rs)
        duration = max(r.finished_at for r in rs) - t0
    else:
        duration = 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in done)
    s: dict[str, Any] = {
        "requests": len(rs), "completed": len(done), "failed": len(rs) - len(done),
        "errors": dict(errors.most_common()),
        "duration_s": duration,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + in_tokens),
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "output_len_mismatch": sum(r.output_tokens != r.output_len for r in done),
        "ttft_ms": stats([r.ttft for r in done if r.ttft is not None], 1000),
        "tpot_ms": stats([r.tpot for r in done if r.tpot is not None and r.output_tokens > 1], 1000),
        "itl_ms": stats([x for r in done for x in r.itls], 1000),
        "e2e_ms": stats([r.e2e for r in done if r.e2e is not None], 1000),
    }
    checked = [r for r in done if r.structured_valid is not None]
    if checked:
        valid = sum(bool(r.structured_valid) for r in checked)
        s["structured"] = {"requests": len(checked), "valid": valid, "valid_rate": valid / len(checked)}
    if slo is not None:
        good = sum(slo.met(r) for r in rs)
        s["slo"] = str(slo)
        s["goodput"] = per_s(good)
        s["slo_attainment"] = good / len(rs) if rs else math.nan
    return s
