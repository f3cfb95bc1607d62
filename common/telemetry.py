"""OpenTelemetry tracing for every service: a tracer provider, W3C trace context over gRPC metadata, span helpers.

- ``setup_tracing(service_name)`` (called once by ``common.rpc`` at service start-up) installs an SDK tracer
  provider where spans have somewhere to go. When ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the standard env) or the config field ``otlp_endpoint`` is set, spans go
  to that OTLP/gRPC endpoint through a ``BatchSpanProcessor`` (the exporter is the optional ``tokenmill[otlp]``
  dependency); with ``trace_dir``, to files. By default neither is set and **no provider is installed**: the
  spans are the API's non-recording ones, which cost a fraction of a recorded span (each service makes several
  a request, and a gateway refuses hundreds a second under a flood) and still carry a caller's trace context on:
  a client's ``traceparent`` reaches every service. The other ``OTEL_*`` variables (sampler,
  propagators, resource attributes, exporter headers) keep their standard meaning.
- Propagation: a caller passes ``metadata=outgoing_metadata()`` on its gRPC call (``traceparent``, ``tracestate``);
  every server built by ``common.rpc.start_server`` has ``TraceContextInterceptor``, which makes the caller's
  context current in the handler, so the server's spans are children of the caller's.
- Spans: ``span`` (a ``with`` block in a coroutine), ``traced`` (a whole unary handler), ``stream_span`` (the body
  of an async generator: safe across its ``yield``s), and, for work timed on another thread (the engine loop
  must never block on tracing), ``start_span`` / ``record_span`` with explicit ``time.time_ns()`` times.

The spans of one request (one trace): ``generate`` (gateway, the root; request_id, tenant, priority,
prompt_tokens) → ``tokenize`` (gateway client call → ``tokenize`` in the tokenizer), ``route`` (router Place),
``prefill`` (prefill worker's handler) → ``prefill.queue`` (submitted to the engine → the start of the first
engine step that took it from the waiting queue: approximate, to one engine iteration) and ``prefill.compute``
(that step → the first token back on the handler's loop), ``decode`` (decode worker: handed to the engine →
its finished delta reaches the handler; output_tokens, finish_reason) → ``kv_transfer`` (NIXL READ started →
the engine-loop poll that saw DONE/ERR, so up to one step late; bytes, blocks, peer).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

log = logging.getLogger(__name__)

SERVER, CLIENT, INTERNAL = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL
ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# A proxy: it follows whichever provider is installed, before or after this module is imported.
TRACER = trace.get_tracer("tokenmill")
F = TypeVar("F", bound=Callable[..., Any])
Attributes = Mapping[str, Any] | None


# -- set-up ------------------------------------------------------------------------------------------------
@dataclass
class TracingSetup:
    provider: TracerProvider
    exporter: SpanExporter | None  # None: spans are made and propagated, never exported
    processor: SpanProcessor | None
    installed: bool  # False: a provider was installed already (a test's, or an earlier call), and stays


def otlp_endpoint(configured: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The OTLP endpoint in force: the config field, else the standard env variables, else None (no export)."""
    if configured:
        return configured
    env = os.environ if env is None else env
    return next((env[k] for k in ENDPOINT_ENV if env.get(k)), None)


