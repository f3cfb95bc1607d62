"""One benchmark run: send a request stream to a target on an open-loop schedule and/or under a concurrency cap,
and collect one record per request.

- Open loop: request ``i`` is due at ``arrivals[i]`` seconds after the start; with a concurrency cap it also waits
  for a free slot (as ``vllm bench serve --request-rate R --max-concurrency C`` does).
- Closed loop: an infinite rate and a cap ``C``: exactly ``C`` requests in flight until the count or the duration
  is reached (no new request starts after the duration; those in flight finish).
- Warm-up: ``num_warmups`` requests (from their own seed) run to completion before the clock starts, and requests
  due in the first ``warmup_s`` seconds are sent but marked ``warmup`` and left out of the summary.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from loadgen.arrivals import arrival_times
from loadgen.clients import Target
from loadgen.metrics import RequestRecord
from loadgen.workloads import RequestSpec


@dataclass(frozen=True)
class LoadConfig:
    """The offered load of one run."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_requests: int | None = 100
    duration_s: float | None = None
    warmup_s: float = 0.0
    num_warmups: int = 0
    seed: int = 0

    @property
    def label(self) -> str:
        parts = []
        if not math.isinf(self.request_rate):
            parts.append(f"{self.request_rate:g} req/s" + (f" (burstiness {self.burstiness:g})"
                                                           if self.burstiness != 1 else ""))
        if self.max_concurrency:
            parts.append(f"concurrency {self.max_concurrency}")
        return ", ".join(parts) or "all at once"


def _record(spec: RequestSpec, scheduled: float, warmup: bool) -> RequestRecord:
    return RequestRecord(index=spec.index, input_len=spec.input_len, output_len=spec.output_len, scheduled=scheduled,
                         tenant=spec.tenant.name if spec.tenant else None,
                         priority=spec.tenant.priority if spec.tenant else None, group=spec.group, warmup=warmup)


async def run_warmups(target: Target, warmups: Iterator[RequestSpec], load: LoadConfig) -> list[RequestRecord]:
    """Send ``load.num_warmups`` requests (at most ``max_concurrency`` at a time) and wait for them all: the
    connections, the server's first-request costs and its compilation happen before the clock starts."""
    specs = [next(warmups) for _ in range(load.num_warmups)]
    recs = [_record(s, 0.0, True) for s in specs]
    sem = asyncio.Semaphore(load.max_concurrency or max(1, len(specs)))
    t0 = time.perf_counter()

    async def warm(spec: RequestSpec, rec: RequestRecord) -> None:
        async with sem:
            await target.send(spec, rec, t0)

    await asyncio.gather(*(warm(s, r) for s, r in zip(specs, recs)))
    return recs


async def run_load(target: Target, requests: Iterator[RequestSpec], load: LoadConfig,
                   on_done: Callable[[RequestRecord], None] | None = None,
                   into: list[RequestRecord] | None = None) -> list[RequestRecord]:
    """Drive ``target`` with the measured load; return the records in send order (those due inside
    ``warmup_s`` flagged ``warmup``), appended to ``into`` as they are sent when given: if the run is cancelled
    (Ctrl-C), the requests in flight are cancelled (outcome ``cancelled``) and ``into`` holds what was sent."""
    if (load.num_requests is None) == (load.duration_s is None):
        raise ValueError("give a request count or a duration")
    closed = math.isinf(load.request_rate)
    if closed and load.duration_s is not None and not load.max_concurrency:
        raise ValueError("a duration with an infinite request rate needs --max-concurrency (closed loop)")
    records: list[RequestRecord] = [] if into is None else into

    tasks: list[asyncio.Task[None]] = []
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

    async def one(spec: RequestSpec, rec: RequestRecord, t0: float) -> None:
        try:
            await target.send(spec, rec, t0)
        finally:
            if sem is not None:
                sem.release()
            if on_done is not None:
                on_done(rec)

    async def dispatch(t0: float) -> None:
        if closed and load.duration_s is not None:
            assert sem is not None
            while time.perf_counter() - t0 < load.duration_s:
                await sem.acquire()
                now = time.perf_counter() - t0  # read once: the request's time is the one checked
                if now >= load.duration_s:
                    sem.release()
                    break
                spec = next(requests)
                rec = _record(spec, now, False)
                records.append(rec)
                tasks.append(asyncio.create_task(one(spec, rec, t0)))
            return
        times = arrival_times(load.request_rate, load.burstiness, load.seed, count=load.num_requests,
                              duration=load.duration_s)
        for due in times:
            spec = next(requests)
            delay = due - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                await sem.acquire()
            rec = _record(spec, due, due < load.warmup_s)
            records.append(rec)
            tasks.append(asyncio.create_task(one(spec, rec, t0)))

    try:
        await dispatch(time.perf_counter())
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return records
