"""Service scaffolding shared by every Tokenmill service: a ``grpc.aio`` server with health and reflection, a
Prometheus ``/metrics`` endpoint, graceful drain on SIGTERM/SIGINT, and exception → status-code translation.

A service is a ``ServiceApp``: it registers its servicers, gets ready (``start``: load, warm up), and cleans up
(``stop``). ``run(app, cfg)`` does the rest:

1. listen on ``cfg.address`` with ``grpc.health.v1`` NOT_SERVING, server reflection, ``/metrics`` on its own port;
2. ``await app.start()``; then SERVING and one log line: ``<role> ready: grpc 127.0.0.1:P metrics :M``;
3. on SIGTERM/SIGINT: ``await app.begin_drain()`` if it has one, NOT_SERVING, stop accepting, let in-flight
   RPCs finish for ``cluster.grace_s`` seconds (``server.stop(grace)``: then they are cancelled),
   ``await app.stop()``, return 0.

Tracing (OpenTelemetry, ``common.telemetry``): ``serve_until_signalled`` calls ``setup_tracing``; every server has
``TraceContextInterceptor`` (the default of ``interceptors`` in ``start_server``), so a caller's ``traceparent``
makes the handler's spans its children.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from common import telemetry
from common.cluster_config import ServiceConfig
from common.gc_watch import GcWatch, freeze_startup_heap

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# Loopback messages can be large (a 128k-token prompt is ~0.6 MB of ids; KV handles list thousands of blocks).
GRPC_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]
# gRPC enables SO_REUSEPORT by default: a second server on a taken port would silently share it. Keepalive: every
# connection gets an HTTP/2 ping after 20 s without traffic (the heartbeat of an idle stream: proxies keep it open,
# and a client that vanished is found within 30 s and its streams cancelled).
SERVER_OPTIONS: list[tuple[str, Any]] = [*GRPC_OPTIONS, ("grpc.so_reuseport", 0), ("grpc.keepalive_time_ms", 20_000),
                                         ("grpc.keepalive_timeout_ms", 10_000)]


# -- errors ------------------------------------------------------------------------------------------------
class ResourceExhausted(Exception):
    """The service is over a limit (queue full, quota); the client may retry later."""


class Unauthenticated(Exception):
    """The caller did not prove who it is (a missing or unknown API key)."""


class NotFound(Exception):
    """The named thing (a model, a lease) does not exist here."""


class Unavailable(Exception):
    """Nothing can serve the request right now (no workers, draining); the client may retry elsewhere."""


class FailedPrecondition(Exception):
    """The call does not fit the service's state or configuration now (e.g. a profile stopped that never started)."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message for an exception raised while serving a request.

    ValueError (the engine's RequestError, ChatTemplateError) → INVALID_ARGUMENT with its message;
    a downstream RPC error keeps its code and details; anything unexpected → INTERNAL naming the type only.
    """
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or exc.code().name
    if isinstance(exc, ResourceExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the service log"


# The status message travels as the grpc-message trailer, percent-encoded: one past the receiver's metadata limit
# (8 KiB soft, 16 KiB hard) arrives as RESOURCE_EXHAUSTED "Stream removed" instead of the status that was sent.
MAX_MESSAGE_CHARS = 500


def clip_message(message: str) -> str:
    """``message`` cut to ``MAX_MESSAGE_CHARS`` (it may echo a client's value of any length)."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}… ({len(message) - MAX_MESSAGE_CHARS} more characters)"


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("unexpected error serving a request", exc_info=exc)
    await context.abort(code, clip_message(message))
    raise AssertionError("unreachable")  # context.abort raises


def translate_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a servicer method (unary or server-streaming): exceptions become gRPC statuses via ``status_for``.

    ``context.abort`` inside the method and client cancellation pass through untouched. A streaming method is closed
    as soon as its call ends: a client that cancels while the method waits at a ``yield`` (gRPC is sending) runs its
    ``finally`` blocks then, not whenever the garbage collector finds the suspended generator.
    """
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            gen = method(self, request, context)
            context.add_done_callback(lambda _ctx: _close_soon(gen))  # type: ignore[arg-type]  # types-grpcio's callback type is a class: no function matches
            try:
                async for item in gen:
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await abort(context, e)

        return stream

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await abort(context, e)

    return unary


def _close_soon(gen: Any) -> None:
    """Close an async generator that waits at a ``yield`` (one inside an ``await`` gets the call's cancellation)."""
    if gen.ag_running or gen.ag_frame is None:
        return

    async def close() -> None:
        with contextlib.suppress(RuntimeError):  # it started running again meanwhile: it ends on its own
            await gen.aclose()

    _closing.spawn(close())


class Background:
    """Tasks run beside the handlers (lease releases, closing a finished call): kept referenced until they end,
    and waited for a while when the service stops."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout: float) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)


_closing = Background()


def add_servicer(server: grpc.aio.Server, service: ServiceDescriptor, servicer: Any) -> None:
    """Register ``servicer``'s methods of ``service``, as the generated ``add_*Servicer_to_server`` does, except that
    a request whose bytes do not parse ends INVALID_ARGUMENT (gRPC's own deserializer ends it UNKNOWN). For services
    that take bytes from outside; unary requests only."""
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for m in service.methods:
        if m.client_streaming:
            raise TypeError(f"{m.full_name}: add_servicer takes unary requests only")
        parse = _parser(message_factory.GetMessageClass(m.input_type))
        behavior = getattr(servicer, m.name)
        out = message_factory.GetMessageClass(m.output_type).SerializeToString
        if m.server_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(_parsed_stream(parse, behavior),
                                                                    response_serializer=out)
        else:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(_parsed_unary(parse, behavior),
                                                                   response_serializer=out)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _parser(cls: Any) -> Callable[[bytes, grpc.aio.ServicerContext], Any]:
    async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return cls.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a valid {cls.DESCRIPTOR.full_name} message ({e})")

    return parse


def _parsed_stream(parse: Callable[..., Any], behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        async for item in behavior(await parse(raw, context), context):
            yield item

    return stream


def _parsed_unary(parse: Callable[..., Any], behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await parse(raw, context), context)

    return unary


# -- clients --------------------------------------------------------------------------------------------
class StubCache:
    """Channels to workers, opened on first use by address and kept (workers come and go; addresses repeat)."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, type], Any] = {}

    def get(self, address: str, stub_cls: type) -> Any:
        key = (address, stub_cls)
        stub = self._stubs.get(key)
        if stub is None:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
            stub = self._stubs[key] = stub_cls(ch)
        return stub

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._stubs.clear()


# -- the server --------------------------------------------------------------------------------------------
class ServiceApp(Protocol):
    """What ``run`` needs from a service."""

    @property
    def role(self) -> str: ...

    registry: CollectorRegistry

    def register(self, server: grpc.aio.Server) -> list[str]:
        """Add the servicers to ``server``; return their full service names (for health and reflection)."""
        ...

    async def start(self) -> None:
        """Get ready to serve (load, warm up). Called after the server listens, while health is NOT_SERVING."""
        ...

    async def stop(self) -> None:
        """Release resources after the server drained. Must not raise."""
        ...


# Optional on a ServiceApp: ``async def begin_drain(self) -> None``, awaited as soon as the drain starts (before
# in-flight RPCs finish), e.g. to tell the router "draining" at once. Exceptions are logged and ignored. Also
# optional: ``stop_event`` (an ``asyncio.Event`` the app sets to end itself) and ``failed`` (not None: `run` exits 1).


@dataclass
class RunningServer:
    """A listening server: its health servicer decides what load balancers and the launcher see."""

    server: grpc.aio.Server
    health: health_aio.HealthServicer
    service_names: list[str]
    port: int
    metrics_port: int | None
    _metrics_http: Any = None

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def drain(self, grace_s: float) -> None:
        """NOT_SERVING, refuse new RPCs, give in-flight ones ``grace_s`` seconds, then cancel them."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self._metrics_http is not None:  # shutdown() waits for the serving thread's next poll (≤ 0.5 s)
            http = self._metrics_http
            threading.Thread(target=lambda: (http.shutdown(), http.server_close()), daemon=True).start()


async def start_server(
    app: ServiceApp,
    host: str,
    port: int,
    metrics_port: int | None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None,
    reuse_port: bool = False,
) -> RunningServer:
    """Listen on ``host:port`` (0: any free port) with health NOT_SERVING; ``/metrics`` on ``metrics_port``.

    ``interceptors`` None: the trace-context one (a list given replaces it: include it to keep tracing).
    ``reuse_port``: share the port with the other processes that listen on it so (SO_REUSEPORT)."""
    if interceptors is None:
        interceptors = [telemetry.TraceContextInterceptor()]
    options = [(k, 1 if k == "grpc.so_reuseport" and reuse_port else v) for k, v in SERVER_OPTIONS]
    server = grpc.aio.server(interceptors=list(interceptors), options=options)
    names = app.register(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"{app.role}: cannot listen on {host}:{port} (in use?)")
    running = RunningServer(server, health, names, bound, metrics_port)
    await running.set_serving(False)
    await server.start()
    if metrics_port is not None:
        http, _ = start_http_server(metrics_port, addr=host, registry=app.registry)
        running._metrics_http = http
        running.metrics_port = http.server_port
    return running


async def serve_until_signalled(app: ServiceApp, cfg: ServiceConfig, stop: asyncio.Event | None = None,
                                freeze_gc: bool = False) -> None:
    """Run ``app`` on ``cfg``'s ports until SIGTERM/SIGINT (or ``stop`` is set), then drain and stop it.
    ``freeze_gc``: once ready, freeze the process's heap out of later collections (a service's own process only)."""
    stop = stop or getattr(app, "stop_event", None) or asyncio.Event()  # an app may end itself (a dead engine)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    telemetry.setup_tracing(f"tokenmill-{cfg.role}", cfg.cluster.otlp_endpoint, instance_id=cfg.name,
                            trace_dir=cfg.cluster.trace_dir)
    running = await start_server(app, cfg.host, cfg.grpc_port, cfg.metrics_port)
    shared: RunningServer | None = None  # the public port a gateway serves with the host's other gateways
    gc_watch = GcWatch(app.registry, cfg.name)
    try:
        starting = asyncio.ensure_future(app.start())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # a failed start raises here
            if freeze_gc:
                frozen = freeze_startup_heap()
                log.debug("%s: %d objects of start-up frozen out of garbage collection", cfg.name, frozen)
            if cfg.shared_grpc_port is not None:  # bound once ready: the kernel hands connections only to a ready one
                shared = await start_server(app, cfg.host, cfg.shared_grpc_port, None, reuse_port=True)
                await shared.set_serving(True)
            await running.set_serving(True)
            log.info("%s ready: grpc %s:%d%s metrics :%s", cfg.name, cfg.host, running.port,
                     f" (public {shared.port}, shared)" if shared is not None else "", running.metrics_port)
            await stopped
        else:
            starting.cancel()
        log.info("%s draining (grace %.1f s)", cfg.name, cfg.cluster.grace_s)
    finally:
        begin_drain = getattr(app, "begin_drain", None)
        if begin_drain is not None:
            try:
                await begin_drain()
            except Exception:
                log.exception("%s: begin_drain failed", cfg.name)
        servers = [running] if shared is None else [shared, running]
        await asyncio.gather(*(srv.drain(cfg.cluster.grace_s) for srv in servers))
        await app.stop()
        gc_watch.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("%s stopped", cfg.name)


def run(app: ServiceApp, cfg: ServiceConfig) -> int:
    """Blocking entry point of ``tokenmill serve <role>``: returns the process exit code (1: it failed)."""
    try:
        asyncio.run(serve_until_signalled(app, cfg, freeze_gc=cfg.cluster.gc_freeze))
    except (OSError, ValueError) as e:  # a bad model path, a taken port: the message says it all
        log.error("%s failed: %s", cfg.name, e)
        return 1
    except Exception:
        log.exception("%s failed", cfg.name)
        return 1
    failed = getattr(app, "failed", None)
    if failed is not None:
        log.error("%s stopped because its engine failed: %s: %s", cfg.name, type(failed).__name__, failed)
        return 1
    return 0


def health_status(address: str, timeout: float = 1.0) -> str:
    """``SERVING`` / ``NOT_SERVING`` / ``UNREACHABLE`` of a server's overall health (blocking; for tools)."""
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError:
        return "UNREACHABLE"
