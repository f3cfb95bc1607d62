"""Frontend.Generate through the real gateway, tokenizer and router over gRPC, with fake prefill and decode
workers (real gRPC servers that report to the router): streaming, remote prefill, re-placement, cancellation,
input errors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import aiohttp
import grpc
import pytest
from tokenmill.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    frontend_pb2,
    frontend_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    tokenizer_pb2,
)

from common.loader import load_tokenizer
from common.rpc import start_server
from services.gateway.server import GatewayService
from services.router.server import RouterService
from services.tokenizer.server import TokenizerService
from tests.services.harness import HOST, Reporter, cluster, free_port, serving, wait_for_workers

STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, mode: str = "ok", tokens: int = 4) -> None:
        self.mode, self.tokens = mode, tokens
        self.requests: list[decode_pb2.DecodeRequest] = []
        self.cancelled = asyncio.Event()
        self.time_left: list[float | None] = []  # each call's deadline, as its worker sees it

    async def Decode(self, request, context):
        self.requests.append(request)
        self.time_left.append(context.time_remaining())
        # the call ended before its last token: the client cancelled it (told wherever the stream was; one waiting
        # at a yield gets no exception)
        ended = False
        context.add_done_callback(lambda _ctx: None if ended else self.cancelled.set())
        if self.mode == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining")
        if self.mode == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is 9000 tokens; this model accepts 8192")
        for i in range(10**6 if self.mode == "slow" else self.tokens):  # "pause": tokens 0.3 s apart, "paced" 20 ms
            fails = self.mode == "fail_after" or (self.mode == "fail_fresh" and not request.prior_output_ids)
            if fails and i == 2:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker lost its GPU")
            last = i == self.tokens - 1 and self.mode != "slow"
            ended = last
            yield decode_pb2.TokenDelta(
                text=f"<{i}>", token_ids=[100 + i], finish_reason=STOP if last else 0,
                usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1)
                if last else None)
            await asyncio.sleep({"slow": 0.02, "paced": 0.02, "pause": 0.3}.get(self.mode, 0))


    async def DecodeStream(self, requests, context):
        """The gateway's one stream to this worker (gateway.decode_stream, the default): each request runs through
        ``Decode`` with a context of its own; its deltas go out tagged with its id, an abort as its error."""
        out: asyncio.Queue[decode_pb2.TokenDelta] = asyncio.Queue()
        tasks: dict[str, asyncio.Task] = {}

        async def one(m):
            req = m.request
            ctx, rid = _RequestContext(tuple(m.trace.items())), req.meta.request_id
            try:
                async for d in self.Decode(req, ctx):
                    d.request_id = rid
                    out.put_nowait(d)
            except _Aborted as a:
                out.put_nowait(decode_pb2.TokenDelta(request_id=rid, error=decode_pb2.RequestError(
                    code=a.code.value[0], message=a.details)))
            finally:
                ctx.end()
                tasks.pop(rid, None)

        async def read():
            async for m in requests:
                if m.WhichOneof("kind") == "request":
                    tasks[m.request.meta.request_id] = asyncio.get_running_loop().create_task(one(m))
                elif (t := tasks.get(m.cancel_request_id)) is not None:
                    t.cancel()

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while True:
                yield decode_pb2.TokenDeltaBatch(deltas=[await out.get()])
        finally:
            reader.cancel()
            for t in list(tasks.values()):
                t.cancel()


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details


class _RequestContext:
    """What ``FakeDecode.Decode`` uses of a call's context, for one request on a DecodeStream (no deadline: the
    gateway enforces it and cancels the request; the request's trace context as its metadata)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._callbacks: list = []
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None

    def add_done_callback(self, cb) -> None:
        self._callbacks.append(cb)

    async def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(code, details)

    def end(self) -> None:
        for cb in self._callbacks:
            cb(self)


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, address: str, finish: int = 0) -> None:
        self.address, self.finish = address, finish
        self.requests: list[prefill_pb2.PrefillRequest] = []
        self.released: list[str] = []

    async def Prefill(self, request, context):
        self.requests.append(request)
        return prefill_pb2.PrefillResult(
            first_token_id=28120, finish_reason=self.finish, cached_tokens=0,
            kv=common_pb2.KvHandle(worker_id="prefill-a", address=self.address, block_ids=[1, 2], lease_id="lease-1",
                                   num_tokens=len(request.prompt_token_ids)))

    async def Release(self, request, context):
        self.released.append(request.lease_id)
        return prefill_pb2.ReleaseResponse(released=True)


