"""The gateway's placements on one ``PlaceStream`` per router (services/gateway/place_stream.py): what a caller gets
is what ``Place`` would give, on one call however many placements; a stream that breaks fails what waits on it and
the next placement opens another; a router without ``PlaceStream`` is asked with ``Place``; a deadline ends the
wait; a router that is down is skipped for the next. Real gRPC servers: the real router, and fake routers where a
failure is the point."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from tokenmill.v1 import common_pb2, router_pb2, router_pb2_grpc

from services.gateway.place_stream import PlaceStreams
from services.gateway.pools import ChannelPool
from services.router.server import RouterService
from tests.services.harness import HOST, Reporter, cluster, free_port, serving, wait_for_workers

PROMPT = list(range(1, 40))


def _req(rid: str) -> router_pb2.PlaceRequest:
    return router_pb2.PlaceRequest(meta=common_pb2.RequestMeta(request_id=rid), prompt_token_ids=PROMPT, max_tokens=8)


class _FakeRouter(router_pb2_grpc.RouterServicer):
    """``Place`` answers decode-fake; ``PlaceStream`` per ``mode``: "answer" (as Place), "silent" (reads, never
    answers), "break" (ends the call UNAVAILABLE after its first request)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.stream_calls = 0
        self.unary_calls = 0
        self.seen = asyncio.Event()

    @staticmethod
    def _placement() -> router_pb2.Placement:
        return router_pb2.Placement(decode=router_pb2.WorkerRef(worker_id="decode-fake", address="127.0.0.1:1"))

    async def Place(self, request, context):
        self.unary_calls += 1
        return self._placement()

    async def PlaceStream(self, request_iterator, context) -> AsyncIterator[router_pb2.PlaceStreamReply]:
        self.stream_calls += 1
        async for m in request_iterator:
            self.seen.set()
            if self.mode == "break":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the fake router went away")
            if self.mode == "answer":
                yield router_pb2.PlaceStreamReply(id=m.id, placement=self._placement())


class _OldRouter(router_pb2_grpc.RouterServicer):
    """A router from before ``PlaceStream``: the generated base answers it UNIMPLEMENTED."""

    def __init__(self) -> None:
        self.unary_calls = 0

    async def Place(self, request, context):
        self.unary_calls += 1
        return _FakeRouter._placement()


@contextlib.asynccontextmanager
async def _fake(servicer: router_pb2_grpc.RouterServicer) -> AsyncIterator[str]:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"{HOST}:{port}")
    await server.start()
    try:
        yield f"{HOST}:{port}"
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def _placing(*addresses: str) -> AsyncIterator[PlaceStreams]:
    """The gateway's placements over routers at ``addresses``, closed afterwards."""
    pool = ChannelPool(list(addresses), router_pb2_grpc.RouterStub, 8)
    streams = PlaceStreams(pool)
    try:
        yield streams
    finally:
        await streams.close()
        await pool.close()


def test_placements_share_one_stream_and_equal_what_place_gives():
    async def body() -> None:
        port = free_port()
        cfg = cluster(**{"router.port": port})
        async with serving(RouterService(cfg.service("router", 0)), cfg, "router", port):
            addr = f"{HOST}:{port}"
            rep = Reporter(addr)
            await rep.send(worker_id="decode-a", address="127.0.0.1:1", role=router_pb2.WORKER_ROLE_DECODE,
                           model_id="m", block_size=16, free_blocks=1000, total_blocks=1000)
            await wait_for_workers(addr, 1)
            pool = ChannelPool([addr], router_pb2_grpc.RouterStub, 8)
            streams = PlaceStreams(pool)
            try:
                got = await asyncio.gather(*(streams.place(_req(f"r{i}"), 10) for i in range(50)))
                assert {p.decode.worker_id for p in got} == {"decode-a"}
                assert list(streams.open_streams()) == [addr] and streams.open_streams()[addr] == 0
                want = await pool.call(lambda stub: stub.Place(_req("r-unary")), "router")
                assert got[0].decode == want.decode and got[0].cached_blocks == want.cached_blocks
                with pytest.raises(grpc.aio.AioRpcError) as e:  # the router's refusal, as Place raises it
                    await streams.place(router_pb2.PlaceRequest(meta=common_pb2.RequestMeta(request_id="empty")), 10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "prompt_token_ids is empty" in (e.value.details() or "")
                assert len(streams.open_streams()) == 1  # the refusal did not end the stream
            finally:
                await streams.close()
                await pool.close()
                await rep.close()

    asyncio.run(body())


def test_a_broken_stream_fails_what_waits_and_the_next_placement_opens_another():
    async def body() -> None:
        fake = _FakeRouter("break")
        async with _fake(fake) as addr, _placing(addr) as streams:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await streams.place(_req("a"), 10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert streams.open_streams() == {}
            fake.mode = "answer"
            p = await streams.place(_req("b"), 10)
            assert p.decode.worker_id == "decode-fake" and fake.stream_calls == 2

    asyncio.run(body())


def test_a_placement_past_its_deadline_ends_deadline_exceeded():
    async def body() -> None:
        fake = _FakeRouter("silent")
        async with _fake(fake) as addr, _placing(addr) as streams:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await streams.place(_req("a"), 0.3)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and fake.seen.is_set()
            assert streams.open_streams() == {addr: 0}  # nothing left waiting; the stream stays

    asyncio.run(body())


def test_a_router_without_place_stream_is_asked_with_place():
    async def body() -> None:
        old = _OldRouter()
        async with _fake(old) as addr, _placing(addr) as streams:
            for rid in ("a", "b"):
                assert (await streams.place(_req(rid), 10)).decode.worker_id == "decode-fake"
            assert old.unary_calls == 2 and streams.open_streams() == {}

    asyncio.run(body())


def test_a_router_that_is_down_is_skipped_for_the_next():
    async def body() -> None:
        fake = _FakeRouter("answer")
        down = f"{HOST}:{free_port()}"  # nothing listens there
        async with _fake(fake) as addr, _placing(down, addr) as streams:
            p = await streams.place(_req("a"), 10)  # the first router in turn is down: the second answers
            assert p.decode.worker_id == "decode-fake" and fake.stream_calls == 1
            got = await asyncio.gather(*(streams.place(_req(f"r{i}"), 10) for i in range(20)))
            assert {g.decode.worker_id for g in got} == {"decode-fake"}
            assert (fake.stream_calls, fake.unary_calls) == (1, 0)  # twenty more on the same call, none unary

    asyncio.run(body())


def test_concurrent_unary_calls_skip_a_router_that_is_down_each_once():
    """``ChannelPool.call``, as ``PlaceStreams``: each call tries every router once from its own turn, however the
    calls beside it move the round-robin turn meanwhile."""
    async def body() -> None:
        fake = _FakeRouter("answer")
        async with _fake(fake) as addr:
            pool = ChannelPool([f"{HOST}:{free_port()}", addr], router_pb2_grpc.RouterStub, 8)
            try:
                got = await asyncio.gather(*(pool.call(lambda stub, i=i: stub.Place(_req(f"r{i}")), "router")
                                             for i in range(20)))
                assert {g.decode.worker_id for g in got} == {"decode-fake"} and fake.unary_calls == 20
            finally:
                await pool.close()

    asyncio.run(body())
