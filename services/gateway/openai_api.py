"""The OpenAI wire format: request bodies → ``GenerateRequest``s, ``GenerateResponse``s → response JSON and SSE
chunks, errors in OpenAI's shape. Pure functions and small classes: no I/O (``services/gateway/http.py`` serves).

Accepted fields: OpenAI's (``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``n``, ``stop``,
``seed``, ``presence_penalty``, ``frequency_penalty``, ``logprobs`` / ``top_logprobs``, ``user``, ``stream``,
``stream_options.include_usage``) and vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``priority``, ``cache_salt``), ``service_tier`` as the request's priority class (``SERVICE_TIERS``),
``skip_response_cache`` (answer from a worker even when the gateway's response cache holds the request),
structured outputs: ``response_format`` and vLLM's ``structured_outputs`` and ``guided_*``
(``services/gateway/constraints.py``), and on chat ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
(``services/gateway/tools.py``). A choice the output filter blocked ends with ``finish_reason: "content_filter"``
and carries ``filter_reason`` (why) beside it, in the response and in the streamed chunk that ends it. Unknown
fields are ignored, as OpenAI and vLLM do; features we do not serve (``echo``, ``suffix``, ``best_of`` > n, images,
the deprecated ``functions``) are a 400 that says so. The bodies are the pydantic models of
``services/gateway/openai_schema.py``; ``validate`` turns their first failure into the 400 that names the field.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError
from tokenmill.v1 import common_pb2, frontend_pb2, tokenizer_pb2

from services.gateway import constraints
from services.gateway import openai_schema as schema
from services.gateway import tool_parsers as tp
from services.gateway import tools as tl

Kind = Literal["chat", "completion"]
MAX_N = schema.MAX_N
MAX_LOGPROBS = schema.MAX_LOGPROBS
M = TypeVar("M", bound=BaseModel)
_FINISH: dict[int, str] = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort", common_pb2.FINISH_REASON_CONTENT_FILTER: "content_filter"}
# OpenAI's error types by status code
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
               503: "service_unavailable", 504: "timeout_error"}
# OpenAI's service_tier → the priority class (None: the tenant's default); a class's own name is accepted too.
# Responses carry the tier the request ran in (TIER_OF_CLASS).
SERVICE_TIERS: dict[str, common_pb2.PriorityClass | None] = {
    "auto": None, "priority": common_pb2.PRIORITY_CLASS_INTERACTIVE, "default": common_pb2.PRIORITY_CLASS_STANDARD,
    "flex": common_pb2.PRIORITY_CLASS_BATCH, "interactive": common_pb2.PRIORITY_CLASS_INTERACTIVE,
    "standard": common_pb2.PRIORITY_CLASS_STANDARD, "batch": common_pb2.PRIORITY_CLASS_BATCH}
TIER_OF_CLASS = {common_pb2.PRIORITY_CLASS_INTERACTIVE: "priority", common_pb2.PRIORITY_CLASS_STANDARD: "default",
                 common_pb2.PRIORITY_CLASS_BATCH: "flex"}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "stop_token_ids", "stop")


class OpenAIError(Exception):
    """An HTTP error with OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPE.get(self.status, "api_error"),
                          "param": self.param, "code": self.code if self.code is not None else self.status}}


def bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def param_of(message: str) -> str | None:
    """The request field a validation message starts with (``"top_p must be …"`` → ``top_p``)."""
    word = message.split(" ", 1)[0]
    return word if word in _SAMPLING_FIELDS else None


@dataclass(slots=True)
class Parsed:
    """One OpenAI request, ready to run: one ``GenerateRequest`` per choice (prompts × n)."""

    kind: Kind
    model: str
    requests: list[frontend_pb2.GenerateRequest]
    n: int
    num_prompts: int
    stream: bool
    include_usage: bool
    logprobs: bool
    service_tier: common_pb2.PriorityClass | None = None  # the priority class asked for (None: the tenant's default)
    tools: tl.ToolRequest | None = None  # chat with tools offered to the model (tool_choice other than none)
    tool_parser: tl.ParserName = "hermes"


