"""The OpenAI HTTP API of a whole cluster (``tokenmill up``: real processes, the real model, KV over NIXL), driven
by the official ``openai`` client, sync and async: outputs equal ``tokenmill generate``, streaming with n, stop
strings and logprobs, 200 concurrent streams counted in ``/metrics``, the context limit, and KV freed when a
client disconnects."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.request

import aiohttp
import openai
import pytest

from tests.services.harness import running_cluster
from tests.services.test_cluster_e2e import all_blocks_free, wait_for

MAX_LEN = 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("openai"), "--tokenizers", "1",
                         "--set", f"engine.max_model_len={MAX_LEN}", "--set", "router.prefill_threshold_tokens=200",
                         "--grace", "3") as info:
        yield info


def sync_client(info) -> openai.OpenAI:
    return openai.OpenAI(base_url=info["http"] + "/v1", api_key="none", max_retries=0, timeout=120)


def async_client(info) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=info["http"] + "/v1", api_key="none", max_retries=0, timeout=300)


def http_metric(info, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(info["http"] + "/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors."]
PROMPTS = ["The history of the printing press", "def fibonacci(n):"]


def test_greedy_outputs_equal_tokenmill_generate(cluster, tmp_path):
    c = sync_client(cluster)
    got = []
    for q in CHATS:
        r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}], temperature=0,
                                      max_tokens=24)
        got.append((r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens))
    for p in PROMPTS:
        r = c.completions.create(model="smollm2", prompt=p, temperature=0, max_tokens=24)
        got.append((r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens))
    lines = [{"messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 24} for q in CHATS]
    lines += [{"prompt": p, "temperature": 0, "max_tokens": 24} for p in PROMPTS]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--prompts", str(inp),
                          "--max-model-len", str(MAX_LEN), "--dtype", "float32"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    ref = [json.loads(x) for x in out.stdout.splitlines()]
    assert [(r["text"], r["finish_reason"], len(r["token_ids"])) for r in ref] == got
    assert "Paris" in got[0][0]


def test_logit_bias_steers_sampled_tokens(cluster):
    c = sync_client(cluster)
    r = c.completions.create(model="smollm2", prompt="Hello", max_tokens=6, temperature=1.0, seed=3,
                             logit_bias={"28": 100}, logprobs=0)
    toks = r.choices[0].logprobs.tokens
    assert len(toks) == 6 and len(set(toks)) == 1, toks  # +100 on one id: every pick is that token
    plain = c.completions.create(model="smollm2", prompt="Hello", max_tokens=6, temperature=1.0, seed=3,
                                 logprobs=0)
    assert plain.choices[0].logprobs.tokens != toks
    with pytest.raises(openai.BadRequestError, match=r"logit_bias has token id 99999999, outside the vocabulary"):
        c.completions.create(model="smollm2", prompt="Hello", max_tokens=2, logit_bias={"99999999": 1})


def test_async_streams_with_n_stop_strings_and_logprobs(cluster):
    async def body():
        c = async_client(cluster)
        # n=2 sampled completions, streamed: both choices arrive, differ, and end with a finish reason
        texts, finish = {0: "", 1: ""}, {}
        async for ch in await c.completions.create(model="smollm2", prompt="Once upon a time", n=2, max_tokens=16,
                                                   temperature=1.0, seed=11, stream=True, logprobs=2,
                                                   stream_options={"include_usage": True}):
            for choice in ch.choices:
                texts[choice.index] += choice.text
                if choice.logprobs is not None:
                    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
            last = ch
        assert finish == {0: "length", 1: "length"} and texts[0] != texts[1]
        assert last.usage.completion_tokens == 32
        # a stop string ends the output before it (and is not included)
        r = await c.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=64,
            messages=[{"role": "user", "content": "Count from 1 to 20, separated by commas."}], stop=[" 5"])
        assert r.choices[0].finish_reason == "stop" and " 5" not in r.choices[0].message.content
        assert "4" in r.choices[0].message.content
        # greedy logprobs: the chosen token is the top alternative, with the same logprob
        r = await c.chat.completions.create(model="smollm2", temperature=0, max_tokens=6, logprobs=True,
                                            top_logprobs=3, messages=[{"role": "user", "content": CHATS[0]}])
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens == 6
        for t in content:
            assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
            assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4) and t.logprob <= 0
        assert "".join(t.token for t in content) == r.choices[0].message.content
        await c.close()

    asyncio.run(body())


def test_200_concurrent_streams_all_complete_and_are_counted(cluster):
    before = http_metric(cluster, "tokenmill:http_requests_total", endpoint="/v1/chat/completions", status="200")
    ok_before = http_metric(cluster, "tokenmill:request_success_total")

    async def one(c, i):
        text, reason = "", None
        async for ch in await c.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": f"Say hello to user {i}."}], max_tokens=8,
                temperature=0, stream=True):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                reason = ch.choices[0].finish_reason or reason
        return text, reason

    async def body():
        c = async_client(cluster)
        outs = await asyncio.gather(*(one(c, i) for i in range(200)))
        await c.close()
        return outs

    outs = asyncio.run(body())
    assert len(outs) == 200 and all(reason in ("stop", "length") and text for text, reason in outs)
    after = http_metric(cluster, "tokenmill:http_requests_total", endpoint="/v1/chat/completions", status="200")
    assert after - before == 200
    assert http_metric(cluster, "tokenmill:request_success_total") - ok_before == 200
    wait_for(lambda: all_blocks_free(cluster, "decode"), 10, "decode blocks free after 200 streams")


def test_context_limit_and_disconnect_free_the_kv(cluster):
    c = sync_client(cluster)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="smollm2", prompt=[504] * (MAX_LEN - 3), max_tokens=4)
    msg = e.value.body["message"]
    assert "1021" in msg and "1024" in msg, msg

    async def disconnect():
        async with aiohttp.ClientSession() as s:
            r = await s.post(cluster["http"] + "/v1/completions", json={
                "model": "smollm2", "prompt": "The history of the printing press begins " * 30,
                "max_tokens": 500, "ignore_eos": True, "stream": True})
            assert r.status == 200
            for _ in range(3):  # as OpenAI's stream: data lines only (id: lines come with resume on)
                assert (await r.content.readline()).startswith(b"data: ")
                await r.content.readline()
            r.close()

    asyncio.run(disconnect())
    wait_for(lambda: all_blocks_free(cluster, "decode") and all_blocks_free(cluster, "prefill"), 10,
             "blocks freed after the HTTP client went away")
    with urllib.request.urlopen(cluster["http"] + "/health", timeout=5) as r:
        assert r.status == 200
