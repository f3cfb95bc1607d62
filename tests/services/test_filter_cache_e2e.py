"""The output filter and the response cache in a whole cluster (``tokenmill up``: real processes, the real model),
driven by the official ``openai`` client and the gRPC ``Frontend``.

The cluster's filter blocks the word "Paris" for every tenant but ``open`` (whose override is empty); its gateway
caches responses (1 MiB, a TTL of ``TTL_S``). A request's worker-side footprint is read from the decode workers'
``/metrics`` (finished requests), so "answered from the cache" means no decode worker saw it."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import grpc
import openai
import pytest
from tokenmill.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

from tests.services.harness import running_cluster
from tests.services.test_cluster_e2e import all_blocks_free, procs, wait_for
from tests.services.test_openai_e2e import http_metric

TTL_S = 6.0
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
BLOCKED = "the output matched a blocked word"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("filtercache"), "--tokenizers", "1",
                         "--set", "engine.max_model_len=1024",
                         "--set", "output_filter.default.words=Paris",
                         "--set", "output_filter.tenants.open.words=",
                         "--set", "gateway.response_cache_bytes=1MiB",
                         "--set", f"gateway.response_cache_ttl_s={TTL_S}",
                         "--grace", "3") as info:
        yield info


def client(info, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=info["http"] + "/v1", api_key="none", max_retries=0, timeout=120,
                         default_headers={"x-tenant-id": tenant})


def decode_metric(info, name: str, **labels: str) -> float:
    """``name`` summed over the decode workers' samples that carry ``labels`` (0 when none has one yet)."""
    total = 0.0
    for p in procs(info, "decode"):
        text = urllib.request.urlopen(f"http://127.0.0.1:{p['metrics_port']}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
            if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
                total += float(m.group(2))
    return total


def decoded(info) -> float:
    """Requests the decode workers have finished (any reason)."""
    return decode_metric(info, "tokenmill:request_success_total")


# -- the output filter -----------------------------------------------------------------------------------------
def test_blocked_stream_ends_with_content_filter_and_its_blocks_are_freed(cluster):
    c = client(cluster, "filtered")
    tokens0 = decode_metric(cluster, "tokenmill:generation_tokens_total")
    filtered0 = decode_metric(cluster, "tokenmill:request_success_total", finished_reason="content_filter")
    # ignore_eos and 600 tokens: only the filter's abort ends this stream soon
    stream = c.chat.completions.create(model="smollm2", messages=CAPITAL, temperature=0, max_tokens=600,
                                       stream=True, stream_options={"include_usage": True}, logprobs=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    sent_tokens = "".join(t.token for ch in chunks if ch.choices and ch.choices[0].logprobs
                          for t in ch.choices[0].logprobs.content)
    # token ids (and their logprobs) leave with the last character of their text, never ahead of it
    assert text.startswith(sent_tokens) and "Par" not in sent_tokens
    ends = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(ends) == 1 and ends[0].finish_reason == "content_filter"
    assert ends[0].filter_reason == BLOCKED  # the chunk that ends the stream says why
    assert "Par" not in text
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens < 600
    wait_for(lambda: all_blocks_free(cluster, "decode"), 10, "the blocked sequence's blocks freed")
    assert decode_metric(cluster, "tokenmill:generation_tokens_total") - tokens0 < 600  # aborted, not run out
    assert decode_metric(cluster, "tokenmill:request_success_total",
                         finished_reason="content_filter") == filtered0 + 1


def test_blocked_unary_response_and_grpc_carry_the_reason(cluster):
    r = client(cluster, "filtered").chat.completions.create(model="smollm2", messages=CAPITAL, temperature=0,
                                                           max_tokens=24)
    assert r.choices[0].finish_reason == "content_filter" and "Paris" not in r.choices[0].message.content
    assert r.choices[0].filter_reason == BLOCKED

    async def grpc_call():
        async with grpc.aio.insecure_channel(cluster["gateway"]) as ch:
            req = frontend_pb2.GenerateRequest(
                chat=tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user",
                                                                                   content=CAPITAL[0]["content"])]),
                params=common_pb2.SamplingParams(temperature=0, max_tokens=24))
            return [m async for m in frontend_pb2_grpc.FrontendStub(ch).Generate(req)]

    msgs = asyncio.run(grpc_call())
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_CONTENT_FILTER
    assert msgs[-1].filter_reason == BLOCKED
    assert "Paris" not in "".join(m.text for m in msgs)