# -- reading requests ----------------------------------------------------------------------------------------
def _path(loc: tuple[int | str, ...]) -> str:
    """A validation error's location as the client wrote it: ``messages[0].role``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def error_of(exc: ValidationError, order: tuple[str, ...] = ()) -> OpenAIError:
    """The first failure of a body (the first in ``order`` of its top-level field) → a 400 naming the field."""
    errors = exc.errors(include_url=False)
    e = min(errors, key=lambda e: order.index(e["loc"][0]) if e["loc"] and e["loc"][0] in order else len(order))
    loc, ctx = tuple(e["loc"]), e.get("ctx") or {}
    param = ctx.get("param") or (str(loc[0]) if loc else None)
    if e["type"] == "tokenmill":
        message = ctx["message"] or f"{_path(loc)}{ctx['at']} {ctx['what']}"
    elif not loc and e["type"] == "model_type":
        return bad("the request body must be a JSON object")
    elif e["type"] == "missing" and str(loc[-1]) in schema.MISSING:
        message = f"{_path(loc)} {schema.MISSING[str(loc[-1])]}"
    elif e["type"] in ("model_type", "dict_type"):
        message = f"{_path(loc)} must be an object, got {e['input']!r}"
    else:  # a check of pydantic's own: its words, after the field
        message = f"{_path(loc)}: {e['msg']}"
    return bad(message, param)


def validate(model: type[M], body: Any, resolve_model: Callable[[str | None], str] | None = None) -> M:
    """``body`` as ``model``, or the OpenAIError of its first failure. With ``resolve_model``, an unknown model is
    the answer (404) before any other field's failure, as long as ``model`` itself is a string."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        order = schema.CHECK_ORDER + tuple(model.model_fields)
        if resolve_model is not None and isinstance(body, dict) and (
                body.get("model") is None or isinstance(body.get("model"), str)):
            resolve_model(body.get("model"))
        raise error_of(exc, order) from None


def _params(body: dict[str, Any], r: schema.ChatCompletionRequest | schema.CompletionRequest
            ) -> tuple[common_pb2.SamplingParams, bool]:
    """The sampling fields → SamplingParams (range checks are SamplingParams.validate's, at the gateway)."""
    p = common_pb2.SamplingParams()
    mt = r.max_completion_tokens if isinstance(r, schema.ChatCompletionRequest) else None
    if mt is None:
        mt = r.max_tokens
    if mt is None and isinstance(r, schema.CompletionRequest):
        mt = 16  # OpenAI's (and vLLM's) default for completions; chat defaults to the rest of the context
    if mt is not None:
        p.max_tokens = mt
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = getattr(r, name)
        if v is not None:
            setattr(p, name, v)
    if r.top_k is not None:
        p.top_k = r.top_k
    if r.seed is not None:
        p.seed = r.seed
    p.stop.extend(r.stop or [])
    p.stop_token_ids.extend(r.stop_token_ids or [])
    for tid, v in (r.logit_bias or {}).items():
        p.logit_bias[tid] = v
    try:
        so = constraints.from_body(body)
    except constraints.ConstraintError as e:
        raise bad(str(e), e.param) from None
    if so is not None:
        p.structured.CopyFrom(so)
    p.ignore_eos = bool(r.ignore_eos)
    p.min_tokens = r.min_tokens or 0
    p.include_stop_str_in_output = bool(r.include_stop_str_in_output)
    if r.skip_special_tokens is not None:
        p.skip_special_tokens = r.skip_special_tokens
    want_logprobs = False
    if isinstance(r, schema.ChatCompletionRequest):
        want_logprobs = bool(r.logprobs)
        if want_logprobs:
            p.logprobs = r.top_logprobs or 0
    elif r.logprobs is not None:
        want_logprobs = True
        p.logprobs = r.logprobs
    return p, want_logprobs


