"""Workers stream their load to the router: one ``Router.Report`` stream per worker, a report per interval.

Reconnects with backoff when the router is away; never blocks the engine (the snapshot runs on the engine
thread between steps, via ``EngineLoop.submit``). A step can outlast the router's ``worker_timeout_s`` (a long
prefill, a starved CPU): while a snapshot waits for one, a heartbeat goes each interval (the last report, marked
``heartbeat``), so the router keeps a busy worker instead of forgetting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from tokenmill.v1 import router_pb2, router_pb2_grpc

from common.engine import LLMEngine
from common.rpc import GRPC_OPTIONS

log = logging.getLogger(__name__)


def engine_load(
    engine: LLMEngine, worker_id: str, address: str, role: router_pb2.WorkerRole, full: bool = False, draining: bool = False
) -> router_pb2.WorkerLoad:
    """A load report from the engine's current state (call on the engine thread).

    ``full``: list every cached block and tell the router to forget what it knew (a new stream). Incremental
    KV events are added by the caller, which keeps them per router."""
    bm = engine.block_manager
    bm.track_events = True
    stored: list[int] = []
    removed: list[int] = []
    if full:
        stored = sorted(bm.cached_block_hashes())
    queued = sum(s.num_tokens - s.num_computed_tokens for s in engine.scheduler.waiting)
    queued += sum(max(0, s.num_prompt_tokens - s.num_computed_tokens) for s in engine.scheduler.running)
    return router_pb2.WorkerLoad(
        worker_id=worker_id,
        address=address,
        role=role,
        model_id=engine.source.model_id,
        block_size=bm.block_size,
        free_blocks=bm.num_free_blocks,
        total_blocks=bm.num_blocks,
        running=engine.num_running,
        waiting=engine.num_waiting,
        queued_prefill_tokens=queued,
        kv_events=router_pb2.KvEvents(stored=stored, removed=removed, reset=full),
        draining=draining,
    )


def still_alive(last: router_pb2.WorkerLoad) -> router_pb2.WorkerLoad:
    """The last report again, without its KV events (the router has them), marked a heartbeat."""
    out = router_pb2.WorkerLoad()
    out.CopyFrom(last)
    out.ClearField("kv_events")
    out.heartbeat = True
    return out


async def report_forever(
    router_address: str,
    snapshot: Callable[[bool], Awaitable[router_pb2.WorkerLoad]],
    interval_s: float,
    stop: asyncio.Event,
) -> None:
    """Keep a Report stream open to the router until ``stop``; the first report of each stream resets the
    router's view of this worker's cache (``kv_events.reset``) and lists every cached block."""
    backoff = 0.2
    while not stop.is_set():
        try:
            async with grpc.aio.insecure_channel(router_address, options=GRPC_OPTIONS) as ch:
                stub = router_pb2_grpc.RouterStub(ch)

                async def reports() -> AsyncIterator[router_pb2.WorkerLoad]:
                    last: router_pb2.WorkerLoad | None = None
                    pending: asyncio.Future[router_pb2.WorkerLoad] | None = None
                    try:
                        while not stop.is_set():
                            if pending is None:
                                pending = asyncio.ensure_future(snapshot(last is None))
                            # the first report of a stream must be a full one: wait for it
                            done, _ = await asyncio.wait({pending}, timeout=None if last is None else interval_s)
                            if not done:
                                assert last is not None  # the first wait has no timeout: it returns done
                                yield still_alive(last)
                                continue
                            last, pending = pending.result(), None
                            yield last
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(stop.wait(), interval_s)
                        if pending is not None:
                            await pending
                        yield await snapshot(False)  # the last one says draining
                    finally:
                        if pending is not None and not pending.done():
                            pending.cancel()

                await stub.Report(reports())
                backoff = 0.2
        except grpc.aio.AioRpcError as e:
            if stop.is_set():
                return
            log.debug("router %s unreachable (%s); retrying in %.1f s", router_address, e.code().name, backoff)
        try:
            await asyncio.wait_for(stop.wait(), backoff)
        except TimeoutError:
            backoff = min(backoff * 2, 2.0)
