"""The OpenAI request bodies the HTTP API accepts, as pydantic models: their validation (each failure names the
field and what is wrong, in the words ``openai_api.py`` answers with) and the OpenAPI document of ``GET
/openapi.json``, generated from the same models.

A failed check is a ``PydanticCustomError`` of type ``tokenmill``: its context holds ``what`` (said after the
field's path, e.g. ``messages[0].role``), or a whole ``message``, and ``param`` when the field at fault is not the
first element of the path. ``openai_api.error_of`` turns the first error into the OpenAI error.

Unknown fields are ignored, as OpenAI and vLLM do; a feature we do not serve is a 400 that names it. Tools and
structured outputs are typed here for the document and checked by ``tools.py`` and ``constraints.py``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import models_json_schema
from pydantic_core import PydanticCustomError

MAX_N = 128
MAX_LOGPROBS = 20
ROLES = ("system", "developer", "user", "assistant", "tool")
SERVICE_TIER_NAMES = ("auto", "priority", "default", "flex", "interactive", "standard", "batch")
PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of such lists"
# what a required field's absence says (the same as a wrong value, as the hand-written checks said)
MISSING = {"messages": "must be a non-empty list of {role, content} objects",
           "prompt": f"must be {PROMPT_FORMS}",
           "role": f"must be one of {list(ROLES)}, got None",
           "tokens": "must be a list of token ids (integers >= 0)"}


def fail(what: str = "", *, at: str = "", message: str = "", param: str | None = None) -> PydanticCustomError:
    """A validation error in the project's words: ``<path><at> <what>``, or ``message`` whole."""
    return PydanticCustomError("tokenmill", "{text}", {"text": message or what, "what": what, "at": at,
                                                       "message": message, "param": param})


