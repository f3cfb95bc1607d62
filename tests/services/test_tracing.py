"""OpenTelemetry tracing: one Generate is one trace across the gateway, tokenizer and router (W3C trace context
in gRPC metadata), then across real prefill and decode workers (a tiny random model); spans collected in-process
by an in-memory exporter. And ``setup_tracing`` exports nothing unless an OTLP endpoint is configured."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from tokenmill.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

from common import telemetry
from common.loader import load_tokenizer
from services.decode.server import DecodeWorker
from services.gateway.server import GatewayService
from services.prefill.server import PrefillWorker
from services.router.server import RouterService
from tests.services.harness import HOST, cluster, free_port, serving, wait_for_workers
from tests.services.test_gateway import FakeDecode, stack


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def exporter():
    """Every span of this process lands here (the global provider: installed now unless one already is)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exp = InMemorySpanExporter()
    processor = _Switchable(exp)
    provider.add_span_processor(processor)
    yield exp
    processor.on = False  # a provider cannot drop a processor: this one stays, inert, for later tests
    exp.clear()


class _Switchable(SimpleSpanProcessor):
    on = True

    def on_end(self, span) -> None:
        if self.on:
            super().on_end(span)


class RecordingDecode(FakeDecode):
    """A fake decode worker that keeps each call's metadata."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.metadata: list[dict[str, str]] = []

    async def Decode(self, request, context):
        self.metadata.append(dict(context.invocation_metadata() or ()))
        async for delta in super().Decode(request, context):
            yield delta


async def _spans_of(exp: InMemorySpanExporter, request_id: str, timeout: float = 5.0):
    """The finished spans of the trace whose ``generate`` span has ``request_id`` (it ends last: wait for it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        spans = exp.get_finished_spans()
        gen = [s for s in spans if s.name == "generate" and s.attributes.get("request_id") == request_id]
        if gen:
            [g] = gen
            return g, [s for s in spans if s.context.trace_id == g.context.trace_id]
        assert loop.time() < deadline, f"no generate span for {request_id}: {[s.name for s in spans]}"
        await asyncio.sleep(0.01)


def test_one_generate_is_one_trace_across_the_grpc_hops(tok, exporter):
    async def body():
        d = RecordingDecode(tokens=3)
        async with stack(tok, {"decode-a": d}) as st, grpc.aio.insecure_channel(st.gateway) as ch:
            fe = frontend_pb2_grpc.FrontendStub(ch)
            exporter.clear()
            req = frontend_pb2.GenerateRequest(prompt="Hello there", request_id="trace-1", priority=3)
            out = [r async for r in fe.Generate(req, metadata=(("x-tenant-id", "acme"),), timeout=20)]
            assert out[-1].finish_reason != 0
            gen, spans = await _spans_of(exporter, "trace-1")
            names = sorted(s.name for s in spans)
            assert names == ["generate", "route", "tokenize", "tokenize"], names
            trace_id = gen.context.trace_id
            assert {s.context.trace_id for s in spans} == {trace_id}

            # the links: generate (root) → tokenize (gateway, client) → tokenize (tokenizer, server); → route
            assert gen.parent is None and gen.kind is SpanKind.SERVER
            [gw_tok] = [s for s in spans if s.name == "tokenize" and s.kind is SpanKind.CLIENT]
            [tk_tok] = [s for s in spans if s.name == "tokenize" and s.kind is SpanKind.SERVER]
            [route] = [s for s in spans if s.name == "route"]
            assert gw_tok.parent.span_id == gen.context.span_id and not gw_tok.parent.is_remote
            assert tk_tok.parent.span_id == gw_tok.context.span_id and tk_tok.parent.is_remote  # over gRPC
            assert route.parent.span_id == gen.context.span_id and route.parent.is_remote
            assert gw_tok.start_time <= tk_tok.start_time <= tk_tok.end_time <= gw_tok.end_time
            assert gen.start_time <= gw_tok.start_time and route.end_time <= gen.end_time

            n_prompt = len(tok.encode("Hello there"))
            assert dict(gen.attributes) == {"request_id": "trace-1", "tenant": "acme", "priority": 3,
                                            "priority_class": "standard",
                                            "prompt_tokens": n_prompt}
            assert tk_tok.attributes["tokens"] == n_prompt
            assert route.attributes["decode_worker"] == "decode-a" and route.attributes["request_id"] == "trace-1"
            # the decode worker is called under the same trace, as a child of generate
            [md] = d.metadata
            assert md["traceparent"].startswith(f"00-{trace_id:032x}-{gen.context.span_id:016x}-")

            # the next request is a trace of its own: nothing leaks from one RPC's context into another's
            await asyncio.sleep(0)
            out = [r async for r in fe.Generate(frontend_pb2.GenerateRequest(prompt="Hi", request_id="trace-2"),
                                                timeout=20)]
            gen2, spans2 = await _spans_of(exporter, "trace-2")
            assert gen2.parent is None and gen2.context.trace_id != trace_id
            assert sorted(s.name for s in spans2) == ["generate", "route", "tokenize", "tokenize"]

            # a client that sends its own traceparent gets generate as a child of its span
            client_trace, client_span = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
            tp = f"00-{client_trace:032x}-{client_span:016x}-01"
            out = [r async for r in fe.Generate(frontend_pb2.GenerateRequest(prompt="Hi", request_id="trace-3"),
                                                metadata=(("traceparent", tp),), timeout=20)]
            gen3, spans3 = await _spans_of(exporter, "trace-3")
            assert gen3.context.trace_id == client_trace and gen3.parent.span_id == client_span
            assert len(spans3) == 4

    asyncio.run(body())


def test_a_failed_request_marks_its_span(tok, exporter):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode("invalid")}) as st, grpc.aio.insecure_channel(st.gateway) as ch:
            exporter.clear()
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in frontend_pb2_grpc.FrontendStub(ch).Generate(
                        frontend_pb2.GenerateRequest(prompt="x", request_id="trace-bad"), timeout=20):
                    pass
            gen, _ = await _spans_of(exporter, "trace-bad")
            assert gen.status.status_code is trace.StatusCode.ERROR
            assert "9000 tokens" in gen.status.description
            [ev] = [e for e in gen.events if e.name == "exception"]  # type and message, no stack trace
            assert ev.attributes["exception.type"] == "AioRpcError" and "9000 tokens" in ev.attributes[
                "exception.message"] and "exception.stacktrace" not in ev.attributes

    asyncio.run(body())


