"""What a refused request costs the gateway: CPU µs per request refused at the door, over gRPC ``Generate`` and
HTTP ``/v1/completions``, by a tenant's in-flight cap (``max_inflight``) and by its requests quota (``rpm``).

A flooding tenant at its cap retries at once after each refusal (``bench_tenants``: hundreds a second), and the
CPU the gateway spends refusing delays the other tenants' requests in the same process. This starts a real gateway
(``GatewayService``, its gRPC server and HTTP API, tracing set up as a service sets it up) in a process of its
own, with no tokenizer, router or worker behind it: every request sent is refused before any of them is needed.
Tenant ``capped`` holds its one in-flight slot (taken in the server process); tenant ``quota`` has spent its bucket
(1 request a minute). The client sends ``--requests`` of each kind, ``--concurrency`` at a time, and reads the
server process's CPU time (every thread: gRPC's own too) around each batch. Beside the gateway, in the same process
and run, a bare gRPC server whose ``Generate`` refuses at once with the same status (``grpc floor``): what
grpc-aio costs a call before any of our code, the limit a refusal cannot go below.

    python -m loadgen.bench_refusals [--shared] [--audit] [--profile N]

``--shared``: the counts and buckets in a host's shared file (``tokenmill up`` with several gateways);
``--audit``: with ``gateway.audit_log``; ``--profile N``: the server's N hottest functions (cProfile, cumulative)
for each kind. A measurement, not a test: it asserts only that every request was refused as expected.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import io
import multiprocessing as mp
import pstats
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from tokenmill.v1 import frontend_pb2, frontend_pb2_grpc

from loadgen.bench_gpu_serving import free_base_port

KEYS = {"capped": "sk-capped", "quota": "sk-quota"}
HOST = "127.0.0.1"


def _config(work: Path, shared: bool, audit: bool) -> dict[str, Any]:
    def sha(k: str) -> list[str]:
        return [hashlib.sha256(k.encode()).hexdigest()]

    o: dict[str, Any] = {
        # capped as bench_tenants' flood is: a requests quota (its x-ratelimit-* headers) and an in-flight cap
        "tenants": {"capped": {"keys_sha256": sha(KEYS["capped"]), "max_inflight": 1, "rpm": 480, "rpm_burst": 8},
                    "quota": {"keys_sha256": sha(KEYS["quota"]), "rpm": 1, "rpm_burst": 1}},
        "base_port": free_base_port()}
    if shared:
        o["gateway.count"] = 2
        o["gateway.shared_limits_file"] = str(work / "limits")
    if audit:
        o["gateway.audit_log"] = str(work / "audit.jsonl")
    return o


def _stop_profile(prof: cProfile.Profile, done: threading.Event) -> None:
    prof.disable()
    done.set()


async def _thread_time() -> float:
    return time.thread_time()


def _serve(conn: Connection, overrides: dict[str, Any]) -> None:
    """The server process: a gateway with both tenants at their limits; answers ``cpu``, ``profile N``, ``stop``."""
    from common import rpc, telemetry
    from common.cluster_config import load_cluster_config
    from services.gateway.host_limits import HostLimits
    from services.gateway.server import GatewayService

    async def main() -> None:
        cfg = load_cluster_config(overrides=overrides, env={})
        telemetry.setup_tracing("tokenmill-gateway")  # what serve_until_signalled does (no exporter: no provider)
        if cfg.gateway.shared_limits_file:
            HostLimits.create(cfg.gateway.shared_limits_file, cfg)
        gw = GatewayService(cfg.service("gateway", 0))
        srv = await rpc.start_server(gw, HOST, 0, None)
        await gw.start()

        async def ready() -> tuple[bool, str]:
            return True, "ready"  # no tokenizer, router or worker here: the refusals come before them

        gw.http.ready = ready  # type: ignore[method-assign]
        # the floor: a bare gRPC server (no interceptor) whose Generate refuses at once, as the gateway does
        bare = grpc.aio.server()
        frontend_pb2_grpc.add_FrontendServicer_to_server(_Refuser(), bare)
        bare_port = bare.add_insecure_port(f"{HOST}:0")
        await bare.start()
        gw.admit_in_flight(gw.tenancy.tenants["capped"], "held", "")  # capped's one slot, held from now on
        gw.admit_request(gw.tenancy.tenants["quota"], "spent", "")  # quota's one request of the minute
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        prof: list[cProfile.Profile] = []

        def commands() -> None:
            conn.send((srv.port, gw.http.port, bare_port))
            while True:
                cmd = conn.recv()
                if cmd == "cpu":  # the process's CPU time (every thread), and the event loop's thread's
                    fut = asyncio.run_coroutine_threadsafe(_thread_time(), loop)
                    conn.send((time.process_time(), fut.result()))
                elif cmd == "profile-on":
                    prof[:] = [cProfile.Profile()]
                    loop.call_soon_threadsafe(prof[0].enable)
                    conn.send(None)
                elif isinstance(cmd, tuple) and cmd[0] == "profile-off":
                    done = threading.Event()
                    loop.call_soon_threadsafe(_stop_profile, prof[0], done)
                    done.wait()
                    out = io.StringIO()
                    pstats.Stats(prof[0], stream=out).sort_stats(cmd[2]).print_stats(cmd[1])
                    conn.send(out.getvalue())
                else:
                    loop.call_soon_threadsafe(stop.set)
                    return

        threading.Thread(target=commands, daemon=True).start()
        await stop.wait()
        await bare.stop(0.2)
        await srv.drain(0.2)
        await gw.stop()

    asyncio.run(main())


class _Refuser(frontend_pb2_grpc.FrontendServicer):
    """``Generate`` refused at once with the gateway's status: what grpc-aio costs a call before any of our code."""

    async def Generate(self, request: frontend_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details("refused")
        return
        yield  # an async generator, as the gateway's streaming method is


async def _grpc(port: int, key: str, n: int, concurrency: int) -> dict[str, int]:
    codes: dict[str, int] = {}
    async with grpc.aio.insecure_channel(f"{HOST}:{port}") as ch:
        stub = frontend_pb2_grpc.FrontendStub(ch)
        req = frontend_pb2.GenerateRequest(prompt="Hello there, a prompt of a few words")
        md = [("authorization", f"Bearer {key}")]

        async def worker(k: int) -> None:
            for _ in range(k):
                try:
                    async for _r in stub.Generate(req, metadata=md):
                        pass
                    code = "OK"
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                codes[code] = codes.get(code, 0) + 1

        await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
    return codes


async def _http(port: int, key: str, n: int, concurrency: int) -> dict[str, int]:
    codes: dict[str, int] = {}
    body = {"model": "smollm2", "prompt": "Hello there, a prompt of a few words", "max_tokens": 16}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        async def worker(k: int) -> None:
            for _ in range(k):
                async with s.post(f"http://{HOST}:{port}/v1/completions", json=body) as r:
                    await r.read()
                    codes[str(r.status)] = codes.get(str(r.status), 0) + 1

        await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
    return codes


class _Context:
    """What ``FrontendServicer.Generate`` uses of a ``grpc.aio.ServicerContext``, for ``--direct``."""

    def __init__(self, key: str) -> None:
        self.md = (("authorization", f"Bearer {key}"), ("user-agent", "grpc-python-asyncio/1.85.1"))
        self.code: Any = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.md

    def set_trailing_metadata(self, md: Any) -> None:
        self.trailing = md

    def set_code(self, code: Any) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def add_done_callback(self, cb: Any) -> None:
        pass

    async def abort(self, code: Any, details: str) -> None:
        self.code, self.details = code, details
        raise grpc.aio.AbortError("Locally aborted.")


def direct(calls: int, reps: int) -> None:
    """The gateway's own code per gRPC refusal: ``FrontendServicer.Generate`` called in this process with a stand-in
    context (no gRPC under it), the least thread CPU time of ``reps`` batches of ``calls``."""
    from common import telemetry
    from common.cluster_config import load_cluster_config
    from services.gateway.server import FrontendServicer, GatewayService

    async def run() -> None:
        telemetry.setup_tracing("tokenmill-gateway")
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_cluster_config(overrides=_config(Path(tmp), False, False), env={})
        gw = GatewayService(cfg.service("gateway", 0))
        gw.admit_in_flight(gw.tenancy.tenants["capped"], "held", "")
        gw.admit_request(gw.tenancy.tenants["quota"], "spent", "")
        servicer, req = FrontendServicer(gw), frontend_pb2.GenerateRequest(prompt="Hello there")
        for tenant in KEYS:
            async def one(key: str = KEYS[tenant]) -> _Context:
                ctx = _Context(key)
                try:
                    async for _r in servicer.Generate(req, ctx):
                        pass
                except grpc.aio.AbortError:
                    pass
                return ctx

            if (await one()).code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise SystemExit(f"{tenant}: not refused")
            best = float("inf")
            for _ in range(reps):
                t0 = time.thread_time()
                for _ in range(calls):
                    await one()
                best = min(best, (time.thread_time() - t0) / calls * 1e6)
            print(f"direct grpc {'in_flight' if tenant == 'capped' else 'rpm'}: {best:.1f} µs per refusal")

    asyncio.run(run())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4000, help="refused requests per kind (default 4000)")
    p.add_argument("--concurrency", type=int, default=16, help="default 16")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every kind; the best is printed (default 3)")
    p.add_argument("--shared", action="store_true", help="the limits in a host's shared file (2 gateways)")
    p.add_argument("--audit", action="store_true", help="with gateway.audit_log")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print the server's N hottest functions")
    p.add_argument("--profile-sort", default="tottime", help="pstats' order: tottime (default), cumulative")
    p.add_argument("--only", help="only the kinds whose name holds this (grpc, http, rpm, in_flight, floor)")
    p.add_argument("--direct", action="store_true", help="only the gateway's own code: Generate called in-process")
    a = p.parse_args(argv)
    if a.direct:
        direct(a.requests // 2, 10 * a.rounds)
        return
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, _config(Path(tmp), a.shared, a.audit)), daemon=True)
        proc.start()
        if not conn.poll(60):
            raise SystemExit("the gateway did not start (its error is above)")
        grpc_port, http_port, bare_port = conn.recv()
        kinds = {"grpc floor": (_grpc, bare_port, "capped", "RESOURCE_EXHAUSTED"),
                 "grpc in_flight": (_grpc, grpc_port, "capped", "RESOURCE_EXHAUSTED"),
                 "grpc rpm": (_grpc, grpc_port, "quota", "RESOURCE_EXHAUSTED"),
                 "http in_flight": (_http, http_port, "capped", "429"),
                 "http rpm": (_http, http_port, "quota", "429")}
        kinds = {k: v for k, v in kinds.items() if a.only is None or a.only in k}
        best: dict[str, tuple[float, float]] = {}
        for rnd in range(a.rounds + 1):  # round 0 warms up
            for name, (send, port, tenant, want) in kinds.items():
                n = a.requests if rnd else a.requests // 4
                conn.send("cpu")
                (cpu0, loop0), t0 = conn.recv(), time.perf_counter()
                codes = asyncio.run(send(port, KEYS[tenant], n, a.concurrency))
                conn.send("cpu")
                (cpu1, loop1), wall = conn.recv(), time.perf_counter() - t0
                sent = sum(codes.values())
                if codes != {want: sent}:
                    raise SystemExit(f"{name}: expected every request refused with {want}, got {codes}")
                if rnd:
                    us, loop_us = (cpu1 - cpu0) / sent * 1e6, (loop1 - loop0) / sent * 1e6
                    b = best.setdefault(name, (us, loop_us))
                    best[name] = (min(b[0], us), min(b[1], loop_us))
                    print(f"round {rnd} {name:15s} {sent} refused in {wall:.2f} s ({sent / wall:.0f}/s): server "
                          f"CPU {us:.0f} µs per refusal, {loop_us:.0f} µs of it in the event loop's thread")
        print("best (µs per refusal, process / event loop): " + ", ".join(
            f"{k} {v[0]:.0f} / {v[1]:.0f}" for k, v in best.items()))
        if "grpc floor" in best:  # the limit: a bare gRPC server refusing at once, in the same process and run
            floor = best["grpc floor"][0]
            print("above the floor (the gateway's own work a gRPC refusal, µs): " + ", ".join(
                f"{k} {v[0] - floor:.0f}" for k, v in best.items() if k.startswith("grpc ") and k != "grpc floor"))
        if a.profile:
            for name, (send, port, tenant, _) in kinds.items():
                conn.send("profile-on")
                conn.recv()
                asyncio.run(send(port, KEYS[tenant], a.requests, a.concurrency))
                conn.send(("profile-off", a.profile, a.profile_sort))
                print(f"--- {name}\n{conn.recv()}")
        conn.send("stop")
        proc.join(10)


if __name__ == "__main__":
    main()