# -- scalar fields: JSON null is "not given"; a JSON true is not a number --------------------------------------
def _number(v: Any, what: str) -> Any:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise fail(f"must be {what}, got {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise fail(f"must be a finite number, got {v!r}")
    return v


def _int(lo: int | None = None, hi: int | None = None) -> BeforeValidator:
    def check(v: Any) -> int | None:
        if v is None:
            return None
        v = _number(v, "an integer")
        if isinstance(v, float):
            if not v.is_integer():
                raise fail(f"must be an integer, got {v!r}")
            v = int(v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise fail(f"must be {f'>= {lo}' if hi is None else f'in [{lo}, {hi}]'}, got {v}")
        return v

    return BeforeValidator(check)


def _float(v: Any) -> float | None:
    if v is None:
        return None
    v = _number(v, "a number")
    try:
        return float(v)
    except OverflowError:  # an integer literal past a float's range
        raise fail(f"must be a finite number, got an integer of {len(str(v))} digits") from None


def _bool(v: Any) -> bool | None:
    if v is None or isinstance(v, bool):
        return v
    raise fail(f"must be true or false, got {v!r}")


def _truthy(v: Any) -> bool:
    return bool(v)  # these fields were always read as "set or not": keep accepting any JSON value


Float = Annotated[float | None, BeforeValidator(_float)]
Bool = Annotated[bool | None, BeforeValidator(_bool)]
AnyInt = Annotated[int | None, _int()]
PositiveInt = Annotated[Annotated[int, Field(ge=1)] | None, _int(1)]
Count = Annotated[Annotated[int, Field(ge=0)] | None, _int(0)]
Choices = Annotated[Annotated[int, Field(ge=1, le=MAX_N)] | None, _int(1, MAX_N)]
TopLogprobs = Annotated[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None, _int(0, MAX_LOGPROBS)]


def _not_served(v: Any) -> Any:
    if v:
        raise fail("is not supported by this server")
    return v


NotServed = Annotated[Any, BeforeValidator(_not_served), WithJsonSchema(
    {"type": "boolean", "description": "not served: only a false value is accepted"})]


def _delegated(schema: dict[str, Any], checked_by: str) -> dict[str, Any]:
    """The OpenAPI schema of a field checked elsewhere (``checked_by``); null, as absent, is accepted too."""
    return {"anyOf": [schema, {"type": "null"}], "description": f"checked by {checked_by}"}


_TOOLS_PY, _CONSTRAINTS_PY = "services/gateway/tools.py", "services/gateway/constraints.py"
Tools = Annotated[Any, WithJsonSchema(_delegated({"type": "array", "items": {"type": "object", "properties": {
    "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "description": {"type": "string"}, "parameters": {"type": "object"}}}}}},
    _TOOLS_PY))]
ToolChoice = Annotated[Any, WithJsonSchema(_delegated(
    {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]}, _TOOLS_PY))]
ToolFlag = Annotated[Any, WithJsonSchema(_delegated({"type": "boolean"}, _TOOLS_PY))]
Absent = Annotated[Any, WithJsonSchema({"type": "null", "description": "not served (any value but null is a 400 that "
                                                                        "says so)"})]
Constraint = Annotated[Any, WithJsonSchema(_delegated({"type": "object"}, _CONSTRAINTS_PY))]
JsonConstraint = Annotated[Any, WithJsonSchema(_delegated({"anyOf": [{"type": "object"}, {"type": "string"}]},
                                                           _CONSTRAINTS_PY))]
TextConstraint = Annotated[Any, WithJsonSchema(_delegated({"type": "string"}, _CONSTRAINTS_PY))]
ChoiceConstraint = Annotated[Any, WithJsonSchema(_delegated({"type": "array", "items": {"type": "string"}},
                                                             _CONSTRAINTS_PY))]
Ignored = Annotated[Any, WithJsonSchema({"type": "string", "description": "accepted and ignored"})]


# -- messages ------------------------------------------------------------------------------------------------
class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field("{}", description="the arguments as a JSON string")


class ToolCall(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message; ``developer`` is read as ``system``, the content parts are text only."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    tool_calls: list[ToolCall] | None = Field(None, validate_default=True,
                                              description="an assistant message's calls (other roles: ignored)")
    tool_call_id: str | None = Field(None, validate_default=True,
                                     description="the call a tool message answers (required with role tool)")

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, v: Any) -> Any:
        if v not in ROLES:
            raise fail(f"must be one of {list(ROLES)}, got {v!r}")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any, info: ValidationInfo) -> str:
        if isinstance(v, list):  # content parts: text only, joined
            for j, part in enumerate(v):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise fail(f"is of type {kind!r}; this model takes text parts only", at=f"[{j}]")
            v = "".join(part["text"] for part in v)
        if v is None and info.data.get("role") == "assistant":
            v = ""
        if not isinstance(v, str):
            raise fail("must be a string or a list of text parts")
        return v

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _tool_calls(cls, v: Any, info: ValidationInfo) -> list[dict[str, Any]] | None:
        if info.data.get("role") != "assistant" or not v:
            return None
        if not isinstance(v, list):
            raise fail("must be a list of {id, type: function, function: {name, arguments}}")
        out = []
        for j, c in enumerate(v):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                    fn.get("arguments", ""), str):
                raise fail("must be {id, type: function, function: {name, arguments}} with arguments as a JSON "
                           "string", at=f"[{j}]")
            out.append({"id": str(c.get("id") or ""), "type": "function",
                        "function": {"name": fn["name"], "arguments": fn.get("arguments") or "{}"}})
        return out

    @field_validator("tool_call_id", mode="before")
    @classmethod
    def _tool_call_id(cls, v: Any, info: ValidationInfo) -> str | None:
        if info.data.get("role") != "tool":
            return None
        if not isinstance(v, str) or not v:
            raise fail("is missing; a tool message answers the call with that id")
        return v


def _messages(v: Any) -> Any:
    if not isinstance(v, list) or not v:
        raise fail(MISSING["messages"])
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise fail("must be an object with role and content", at=f"[{i}]")
    return v


Messages = Annotated[list[ChatMessage], BeforeValidator(_messages), Field(min_length=1)]


# the order the fields are checked in: a body's first failure in it is the answer
CHECK_ORDER = ("model", "echo", "suffix", "n", "best_of", "stream", "stream_options", "skip_response_cache",
               "max_completion_tokens", "max_tokens", "temperature", "top_p", "min_p", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "top_k", "seed", "stop", "stop_token_ids", "logit_bias",
               "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "logprobs",
               "top_logprobs", "tools", "priority", "service_tier", "cache_salt", "messages", "prompt")


# -- the bodies ----------------------------------------------------------------------------------------------
def _stop(v: Any) -> Any:
    if isinstance(v, str):
        return [v]
    if v is not None and not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        raise fail(f"must be a string or a list of strings, got {v!r}")
    return v


def _stop_token_ids(v: Any) -> Any:
    if v is not None and (not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in v)):
        raise fail("must be a list of integer token ids")
    return v