def test_prefill_and_decode_workers_add_their_spans_to_the_trace(exporter):
    """Router, prefill and decode workers for real on ``dummy:tiny-llama`` (token ids in, no tokenizer called)."""

    async def run(gw: str, request_id: str, n_prompt: int):
        async with grpc.aio.insecure_channel(gw) as ch:
            req = frontend_pb2.GenerateRequest(
                prompt_token_ids=frontend_pb2.TokenIds(ids=[(7 * i) % 500 + 3 for i in range(n_prompt)]),
                request_id=request_id, params=common_pb2.SamplingParams(max_tokens=5, ignore_eos=True))
            out = [r async for r in frontend_pb2_grpc.FrontendStub(ch).Generate(req, timeout=60)]
        assert sum(len(r.token_ids) for r in out) == 5
        gen, spans = await _spans_of(exporter, request_id)
        return gen, {s.name: s for s in spans}, sorted(s.name for s in spans)

    async def body():
        ports = {r: free_port() for r in ("tokenizer", "router", "gateway", "prefill", "decode")}
        cfg = cluster(**{"model": "dummy:tiny-llama", "engine.kv_cache_memory": 8 << 20, "tokenizer.count": 1,
                         **{f"{r}.port": p for r, p in ports.items()}, "router.prefill_threshold_tokens": 32,
                         "prefill.report_interval_s": 0.05, "decode.report_interval_s": 0.05})
        async with contextlib.AsyncExitStack() as es:
            for role, app in (("router", RouterService), ("prefill", PrefillWorker), ("decode", DecodeWorker),
                              ("gateway", GatewayService)):
                await es.enter_async_context(serving(app(cfg.service(role, 0)), cfg, role, ports[role]))
            await wait_for_workers(f"{HOST}:{ports['router']}", 2)
            gw = f"{HOST}:{ports['gateway']}"

            # a long prompt: prefilled remotely, its KV pulled by the decode worker
            gen, s, names = await run(gw, "remote-1", 59)
            assert names == ["decode", "generate", "kv_transfer", "prefill", "prefill.compute", "prefill.queue",
                             "route"], names
            gid = gen.context.span_id
            assert s["route"].parent.span_id == gid and s["prefill"].parent.span_id == gid
            assert s["decode"].parent.span_id == gid and s["decode"].parent.is_remote
            pre, queue, compute = s["prefill"], s["prefill.queue"], s["prefill.compute"]
            assert queue.parent.span_id == compute.parent.span_id == pre.context.span_id
            assert pre.start_time <= queue.start_time <= queue.end_time == compute.start_time
            assert compute.start_time <= compute.end_time <= pre.end_time
            assert pre.attributes["prompt_tokens"] == 59
            kv, dec = s["kv_transfer"], s["decode"]
            assert kv.parent.span_id == dec.context.span_id
            assert dict(kv.attributes) == {"bytes": kv.attributes["bytes"], "blocks": 4, "runs": kv.attributes["runs"],
                                           "peer": kv.attributes["peer"]}
            assert kv.attributes["peer"].startswith("prefill-0.")  # the agent: the worker and its process
            assert 1 <= kv.attributes["runs"] <= 4  # contiguous runs of blocks, each one NIXL descriptor
            assert kv.attributes["bytes"] > 0 and kv.status.status_code is trace.StatusCode.UNSET
            assert dec.start_time <= kv.start_time <= kv.end_time <= dec.end_time <= gen.end_time
            assert dec.attributes["output_tokens"] == 5 and dec.attributes["finish_reason"] == "length"

            # a short one: prefilled on the decode worker itself, no prefill or KV transfer spans
            gen, s, names = await run(gw, "local-1", 9)
            assert names == ["decode", "generate", "route"], names
            assert s["decode"].parent.span_id == gen.context.span_id

    asyncio.run(body())


