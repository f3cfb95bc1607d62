"""How late an asyncio event loop runs what is due.

A task sleeps ``interval_s`` again and again and records how much later than asked it woke: the time the loop spent
elsewhere (a callback that held it, a GC pause, a process starved of CPU). A request's latency measured by, or
passing through, a loop includes that loop's lag, so the gateway exports it as a histogram and the load generator
reports its own beside its figures.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class LoopLag:
    """``observe``: called with each lag in seconds (e.g. a Prometheus histogram's ``observe``). ``keep``: also keep
    the lags, for ``take``."""

    def __init__(self, interval_s: float = 0.01, observe: Callable[[float], None] | None = None,
                 keep: bool = False) -> None:
        self.interval_s = interval_s
        self._observe = observe
        self._keep = keep
        self._lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sampling on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def take(self) -> list[float]:
        """The lags recorded since the last ``take`` (with ``keep``), in seconds."""
        out, self._lags = self._lags, []
        return out

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, loop.time() - t - self.interval_s)
            if self._keep:
                self._lags.append(lag)
            if self._observe is not None:
                self._observe(lag)
