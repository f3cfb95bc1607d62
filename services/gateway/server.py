"""The gateway's gRPC ``Frontend.Generate`` (and, through the same ``generate``, the OpenAI HTTP API of
``services/gateway/http.py``): validate → tokenize (pool) → ``Router.Place`` → ``Prefill.Prefill``
(when placed remotely) → ``Decode.Decode``, whose deltas are forwarded to the client as they come.

- The first token is not held back for the KV transfer: the decode worker streams it as its first message,
  before it pulls the KV.
- Client cancellation cancels the Decode call (the decode worker frees its blocks and gives the prefill lease
  back). The gateway names each prefill lease itself, so it releases the lease when the client leaves during
  the Prefill call (whether or not the result came back), before Decode was called, or before the decode worker
  answered (then only while no decode worker has claimed it: a claimed lease may have a READ under it).
- A worker that fails with UNAVAILABLE before any token reached the client is excluded and the request re-placed
  (``gateway.placement_retries`` times, a prefill result is kept).
- Tenants (``services/gateway/tenancy.py``): the door names the request's tenant by its API key and takes its
  request token; after tokenization its tokens are charged, and the RequestMeta of every worker call carries the
  tenant, its priority class, weight, running cap and cache scope; when it ends the bill is settled, counted and
  audited (``services/gateway/accounting.py``).
- A decode worker that fails with UNAVAILABLE (died, unreachable, its engine failed) after tokens reached the
  client: the stream moves (``gateway.migration_limit`` times). The request is placed again, that worker
  excluded, with the tokens already sent as its prior outputs; the new decode worker recomputes prompt + those
  tokens (its prefix cache helps) and streams what follows, so the client sees no token twice and none missing.
- With ``gateway.response_cache_bytes`` set, a deterministic request (temperature 0 or a seed) asked again within
  ``gateway.response_cache_ttl_s`` is replayed from the response cache (``services/gateway/response_cache.py``)
  before tokenization: no tokenizer, router or worker call.
- The output filter runs on the decode worker; a stream it blocks ends with ``FINISH_REASON_CONTENT_FILTER`` and
  ``filter_reason``, passed on as they come. An answer that ends at the prefill worker is checked here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter as Tally
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from tokenmill.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    frontend_pb2,
    frontend_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

from common import rpc, structured, telemetry
from common.cluster_config import ServiceConfig
from common.leases import release_lease
from common.loop_lag import LoopLag
from common.output_filter import PolicySet
from common.wire import sampling_params_from_proto
from services.gateway.accounting import Accounting, AuditRecord
from services.gateway.decode_stream import DecodeStreams
from services.gateway.host_limits import HostLimits, in_flight_capped
from services.gateway.http import RETRY_AFTER_S, HttpFrontend
from services.gateway.place_stream import PlaceStreams
from services.gateway.pools import ChannelPool
from services.gateway.response_cache import CacheMetrics, ResponseCache, cacheable
from services.gateway.resume import ResumableStreams, StreamGone
from services.gateway.tenancy import CLASS_NAME, Charge, QuotaExceeded, RequestTooLarge, Tenancy, Tenant

log = logging.getLogger(__name__)

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort", common_pb2.FINISH_REASON_CONTENT_FILTER: "content_filter"}
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


def validate(req: frontend_pb2.GenerateRequest) -> None:
    """Raise ValueError (→ INVALID_ARGUMENT) with a message the client can act on."""
    which = req.WhichOneof("input")
    if which is None:
        raise ValueError("GenerateRequest needs an input: set one of prompt, chat or prompt_token_ids")
    if which == "prompt" and not req.prompt:
        raise ValueError("prompt is empty; send at least one character")
    if which == "chat":
        if not req.chat.messages:
            raise ValueError("chat.messages is empty; send at least one message")
        for i, m in enumerate(req.chat.messages):
            if not m.role:
                raise ValueError(f"chat.messages[{i}].role is empty; use system, user or assistant")
    if which == "prompt_token_ids":
        ids = req.prompt_token_ids.ids
        if not ids:
            raise ValueError("prompt_token_ids is empty; send at least one token id")
        bad = next((i for i, t in enumerate(ids) if t < 0), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids[{bad}] is {ids[bad]}; token ids are >= 0")
    if req.priority < 0:
        raise ValueError(f"priority must be >= 0 (0 = interactive, 10 = batch), got {req.priority}")
    if req.priority_class not in CLASS_NAME and req.priority_class != common_pb2.PRIORITY_CLASS_UNSPECIFIED:
        raise ValueError(f"priority_class {req.priority_class} is not a class; use PRIORITY_CLASS_INTERACTIVE, "
                         "_STANDARD or _BATCH (unset: the tenant's default)")
    params = sampling_params_from_proto(req.params)
    params.validate(vocab_size=2**31 - 1)  # the worker checks the vocabulary
    if params.structured is not None:
        structured.check(params.structured)  # GrammarError is a ValueError naming the problem


class GatewayMetrics:
    """vLLM's names under ``tokenmill:``, so existing dashboards need one prefix changed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.success = Counter("tokenmill:request_success", "Finished requests by finish reason",
                               ["finished_reason"], registry=r)
        self.failure = Counter("tokenmill:request_failure", "Requests that ended with an error, by status code",
                               ["code"], registry=r)
        self.ttft = Histogram("tokenmill:time_to_first_token_seconds", "Time to first token, at the gateway",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("tokenmill:inter_token_latency_seconds", "Time between output tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("tokenmill:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Generated tokens", registry=r)
        self.running = Gauge("tokenmill:num_requests_running", "Requests in flight at the gateway", registry=r)
        self.retries = Counter("tokenmill:request_replacements", "Re-placements after a worker failed",
                               ["role"], registry=r)
        self.migrations = Counter("tokenmill:request_migrations", "Streams moved to another decode worker after "
                                  "theirs failed mid-stream", registry=r)
        self.loop_lag = Histogram("tokenmill:gateway_loop_lag_seconds", "How late the gateway's event loop woke a "
                                  "10 ms timer: time every request through this gateway waited too",
                                  buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
                                  registry=r)


class _Timing:
    """TTFT / ITL bookkeeping of one stream."""

    def __init__(self, m: GatewayMetrics) -> None:
        self.m, self.t0, self.tokens = m, time.perf_counter(), 0
        self.last: float | None = None
        self.span = telemetry.current_span()  # the request's ``generate`` span: its first token is an event there

    def on_tokens(self, k: int) -> None:
        if k <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.m.ttft.observe(now - self.t0)
            self.span.add_event("first_token")
        else:
            gap = (now - self.last) / k
            for _ in range(k):
                self.m.itl.observe(gap)
        self.last = now
        self.tokens += k


@dataclass(slots=True)
class _Attempts:
    """One request's placement attempts: what failed, the prefill result, who owns its lease."""

    max_retries: int
    max_migrations: int = 0
    exclude: list[str] = field(default_factory=list)
    pre: prefill_pb2.PrefillResult | None = None
    lease: str = ""  # who frees pre's lease: "" nobody (none, or settled), "ours", or "decode" (sent to a decode worker)
    done: bool = False
    sent: list[int] = field(default_factory=list)  # token ids streamed to the client so far
    migrations: int = 0

    def retry(self, failed_worker: str) -> bool:
        """Exclude ``failed_worker``; False when the retries are spent."""
        if len(self.exclude) >= self.max_retries:
            return False
        self.exclude.append(failed_worker)
        return True


class FrontendServicer(frontend_pb2_grpc.FrontendServicer):
    def __init__(self, app: GatewayService) -> None:
        self.app = app

    @rpc.translate_errors
    async def Generate(self, request: frontend_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        with telemetry.stream_span("generate") as span:  # the root of the request's trace (or the client's child)
            tenant = self.app.identify(*_identity(context), request.request_id, request.model)
            try:
                self.app.admit_in_flight(tenant, request.request_id, request.model)  # counted in flight from here
            except QuotaExceeded as e:
                _refuse(context, span, e)
                return
            with self.app.in_flight(tenant, admitted=True):  # released however the call ends
                try:
                    self.app.admit_request(tenant, request.request_id, request.model)
                except QuotaExceeded as e:
                    _refuse(context, span, e)
                    return
                if tenant.has_quotas:  # OpenAI's x-ratelimit-* headers, as metadata
                    await context.send_initial_metadata(_grpc_headers(tenant.ratelimit_headers()))
                left = context.time_remaining()
                deadline = None if left is None else time.monotonic() + left
                try:
                    async for resp in self._generate(request, tenant, deadline):
                        yield resp
                except (QuotaExceeded, RequestTooLarge) as e:
                    self.app.tenancy.refund_request(tenant)  # refused after the door: nothing is half-admitted
                    if isinstance(e, QuotaExceeded):
                        context.set_trailing_metadata(_grpc_headers({**e.headers, **tenant.ratelimit_headers()}))
                    raise

    async def _generate(self, request: frontend_pb2.GenerateRequest, tenant: Tenant, deadline: float | None
                        ) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        """The request's responses: straight from the generation, or through the resumable streams."""
        streams = self.app.streams
        if streams is None:
            async for resp in self.app.generate(request, tenant, deadline):
                yield resp
            return
        req = frontend_pb2.GenerateRequest()
        req.CopyFrom(request)
        req.request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        gen = self.app.generate(req, tenant, deadline)
        sl = streams.start(req.request_id, gen, owner=tenant.name)
        async for resp in streams.follow(sl):
            yield resp

    @rpc.translate_errors
    async def Resume(self, request: frontend_pb2.ResumeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        streams = self.app.streams
        tenant = self.app.tenancy.identify(*_identity(context))
        if streams is None:
            raise StreamGone("resume is off on this gateway (gateway.resume_window_s is 0)")
        with self.app.in_flight(tenant):  # counted as HTTP's resumes are; admitted when it was first sent
            async for resp in streams.follow(streams.get(request.request_id, tenant.name), request.after_seq):
                yield resp


class GatewayService:
    """The ``rpc.ServiceApp`` for the gateway (gRPC half)."""

    role = "gateway"

    def __init__(self, cfg: ServiceConfig) -> None:
        c = cfg.cluster
        self.cfg = cfg
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = GatewayMetrics(self.registry)
        limit = c.gateway.max_inflight_per_channel
        self.tokenizers = ChannelPool(c.addresses("tokenizer"), tokenizer_pb2_grpc.TokenizerStub, limit)
        self.routers = ChannelPool(c.addresses("router"), router_pb2_grpc.RouterStub, limit)
        self.workers = rpc.StubCache()
        self.decode_streams = DecodeStreams(self.workers) if c.gateway.decode_stream else None
        self.placements = PlaceStreams(self.routers) if c.gateway.place_stream else None
        self.stream_intervals = c.gateway.class_stream_interval_ms
        self._background = rpc.Background()
        window = c.gateway.resume_window_s
        self.streams: ResumableStreams | None = ResumableStreams(window) if window > 0 else None
        # the quota state this host's gateways share (`tokenmill up` with several gateways); None: this process's own
        path = c.gateway.shared_limits_file
        self.limits = HostLimits(path, c, cfg.index) if path else None
        # the tenants' in-flight counts go to that file only where a cap reads them
        self._shared_counts = self.limits if self.limits is not None and in_flight_capped(c) else None
        self.tenancy = Tenancy.from_config(c, shared=self.limits)
        self.accounting = Accounting(self.registry, c.gateway.audit_log, c.gateway.log_prompts,
                                     self.tenancy.tenants)
        self.cache: ResponseCache | None = None
        if c.gateway.response_cache_bytes > 0:
            self.cache = ResponseCache(c.gateway.response_cache_bytes, c.gateway.response_cache_ttl_s,
                                       CacheMetrics(self.registry))
        self.policies = PolicySet(c.output_filter, c.model)  # for an answer that ends at prefill (no decode)
        self.inflight = 0  # requests in flight through either front door (admit_in_flight, in_flight)
        self.tenant_inflight: Tally[str] = Tally()  # at this gateway, where the host's gateways do not share them
        self.http = HttpFrontend(self)
        self.loop_lag = LoopLag(observe=self.metrics.loop_lag.observe)

    def register(self, server: grpc.aio.Server) -> list[str]:
        service = frontend_pb2.DESCRIPTOR.services_by_name["Frontend"]
        rpc.add_servicer(server, service, FrontendServicer(self))  # bytes that do not parse: INVALID_ARGUMENT
        return [service.full_name]

    async def start(self) -> None:
        if not self.tokenizers.addresses or not self.routers.addresses:
            raise RuntimeError("the gateway needs at least one tokenizer and one router address in the config")
        c = self.cfg.cluster
        self.accounting.open()
        self.loop_lag.start()
        await self.http.start(c.host, c.gateway_public_ports(self.cfg.index)[1], reuse_port=c.gateways_share_ports)

    async def begin_drain(self) -> None:
        self.http.draining = True  # /health and new HTTP requests: 503 from now on, each answer closing its connection
        if self.cfg.cluster.gateways_share_ports:  # the kernel gives new connections to the host's other gateways
            await self.http.stop_listening()

    async def stop(self) -> None:
        await self.loop_lag.stop()
        await self.http.stop()
        if self.streams is not None:
            await self.streams.close()
        await self._background.drain(timeout=2)
        if self.decode_streams is not None:
            await self.decode_streams.close()
        if self.placements is not None:
            await self.placements.close()
        await self.tokenizers.close()
        await self.routers.close()
        await self.workers.close()
        self.accounting.close()

    # -- the request path ---------------------------------------------------------------------------------
    def identify(self, authorization: str | None, claimed_tenant: str, request_id: str, model: str) -> Tenant:
        """A request's tenant by its key (``claimed_tenant``, the client's x-tenant-id, only while no key is
        configured). Raises Unauthenticated; the refusal is counted and audited."""
        try:
            return self.tenancy.identify(authorization, claimed_tenant)
        except rpc.Unauthenticated:
            self.accounting.refused(None, "unauthenticated", AuditRecord(
                "", request_id, model or self.cfg.cluster.model, "UNAUTHENTICATED"))
            raise

    def admit_in_flight(self, tenant: Tenant, request_id: str, model: str) -> None:
        """The gateway's and the tenant's in-flight caps (``gateway.max_inflight_requests``; the tenant's
        ``max_inflight``, else ``gateway.tenant_max_inflight``), one count for both front doors. Checks them and
        counts the request in flight in one step (a tenant's count shared by the host's gateways: under the file's
        lock), so requests arriving together cannot all pass a cap one below; the caller then runs the request in
        ``in_flight(tenant, admitted=True)``, which releases the count however it ends. With
        ``gateway.quota_shares`` N a tenant's cap here is 1/N of it, rounded up. Raises QuotaExceeded (HTTP
        429, gRPC RESOURCE_EXHAUSTED, Retry-After), counting nothing; the refusal is counted and audited. Checked
        before the request's quota takes anything."""
        g = self.cfg.cluster.gateway
        cap, key = g.tenant_max_inflight, "gateway.tenant_max_inflight"
        if tenant.cfg.max_inflight:
            cap, key = tenant.cfg.max_inflight, f"tenants.{tenant.name}.max_inflight"
        share = cap if cap is None else -(-cap // g.quota_shares)  # this gateway's share of the cap, rounded up
        if self.inflight >= g.max_inflight_requests:
            msg, code = (f"the gateway queue is full ({self.inflight} requests in flight); retry after the "
                         "Retry-After seconds", "queue_full")
        elif not self._count(tenant.name, 1, share):
            split = (f", {share} at each of the {g.quota_shares} gateways that split it (gateway.quota_shares)"
                     if g.quota_shares > 1 else "")
            msg, code = (f"tenant {tenant.name or '(default)'} is over its quota of {cap} requests in flight "
                         f"({key}){split}; retry after the Retry-After seconds", "quota_exceeded")
        else:
            self.inflight += 1
            return
        self.accounting.refused(tenant, "in_flight", AuditRecord(
            tenant.name, request_id, model or self.cfg.cluster.model, "RESOURCE_EXHAUSTED"))
        raise QuotaExceeded(msg, "in_flight", RETRY_AFTER_S, {"Retry-After": str(RETRY_AFTER_S)},
                            openai_code=code)

    def tenant_in_flight(self, name: str) -> int:
        """The tenant's requests in flight: at every gateway of the host when they share their counts."""
        shared = self._shared_counts
        return shared.in_flight(name) if shared is not None else self.tenant_inflight[name]

    def _count(self, name: str, delta: int, below: int | None = None) -> bool:
        """Add ``delta`` to the tenant's in-flight count; with ``below``, only if the count is below it (one step).
        False: it was not, and nothing was added."""
        shared = self._shared_counts
        if shared is not None:
            return shared.add_in_flight(name, delta, below)
        n = self.tenant_inflight[name]
        if below is not None and n >= below:
            return False
        if n + delta:
            self.tenant_inflight[name] = n + delta
        else:
            del self.tenant_inflight[name]
        return True

    @contextlib.contextmanager
    def in_flight(self, tenant: Tenant, admitted: bool = False) -> Iterator[None]:
        """Counts a request in flight, at this gateway and for its tenant, while the block runs. ``admitted``:
        ``admit_in_flight`` counted it already; the block's end releases that count."""
        if not admitted:
            self.inflight += 1
            self._count(tenant.name, 1)
        try:
            yield
        finally:
            self.inflight -= 1
            self._count(tenant.name, -1)

    def admit_request(self, tenant: Tenant, request_id: str, model: str) -> None:
        """Take the request's token from the tenant's requests-per-minute bucket (before any work). Raises
        QuotaExceeded; the refusal is counted and audited."""
        try:
            self.tenancy.admit_request(tenant)
        except QuotaExceeded:
            self.accounting.refused(tenant, "requests", AuditRecord(
                tenant.name, request_id, model or self.cfg.cluster.model, "RESOURCE_EXHAUSTED"))
            raise

    async def generate(self, req: frontend_pb2.GenerateRequest, tenant: Tenant, deadline: float | None = None
                       ) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        """One generation of ``tenant`` (admitted at the door by ``admit_request``): its tokens are charged to the
        tenant's token quota after tokenization (QuotaExceeded, RequestTooLarge) and settled when it ends.
        ``deadline`` (``time.monotonic()``; None: none) bounds every call it makes; nothing else of the caller's
        is read, so the gRPC call, the HTTP API and a resumable stream that outlives its call all run it alike."""
        gw = self.cfg.cluster.gateway
        timing = _Timing(self.metrics)
        st = _Attempts(gw.placement_retries, gw.migration_limit)
        rec = AuditRecord(tenant.name, req.request_id, req.model or self.cfg.cluster.model, "CANCELLED")
        charge: Charge | None = None
        from_cache = False
        output: list[str] = []
        self.metrics.running.inc()
        outcome = "CANCELLED"
        try:
            validate(req)
            rid = req.request_id or f"gen-{uuid.uuid4().hex}"
            rec.request_id = rid
            meta = common_pb2.RequestMeta(request_id=rid, priority=req.priority, cache_salt=req.cache_salt)
            self.tenancy.fill_meta(tenant, meta, req.priority_class)
            rec.priority_class = CLASS_NAME[meta.priority_class]
            if gw.log_prompts:
                rec.prompt = _prompt_of(req)
            span = telemetry.current_span()
            span.set_attributes({"request_id": rid, "tenant": meta.tenant_id, "priority": req.priority,
                                 "priority_class": rec.priority_class})
            key: bytes | None = None
            recorded: list[frontend_pb2.GenerateResponse] | None = None  # the stream, while it is to be cached
            if self.cache is not None and cacheable(req):
                key = self.cache.key(meta.tenant_id, self.cfg.cluster.model, req)
                hit = None
                if req.skip_response_cache:
                    self.cache.m.bypasses.inc()
                else:
                    hit = self.cache.get(key)
                if hit is not None:  # counted and audited for the tenant; no worker ran, so no token is charged
                    span.set_attribute("response_cache", "hit")
                    self.accounting.admitted(tenant)
                    from_cache = True
                    for seq, resp in enumerate(hit, 1):
                        resp.request_id, resp.seq = rid, seq
                        timing.on_tokens(len(resp.token_ids))
                        if resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                            outcome = _FINISH.get(resp.finish_reason, "stop")
                            self.metrics.success.labels(outcome).inc()
                            self.metrics.prompt_tokens.inc(resp.usage.prompt_tokens)
                            rec.prompt_tokens = resp.usage.prompt_tokens
                        yield resp
                    return
                recorded = []
            ids = await self.tokenize(req, meta, _left(deadline))
            span.set_attribute("prompt_tokens", len(ids))
            p = req.params
            charge = self.tenancy.charge(tenant, len(ids), p.max_tokens if p.HasField("max_tokens") else 0)
            rec.prompt_tokens = len(ids)
            self.accounting.admitted(tenant)
            self.metrics.prompt_tokens.inc(len(ids))
            seq = 0
            async for resp in self._place_and_run(req, meta, ids, deadline, timing, st):
                if resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    outcome = _FINISH.get(resp.finish_reason, "stop")
                    self.metrics.success.labels(outcome).inc()
                if resp.HasField("usage"):
                    rec.cached_tokens = resp.usage.cached_tokens
                if gw.log_prompts:
                    output.append(resp.text)
                seq += 1
                resp.seq = seq
                if recorded is not None:
                    recorded.append(resp)
                    if outcome in ("stop", "length"):  # a complete answer: never an aborted or filtered one
                        assert self.cache is not None and key is not None  # both set with recorded
                        self.cache.put(key, recorded)
                yield resp
        except (QuotaExceeded, RequestTooLarge) as e:
            outcome = rpc.status_for(e)[0].name
            self.metrics.failure.labels(outcome).inc()
            reason = "tokens" if isinstance(e, QuotaExceeded) else "too_large"
            rec.status = outcome
            self.accounting.refused(tenant, reason, rec)
            raise
        except Exception as e:
            outcome = rpc.status_for(e)[0].name
            self.metrics.failure.labels(outcome).inc()
            raise
        finally:
            self.metrics.running.dec()
            self.metrics.generation_tokens.inc(timing.tokens)
            if outcome == "CANCELLED":
                self.metrics.success.labels("abort").inc()
            else:
                self.metrics.e2e.observe(time.perf_counter() - timing.t0)
            rec.status, rec.latency_s = outcome, time.perf_counter() - timing.t0
            rec.completion_tokens, rec.migrations = timing.tokens, st.migrations
            if gw.log_prompts:
                rec.output = "".join(output)
            self._close_books(tenant, charge, rec, from_cache)

    def _close_books(self, tenant: Tenant, charge: Charge | None, rec: AuditRecord, from_cache: bool) -> None:
        """A generation ended, however it ended: an admitted one is billed its input and real output (the unused
        part of its charge goes back), counted and audited; one answered by the response cache is counted and
        audited; one refused by its token quota is audited already."""
        if charge is not None:
            self.tenancy.settle(charge, rec.prompt_tokens + rec.completion_tokens)
            self.accounting.served(tenant, rec)
        elif from_cache:
            self.accounting.served(tenant, rec)
        elif rec.reason is None:  # failed before admission: invalid, or the tokenizer failed
            self.accounting.write(rec)

    async def tokenize(self, req: frontend_pb2.GenerateRequest, meta: common_pb2.RequestMeta,
                       timeout: float | None) -> list[int]:
        which = req.WhichOneof("input")
        if which == "prompt_token_ids":
            return list(req.prompt_token_ids.ids)
        if which == "chat":
            chat = tokenizer_pb2.ChatMessages()
            chat.CopyFrom(req.chat)
            chat.add_generation_prompt = True  # Generate always asks the model for the next (assistant) turn
            treq = tokenizer_pb2.TokenizeRequest(meta=meta, chat=chat)
        else:
            treq = tokenizer_pb2.TokenizeRequest(meta=meta, text=req.prompt, add_special_tokens=True)
        with telemetry.span("tokenize", telemetry.CLIENT):
            md = telemetry.outgoing_metadata()
            resp = await self.tokenizers.call(lambda stub: stub.Tokenize(treq, timeout=timeout, metadata=md),
                                              "tokenizer")
        if not resp.token_ids:
            raise ValueError("the input tokenized to no tokens; send a non-empty prompt")
        return list(resp.token_ids)

    async def _place_and_run(self, req: frontend_pb2.GenerateRequest, meta: common_pb2.RequestMeta,
                             ids: list[int], deadline: float | None, timing: _Timing, st: _Attempts
                             ) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        try:
            while True:
                # a moved stream is placed by its whole context and recomputes it on the decode worker
                placement = await self._place(req, meta, ids + st.sent, st.exclude, deadline)
                if st.pre is None and not st.sent and placement.HasField("prefill"):
                    if not await self._prefill(placement.prefill, meta, ids, req, deadline, st):
                        continue  # the prefill worker was unavailable: re-placed without it
                    assert st.pre is not None
                    if st.pre.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        st.lease = ""
                        self._release(st.pre.kv)
                        yield await self._finished_at_prefill(meta, ids, st.pre, req, timing)
                        return
                async for resp in self._decode(placement.decode, meta, ids, req, deadline, timing, st):
                    yield resp
                if st.done:
                    return
        finally:
            if st.pre is not None and st.lease == "ours":  # cancelled or failed between prefill and decode
                self._release(st.pre.kv)
            elif st.pre is not None and st.lease == "decode" and not st.done:
                # the Decode call may never have reached its worker: free the lease unless a decode worker claimed it
                self._release(st.pre.kv, unclaimed_only=True)

    async def _place(self, req: frontend_pb2.GenerateRequest, meta: common_pb2.RequestMeta, ids: list[int],
                     exclude: list[str], deadline: float | None) -> router_pb2.Placement:
        """The router's placement. While no router answers or none has a decode worker, a first placement waits up
        to ``gateway.ready_wait_s`` (a router restarting, workers registering); a re-placement that excluded
        workers does not wait, since the same workers come back under the same ids."""
        p = req.params
        place = router_pb2.PlaceRequest(meta=meta, prompt_token_ids=ids, exclude_workers=exclude,
                                        max_tokens=p.max_tokens if p.HasField("max_tokens") else 0)
        wait_until = time.monotonic() + (0.0 if exclude else self.cfg.cluster.gateway.ready_wait_s)
        pause = 0.05
        while True:
            try:
                if self.placements is not None:
                    return await self.placements.place(place, _left(deadline))
                return await self.routers.call(lambda stub: stub.Place(place, timeout=_left(deadline),
                                                                       metadata=telemetry.outgoing_metadata()),
                                               "router")
            except grpc.aio.AioRpcError as e:
                left = wait_until - time.monotonic()
                if e.code() != grpc.StatusCode.UNAVAILABLE or left <= 0:
                    raise
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, 1.0)

    async def _prefill(self, ref: router_pb2.WorkerRef, meta: common_pb2.RequestMeta, ids: list[int],
                       req: frontend_pb2.GenerateRequest, deadline: float | None, st: _Attempts) -> bool:
        """Run the prompt on a prefill worker; False when it was unavailable and the request should re-place."""
        stub = self.workers.get(ref.address, prefill_pb2_grpc.PrefillStub)
        lease_id = uuid.uuid4().hex
        try:
            st.pre = await stub.Prefill(prefill_pb2.PrefillRequest(meta=meta, prompt_token_ids=ids, params=req.params,
                                                                   lease_id=lease_id),
                                        timeout=_left(deadline), metadata=telemetry.outgoing_metadata())
        except asyncio.CancelledError:  # the client left: the lease may exist with its result lost on the way
            self._release(common_pb2.KvHandle(worker_id=ref.worker_id, address=ref.address, lease_id=lease_id))
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() != _UNAVAILABLE:
                self._release(common_pb2.KvHandle(worker_id=ref.worker_id, address=ref.address, lease_id=lease_id))
            if e.code() != _UNAVAILABLE or not st.retry(ref.worker_id):
                raise
            self.metrics.retries.labels("prefill").inc()
            log.warning("%s: prefill worker %s unavailable (%s); re-placing", meta.request_id, ref.worker_id,
                        e.details())
            return False
        st.lease = "ours" if st.pre.kv.lease_id else ""
        return True

    async def _decode(self, ref: router_pb2.WorkerRef, meta: common_pb2.RequestMeta, ids: list[int],
                      req: frontend_pb2.GenerateRequest, deadline: float | None, timing: _Timing,
                      st: _Attempts) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        """Stream one Decode call to the client. Sets ``st.done``, or returns to re-place (worker unavailable
        before its first message), or raises."""
        dreq = decode_pb2.DecodeRequest(meta=meta, prompt_token_ids=ids, params=req.params,
                                        prior_output_ids=st.sent)
        if st.pre is not None and not st.sent:
            dreq.first_token_id = st.pre.first_token_id
            if st.pre.HasField("first_logprob"):
                dreq.first_logprob.CopyFrom(st.pre.first_logprob)
            dreq.kv.CopyFrom(st.pre.kv)
        call: Any
        if self.decode_streams is not None:  # on the gateway's one stream to this worker
            call = self.decode_streams.decode(ref.address, dreq, _left(deadline),
                                              self.stream_intervals.seconds(meta.priority_class))
        else:
            call = self.workers.get(ref.address, decode_pb2_grpc.DecodeStub).Decode(
                dreq, timeout=_left(deadline), metadata=telemetry.outgoing_metadata())
        if st.lease == "ours":
            st.lease = "decode"  # the decode worker pulls the KV and gives the lease back
        try:
            async for delta in call:
                st.sent.extend(delta.token_ids)
                timing.on_tokens(len(delta.token_ids))
                st.done = delta.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                yield frontend_pb2.GenerateResponse(
                    request_id=meta.request_id, text=delta.text, token_ids=delta.token_ids,
                    logprobs=delta.logprobs, finish_reason=delta.finish_reason, usage=delta.usage,
                    filter_reason=delta.filter_reason)
                if st.done:
                    return
        except grpc.aio.AioRpcError as e:
            if e.code() != _UNAVAILABLE:
                raise
            if st.sent:  # tokens reached the client: move the stream
                if st.migrations >= st.max_migrations:
                    raise rpc.Unavailable(
                        f"decode worker {ref.worker_id} failed after {len(st.sent)} tokens were streamed "
                        f"({e.details()}) and the stream was moved {st.migrations} times already "
                        f"(gateway.migration_limit); the output is incomplete, retry the request") from e
                st.migrations += 1
                st.exclude.append(ref.worker_id)
                self.metrics.migrations.inc()
                log.warning("%s: decode worker %s failed after %d tokens (%s); moving the stream", meta.request_id,
                            ref.worker_id, len(st.sent), e.details())
                return
            if st.lease == "decode":
                st.lease = "ours"  # it never started: ours again
            if not st.retry(ref.worker_id):
                raise rpc.Unavailable(f"decode worker {ref.worker_id} is unavailable ({e.details()}) after "
                                      f"{st.max_retries} re-placements; retry later") from e
            self.metrics.retries.labels("decode").inc()
            log.warning("%s: decode worker %s unavailable (%s); re-placing", meta.request_id, ref.worker_id,
                        e.details())
            return
        finally:
            if self.decode_streams is not None:
                await call.aclose()  # unfinished: a cancel on the stream, and the decode worker frees the blocks
            elif not st.done:
                call.cancel()  # the client went away (or we failed): the decode worker frees the blocks
        raise rpc.Unavailable(f"decode worker {ref.worker_id} ended the stream without a finish reason")

    async def _finished_at_prefill(self, meta: common_pb2.RequestMeta, ids: list[int],
                                   pre: prefill_pb2.PrefillResult, req: frontend_pb2.GenerateRequest,
                                   timing: _Timing) -> frontend_pb2.GenerateResponse:
        """The first token ended the request: no decode; the text comes from the tokenizer pool."""
        skip = req.params.skip_special_tokens if req.params.HasField("skip_special_tokens") else True
        dreq = tokenizer_pb2.DetokenizeRequest(token_ids=[pre.first_token_id], skip_special_tokens=skip)
        text = (await self.tokenizers.call(lambda stub: stub.Detokenize(dreq), "tokenizer")).text
        timing.on_tokens(1)
        finish, why = pre.finish_reason, ""
        policy = self.policies.for_request(meta.tenant_id)
        if policy is not None and text:
            v = policy.check(text, 0, True)
            if v.blocked:
                text, finish, why = "", common_pb2.FINISH_REASON_CONTENT_FILTER, v.reason
        resp = frontend_pb2.GenerateResponse(
            request_id=meta.request_id, text=text, token_ids=[pre.first_token_id], finish_reason=finish,
            filter_reason=why,
            usage=common_pb2.Usage(prompt_tokens=len(ids), completion_tokens=1, cached_tokens=pre.cached_tokens))
        if pre.HasField("first_logprob"):
            resp.logprobs.append(pre.first_logprob)
        return resp

    def _release(self, kv: common_pb2.KvHandle, unclaimed_only: bool = False) -> None:
        release_lease(self.workers, self._background, kv, unclaimed_only)


def _left(deadline: float | None) -> float | None:
    """Seconds to ``deadline`` (a ``time.monotonic()``), as a call's timeout; None: no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _refuse(context: grpc.aio.ServicerContext, span: Span, e: QuotaExceeded) -> None:
    """End a call refused at the door as ``rpc.translate_errors`` would end it (RESOURCE_EXHAUSTED, the message,
    the refusal's headers as trailing metadata; the span failed), without raising through the call's layers and
    ``context.abort``: a flooding tenant is refused hundreds of times a second."""
    telemetry.fail(span, e)
    context.set_trailing_metadata(_grpc_headers(e.headers))
    context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
    context.set_details(rpc.clip_message(str(e)))


def _grpc_headers(headers: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """HTTP headers as gRPC metadata (keys in lower case)."""
    return tuple((k.lower(), v) for k, v in headers.items())


def _prompt_of(req: frontend_pb2.GenerateRequest) -> Any:
    """The request's input for the audit log (only with gateway.log_prompts)."""
    which = req.WhichOneof("input")
    if which == "chat":
        return [{"role": m.role, "content": m.content} for m in req.chat.messages]
    if which == "prompt_token_ids":
        return list(req.prompt_token_ids.ids)
    return req.prompt


def _identity(context: grpc.aio.ServicerContext) -> tuple[str, str]:
    """The call's ``authorization`` and ``x-tenant-id`` metadata ("" where absent; the first of each), in one pass."""
    auth = tenant = None
    for k, v in context.invocation_metadata() or ():
        if k == "authorization":
            auth = str(v) if auth is None else auth
        elif k == "x-tenant-id":
            tenant = str(v) if tenant is None else tenant
    return auth or "", tenant or ""


def serve(cfg: ServiceConfig) -> int:
    """``tokenmill serve gateway``."""
    return rpc.run(GatewayService(cfg), cfg)