def test_a_tenant_override_turns_the_filter_off(cluster):
    r = client(cluster, "open").chat.completions.create(model="smollm2", messages=CAPITAL, temperature=0,
                                                       max_tokens=24)
    assert r.choices[0].finish_reason in ("stop", "length") and "Paris" in r.choices[0].message.content


# -- the response cache ----------------------------------------------------------------------------------------
def ask(c: openai.OpenAI, content: str, max_tokens: int = 12, **kw):
    return c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}],
                                     max_tokens=max_tokens, **kw)


def test_a_repeated_greedy_request_is_answered_from_the_cache_without_a_worker(cluster):
    c = client(cluster, "cache-a")
    first = ask(c, "Name three primary colors.", temperature=0)
    n, hits = decoded(cluster), http_metric(cluster, "tokenmill:response_cache_hits_total")
    again = ask(c, "Name three primary colors.", temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.choices[0].finish_reason == first.choices[0].finish_reason
    assert again.usage == first.usage and again.id != first.id
    assert decoded(cluster) == n  # no decode worker saw it
    assert http_metric(cluster, "tokenmill:response_cache_hits_total") == hits + 1
    assert http_metric(cluster, "tokenmill:response_cache_bytes") > 0
    # the bypass: the body field, and Cache-Control: no-cache
    ask(c, "Name three primary colors.", temperature=0, extra_body={"skip_response_cache": True})
    assert decoded(cluster) == n + 1
    ask(c, "Name three primary colors.", temperature=0, extra_headers={"Cache-Control": "no-cache"})
    assert decoded(cluster) == n + 2
    # another tenant never sees this tenant's entry
    other = ask(client(cluster, "cache-b"), "Name three primary colors.", temperature=0)
    assert decoded(cluster) == n + 3 and other.choices[0].message.content == first.choices[0].message.content
    # another parameter is another entry
    ask(c, "Name three primary colors.", temperature=0, max_tokens=11)
    assert decoded(cluster) == n + 4


def test_a_streamed_request_gets_the_cached_answer_as_the_same_stream(cluster):
    c = client(cluster, "cache-stream")

    def stream(**kw):
        chunks = list(c.chat.completions.create(model="smollm2", stream=True, stream_options={"include_usage": True},
                                                messages=[{"role": "user", "content": "Write a haiku about the sea."}],
                                                max_tokens=16, temperature=0, **kw))
        return [(ch.choices[0].delta.content, ch.choices[0].finish_reason) for ch in chunks if ch.choices], chunks[-1].usage

    live, live_usage = stream()
    n = decoded(cluster)
    cached, cached_usage = stream()
    assert decoded(cluster) == n
    assert cached == live and cached_usage == live_usage and len(cached) > 2
    unary = ask(c, "Write a haiku about the sea.", temperature=0, max_tokens=16)  # the same entry, not streamed
    assert decoded(cluster) == n and unary.choices[0].message.content == "".join(t or "" for t, _ in live)


def test_sampled_requests_are_cached_only_with_a_seed(cluster):
    c = client(cluster, "cache-sampled")
    n, misses = decoded(cluster), http_metric(cluster, "tokenmill:response_cache_misses_total")
    ask(c, "Tell me a joke.", temperature=0.9)
    ask(c, "Tell me a joke.", temperature=0.9)
    assert decoded(cluster) == n + 2
    assert http_metric(cluster, "tokenmill:response_cache_misses_total") == misses  # never even looked up
    a = ask(c, "Tell me a joke.", temperature=0.9, seed=7)
    b = ask(c, "Tell me a joke.", temperature=0.9, seed=7)
    assert decoded(cluster) == n + 3 and a.choices[0].message.content == b.choices[0].message.content


def test_filtered_answers_are_never_cached(cluster):
    c = client(cluster, "cache-filtered")
    n = decoded(cluster)
    for _ in range(2):
        r = c.chat.completions.create(model="smollm2", messages=CAPITAL, temperature=0, max_tokens=24)
        assert r.choices[0].finish_reason == "content_filter"
    assert decoded(cluster) == n + 2


def test_an_entry_expires_after_the_ttl(cluster):
    c = client(cluster, "cache-ttl")
    ask(c, "Count to five.", temperature=0)
    n = decoded(cluster)
    ask(c, "Count to five.", temperature=0)
    assert decoded(cluster) == n
    time.sleep(TTL_S + 0.5)
    ask(c, "Count to five.", temperature=0)
    assert decoded(cluster) == n + 1