def setup_tracing(service_name: str, endpoint: str | None = None, *, instance_id: str = "",
                  install: bool = True, trace_dir: str | None = None) -> TracingSetup:
    """Build the process's tracer provider and (``install``) make it the global one, unless nothing would receive
    its spans (no exporter, no ``trace_dir``): then ``installed`` is False and the global provider is left as it is.

    ``endpoint`` is the config field ``otlp_endpoint``; without it, the standard OTLP env variables decide.
    A missing exporter package or a bad endpoint is logged, never fatal: tracing must not stop a service.
    ``trace_dir`` (the config field): spans also go, one JSON line each, to ``trace_dir/SERVICE-PID.jsonl``
    (``python -m loadgen.trace_summary DIR`` breaks requests' time down by stage)."""
    attrs = {"service.name": service_name}
    if instance_id:
        attrs["service.instance.id"] = instance_id
    provider = TracerProvider(resource=Resource.create(attrs))
    exporter: SpanExporter | None = None
    processor: SpanProcessor | None = None
    where = otlp_endpoint(endpoint)
    if where:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            # no endpoint argument: the exporter reads the OTEL_EXPORTER_OTLP_* env itself (headers, TLS…)
            exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
        except ImportError:
            log.warning("%s: OTLP endpoint %s is set but the exporter is not installed (pip install "
                        "'tokenmill[otlp]'): spans are not exported", service_name, where)
        except Exception as e:
            log.warning("%s: cannot export spans to %s (%s): spans are not exported", service_name, where, e)
        if exporter is not None:
            processor = BatchSpanProcessor(exporter)
            provider.add_span_processor(processor)
            log.info("%s: exporting spans over OTLP to %s", service_name, where)
    if trace_dir:
        path = os.path.join(trace_dir, f"{service_name}-{os.getpid()}.jsonl")
        try:
            os.makedirs(trace_dir, exist_ok=True)
            provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(path)))
            log.info("%s: writing spans to %s", service_name, path)
        except OSError as e:
            log.warning("%s: cannot write spans to %s (%s)", service_name, path, e)
    installed = False
    if install and exporter is None and not trace_dir:
        log.debug("%s: no OTLP endpoint and no trace_dir: spans are not recorded", service_name)
    elif install:
        if isinstance(trace.get_tracer_provider(), TracerProvider):
            log.debug("%s: a tracer provider is installed already; keeping it", service_name)
        else:
            trace.set_tracer_provider(provider)
            installed = True
    return TracingSetup(provider, exporter, processor, installed)


class JsonLinesSpanExporter(SpanExporter):
    """Finished spans as JSON lines in a file: name, trace and span ids (hex), parent id, start and end (ns since
    the epoch), attributes, and events (name, time)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1 << 16)  # noqa: SIM115 (open for the exporter's life)

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        for sp in spans:
            ctx, parent = sp.context, sp.parent
            self._file.write(json.dumps({
                "name": sp.name, "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
                "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
                "service": sp.resource.attributes.get("service.name"), "start_ns": sp.start_time,
                "end_ns": sp.end_time, "attributes": dict(sp.attributes or {}),
                "events": [{"name": e.name, "time_ns": e.timestamp} for e in sp.events],
            }, default=str) + "\n")
        self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._file.close()


# -- propagation over gRPC metadata --------------------------------------------------------------------------
def outgoing_metadata() -> tuple[tuple[str, str], ...] | None:
    """The current trace context as gRPC call metadata (``metadata=`` of a stub call); None when there is none."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) or None


class _MetadataGetter(Getter[Sequence[tuple[str, Any]]]):
    def get(self, carrier: Sequence[tuple[str, Any]], key: str) -> list[str] | None:
        values = [v for k, v in carrier if k == key and isinstance(v, str)]
        return values or None

    def keys(self, carrier: Sequence[tuple[str, Any]]) -> list[str]:
        return [k for k, _ in carrier]


_GETTER = _MetadataGetter()


def incoming_context(metadata: Sequence[tuple[str, Any]] | None) -> otel_context.Context | None:
    """The caller's trace context from gRPC invocation metadata; None when it carries none."""
    if not metadata:
        return None
    fields = propagate.get_global_textmap().fields
    if not any(k in fields for k, _ in metadata):
        return None
    return propagate.extract(metadata, getter=_GETTER)


class TraceContextInterceptor(grpc.aio.ServerInterceptor):
    """Runs each handler under the trace context its caller sent (``traceparent``), so spans it starts are the
    caller's children. A call without one is passed through untouched (no wrapping, no cost)."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        ctx = incoming_context(details.invocation_metadata) if handler is not None else None
        if ctx is None:
            return handler
        h = handler
        if h.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_under(ctx, h.unary_unary), h.request_deserializer,
                                                       h.response_serializer)
        if h.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_under(ctx, h.unary_stream), h.request_deserializer,
                                                        h.response_serializer)
        if h.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_under(ctx, h.stream_unary), h.request_deserializer,
                                                        h.response_serializer)
        if h.stream_stream:
            return grpc.stream_stream_rpc_method_handler(_under(ctx, h.stream_stream), h.request_deserializer,
                                                         h.response_serializer)
        return handler


def _under(ctx: otel_context.Context, behavior: Callable[..., Any]) -> Callable[..., Any]:
    """``behavior`` run with ``ctx`` current; keeps its kind (async generator / coroutine), which gRPC inspects."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: Any) -> Any:
            with _activated(ctx):
                async for item in behavior(request, context):
                    yield item

        return stream
    if inspect.iscoroutinefunction(behavior):
        async def unary(request: Any, context: Any) -> Any:
            token = otel_context.attach(ctx)
            try:
                return await behavior(request, context)
            finally:
                otel_context.detach(token)

        return unary
    return behavior  # a synchronous behaviour (not used by our aio servers): left as it is