@dataclass
class Stack:
    gateway: str
    gw: GatewayService
    decodes: dict[str, FakeDecode] = field(default_factory=dict)
    prefill: FakePrefill | None = None


@contextlib.asynccontextmanager
async def stack(tok, decodes: dict[str, FakeDecode], prefill_finish: int | None = None, threshold: int = 256,
                **config):
    """Tokenizer, router and gateway for real; fake workers registered with the router. ``config``: more
    dotted config keys (e.g. ``**{"gateway.api_keys": ["k"]}``)."""
    ports = {r: free_port() for r in ("tokenizer", "router", "gateway")}
    cfg = cluster(**{"tokenizer.count": 1, "tokenizer.port": ports["tokenizer"], "router.port": ports["router"],
                     "gateway.port": ports["gateway"], "router.prefill_threshold_tokens": threshold, **config})
    router_addr = f"{HOST}:{ports['router']}"
    gw = GatewayService(cfg.service("gateway", 0))
    async with contextlib.AsyncExitStack() as es:
        await es.enter_async_context(serving(TokenizerService(cfg.service("tokenizer", 0), tok), cfg, "tokenizer",
                                             ports["tokenizer"]))
        await es.enter_async_context(serving(RouterService(cfg.service("router", 0)), cfg, "router",
                                             ports["router"]))
        await es.enter_async_context(serving(gw, cfg, "gateway", ports["gateway"]))
        st = Stack(f"{HOST}:{ports['gateway']}", gw, decodes)
        workers: list[tuple[str, object, int]] = [(wid, d, router_pb2.WORKER_ROLE_DECODE) for wid, d in decodes.items()]
        if prefill_finish is not None:
            p = free_port()
            st.prefill = FakePrefill(f"{HOST}:{p}", prefill_finish)
            workers.append(("prefill-a", st.prefill, router_pb2.WORKER_ROLE_PREFILL))
        for wid, servicer, role in workers:
            port = free_port() if role == router_pb2.WORKER_ROLE_DECODE else int(st.prefill.address.split(":")[1])
            app = _WorkerApp(servicer)
            srv = await start_server(app, HOST, port, None)
            await srv.set_serving(True)
            es.push_async_callback(srv.drain, 0.2)
            rep = Reporter(router_addr)
            await rep.send(worker_id=wid, address=f"{HOST}:{port}", role=role, model_id="m", block_size=16,
                           free_blocks=1000, total_blocks=1000)
            es.push_async_callback(rep.close)
        await wait_for_workers(router_addr, len(workers))
        yield st


class _WorkerApp:
    role = "fake"

    def __init__(self, servicer) -> None:
        from prometheus_client import CollectorRegistry

        self.servicer, self.registry = servicer, CollectorRegistry()

    def register(self, server):
        if isinstance(self.servicer, FakeDecode):
            decode_pb2_grpc.add_DecodeServicer_to_server(self.servicer, server)
            return ["tokenmill.v1.Decode"]
        prefill_pb2_grpc.add_PrefillServicer_to_server(self.servicer, server)
        return ["tokenmill.v1.Prefill"]


