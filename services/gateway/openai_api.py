"""The OpenAI wire format: request bodies → ``GenerateRequest``s, ``GenerateResponse``s → response JSON and SSE
chunks, errors in OpenAI's shape. Pure functions and small classes: no I/O (``services/gateway/http.py`` serves).

Accepted fields: OpenAI's (``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``n``, ``stop``,
``seed``, ``presence_penalty``, ``frequency_penalty``, ``logprobs`` / ``top_logprobs``, ``user``, ``stream``,
``stream_options.include_usage``) and vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``priority``, ``cache_salt``), and ``service_tier`` as the request's priority class (``SERVICE_TIERS``). Unknown
fields are ignored, as OpenAI and vLLM do; features we do not serve
(tools, structured output, ``echo``, ``suffix``, ``best_of`` > n, images) are a 400 that says so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.v1 import common_pb2, frontend_pb2, tokenizer_pb2

Kind = Literal["chat", "completion"]
MAX_N = 128
MAX_LOGPROBS = 20
_ROLES = ("system", "developer", "user", "assistant", "tool")
_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort"}
# OpenAI's error types by status code
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
               503: "service_unavailable", 504: "timeout_error"}
# OpenAI's service_tier → the priority class (None: the tenant's default); a class's own name is accepted too.
# Responses carry the tier the request ran in (TIER_OF_CLASS).
SERVICE_TIERS: dict[str, int | None] = {
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
    service_tier: int | None = None  # the priority class asked for (None: the tenant's default)


# -- reading fields ------------------------------------------------------------------------------------------
def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    # bool is an int in Python: a JSON true is not a number here
    if isinstance(v, bool) and bool not in kinds:
        raise bad(f"{name} must be {what}, got {v!r}", name)
    if not isinstance(v, kinds):
        raise bad(f"{name} must be {what}, got {v!r}", name)
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"{name} must be a finite number, got {v!r}", name)
    return v


def _int(body: dict[str, Any], name: str, default: int | None = None, lo: int | None = None,
         hi: int | None = None) -> int | None:
    v = _field(body, name, (int, float), "an integer", default)
    if v is None:
        return None
    if isinstance(v, float):
        if not v.is_integer():
            raise bad(f"{name} must be an integer, got {v!r}", name)
        v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(f"{name} must be {rng}, got {v}", name)
    return v


def _float(body: dict[str, Any], name: str) -> float | None:
    v = _field(body, name, (int, float), "a number")
    try:
        return None if v is None else float(v)
    except OverflowError:  # an integer literal past a float's range
        raise bad(f"{name} must be a finite number, got an integer of {len(str(v))} digits", name) from None


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    return bool(_field(body, name, (bool,), "true or false", default))


def _token_ids(v: Any, name: str) -> list[int]:
    if not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad(f"{name} must be a non-empty list of integer token ids", name)
    bad_at = next((i for i, t in enumerate(v) if t < 0), None)
    if bad_at is not None:
        raise bad(f"{name}[{bad_at}] is {v[bad_at]}; token ids are >= 0", name)
    return v


def _params(body: dict[str, Any], kind: Kind) -> tuple[common_pb2.SamplingParams, bool]:
    """The sampling fields → SamplingParams (range checks are SamplingParams.validate's, at the gateway)."""
    p = common_pb2.SamplingParams()
    mt = _int(body, "max_completion_tokens", lo=1) if kind == "chat" else None
    if mt is None:
        mt = _int(body, "max_tokens", lo=1)
    if mt is None and kind == "completion":
        mt = 16  # OpenAI's (and vLLM's) default for completions; chat defaults to the rest of the context
    if mt is not None:
        p.max_tokens = mt
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = _float(body, name)
        if v is not None:
            setattr(p, name, v)
    top_k = _int(body, "top_k")
    if top_k is not None:
        p.top_k = top_k
    seed = _int(body, "seed")
    if seed is not None:
        p.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    p.stop.extend(stop or [])
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad("stop_token_ids must be a list of integer token ids", "stop_token_ids")
        p.stop_token_ids.extend(ids)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad("logit_bias must be an object mapping token ids to numbers in [-100, 100]", "logit_bias")
        for key, v in bias.items():
            try:
                tid = int(key)
            except (TypeError, ValueError):
                raise bad(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
            if isinstance(v, bool) or not isinstance(v, int | float) or not -100 <= v <= 100:
                raise bad(f"logit_bias[{key!r}] must be a number in [-100, 100], got {v!r}", "logit_bias")
            if tid < 0:
                raise bad(f"logit_bias key {key!r} is not a token id (ids are >= 0)", "logit_bias")
            p.logit_bias[tid] = float(v)
    p.ignore_eos = _bool(body, "ignore_eos")
    p.min_tokens = _int(body, "min_tokens", 0, lo=0) or 0
    p.include_stop_str_in_output = _bool(body, "include_stop_str_in_output")
    if body.get("skip_special_tokens") is not None:
        p.skip_special_tokens = _bool(body, "skip_special_tokens")
    want_logprobs = False
    if kind == "chat":
        want_logprobs = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
        if top is not None and not want_logprobs and top > 0:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        if want_logprobs:
            p.logprobs = top or 0
    else:
        lp = _int(body, "logprobs", lo=0, hi=MAX_LOGPROBS)
        if lp is not None:
            want_logprobs = True
            p.logprobs = lp
    return p, want_logprobs


def messages(body: dict[str, Any]) -> tokenizer_pb2.ChatMessages:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    chat = tokenizer_pb2.ChatMessages(add_generation_prompt=True)
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with role and content", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"{where}.role must be one of {list(_ROLES)}, got {role!r}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad(f"{where}.content[{j}] is of type {kind!r}; this model takes text parts only",
                              "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of text parts", "messages")
        chat.messages.add(role="system" if role == "developer" else role, content=content)
    return chat


def _unsupported(body: dict[str, Any], kind: Kind) -> None:
    if body.get("tools") or body.get("functions"):
        raise bad("tool calling is not supported by this server; send the request without tools", "tools")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") in (None, "text")):
        raise bad("response_format other than text is not supported by this server", "response_format")
    if kind == "completion":
        if body.get("echo"):
            raise bad("echo is not supported by this server", "echo")
        if body.get("suffix"):
            raise bad("suffix is not supported by this server", "suffix")


def parse(body: Any, kind: Kind, resolve_model: Callable[[str | None], str]) -> Parsed:
    """Validate an OpenAI request body; raise OpenAIError (400/404) with the field in ``param``.

    ``resolve_model`` maps the requested model to the served name (or raises the 404)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"model must be a string, got {model!r}", "model")
    model = resolve_model(model)
    _unsupported(body, kind)
    n = _int(body, "n", 1, lo=1, hi=MAX_N) or 1
    best_of = _int(body, "best_of", lo=1)
    if best_of is not None and best_of != n:
        raise bad(f"best_of ({best_of}) other than n ({n}) is not supported by this server", "best_of")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options must be an object", "stream_options")
        if not stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
    include_usage = bool(opts and opts.get("include_usage"))
    params, want_logprobs = _params(body, kind)
    priority = _int(body, "priority", 0) or 0
    tier = body.get("service_tier")
    if tier is not None and (not isinstance(tier, str) or tier not in SERVICE_TIERS):
        raise bad(f"service_tier must be one of {list(SERVICE_TIERS)}, got {tier!r}", "service_tier")
    salt = body.get("cache_salt") or ""
    if not isinstance(salt, str):
        raise bad("cache_salt must be a string", "cache_salt")
    inputs: list[dict[str, Any]]
    if kind == "chat":
        inputs = [{"chat": messages(body)}]
    else:
        inputs = _prompts(body.get("prompt"))
    reqs = []
    for inp in inputs:
        for j in range(n):
            r = frontend_pb2.GenerateRequest(model=model, params=params, priority=priority, cache_salt=salt)
            if "chat" in inp:
                r.chat.CopyFrom(inp["chat"])
            elif "ids" in inp:
                r.prompt_token_ids.ids.extend(inp["ids"])
            else:
                r.prompt = inp["text"]
            if n > 1 and params.HasField("seed"):
                r.params.seed = params.seed + j  # n different samples, each reproducible
            reqs.append(r)
    return Parsed(kind, model, reqs, n, len(inputs), stream, include_usage, want_logprobs,
                  SERVICE_TIERS[tier] if tier is not None else None)


def _prompts(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt is empty; send at least one character", "prompt")
        return [{"text": prompt}]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            if any(not p for p in prompt):
                raise bad("prompt contains an empty string", "prompt")
            return [{"text": p} for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [{"ids": _token_ids(prompt, "prompt")}]
        if all(isinstance(p, list) for p in prompt):
            return [{"ids": _token_ids(p, f"prompt[{i}]")} for i, p in enumerate(prompt)]
    raise bad("prompt must be a string, a list of strings, a list of token ids or a list of such lists",
              "prompt")


# -- responses -----------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Choice:
    """What one choice accumulated (non-streaming) or the usage it reported (streaming)."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
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
            if self.p.kind == "chat":
                item: dict[str, Any] = {"index": c.index, "message": {"role": "assistant", "content": text},
                                        "logprobs": self.fmt.chat(c.logprobs) if self.p.logprobs else None}
            else:
                item = {"index": c.index, "text": text,
                        "logprobs": self.fmt.completion(c.logprobs) if self.p.logprobs else None}
            item["finish_reason"] = c.finish_reason
            items.append(item)
        out["choices"] = items
        out["usage"] = usage(choices, self.p.n)
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
        out["choices"] = [item]
        if self.p.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        out = self._head("chat.completion.chunk" if self.p.kind == "chat" else "text_completion")
        out["choices"] = []
        out["usage"] = usage(choices, self.p.n)
        return out