def _task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


@contextlib.contextmanager
def _activated(ctx: otel_context.Context) -> Iterator[None]:
    """``ctx`` current for the block, across the ``yield``s of an async generator. An abandoned generator is
    closed by the loop in another task: there the detach is skipped (its context is not ours to reset)."""
    token = otel_context.attach(ctx)
    task = _task()
    try:
        yield
    finally:
        if _task() is task:
            otel_context.detach(token)


# -- spans ---------------------------------------------------------------------------------------------------
def span(name: str, kind: SpanKind = INTERNAL, attributes: Attributes = None) -> Any:
    """``with span("tokenize", CLIENT):`` — a child of the current span, current inside the block (coroutines)."""
    return TRACER.start_as_current_span(name, kind=kind, attributes=attributes)


def traced(name: str, kind: SpanKind = SERVER) -> Callable[[F], F]:
    """Decorate a unary ``async def`` handler: its whole body runs in span ``name`` (errors recorded)."""
    def deco(method: F) -> F:
        @functools.wraps(method)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            with TRACER.start_as_current_span(name, kind=kind):
                return await method(*args, **kwargs)

        return cast(F, wrapper)  # wraps keeps the signature of ``method``

    return deco


@contextlib.contextmanager
def stream_span(name: str, kind: SpanKind = SERVER, attributes: Attributes = None,
                parent: otel_context.Context | None = None) -> Iterator[trace.Span]:
    """A span around the body of an async generator (a streaming handler) or a coroutine, current inside it
    (tasks started there inherit it); ended on exit. A client cancellation is marked ``cancelled``, not an
    error. ``parent``: the caller's context for a request that did not come over gRPC (the HTTP API's
    ``traceparent``, from ``incoming_context``); None: the current one."""
    s = TRACER.start_span(name, context=parent, kind=kind, attributes=attributes)
    try:
        with _activated(trace.set_span_in_context(s)):
            yield s
    except BaseException as e:
        fail(s, e)
        raise
    finally:
        s.end()


def current_span() -> trace.Span:
    return trace.get_current_span()


def start_span(name: str, *, parent: otel_context.Context | None = None, start_ns: int | None = None,
               kind: SpanKind = INTERNAL, attributes: Attributes = None) -> trace.Span:
    """A span that is not made current: end it with ``finish``. ``parent`` None: the current context."""
    return TRACER.start_span(name, context=parent, kind=kind, attributes=attributes, start_time=start_ns)


def context_with(s: trace.Span) -> otel_context.Context:
    """The current context with ``s`` as its span: the ``parent`` for ``s``'s children made elsewhere."""
    return trace.set_span_in_context(s)


def fail(s: trace.Span, e: BaseException | str) -> None:
    """Mark ``s`` failed (an exception or a message); a cancellation is an attribute, not an error."""
    if isinstance(e, asyncio.CancelledError | GeneratorExit):
        s.set_attribute("cancelled", True)
        return
    if isinstance(e, BaseException):
        # the exception event without its stack trace: formatting one costs ~0.1 ms, and a gateway refuses
        # hundreds of requests a second when a tenant floods it (an unexpected error's trace is in the log)
        if s.is_recording():
            s.add_event("exception", {"exception.type": type(e).__name__, "exception.message": str(e)})
        s.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
    else:
        s.set_status(Status(StatusCode.ERROR, e))


def finish(s: trace.Span, end_ns: int | None = None, attributes: Attributes = None,
           error: BaseException | str | None = None) -> None:
    if attributes:
        s.set_attributes(attributes)
    if error is not None:
        fail(s, error)
    s.end(end_time=end_ns)


def record_span(name: str, start_ns: int, end_ns: int, parent: otel_context.Context | None = None,
                attributes: Attributes = None, error: str | None = None) -> None:
    """A finished span from timestamps taken elsewhere (``time.time_ns()``, e.g. on the engine thread)."""
    finish(start_span(name, parent=parent, start_ns=start_ns, attributes=attributes), end_ns, None, error)

