"""Tools in the prompt of a model whose chat template does not render them (SmolLM2's, for one).

The messages are rewritten into plain system/user/assistant turns that any template renders, the way
Hermes-style templates (NousResearch Hermes 2 Pro, Qwen 2.5) write tools:

- the tools go in a system section, as JSON inside ``<tools></tools>``, with the call format to answer in;
- an assistant turn's calls become its text, in that format;
- a tool result becomes a user turn holding ``<tool_response>…</tool_response>``.

The call format follows ``gateway.tool_parser``, so the gateway can read what the model was asked for: ``hermes``
asks for ``<tool_call>{"name", "arguments"}</tool_call>``, ``llama3`` for the JSON object
``{"name", "parameters"}`` alone (Llama 3.1's JSON tool prompt).
"""

from __future__ import annotations

import json
from typing import Any, Literal

Style = Literal["hermes", "llama3"]

_HERMES = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_LLAMA3 = (
    "# Tools\n\nGiven the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\n"
    'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. '
    "Do not use variables.\n\n{tools}"
)


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               style: Style = "hermes") -> list[dict[str, Any]]:
    """``messages`` rewritten so that a template without tool support shows ``tools`` and the tool turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            parts = [m.get("content") or ""] + [_call_text(c, style) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(p for p in parts if p)})
        elif role == "tool":
            response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_responses"):  # consecutive results share one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_responses": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_responses", None)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        section = (_HERMES if style == "hermes" else _LLAMA3).format(tools=listing)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{section}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _call_text(call: dict[str, Any], style: Style) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if style == "hermes":
        return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + \
            "\n</tool_call>"
    return json.dumps({"name": fn.get("name"), "parameters": args}, ensure_ascii=False)
