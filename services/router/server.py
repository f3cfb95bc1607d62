"""The Router service: ``Report`` streams in, ``Place`` and ``ListWorkers`` out. The policy is in ``placement.py``.

``PlaceStream`` is ``Place`` for many requests on one call: a gateway keeps one open per router (one message each
way a placement, not a call: services/gateway/place_stream.py).

Router replicas are stateless towards each other: every worker streams its load to every router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from tokenmill.v1 import router_pb2, router_pb2_grpc

from common import rpc, telemetry
from common.cluster_config import ServiceConfig
from services.router.placement import LoadReport, NoWorkers, Role, WorkerState, WorkerTable

log = logging.getLogger(__name__)

_ROLES = {router_pb2.WORKER_ROLE_PREFILL: Role.PREFILL, router_pb2.WORKER_ROLE_DECODE: Role.DECODE}
_PROTO_ROLES = {v: k for k, v in _ROLES.items()}


def report_from_proto(m: router_pb2.WorkerLoad) -> LoadReport:
    """Raises ValueError (→ INVALID_ARGUMENT) for a report the router cannot use."""
    if not m.worker_id or not m.address:
        raise ValueError("WorkerLoad needs worker_id and address")
    if m.role not in _ROLES:
        raise ValueError(f"worker {m.worker_id}: role must be WORKER_ROLE_PREFILL or WORKER_ROLE_DECODE")
    if m.block_size <= 0:
        raise ValueError(f"worker {m.worker_id}: block_size must be > 0, got {m.block_size}")
    ev = m.kv_events
    return LoadReport(
        worker_id=m.worker_id, address=m.address, role=_ROLES[m.role], model_id=m.model_id,
        block_size=m.block_size, free_blocks=m.free_blocks, total_blocks=m.total_blocks, running=m.running,
        waiting=m.waiting, queued_prefill_tokens=m.queued_prefill_tokens, stored=list(ev.stored),
        removed=list(ev.removed), reset=ev.reset, draining=m.draining,
    )


def load_to_proto(w: WorkerState) -> router_pb2.WorkerLoad:
    r = w.last
    return router_pb2.WorkerLoad(
        worker_id=r.worker_id, address=r.address, role=_PROTO_ROLES[r.role], model_id=r.model_id,
        block_size=r.block_size, free_blocks=r.free_blocks, total_blocks=r.total_blocks, running=r.running,
        waiting=r.waiting, queued_prefill_tokens=r.queued_prefill_tokens, draining=r.draining,
    )


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.placements = Counter("tokenmill:router_placements", "Placements by prefill mode",
                                  ["prefill"], registry=registry)
        self.place_errors = Counter("tokenmill:router_place_errors", "Place calls refused, by status code",
                                    ["code"], registry=registry)
        self.place_latency = Histogram("tokenmill:router_place_latency_seconds", "Time to place a request",
                                       buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1), registry=registry)
        self.cached_blocks = Histogram("tokenmill:router_prefix_overlap_blocks", "Prefix overlap of placements",
                                       buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=registry)
        self.reports = Counter("tokenmill:router_reports", "Worker load reports received", registry=registry)
        self.workers = Gauge("tokenmill:router_workers", "Live workers", ["role"], registry=registry)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, app: RouterService) -> None:
        self.app = app

    @rpc.translate_errors
    async def Place(self, request: router_pb2.PlaceRequest, context: grpc.aio.ServicerContext
                    ) -> router_pb2.Placement:
        with telemetry.span("route", telemetry.SERVER) as span:
            p = self.app.place(request)
            span.set_attributes(route_attributes(request, p))
        return p

    @rpc.translate_errors
    async def PlaceStream(self, request_iterator: AsyncIterator[router_pb2.PlaceStreamRequest],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[router_pb2.PlaceStreamReply]:
        """``Place`` for each request on the call, answered in order; a request's error is its reply's, and the
        call goes on."""
        async for m in request_iterator:
            yield self.app.place_streamed(m)

    @rpc.translate_errors
    async def Report(self, request_iterator, context: grpc.aio.ServicerContext) -> router_pb2.ReportAck:
        stream = object()
        worker_id = ""
        try:
            async for load in request_iterator:
                if load.heartbeat and worker_id == load.worker_id and self.app.table.touch(worker_id, time.monotonic(),
                                                                                             stream):
                    continue
                r = report_from_proto(load)
                if worker_id and r.worker_id != worker_id:
                    raise ValueError(f"one Report stream carries one worker: {worker_id}, then {r.worker_id}")
                if not worker_id:
                    log.info("worker %s (%s) at %s reporting", r.worker_id, r.role.value, r.address)
                worker_id = r.worker_id
                self.app.report(r, stream)
        finally:
            if worker_id and self.app.table.forget_stream(worker_id, stream):
                log.info("worker %s stream ended: forgotten", worker_id)
                self.app.update_gauges()
        return router_pb2.ReportAck()

    async def ListWorkers(self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
                          ) -> router_pb2.ListWorkersResponse:
        ws = sorted(self.app.table.workers.values(), key=lambda w: w.last.worker_id)
        return router_pb2.ListWorkersResponse(workers=[load_to_proto(w) for w in ws])


class RouterService:
    """The ``rpc.ServiceApp`` for the router."""

    role = "router"

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.table = WorkerTable(cfg.cluster.router)
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = RouterMetrics(self.registry)
        self._sweeper: asyncio.Task[None] | None = None

    def register(self, server: grpc.aio.Server) -> list[str]:
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(self), server)
        return [router_pb2.DESCRIPTOR.services_by_name["Router"].full_name]

    async def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    def report(self, r: LoadReport, stream: object) -> None:
        known = r.worker_id in self.table.workers
        self.table.report(r, time.monotonic(), stream)
        self.metrics.reports.inc()
        if not known:
            self.update_gauges()

    def place(self, req: router_pb2.PlaceRequest) -> router_pb2.Placement:
        """Raises ValueError for an empty prompt, rpc.Unavailable when no decode worker can take it."""
        t0 = time.perf_counter()
        if not req.prompt_token_ids:
            raise ValueError("PlaceRequest.prompt_token_ids is empty")
        try:
            d = self.table.place(req.prompt_token_ids, req.max_tokens, req.meta.cache_salt, time.monotonic(),
                                 req.exclude_workers)
        except NoWorkers as e:
            self.metrics.place_errors.labels("UNAVAILABLE").inc()
            raise rpc.Unavailable(str(e)) from e
        self.metrics.placements.labels("remote" if d.prefill else "local").inc()
        self.metrics.cached_blocks.observe(d.cached_blocks)
        self.metrics.place_latency.observe(time.perf_counter() - t0)
        out = router_pb2.Placement(decode=_ref(d.decode), cached_blocks=d.cached_blocks, reason=d.reason)
        if d.prefill is not None:
            out.prefill.CopyFrom(_ref(d.prefill))
        return out

    def place_streamed(self, m: router_pb2.PlaceStreamRequest) -> router_pb2.PlaceStreamReply:
        """One request of a ``PlaceStream``: its placement, or the status ``Place`` would have ended with; its
        ``route`` span a child of the request's trace."""
        req = m.request
        span = telemetry.start_span("route", parent=telemetry.incoming_context(list(m.trace.items())),
                                    kind=telemetry.SERVER)
        try:
            p = self.place(req)
        except Exception as e:
            code, message = rpc.status_for(e)
            telemetry.finish(span, attributes={"request_id": req.meta.request_id}, error=e)
            return router_pb2.PlaceStreamReply(id=m.id, error_code=code.value[0], error_message=message)
        telemetry.finish(span, attributes=route_attributes(req, p))
        return router_pb2.PlaceStreamReply(id=m.id, placement=p)

    def update_gauges(self) -> None:
        for role in Role:
            self.metrics.workers.labels(role.value).set(
                sum(1 for w in self.table.workers.values() if w.last.role is role))

    async def _sweep(self) -> None:
        period = max(0.05, min(1.0, self.table.policy.worker_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            for wid in self.table.forget_silent(time.monotonic()):
                log.warning("worker %s silent for over %.1f s: forgotten", wid, self.table.policy.worker_timeout_s)
                self.update_gauges()


def route_attributes(req: router_pb2.PlaceRequest, p: router_pb2.Placement) -> dict[str, str | int]:
    """A placement's ``route`` span attributes, whichever call asked for it."""
    return {"request_id": req.meta.request_id, "decode_worker": p.decode.worker_id,
            "prefill_worker": p.prefill.worker_id, "cached_blocks": p.cached_blocks}


def _ref(w: WorkerState) -> router_pb2.WorkerRef:
    return router_pb2.WorkerRef(worker_id=w.last.worker_id, address=w.last.address)


def serve(cfg: ServiceConfig) -> int:
    """``tokenmill serve router``."""
    return rpc.run(RouterService(cfg), cfg)
