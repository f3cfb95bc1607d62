"""A worker whose engine thread dies: what waits on the engine ends with UNAVAILABLE, and the worker goes down
(drained, exit code 1) instead of serving on with a dead engine. The worker, its engine (SmolLM2 on the CPU) and
its gRPC server are real; the fault is injected into ``engine.step``, as a device error would raise there."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenmill.v1 import common_pb2, decode_pb2, decode_pb2_grpc

from common import rpc
from services.decode.server import DecodeWorker
from tests.services.harness import HOST, cluster, free_port


async def _wait_serving(ch: grpc.aio.Channel, timeout: float) -> None:
    health = health_pb2_grpc.HealthStub(ch)
    for _ in range(int(timeout / 0.1)):
        with contextlib.suppress(grpc.aio.AioRpcError):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the decode worker was not SERVING within {timeout} s")


def test_a_dead_engine_fails_its_streams_and_stops_the_worker():
    async def body() -> DecodeWorker:
        port, mport = free_port(), free_port()
        svc = cluster(**{"decode.port": port, "decode.metrics_port": mport, "grace_s": 1,
                         "engine.kv_cache_memory": "256MiB", "engine.dtype": "float32",
                         "worker_engine_process": False}).service("decode")  # the fault goes into its engine
        worker = DecodeWorker(svc)
        served = asyncio.ensure_future(rpc.serve_until_signalled(worker, svc))
        async with grpc.aio.insecure_channel(f"{HOST}:{port}") as ch:
            await _wait_serving(ch, 300)
            call = decode_pb2_grpc.DecodeStub(ch).Decode(decode_pb2.DecodeRequest(
                prompt_token_ids=[1, 2, 3, 4, 5],
                params=common_pb2.SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0)))
            first = await call.read()
            assert first is not grpc.aio.EOF and first.token_ids

            def fault() -> None:
                raise RuntimeError("simulated device fault")

            assert worker.engine is not None
            worker.engine.step = fault  # type: ignore[method-assign]
            async def drain() -> None:
                while await call.read() is not grpc.aio.EOF:
                    pass

            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(drain(), 60)  # a stream left hanging fails here with TimeoutError
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
            assert "its engine failed (RuntimeError: simulated device fault)" in (e.value.details() or "")
        await asyncio.wait_for(served, 30)  # the worker drained and stopped by itself
        return worker

    worker = asyncio.run(body())
    assert isinstance(worker.failed, RuntimeError)
    assert worker.loop is not None and worker.loop.submit(lambda e: None).exception(timeout=1) is not None


def test_run_exits_1_when_the_app_failed():
    class Failed:
        role = "decode"

        def __init__(self) -> None:
            from prometheus_client import CollectorRegistry

            self.registry = CollectorRegistry()
            self.stop_event = asyncio.Event()
            self.failed: BaseException | None = None

        def register(self, server: grpc.aio.Server) -> list[str]:
            return []

        async def start(self) -> None:
            self.failed = RuntimeError("engine gone")
            self.stop_event.set()

        async def stop(self) -> None:
            return None

    svc = cluster(**{"decode.port": free_port(), "decode.metrics_port": free_port(), "grace_s": 0}).service("decode")
    assert rpc.run(Failed(), svc) == 1
