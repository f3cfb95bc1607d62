"""The Prefill service in-process, on a tiny random model (``dummy:tiny-llama``), called directly over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import grpc
import pytest
from tokenmill.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

from services.prefill.server import PrefillWorker
from services.router.server import RouterService
from tests.services.harness import HOST, cluster, free_port, serving


def test_a_second_prefill_under_a_request_id_in_flight_is_refused_and_the_first_completes():
    async def body():
        ports = {r: free_port() for r in ("router", "prefill")}
        cfg = cluster(**{"model": "dummy:tiny-llama", "engine.kv_cache_memory": 8 << 20, "tokenizer.count": 1,
                         "worker_engine_process": False,  # the test holds the engine thread
                         **{f"{r}.port": p for r, p in ports.items()}})
        worker = PrefillWorker(cfg.service("prefill", 0))
        async with contextlib.AsyncExitStack() as es:
            await es.enter_async_context(serving(RouterService(cfg.service("router", 0)), cfg, "router",
                                                 ports["router"]))
            await es.enter_async_context(serving(worker, cfg, "prefill", ports["prefill"]))
            gate = threading.Event()
            worker.loop.submit(lambda e: gate.wait(10))  # the engine thread waits: both calls are in flight at once
            req = prefill_pb2.PrefillRequest(meta=common_pb2.RequestMeta(request_id="twin"),
                                             prompt_token_ids=[(7 * i) % 500 + 3 for i in range(40)],
                                             params=common_pb2.SamplingParams(max_tokens=4))
            async with grpc.aio.insecure_channel(f"{HOST}:{ports['prefill']}") as ch:
                stub = prefill_pb2_grpc.PrefillStub(ch)
                first = asyncio.ensure_future(stub.Prefill(req, timeout=20))
                for _ in range(100):
                    if "twin" in worker._waiters:
                        break
                    await asyncio.sleep(0.02)
                try:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.Prefill(req, timeout=20)
                finally:
                    gate.set()
                res = await first  # a second waiter under the same id would orphan this one's: it never returned
                assert res.kv.lease_id and res.kv.block_ids
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
                assert "request id 'twin' is already prefilling" in e.value.details()
                await stub.Release(prefill_pb2.ReleaseRequest(lease_id=res.kv.lease_id), timeout=5)

    asyncio.run(body())
