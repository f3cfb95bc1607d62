"""Tool calling over the OpenAI HTTP API of a whole cluster (``tokenmill up``, the real SmolLM2), driven by the
official ``openai`` client: a round trip (tools → tool_calls → the tool's result → an answer), streamed tool-call
deltas that add up to the non-streamed call, ``tool_choice`` none, ``required`` and a named function (enforced by
structured output, so the arguments always validate), and invalid tool requests as 400s that name the problem.

SmolLM2-135M was not trained to call tools: with ``auto`` it answers in prose. The ``auto`` tests give it a
conversation whose earlier turns called the tool (rendered Hermes-style, as the model would have to), and it then
calls the tool itself the same way.
"""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import openai
import pydantic
import pytest

from tests.services.harness import running_cluster

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("tools"), "--tokenizers", "1",
                         "--set", "engine.max_model_len=1024", "--grace", "3") as info:
        yield info


def client(info) -> openai.OpenAI:
    return openai.OpenAI(base_url=info["http"] + "/v1", api_key="none", max_retries=0, timeout=120)


def calls_before(city: str) -> list[dict]:
    """A conversation in which the assistant called get_weather for two cities, then the question for ``city``."""
    msgs: list[dict] = []
    for i, c in enumerate(("Paris", "Rome")):
        msgs += [{"role": "user", "content": f"What is the weather in {c}?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"call_{i}", "type": "function",
                      "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}]}]
    return [*msgs[:-1], {"role": "user", "content": f"What is the weather in {city}?"}]


def test_round_trip_auto_call_then_the_tools_result_then_an_answer(cluster):
    c = client(cluster)
    msgs = calls_before("Tokyo")
    r = c.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER, TIME], temperature=0,
                                  max_tokens=60)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    [call] = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Tokyo"}
    # the tool's result goes back; the model answers from it
    msgs += [ch.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "18 C, light rain"}]
    r2 = c.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER, TIME], temperature=0,
                                   max_tokens=40)
    ans = r2.choices[0]
    assert ans.finish_reason == "stop" and not ans.message.tool_calls
    assert "18 C" in ans.message.content  # it read the result
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_tool_call_deltas_add_up_to_the_unary_call(cluster):
    c = client(cluster)
    kw = dict(model="smollm2", messages=calls_before("Berlin"), tools=[WEATHER], temperature=0, max_tokens=60)
    unary = c.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = list(c.chat.completions.create(stream=True, **kw))
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert "".join(d.function.arguments for d in rest) == unary[0].function.arguments
    assert json.loads(unary[0].function.arguments) == {"city": "Berlin"}
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""  # the call's text is not content
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "tool_calls"
    assert chunks[0].choices[0].delta.role == "assistant"


def test_tool_choice_none_keeps_tools_out_of_the_prompt_and_the_reply(cluster):
    c = client(cluster)
    msgs = calls_before("Madrid")
    base = c.chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=30)
    r = c.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER], tool_choice="none",
                                  temperature=0, max_tokens=30)
    auto = c.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER], temperature=0, max_tokens=30)
    assert r.usage.prompt_tokens == base.usage.prompt_tokens < auto.usage.prompt_tokens
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content == base.choices[0].message.content
    # vLLM's /tokenize renders the same prompt as the request
    req = urllib.request.Request(cluster["http"] + "/tokenize", json.dumps({"messages": msgs, "tools": [WEATHER]})
                                 .encode(), {"Content-Type": "application/json"})
    assert json.loads(urllib.request.urlopen(req, timeout=30).read())["count"] == auto.usage.prompt_tokens


REQUIRED_PROMPTS = ["What is the weather in Paris?", "What time is it in Tokyo?", "Is it cold in Oslo today?",
                    "Tell me a joke.", "I need the time in UTC and the weather in Lima.", "hello",
                    "Should I bring an umbrella in London?", "What's 2+2?", "Write a poem about the sea.",
                    "Weather in New York in fahrenheit please", "When does the sun set in Cairo?",
                    "Translate 'cat' to French."]


