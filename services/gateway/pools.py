"""Client-side channels of the gateway: round-robin pools with bounded in-flight calls, per-worker stubs, and
``CallStream``, the base of the calls it keeps open for many requests (``DecodeStream``, ``PlaceStream``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from grpc.aio import AioRpcError, Metadata
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.rpc import GRPC_OPTIONS, Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

STATUS_CODES = {c.value[0]: c for c in grpc.StatusCode}  # a status code's number (``code.value[0]``) → the code


def rpc_error(code: grpc.StatusCode, details: str) -> AioRpcError:
    """The error a call that ended with ``code`` raises, for a request on a shared call to raise in its place."""
    return AioRpcError(code, Metadata(), Metadata(), details=details)


class CallStream:
    """A bidi call the gateway keeps open to one server for many of its requests (``DecodeStream``,
    ``PlaceStream``): a writer task sends what is put on ``outgoing``, in order; the subclass's ``_read`` hands out
    what comes back (``_received``), and when the call ends ``error`` says how and ``_ended`` fails what still
    waits on it. Create inside the event loop; ``kind`` names the call and ``peer`` the server in logs and errors."""

    kind = "stream"
    peer = "server"  # what the other end is, in the error of a call that it ended

    def __init__(self, call: Any, address: str) -> None:
        self.address = address
        self.call = call
        self.outgoing: asyncio.Queue[Any] = asyncio.Queue()
        self.error: AioRpcError | None = None
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self._write())
        self._reader = loop.create_task(self._read())

    async def _write(self) -> None:
        try:
            while True:
                await self.call.write(await self.outgoing.get())
        except asyncio.CancelledError:
            raise
        except Exception:  # the call ended or broke: ended here too, the reader fails what waits on it
            if not self.call.done():
                log.warning("%s to %s: a write failed; closing the stream", self.kind, self.address, exc_info=True)
            self.call.cancel()

    async def _read(self) -> None:
        err = rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self.peer} {self.address} ended its {self.kind}")
        try:
            async for m in self.call:
                self._received(m)
        except AioRpcError as e:
            err = e
        except asyncio.CancelledError:
            err = rpc_error(grpc.StatusCode.UNAVAILABLE, f"the gateway closed its {self.kind}")
            raise
        finally:
            self.error = err
            self._ended(err)
            self._writer.cancel()

    def _received(self, message: Any) -> None:
        """A message from the server: hand it to whatever waits for it."""
        raise NotImplementedError

    def _ended(self, error: AioRpcError) -> None:
        """The call is over (``error`` says how): fail everything still waiting on it."""
        raise NotImplementedError

    async def close(self) -> None:
        self.call.cancel()
        for t in (self._reader, self._writer):
            t.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)


class ChannelPool:
    """One channel per address, used round-robin, at most ``max_inflight`` calls in flight on each (3,000
    unbounded calls on one aio channel fail with CANCELLED). A call that finds its server UNAVAILABLE is retried
    once on each other address. Create and use inside one event loop."""

    def __init__(self, addresses: Sequence[str], stub_cls: type, max_inflight: int) -> None:
        self.addresses = list(addresses)
        self._stub_cls = stub_cls
        self._max_inflight = max(1, max_inflight)
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[Any] = []
        self._sems: list[asyncio.Semaphore] = []
        self._next = 0

    def _open(self) -> None:
        if not self._channels:
            self._channels = [grpc.aio.insecure_channel(a, options=GRPC_OPTIONS) for a in self.addresses]
            self._stubs = [self._stub_cls(ch) for ch in self._channels]
            self._sems = [asyncio.Semaphore(self._max_inflight) for _ in self.addresses]

    def stubs(self, what: str) -> list[Any]:
        """A stub per address, in the order of ``addresses`` (for calls that manage their own streams). Raises
        Unavailable without addresses."""
        if not self.addresses:
            raise Unavailable(f"no {what} address is configured")
        self._open()
        return self._stubs

    def turn(self, what: str) -> list[int]:
        """The address indices one call tries, in order: each once, from the next in round-robin (its own order:
        the calls running meanwhile move the pool's turn). Raises Unavailable without addresses."""
        n = len(self.stubs(what))
        start = self._next
        self._next = (start + 1) % n
        return [(start + k) % n for k in range(n)]

    async def call(self, fn: Callable[[Any], Awaitable[T]], what: str) -> T:
        """``await fn(stub)`` on the next channel, the others in turn while one is UNAVAILABLE. Raises the RPC's
        error, or Unavailable without addresses."""
        order = self.turn(what)
        for i in order:
            async with self._sems[i]:
                try:
                    return await fn(self._stubs[i])
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE or i == order[-1]:
                        raise
        raise AssertionError("unreachable")

    async def any_serving(self, timeout: float) -> bool:
        """Whether any address answers grpc.health.v1 SERVING (for the HTTP API's readiness)."""
        self._open()
        for ch in self._channels:
            try:
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                               timeout=timeout)
            except grpc.aio.AioRpcError:
                continue
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return True
        return False

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()
        self._channels = []
