"""The OpenAI HTTP API of the real gateway (with the real tokenizer and router over gRPC, fake decode workers),
driven by the official ``openai`` client: the wire format, every error status as the client's exception type,
limits, readiness, and cancellation on disconnect. The same API against the whole cluster and the real model is
in ``test_openai_e2e.py``."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import jsonschema
import openai
import pytest

from common.cluster_config import load_cluster_config
from common.loader import load_tokenizer
from services.gateway.http import served_model_names
from services.gateway.tenancy import Tenancy
from tests.services.harness import HOST
from tests.services.test_gateway import FakeDecode, stack


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


def base_url(st) -> str:
    return f"http://{HOST}:{st.gw.http.port}/v1"


def client(st, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(st), api_key=key, max_retries=0, timeout=30)


CHAT = [{"role": "user", "content": "Hi there"}]


def test_chat_stream_carries_role_deltas_finish_and_usage_last(tok):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode(tokens=4)}) as st:
            c = client(st)
            chunks = [ch async for ch in await c.chat.completions.create(
                model="smollm2", messages=CHAT, stream=True, stream_options={"include_usage": True})]
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert text == "<0><1><2><3>"
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
            assert all(ch.usage is None for ch in chunks[:-1])
            assert len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
            # the same request, not streamed
            r = await c.chat.completions.create(model="HuggingFaceTB/SmolLM2-135M-Instruct", messages=CHAT)
            assert r.choices[0].message.content == "<0><1><2><3>" and r.choices[0].finish_reason == "stop"
            assert r.model == "HuggingFaceTB/SmolLM2-135M-Instruct" and r.object == "chat.completion"
            assert r.usage.completion_tokens == 4 and r.usage.total_tokens == r.usage.prompt_tokens + 4
            sent = st.decodes["decode-a"].requests[-1]
            assert list(sent.prompt_token_ids) == tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
            await c.close()

    asyncio.run(body())


def test_completions_prompt_forms_n_and_sampling_fields_reach_the_worker(tok):
    async def body():
        d = FakeDecode(tokens=3)
        async with stack(tok, {"decode-a": d}) as st:
            c = client(st)
            r = await c.completions.create(model="smollm2", prompt=["One", "Two"], n=2, max_tokens=3, seed=7,
                                           temperature=0.5, top_p=0.9, stop=["\n"], presence_penalty=0.5,
                                           extra_body={"top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1,
                                                       "ignore_eos": True, "min_tokens": 2})
            assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
            assert all(ch.text == "<0><1><2>" for ch in r.choices)
            assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 2  # each prompt counted once
            p = d.requests[-1].params
            assert (p.max_tokens, p.top_k, p.ignore_eos, p.min_tokens, list(p.stop)) == (3, 20, True, 2, ["\n"])
            assert p.temperature == pytest.approx(0.5) and p.repetition_penalty == pytest.approx(1.1)
            assert sorted(q.params.seed for q in d.requests[-4:]) == [7, 7, 8, 8]  # n samples differ, reproducibly
            # token ids in, and completions' default of 16 tokens
            await c.completions.create(model="smollm2", prompt=[5, 6, 7])
            assert list(d.requests[-1].prompt_token_ids) == [5, 6, 7] and d.requests[-1].params.max_tokens == 16
            await c.close()

    asyncio.run(body())


@pytest.mark.parametrize("kwargs, status, message", [
    ({"temperature": -1}, 400, "temperature must be in [0, 100], got -1"),
    ({"top_p": 0}, 400, "top_p must be in (0, 1]"),
    ({"max_tokens": 0}, 400, "max_tokens must be >= 1, got 0"),
    ({"n": 0}, 400, "n must be in [1, 128]"),
    ({"messages": []}, 400, "messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role must be one of"),
    ({"stop": 5}, 400, "stop must be a string or a list of strings"),
    ({"top_logprobs": 3}, 400, "top_logprobs needs logprobs: true"),
    ({"logit_bias": {"5": 101}}, 400, "logit_bias['5'] must be a number in [-100, 100], got 101"),
    ({"logit_bias": {"dog": 1}}, 400, "logit_bias key 'dog' is not a token id"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs must be in [0, 20]"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, 400, "tools[0].function.name is missing"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options is only allowed with stream: true"),
    ({"model": "gpt-4"}, 404, "the model 'gpt-4' does not exist"),
])
def test_invalid_values_are_openai_errors_with_the_param(tok, kwargs, status, message):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode()}) as st:
            c = client(st)
            args = {"model": "smollm2", "messages": CHAT, **kwargs}
            exc = openai.NotFoundError if status == 404 else openai.BadRequestError
            with pytest.raises(exc) as e:
                await c.chat.completions.create(**args)
            err = e.value.body
            assert e.value.status_code == status and message in err["message"], err
            assert err["param"] == list(kwargs)[-1], err  # the field to fix
            assert st.decodes["decode-a"].requests == []  # refused before any worker saw it
            await c.close()

    asyncio.run(body())


def test_protocol_errors_malformed_json_oversized_body_unknown_path(tok):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode()}, **{"gateway.max_body_bytes": 4096}) as st:
            async with aiohttp.ClientSession() as s:
                url = base_url(st)
                for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
                    async with s.post(f"{url}/chat/completions", data=raw,
                                      headers={"Content-Type": "application/json"}) as r:
                        body = await r.json()
                        assert r.status == 400 and body["error"]["type"] == "invalid_request_error", body
                async with s.post(f"{url}/completions", json={"model": "smollm2", "prompt": "x" * 10000}) as r:
                    body = await r.json()
                    assert r.status == 413 and "4096 bytes" in body["error"]["message"], body
                async with s.get(f"{url}/nowhere") as r:
                    assert r.status == 404 and "error" in await r.json()
            c = client(st)
            with pytest.raises(openai.APIStatusError) as e:
                await c.completions.create(model="smollm2", prompt="y" * 10000)
            assert e.value.status_code == 413
            await c.close()
            text = await _get(f"http://{HOST}:{st.gw.http.port}/metrics")
            assert 'tokenmill:http_requests_total{endpoint="/v1/chat/completions",status="400"} 3.0' in text
            assert 'tokenmill:http_requests_total{endpoint="/v1/completions",status="413"} 2.0' in text

    asyncio.run(body())


def test_bodies_too_deep_or_with_huge_numbers_are_400s(tok):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode()}) as st, aiohttp.ClientSession() as s:
            for raw, message in ((b"[" * 5000 + b"]" * 5000, "nested too deeply"),
                                 (b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}",
                                  "temperature must be a finite number, got an integer of 401 digits"),
                                 (b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", "not valid JSON")):
                async with s.post(f"{base_url(st)}/completions", data=raw,
                                  headers={"Content-Type": "application/json"}) as r:
                    err = await r.json()
                    assert r.status == 400 and message in err["error"]["message"], err
            assert st.decodes["decode-a"].requests == []

    asyncio.run(body())


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


def test_api_keys_401_and_tenants(tok):
    async def body():
        keys = {"gateway.api_keys": ["team-a:sk-a", "sk-b"]}
        async with stack(tok, {"decode-a": FakeDecode(tokens=2)}, **keys) as st:
            for key in ("none", "sk-wrong"):
                with pytest.raises(openai.AuthenticationError) as e:
                    await client(st, key).chat.completions.create(model="smollm2", messages=CHAT)
                assert "API key" in e.value.body["message"]
            async with aiohttp.ClientSession() as s, s.get(f"{base_url(st)}/models") as r:
                assert r.status == 401 and "Authorization: Bearer" in (await r.json())["error"]["message"]
            models = await client(st, "sk-a").models.list()
            assert [m.id for m in models.data] == ["smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"]
            r = await client(st, "sk-a").chat.completions.create(model="smollm2", messages=CHAT)
            assert r.choices[0].message.content == "<0><1>"
            assert st.decodes["decode-a"].requests[-1].meta.tenant_id == "team-a"
            await client(st, "sk-b").chat.completions.create(model="smollm2", messages=CHAT)
            assert st.decodes["decode-a"].requests[-1].meta.tenant_id == "key-1"  # never the key itself

    asyncio.run(body())


def test_queue_full_and_tenant_quota_are_429_with_retry_after(tok):
    async def body():
        for limit in ({"gateway.max_inflight_requests": 1}, {"gateway.tenant_max_inflight": 1}):
            async with stack(tok, {"decode-a": FakeDecode("slow")}, **limit) as st:
                c = client(st)
                first = await c.chat.completions.create(model="smollm2", messages=CHAT, stream=True)
                await first.__anext__()  # holding a slot
                with pytest.raises(openai.RateLimitError) as e:
                    await c.chat.completions.create(model="smollm2", messages=CHAT)
                assert e.value.response.headers["Retry-After"] == "1", limit
                assert "retry" in e.value.body["message"]
                await first.close()
                await c.close()

    asyncio.run(body())


def test_worker_errors_keep_their_status(tok):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode("invalid")}) as st:
            c = client(st)
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as e:
                    r = await c.chat.completions.create(model="smollm2", messages=CHAT, stream=stream)
                    async for _ in r:
                        pass
                assert "9000 tokens" in e.value.body["message"] and "8192" in e.value.body["message"]
            await c.close()

    asyncio.run(body())


def test_not_ready_is_503_and_health_says_why(tok):
    async def body():
        async with stack(tok, {}, **{"gateway.ready_wait_s": 0.3}) as st:  # no decode worker registers
            c = client(st)
            with pytest.raises(openai.InternalServerError) as e:
                await c.chat.completions.create(model="smollm2", messages=CHAT)
            assert e.value.status_code == 503 and "no decode worker" in e.value.body["message"]
            assert e.value.response.headers["Retry-After"] == "1"
            async with aiohttp.ClientSession() as s, s.get(f"http://{HOST}:{st.gw.http.port}/health") as r:
                assert r.status == 503 and "no decode worker" in (await r.json())["detail"]
            await c.close()
        async with stack(tok, {"decode-a": FakeDecode()}) as st:
            async with aiohttp.ClientSession() as s, s.get(f"http://{HOST}:{st.gw.http.port}/health") as r:
                assert r.status == 200
            await st.gw.begin_drain()
            async with aiohttp.ClientSession() as s, s.get(f"http://{HOST}:{st.gw.http.port}/health") as r:
                assert r.status == 503 and "draining" in (await r.json())["detail"]

    asyncio.run(body())


def test_client_disconnect_mid_stream_cancels_the_decode_call(tok):
    async def body():
        d = FakeDecode("slow")
        async with stack(tok, {"decode-a": d}) as st:
            async with aiohttp.ClientSession() as s:
                r = await s.post(f"{base_url(st)}/completions", json={
                    "model": "smollm2", "prompt": "Tell me", "max_tokens": 1000, "stream": True})
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                line = await r.content.readline()
                assert json.loads(line.removeprefix(b"data: "))["choices"][0]["text"] == "<0>"
                r.close()  # the client goes away mid-stream
            await asyncio.wait_for(d.cancelled.wait(), 5)
            for _ in range(50):  # the gateway's in-flight count goes back to zero
                if st.gw.inflight == 0:
                    break
                await asyncio.sleep(0.05)
            assert st.gw.inflight == 0

    asyncio.run(body())


def test_config_helpers():
    tenancy = Tenancy.from_config(load_cluster_config(overrides={"gateway.api_keys": "a:k1,k2,x:y:k3"}, env={}))
    assert [tenancy.identify(f"Bearer {k}").name for k in ("k1", "k2", "k3")] == ["a", "key-1", "x:y"]
    assert served_model_names("smollm2", ()) == ["smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert served_model_names("/m/llama.gguf", ("llama",)) == ["llama"]


def test_tokenize_and_detokenize_like_vllm(tok):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode()}) as st:
            root = f"http://{HOST}:{st.gw.http.port}"
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{root}/tokenize", json={"model": "smollm2", "prompt": "Hello world"}) as r:
                    got = await r.json()
                assert r.status == 200 and got["tokens"] == tok.encode("Hello world") and got["count"] == 2
                async with s.post(f"{root}/tokenize", json={"messages": CHAT}) as r:
                    got = await r.json()
                assert got["tokens"] == tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
                async with s.post(f"{root}/detokenize", json={"tokens": got["tokens"]}) as r:
                    assert (await r.json())["prompt"] == tok.apply_chat_template(CHAT)
                async with s.post(f"{root}/detokenize", json={"tokens": [-1]}) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "tokens"

    asyncio.run(body())


def test_profiling_is_a_400_that_says_how_when_profile_dir_is_not_set(tok):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode()}) as st, aiohttp.ClientSession() as s:
            for path in ("start_profile", "stop_profile"):
                async with s.post(f"http://{HOST}:{st.gw.http.port}/{path}") as r:
                    err = (await r.json())["error"]
                    assert r.status == 400 and "--set profile_dir=DIR" in err["message"], err

    asyncio.run(body())


def test_openapi_document_lists_the_routes_and_their_bodies(tok):
    async def body():
        async with stack(tok, {"decode-a": FakeDecode(tokens=2)}) as st, aiohttp.ClientSession() as s:
            root = f"http://{HOST}:{st.gw.http.port}"
            async with s.get(f"{root}/openapi.json") as r:
                assert r.status == 200
                doc = await r.json()
            assert doc["openapi"].startswith("3.1")
            posts = {r.resource.canonical for r in st.gw.http.app().router.routes() if r.method == "POST"}
            assert posts == {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize",
                             "/start_profile", "/stop_profile"}
            for path in ("/start_profile", "/stop_profile"):  # no body
                assert "requestBody" not in doc["paths"][path]["post"] and doc["paths"][path]["post"]["summary"]
                posts.discard(path)
            schemas = {}
            for path in posts:
                ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                schemas[path] = {"$ref": ref, "components": doc["components"]}
            assert "/v1/models" in doc["paths"] and "/health" in doc["paths"]
            fields = {"/v1/chat/completions": {"messages", "model", "max_tokens", "temperature", "stream"},
                      "/v1/completions": {"prompt", "model", "max_tokens"}, "/tokenize": {"prompt", "messages"},
                      "/detokenize": {"tokens"}}
            for path, names in fields.items():
                name = schemas[path]["$ref"].rsplit("/", 1)[1]
                assert names <= set(doc["components"]["schemas"][name]["properties"]), path
            # a body valid per the document is accepted; one it rules out is refused
            bodies = {"/v1/chat/completions": {"model": "smollm2", "messages": CHAT, "max_tokens": 2, "n": 1},
                      "/v1/completions": {"model": "smollm2", "prompt": [[1, 2, 3]], "max_tokens": 2},
                      "/tokenize": {"messages": CHAT}, "/detokenize": {"tokens": [1, 2]}}
            # null where a client library sends it for "not set" (the server takes it as absent)
            bodies["/v1/chat/completions"].update(logit_bias=None, response_format=None, tools=None, tool_choice=None,
                                                  functions=None, guided_json=None)
            bodies["/v1/completions"].update(logit_bias=None, response_format=None)
            for path, good in bodies.items():
                jsonschema.validate(good, schemas[path])
                async with s.post(f"{root}{path}", json=good) as r:
                    assert r.status == 200, (path, await r.text())
            bad = {"model": "smollm2", "messages": CHAT, "n": 0}
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, schemas["/v1/chat/completions"])
            async with s.post(f"{root}/v1/chat/completions", json=bad) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "n"

    asyncio.run(body())
