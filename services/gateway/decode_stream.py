"""One ``DecodeStream`` per decode worker: every request this gateway sends to a worker shares one gRPC call.

A decode worker produces a token for each of its sequences every engine step. With a call per request, that is a
gRPC message per sequence and step, on the worker and here; on one stream per worker, the worker sends one message
per step (``TokenDeltaBatch``: every delta since its last message, each tagged with its request id), and this
module hands each delta to its request's queue. vLLM and SGLang batch a step's outputs between their engine and
their API server the same way.

A request that falls behind its worker (this process busy relaying other streams) gets the deltas waiting in its
queue merged into one, as a worker merges a slow stream's tokens: each message sent to a client costs this event
loop about as much as a delta received, so the messages it has to send shrink when it is busiest. A request given a
stream interval (``gateway.class_stream_interval_ms``: batch requests by default) waits that long after each
message but the last, so each carries every token that came meanwhile.

What a request sees is what its own ``Decode`` call would give (``DecodeStreams.decode``): its deltas in order,
then the end of its iterator at the finish reason, or a ``grpc.aio.AioRpcError`` with the status its call would have
ended with, so the gateway's re-placement and migration work unchanged. When the stream itself breaks (the worker
went away), every request on it gets that error; the next request opens a new stream. A request whose consumer
leaves early (the client went away) is cancelled on the worker with a ``cancel_request_id``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc.aio import AioRpcError
from tokenmill.v1 import common_pb2, decode_pb2, decode_pb2_grpc

from common import rpc, telemetry
from services.gateway.pools import STATUS_CODES, CallStream, rpc_error


def _merge(d: decode_pb2.TokenDelta, q: asyncio.Queue[decode_pb2.TokenDelta | BaseException]
           ) -> tuple[decode_pb2.TokenDelta, decode_pb2.TokenDelta | BaseException | None]:
    """``d`` with the plain deltas already waiting in ``q`` appended (tokens, text, logprobs; the last one's finish
    reason, usage and filter reason), up to the first that ends the stream with a finish reason; an error or an
    exception is not merged and comes back second, to be handled next."""
    while d.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED and not q.empty():
        nxt = q.get_nowait()
        if isinstance(nxt, BaseException) or nxt.HasField("error"):
            return d, nxt
        d.text += nxt.text
        d.token_ids.extend(nxt.token_ids)
        d.logprobs.extend(nxt.logprobs)
        d.finish_reason = nxt.finish_reason
        if nxt.HasField("usage"):
            d.usage.CopyFrom(nxt.usage)
        if nxt.filter_reason:
            d.filter_reason = nxt.filter_reason
    return d, None


def _wake(f: asyncio.Future[None] | None) -> None:
    if f is not None and not f.done():
        f.set_result(None)


class _Stream(CallStream):
    """One open ``DecodeStream`` call: the writer sends requests and cancels in order, the reader hands each delta
    to its request's queue."""

    kind, peer = "DecodeStream", "decode worker"

    def __init__(self, stub: decode_pb2_grpc.DecodeStub, address: str) -> None:
        self.queues: dict[str, asyncio.Queue[decode_pb2.TokenDelta | BaseException]] = {}
        # a request waiting out its stream interval: woken early by its end (a finish, an error, its deadline)
        self.waiting: dict[str, asyncio.Future[None]] = {}
        self.ended: set[str] = set()  # requests whose end is in their queue
        super().__init__(stub.DecodeStream(), address)

    def _received(self, batch: decode_pb2.TokenDeltaBatch) -> None:
        for d in batch.deltas:
            q = self.queues.get(d.request_id)
            if q is not None:
                q.put_nowait(d)
                if d.finish_reason or d.HasField("error"):
                    self.ended.add(d.request_id)
                    _wake(self.waiting.get(d.request_id))

    def _ended(self, error: AioRpcError) -> None:
        for q in self.queues.values():
            q.put_nowait(error)
        for f in self.waiting.values():
            _wake(f)

    async def decode(self, req: decode_pb2.DecodeRequest, timeout: float | None, interval: float = 0.0
                     ) -> AsyncIterator[decode_pb2.TokenDelta]:
        if self.error is not None:
            raise self.error
        rid = req.meta.request_id
        if rid in self.queues:  # as the worker refuses a request id already streaming there
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request id {rid!r} is already streaming on decode worker {self.address}")
        q: asyncio.Queue[decode_pb2.TokenDelta | BaseException] = asyncio.Queue()
        self.queues[rid] = q
        trace = dict(telemetry.outgoing_metadata() or ())
        self.outgoing.put_nowait(decode_pb2.DecodeStreamRequest(request=req, trace=trace))
        timer = None
        loop = asyncio.get_running_loop()
        if timeout is not None:
            timer = loop.call_later(timeout, self._expire, rid, q)
        done = False
        held: decode_pb2.TokenDelta | BaseException | None = None
        try:
            while True:
                d = held if held is not None else await q.get()
                held = None
                if not isinstance(d, BaseException) and not d.HasField("error"):
                    d, held = _merge(d, q)
                if isinstance(d, BaseException):
                    raise d
                if d.HasField("error"):
                    done = True  # the worker ended it
                    raise rpc_error(STATUS_CODES.get(d.error.code, grpc.StatusCode.UNKNOWN), d.error.message)
                yield d
                if d.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    done = True
                    return
                if interval > 0 and held is None and rid not in self.ended and self.error is None:
                    # what comes meanwhile is merged into the next message; the request's end wakes it
                    f = self.waiting[rid] = loop.create_future()
                    h = loop.call_later(interval, _wake, f)
                    try:
                        await f
                    finally:
                        h.cancel()
                        del self.waiting[rid]
        finally:
            if timer is not None:
                timer.cancel()
            if self.queues.get(rid) is q:
                del self.queues[rid]
                self.ended.discard(rid)
            if not done and self.error is None:  # the consumer left early: free the request on the worker
                self.outgoing.put_nowait(decode_pb2.DecodeStreamRequest(cancel_request_id=rid))

    def _expire(self, rid: str, q: asyncio.Queue[decode_pb2.TokenDelta | BaseException]) -> None:
        q.put_nowait(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
        self.ended.add(rid)
        _wake(self.waiting.get(rid))


class DecodeStreams:
    """The gateway's streams, one per decode worker address, opened on first use and again after one breaks."""

    def __init__(self, stubs: rpc.StubCache) -> None:
        self._stubs = stubs
        self._streams: dict[str, _Stream] = {}

    def decode(self, address: str, req: decode_pb2.DecodeRequest, timeout: float | None, interval: float = 0.0
               ) -> AsyncIterator[decode_pb2.TokenDelta]:
        """The request's deltas from the worker at ``address``, as its own ``Decode`` call would stream them;
        with an ``interval`` (s), at most one message an interval after the first, each with every token since the
        last. ``req.meta.request_id`` must be set (unique on the worker)."""
        s = self._streams.get(address)
        if s is None or s.error is not None:
            s = self._streams[address] = _Stream(self._stubs.get(address, decode_pb2_grpc.DecodeStub), address)
        return s.decode(req, timeout, interval)

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)

    def open_streams(self) -> dict[str, Any]:
        """Address → requests in flight on its open stream."""
        return {a: len(s.queues) for a, s in self._streams.items() if s.error is None}
