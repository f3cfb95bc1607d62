"""LoopLag: a callback that holds the event loop shows up as lag, observed and kept; an idle loop shows little."""

from __future__ import annotations

import asyncio
import time

from common.loop_lag import LoopLag


def test_a_held_loop_is_seen_as_lag():
    async def body():
        seen: list[float] = []
        lag = LoopLag(interval_s=0.01, observe=seen.append, keep=True)
        lag.start()
        await asyncio.sleep(0.1)
        idle = lag.take()
        time.sleep(0.25)  # holds the loop, as a slow callback would
        await asyncio.sleep(0.05)
        held = lag.take()
        await lag.stop()
        assert len(idle) >= 3 and max(idle) < 0.1, idle
        assert max(held) >= 0.2, held
        assert len(seen) == len(idle) + len(held) and lag.take() == []

    asyncio.run(body())
