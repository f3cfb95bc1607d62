"""Tenants on a whole cluster (``tokenmill up``: real processes, the real model), through both front doors (the
official ``openai`` client and a gRPC client): keys, quotas in tokens, priority classes, prefix-cache isolation,
per-tenant metrics and the audit log."""

from __future__ import annotations

import datetime as dt
import json
import re
import urllib.request
import uuid

import grpc
import openai
import pytest
import yaml
from tokenmill.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

from services.gateway.tenancy import hash_key
from tests.services.harness import running_cluster
from tests.services.test_cluster_e2e import all_blocks_free, wait_for
from tests.services.test_openai_e2e import http_metric

MAX_LEN = 1024
TENANTS = {
    "acme": {"rpm": 1000, "tpm": 1000000, "price_input_per_mtok": 1.0, "price_output_per_mtok": 2.0},
    "beta": {},
    "tight": {"rpm": 1, "rpm_burst": 10, "tpm": 1, "tpm_burst": 400},  # refills: 1 request, 1 token a minute
    "few": {"rpm": 1, "rpm_burst": 2},
    "shy": {"default_class": "batch", "max_class": "standard"},
    "pool1": {"share_prefix_cache": True},
    "pool2": {"share_prefix_cache": True},
}
LIMIT_HEADERS = [f"x-ratelimit-{k}-{w}" for k in ("limit", "remaining", "reset") for w in ("requests", "tokens")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    config = tmp / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "gateway": {"audit_log": str(tmp / "audit.jsonl")},
        "tenants": {name: {"keys_sha256": [hash_key(f"sk-{name}")], **t} for name, t in TENANTS.items()}}))
    with running_cluster(tmp, "--config", str(config), "--tokenizers", "1", "--set",
                         f"engine.max_model_len={MAX_LEN}", "--set", "router.prefill_threshold_tokens=200",
                         "--grace", "3") as info:
        info["audit"] = tmp / "audit.jsonl"
        yield info


def client(info, tenant: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=info["http"] + "/v1", api_key=f"sk-{tenant}" if tenant else "sk-nobody",
                         max_retries=0, timeout=120)


def grpc_generate(info, req, key: str | None = None, tenant_header: str | None = None):
    """(responses, trailing metadata) of one Frontend.Generate call; raises grpc.RpcError with its trailers."""
    md = ([("authorization", f"Bearer {key}")] if key else []) + (
        [("x-tenant-id", tenant_header)] if tenant_header else [])
    with grpc.insecure_channel(info["gateway"]) as ch:
        call = frontend_pb2_grpc.FrontendStub(ch).Generate(req, metadata=md, timeout=120)
        return list(call), dict(call.trailing_metadata() or ())


def audit(info) -> list[dict]:
    return [json.loads(line) for line in info["audit"].read_text().splitlines()]


def req(prompt: str, max_tokens: int = 4, **fields) -> frontend_pb2.GenerateRequest:
    return frontend_pb2.GenerateRequest(prompt=prompt, params=common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0), **fields)