def chat_messages(msgs: list[schema.ChatMessage]) -> tokenizer_pb2.ChatMessages:
    """Validated messages → the tokenizer's (``developer`` is ``system``; tool calls as OpenAI's JSON)."""
    chat = tokenizer_pb2.ChatMessages(add_generation_prompt=True)
    for m in msgs:
        msg = chat.messages.add(role="system" if m.role == "developer" else m.role, content=m.content)
        if m.tool_calls:
            msg.tool_calls_json = json.dumps([c.model_dump() for c in m.tool_calls], ensure_ascii=False)
        if m.tool_call_id is not None:
            msg.tool_call_id = m.tool_call_id
    return chat


def chat_tools(body: dict[str, Any]) -> tl.ToolRequest | None:
    """A chat body's tools when they are offered to the model (None without tools or with ``tool_choice`` none)."""
    try:
        req = tl.parse_request(body)
    except tl.ToolError as e:
        raise bad(str(e), e.param) from None
    return req if req is not None and req.offered else None


def _tools(body: dict[str, Any], kind: Kind, params: common_pb2.SamplingParams) -> tl.ToolRequest | None:
    """The request's tools (chat only), the constraint of ``required`` / a named function set on ``params``."""
    if kind == "completion":
        return None  # the model refused them
    req = chat_tools(body)
    if req is None:
        return None
    tool_schema = req.schema()
    if tool_schema is not None:
        if params.HasField("structured"):
            raise bad("tool_choice 'required' or a named function constrains the output to the call: send it "
                      "without response_format, structured_outputs or guided_*", "tool_choice")
        params.structured.json_schema = json.dumps(tool_schema)
    return req


def parse(body: Any, kind: Kind, resolve_model: Callable[[str | None], str],
          tool_parser: tl.ParserName = "hermes") -> Parsed:
    """Validate an OpenAI request body; raise OpenAIError (400/404) with the field in ``param``.

    ``resolve_model`` maps the requested model to the served name (or raises the 404); ``tool_parser`` reads tool
    calls out of the model's text (``gateway.tool_parser``)."""
    r: schema.ChatCompletionRequest | schema.CompletionRequest
    if kind == "chat":
        r = validate(schema.ChatCompletionRequest, body, resolve_model)
    else:
        r = validate(schema.CompletionRequest, body, resolve_model)
    model = resolve_model(r.model)
    n = r.n or 1
    params, want_logprobs = _params(body, r)
    tools = _tools(body, kind, params)
    inputs: list[dict[str, Any]]
    if isinstance(r, schema.ChatCompletionRequest):
        chat = chat_messages(r.messages)
        if tools is not None:
            chat.tools_json = tools.tools_json()
        inputs = [{"chat": chat}]
    else:
        inputs = _prompts(r.prompt)
    reqs = []
    for inp in inputs:
        for j in range(n):
            req = frontend_pb2.GenerateRequest(model=model, params=params, priority=r.priority or 0,
                                               cache_salt=r.cache_salt, skip_response_cache=bool(r.skip_response_cache))
            if "chat" in inp:
                req.chat.CopyFrom(inp["chat"])
            elif "ids" in inp:
                req.prompt_token_ids.ids.extend(inp["ids"])
            else:
                req.prompt = inp["text"]
            if n > 1 and params.HasField("seed"):
                req.params.seed = params.seed + j  # n different samples, each reproducible
            reqs.append(req)
    tier = r.service_tier
    return Parsed(kind, model, reqs, n, len(inputs), bool(r.stream),
                  bool(r.stream_options and r.stream_options.include_usage), want_logprobs,
                  SERVICE_TIERS[tier] if tier is not None else None, tools, tool_parser)


