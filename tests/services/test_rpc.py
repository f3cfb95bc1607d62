"""common/rpc.py: health transitions, reflection, /metrics, drain with a grace period, error translation."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client import CollectorRegistry, Counter
from tokenmill.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc

from common import rpc
from common.engine import RequestError
from common.tokenizer import ChatTemplateError
from tests.services.harness import HOST, free_port

TOKENIZER = "tokenmill.v1.Tokenizer"


class _SlowTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    @rpc.translate_errors
    async def Tokenize(self, request, context):
        self.entered.set()
        await self.release.wait()
        if request.text == "bad":
            raise RequestError("the prompt is 9000 tokens; this model accepts 8192")
        return tokenizer_pb2.TokenizeResponse(token_ids=[len(request.text)])


class _App:
    role = "test"

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.hits = Counter("tokenmill:test_hits", "test counter", registry=self.registry)
        self.servicer = _SlowTokenizer()
        self.may_start = asyncio.Event()
        self.stopped = False

    def register(self, server):
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(self.servicer, server)
        return [TOKENIZER]

    async def start(self):
        await self.may_start.wait()

    async def stop(self):
        self.stopped = True


async def _check(stub, service: str = "") -> str:
    resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def test_health_reflection_metrics_and_drain():
    async def body():
        app = _App()
        port, mport = free_port(), free_port()
        srv = await rpc.start_server(app, HOST, port, mport)
        addr = f"{HOST}:{port}"
        async with grpc.aio.insecure_channel(addr) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            # listening but not ready: NOT_SERVING, overall and per service
            assert await _check(health) == "NOT_SERVING"
            assert await _check(health, TOKENIZER) == "NOT_SERVING"
            await srv.set_serving(True)
            assert await _check(health) == "SERVING"
            assert await _check(health, TOKENIZER) == "SERVING"

            # reflection, the way grpcurl uses it (blocking client: off the loop)
            def reflect():
                with grpc.insecure_channel(addr) as sync_ch:
                    db = ProtoReflectionDescriptorDatabase(sync_ch)
                    services = set(db.get_services())
                    fd = db.FindFileContainingSymbol(TOKENIZER)
                    return services, fd.name

            services, fname = await asyncio.to_thread(reflect)
            assert {TOKENIZER, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
            assert fname == "tokenmill/v1/tokenizer.proto"

            # /metrics on its own port, this process's registry
            app.hits.inc(3)
            body = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://{HOST}:{mport}/metrics", timeout=5).read().decode())
            assert "tokenmill:test_hits_total 3.0" in body

            # drain: an in-flight RPC finishes within the grace period; watchers see NOT_SERVING; new RPCs fail
            tok = tokenizer_pb2_grpc.TokenizerStub(ch)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            inflight = asyncio.ensure_future(tok.Tokenize(tokenizer_pb2.TokenizeRequest(text="abcd"), timeout=10))
            await asyncio.wait_for(app.servicer.entered.wait(), 5)
            drain = asyncio.ensure_future(srv.drain(grace_s=5))
            assert (await asyncio.wait_for(watch.read(), 5)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            await asyncio.sleep(0.1)
            assert not drain.done()  # waiting for the in-flight call, not cutting it
            app.servicer.release.set()
            assert list((await inflight).token_ids) == [4]
            await asyncio.wait_for(drain, 5)
        async with grpc.aio.insecure_channel(addr) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await tokenizer_pb2_grpc.TokenizerStub(ch).Tokenize(tokenizer_pb2.TokenizeRequest(text="x"),
                                                                   timeout=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(body())


def test_grace_period_bounds_the_drain_and_errors_are_translated():
    async def body():
        app = _App()
        port = free_port()
        srv = await rpc.start_server(app, HOST, port, None)
        await srv.set_serving(True)
        app.servicer.release.set()
        async with grpc.aio.insecure_channel(f"{HOST}:{port}") as ch:
            tok = tokenizer_pb2_grpc.TokenizerStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await tok.Tokenize(tokenizer_pb2.TokenizeRequest(text="bad"), timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == "the prompt is 9000 tokens; this model accepts 8192"
            app.servicer.release.clear()
            stuck = asyncio.ensure_future(tok.Tokenize(tokenizer_pb2.TokenizeRequest(text="zz"), timeout=10))
            await asyncio.sleep(0.2)
            t0 = asyncio.get_running_loop().time()
            await srv.drain(grace_s=0.3)  # the stuck call is cancelled when the grace period ends
            assert asyncio.get_running_loop().time() - t0 < 3
            with pytest.raises(grpc.aio.AioRpcError):
                await stuck

    asyncio.run(body())


def test_add_servicer_answers_bytes_that_do_not_parse_with_invalid_argument():
    class Frontend(frontend_pb2_grpc.FrontendServicer):
        async def Generate(self, request, context):
            yield frontend_pb2.GenerateResponse(text=request.prompt)

    class Tokenizer(tokenizer_pb2_grpc.TokenizerServicer):
        async def Tokenize(self, request, context):
            return tokenizer_pb2.TokenizeResponse(token_ids=[len(request.text)])

    async def body():
        server = grpc.aio.server()
        rpc.add_servicer(server, frontend_pb2.DESCRIPTOR.services_by_name["Frontend"], Frontend())
        rpc.add_servicer(server, tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"], Tokenizer())
        port = server.add_insecure_port(f"{HOST}:{free_port()}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"{HOST}:{port}") as ch:
                generate = ch.unary_stream("/tokenmill.v1.Frontend/Generate", request_serializer=bytes,
                                           response_deserializer=frontend_pb2.GenerateResponse.FromString)
                tokenize = ch.unary_unary("/tokenmill.v1.Tokenizer/Tokenize", request_serializer=bytes,
                                          response_deserializer=tokenizer_pb2.TokenizeResponse.FromString)
                ok = frontend_pb2.GenerateRequest(prompt="hi").SerializeToString()
                assert [r.text async for r in generate(ok, timeout=5)] == ["hi"]
                ok = tokenizer_pb2.TokenizeRequest(text="abc").SerializeToString()
                assert list((await tokenize(ok, timeout=5)).token_ids) == [3]
                for bad in (b"\xff\xff\xff", b"\x1a\x02\xff\xfe"):  # a corrupt wire format; a string not UTF-8
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        async for _ in generate(bad, timeout=5):
                            pass
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
                    assert "not a valid tokenmill.v1.GenerateRequest" in e.value.details()
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await tokenize(bad, timeout=5)
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        finally:
            await server.stop(0)

    asyncio.run(body())


def test_a_status_message_that_echoes_a_huge_value_is_clipped_and_keeps_its_code():
    class Tokenizer(tokenizer_pb2_grpc.TokenizerServicer):
        @rpc.translate_errors
        async def Tokenize(self, request, context):
            raise ValueError(f"request id {request.meta.request_id!r} is already running")

    async def body():
        server = grpc.aio.server()
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(Tokenizer(), server)
        port = server.add_insecure_port(f"{HOST}:{free_port()}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"{HOST}:{port}") as ch:
                rid = "é" * 100_000  # 600 kB percent-encoded: far past any metadata limit
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await tokenizer_pb2_grpc.TokenizerStub(ch).Tokenize(tokenizer_pb2.TokenizeRequest(
                        meta=common_pb2.RequestMeta(request_id=rid)), timeout=5)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value  # not RESOURCE_EXHAUSTED
                assert e.value.details().startswith("request id 'éé") and "more characters)" in e.value.details()
        finally:
            await server.stop(0)

    asyncio.run(body())


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (RequestError("too long"), grpc.StatusCode.INVALID_ARGUMENT),
        (ChatTemplateError("bad role"), grpc.StatusCode.INVALID_ARGUMENT),
        (ValueError("top_p must be in (0, 1], got 2"), grpc.StatusCode.INVALID_ARGUMENT),
        (rpc.ResourceExhausted("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (rpc.Unavailable("no decode worker"), grpc.StatusCode.UNAVAILABLE),
        (rpc.NotFound("no such model"), grpc.StatusCode.NOT_FOUND),
        (KeyError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_for(exc, code):
    got, message = rpc.status_for(exc)
    assert got == code
    if code != grpc.StatusCode.INTERNAL:
        assert message == str(exc)
    else:
        assert "KeyError" in message and "'x'" not in message  # internals stay in the log


def test_serve_until_signalled_runs_the_lifecycle_in_order(caplog):
    from tests.services.harness import cluster

    class App(_App):
        def __init__(self):
            super().__init__()
            self.calls = []

        async def start(self):
            self.calls.append("start")

        async def begin_drain(self):
            self.calls.append("begin_drain")

        async def stop(self):
            self.calls.append("stop")

    async def body():
        port, mport = free_port(), free_port()
        # one tokenizer: a second one's ports (port + 1, mport + 1) can land on the first's when the two free ports
        # are neighbours, a collision no base port can avoid
        svc = cluster(**{"tokenizer.count": 1, "tokenizer.port": port, "tokenizer.metrics_port": mport,
                         "grace_s": 1}).service("tokenizer")
        app, stop = App(), asyncio.Event()
        task = asyncio.ensure_future(rpc.serve_until_signalled(app, svc, stop))
        async with grpc.aio.insecure_channel(f"{HOST}:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for _ in range(100):
                with contextlib.suppress(grpc.aio.AioRpcError):
                    if await _check(health) == "SERVING":
                        break
                await asyncio.sleep(0.02)
            assert await _check(health) == "SERVING"
        stop.set()
        await asyncio.wait_for(task, 5)
        assert app.calls == ["start", "begin_drain", "stop"]

    with caplog.at_level("INFO", logger="common.rpc"):
        asyncio.run(body())
    assert any("tokenizer-0 ready: grpc 127.0.0.1:" in r.getMessage() for r in caplog.records)
    assert any("tokenizer-0 stopped" in r.getMessage() for r in caplog.records)
