"""What the fronts of prefill and decode workers share: their engine core (common/engine_core.py), metrics, load
reports."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from tokenmill.v1 import common_pb2, prefill_pb2, router_pb2, worker_pb2, worker_pb2_grpc

from common import gc_watch, rpc
from common.cluster_config import ServiceConfig
from common.engine import STEP_PHASES, LLMEngine
from common.engine_core import CoreHandle, CoreInfo, ProcessCore, ThreadCore, WorkerCore
from common.engine_loop import LOOP_PARTS, EngineLoop
from common.kv_transfer import KvCompat
from common.load_report import report_forever
from common.rpc import Unavailable
from common.sampling import SamplingParams
from common.sequence import FinishReason, PriorityClass
from common.tokenizer import TextTokenizer

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
        latency = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
        self.queue_time = Histogram("tokenmill:request_queue_time_seconds", "A request's arrival in the engine to "
                                    "the first step that computes its prompt", registry=r, buckets=latency)
        self.engine_ttft = Histogram("tokenmill:engine_time_to_first_token_seconds", "A request's arrival in the "
                                     "engine to its first token (computed on this worker)", registry=r,
                                     buckets=latency)
        self.nixl_bytes = Gauge("tokenmill:nixl_xfer_bytes", "KV bytes moved over NIXL", registry=r)
        self.nixl_seconds = Gauge("tokenmill:nixl_xfer_seconds", "Seconds spent in NIXL transfers, summed over "
                                  "transfers (overlapping ones each count)", registry=r)
        self.nixl_busy = Gauge("tokenmill:nixl_xfer_busy_seconds", "Seconds with at least one NIXL transfer in "
                               "flight: bytes ÷ this is the bandwidth the link delivered", registry=r)
        self.nixl_failures = Gauge("tokenmill:nixl_xfer_failures", "Failed NIXL transfers", registry=r)
        self.nixl_reads = Gauge("tokenmill:nixl_xfer_reads", "NIXL READs posted", registry=r)
        self.nixl_descriptors = Gauge("tokenmill:nixl_xfer_descriptors", "Descriptors of the NIXL READs posted, "
                                      "after merging the block runs contiguous on both sides: ÷ reads is the "
                                      "mean per READ (UCX copies each on its own)", registry=r)
        self.nixl_post = Gauge("tokenmill:nixl_xfer_post_seconds", "Seconds the engine thread spent posting NIXL "
                               "READs, summed", registry=r)
        self.nixl_warmups = Gauge("tokenmill:nixl_xfer_warmups", "One-block READs that woke an idle link ahead of a "
                                  "pull (not in the READs, bytes or seconds above)", registry=r)
        self.steps = Gauge("tokenmill:engine_steps", "Engine steps run", registry=r)
        self.step_seconds = Gauge("tokenmill:engine_step_seconds", "Seconds spent in engine steps (schedule, "
                                  "forward, sampling, outputs), summed: ÷ engine_steps is the mean step", registry=r)
        self.step_decode_rows = Gauge("tokenmill:engine_step_decode_rows", "Decode rows over all steps, summed: "
                                      "÷ engine_steps is the mean decode batch", registry=r)
        self.step_prompt_tokens = Gauge("tokenmill:engine_step_prompt_tokens", "Prompt tokens computed over all "
                                        "steps, summed", registry=r)
        self.engine_gc_pause = Histogram("tokenmill:engine_gc_pause_seconds", "Garbage collection pauses in the "
                                         "engine core's process, by generation collected", ["generation"],
                                         registry=r, buckets=gc_watch.BUCKETS)
        self.step_phase_seconds = Gauge("tokenmill:engine_step_phase_seconds", "Seconds of the engine steps' host "
                                        "time by phase, summed (schedule, launch, wait: blocked on the device for "
                                        "picked tokens, outputs, sample, other): common/engine.py, STEP_PHASES",
                                        ["phase"], registry=r)
        self.loop_seconds = Gauge("tokenmill:engine_loop_seconds", "Seconds of the engine thread's work between "
                                  "steps, by part, summed (commands, tick: KV pulls and leases, before, outputs, "
                                  "after: common/engine_loop.py, LOOP_PARTS)", ["part"], registry=r)
        self.grammar_masks = Gauge("tokenmill:grammar_masks", "Constrained rows' grammar masks, summed, by where "
                                   "they came from (cache: the grammar mask process's cache of masks by place; "
                                   "process: llguidance in that process; inline: the engine's own thread)",
                                   ["source"], registry=r)
        self.grammar_mask_batches = Gauge("tokenmill:grammar_mask_batches", "Batches of constrained rows' masks the "
                                          "grammar mask process answered", registry=r)
        self.grammar_mask_fill_seconds = Gauge("tokenmill:grammar_mask_fill_seconds", "Seconds the grammar mask "
                                               "process took to advance its matchers and fill their masks, summed "
                                               "over its batches", registry=r)
        self.grammar_mask_slow_batches = Gauge("tokenmill:grammar_mask_slow_batches", "The grammar mask process's "
                                               "batches whose fill took over 1 ms (common/grammar_proc.py, "
                                               "SLOW_FILL_S): a small model's step, which the pick waits past",
                                               registry=r)
        self.idle_seconds = Gauge("tokenmill:engine_idle_seconds", "Seconds the engine thread waited for work with "
                                  "no sequence to run", registry=r)
        self.cpu_seconds = Gauge("tokenmill:engine_thread_cpu_seconds", "CPU seconds of the engine thread since the "
                                 "engine was ready; its busy time (engine_step_seconds plus engine_loop_seconds) less "
                                 "this is time it could not run: waiting for the GIL or a blocking write",
                                 registry=r)
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

    def bind(self, stats: Callable[[], dict[str, float]]) -> None:
        """Read the engine's and the agent's counters at scrape time from ``stats()``: the engine core's last
        report, renewed every ``STATS_INTERVAL_S`` while it works and when it goes idle (``WorkerCore.stats``: a
        key per gauge of ``STATS_GAUGES``, named as the gauge's attribute here, and the priority classes'
        ``waiting_CLASS`` / ``running_CLASS``)."""
        def read(key: str) -> Callable[[], float]:
            return lambda: stats().get(key, 0.0)

        for key in STATS_GAUGES:
            getattr(self, key).set_function(read(key))
        for phase in STEP_PHASES:
            self.step_phase_seconds.labels(phase).set_function(read(f"phase_{phase}"))
        for part in LOOP_PARTS:
            self.loop_seconds.labels(part).set_function(read(f"loop_{part}"))
        for source in GRAMMAR_MASK_SOURCES:
            self.grammar_masks.labels(source).set_function(read(f"grammar_masks_{source}"))
        for klass in PriorityClass:
            label = klass.name.lower()
            self.class_waiting.labels(label).set_function(read(f"waiting_{label}"))
            self.class_running.labels(label).set_function(read(f"running_{label}"))


# where a constrained row's mask came from (GrammarCompiler.mask_counts, tokenmill:grammar_masks)
GRAMMAR_MASK_SOURCES = ("cache", "process", "inline")

# the gauges ``WorkerMetrics.bind`` reads from the engine core's counters, by attribute (= the counter's key)
STATS_GAUGES = ("steps", "step_seconds", "step_decode_rows", "step_prompt_tokens", "idle_seconds", "cpu_seconds",
                "running", "waiting", "kv_used", "kv_free", "kv_total", "prefix_queries", "prefix_hits",
                "nixl_bytes", "nixl_seconds", "nixl_busy", "nixl_failures", "nixl_reads", "nixl_descriptors",
                "nixl_post", "nixl_warmups", "grammar_mask_batches", "grammar_mask_fill_seconds",
                "grammar_mask_slow_batches")


def compat_proto(c: KvCompat) -> prefill_pb2.KvCompat:
    return prefill_pb2.KvCompat(**c.as_dict())


def logprob_proto(lp: Any) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


class WorkerBase:
    """The front of a model worker: its engine core (``common/engine_core.py``; ``core_class`` says which), load
    reports to every router, and the metrics; subclasses add their servicer and what they do with the core's
    events (``ev_<kind>`` methods, called on the engine thread or the core's pipe reader: keep them cheap)."""

    role_proto: router_pb2.WorkerRole = router_pb2.WORKER_ROLE_UNSPECIFIED
    core_class: type[WorkerCore] = WorkerCore

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.role = cfg.role
        if cfg.cluster.worker_switch_interval_ms is not None:
            sys.setswitchinterval(cfg.cluster.worker_switch_interval_ms / 1000)
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = WorkerMetrics(self.registry)
        self.core: CoreHandle | None = None
        self.info: CoreInfo | None = None
        self.tokenizer: TextTokenizer | None = None
        self.stats: dict[str, float] = {}  # the core's last counters (``ev_stats``)
        # with the engine on a thread of this process (``worker_engine_process`` false) only: tests reach into them
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.aio: asyncio.AbstractEventLoop | None = None
        self.draining = False
        # the engine failed: set with the exception; ``stop_event`` then ends the service (exit code 1)
        self.failed: BaseException | None = None
        self.stop_event = asyncio.Event()
        self._events: dict[str, tuple[list[int], list[int]]] = {}  # per router: KV events not yet reported
        self._stop_reports = asyncio.Event()
        self._report_tasks: list[asyncio.Task[None]] = []

    # -- the core's events (engine thread or pipe reader) --------------------------------------------------
    def on_core_event(self, kind: str, *args: Any) -> None:
        getattr(self, f"ev_{kind}")(*args)

    def ev_stats(self, stats: dict[str, float]) -> None:
        self.stats = stats

    def ev_engine_gc(self, generation: int, seconds: float) -> None:
        self.metrics.engine_gc_pause.labels(str(generation)).observe(seconds)

    def ev_latencies(self, queued: list[float], first_tokens: list[float]) -> None:
        for v in queued:
            self.metrics.queue_time.observe(v)
        for v in first_tokens:
            self.metrics.engine_ttft.observe(v)

    def fail_requests(self, exc: Exception) -> None:
        """Every request waiting on the engine ends with ``exc`` (asyncio loop; the engine failed)."""
        raise NotImplementedError

    def _engine_failed(self, e: BaseException) -> None:  # engine thread or pipe reader
        self.call_in_aio(self._fail, e)

    def _fail(self, e: BaseException) -> None:
        self.failed = e
        self.draining = True
        self.fail_requests(Unavailable(f"{self.cfg.name}: its engine failed ({type(e).__name__}: {e}); the "
                                       f"request can be sent again"))
        self.stop_event.set()

    async def call(self, method: str, *args: Any) -> Any:
        """``core.method(*args)`` on the engine thread, before its next step. Runs even if the caller is
        cancelled while it waits."""
        assert self.core is not None
        return await asyncio.wrap_future(self.core.call(method, *args))

    def cast(self, method: str, *args: Any) -> None:
        """``call`` without waiting for it (any thread)."""
        assert self.core is not None
        self.core.call(method, *args)

    def now(self, method: str, *args: Any) -> None:
        """``core.method(*args)`` at once, off the engine thread, without waiting (``CoreHandle.now``)."""
        assert self.core is not None
        self.core.now(method, *args)

    async def validate(self, prompt: list[int], params: SamplingParams) -> int:
        """The engine's checks of a request; raises RequestError. Checked here against the engine's fixed limits
        (``CoreInfo.limits``), with no round trip to the engine's process on the request's way in; only a grammar
        goes to the core, which compiles and caches it off the engine thread."""
        assert self.core is not None and self.info is not None
        if params.structured is None:
            return self.info.limits.check(prompt, params)
        return await asyncio.wrap_future(self.core.validate(prompt, params))

    async def start(self) -> None:
        self.aio = asyncio.get_running_loop()
        handle = ProcessCore if self.cfg.cluster.worker_engine_process else ThreadCore
        self.core = handle(self.core_class, self.cfg, self.on_core_event, self._engine_failed)
        self.core.start()
        self.info = await asyncio.wrap_future(self.core.ready)
        if isinstance(self.core, ThreadCore):
            self.loop, self.engine = self.core.loop, self.core.core.engine
            self.tokenizer = self.engine.tokenizer if self.engine is not None else None
        elif self.info.tokenizer is not None:
            self.tokenizer = self.info.tokenizer.build()
        self.metrics.bind(lambda: self.stats)
        interval = self.cfg.cluster.worker_pool(self.cfg.role).report_interval_s
        # every router replica keeps its own view: each gets this worker's stream
        self._report_tasks = [
            asyncio.create_task(report_forever(addr, self._snapshot_for(addr), interval, self._stop_reports))
            for addr in self.cfg.cluster.addresses("router")
        ]

    def _snapshot_for(self, router: str) -> Callable[[bool], Awaitable[router_pb2.WorkerLoad]]:
        """Snapshots for one router's stream; KV events are kept per router, so each sees them all."""
        async def snapshot(first: bool) -> router_pb2.WorkerLoad:
            load, stored, removed = await self.call("load", self.cfg.name, self.cfg.address, self.role_proto, first,
                                                    self.draining)
            if stored or removed:
                for addr in self.cfg.cluster.addresses("router"):
                    s, r = self._events.setdefault(addr, ([], []))
                    s.extend(stored)
                    r.extend(removed)
            if not first:
                mine = self._events.pop(router, ([], []))
                load.kv_events.stored.extend(mine[0])
                load.kv_events.removed.extend(mine[1])
            else:
                self._events.pop(router, None)
            return load

        return snapshot

    async def begin_drain(self) -> None:
        """SIGTERM: tell every router at once that no new work should come here."""
        self.draining = True
        if self.info is not None and self.failed is None:
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
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # stop() itself was cancelled
                # else the report task ended cancelled (gRPC cancels its stream when the channel closes under it)
            except (TimeoutError, Exception):
                task.cancel()
        if self.core is not None:
            await asyncio.to_thread(self.core.stop)

    def register_admin(self, server: grpc.aio.Server) -> list[str]:
        """Serve ``WorkerAdmin`` (every model worker's operator calls); its service name, for health and
        reflection."""
        worker_pb2_grpc.add_WorkerAdminServicer_to_server(WorkerAdminServicer(self), server)
        return [worker_pb2.DESCRIPTOR.services_by_name["WorkerAdmin"].full_name]

    def call_in_aio(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the asyncio loop (from the engine thread, the core's pipe reader or the detok
        thread)."""
        assert self.aio is not None
        self.aio.call_soon_threadsafe(fn, *args)


class WorkerAdminServicer(worker_pb2_grpc.WorkerAdminServicer):
    """Operator calls on one model worker."""

    def __init__(self, worker: WorkerBase) -> None:
        self.worker = worker

    @rpc.translate_errors
    async def Profile(self, request: worker_pb2.ProfileRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.ProfileResponse:
        """Start or stop the engine's profiler (common/profiling.py), between two of its steps."""
        path = await self.worker.call("profile", request.start)
        return worker_pb2.ProfileResponse(worker_id=self.worker.cfg.name, trace_path=path)
