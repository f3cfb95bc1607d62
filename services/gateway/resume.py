"""Streams that outlive their connection: a client that reconnects gets what it missed, then the live stream.

With ``gateway.resume_window_s`` > 0 the gateway runs each stream's generation in a task of its own that logs
every response (``seq`` = its 1-based position). The client's call only follows the log, so when the client goes
away the generation goes on: for ``resume_window_s`` with nobody following, then it is cancelled (the decode
worker frees its KV). A finished stream's log is kept as long, for a client that lost the tail. ``Frontend.Resume``
(gRPC) and a POST with ``Last-Event-ID`` (HTTP SSE) follow the log again from after a given ``seq``: no response
twice, none missing.

Off by default (0): a stream whose client left is cancelled at once, as vLLM and OpenAI's API do, since holding it
costs KV blocks and compute for a client that may not come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from tokenmill.v1 import frontend_pb2

from common.rpc import NotFound

log = logging.getLogger(__name__)


class StreamGone(NotFound):
    """No stream of that request id to follow: never started here, or its resume window passed."""


class StreamLog:
    """One stream's responses in order, the task that produces them, and who follows them."""

    def __init__(self, request_id: str, owner: str = "") -> None:
        self.request_id = request_id
        self.owner = owner  # the tenant whose stream it is: only it may resume it
        self.items: list[frontend_pb2.GenerateResponse] = []
        self.done = False
        self.error: BaseException | None = None
        self.producer: asyncio.Task[None] | None = None
        self.followers = 0
        self.expiry: asyncio.TimerHandle | None = None
        self._changed = asyncio.Event()

    def append(self, resp: frontend_pb2.GenerateResponse) -> None:
        self.items.append(resp)
        self._wake()

    def finish(self, error: BaseException | None = None) -> None:
        self.done, self.error = True, error
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self) -> None:
        await self._changed.wait()


class ResumableStreams:
    """Every resumable stream of one gateway, by request id."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._logs: dict[str, StreamLog] = {}

    def __len__(self) -> int:
        return len(self._logs)

    def start(self, request_id: str, source: AsyncIterator[frontend_pb2.GenerateResponse], owner: str = ""
              ) -> StreamLog:
        """Run ``source`` (a generation of tenant ``owner``) in a task of its own, logging every response. Raises
        ValueError when a stream of that id is still here (resume it instead)."""
        if request_id in self._logs:
            raise ValueError(f"request id {request_id!r} is already streaming here; resume it (Frontend.Resume, or "
                             f"Last-Event-ID over HTTP) or use another id")
        sl = StreamLog(request_id, owner)
        self._logs[request_id] = sl

        async def produce() -> None:
            try:
                async for resp in source:
                    sl.append(resp)
                sl.finish()
            except asyncio.CancelledError:
                sl.finish(asyncio.CancelledError())
                raise
            except BaseException as e:  # the followers get it
                sl.finish(e)

        sl.producer = asyncio.get_running_loop().create_task(produce())
        return sl

    def get(self, request_id: str, owner: str = "") -> StreamLog:
        """The stream of that id, if it is tenant ``owner``'s; another tenant's is as good as none."""
        sl = self._logs.get(request_id)
        if sl is None or sl.owner != owner:
            raise StreamGone(f"no stream {request_id!r} to resume on this gateway: it never ran here, or nobody "
                             f"followed it for {self.window_s:g} s (gateway.resume_window_s)")
        return sl

    async def follow(self, sl: StreamLog, after_seq: int = 0) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        """The responses after ``after_seq``, then the live ones, until the stream ends (its error is raised)."""
        if not 0 <= after_seq <= len(sl.items):
            raise ValueError(f"after_seq {after_seq}: stream {sl.request_id!r} has sent {len(sl.items)} responses "
                             f"so far (seq 1..{len(sl.items)})")
        sl.followers += 1
        if sl.expiry is not None:
            sl.expiry.cancel()
            sl.expiry = None
        try:
            i = after_seq
            while True:
                while i < len(sl.items):
                    yield sl.items[i]
                    i += 1
                if sl.done:
                    if sl.error is not None and not isinstance(sl.error, asyncio.CancelledError):
                        raise sl.error
                    return
                await sl.changed()
        finally:
            sl.followers -= 1
            if sl.followers == 0:
                sl.expiry = asyncio.get_running_loop().call_later(self.window_s, self._expire, sl)

    def _expire(self, sl: StreamLog) -> None:
        """Nobody followed ``sl`` for the window: cancel its generation (frees its KV) and forget it."""
        if sl.followers or self._logs.get(sl.request_id) is not sl:
            return
        del self._logs[sl.request_id]
        if sl.producer is not None and not sl.producer.done():
            log.info("stream %s was not resumed within %.0f s: cancelled", sl.request_id, self.window_s)
            sl.producer.cancel()

    async def close(self) -> None:
        """Cancel every generation still running (the gateway stops)."""
        for sl in list(self._logs.values()):
            if sl.expiry is not None:
                sl.expiry.cancel()
            if sl.producer is not None and not sl.producer.done():
                sl.producer.cancel()
                with contextlib.suppress(BaseException):
                    await sl.producer
        self._logs.clear()