def test_setup_tracing_exports_only_when_an_endpoint_is_configured(monkeypatch, tmp_path):
    for k in telemetry.ENDPOINT_ENV:
        monkeypatch.delenv(k, raising=False)
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there, and nothing connects: no span ends

    s = telemetry.setup_tracing("tokenmill-test", install=False)
    assert s.exporter is None and s.processor is None and not s.installed
    assert s.provider._active_span_processor._span_processors == ()  # no exporter, no processor at all
    assert s.provider.resource.attributes["service.name"] == "tokenmill-test"
    with s.provider.get_tracer("t").start_as_current_span("x") as sp:  # spans are still made and propagated
        assert sp.is_recording()
        [(key, value)] = telemetry.outgoing_metadata()
        assert key == "traceparent" and f"{sp.get_span_context().trace_id:032x}" in value
    s.provider.shutdown()

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    s = telemetry.setup_tracing("tokenmill-test", install=False)
    try:
        assert isinstance(s.exporter, OTLPSpanExporter) and isinstance(s.processor, BatchSpanProcessor)
        assert s.provider._active_span_processor._span_processors == (s.processor,)
    finally:
        s.provider.shutdown()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")

    s = telemetry.setup_tracing("tokenmill-test", endpoint, install=False)  # the config field alone
    try:
        assert isinstance(s.exporter, OTLPSpanExporter)
    finally:
        s.provider.shutdown()
    assert telemetry.otlp_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1"}) == "http://a:1"

    # a service's set-up (install) with nowhere to send spans installs nothing: the API's spans pass a caller's
    # trace context on without recording; with trace_dir it installs its provider
    installed: list[object] = []
    monkeypatch.setattr(telemetry.trace, "get_tracer_provider", lambda: trace.ProxyTracerProvider())
    monkeypatch.setattr(telemetry.trace, "set_tracer_provider", installed.append)
    s = telemetry.setup_tracing("tokenmill-test")
    assert not s.installed and installed == []
    s = telemetry.setup_tracing("tokenmill-test", trace_dir=str(tmp_path))
    try:
        assert s.installed and installed == [s.provider]
    finally:
        s.provider.shutdown()
    monkeypatch.undo()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    token = otel_context.attach(telemetry.incoming_context([("traceparent", parent)]))
    try:
        with trace.NoOpTracer().start_as_current_span("x") as sp:
            assert not sp.is_recording() and telemetry.outgoing_metadata() == (("traceparent", parent),)
    finally:
        otel_context.detach(token)
    assert telemetry.otlp_endpoint("http://b:2", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1"}) == "http://b:2"
    assert telemetry.otlp_endpoint(None, {}) is None