async def generate(addr: str, **req) -> list[frontend_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(addr) as ch:
        return [r async for r in frontend_pb2_grpc.FrontendStub(ch).Generate(
            frontend_pb2.GenerateRequest(**req), timeout=20)]


def _sample(metric, suffix: str, **labels) -> float:
    for fam in metric.collect():
        for s in fam.samples:
            if s.name.endswith(suffix) and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


@pytest.mark.parametrize("overrides", [{}, {"gateway.resume_window_s": 1.0}], ids=["plain", "resumable"])
def test_the_callers_deadline_bounds_the_worker_calls(tok, overrides):
    """With a Decode call per request, a gRPC caller's deadline reaches the decode worker (a resumable stream keeps
    it too); HTTP sets none. (On the gateway's DecodeStream the gateway enforces it: the next test.)"""
    overrides = {**overrides, "gateway.decode_stream": False}
    async def body():
        d = FakeDecode(tokens=2)
        async with stack(tok, {"decode-a": d}, **overrides) as st:
            await generate(st.gateway, prompt="hi")  # 20 s
            async with aiohttp.ClientSession() as s, s.post(
                    f"http://{HOST}:{st.gw.http.port}/v1/completions", json={"prompt": "hi"}) as r:
                assert r.status == 200
            grpc_left, http_left = d.time_left
            assert grpc_left is not None and 15 < grpc_left < 21  # gRPC rounds deadlines up a little
            assert http_left is None or http_left > 10**6  # no deadline

    asyncio.run(body())


def test_on_the_decode_stream_the_callers_deadline_cancels_the_request_on_the_worker(tok):
    """The gateway's DecodeStream carries no per-call deadline: at the caller's deadline the gateway ends the
    request (DEADLINE_EXCEEDED) and cancels it on the worker; the stream stays open for the next request."""
    async def body():
        d = FakeDecode(mode="slow")
        async with stack(tok, {"decode-a": d}) as st:
            async with grpc.aio.insecure_channel(st.gateway) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in frontend_pb2_grpc.FrontendStub(ch).Generate(
                            frontend_pb2.GenerateRequest(prompt="hi"), timeout=0.6):
                        pass
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.wait_for(d.cancelled.wait(), 5)
            d.mode, d.tokens = "ok", 3
            out = await generate(st.gateway, prompt="hi")
            assert [r.text for r in out] == ["<0>", "<1>", "<2>"]
            assert st.gw.decode_streams is not None and list(st.gw.decode_streams.open_streams().values()) == [0]

    asyncio.run(body())


def test_a_batch_request_streams_at_its_class_interval_and_ends_without_waiting_it_out(tok):
    """gateway.class_stream_interval_ms: a batch request gets its first token at once, then every token since in
    one message per interval; its end wakes the wait (the stream does not sit out the interval). Interactive and
    standard requests get a message per delta (their interval 0)."""
    async def body():
        d = FakeDecode(mode="paced", tokens=10)  # a token every 20 ms
        async with stack(tok, {"decode-a": d}, **{"gateway.class_stream_interval_ms.batch": 500}) as st:
            t0 = time.monotonic()
            out = await generate(st.gateway, prompt="hi", priority_class=common_pb2.PRIORITY_CLASS_BATCH)
            took = time.monotonic() - t0
            assert [t for r in out for t in r.token_ids] == list(range(100, 110)) and out[-1].finish_reason == STOP
            assert [len(r.token_ids) for r in out] == [1, 9], [len(r.token_ids) for r in out]
            assert took < 0.45, f"the batch stream waited out its 0.5 s interval: {took:.2f} s"
            for klass in (common_pb2.PRIORITY_CLASS_INTERACTIVE, common_pb2.PRIORITY_CLASS_STANDARD):
                out = await generate(st.gateway, prompt="hi", priority_class=klass)
                assert [len(r.token_ids) for r in out] == [1] * 10

    asyncio.run(body())


def test_generate_streams_decode_deltas(tok):
    async def body():
        d = FakeDecode(tokens=4)
        async with stack(tok, {"decode-a": d}) as st:
            out = first = await generate(st.gateway, prompt="Hello there", request_id="req-1")
            # deltas waiting for a client that lags are merged into one message (services/gateway/decode_stream.py)
            assert "".join(r.text for r in out) == "<0><1><2><3>"
            assert [t for r in out for t in r.token_ids] == [100, 101, 102, 103]
            assert all(len(r.token_ids) == len(r.text) // 3 for r in out)  # each message's text is its tokens'
            assert {r.request_id for r in out} == {"req-1"}
            assert out[-1].finish_reason == STOP and out[-1].usage.completion_tokens == 4
            [req] = d.requests
            assert list(req.prompt_token_ids) == tok.encode("Hello there")
            assert req.meta.request_id == "req-1" and not req.HasField("kv") and not req.HasField("first_token_id")

            msgs = [{"role": "user", "content": "What is the capital of France?"}]
            out = await generate(st.gateway, chat=tokenizer_pb2.ChatMessages(
                messages=[tokenizer_pb2.ChatMessage(**m) for m in msgs]))
            assert out[0].request_id.startswith("gen-")
            want = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
            assert list(d.requests[1].prompt_token_ids) == want

            m = st.gw.metrics
            # a gap per token after each request's first message
            itls = sum(sum(len(r.token_ids) for r in o[1:]) for o in (first, out))
            assert sum(len(r.token_ids) for o in (first, out) for r in o) == 8
            assert _sample(m.ttft, "_count") == 2 and _sample(m.itl, "_count") == itls
            assert _sample(m.success, "_total", finished_reason="stop") == 2

    asyncio.run(body())


def test_remote_prefill_hands_first_token_and_kv_to_decode(tok):
    async def body():
        d = FakeDecode(tokens=3)
        async with stack(tok, {"decode-a": d}, prefill_finish=0, threshold=4) as st:
            out = await generate(st.gateway, prompt_token_ids=frontend_pb2.TokenIds(ids=list(range(1, 40))))
            # the fake decode worker's three deltas, merged where the client lagged
            assert [t for r in out for t in r.token_ids] == [100, 101, 102] and out[-1].finish_reason == STOP
            [preq], [dreq] = st.prefill.requests, d.requests
            assert list(preq.prompt_token_ids) == list(range(1, 40))
            assert dreq.first_token_id == 28120 and dreq.kv.lease_id == "lease-1"
            assert st.prefill.released == []  # the decode worker owns the lease now

    asyncio.run(body())


def test_first_token_that_finishes_skips_decode_and_releases_the_lease(tok):
    async def body():
        d = FakeDecode()
        async with stack(tok, {"decode-a": d}, prefill_finish=LENGTH, threshold=4) as st:
            out = await generate(st.gateway, prompt_token_ids=frontend_pb2.TokenIds(ids=list(range(1, 40))),
                                 params=common_pb2.SamplingParams(max_tokens=1))
            [r] = out
            assert list(r.token_ids) == [28120] and r.text == tok.decode([28120]) and r.finish_reason == LENGTH
            assert r.usage.prompt_tokens == 39 and r.usage.completion_tokens == 1
            assert d.requests == []
            for _ in range(50):
                if st.prefill.released:
                    break
                await asyncio.sleep(0.02)
            assert st.prefill.released == ["lease-1"]

    asyncio.run(body())


def test_unavailable_decode_is_replaced_before_the_first_token(tok):
    async def body():
        a, b = FakeDecode("unavailable"), FakeDecode(tokens=2)
        async with stack(tok, {"decode-a": a, "decode-b": b}) as st:
            out = await generate(st.gateway, prompt="hi")
            assert [r.text for r in out] == ["<0>", "<1>"]
            assert len(a.requests) == 1 and len(b.requests) == 1  # a first (tie → smaller id), then b
            assert _sample(st.gw.metrics.retries, "_total", role="decode") == 1

    asyncio.run(body())


def test_a_stream_whose_decode_worker_fails_after_tokens_moves_with_the_tokens_sent(tok):
    async def body():
        decodes = {"decode-a": FakeDecode("fail_fresh", tokens=5), "decode-b": FakeDecode("fail_fresh", tokens=5)}
        async with stack(tok, decodes) as st, grpc.aio.insecure_channel(st.gateway) as ch:
            got, ids = [], []
            async for r in frontend_pb2_grpc.FrontendStub(ch).Generate(frontend_pb2.GenerateRequest(prompt="hi"),
                                                                        timeout=20):
                got.append(r.text)
                ids += r.token_ids
            # two tokens from the worker that failed, then the other one's stream (the fakes restart at <0>)
            assert got == ["<0>", "<1>", "<0>", "<1>", "<2>", "<3>", "<4>"] and ids[:2] == [100, 101]
            first, moved = sorted(decodes.values(), key=lambda d: len(d.requests[0].prior_output_ids))
            assert len(first.requests) == 1 and len(moved.requests) == 1
            assert list(moved.requests[0].prior_output_ids) == [100, 101]
            assert moved.requests[0].prompt_token_ids == first.requests[0].prompt_token_ids
            assert not moved.requests[0].HasField("kv")
            assert _sample(st.gw.metrics.migrations, "_total") == 1

    asyncio.run(body())


def test_failure_after_tokens_past_the_migration_limit_ends_unavailable_and_spent_retries_release_the_lease(tok):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode("fail_after", tokens=5)},
                         **{"gateway.migration_limit": 0}) as st:
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async with grpc.aio.insecure_channel(st.gateway) as ch:
                    async for r in frontend_pb2_grpc.FrontendStub(ch).Generate(
                            frontend_pb2.GenerateRequest(prompt="hi"), timeout=20):
                        got.append(r.text)
            assert got == ["<0>", "<1>"]
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "decode-a failed after 2 tokens" in e.value.details()
            assert "moved 0 times already (gateway.migration_limit)" in e.value.details()
        dead = {"decode-a": FakeDecode("unavailable"), "decode-b": FakeDecode("unavailable"),
                "decode-c": FakeDecode("unavailable")}
        async with stack(tok, dead, prefill_finish=0, threshold=4) as st:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(st.gateway, prompt_token_ids=frontend_pb2.TokenIds(ids=list(range(1, 40))))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "re-placements" in e.value.details()
            assert [len(d.requests) for d in dead.values()] == [1, 1, 1]  # 1 try + 2 re-placements
            assert len(st.prefill.requests) == 1  # the prefill result was reused
            for _ in range(50):
                if st.prefill.released:
                    break
                await asyncio.sleep(0.02)
            assert st.prefill.released == ["lease-1"]

    asyncio.run(body())


