"""One benchmark run: send a request stream to a target on an open-loop schedule and/or under a concurrency cap,
and collect one record per request.

- Open loop: request ``i`` is due at ``arrivals[i]`` seconds after the start; with a concurrency cap it also waits
  for a free slot (as ``vllm bench serve --request-rate R --max-concurrency C`` does).
- Closed loop: an infinite rate and a cap ``C``: exactly ``C`` requests in flight until the count or the duration
  is reached (no new request starts after the duration; those in flight finish).
- Warm-up: ``num_warmups`` requests (from their own seed) run to completion before the clock starts, and requests
  due in the first ``warmup_s`` seconds are sent but marked ``warmup`` and left out of the summary.
- Several client processes (``run_load_processes``): one Python process reading ~10,000 token messages a second
  spends a whole core on them, and its own delays then show in TTFT and throughput as if they were the server's.
  The requests are dealt out to N processes, each with 1/N of the rate and of the concurrency cap, on one clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import multiprocessing
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

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
                   into: list[RequestRecord] | None = None, t0: float | None = None) -> list[RequestRecord]:
    """Drive ``target`` with the measured load; return the records in send order (those due inside
    ``warmup_s`` flagged ``warmup``), appended to ``into`` as they are sent when given: if the run is cancelled
    (Ctrl-C), the requests in flight are cancelled (outcome ``cancelled``) and ``into`` holds what was sent.
    ``t0``: the run's start on ``time.perf_counter`` (default: now), shared by the processes of one run."""
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
            # behind schedule, still yield: the sends already made must run (a loop that only dispatched would
            # pile up requests it never sends)
            await asyncio.sleep(max(0.0, delay))
            if sem is not None:
                await sem.acquire()
            rec = _record(spec, due, due < load.warmup_s)
            records.append(rec)
            tasks.append(asyncio.create_task(one(spec, rec, t0)))

    try:
        await dispatch(time.perf_counter() if t0 is None else t0)
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return records


def split_load(load: LoadConfig, counts: list[int]) -> list[LoadConfig]:
    """One process's share of ``load`` for each of ``counts`` (its requests): 1/N of the rate and of the cap."""
    n = len(counts)
    cap = load.max_concurrency
    if cap is not None and cap < n:
        raise ValueError(f"{n} client processes need a concurrency cap of at least {n}; got {cap}")
    return [dataclasses.replace(load, request_rate=load.request_rate / n, num_requests=k, num_warmups=0,
                                max_concurrency=None if cap is None else cap // n + (i < cap % n),
                                seed=load.seed + 7919 * i)
            for i, k in enumerate(counts)]


def _client_process(conn: Connection, target: Target, specs: list[RequestSpec], load: LoadConfig) -> None:
    """One client process: open, say ready, wait for the run's start, run, send the records and CPU seconds."""
    async def main() -> None:
        await target.open()
        try:
            conn.send("ready")
            t0 = conn.recv()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            recs = await run_load(target, iter(specs), load, lambda r: conn.send(("done", r.ok)), t0=t0)
            conn.send(("records", recs, time.process_time() - cpu0, time.perf_counter() - wall0))
        finally:
            await target.close()

    asyncio.run(main())


async def run_load_processes(target: Target, specs: list[RequestSpec], load: LoadConfig, processes: int,
                             on_done: Callable[[bool], None] | None = None,
                             on_ready: Callable[[], Awaitable[None]] | None = None,
                             ) -> tuple[list[RequestRecord], list[tuple[float, float]]]:
    """``run_load`` from ``processes`` client processes: the requests dealt out in turn, each process with its share
    of the load (``split_load``), one start time for all. Returns the records in send order and each process's CPU
    and wall seconds over its run; ``on_done(ok)`` is called as requests end, ``on_ready`` once every process has
    started, before the clock (what measures the run starts there). Needs a request list (a count, not a
    duration)."""
    if load.duration_s is not None:
        raise ValueError("several client processes need a request count, not a duration")
    shares = [specs[i::processes] for i in range(processes)]
    loads = split_load(load, [len(s) for s in shares])
    ctx = multiprocessing.get_context("spawn")
    conns, procs = [], []
    for share, sub in zip(shares, loads):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_client_process, args=(theirs, target.clone(), share, sub), daemon=True)
        p.start()
        theirs.close()
        conns.append(mine)
        procs.append(p)
    try:
        for c in conns:
            if await asyncio.to_thread(c.recv) != "ready":
                raise RuntimeError("a client process failed to start")
        if on_ready is not None:
            await on_ready()
        t0 = time.perf_counter() + 0.05
        for c in conns:
            c.send(t0)

        async def collect(c: Connection) -> tuple[list[RequestRecord], tuple[float, float]]:
            while True:
                msg = await asyncio.to_thread(c.recv)
                if msg[0] == "done":
                    if on_done is not None:
                        on_done(msg[1])
                else:
                    return msg[1], (msg[2], msg[3])

        got = await asyncio.gather(*(collect(c) for c in conns))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    records = sorted((r for recs, _ in got for r in recs), key=lambda r: (r.start, r.index))
    return records, [times for _, times in got]
