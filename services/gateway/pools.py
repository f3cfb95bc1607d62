"""Client-side channels of the gateway: round-robin pools with bounded in-flight calls, and per-worker stubs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.rpc import GRPC_OPTIONS, Unavailable

T = TypeVar("T")


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

    async def call(self, fn: Callable[[Any], Awaitable[T]], what: str) -> T:
        """``await fn(stub)`` on the next channel. Raises the RPC's error, or Unavailable without addresses."""
        n = len(self.addresses)
        if n == 0:
            raise Unavailable(f"no {what} address is configured")
        self._open()
        for attempt in range(n):
            i = self._next
            self._next = (i + 1) % n
            async with self._sems[i]:
                try:
                    return await fn(self._stubs[i])
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == n - 1:
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