def test_client_cancel_cancels_the_decode_call(tok):
    async def body():
        d = FakeDecode("slow")
        async with stack(tok, {"decode-a": d}) as st, grpc.aio.insecure_channel(st.gateway) as ch:
            call = frontend_pb2_grpc.FrontendStub(ch).Generate(frontend_pb2.GenerateRequest(prompt="hi"))
            assert (await call.read()).text == "<0>"
            assert (await call.read()).text == "<1>"
            call.cancel()
            await asyncio.wait_for(d.cancelled.wait(), 5)
            for _ in range(50):
                if _sample(st.gw.metrics.success, "_total", finished_reason="abort") == 1:
                    break
                await asyncio.sleep(0.02)
            assert _sample(st.gw.metrics.success, "_total", finished_reason="abort") == 1
            assert _sample(st.gw.metrics.running, "") == 0

    asyncio.run(body())


@pytest.mark.parametrize(
    ("req", "code", "message"),
    [
        ({}, "INVALID_ARGUMENT", "needs an input: set one of prompt, chat or prompt_token_ids"),
        ({"prompt": ""}, "INVALID_ARGUMENT", "prompt is empty"),
        ({"prompt": "x", "params": common_pb2.SamplingParams(top_p=2)}, "INVALID_ARGUMENT",
         "top_p must be in (0, 1], got 2"),
        ({"prompt": "x", "params": common_pb2.SamplingParams(max_tokens=0)}, "INVALID_ARGUMENT",
         "max_tokens must be at least 1, got 0"),
        ({"chat": tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(content="hi")])},
         "INVALID_ARGUMENT", "chat.messages[0].role is empty"),
        ({"prompt_token_ids": frontend_pb2.TokenIds(ids=[3, -1])}, "INVALID_ARGUMENT",
         "prompt_token_ids[1] is -1"),
        ({"prompt": "worker says no"}, "INVALID_ARGUMENT", "the prompt is 9000 tokens; this model accepts 8192"),
    ],
)
def test_bad_requests_get_actionable_errors(tok, req, code, message):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode("invalid")}) as st:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(st.gateway, **req)
            assert e.value.code().name == code and message in e.value.details()
            assert _sample(st.gw.metrics.failure, "_total", code=code) == 1

    asyncio.run(body())


