"""The OpenAI streaming protocol as vLLM's server (and ours) writes it: SSE events cut anywhere in the byte
stream, comments, CRLF, a role chunk, a usage chunk, ``[DONE]``, and an error event after the 200."""

from __future__ import annotations

import json

import pytest

from loadgen.clients import OpenAITarget, SendOptions, SseDecoder
from loadgen.metrics import RequestRecord
from loadgen.workloads import RequestSpec, Tenant


def _chunk(delta: dict | None = None, text: str | None = None, usage: dict | None = None) -> dict:
    if usage is not None:
        return {"id": "x", "object": "chat.completion.chunk", "choices": [], "usage": usage}
    choice = {"index": 0, "delta": delta} if delta is not None else {"index": 0, "text": text}
    return {"id": "x", "object": "chat.completion.chunk", "choices": [choice]}


CHAT = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hel"}), _chunk({"content": "lo, wörld"}),
        _chunk({"content": "!"}), _chunk(usage={"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                                 "prompt_tokens_details": {"cached_tokens": 4}})]


def _wire(events: list[dict], nl: str = "\n") -> bytes:
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}{nl}{nl}" for e in events)
    return (f": ping{nl}{nl}" + body + f"data: [DONE]{nl}{nl}").encode()


@pytest.mark.parametrize("nl", ["\n", "\r\n"])
def test_events_survive_every_cut_of_the_stream(nl):
    wire = _wire(CHAT, nl)
    want = [json.dumps(e, ensure_ascii=False) for e in CHAT] + ["[DONE]"]
    for cut in range(1, len(wire)):  # also cuts inside the multi-byte 'ö' and between CR and LF
        d = SseDecoder()
        got = d.feed(wire[:cut]) + d.feed(wire[cut:])
        assert got == want, cut
    d = SseDecoder()
    assert [e for i in range(len(wire)) for e in d.feed(wire[i:i + 1])] == want
    d = SseDecoder()
    assert d.feed(b"event: x\ndata: {\"a\":\ndata: 1}\nid: 3\n\n") == ['{"a":\n1}']  # multi-line data joined


def _replay(target: OpenAITarget, events: list[str]) -> RequestRecord:
    rec = RequestRecord(0, 7, 3)
    for i, ev in enumerate(events):
        if target.on_data(ev, rec, 0.1 * (i + 1)):
            break
    return rec


def test_chat_and_completion_chunks_make_the_record():
    chat = OpenAITarget("http://h:1/v1", "chat", "m", SendOptions())
    d = SseDecoder()
    rec = _replay(chat, d.feed(_wire(CHAT)))
    # the role chunk (empty content) is not a token: TTFT is the first text
    assert rec.chunk_times == pytest.approx([0.2, 0.3, 0.4]) and rec.ttft == pytest.approx(0.2)
    assert (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens, rec.output_tokens) == (7, 3, 4, 3)
    comp = OpenAITarget("http://h:1", "completions", "m", SendOptions())
    events = [_chunk(text="a"), _chunk(text=""), _chunk(text="b")]
    rec = _replay(comp, [json.dumps(e) for e in events] + ["[DONE]"])
    assert rec.chunk_times == pytest.approx([0.1, 0.3]) and rec.completion_tokens is None and rec.output_tokens == 2
    rec = _replay(comp, [json.dumps(_chunk(text="a")), json.dumps({"error": {"message": "worker died"}})])
    assert (rec.outcome, rec.error_kind, rec.error) == ("error", "stream error", "worker died")


def test_payloads_follow_the_openai_api():
    spec = RequestSpec(0, (1, 2), "hi there", 2, 16, Tenant("t", 1.0, 10, "sk-t"))
    chat = OpenAITarget("http://h:1/v1/", "chat", "m", SendOptions(ignore_eos=True, temperature=0, api_key="sk-d"))
    assert chat.url == "http://h:1/v1/chat/completions"
    assert chat.payload(spec) == {"model": "m", "stream": True, "stream_options": {"include_usage": True},
                                  "messages": [{"role": "user", "content": "hi there"}],
                                  "max_completion_tokens": 16, "ignore_eos": True, "temperature": 0,
                                  "priority": 10}
    assert chat.headers(spec)["Authorization"] == "Bearer sk-t" and chat.headers(spec)["x-tenant-id"] == "t"
    assert chat.headers()["Authorization"] == "Bearer sk-d"
    comp = OpenAITarget("http://h:1", "completions", "m", SendOptions(cache_salt="run-1"))
    assert comp.url == "http://h:1/v1/completions"
    p = comp.payload(RequestSpec(0, (1,), "x", 1, 5))
    assert (p["prompt"], p["max_tokens"], p["cache_salt"]) == ("x", 5, "run-1")
    assert "ignore_eos" not in p and "priority" not in p
