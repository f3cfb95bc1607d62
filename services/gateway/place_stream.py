"""One ``PlaceStream`` per router: every placement this gateway asks of a router shares one gRPC call.

A unary ``Place`` is a call each: its set-up, the router's per-call handling and the teardown, which every request
pays before its prompt can start. On one stream per router a placement is a message each way, tagged with an id
the reply carries: 0.45-0.7 ms shorter and a fifth to a quarter less of the router's CPU
(``python -m loadgen.bench_placement``, docs/benchmarks.md, "A request's way in").

What a caller sees is what its ``Place`` call would give: the ``Placement``, or a ``grpc.aio.AioRpcError`` with the
status the call would have ended with (the router's own refusals travel in the reply; a stream that breaks fails
every placement waiting on it with UNAVAILABLE, and the next placement opens a new one), so the gateway's retries
across routers and its wait for a router at start-up work unchanged. A router that does not serve ``PlaceStream``
(UNIMPLEMENTED: an older router during a rolling upgrade) is asked with ``Place`` from then on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import grpc
from grpc.aio import AioRpcError
from tokenmill.v1 import router_pb2

from common import telemetry
from services.gateway.pools import STATUS_CODES, CallStream, ChannelPool, rpc_error

log = logging.getLogger(__name__)


class _Stream(CallStream):
    """One open ``PlaceStream`` call: the writer sends the requests in order, the reader resolves each request's
    future by the id its reply carries."""

    kind, peer = "PlaceStream", "router"

    def __init__(self, stub: Any, address: str) -> None:
        self.pending: dict[int, asyncio.Future[router_pb2.Placement]] = {}
        self._ids = itertools.count(1)
        super().__init__(stub.PlaceStream(), address)

    def _received(self, r: router_pb2.PlaceStreamReply) -> None:
        f = self.pending.pop(r.id, None)
        if f is None or f.done():  # its caller left (cancelled, or past its deadline)
            return
        if r.error_code:
            f.set_exception(rpc_error(STATUS_CODES.get(r.error_code, grpc.StatusCode.UNKNOWN), r.error_message))
        else:
            f.set_result(r.placement)

    def _ended(self, error: AioRpcError) -> None:
        pending, self.pending = self.pending, {}
        for f in pending.values():
            if not f.done():
                f.set_exception(error)

    async def place(self, req: router_pb2.PlaceRequest, timeout: float | None) -> router_pb2.Placement:
        if self.error is not None:
            raise self.error
        i = next(self._ids)
        f: asyncio.Future[router_pb2.Placement] = asyncio.get_running_loop().create_future()
        self.pending[i] = f
        trace = dict(telemetry.outgoing_metadata() or ())
        self.outgoing.put_nowait(router_pb2.PlaceStreamRequest(id=i, request=req, trace=trace))
        try:
            return await asyncio.wait_for(f, timeout)
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            self.pending.pop(i, None)


class PlaceStreams:
    """The gateway's placements: on a stream per router (opened on first use and again after one breaks), the
    routers taken in the pool's turn (``ChannelPool.turn``, as its unary calls), and a placement whose router is
    UNAVAILABLE tried once on each other router."""

    def __init__(self, routers: ChannelPool) -> None:
        self.routers = routers
        self._streams: dict[str, _Stream] = {}
        self._unary: set[str] = set()  # routers that do not serve PlaceStream

    async def place(self, req: router_pb2.PlaceRequest, timeout: float | None) -> router_pb2.Placement:
        """The router's placement for ``req``, as ``Place`` would answer it. Raises its error."""
        order = self.routers.turn("router")
        stubs = self.routers.stubs("router")
        for i in order:
            try:
                return await self._one(self.routers.addresses[i], stubs[i], req, timeout)
            except AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or i == order[-1]:
                    raise
        raise AssertionError("unreachable")

    async def _one(self, address: str, stub: Any, req: router_pb2.PlaceRequest, timeout: float | None
                   ) -> router_pb2.Placement:
        if address in self._unary:
            return await stub.Place(req, timeout=timeout, metadata=telemetry.outgoing_metadata())
        s = self._streams.get(address)
        if s is None or s.error is not None:
            s = self._streams[address] = _Stream(stub, address)
        try:
            return await s.place(req, timeout)
        except AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            log.info("router %s does not serve PlaceStream: placing with Place there", address)
            self._unary.add(address)
            return await stub.Place(req, timeout=timeout, metadata=telemetry.outgoing_metadata())

    def open_streams(self) -> dict[str, int]:
        """Router address → placements waiting on its open stream."""
        return {a: len(s.pending) for a, s in self._streams.items() if s.error is None}

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
