"""Tenants at the real gateway, tokenizer and router with fake decode workers (what the workers are sent is
visible): RequestMeta's tenant fields on every worker call, the audit log with prompts, and resumable streams
that only their tenant may follow."""

from __future__ import annotations

import asyncio
import json

import grpc
import openai
import pytest
from tokenmill.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

from common.loader import load_tokenizer
from services.gateway.tenancy import hash_key
from tests.services.test_gateway import FakeDecode, stack
from tests.services.test_http_api import client

TENANTS = {"tenants.acme.keys_sha256": hash_key("sk-acme"), "tenants.acme.weight": 2.5,
           "tenants.acme.max_running": 3, "tenants.acme.max_class": "standard", "tenants.acme.rpm": 100,
           "tenants.beta.keys_sha256": hash_key("sk-beta"), "tenants.beta.share_prefix_cache": True}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


def test_request_meta_carries_the_tenant_to_the_workers(tok):
    async def body():
        d = FakeDecode(tokens=2)
        async with stack(tok, {"decode-a": d}, **TENANTS) as st:
            await client(st, "sk-acme").completions.create(model="smollm2", prompt="Hi", max_tokens=2,
                                                           extra_body={"service_tier": "priority",
                                                                       "cache_salt": "mine"})
            m = d.requests[-1].meta
            assert (m.tenant_id, m.priority_class, m.tenant_weight, m.tenant_max_running) == (
                "acme", common_pb2.PRIORITY_CLASS_STANDARD, 2.5, 3)
            assert m.cache_salt == "tenant\x00acme\x00mine"
            async with grpc.aio.insecure_channel(st.gateway) as ch:
                stub = frontend_pb2_grpc.FrontendStub(ch)
                req = frontend_pb2.GenerateRequest(prompt="Hi", priority_class=common_pb2.PRIORITY_CLASS_BATCH)
                [r async for r in stub.Generate(req, metadata=[("authorization", "Bearer sk-beta")])]
                m = d.requests[-1].meta
                assert (m.tenant_id, m.priority_class, m.tenant_weight, m.cache_salt) == (
                    "beta", common_pb2.PRIORITY_CLASS_BATCH, 1.0, "")  # beta shares its prefix cache
                call = stub.Generate(frontend_pb2.GenerateRequest(prompt="Hi"),
                                     metadata=[("authorization", "Bearer sk-acme")])
                md = dict(await call.initial_metadata())  # OpenAI's x-ratelimit-* headers, as metadata
                assert md["x-ratelimit-limit-requests"] == "100" and md["x-ratelimit-remaining-requests"] == "98"
                assert "x-ratelimit-limit-tokens" not in md  # acme has no token quota
                [r async for r in call]
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    bad = frontend_pb2.GenerateRequest(prompt="Hi", priority_class=7)
                    [r async for r in stub.Generate(bad, metadata=[("authorization", "Bearer sk-beta")])]
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "priority_class 7" in e.value.details()

    asyncio.run(body())


def test_prefill_and_decode_get_the_same_tenant_meta(tok):
    async def body():
        d = FakeDecode(tokens=2)
        async with stack(tok, {"decode-a": d}, prefill_finish=0, threshold=1, **TENANTS) as st:
            await client(st, "sk-acme").completions.create(model="smollm2", prompt="A prompt long enough",
                                                           max_tokens=2)
            pre, dec = st.prefill.requests[-1].meta, d.requests[-1].meta
            assert pre == dec and pre.tenant_id == "acme" and pre.tenant_weight == 2.5
            assert pre.priority_class == common_pb2.PRIORITY_CLASS_STANDARD and pre.cache_salt.startswith("tenant")

    asyncio.run(body())


def test_audit_log_holds_prompts_and_outputs_only_when_asked(tok, tmp_path):
    async def body(log_prompts: bool):
        path = tmp_path / f"audit-{log_prompts}.jsonl"
        async with stack(tok, {"decode-a": FakeDecode(tokens=3)}, **TENANTS, **{
                "gateway.audit_log": str(path), "gateway.log_prompts": log_prompts}) as st:
            c = client(st, "sk-acme")
            await c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Secret plan"}],
                                            extra_headers={"X-Request-Id": "a-1"})
            with pytest.raises(openai.AuthenticationError):
                await client(st, "sk-wrong").completions.create(model="smollm2", prompt="Hi")
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        served = next(r for r in lines if r["request_id"] == "a-1")
        assert (served["tenant"], served["completion_tokens"], served["status"]) == ("acme", 3, "stop")
        assert any(r["status"] == "UNAUTHENTICATED" and r["reason"] == "unauthenticated" for r in lines)
        if log_prompts:
            assert served["prompt"] == [{"role": "user", "content": "Secret plan"}]
            assert served["output"] == "<0><1><2>"
        else:
            assert "Secret" not in path.read_text() and "output" not in served

    asyncio.run(body(True))
    asyncio.run(body(False))