def test_no_decode_worker_is_unavailable(tok):
    async def body():
        async with stack(tok, {}, **{"gateway.ready_wait_s": 0.3}) as st:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(st.gateway, prompt="hi")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no decode worker has registered with the router" in e.value.details()

    asyncio.run(body())


def test_a_request_waits_for_a_decode_worker_that_registers_within_ready_wait(tok):
    """A router that restarted has no worker until they report again: a request waits for one (up to
    gateway.ready_wait_s) instead of failing."""
    async def body():
        async with stack(tok, {}, **{"gateway.ready_wait_s": 10.0}) as st:
            late = asyncio.create_task(generate(st.gateway, prompt="hi"))
            await asyncio.sleep(0.5)
            assert not late.done()
            port = free_port()
            srv = await start_server(_WorkerApp(FakeDecode(tokens=2)), HOST, port, None)
            await srv.set_serving(True)
            rep = Reporter(f"{HOST}:{st.gw.cfg.cluster.router.port}")
            await rep.send(worker_id="decode-late", address=f"{HOST}:{port}", role=router_pb2.WORKER_ROLE_DECODE,
                           model_id="m", block_size=16, free_blocks=1000, total_blocks=1000)
            try:
                out = await late
                assert "".join(r.text for r in out) == "<0><1>" and out[-1].finish_reason == STOP
            finally:
                await rep.close()
                await srv.drain(0.2)

    asyncio.run(body())


