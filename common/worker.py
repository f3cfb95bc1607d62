"""What prefill and decode workers share: engine start-up, the engine loop, metrics, the NIXL agent, reports."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from tokenmill.v1 import common_pb2, prefill_pb2, router_pb2

from common.cluster_config import ServiceConfig
from common.engine import LLMEngine, RequestOutput
from common.engine_loop import EngineLoop
from common.kv_transfer import KvCompat, KvTransferAgent
from common.load_report import engine_load, report_forever
from common.loader import load_model_source
from common.model_runner import KV_LAYOUT
from common.rpc import Unavailable
from common.sampling import SamplingParams
from common.sequence import FinishReason, PriorityClass

log = logging.getLogger(__name__)

FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.CONTENT_FILTER: common_pb2.FINISH_REASON_CONTENT_FILTER,
}


class WorkerMetrics:
    """vLLM-parallel names, prefixed ``tokenmill:`` (see ANCHORS.md)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter("tokenmill:request_success", "Finished requests by reason", ["finished_reason"],
                                registry=r)
        self.running = Gauge("tokenmill:num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("tokenmill:num_requests_waiting", "Sequences waiting for blocks", registry=r)
        self.class_running = Gauge("tokenmill:num_requests_running_by_class", "Sequences in the running batch, "
                                   "by priority class", ["priority_class"], registry=r)
        self.class_waiting = Gauge("tokenmill:num_requests_waiting_by_class", "Sequences waiting, by priority class",
                                   ["priority_class"], registry=r)
        self.kv_used = Gauge("tokenmill:kv_cache_usage_perc", "Fraction of KV blocks in use", registry=r)
        self.kv_free = Gauge("tokenmill:kv_blocks_free", "Free KV blocks", registry=r)
        self.kv_total = Gauge("tokenmill:kv_blocks_total", "KV blocks in the pool", registry=r)
        self.prefix_queries = Gauge("tokenmill:prefix_cache_queries", "Prompt tokens looked up", registry=r)
        self.prefix_hits = Gauge("tokenmill:prefix_cache_hits", "Prompt tokens served from the cache", registry=r)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Tokens generated", registry=r)
        self.queue_time = Histogram("tokenmill:request_queue_time_seconds", "Arrival to first schedule",
                                    registry=r)
        self.nixl_bytes = Gauge("tokenmill:nixl_xfer_bytes", "KV bytes moved over NIXL", registry=r)
        self.nixl_seconds = Gauge("tokenmill:nixl_xfer_seconds", "Seconds spent in NIXL transfers, summed over "
                                  "transfers (overlapping ones each count)", registry=r)
        self.nixl_busy = Gauge("tokenmill:nixl_xfer_busy_seconds", "Seconds with at least one NIXL transfer in "
                               "flight: bytes ÷ this is the bandwidth the link delivered", registry=r)
        self.nixl_failures = Gauge("tokenmill:nixl_xfer_failures", "Failed NIXL transfers", registry=r)
        self.steps = Gauge("tokenmill:engine_steps", "Engine steps run", registry=r)
        self.step_seconds = Gauge("tokenmill:engine_step_seconds", "Seconds spent in engine steps (schedule, "
                                  "forward, sampling, outputs), summed: ÷ engine_steps is the mean step", registry=r)
        self.step_decode_rows = Gauge("tokenmill:engine_step_decode_rows", "Decode rows over all steps, summed: "
                                      "÷ engine_steps is the mean decode batch", registry=r)
        self.step_prompt_tokens = Gauge("tokenmill:engine_step_prompt_tokens", "Prompt tokens computed over all "
                                        "steps, summed", registry=r)
        self.idle_seconds = Gauge("tokenmill:engine_idle_seconds", "Seconds the engine thread waited for work with "
                                  "no sequence to run", registry=r)
        self.expired_leases = Counter("tokenmill:nixl_expired_leases", "KV leases that expired unread",
                                      registry=r)
        # one observation per request's KV transfer, on both sides: decode from posting its READ to seeing it
        # complete, prefill from the decode worker's Claim to the READ's completion notification
        self.kv_transfer_seconds = Histogram(
            "tokenmill:kv_transfer_seconds", "A request's KV transfer over NIXL, seconds", registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0))
        self.kv_transfer_bytes = Histogram(
            "tokenmill:kv_transfer_bytes", "A request's KV transfer over NIXL, bytes", registry=r,
            buckets=tuple(float(1 << k) for k in range(20, 34)))  # 1 MiB .. 8 GiB
        self.kv_transfer_blocks = Histogram(
            "tokenmill:kv_transfer_blocks", "A request's KV transfer over NIXL, blocks", registry=r,
            buckets=tuple(float(1 << k) for k in range(0, 14)))  # 1 .. 8,192
        self.kv_recomputes = Counter(
            "tokenmill:kv_recomputes", "Prompts a decode worker recomputed instead of pulling their KV, by reason "
            "(claim_refused: the lease was gone or its holder unreachable; read_failed; read_timeout: the READ "
            "outlived the claim's hold; no_room: no free blocks for the pull)", ["reason"], registry=r)

    def observe_transfer(self, seconds: float, nbytes: int, blocks: int) -> None:
        self.kv_transfer_seconds.observe(seconds)
        self.kv_transfer_bytes.observe(nbytes)
        self.kv_transfer_blocks.observe(blocks)

    def bind(self, engine: LLMEngine, agent: KvTransferAgent | None, loop: EngineLoop | None = None) -> None:
        """Read the engine's and the agent's state at scrape time, so ``/metrics`` is never a report interval
        behind. Every read is a length or a number the engine thread replaces whole (atomic under the GIL)."""
        bm = engine.block_manager
        self.steps.set_function(lambda: engine.num_steps)
        self.step_seconds.set_function(lambda: engine.step_seconds)
        self.step_decode_rows.set_function(lambda: engine.step_decode_rows)
        self.step_prompt_tokens.set_function(lambda: engine.step_prompt_tokens)
        if loop is not None:
            self.idle_seconds.set_function(lambda: loop.idle_seconds)
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)

        def by_class(klass: PriorityClass, i: int) -> Callable[[], float]:
            """The class's count of waiting (``i`` 0) or running (1) requests."""
            return lambda: engine.num_by_class(klass)[i]

        for klass in PriorityClass:
            label = klass.name.lower()
            self.class_waiting.labels(label).set_function(by_class(klass, 0))
            self.class_running.labels(label).set_function(by_class(klass, 1))
        self.kv_used.set_function(bm.usage)
        self.kv_free.set_function(lambda: bm.num_free_blocks)
        self.kv_total.set_function(lambda: bm.num_blocks)
        self.prefix_queries.set_function(lambda: bm.stats.queries)
        self.prefix_hits.set_function(lambda: bm.stats.hits)
        if agent is not None:
            self.nixl_bytes.set_function(lambda: agent.bytes_transferred)
            self.nixl_seconds.set_function(lambda: agent.transfer_seconds)
            self.nixl_busy.set_function(lambda: agent.busy_seconds)
            self.nixl_failures.set_function(lambda: agent.failures)