def streamed_calls(chunks) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or []:
            got = calls.setdefault(d.index, [d.function.name, ""])
            got[1] += d.function.arguments or ""
    return [(name, args) for name, args in (calls[i] for i in sorted(calls))]


def test_required_always_returns_calls_whose_arguments_validate(cluster):
    """Every prompt, asked or not about the tools, gets calls that validate. SmolLM2 sometimes repeats calls until
    max_tokens: the call that was cut is left out of the message (finish_reason says length)."""
    c = client(cluster)
    for q in REQUIRED_PROMPTS:
        kw = dict(model="smollm2", messages=[{"role": "user", "content": q}], tools=[WEATHER, TIME],
                  tool_choice="required", temperature=0, max_tokens=120)
        ch = c.chat.completions.create(**kw).choices[0]
        found = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        assert found and ch.finish_reason in ("tool_calls", "length") and ch.message.content is None, q
        for name, args in found:
            jsonschema.validate(json.loads(args), SCHEMAS[name])
        chunks = list(c.chat.completions.create(stream=True, **kw))
        streamed = streamed_calls(chunks)
        assert chunks[-1].choices[0].finish_reason == ch.finish_reason
        assert streamed == found if ch.finish_reason == "tool_calls" else streamed[:len(found)] == found, q


def test_named_function_is_called_with_valid_arguments(cluster):
    c = client(cluster)
    choice = {"type": "function", "function": {"name": "get_time"}}
    for q in ("What is the weather in Paris?", "What time is it in Sydney?"):
        kw = dict(model="smollm2", messages=[{"role": "user", "content": q}], tools=[WEATHER, TIME],
                  tool_choice=choice, temperature=0, max_tokens=80)
        ch = c.chat.completions.create(**kw).choices[0]
        [call] = ch.message.tool_calls
        assert call.function.name == "get_time" and ch.finish_reason == "stop"  # OpenAI's for a forced call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])
        streamed = list(c.chat.completions.create(stream=True, **kw))
        deltas = [d for s in streamed for d in (s.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == "get_time"
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


class GetTime(pydantic.BaseModel):
    """The local time in a time zone."""

    timezone: str


def test_the_clients_parse_reads_a_pydantic_function_tools_arguments(cluster):
    c = client(cluster)
    r = c.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": "What time is it in Lima?"}],
                                 tools=[openai.pydantic_function_tool(GetTime)], temperature=0, max_tokens=60,
                                 tool_choice={"type": "function", "function": {"name": "GetTime"}})
    [call] = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetTime) and call.function.parsed_arguments.timezone


BAD = [
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name is missing"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]),
     "tools[0].function.parameters is not a valid JSON Schema"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]),
     "tools[0].function.parameters must be a JSON Schema object"),
    (dict(tools=[{"type": "code_interpreter"}]), "function tools only"),
    (dict(tools=[WEATHER, WEATHER]), "two functions named 'get_weather'"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_stock"}}),
     "tool_choice names the function 'get_stock', which is not in tools"),
    (dict(tool_choice="required"), "tool_choice 'required' needs tools"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
     "tool_choice 'required' or a named function constrains the output to the call"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice must be 'none', 'auto', 'required'"),
    (dict(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls must be true or false"),
    (dict(messages=[{"role": "tool", "content": "22 C"}]), "messages[0].tool_call_id is missing"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": {}}}]}]),
     "arguments as a JSON string"),
]


@pytest.mark.parametrize(("extra", "message"), BAD)
def test_invalid_tool_requests_are_400s_naming_the_problem(cluster, extra, message):
    c = client(cluster)
    kw = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**kw)
    assert message in e.value.message


def test_tools_on_completions_is_a_400(cluster):
    with pytest.raises(openai.BadRequestError, match="tools are served on /v1/chat/completions"):
        client(cluster).completions.create(model="smollm2", prompt="Hi", max_tokens=4, extra_body={"tools": [WEATHER]})