# -- resumable streams ----------------------------------------------------------------------------------------
RESUME = {"gateway.resume_window_s": 1.0}


def test_a_lost_grpc_stream_resumes_after_its_last_seq_and_expires_unfollowed(tok):
    async def body():
        d = FakeDecode("slow")
        async with stack(tok, {"decode-a": d}, **RESUME) as st, grpc.aio.insecure_channel(st.gateway) as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            call = stub.Generate(frontend_pb2.GenerateRequest(prompt="hi", request_id="r-1"))
            got = [await call.read() for _ in range(3)]
            assert [r.seq for r in got] == [1, 2, 3] and [r.text for r in got] == ["<0>", "<1>", "<2>"]
            call.cancel()  # the connection is lost; the generation goes on
            await asyncio.sleep(0.2)
            assert not d.cancelled.is_set()
            again = stub.Resume(frontend_pb2.ResumeRequest(request_id="r-1", after_seq=3))
            more = [await again.read() for _ in range(6)]
            assert [r.seq for r in more] == [4, 5, 6, 7, 8, 9]
            assert [r.text for r in more] == [f"<{i}>" for i in range(3, 9)]  # none twice, none missing
            again.cancel()
            await asyncio.wait_for(d.cancelled.wait(), 5)  # nobody followed for the window: cancelled, KV freed
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Resume(frontend_pb2.ResumeRequest(request_id="r-1", after_seq=9)).read()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "resume_window_s" in e.value.details()

    asyncio.run(body())


