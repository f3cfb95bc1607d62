"""Tools in the prompt: a chat template that takes ``tools`` renders them itself; one that does not (SmolLM2's) gets
them, and the tool turns, written Hermes-style or as Llama 3's JSON prompt (``common/tool_prompt.py``)."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, models
from tokenmill.v1 import tokenizer_pb2

from common.loader import load_tokenizer
from common.tokenizer import TextTokenizer
from services.tokenizer.server import chat_messages, chat_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TURNS = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
         {"role": "tool", "tool_call_id": "call_2", "content": "windy"}]


def test_smollm2_gets_tools_and_tool_turns_hermes_style():
    tok = load_tokenizer("smollm2")
    assert not tok.renders_tools
    text = tok.apply_chat_template(TURNS, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in text
    # consecutive results share one user turn
    assert ("<|im_start|>user\n<tool_response>\n22 C\n</tool_response>\n<tool_response>\nwindy\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in text
    assert "SmolLM" not in text  # the tools' system turn replaces the template's default one
    with_system = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *TURNS[:1]], tools=TOOLS)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    # no tools and no tool turns: the template alone
    plain = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(plain, tools=None) == tok.apply_chat_template(plain)


def test_llama3_style_asks_for_json_calls():
    text = load_tokenizer("smollm2").apply_chat_template(TURNS, tools=TOOLS, tool_format="llama3")
    assert 'Respond in the format {"name": function name, "parameters": dictionary' in text
    assert '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|im_end|>' in text


def test_a_template_that_takes_tools_renders_them_itself():
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments.city }})]{% endfor %}"
                "{% endfor %}")
    tok = TextTokenizer(Tokenizer(models.BPE()), template, None, None, False)
    assert tok.renders_tools
    text = tok.apply_chat_template(TURNS[:3], add_generation_prompt=False, tools=TOOLS)
    assert text == "TOOLS:get_weather;user:Weather in Paris?assistant:[get_weather(Paris)]tool:22 C"


def test_the_tokenizer_service_hands_tool_fields_to_the_template():
    chat = tokenizer_pb2.ChatMessages(tools_json=json.dumps(TOOLS))
    chat.messages.add(role="assistant", tool_calls_json=json.dumps(
        [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]))
    chat.messages.add(role="tool", content="3 C", tool_call_id="c")
    msgs = chat_messages(chat)
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # an object, as templates take
    assert msgs[1] == {"role": "tool", "content": "3 C", "tool_call_id": "c"}
    assert chat_tools(chat) == TOOLS and chat_tools(tokenizer_pb2.ChatMessages()) is None