def _logit_bias(v: Any) -> dict[int, float] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise fail("must be an object mapping token ids to numbers in [-100, 100]")
    out: dict[int, float] = {}
    for key, b in v.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise fail(message=f"logit_bias key {key!r} is not a token id") from None
        if isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100:
            raise fail(f"must be a number in [-100, 100], got {b!r}", at=f"[{key!r}]")
        if tid < 0:
            raise fail(message=f"logit_bias key {key!r} is not a token id (ids are >= 0)")
        out[tid] = float(b)
    return out


def _service_tier(v: Any) -> Any:
    if v is not None and (not isinstance(v, str) or v not in SERVICE_TIER_NAMES):
        raise fail(f"must be one of {list(SERVICE_TIER_NAMES)}, got {v!r}")
    return v


def _cache_salt(v: Any) -> str:
    v = v or ""
    if not isinstance(v, str):
        raise fail("must be a string")
    return v


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Annotated[bool, BeforeValidator(_truthy)] = Field(
        False, description="a last chunk with the usage (and usage: null on every other chunk)")


def _stream_options(v: Any) -> Any:
    if v is not None and not isinstance(v, dict):
        raise fail("must be an object")
    return v


def _model(v: Any) -> Any:
    if v is not None and not isinstance(v, str):
        raise fail(f"must be a string, got {v!r}")
    return v