def test_unknown_keys_are_refused_on_both_doors_and_x_tenant_id_is_not_trusted(cluster):
    for key in ("sk-nobody", "sk-acm"):
        c = openai.OpenAI(base_url=cluster["http"] + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            c.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
    for key, header in ((None, None), ("sk-nobody", None), (None, "acme")):
        with pytest.raises(grpc.RpcError) as e:
            grpc_generate(cluster, req("Hello"), key, header)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (key, header)
        assert "API key" in e.value.details()
    # a valid key names the tenant; a client's x-tenant-id names nothing
    out, _ = grpc_generate(cluster, req("Hello", request_id="who-am-i"), "sk-beta", tenant_header="acme")
    assert out[-1].finish_reason
    line = next(r for r in audit(cluster) if r["request_id"] == "who-am-i")
    assert line["tenant"] == "beta"
    assert http_metric(cluster, "tokenmill:tenant_rejected_requests_total", tenant="other",
                         reason="unauthenticated") >= 5


def test_token_quota_refuses_with_retry_after_refunds_and_settles(cluster):
    def rejected(reason):
        return http_metric(cluster, "tokenmill:tenant_rejected_requests_total", tenant="tight", reason=reason)

    before = rejected("tokens"), rejected("too_large")
    c = client(cluster, "tight")
    prompt = "Count: one two three four five six seven eight nine ten eleven twelve"
    raw = c.completions.with_raw_response.create(model="smollm2", prompt=prompt, max_tokens=300, stop=[" "])
    r = raw.parse()
    used = r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.completion_tokens < 300
    h = raw.headers
    assert all(k in h for k in LIMIT_HEADERS), dict(h)
    assert h["x-ratelimit-limit-tokens"] == "400" and h["x-ratelimit-limit-requests"] == "10"
    # input + max_tokens were charged, then the bill settled with the real output (at most a token refilled since)
    assert 400 - used <= int(h["x-ratelimit-remaining-tokens"]) <= 400 - used + 1
    assert h["x-ratelimit-remaining-requests"] == "9"
    left = int(h["x-ratelimit-remaining-tokens"])

    n_in = r.usage.prompt_tokens
    over = left + 10 - n_in  # max_tokens that fit the 400 of the bucket, but not the tokens left now
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="smollm2", prompt=prompt, max_tokens=over)
    msg = e.value.body["message"]
    assert "tenant tight is over its quota of 1 tokens per minute (tpm)" in msg, msg
    assert f"needs {left + 10} ({n_in} input + {over} max_tokens), {left} are left" in msg, msg
    h = e.value.response.headers
    assert int(h["Retry-After"]) > 60  # ~1 token a minute: minutes, computed from the bucket
    assert all(k in h for k in LIMIT_HEADERS)
    assert h["x-ratelimit-remaining-requests"] == "9"  # the refused request's request token came back
    assert int(h["x-ratelimit-remaining-tokens"]) == left  # and it took no tokens
    with pytest.raises(grpc.RpcError) as g:
        grpc_generate(cluster, req(prompt, over), "sk-tight")
    assert g.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "(tpm)" in g.value.details()
    trailers = dict(g.value.trailing_metadata())
    assert int(trailers["retry-after"]) > 60 and trailers["x-ratelimit-remaining-requests"] == "9"
    # nothing was placed: every worker's blocks are free
    wait_for(lambda: all_blocks_free(cluster, "decode") and all_blocks_free(cluster, "prefill"), 10,
             "blocks free after the refusals")
    # more than the bucket can ever hold: said so, not a wait forever
    with pytest.raises(openai.BadRequestError, match=r"holds at most 400; lower max_tokens"):
        c.completions.create(model="smollm2", prompt=prompt, max_tokens=450)
    raw = c.completions.with_raw_response.create(model="smollm2", prompt=prompt, max_tokens=3)
    assert raw.headers["x-ratelimit-remaining-requests"] == "8"
    assert (rejected("tokens") - before[0], rejected("too_large") - before[1]) == (2, 1)


def test_request_quota_refuses_on_both_doors(cluster):
    before = http_metric(cluster, "tokenmill:tenant_rejected_requests_total", tenant="few", reason="requests")
    c = client(cluster, "few")
    remaining = [c.completions.with_raw_response.create(model="smollm2", prompt="Hi", max_tokens=2).headers[
        "x-ratelimit-remaining-requests"] for _ in range(2)]
    assert remaining == ["1", "0"]
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert "tenant few is over its quota of 1 requests per minute (rpm, burst 2)" in e.value.body["message"]
    assert 1 <= int(e.value.response.headers["Retry-After"]) <= 60
    with pytest.raises(grpc.RpcError) as g:
        grpc_generate(cluster, req("Hi"), "sk-few")
    assert g.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "(rpm" in g.value.details()
    assert 1 <= int(dict(g.value.trailing_metadata())["retry-after"]) <= 60
    assert http_metric(cluster, "tokenmill:tenant_rejected_requests_total", tenant="few",
                         reason="requests") - before == 2


