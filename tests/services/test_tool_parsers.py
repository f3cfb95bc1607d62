"""The tool-call parsers (``services/gateway/tool_parsers.py``) and the request side (``services/gateway/tools.py``):
both output formats whole and fed in fragments of every size (the streamed events add up to the whole message),
text around calls, text held back only while it may start a call, outputs that are not calls after all, and the
schemas that enforce ``required`` and a named function."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.gateway import tool_parsers as tp
from services.gateway import tools as tl

F = tl.Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
G = tl.Tool("get_time", "", {"type": "object", "properties": {"tz": {"type": "string"}}})


def stream(parser: str = "hermes", mode: tl.Mode = "auto", parallel: bool = True, named: str | None = None
           ) -> tp.CallStream:
    return tl.ToolRequest((F, G), mode, named, parallel).stream(parser)  # type: ignore[arg-type]


def in_pieces(s: tp.CallStream, text: str, size: int) -> tuple[tp.ParsedOutput, list[list[tp.Event]]]:
    per_feed = [s.feed(text[i:i + size]) for i in range(0, len(text), size)] + [s.finish()]
    return tp.collect([e for evs in per_feed for e in evs]), per_feed


def calls(out: tp.ParsedOutput) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in out.tool_calls]


HERMES = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } in \\" text"}}'
          '\n</tool_call>\nand <tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call> done.')
HERMES_CALLS = [("get_weather", '{"city": "Paris", "note": "a } in \\" text"}'), ("get_time", '{"tz": "UTC"}')]


@pytest.mark.parametrize("size", [1, 2, 5, 11, 1000])
def test_hermes_calls_and_the_text_around_them_in_any_fragments(size):
    out, _ = in_pieces(stream(), HERMES, size)
    assert calls(out) == HERMES_CALLS
    assert out.content == "Let me look. \nand  done."
    whole = tp.parse_output(stream(), HERMES)
    assert calls(whole) == HERMES_CALLS and whole.content == out.content
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in whole.tool_calls)
    assert len({c["id"] for c in whole.tool_calls}) == 2


def test_hermes_holds_back_only_what_may_start_a_tag():
    s = stream()
    assert s.feed("It is <tool") == [tp.Text("It is ")]
    assert s.feed("box> here <") == [tp.Text("<toolbox> here ")]
    evs = s.feed('tool_call>{"name": "get_')
    assert evs == []  # the name is not complete: nothing is said yet
    evs = s.feed('weather", "arguments": {"ci')
    assert isinstance(evs[0], tp.CallStart) and evs[0].name == "get_weather" and evs[0].index == 0
    assert evs[1:] == [tp.ArgsDelta(0, '{"ci')]
    assert s.feed('ty": "Oslo"}}</tool_call> <tool_c') == [tp.ArgsDelta(0, 'ty": "Oslo"}'), tp.Text(" ")]
    assert s.finish() == [tp.Text("<tool_c")]


def test_hermes_arguments_before_the_name_wait_for_it():
    s = stream()
    assert s.feed('<tool_call>{"arguments": {"tz": "CET"}, ') == []
    start, args = s.feed('"name": "get_time"}</tool_call>')
    assert start.name == "get_time" and args == tp.ArgsDelta(0, '{"tz": "CET"}')


@pytest.mark.parametrize("text", ["<tool_call>not json</tool_call> ok", '<tool_call>{"city": "Paris"}</tool_call>',
                                  '<tool_call>{"name": 3}</tool_call>'])
def test_hermes_tags_without_a_call_are_text(text):
    for size in (1, 3, 100):
        out, _ = in_pieces(stream(), text, size)
        assert out.tool_calls == [] and out.content == text


def test_a_second_arguments_field_and_other_keys_are_ignored():
    text = '<tool_call>{"name": "get_time", "id": 7, "parameters": {"tz": "A"}, "arguments": {"x": 1}}</tool_call>'
    for size in (1, 1000):
        out, _ = in_pieces(stream(), text, size)
        assert calls(out) == [("get_time", '{"tz": "A"}')] and out.content is None


def test_hermes_call_without_arguments_or_closing_tag():
    out = tp.parse_output(stream(), '<tool_call>{"name": "get_time"}')
    assert calls(out) == [("get_time", "{}")] and out.content is None


def test_a_call_cut_by_max_tokens_is_left_out():
    text = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    out = tp.parse_output(stream(), text)
    assert out.tool_calls == [] and out.content == text  # no call left: all text
    text = '[{"name": "get_time", "parameters": {"tz": "A"}}, {"name": "get_time", "parameters": {"tz": "'
    out = tp.parse_output(stream(mode="required"), text)
    assert calls(out) == [("get_time", '{"tz": "A"}')] and out.content is None
    bad_middle = '<tool_call>{"name": "get_time", "arguments": {tz: 1}}</tool_call><tool_call>{"name": "get_time"}'
    assert tp.parse_output(stream(), bad_middle) == tp.ParsedOutput(bad_middle)


def test_parallel_tool_calls_false_keeps_the_first_call():
    out, _ = in_pieces(stream(parallel=False), HERMES, 4)
    assert calls(out) == HERMES_CALLS[:1]


LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Lima"}}', [("get_weather", '{"city": "Lima"}')], None),
    ('<|python_tag|>{"name": "get_time", "arguments": {"tz": "UTC"}}', [("get_time", '{"tz": "UTC"}')], None),
    (' {"name": "get_weather", "parameters": {"city": "A"}}; {"name": "get_time", "parameters": {}}',
     [("get_weather", '{"city": "A"}'), ("get_time", "{}")], None),
    ('{"name": "get_time"}', [("get_time", "{}")], None),
    ('The answer is {"name": "get_time"}', [], 'The answer is {"name": "get_time"}'),
    ('{"answer": 42} is the JSON', [], '{"answer": 42} is the JSON'),
    ('{"name": "get_time", "parameters": {"tz": "UTC"}} Hope that helps', [("get_time", '{"tz": "UTC"}')],
     "Hope that helps"),
    ("Plain text only.", [], "Plain text only."),
]


@pytest.mark.parametrize(("text", "want", "content"), LLAMA3)
def test_llama3_json_calls_in_any_fragments(text, want, content):
    for size in (1, 4, 1000):
        out, _ = in_pieces(stream("llama3"), text, size)
        assert calls(out) == want and out.content == content, size


def test_llama3_holds_back_the_start_only_while_it_may_be_a_call():
    s = stream("llama3")
    assert s.feed("  <|python") == []
    assert s.feed("_tag|>") == []
    s2 = stream("llama3")
    assert s2.feed("Hi") == [tp.Text("Hi")] and s2.feed(' {"name": "x"}') == [tp.Text(' {"name": "x"}')]


def test_required_parses_the_list_of_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {"tz": "X"}}]'
    for size in (1, 7, 1000):
        out, _ = in_pieces(stream(mode="required"), text, size)
        assert calls(out) == [("get_weather", '{"city": "Rome"}'), ("get_time", '{"tz": "X"}')]
        assert out.content is None


def test_named_choice_streams_the_whole_output_as_arguments():
    s = stream(mode="named", named="get_time")
    start, first = s.feed('{"tz"')
    assert start.name == "get_time" and first == tp.ArgsDelta(0, '{"tz"')
    assert s.feed(': "UTC"}') == [tp.ArgsDelta(0, ': "UTC"}')]
    assert calls(tp.parse_output(stream(mode="named", named="get_time"), '{"tz": "UTC"}')) == [
        ("get_time", '{"tz": "UTC"}')]


def test_schemas_of_required_and_named():
    req = tl.ToolRequest((F, G), "required")
    schema = req.schema()
    ok = [{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}],
                [{"parameters": {"city": "x"}}], [{**ok[1], "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = tl.ToolRequest((F, G), "required", parallel=False).schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, one)
    assert tl.ToolRequest((F, G), "named", "get_weather").schema() == {**F.parameters, "additionalProperties": False}
    with pytest.raises(jsonschema.ValidationError):  # only the declared arguments
        jsonschema.validate([{"name": "get_time", "parameters": {"tz": "A", "extra": 1}}], schema)


def test_closed_schemas_take_only_declared_properties():
    s = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                          "c": {"type": "array", "items": {"properties": {"d": {}}}},
                                          "e": {"type": "object", "additionalProperties": {"type": "string"}},
                                          "f": {"enum": [{"properties": 1}]}}}
    c = tl.closed(s)
    assert c["additionalProperties"] is False and c["properties"]["a"]["additionalProperties"] is False
    assert c["properties"]["c"]["items"]["additionalProperties"] is False
    assert c["properties"]["e"]["additionalProperties"] == {"type": "string"}  # said otherwise: kept
    assert c["properties"]["f"] == {"enum": [{"properties": 1}]}  # data, not a schema
    assert "additionalProperties" not in s  # the tool's own schema (shown in the prompt) is unchanged
    assert tl.ToolRequest((F, G), "auto").schema() is None


def test_parse_request_defaults_and_errors():
    body = {"tools": [{"type": "function", "function": {"name": "f"}}]}
    req = tl.parse_request(body)
    assert req is not None and req.mode == "auto" and req.parallel and req.tools[0].parameters["type"] == "object"
    assert tl.parse_request({"tools": []}) is None and tl.parse_request({"tool_choice": "none"}) is None
    assert tl.parse_request({**body, "tool_choice": "none"}).offered is False
    named = tl.parse_request({**body, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert named.mode == "named" and named.named == "f"
    assert json.loads(req.tools_json()) == [{"type": "function", "function": {
        "name": "f", "description": "", "parameters": {"type": "object", "properties": {}}}}]
    for bad, field in [({"functions": [{}]}, "functions"), ({"tools": {"a": 1}}, "tools"),
                       ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
                       ({**body, "tool_choice": {"type": "function"}}, "tool_choice")]:
        with pytest.raises(tl.ToolError) as e:
            tl.parse_request(bad)
        assert e.value.param == field