def _prompts(prompt: Any) -> list[dict[str, Any]]:
    """A validated prompt → one input per prompt."""
    if isinstance(prompt, str):
        return [{"text": prompt}]
    if all(isinstance(p, str) for p in prompt):
        return [{"text": p} for p in prompt]
    if all(isinstance(t, int) for t in prompt):
        return [{"ids": prompt}]
    return [{"ids": p} for p in prompt]


# -- responses -----------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Choice:
    """What one choice accumulated (non-streaming) or the usage it reported (streaming)."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    filter_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    chars: int = 0  # text length so far (completions' logprobs text_offset)

    def add(self, resp: frontend_pb2.GenerateResponse, keep: bool = True) -> None:
        self.chars += len(resp.text)
        if keep:
            self.text.append(resp.text)
            self.token_ids.extend(resp.token_ids)
            self.logprobs.extend(resp.logprobs)
        if resp.finish_reason:
            self.finish_reason = finish_reason(resp.finish_reason)
            self.filter_reason = resp.filter_reason
        if resp.HasField("usage"):
            u = resp.usage
            self.prompt_tokens, self.completion_tokens, self.cached_tokens = (
                u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def finish_reason(code: int) -> str | None:
    return _FINISH.get(code) if code else None


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (its n choices share it), completion tokens for every choice."""
    prompt = sum(c.prompt_tokens for c in choices if c.index % n == 0)
    cached = sum(c.cached_tokens for c in choices if c.index % n == 0)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class LogprobFormatter:
    """TokenLogprob protos → OpenAI's chat (``content: [...]``) or completions (parallel lists) shape.

    ``token_text(id)`` is the token's text (vLLM: the token decoded alone)."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self.token_text = token_text

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        s = self.token_text(token_id)
        return {"token": s, "logprob": _finite(logprob), "bytes": list(s.encode("utf-8"))}

    def chat(self, lps: list[common_pb2.TokenLogprob]) -> dict[str, Any]:
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t.token_id, t.logprob) for t in lp.top]}
                            for lp in lps]}

    def completion(self, lps: list[common_pb2.TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
        tokens, offsets, off = [], [], text_offset
        for lp in lps:
            s = self.token_text(lp.token_id)
            tokens.append(s)
            offsets.append(off)
            off += len(s)
        tops = []
        for lp in lps:
            d: dict[str, float] = {}
            for t in lp.top:
                d.setdefault(self.token_text(t.token_id), _finite(t.logprob))
            tops.append(d)
        return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in lps], "top_logprobs": tops,
                "text_offset": offsets}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf; vLLM clamps the same way


class ResponseBuilder:
    """Response objects of one request (same id, created and model in every chunk)."""

    def __init__(self, parsed: Parsed, request_id: str, fmt: LogprobFormatter, service_tier: str | None = None
                 ) -> None:
        self.p, self.id, self.fmt = parsed, request_id, fmt
        self.created = int(time.time())
        self.object = "chat.completion" if parsed.kind == "chat" else "text_completion"
        self.service_tier = service_tier  # the tier the request runs in, as OpenAI's responses name it
        self._calls: dict[int, tp.CallStream] = {}  # streamed choices' tool-call parsers

    def _finish(self, reason: str | None, calls: int) -> str | None:
        """OpenAI's finish reason: ``tool_calls`` when the model chose to call (a named function's is ``stop``)."""
        named = self.p.tools is not None and self.p.tools.mode == "named"
        return "tool_calls" if reason == "stop" and calls and not named else reason

    def _head(self, obj: str) -> dict[str, Any]:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.p.model}
        if self.service_tier is not None:
            out["service_tier"] = self.service_tier
        return out

    def full(self, choices: list[Choice]) -> dict[str, Any]:
        out = self._head(self.object)
        items = []
        for c in choices:
            text = "".join(c.text)
            finish = c.finish_reason
            if self.p.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.p.tools is not None:
                    said = tp.parse_output(self.p.tools.stream(self.p.tool_parser), text)
                    message["content"] = said.content
                    if said.tool_calls:
                        message["tool_calls"] = said.tool_calls
                    finish = self._finish(finish, len(said.tool_calls))
                item: dict[str, Any] = {"index": c.index, "message": message,
                                        "logprobs": self.fmt.chat(c.logprobs) if self.p.logprobs else None}
            else:
                item = {"index": c.index, "text": text,
                        "logprobs": self.fmt.completion(c.logprobs) if self.p.logprobs else None}
            item["finish_reason"] = finish
            if c.filter_reason:
                item["filter_reason"] = c.filter_reason
            items.append(item)
        out["choices"] = items
        out["usage"] = usage(choices, self.p.n)
        return out

    def chunks(self, c: Choice, resp: frontend_pb2.GenerateResponse, first: bool) -> list[dict[str, Any]]:
        """The streamed chunks for ``resp`` (a delta of choice ``c``, before ``c.add(resp)``): one, or with tools
        those the parser can say now (none while it holds back text that may start a call)."""
        if self.p.tools is None:
            return [self.chunk(c, resp, first)]
        stream = self._calls.setdefault(c.index, self.p.tools.stream(self.p.tool_parser))
        events = stream.feed(resp.text)
        fr = finish_reason(resp.finish_reason)
        if fr is not None:
            events += stream.finish()
            self._calls.pop(c.index, None)
        deltas = _tool_deltas(events)
        if first:
            deltas = [{"role": "assistant", "content": ""}, *deltas]
        if fr is not None or (resp.logprobs and self.p.logprobs):
            deltas = deltas or [{}]
        out = []
        for i, delta in enumerate(deltas):
            head = self._head("chat.completion.chunk")
            last = i == len(deltas) - 1
            head["choices"] = [{"index": c.index, "delta": delta,
                                "logprobs": self.fmt.chat(list(resp.logprobs)) if self.p.logprobs and i == 0
                                else None,
                                "finish_reason": self._finish(fr, stream.calls) if last else None}]
            if last and resp.filter_reason:
                head["choices"][0]["filter_reason"] = resp.filter_reason
            if self.p.include_usage:
                head["usage"] = None
            out.append(head)
        return out

    def chunk(self, c: Choice, resp: frontend_pb2.GenerateResponse, first: bool) -> dict[str, Any]:
        """One streamed chunk for ``resp`` (a delta of choice ``c``, before ``c.add(resp)``); the chat role
        rides on the first."""
        out = self._head("chat.completion.chunk" if self.p.kind == "chat" else "text_completion")
        fr = finish_reason(resp.finish_reason)
        if self.p.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": resp.text} if first else {"content": resp.text}
            item: dict[str, Any] = {"index": c.index, "delta": delta,
                                    "logprobs": self.fmt.chat(list(resp.logprobs)) if self.p.logprobs else None}
        else:
            item = {"index": c.index, "text": resp.text,
                    "logprobs": self.fmt.completion(list(resp.logprobs), c.chars)
                    if self.p.logprobs else None}
        item["finish_reason"] = fr
        if resp.filter_reason:
            item["filter_reason"] = resp.filter_reason
        out["choices"] = [item]
        if self.p.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        out = self._head("chat.completion.chunk" if self.p.kind == "chat" else "text_completion")
        out["choices"] = []
        out["usage"] = usage(choices, self.p.n)
        return out


def _tool_deltas(events: list[tp.Event]) -> list[dict[str, Any]]:
    """Parser events → chat deltas as OpenAI streams them: text as ``content``; a call's first delta with its
    index, id, type and name (arguments ""), then its argument fragments."""
    out: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, tp.Text):
            out.append({"content": e.text})
        elif isinstance(e, tp.CallStart):
            out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                        "function": {"name": e.name, "arguments": ""}}]})
        else:
            out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return out
