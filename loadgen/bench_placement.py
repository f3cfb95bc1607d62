"""What a placement costs: the gateway's two ways to ask the router, timed against a real router.

Every request the gateway serves is placed by a router before its prompt can start, so a placement's round trip is
in every request's time to first token. This starts the real router (``tokenmill serve router``, a process of its
own) with one decode worker registered, and asks it for ``--requests`` placements of a ``--prompt``-token prompt,
the way the gateway does (``services/gateway/place_stream.py``):

- ``Place``: a unary call per placement (``gateway.place_stream: false``);
- ``PlaceStream``: a message each way on one open call (the default).

Each way is timed one placement at a time, after a ``--gap`` of idle (the event loops asleep, as between a
lightly loaded cluster's requests) and back to back, then ``--requests`` at once (a busy gateway), where the
router process's CPU per placement is read from ``/proc`` (Linux). Rounds alternate the two ways. Last, the
placement itself (``RouterService.place``, in this process): how much of the router's CPU is not the call's.

    python -m loadgen.bench_placement [--requests 2000] [--rounds 3]

A measurement, not a test: it asserts only that every placement was answered with the registered worker.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import grpc
from tokenmill.v1 import common_pb2, router_pb2, router_pb2_grpc

from common.cluster_config import ClusterConfig
from loadgen.proc_cpu import process_table
from services.gateway.place_stream import PlaceStreams
from services.gateway.pools import ChannelPool
from services.router.placement import LoadReport, Role
from services.router.server import RouterService

HOST = "127.0.0.1"
WORKER = "decode-bench"


def _cpu(pid: int) -> float:
    return process_table().get(pid, (0, 0.0))[1]


async def _ready(addr: str, timeout: float = 60.0) -> None:
    """Wait until the router answers."""
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        while True:
            try:
                await stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=1)
                return
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)


async def _measure(addr: str, pid: int, a: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    async with grpc.aio.insecure_channel(addr) as ch:
        report = router_pb2_grpc.RouterStub(ch).Report()
        load = router_pb2.WorkerLoad(worker_id=WORKER, address=f"{HOST}:1", model_id="m", block_size=16,
                                     role=router_pb2.WORKER_ROLE_DECODE, free_blocks=10**6, total_blocks=10**6)

        async def reporting() -> None:  # as a worker does: a silent one is forgotten
            while True:
                await report.write(load)
                await asyncio.sleep(0.25)

        reporter = asyncio.get_running_loop().create_task(reporting())
        pool = ChannelPool([addr], router_pb2_grpc.RouterStub, 256)  # the gateway's max_inflight_per_channel
        streams = PlaceStreams(pool)
        seq = iter(range(10**9))

        def req() -> router_pb2.PlaceRequest:
            return router_pb2.PlaceRequest(meta=common_pb2.RequestMeta(request_id=f"b{next(seq)}"),
                                           prompt_token_ids=list(range(1, a.prompt + 1)), max_tokens=16)

        async def unary() -> router_pb2.Placement:
            return await pool.call(lambda stub: stub.Place(req()), "router")

        async def stream() -> router_pb2.Placement:
            return await streams.place(req(), None)

        ways: dict[str, Callable[[], Awaitable[router_pb2.Placement]]] = {"Place": unary, "PlaceStream": stream}
        await asyncio.sleep(0.1)
        for _ in range(50):  # the worker registered, both ways warm
            for fn in ways.values():
                assert (await fn()).decode.worker_id == WORKER
        out: dict[str, dict[str, list[float]]] = {w: {"idle": [], "busy": [], "cpu_us": [], "rate": []} for w in ways}
        for rnd in range(a.rounds):
            for name, fn in ways.items():
                for i in range(a.requests // 4):
                    if i % 2:
                        await asyncio.sleep(a.gap)
                    t = time.perf_counter()
                    p = await fn()
                    (out[name]["idle"] if i % 2 else out[name]["busy"]).append((time.perf_counter() - t) * 1e3)
                    assert p.decode.worker_id == WORKER
                cpu0, t0 = _cpu(pid), time.perf_counter()
                got = await asyncio.gather(*(fn() for _ in range(a.requests)))
                wall, cpu = time.perf_counter() - t0, _cpu(pid) - cpu0
                assert all(p.decode.worker_id == WORKER for p in got)
                out[name]["cpu_us"].append(cpu / a.requests * 1e6)
                out[name]["rate"].append(a.requests / wall)
                print(f"round {rnd + 1}/{a.rounds} {name}: {a.requests} placements, {a.requests / wall:,.0f}/s, "
                      f"router CPU {cpu / a.requests * 1e6:.0f} µs each", flush=True)
        reporter.cancel()
        await streams.close()
        await pool.close()
        report.cancel()
    return out


def placement_cpu_us(prompt: int, n: int = 2000) -> float:
    """The router's own work a placement (``RouterService.place`` on a message's prompt, one decode worker
    registered), in this process: µs, the median of 5 runs of ``n``."""
    app = RouterService(ClusterConfig().service("router", 0))
    load = LoadReport(worker_id=WORKER, address=f"{HOST}:1", role=Role.DECODE, model_id="m", block_size=16,
                      free_blocks=10**6, total_blocks=10**6)
    req = router_pb2.PlaceRequest(meta=common_pb2.RequestMeta(request_id="b"),
                                  prompt_token_ids=list(range(1, prompt + 1)), max_tokens=16)
    runs = []
    for _ in range(5):
        app.report(load, WORKER)  # a report resets the placements counted since the last one
        t = time.perf_counter()
        for _ in range(n):
            assert app.place(req).decode.worker_id == WORKER
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def _pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000, help="placements a round at concurrency (default 2000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the two ways alternating (default 3)")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens a placement carries (default 1024)")
    p.add_argument("--gap", type=float, default=0.005, help="idle seconds before each timed placement (0.005)")
    p.add_argument("--port", type=int, default=24990, help="the router's port (loopback)")
    a = p.parse_args(argv)
    addr = f"{HOST}:{a.port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "router", "--host", HOST, "--port",
                             str(a.port), "--metrics-port", "0"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        asyncio.run(_ready(addr))
        out = asyncio.run(_measure(addr, proc.pid, a))
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"\none placement at a time ({a.prompt}-token prompts), ms; then {a.requests} in flight:\n")
    print("| way | after idle p50 / p90 | back to back p50 / p90 | in flight: placements/s | router CPU µs each |")
    print("|---|---|---|---:|---:|")
    for name, o in out.items():
        print(f"| {name} | {_pct(o['idle'], .5):.3f} / {_pct(o['idle'], .9):.3f} | {_pct(o['busy'], .5):.3f} / "
              f"{_pct(o['busy'], .9):.3f} | {statistics.median(o['rate']):,.0f} | {statistics.median(o['cpu_us']):.0f} |")
    print(f"\nof which the placement itself (RouterService.place, in process): {placement_cpu_us(a.prompt):.0f} µs")


if __name__ == "__main__":
    main()