def build_engine(cfg: ServiceConfig) -> LLMEngine:
    """Load the model and warm it up (one short request) so the first real one pays no start-up cost. Raises
    ValueError for a tensor-parallel prefill worker: the KV transfer would carry rank 0's shard alone."""
    tp = cfg.cluster.engine.tensor_parallel_size
    if cfg.role == "prefill" and tp > 1:
        raise ValueError(f"{cfg.name}: engine.tensor_parallel_size={tp} on a prefill worker: the KV transfer between "
                         f"the pools does not carry a tensor-parallel worker's shards; serve the aggregated layout "
                         f"(prefill.count=0)")
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    t0 = time.perf_counter()
    engine = LLMEngine(load_model_source(cfg.cluster.model, cfg.cluster.tokenizer_spec), cfg.cluster.engine)
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0.0))
    engine.reset_step_counters()  # /metrics counts served work only
    log.info("%s: model %s loaded and warmed in %.1f s (%d KV blocks)", cfg.name, engine.source.model_id,
             time.perf_counter() - t0, engine.block_manager.num_blocks)
    return engine


def make_agent(cfg: ServiceConfig, engine: LLMEngine) -> KvTransferAgent:
    kv = engine.runner.kv_cache
    role = cfg.role
    if role != "prefill" and role != "decode":
        raise ValueError(f"{cfg.name}: a KV transfer agent belongs to a prefill or decode worker")
    # the name is unique to this process: a restarted worker's peers see a new agent, never READ through the old
    return KvTransferAgent(f"{cfg.name}.{os.getpid()}", kv, KvCompat.for_pool(kv, engine.source.model_id, KV_LAYOUT),
                           role=role)


def compat_proto(c: KvCompat) -> prefill_pb2.KvCompat:
    return prefill_pb2.KvCompat(**c.as_dict())


def logprob_proto(lp: Any) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


