"""OpenAI tool calling at the gateway: the request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, the JSON
schema that enforces ``required`` and a named function (the engine's structured output), and which parser reads
the calls. Pure: no I/O.

``required`` is a JSON list of ``{"name", "parameters"}`` (vLLM's shape), a named function its arguments' schema.
The model's text becomes ``tool_calls`` in ``tool_parsers.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from services.gateway.tool_parsers import CallStream, HermesStream, JsonCallsStream, NamedStream

Mode = Literal["none", "auto", "required", "named"]
ParserName = Literal["hermes", "llama3"]
_EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A tool field of the request is invalid; ``param`` names the field (the gateway answers 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A chat request's tools and how the model is to use them."""

    tools: tuple[Tool, ...]
    mode: Mode
    named: str | None = None  # the function a named tool_choice forces
    parallel: bool = True

    @property
    def offered(self) -> bool:
        """Whether the tools reach the prompt and the output is parsed (``none``: neither, as if none were sent)."""
        return self.mode != "none"

    @property
    def enforced(self) -> bool:
        return self.mode in ("required", "named")

    def tools_json(self) -> str:
        """The tools in OpenAI's shape, for the chat template."""
        return json.dumps([{"type": "function", "function": {"name": t.name, "description": t.description,
                                                             "parameters": t.parameters}} for t in self.tools],
                          ensure_ascii=False)

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match (``required``: a list of calls; named: the function's arguments);
        None when the model is free."""
        if self.mode == "named":
            return closed(next(t.parameters for t in self.tools if t.name == self.named))
        if self.mode != "required":
            return None
        calls: dict[str, Any] = {
            "type": "array", "minItems": 1,
            "items": {"type": "object", "anyOf": [
                {"properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": closed(t.parameters)},
                 "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]}}
        if not self.parallel:
            calls["maxItems"] = 1
        return calls

    def stream(self, parser: ParserName) -> CallStream:
        """A fresh parser for one choice's output."""
        if self.mode == "named":
            return NamedStream(self.named or "")
        if self.mode == "required":
            return JsonCallsStream(self.parallel, leading_text=False)
        if parser == "llama3":
            return JsonCallsStream(self.parallel, leading_text=True)
        return HermesStream(self.parallel)


# -- the request ---------------------------------------------------------------------------------------------
def parse_request(body: dict[str, Any]) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body; None without tools. Raises ToolError."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise ToolError("functions and function_call are deprecated and not served; send tools and tool_choice",
                        "functions")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise ToolError(f"tool_choice {_short(choice)} needs tools; send the functions in tools", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise ToolError("tools must be a list of {type: function, function: {name, description, parameters}}",
                        "tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ToolError(f"tools has two functions named {dup!r}; function names must be unique", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls")
    if choice is None or choice in ("auto", "none", "required"):
        return ToolRequest(tools, choice or "auto", None, parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in names:
            raise ToolError(f"tool_choice names the function {name!r}, which is not in tools ({names})",
                            "tool_choice")
        return ToolRequest(tools, "named", name, parallel)
    raise ToolError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                    f"{{\"name\": ...}}}}, got {_short(choice)}", "tool_choice")


def _tool(t: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        kind = t.get("type") if isinstance(t, dict) else type(t).__name__
        raise ToolError(f"{where} is of type {kind!r}; this server serves function tools only", "tools")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"{where}.function must be an object with name, description and parameters", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{where}.function.name is missing; every function needs a name", "tools")
    if len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name):
        raise ToolError(f"{where}.function.name {name!r} must be letters, digits, _ or -, at most 64", "tools")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise ToolError(f"{where}.function.description must be a string", "tools")
    params = fn.get("parameters")
    if params is None:
        params = _EMPTY_PARAMS
    if not isinstance(params, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON Schema object, got {_short(params)}", "tools")
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as e:
        at = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ToolError(f"{where}.function.parameters is not a valid JSON Schema at {at}: {e.message}",
                        "tools") from None
    return Tool(name, desc, params)


_DATA_KEYS = ("enum", "const", "default", "examples")  # their values are JSON data, not schemas


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that does not say otherwise, as xgrammar's
    strict mode (vLLM's default) reads a schema: a constrained call then holds the declared arguments only, and a
    small model cannot fill its ``max_tokens`` with keys the function does not take."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYS else closed(v) for k, v in schema.items()}
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _short(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 80 else s[:77] + "..."