def test_a_finished_stream_gives_its_tail_and_bad_resumes_are_refused(tok):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode("ok", tokens=4)}, **RESUME) as st, \
                grpc.aio.insecure_channel(st.gateway) as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            full = [r async for r in stub.Generate(frontend_pb2.GenerateRequest(prompt="hi", request_id="r-2"))]
            assert [r.seq for r in full] == [1, 2, 3, 4] and full[-1].finish_reason == STOP
            tail = [r async for r in stub.Resume(frontend_pb2.ResumeRequest(request_id="r-2", after_seq=2))]
            assert tail == full[2:]
            for rid, after, code in [("r-2", 9, grpc.StatusCode.INVALID_ARGUMENT),
                                     ("nope", 0, grpc.StatusCode.NOT_FOUND)]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    [r async for r in stub.Resume(frontend_pb2.ResumeRequest(request_id=rid, after_seq=after))]
                assert e.value.code() == code, e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:  # its id is taken while its log is kept
                [r async for r in stub.Generate(frontend_pb2.GenerateRequest(prompt="hi", request_id="r-2"))]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already streaming" in e.value.details()

    asyncio.run(body())


def test_resume_is_off_by_default(tok):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode("ok", tokens=2)}) as st, \
                grpc.aio.insecure_channel(st.gateway) as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            full = [r async for r in stub.Generate(frontend_pb2.GenerateRequest(prompt="hi", request_id="r-3"))]
            assert [r.seq for r in full] == [1, 2]  # seq numbers always
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Resume(frontend_pb2.ResumeRequest(request_id="r-3")).read()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "resume is off" in e.value.details()

    asyncio.run(body())


async def _sse_events(resp) -> list[tuple[str | None, str]]:
    """(id, data) of each SSE event in a streamed aiohttp response, and the comments as (None, ': ...')."""
    events, cur_id = [], None
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            cur_id = line[4:]
        elif line.startswith("data: "):
            events.append((cur_id, line[6:]))
            cur_id = None
        elif line.startswith(":"):
            events.append((None, line))
    return events


def test_an_sse_stream_resumes_with_last_event_id_and_idle_streams_get_heartbeats(tok):
    import json

    import aiohttp

    async def body():
        port = free_port()
        config = {**RESUME, "gateway.http_port": port, "gateway.heartbeat_s": 0.1}
        async with stack(tok, {"decode-a": FakeDecode("pause", tokens=5)}, **config) as st, \
                aiohttp.ClientSession() as http:
            url = f"http://{HOST}:{port}/v1/completions"
            req = {"model": st.gw.http.names[0], "prompt": "hi", "stream": True, "max_tokens": 5}
            async with http.post(url, json=req, headers={"X-Request-Id": "cmpl-r4"}) as r:
                assert r.status == 200
                first, seen = [], 0
                async for raw in r.content:  # read up to the second event, then drop the connection
                    line = raw.decode()
                    if line.startswith("id: "):
                        seen = int(line[4:])
                    first.append(line)
                    if seen == 2 and line.startswith("data: "):
                        break
            async with http.post(url, json=req, headers={"X-Request-Id": "cmpl-r4", "Last-Event-ID": "2"}) as r:
                assert r.status == 200, await r.text()
                rest = await _sse_events(r)
            ids = [i for i, _ in rest if i is not None]
            assert ids == ["3", "4", "5"]
            texts = [json.loads(d)["choices"][0]["text"] for i, d in rest if i is not None]
            assert texts == ["<2>", "<3>", "<4>"]
            assert rest[-1] == (None, "[DONE]")
            assert (None, ": keep-alive") in rest  # 0.3 s between tokens, a heartbeat every 0.1 s
            async with http.post(url, json=req, headers={"X-Request-Id": "cmpl-r4", "Last-Event-ID": "x"}) as r:
                assert r.status == 400 and "Last-Event-ID" in (await r.json())["error"]["message"]

    asyncio.run(body())