class _Request(BaseModel):
    """The fields chat and completions share."""

    model_config = ConfigDict(extra="ignore")
    model: Annotated[str | None, BeforeValidator(_model)] = Field(
        None, description="a served name (GET /v1/models); default: the first")
    n: Choices = Field(1, description="choices per prompt")
    best_of: PositiveInt = Field(None, description="only equal to n is served")
    stream: Bool = False
    stream_options: Annotated[StreamOptions | None, BeforeValidator(_stream_options)] = Field(
        None, description="only with stream: true")
    skip_response_cache: Bool = Field(False, description="answer from a worker even when the response cache holds "
                                                         "the request")
    max_tokens: PositiveInt = None
    temperature: Float = None
    top_p: Float = None
    min_p: Float = None
    presence_penalty: Float = None
    frequency_penalty: Float = None
    repetition_penalty: Float = None
    top_k: AnyInt = None
    seed: AnyInt = None
    stop: Annotated[list[str] | None, BeforeValidator(_stop), WithJsonSchema(
        {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]})] = None
    stop_token_ids: Annotated[list[int] | None, BeforeValidator(_stop_token_ids)] = None
    logit_bias: Annotated[dict[int, float] | None, BeforeValidator(_logit_bias), WithJsonSchema(
        {"anyOf": [{"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
                   {"type": "null"}], "description": "token id → bias"})] = None
    response_format: Constraint = None
    structured_outputs: Constraint = None
    guided_json: JsonConstraint = None
    guided_regex: TextConstraint = None
    guided_choice: ChoiceConstraint = None
    guided_grammar: TextConstraint = None
    ignore_eos: Bool = False
    min_tokens: Count = 0
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = None
    priority: AnyInt = Field(0, description="lower runs first (vLLM's)")
    service_tier: Annotated[str | None, BeforeValidator(_service_tier), WithJsonSchema(
        {"enum": [*SERVICE_TIER_NAMES, None], "description": "the priority class (auto: the tenant's default)"})] = None
    cache_salt: Annotated[str, BeforeValidator(_cache_salt)] = ""
    user: Ignored = None

    @field_validator("best_of", mode="after")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if v is not None and "n" in info.data and v != n:
            raise fail(message=f"best_of ({v}) other than n ({n}) is not supported by this server")
        return v

    @field_validator("stream_options", mode="after")
    @classmethod
    def _needs_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and "stream" in info.data and not info.data["stream"]:
            raise fail(message="stream_options is only allowed with stream: true")
        return v

class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    max_completion_tokens: PositiveInt = Field(None, description="max_tokens' newer name; wins over it")
    logprobs: Bool = False
    top_logprobs: TopLogprobs = None
    tools: Tools = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: ToolFlag = None
    functions: Absent = None  # deprecated: tools.py answers with what to send instead
    function_call: Absent = None
    messages: Messages

    @model_validator(mode="before")
    @classmethod
    def _newer_max_tokens(cls, body: Any) -> Any:
        # max_completion_tokens given: max_tokens is not read, so not checked either
        if isinstance(body, dict) and body.get("max_completion_tokens") is not None:
            return {k: v for k, v in body.items() if k != "max_tokens"}
        return body

    @field_validator("top_logprobs", mode="after")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and "logprobs" in info.data and not info.data["logprobs"] and v > 0:
            raise fail(message="top_logprobs needs logprobs: true")
        return v


def _prompt(v: Any) -> Any:
    if isinstance(v, str):
        if not v:
            raise fail("is empty; send at least one character")
        return v
    if isinstance(v, list) and v:
        if all(isinstance(p, str) for p in v):
            if any(not p for p in v):
                raise fail("contains an empty string")
            return v
        if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return _token_ids(v, "", "prompt")
        if all(isinstance(p, list) for p in v):
            return [_token_ids(p, f"[{i}]", f"prompt[{i}]") for i, p in enumerate(v)]
    raise fail(MISSING["prompt"])


def _token_ids(v: list[Any], at: str, param: str) -> list[int]:
    if not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise fail("must be a non-empty list of integer token ids", at=at, param=param)
    bad_at = next((i for i, t in enumerate(v) if t < 0), None)
    if bad_at is not None:
        raise fail(f"is {v[bad_at]}; token ids are >= 0", at=f"{at}[{bad_at}]", param=param)
    return v


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    echo: NotServed = None
    suffix: NotServed = None
    max_tokens: PositiveInt = Field(None, description="default 16")
    logprobs: TopLogprobs = Field(None, description="top logprobs per token (0: the chosen token's only)")
    tools: Absent = None  # served on /v1/chat/completions
    prompt: Annotated[str | list[str] | TokenIds | list[TokenIds], BeforeValidator(_prompt)]

    @field_validator("tools", mode="before")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v:
            raise fail("are served on /v1/chat/completions, not on /v1/completions")
        return v


def _tokenize_prompt(v: Any) -> Any:
    if not isinstance(v, str):
        raise fail(message="send prompt (a string) or messages", param="prompt")
    return v


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: ``prompt``, or ``messages`` (and ``tools``) through the chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: Annotated[str | None, BeforeValidator(_tokenize_prompt)] = None
    add_special_tokens: Annotated[bool, BeforeValidator(_truthy)] = True
    messages: Annotated[list[ChatMessage] | None, BeforeValidator(_messages)] = None  # null too: checked
    add_generation_prompt: Annotated[bool, BeforeValidator(_truthy)] = True
    tools: Tools = None
    tool_choice: ToolChoice = None

    @model_validator(mode="before")
    @classmethod
    def _one_input(cls, body: Any) -> Any:
        # messages win; without them the prompt is required (checked even when absent)
        if isinstance(body, dict):
            if "messages" in body:
                return {k: v for k, v in body.items() if k not in ("prompt", "add_special_tokens")}
            if "prompt" not in body:
                return {**body, "prompt": None}
        return body


def _tokens(v: Any) -> Any:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise fail(MISSING["tokens"])
    return v


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``."""

    model_config = ConfigDict(extra="ignore")
    tokens: Annotated[TokenIds, BeforeValidator(_tokens)]


# -- the OpenAPI document ------------------------------------------------------------------------------------
BODIES: dict[str, type[BaseModel]] = {"/v1/chat/completions": ChatCompletionRequest,
                                      "/v1/completions": CompletionRequest,
                                      "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def openapi(routes: list[tuple[str, str, str]], title: str, version: str) -> dict[str, Any]:
    """OpenAPI 3.1 for ``routes`` (method, path, summary); a POST's request body is its model in ``BODIES``."""
    _, defs = models_json_schema([(m, "validation") for m in BODIES.values()],
                                 ref_template="#/components/schemas/{model}")
    paths: dict[str, Any] = {}
    for method, path, summary in routes:
        op: dict[str, Any] = {"summary": summary, "responses": {
            "200": {"description": "OK"},
            "default": {"description": "an OpenAI error", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Error"}}}}}}
        model = BODIES.get(path) if method == "post" else None
        if model is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        paths.setdefault(path, {})[method] = op
    schemas = dict(defs.get("$defs", {}))
    schemas["Error"] = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                         "param": {"type": ["string", "null"]},
                                         "code": {"type": ["string", "integer", "null"]}}}}}
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": schemas}}
