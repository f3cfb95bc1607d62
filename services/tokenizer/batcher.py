"""Token-aware batching of encode calls: one asyncio task owns the queue, submitters await a future.

Each request waits at most its priority class's window (``windows_s``: short for interactive, long for batch).
A batch fires when the pending requests' estimated tokens reach ``max_tokens`` or the first window is over; it
takes interactive requests first, then standard, then batch (each in arrival order) up to ``max_tokens``, and
what it leaves keeps its own deadline. It is encoded with the Rust batch encoder in a worker thread, so the event
loop keeps accepting requests (they form the next batch meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from common.sequence import PriorityClass

EncodeBatch = Callable[[Sequence[str], bool], list[list[int]]]


def estimate_tokens(text: str) -> int:
    """A cheap upper-ish estimate of a text's token count (byte-level BPE averages ~4 characters a token)."""
    return len(text) // 4 + 1


@dataclass(slots=True)
class _Item:
    text: str
    add_special_tokens: bool
    tokens: int
    klass: PriorityClass
    deadline: float  # event-loop time by which its batch fires
    future: asyncio.Future[list[int]]


@dataclass(frozen=True, slots=True)
class BatchStats:
    """What one fired batch held (for metrics)."""

    requests: int
    est_tokens: int
    seconds: float


class EncodeBatcher:
    """Batches concurrent ``encode`` calls. Create inside a running loop; ``close()`` fails pending calls."""

    def __init__(
        self,
        encode_batch: EncodeBatch,
        max_tokens: int,
        windows_s: Mapping[PriorityClass, float],
        on_batch: Callable[[BatchStats], None] | None = None,
    ) -> None:
        """``windows_s``: each class's window in seconds (a class not named: the standard one's)."""
        self._encode_batch = encode_batch
        self._max_tokens = max(1, max_tokens)
        standard = max(0.0, windows_s.get(PriorityClass.STANDARD, 0.0))
        self._windows = {k: max(0.0, windows_s.get(k, standard)) for k in PriorityClass}
        self._on_batch = on_batch
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="encode-batcher")

    async def encode(self, text: str, add_special_tokens: bool,
                     klass: PriorityClass = PriorityClass.STANDARD) -> list[int]:
        """The token ids of ``text``, encoded as part of a batch within ``klass``'s window."""
        if self._task.done():
            raise RuntimeError("the encode batcher is closed")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[int]] = loop.create_future()
        deadline = loop.time() + self._windows[klass]
        self._queue.put_nowait(_Item(text, add_special_tokens, estimate_tokens(text), klass, deadline, fut))
        return await fut

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if not item.future.done():
                item.future.set_exception(RuntimeError("the tokenizer is shutting down"))

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        pending: list[_Item] = []
        while True:
            if not pending:
                pending.append(await self._queue.get())
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
            left = min(it.deadline for it in pending) - loop.time()
            if sum(it.tokens for it in pending) < self._max_tokens and left > 0:
                with contextlib.suppress(TimeoutError):
                    pending.append(await asyncio.wait_for(self._queue.get(), left))
                continue
            batch, pending = self._take(pending)
            await self._fire(batch, sum(it.tokens for it in batch))

    def _take(self, pending: list[_Item]) -> tuple[list[_Item], list[_Item]]:
        """The batch to fire (interactive first, up to ``max_tokens``, at least one item) and what stays."""
        ordered = sorted(pending, key=lambda it: it.klass)  # stable: arrival order within a class
        tokens, n = 0, 0
        while n < len(ordered) and tokens < self._max_tokens:
            tokens += ordered[n].tokens
            n += 1
        return ordered[:n], ordered[n:]

    async def _fire(self, batch: list[_Item], tokens: int) -> None:
        live = [it for it in batch if not it.future.done()]  # a cancelled caller's item is skipped
        if not live:
            return
        start = asyncio.get_running_loop().time()
        for flag in (True, False):
            group = [it for it in live if it.add_special_tokens is flag]
            if not group:
                continue
            try:
                ids = await asyncio.to_thread(self._encode_batch, [it.text for it in group], flag)
            except Exception as e:
                for it in group:
                    if not it.future.done():
                        it.future.set_exception(e)
                continue
            for it, out in zip(group, ids):
                if not it.future.done():
                    it.future.set_result(out)
        if self._on_batch is not None:
            self._on_batch(BatchStats(len(live), tokens, asyncio.get_running_loop().time() - start))
