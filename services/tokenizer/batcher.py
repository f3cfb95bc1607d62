"""Token-aware batching of encode calls: one asyncio task owns the queue, submitters await a future.

A batch fires when its estimated tokens reach ``max_tokens`` or its oldest item has waited ``max_wait_s``;
it is encoded with the Rust batch encoder in a worker thread, so the event loop keeps accepting requests (they
form the next batch meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

EncodeBatch = Callable[[Sequence[str], bool], list[list[int]]]


def estimate_tokens(text: str) -> int:
    """A cheap upper-ish estimate of a text's token count (byte-level BPE averages ~4 characters a token)."""
    return len(text) // 4 + 1


@dataclass(slots=True)
class _Item:
    text: str
    add_special_tokens: bool
    tokens: int
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
        max_wait_s: float,
        on_batch: Callable[[BatchStats], None] | None = None,
    ) -> None:
        self._encode_batch = encode_batch
        self._max_tokens = max(1, max_tokens)
        self._max_wait_s = max(0.0, max_wait_s)
        self._on_batch = on_batch
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="encode-batcher")

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The token ids of ``text``, encoded as part of a batch."""
        if self._task.done():
            raise RuntimeError("the encode batcher is closed")
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Item(text, add_special_tokens, estimate_tokens(text), fut))
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
        while True:
            batch = [await self._queue.get()]
            tokens = batch[0].tokens
            deadline = loop.time() + self._max_wait_s
            while tokens < self._max_tokens:
                if self._queue.empty():
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(self._queue.get(), left)
                    except TimeoutError:
                        break
                else:
                    item = self._queue.get_nowait()
                batch.append(item)
                tokens += item.tokens
            await self._fire(batch, tokens)

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
