"""The OpenAI-compatible HTTP API of the gateway, beside its gRPC ``Frontend`` in the same process and event loop.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (SSE when ``stream``), ``GET /v1/models``,
``POST /tokenize`` and ``POST /detokenize`` (vLLM's),
``GET /health`` (200 only while a tokenizer, the router and at least one decode worker serve), ``GET /metrics``,
``GET /openapi.json`` (OpenAPI 3.1 of these routes, the request bodies from ``openai_schema.py``'s models).
Every choice of a request runs through ``GatewayService.generate``: the same path, metrics and errors as gRPC.

Status codes: 400 invalid values, malformed JSON and prompts over the context (the message names both numbers),
401 missing/invalid API key (once any key is configured: ``services/gateway/tenancy.py``), 404 unknown model or
path, 413 body over ``gateway.max_body_bytes``, 429 over a tenant's quota (``Retry-After`` from its bucket), over
``gateway.max_inflight_requests`` or ``gateway.tenant_max_inflight`` (``Retry-After``), 503 while the cluster is
not ready or draining (``Retry-After``). A streamed response has sent its 200 only after the first token came back,
so errors before that keep their status; an error after it ends the stream with an ``error`` event.

``Cache-Control: no-cache`` (or ``no-store``) on a completion request skips the response cache, as the body field
``skip_response_cache`` does.

A client that disconnects cancels its choices: the handler task is cancelled (``handler_cancellation``), the
``Decode`` calls with it, and the decode worker frees the blocks.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from tokenmill.v1 import common_pb2, frontend_pb2, router_pb2, tokenizer_pb2, worker_pb2, worker_pb2_grpc

from common import rpc, telemetry
from services.gateway import openai_api as oa
from services.gateway import openai_schema as schema
from services.gateway.tenancy import QuotaExceeded, RequestTooLarge, Tenant

if TYPE_CHECKING:
    from services.gateway.server import GatewayService

log = logging.getLogger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# Retry-After of a refusal that names no time of its own (a full gateway or an in-flight cap, a cluster not ready),
# in seconds: both front doors send it
RETRY_AFTER_S = 1
_RETRY_AFTER_S = str(RETRY_AFTER_S)
_TENANT = web.RequestKey("tenant", Tenant)  # the request's tenant, for its x-ratelimit-* headers
_READY_TTL_S = 0.5
# Hugging Face repository names of the embedded models, served as aliases (benchmark tools ask for these)
_HF_NAMES = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


_SUMMARY = {"/v1/chat/completions": "a chat completion (SSE with stream: true)",
            "/v1/completions": "a text completion (SSE with stream: true)", "/v1/models": "the served model names",
            "/tokenize": "vLLM's: a prompt or chat as the model's token ids",
            "/detokenize": "vLLM's: token ids as text", "/health": "200 while the cluster can serve, else 503",
            "/metrics": "Prometheus metrics", "/openapi.json": "this document",
            "/start_profile": "vLLM's: start the torch profiler in every model worker (with profile_dir set)",
            "/stop_profile": "vLLM's: stop it; each worker writes its trace under profile_dir"}


def _version() -> str:
    try:
        return importlib.metadata.version("tokenmill")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0"


def served_model_names(model: str, configured: tuple[str, ...]) -> list[str]:
    """The names ``/v1/models`` lists and requests may use; the first is the one responses carry."""
    if configured:
        return list(configured)
    names = [model]
    if model in _HF_NAMES:
        names.append(_HF_NAMES[model])
    return names


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps's, built once


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_ENCODE(obj).encode(), status=status,
                        content_type="application/json", headers=headers)


def _sse(obj: Any, event_id: int | None = None) -> bytes:
    head = b"" if event_id is None else b"id: %d\n" % event_id
    return head + b"data: " + _ENCODE(obj).encode() + b"\n\n"


HEARTBEAT = b": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see a live connection


def _last_event_id(request: web.Request) -> int | None:
    """The ``Last-Event-ID`` header as a seq (None without one); a value that is not a count is a 400."""
    raw = request.headers.get("Last-Event-ID")
    if raw is None:
        return None
    try:
        seq = int(raw)
    except ValueError:
        seq = -1
    if seq < 0:
        raise oa.OpenAIError(400, f"Last-Event-ID must be the id of the last event received (a count), got {raw!r}")
    return seq


def error_from(exc: BaseException) -> oa.OpenAIError:
    """An exception from the request path → the OpenAI error (status, message, param)."""
    if isinstance(exc, oa.OpenAIError):
        return exc
    code, message = rpc.status_for(exc)
    status = _HTTP_STATUS.get(code, 500)
    if status == 500:
        log.error("unexpected error serving an HTTP request: %s", message, exc_info=exc)
    if isinstance(exc, QuotaExceeded):  # Retry-After from the tenant's bucket, and its x-ratelimit-* headers
        return oa.OpenAIError(429, message, code=exc.openai_code, headers=exc.headers)
    if isinstance(exc, rpc.Unauthenticated):
        return oa.OpenAIError(401, message, code="invalid_api_key")
    retry = {"Retry-After": _RETRY_AFTER_S} if status in (429, 503) else None
    return oa.OpenAIError(status, message, param=oa.param_of(message) if status == 400 else None,
                          headers=retry)


class HttpFrontend:
    """The aiohttp application; ``start``/``stop`` from the gateway's ``start``/``stop``."""

    def __init__(self, gw: GatewayService) -> None:
        self.gw = gw
        g = gw.cfg.cluster.gateway
        self.cfg = g
        self.names = served_model_names(gw.cfg.cluster.model, g.served_model_names)
        self.draining = False
        self._ready_at = 0.0  # monotonic time of the last successful readiness check
        self._ready_why = "not checked yet"
        self._ready_lock = asyncio.Lock()
        self._tokenizer: Any = None
        self._tokenizer_lock = asyncio.Lock()
        self.requests = Counter("tokenmill:http_requests", "HTTP API requests by endpoint and status code",
                                ["endpoint", "status"], registry=gw.registry)
        self._counted: dict[tuple[str, int], Any] = {}  # (endpoint, status) → its child of ``requests``
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._openapi: dict[str, Any] | None = None
        self.port: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", functools.partial(self.completions, kind="chat"))
        app.router.add_post("/v1/completions", functools.partial(self.completions, kind="completion"))
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_post("/start_profile", functools.partial(self.profile, start=True))
        app.router.add_post("/stop_profile", functools.partial(self.profile, start=False))
        return app

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        """Serve on ``host:port``; ``reuse_port``: together with the host's other gateways (SO_REUSEPORT)."""
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = self._site = web.TCPSite(self._runner, host, port, reuse_port=reuse_port)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port
        log.info("gateway HTTP API (OpenAI) on http://%s:%d/v1 serving %s", host, self.port, self.names)

    async def stop_listening(self) -> None:
        """Accept no new connection; those open go on (a gateway sharing its ports drains so: the kernel gives new
        connections to the host's other gateways)."""
        if self._site is not None:
            await self._site.stop()
            self._site = None

    async def stop(self) -> None:
        self._site = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- middleware ----------------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return self._finish(request, resp)
        except oa.OpenAIError as e:
            status = e.status
            return self._finish(request, _json(e.body(), e.status, e.headers))
        except web.HTTPRequestEntityTooLarge as e:
            status = 413
            err = oa.OpenAIError(413, f"the request body is over the limit of {self.cfg.max_body_bytes} bytes "
                                 f"({e.text or 'too large'}); send a smaller request")
            return self._finish(request, _json(err.body(), 413))
        except web.HTTPException as e:  # unknown path (404), wrong method (405)
            status = e.status
            err = oa.OpenAIError(e.status, f"{e.reason}: {request.method} {request.path}",
                                 code=None if e.status != 404 else "not_found")
            return self._finish(request, _json(err.body(), e.status))
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        except Exception as e:
            err = error_from(e)
            status = err.status
            return self._finish(request, _json(err.body(), err.status, err.headers))
        finally:
            self._count(endpoint, status)

    def _count(self, endpoint: str, status: int) -> None:
        """One request in ``tokenmill:http_requests``: a dictionary probe, not prometheus_client's labels() (a lock
        and a key built every time), as a flooding tenant's refusals come hundreds a second."""
        child = self._counted.get((endpoint, status))
        if child is None:
            child = self._counted[(endpoint, status)] = self.requests.labels(endpoint, str(status))
        child.inc()

    def _finish(self, request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
        """OpenAI's ``x-ratelimit-*`` headers on every response to a tenant with quotas (a stream has them); while
        draining, ``Connection: close``, so that the client's next request opens a new connection (with gateways
        sharing their ports, to one that still listens)."""
        tenant = request.get(_TENANT)
        if tenant is not None and tenant.has_quotas and not resp.prepared:
            resp.headers.update(tenant.ratelimit_headers())  # as of now: after a refusal's refund, a settled bill
        if self.draining and not resp.prepared:
            resp.force_close()
        return resp

    # -- small endpoints -------------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        self._auth(request)
        now = int(time.time())
        return _json({"object": "list", "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "tokenmill", "root": self.names[0],
             "max_model_len": self.gw.cfg.cluster.engine.max_model_len} for name in self.names]})

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()  # over client_max_size: HTTPRequestEntityTooLarge → 413
        try:
            return json.loads(raw)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
            raise oa.bad(f"the request body is not valid JSON ({e})") from e
        except RecursionError:
            raise oa.bad("the request body is nested too deeply to parse; send a flatter JSON object") from None

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: ``{prompt}`` or ``{messages}`` (and ``tools``) → ``{count, max_model_len, tokens}``
        (the pool's tokenizer and chat template, exactly what a request would be given)."""
        self._auth(request)
        body = await self._body(request)
        if not isinstance(body, dict):
            raise oa.bad("the request body must be a JSON object")
        self._resolve_model(body.get("model"))
        r = oa.validate(schema.TokenizeRequest, body)
        if r.messages is not None:
            treq = tokenizer_pb2.TokenizeRequest(chat=oa.chat_messages(r.messages))
            treq.chat.add_generation_prompt = r.add_generation_prompt
            tools = oa.chat_tools(body)
            if tools is not None:
                treq.chat.tools_json = tools.tools_json()
        else:
            treq = tokenizer_pb2.TokenizeRequest(text=r.prompt, add_special_tokens=r.add_special_tokens)
        resp = await self.gw.tokenizers.call(lambda stub: stub.Tokenize(treq, timeout=30), "tokenizer")
        ids = list(resp.token_ids)
        return _json({"count": len(ids), "max_model_len": self.gw.cfg.cluster.engine.max_model_len, "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/detokenize``: ``{tokens}`` → ``{prompt}``."""
        self._auth(request)
        body = await self._body(request)
        r = oa.validate(schema.DetokenizeRequest, body if isinstance(body, dict) else {})
        dreq = tokenizer_pb2.DetokenizeRequest(token_ids=r.tokens, skip_special_tokens=False)
        resp = await self.gw.tokenizers.call(lambda stub: stub.Detokenize(dreq, timeout=30), "tokenizer")
        return _json({"prompt": resp.text})

    async def health(self, request: web.Request) -> web.Response:
        ok, why = await self.ready()
        return _json({"status": "ok" if ok else "unavailable", "detail": why}, 200 if ok else 503,
                     None if ok else {"Retry-After": _RETRY_AFTER_S})

    async def openapi(self, request: web.Request) -> web.Response:
        """The OpenAPI 3.1 document of the routes this app serves (built once: the routes do not change)."""
        if self._openapi is None:
            routes = [(r.method.lower(), r.resource.canonical, _SUMMARY.get(r.resource.canonical, ""))
                      for r in request.app.router.routes() if r.method != "HEAD" and r.resource is not None]
            self._openapi = schema.openapi(routes, "Tokenmill OpenAI-compatible API", _version())
        return _json(self._openapi)

    async def profile(self, request: web.Request, start: bool) -> web.Response:
        """vLLM's ``/start_profile`` and ``/stop_profile``: every model worker the router knows starts (stops) the
        torch profiler around its engine's steps (common/profiling.py); a stop answers each trace's path."""
        self._auth(request)
        if not self.gw.cfg.cluster.profile_dir:
            raise oa.OpenAIError(400, "profiling is off on this cluster: start it with --set profile_dir=DIR, the "
                                      "directory the model workers write their traces to")
        try:
            listed = await self.gw.routers.call(
                lambda stub: stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5.0), "router")
        except (grpc.aio.AioRpcError, rpc.Unavailable) as e:
            raise oa.OpenAIError(503, f"the router is not reachable ({e}); retry shortly") from e
        if not listed.workers:
            raise oa.OpenAIError(503, "no model worker has registered with the router yet; retry shortly")

        async def one(w: router_pb2.WorkerLoad) -> worker_pb2.ProfileResponse:
            stub = self.gw.workers.get(w.address, worker_pb2_grpc.WorkerAdminStub)
            return await stub.Profile(worker_pb2.ProfileRequest(start=start), timeout=120.0)

        results = await asyncio.gather(*(one(w) for w in listed.workers), return_exceptions=True)
        failed = [(w.worker_id, r) for w, r in zip(listed.workers, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            precondition = all(isinstance(r, grpc.aio.AioRpcError)
                               and r.code() == grpc.StatusCode.FAILED_PRECONDITION for _, r in failed)
            why = "; ".join(f"{wid}: {r.details() if isinstance(r, grpc.aio.AioRpcError) else r}"
                            for wid, r in failed)
            written = "; ".join(f"{r.worker_id}: {r.trace_path}" for r in results
                                if isinstance(r, worker_pb2.ProfileResponse) and r.trace_path)
            done = len(listed.workers) - len(failed)
            raise oa.OpenAIError(400 if precondition else 503,
                                 f"{'start' if start else 'stop'} of the profiler failed on {len(failed)} of "
                                 f"{len(listed.workers)} workers ({done} did it{', writing ' + written if written else ''}"
                                 f"): {why}")
        workers = [{"worker_id": r.worker_id, **({"trace_path": r.trace_path} if not start else {})}
                   for r in results if isinstance(r, worker_pb2.ProfileResponse)]
        return _json({"profiling": start, "workers": workers})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.gw.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def ready(self) -> tuple[bool, str]:
        """Whether a tokenizer, the router and a decode worker serve now (checked at most every 0.5 s)."""
        if self.draining:
            return False, "the gateway is draining"
        if time.monotonic() - self._ready_at < _READY_TTL_S:
            return True, "ready"
        async with self._ready_lock:
            if time.monotonic() - self._ready_at < _READY_TTL_S:
                return True, "ready"
            why = await self._check_pools()
            if why is None:
                self._ready_at = time.monotonic()
                return True, "ready"
            self._ready_why = why
            return False, why

    async def ready_within(self, wait_s: float) -> tuple[bool, str]:
        """:meth:`ready`, waiting up to ``wait_s`` for it while the gateway is not draining (a router restarting,
        workers registering: the request is late instead of refused)."""
        deadline = time.monotonic() + wait_s
        ok, why = await self.ready()
        while not ok and not self.draining and time.monotonic() < deadline:
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
            ok, why = await self.ready()
        return ok, why

    async def _check_pools(self) -> str | None:
        """None when ready, else what is missing."""
        if not await self.gw.tokenizers.any_serving(timeout=1.0):
            return "no tokenizer is serving"
        try:
            workers = await self.gw.routers.call(
                lambda stub: stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=1.0), "router")
        except (grpc.aio.AioRpcError, rpc.Unavailable):
            return "the router is not reachable"
        if not any(w.role == router_pb2.WORKER_ROLE_DECODE and not w.draining for w in workers.workers):
            return "no decode worker has registered with the router yet"
        return None

    # -- auth, limits ----------------------------------------------------------------------------------------
    def _auth(self, request: web.Request) -> Tenant:
        """The request's tenant (remembered on the request for its x-ratelimit-* headers); raises Unauthenticated
        (401) when keys are configured and the request has no valid one."""
        h = request.headers
        tenant = self.gw.tenancy.identify(h.get("Authorization"), h.get("x-tenant-id", ""))
        request[_TENANT] = tenant
        return tenant

    async def _token_text(self) -> Any:
        """A cached ``id → text`` for logprobs (the tokenizer loads on first use, off the event loop)."""
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                from common.loader import load_tokenizer

                fn: Callable[[int], str]
                try:
                    c = self.gw.cfg.cluster
                    tok = await asyncio.to_thread(load_tokenizer, c.tokenizer_spec or c.model)
                    fn = functools.lru_cache(maxsize=65536)(
                        lambda i: tok.decode([i], skip_special_tokens=False))
                except (ValueError, FileNotFoundError):
                    fn = lambda i: f"token_id:{i}"  # noqa: E731  (a model without a tokenizer: vLLM's form)
                self._tokenizer = fn
        return self._tokenizer

    def _resolve_model(self, name: str | None) -> str:
        if name is None or name in self.names:
            return self.names[0] if name is None else name
        raise oa.OpenAIError(404, f"the model {name!r} does not exist; this server serves {self.names}",
                             param="model", code="model_not_found")

    # -- completions ---------------------------------------------------------------------------------------
    async def completions(self, request: web.Request, kind: oa.Kind) -> web.StreamResponse:
        t = self.gw.identify(request.headers.get("Authorization"), request.headers.get("x-tenant-id", ""),
                             request.headers.get("X-Request-Id", ""), "")
        request[_TENANT] = t
        tenant = t.name
        body = await self._body(request)
        parsed = oa.parse(body, kind, self._resolve_model, self.cfg.tool_parser)
        if {"no-cache", "no-store"} & {d.strip().lower() for d in request.headers.get("Cache-Control", "").split(",")}:
            for r in parsed.requests:
                r.skip_response_cache = True
        ok, why = await self.ready_within(self.cfg.ready_wait_s)
        if not ok:
            raise oa.OpenAIError(503, f"the cluster is not ready: {why}; retry shortly",
                                 headers={"Retry-After": _RETRY_AFTER_S})
        resume = _last_event_id(request)
        if resume is not None and not (parsed.stream and len(parsed.requests) == 1 and request.headers.get(
                "X-Request-Id")):
            raise oa.OpenAIError(400, "Last-Event-ID resumes a streamed request of one choice: send the same body "
                                      "with stream true and the X-Request-Id of the stream to resume")
        rid = request.headers.get("X-Request-Id") or f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        if resume is None:
            self.gw.admit_in_flight(t, rid, parsed.model)  # counted in flight from here
        with self.gw.in_flight(t, admitted=resume is None):  # released however the request ends
            if resume is None:
                self.gw.admit_request(t, rid, parsed.model)
            if parsed.service_tier is not None:
                for r in parsed.requests:
                    r.priority_class = parsed.service_tier
            asked = parsed.service_tier or common_pb2.PRIORITY_CLASS_UNSPECIFIED
            tier = oa.TIER_OF_CLASS[self.gw.tenancy.priority_class(t, asked)]
            for i, r in enumerate(parsed.requests):
                r.request_id = rid if len(parsed.requests) == 1 else f"{rid}-{i}"
            fmt = oa.LogprobFormatter(await self._token_text() if parsed.logprobs else str)
            builder = oa.ResponseBuilder(parsed, rid, fmt, tier)
            parent = telemetry.incoming_context([(k.lower(), v) for k, v in request.headers.items()])
            try:
                with telemetry.stream_span(f"openai.{kind}", telemetry.SERVER, {"request_id": rid, "tenant": tenant},
                                           parent):
                    if parsed.stream:
                        return await self._stream(request, parsed, builder, t, resume)
                    return await self._unary(parsed, builder, t)
            except (QuotaExceeded, RequestTooLarge):
                if resume is None:
                    self.gw.tenancy.refund_request(t)  # refused after the door: nothing is half-admitted
                raise

    async def _choice(self, req: frontend_pb2.GenerateRequest, tenant: Tenant, resumable: bool = False,
                      after: int | None = None) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        """One choice's responses. ``resumable``: through the gateway's resumable streams (the generation outlives
        this connection for ``gateway.resume_window_s``); ``after``: resume that stream after this seq."""
        streams = self.gw.streams
        if after is not None:
            if streams is None:
                raise oa.OpenAIError(404, "resume is off on this server (gateway.resume_window_s is 0)")
            source = streams.follow(streams.get(req.request_id, tenant.name), after)
        elif resumable and streams is not None:
            source = streams.follow(streams.start(req.request_id, self.gw.generate(req, tenant), owner=tenant.name))
        else:
            source = self.gw.generate(req, tenant)  # an HTTP request has no deadline
        async for resp in source:
            yield resp

    async def _unary(self, parsed: oa.Parsed, builder: oa.ResponseBuilder, tenant: Tenant) -> web.Response:
        choices = [oa.Choice(i) for i in range(len(parsed.requests))]

        async def run(i: int) -> None:
            async for resp in self._choice(parsed.requests[i], tenant):
                choices[i].add(resp)

        tasks = [asyncio.ensure_future(run(i)) for i in range(len(choices))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                exc = t.exception()
                if exc is not None:
                    raise exc
        finally:
            for t in tasks:
                t.cancel()
        return _json(builder.full(choices))

    async def _stream(self, request: web.Request, parsed: oa.Parsed, builder: oa.ResponseBuilder,
                      tenant: Tenant, resume: int | None = None) -> web.StreamResponse:
        """SSE. With resume on, a stream of one choice carries ``id:`` lines (the response's seq), and a client that
        lost the connection sends the same request with ``Last-Event-ID`` (``resume``) and gets the rest."""
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        choices = [oa.Choice(i) for i in range(len(parsed.requests))]
        single = len(choices) == 1
        # id: lines only where a client can resume by them: OpenAI's stream has none, and clients that read every
        # line as `data:` (vLLM's bench client among them) fail on them
        ids = single and self.gw.streams is not None

        async def run(i: int) -> None:
            try:
                async for resp in self._choice(parsed.requests[i], tenant, resumable=single, after=resume):
                    queue.put_nowait((i, resp))
                queue.put_nowait((i, None))
            except Exception as e:
                queue.put_nowait((i, e))

        tasks = [asyncio.ensure_future(run(i)) for i in range(len(choices))]
        try:
            first = await queue.get()
            if isinstance(first[1], Exception):
                raise first[1]  # nothing was sent yet: the error keeps its status code
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": builder.id, **tenant.ratelimit_headers()})
            await resp.prepare(request)
            started: set[int] = {0} if resume else set()  # a resumed stream's first chunk was sent before
            open_, failed = len(choices), None
            batch = [first]
            while True:
                while not queue.empty():  # a lagging client gets everything that is ready in one write
                    batch.append(queue.get_nowait())
                data = b""
                for i, item in batch:
                    if item is None:
                        open_ -= 1
                    elif isinstance(item, Exception):
                        failed = item
                        break
                    else:
                        for chunk in builder.chunks(choices[i], item, i not in started):
                            data += _sse(chunk, item.seq if ids else None)
                        started.add(i)
                        choices[i].add(item, keep=False)
                if failed is not None:
                    data += _sse(error_from(failed).body())
                elif open_ == 0:
                    if parsed.include_usage:
                        data += _sse(builder.usage_chunk(choices))
                    data += b"data: [DONE]\n\n"
                if data:
                    await resp.write(data)
                if failed is not None or open_ == 0:
                    break
                batch = []
                while not batch:
                    try:
                        batch = [await asyncio.wait_for(queue.get(), self.cfg.heartbeat_s)]
                    except TimeoutError:
                        await resp.write(HEARTBEAT)
            await resp.write_eof()
            return resp
        finally:
            for t in tasks:
                t.cancel()