def test_priority_class_defaults_and_is_capped_at_the_tenant_maximum(cluster):
    c = client(cluster, "shy")
    chat = [{"role": "user", "content": "Hi"}]
    tiers = [c.chat.completions.create(model="smollm2", messages=chat, max_tokens=2, **kw).service_tier
             for kw in ({}, {"service_tier": "priority"}, {"service_tier": "flex"})]
    assert tiers == ["flex", "default", "flex"]  # its default batch; interactive capped at its max, standard
    assert client(cluster, "beta").chat.completions.create(model="smollm2", messages=chat, max_tokens=2,
                                                           service_tier="priority").service_tier == "priority"
    with pytest.raises(openai.BadRequestError, match="service_tier must be one of"):
        c.chat.completions.create(model="smollm2", messages=chat, max_tokens=2, service_tier="urgent")
    grpc_generate(cluster, req("Hi", request_id="shy-grpc", priority_class=common_pb2.PRIORITY_CLASS_INTERACTIVE),
                  "sk-shy")
    assert next(r for r in audit(cluster) if r["request_id"] == "shy-grpc")["priority_class"] == "standard"


def test_prefix_cache_is_private_to_a_tenant_unless_shared(cluster):
    def _cached(tenant: str, prompt: str) -> int:
        r = client(cluster, tenant).completions.create(model="smollm2", prompt=prompt, max_tokens=2)
        return r.usage.prompt_tokens_details.cached_tokens

    private = f"{uuid.uuid4().hex} " + "The history of the printing press begins in the fifteenth century. " * 20
    assert _cached("acme", private) == 0
    assert _cached("acme", private) > 0  # its own cache
    assert _cached("beta", private) == 0  # another tenant cannot hit (or time) it
    assert _cached("beta", private) > 0
    shared = f"{uuid.uuid4().hex} " + "A long walk along the river at dawn, with the mist still on the water. " * 20
    assert _cached("pool1", shared) == 0
    assert _cached("pool2", shared) > 0  # both opted in to sharing
    assert _cached("acme", shared) == 0


def test_per_tenant_metrics_cost_and_audit_log(cluster):
    def snapshot():
        return [http_metric(cluster, f"tokenmill:tenant_{m}_total", tenant="acme")
                for m in ("requests", "input_tokens", "output_tokens", "cost")]

    before = snapshot()
    c = client(cluster, "acme")
    usages = [c.completions.create(model="smollm2", prompt=p, max_tokens=5, extra_headers={"X-Request-Id": rid}
                                   ).usage for p, rid in (("Once upon a time", "audit-1"), ("The sea is", "audit-2"))]
    n_in, n_out = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    after = snapshot()
    assert after[0] - before[0] == 2 and after[1] - before[1] == n_in and after[2] - before[2] == n_out
    assert after[3] - before[3] == pytest.approx((n_in * 1.0 + n_out * 2.0) / 1e6)
    text = urllib.request.urlopen(cluster["http"] + "/metrics", timeout=5).read().decode()
    labels = set(re.findall(r'tokenmill:tenant_[a-z_]+\{[^}]*tenant="([^"]*)"', text))
    assert labels == set(TENANTS) | {"other"}  # bounded: configured names and "other", each from the start

    lines = {r["request_id"]: r for r in audit(cluster)}
    for rid, u in zip(("audit-1", "audit-2"), usages, strict=True):
        r = lines[rid]
        assert (r["tenant"], r["model"], r["priority_class"], r["migrations"]) == ("acme", "smollm2", "standard", 0)
        assert (r["prompt_tokens"], r["completion_tokens"]) == (u.prompt_tokens, u.completion_tokens)
        assert r["status"] in ("stop", "length") and r["latency_s"] > 0
        assert "prompt" not in r and "output" not in r  # no text without gateway.log_prompts
        assert dt.datetime.fromisoformat(r["time"]).tzinfo is not None
    with pytest.raises(openai.BadRequestError):  # more than tight's token bucket holds
        client(cluster, "tight").completions.create(model="smollm2", prompt="Hi", max_tokens=450,
                                                    extra_headers={"X-Request-Id": "audit-refused"})
    r = {r["request_id"]: r for r in audit(cluster)}["audit-refused"]
    assert (r["tenant"], r["status"], r["reason"], r["completion_tokens"]) == ("tight", "INVALID_ARGUMENT",
                                                                             "too_large", 0)