class WorkerBase:
    """Engine + loop + agent + load reports; subclasses add their servicer and output handling."""

    role_proto: router_pb2.WorkerRole = router_pb2.WORKER_ROLE_UNSPECIFIED

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.role = cfg.role
        if cfg.cluster.worker_switch_interval_ms is not None:
            sys.setswitchinterval(cfg.cluster.worker_switch_interval_ms / 1000)
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = WorkerMetrics(self.registry)
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.agent: KvTransferAgent | None = None
        self.aio: asyncio.AbstractEventLoop | None = None
        self.draining = False
        # the engine thread died: set with the exception; ``stop_event`` then ends the service (exit code 1)
        self.failed: BaseException | None = None
        self.stop_event = asyncio.Event()
        self._events: dict[str, tuple[list[int], list[int]]] = {}  # per router: KV events not yet reported
        self._stop_reports = asyncio.Event()
        self._report_tasks: list[asyncio.Task[None]] = []

    # subclass hooks (engine thread)
    def on_outputs(self, outs: list[RequestOutput]) -> None:
        raise NotImplementedError

    def on_tick(self, engine: LLMEngine) -> None:
        return None

    def busy(self) -> bool:
        return False

    def fail_requests(self, exc: Exception) -> None:
        """Every request waiting on the engine ends with ``exc`` (asyncio loop; the engine thread died)."""
        raise NotImplementedError

    def _engine_failed(self, e: BaseException) -> None:  # engine thread
        self.call_in_aio(self._fail, e)

    def _fail(self, e: BaseException) -> None:
        self.failed = e
        self.draining = True
        self.fail_requests(Unavailable(f"{self.cfg.name}: its engine failed ({type(e).__name__}: {e}); the "
                                       f"request can be sent again"))
        self.stop_event.set()

    async def start(self) -> None:
        self.aio = asyncio.get_running_loop()

        def setup() -> LLMEngine:  # on the engine thread, the process's only torch thread (see common/engine_loop)
            engine = build_engine(self.cfg)
            self.agent = make_agent(self.cfg, engine)
            return engine

        self.loop = EngineLoop(setup, self.on_outputs, self.on_tick, self.busy, idle_tick_s=0.005,
                               on_failure=self._engine_failed)
        self.loop.start()
        self.engine = await asyncio.wrap_future(self.loop.ready)
        self.metrics.bind(self.engine, self.agent, self.loop)
        interval = self.cfg.cluster.worker_pool(self.cfg.role).report_interval_s
        # every router replica keeps its own view: each gets this worker's stream
        self._report_tasks = [
            asyncio.create_task(report_forever(addr, self._snapshot_for(addr), interval, self._stop_reports))
            for addr in self.cfg.cluster.addresses("router")
        ]

    def _snapshot_for(self, router: str) -> Callable[[bool], Awaitable[router_pb2.WorkerLoad]]:
        """Snapshots for one router's stream; KV events are kept per router, so each sees them all."""
        async def snapshot(first: bool) -> router_pb2.WorkerLoad:
            assert self.loop is not None

            def snap(e: LLMEngine) -> router_pb2.WorkerLoad:
                self._fan_out_events(e)
                load = engine_load(e, self.cfg.name, self.cfg.address, self.role_proto, full=first,
                                   draining=self.draining)
                if not first:
                    mine = self._events.pop(router, ([], []))
                    load.kv_events.stored.extend(mine[0])
                    load.kv_events.removed.extend(mine[1])
                else:
                    self._events.pop(router, None)
                return load

            return await asyncio.wrap_future(self.loop.submit(snap))

        return snapshot

    def _fan_out_events(self, e: LLMEngine) -> None:
        """Move the block manager's new events into every router's queue (engine thread)."""
        stored, removed = e.block_manager.drain_events()
        if not stored and not removed:
            return
        for addr in self.cfg.cluster.addresses("router"):
            s, r = self._events.setdefault(addr, ([], []))
            s.extend(stored)
            r.extend(removed)

    async def begin_drain(self) -> None:
        """SIGTERM: tell every router at once that no new work should come here."""
        self.draining = True
        if self.loop is not None and self.engine is not None:
            await asyncio.gather(*(self._send_one(addr) for addr in self.cfg.cluster.addresses("router")),
                                 return_exceptions=True)

    async def _send_one(self, router: str) -> None:
        """One extra report outside the streams (draining): a short unary-like stream of one message."""
        from tokenmill.v1 import router_pb2_grpc

        from common.rpc import GRPC_OPTIONS

        load = await self._snapshot_for(router)(False)
        load.draining = True

        async def one() -> AsyncIterator[router_pb2.WorkerLoad]:
            yield load

        async with grpc.aio.insecure_channel(router, options=GRPC_OPTIONS) as ch:
            await router_pb2_grpc.RouterStub(ch).Report(one(), timeout=2.0)

    async def stop(self) -> None:
        self.draining = True
        self._stop_reports.set()
        for task in self._report_tasks:
            try:
                await asyncio.wait_for(task, 2.0)
            except (TimeoutError, Exception):
                task.cancel()
        if self.loop is not None:
            await asyncio.to_thread(self.loop.stop)
        if self.engine is not None:
            self.engine.close()  # the engine thread has ended: stop the other tensor-parallel ranks, if any
        if self.agent is not None:
            self.agent.close()

    def call_in_aio(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the asyncio loop (from the engine or detok thread)."""
        assert self.aio is not None
        self.aio.call_soon_threadsafe(fn, *args)