def test_only_its_tenant_may_resume_a_stream(tok):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode("pause", tokens=4)}, **TENANTS,
                         **{"gateway.resume_window_s": 5.0}) as st, grpc.aio.insecure_channel(st.gateway) as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            acme, beta = [("authorization", "Bearer sk-acme")], [("authorization", "Bearer sk-beta")]
            call = stub.Generate(frontend_pb2.GenerateRequest(prompt="hi", request_id="mine"), metadata=acme)
            await call.read()
            call.cancel()
            for md, code in ((beta, grpc.StatusCode.NOT_FOUND), (None, grpc.StatusCode.UNAUTHENTICATED)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Resume(frontend_pb2.ResumeRequest(request_id="mine", after_seq=1), metadata=md).read()
                assert e.value.code() == code
            resumed = stub.Resume(frontend_pb2.ResumeRequest(request_id="mine", after_seq=1), metadata=acme)
            rest = [await resumed.read()]
            assert st.gw.tenant_inflight["acme"] == 1  # a resumed stream counts in flight, as on HTTP
            while (r := await resumed.read()) is not grpc.aio.EOF:
                rest.append(r)
            assert [r.seq for r in rest] == [2, 3, 4]

    asyncio.run(body())


def test_in_flight_caps_hold_on_both_front_doors(tok):
    """``gateway.tenant_max_inflight`` counts a tenant's requests through gRPC and HTTP together: over it, a gRPC
    call gets RESOURCE_EXHAUSTED with Retry-After and an HTTP one 429, naming the cap; another tenant is not held
    back; the slot comes back when the stream ends. A tenant's own ``max_inflight`` wins over that default;
    ``gateway.max_inflight_requests`` caps everyone's."""
    acme, beta = [("authorization", "Bearer sk-acme")], [("authorization", "Bearer sk-beta")]

    def call(stub, who):
        return stub.Generate(frontend_pb2.GenerateRequest(prompt="Hi"), metadata=who)

    async def refused(stub, who) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [r async for r in call(stub, who)]
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(e.value.trailing_metadata())["retry-after"] == "1"
        return e.value

    async def body():
        limits = {"gateway.tenant_max_inflight": 1}
        async with (stack(tok, {"decode-a": FakeDecode("slow")}, **TENANTS, **limits) as st,
                    grpc.aio.insecure_channel(st.gateway) as ch):
            stub = frontend_pb2_grpc.FrontendStub(ch)
            held = call(stub, acme)
            await held.read()  # acme's one slot is taken
            e = await refused(stub, acme)
            assert "tenant acme is over its quota of 1 requests in flight (gateway.tenant_max_inflight)" in e.details()
            with pytest.raises(openai.RateLimitError) as h:  # the HTTP door counts the same requests
                await client(st, "sk-acme").completions.create(model="smollm2", prompt="Hi", max_tokens=2)
            assert h.value.body["code"] == "quota_exceeded" and h.value.response.headers["Retry-After"] == "1"
            other = call(stub, beta)
            await other.read()  # beta has a slot of its own
            assert st.gw.inflight == 2 and st.gw.tenant_inflight == {"acme": 1, "beta": 1}
            # the gateway samples its own event loop's lag (tokenmill:gateway_loop_lag_seconds)
            assert st.gw.registry.get_sample_value("tokenmill:gateway_loop_lag_seconds_count") > 0
            held.cancel()
            other.cancel()
            for _ in range(100):
                if st.gw.inflight == 0:
                    break
                await asyncio.sleep(0.05)
            assert st.gw.inflight == 0 and not st.gw.tenant_inflight
            again = call(stub, acme)
            await again.read()  # acme's slot came back
            again.cancel()
            for _ in range(100):
                if st.gw.inflight == 0:
                    break
                await asyncio.sleep(0.05)
            # calls sent together: one of them passes a cap of 1 (test_host_limits checks that admission counts at
            # once, so that no await between it and the request's work lets others through)
            burst = [call(stub, acme) for _ in range(4)]
            got = await asyncio.gather(*(c.read() for c in burst), return_exceptions=True)
            assert sum(not isinstance(g, BaseException) for g in got) == 1, got
            assert all(g.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for g in got if isinstance(g, BaseException))
            assert st.gw.tenant_inflight == {"acme": 1}
            for c in burst:
                c.cancel()
        # beta's own cap wins over the default; three gateways that split beta's cap of 4 admit 2 each (rounded up)
        for limits, says in (
                ({"tenants.beta.max_inflight": 2, "gateway.tenant_max_inflight": 1},
                 "quota of 2 requests in flight (tenants.beta.max_inflight);"),
                ({"tenants.beta.max_inflight": 4, "gateway.quota_shares": 3},
                 "quota of 4 requests in flight (tenants.beta.max_inflight), 2 at each of the 3 gateways that split "
                 "it (gateway.quota_shares)")):
            async with (stack(tok, {"decode-a": FakeDecode("slow")}, **TENANTS, **limits) as st,
                        grpc.aio.insecure_channel(st.gateway) as ch):
                stub = frontend_pb2_grpc.FrontendStub(ch)
                calls = [call(stub, beta) for _ in range(2)]
                for c in calls:
                    await c.read()
                e = await refused(stub, beta)
                assert says in e.details()
                assert st.gw.tenant_inflight == {"beta": 2}
                for c in calls:
                    c.cancel()
        async with (stack(tok, {"decode-a": FakeDecode("slow")}, **TENANTS,
                          **{"gateway.max_inflight_requests": 1}) as st,
                    grpc.aio.insecure_channel(st.gateway) as ch):
            stub = frontend_pb2_grpc.FrontendStub(ch)
            held = call(stub, acme)
            await held.read()
            assert "queue is full" in (await refused(stub, beta)).details()
            held.cancel()

    asyncio.run(body())


def test_refusals_at_the_door_call_no_tokenizer(tok, tmp_path):
    """A request over its tenant's in-flight cap or its requests quota is refused before the tokenizer pool (or the
    router, or a worker) is called, on both front doors, with the same status, message and headers as ever; it is
    counted and audited, and leaves nothing counted in flight or taken from a bucket (a flooding tenant is refused
    hundreds of times a second: each refusal must stay cheap)."""
    flood = [("authorization", "Bearer sk-flood")]
    audit = tmp_path / "audit.jsonl"
    limits = {"tenants.flood.keys_sha256": hash_key("sk-flood"), "tenants.flood.max_inflight": 1,
              "tenants.flood.rpm": 1, "tenants.flood.rpm_burst": 1, "gateway.audit_log": str(audit)}

    async def refused(stub) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [r async for r in stub.Generate(frontend_pb2.GenerateRequest(prompt="Hi"), metadata=flood)]
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return e.value

    def rejected(gw, reason: str) -> float:
        return gw.registry.get_sample_value("tokenmill:tenant_rejected_requests_total",
                                            {"tenant": "flood", "reason": reason}) or 0.0

    async def body():
        async with (stack(tok, {"decode-a": FakeDecode("slow")}, **TENANTS, **limits) as st,
                    grpc.aio.insecure_channel(st.gateway) as ch):
            tokenized = []
            pool_call = st.gw.tokenizers.call

            async def counted(fn, what):
                tokenized.append(what)
                return await pool_call(fn, what)

            st.gw.tokenizers.call = counted
            stub = frontend_pb2_grpc.FrontendStub(ch)
            held = stub.Generate(frontend_pb2.GenerateRequest(prompt="Hi"), metadata=flood)
            await held.read()  # flood's one slot, and its one request of the minute
            assert len(tokenized) == 1
            for _ in range(3):  # over the in-flight cap
                e = await refused(stub)
                assert e.details() == ("tenant flood is over its quota of 1 requests in flight "
                                       "(tenants.flood.max_inflight); retry after the Retry-After seconds")
                assert dict(e.trailing_metadata())["retry-after"] == "1"
            with pytest.raises(openai.RateLimitError) as h:
                await client(st, "sk-flood").completions.create(model="smollm2", prompt="Hi", max_tokens=2)
            assert h.value.body["code"] == "quota_exceeded" and h.value.response.headers["Retry-After"] == "1"
            assert rejected(st.gw, "in_flight") == 4 and len(tokenized) == 1
            assert st.gw.inflight == 1 and st.gw.tenant_inflight == {"flood": 1}
            held.cancel()
            for _ in range(100):
                if st.gw.inflight == 0:
                    break
                await asyncio.sleep(0.05)
            e = await refused(stub)  # a slot is free now, the request bucket is not
            assert e.details().startswith("tenant flood is over its quota of 1 requests per minute (rpm, burst 1); "
                                          "retry after ")
            md = dict(e.trailing_metadata())
            assert 1 <= int(md["retry-after"]) <= 60 and md["x-ratelimit-limit-requests"] == "1"
            assert md["x-ratelimit-remaining-requests"] == "0" and "x-ratelimit-reset-requests" in md
            with pytest.raises(openai.RateLimitError) as h:
                await client(st, "sk-flood").completions.create(model="smollm2", prompt="Hi", max_tokens=2)
            assert h.value.body["code"] == "rate_limit_exceeded"
            assert h.value.response.headers["x-ratelimit-remaining-requests"] == "0"
            assert rejected(st.gw, "requests") == 2 and len(tokenized) == 1
            assert st.gw.inflight == 0 and not st.gw.tenant_inflight  # refused by the quota: not left in flight
        lines = [json.loads(x) for x in audit.read_text().splitlines()]
        assert [r["reason"] for r in lines if r["status"] == "RESOURCE_EXHAUSTED"] == ["in_flight"] * 4 + [
            "requests"] * 2

    asyncio.run(body())
