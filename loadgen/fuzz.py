"""Bad input for the two front doors: hypothesis strategies of OpenAI request bodies (``/v1/completions``,
``/v1/chat/completions``) and of ``tokenmill.v1.Frontend/Generate`` requests (messages and raw bytes), the calls
that send one case, and the properties every answer must keep. One copy of the generators, used by
``tests/services/test_fuzz_inputs.py`` and by ``tokenmill bench fuzz`` (``loadgen/bench_fuzz.py``).

The properties: HTTP never answers 5xx (the cluster is ready, so not even 503) and every error body is OpenAI's
``{"error": {"message", "type", ...}}``; a stream ends with ``[DONE]`` or an error event below 500; gRPC ends only
with a code in ``GRPC_ALLOWED``. Every case that could be served asks for at most 8 tokens, so it stays short.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

import grpc
from hypothesis import strategies as st
from tokenmill.v1 import common_pb2, frontend_pb2, tokenizer_pb2

GENERATE = "/tokenmill.v1.Frontend/Generate"
MAX_TOKENS = 8  # the most any servable case asks for
ROLES = ("system", "developer", "user", "assistant", "tool")

# The codes a bad request may end with: those the HTTP API maps to a 4xx (services/gateway/http.py's _HTTP_STATUS),
# i.e. the client's fault. common/rpc.status_for gives INVALID_ARGUMENT (ValueError: validation, the engine's
# RequestError, a chat template that refuses), RESOURCE_EXHAUSTED (limits; also gRPC's message size), NOT_FOUND
# (unknown model or lease); OUT_OF_RANGE, FAILED_PRECONDITION, UNAUTHENTICATED and PERMISSION_DENIED are 4xx
# there too. Not allowed: INTERNAL and UNKNOWN (an exception nobody translated: a bug), DATA_LOSS, UNIMPLEMENTED,
# UNAVAILABLE and DEADLINE_EXCEEDED (503/504 on HTTP: on a ready cluster, a dead or hung worker), and CANCELLED
# or ABORTED (the fuzzer never cancels, so the server did).
GRPC_ALLOWED = frozenset({
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
})


@dataclass(frozen=True, slots=True)
class HttpCase:
    """One POST: the path and the raw body; ``what`` names the generator that made it."""

    path: str
    body: bytes
    what: str


@dataclass(frozen=True, slots=True)
class GrpcCase:
    """One ``Generate`` call with ``body`` as the serialized request, parsable or not."""

    body: bytes
    what: str


Case = HttpCase | GrpcCase


@dataclass(frozen=True, slots=True)
class Outcome:
    """The answer to one case: ``status`` is the HTTP code or the gRPC code's name, ``message`` the error's;
    ``violation`` says which property it broke (None: none)."""

    door: Literal["http", "grpc"]
    status: str
    violation: str | None = None
    message: str = ""


# -- JSON values ---------------------------------------------------------------------------------------------
_EDGE_INTS = (0, -1, 1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 2**64, 10**30, 10**400)
_EDGE_STRINGS = ("", "NaN", "nan", "inf", "-inf", "Infinity", "1e400", "-0", "0x10", "null", "true", " 1 ",
                 "\x00", "\ud800", "\udfff", "é", "🙂", "\u202e", "a" * 300)
_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(_EDGE_INTS), st.floats(),
                     st.sampled_from(_EDGE_STRINGS), st.text(max_size=16))
junk = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                        max_size=4),
                    max_leaves=12)
"""Any JSON value (NaN and infinities too: Python writes and reads them), with the numbers and strings parsers
get wrong."""
_not_number = junk.filter(lambda v: v is not None and (isinstance(v, bool) or not isinstance(v, int | float)))


def _weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of ``choices``, each as often as its weight (shrinks towards the first)."""
    pool = [s for w, s in choices for _ in range(w)]
    return st.integers(0, len(pool) - 1).flatmap(lambda i: pool[i])


def _fractional(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi).filter(lambda x: not x.is_integer())


def _out_of(lo: float, hi: float) -> st.SearchStrategy[Any]:
    """Numbers outside [lo, hi], non-finite and huge numbers, and anything that is not a number."""
    return st.one_of(st.floats(max_value=lo, exclude_max=True), st.floats(min_value=hi, exclude_min=True),
                     st.sampled_from([math.nan, math.inf, -math.inf, 10**400, -(10**400)]), _not_number)


Field = tuple[st.SearchStrategy[Any] | None, st.SearchStrategy[Any]]
"""A field's valid values (None: valid only when absent) and its wrong ones."""
_ABSENT = object()  # a "wrong value" that removes a required field


def _wrong_fields(names: list[str]) -> st.SearchStrategy[frozenset[str]]:
    """Which fields of a case get a wrong value: none (two cases in five), one (two in five) or several."""
    names = sorted(names)
    return st.integers(0, 4).flatmap(
        lambda m: st.just(frozenset()) if m < 2 else st.sampled_from(names).map(lambda n: frozenset({n}))
        if m < 4 else st.frozensets(st.sampled_from(names), min_size=2))


# -- text and token ids ------------------------------------------------------------------------------------
def _repeated(lo: int, hi: int) -> st.SearchStrategy[str]:
    """A word repeated ``lo..hi`` times: at least as many tokens, so ``lo`` > the context is over it."""
    return st.builds(lambda w, k: (w + " ") * k, st.sampled_from(["hello", "The cat sat", "1 2 3", "日本語", "🙂"]),
                     st.integers(lo, hi))


def _texts(max_len: int) -> st.SearchStrategy[str]:
    """Short text mostly; some long enough for the remote-prefill path; a few over the context."""
    return _weighted((4, st.text(min_size=1, max_size=40)), (2, _repeated(40, max_len // 2)),
                     (1, _repeated(max_len + 1, 2 * max_len)))


_in_vocab = st.integers(0, 999)
_any_id = st.one_of(_in_vocab, st.integers(0, 2**31 - 1), st.integers(min_value=1_000_000),
                    st.sampled_from([-1, -(2**31), 2**31 - 1, 2**31, 2**63]))


def _ids(max_len: int, tok: st.SearchStrategy[int]) -> st.SearchStrategy[list[int]]:
    """A pattern of ``tok`` repeated to a length: short, past the prefill threshold, or at and over the context."""
    length = _weighted((3, st.integers(1, 40)), (2, st.integers(1, max_len - MAX_TOKENS - 1)),
                       (1, st.integers(max_len - MAX_TOKENS - 2, max_len + 40)))
    return st.builds(lambda pat, n: (pat * (n // len(pat) + 1))[:n], st.lists(tok, min_size=1, max_size=6), length)


# -- OpenAI bodies -----------------------------------------------------------------------------------------
def _bad_max_tokens(max_len: int) -> st.SearchStrategy[Any]:
    """Never None (absent: a chat request would generate to the end of the context), never a large valid count."""
    return st.one_of(st.integers(max_value=0), st.integers(min_value=max_len + 1), _fractional(-5, 5),
                     st.sampled_from([10**400, math.nan]), _not_number)


def _messages(max_len: int) -> Field:
    parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}), min_size=1,
                     max_size=3)
    good_msg = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": st.one_of(_texts(max_len), parts)})
    bad_msg = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(ROLES), junk)}, optional={
        "content": st.one_of(junk, st.just([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])),
        "name": junk})
    return (st.lists(good_msg, min_size=1, max_size=3),
            st.one_of(junk, st.just([]), st.just(_ABSENT), st.lists(st.one_of(good_msg, bad_msg), min_size=1,
                                                                      max_size=3)))


def _prompt(max_len: int) -> Field:
    good = _weighted((3, _texts(max_len)), (1, st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3)),
                     (2, _ids(max_len, _in_vocab)), (1, st.lists(_ids(40, _in_vocab), min_size=1, max_size=2)))
    bad = st.one_of(junk, st.sampled_from(["", [], [""], [[]], [1, "a"], [True], [[1], 2], _ABSENT]),
                    _ids(max_len, _any_id))
    return good, bad


def _openai_fields(kind: Literal["chat", "completion"], max_len: int) -> dict[str, Field]:
    bad_count = st.one_of(st.integers(max_value=-1), st.sampled_from(_EDGE_INTS), _not_number)
    not_bool = junk.filter(lambda v: not isinstance(v, bool))
    fields: dict[str, Field] = {
        "max_tokens": (st.integers(1, MAX_TOKENS), _bad_max_tokens(max_len)),
        "model": (st.sampled_from(["smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"]), junk),
        "n": (st.integers(1, 3), st.one_of(st.integers(max_value=0), st.integers(min_value=129), _not_number)),
        "stream": (st.booleans(), not_bool),
        "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
        "priority": (st.integers(0, 10), bad_count),
        "cache_salt": (st.text(max_size=8), junk), "user": (st.text(max_size=8), junk),
        "response_format": (st.just({"type": "text"}), st.one_of(junk, st.just({"type": "json_object"}))),
        "tools": (None, junk),
        "temperature": (st.floats(0, 2), _out_of(0, 100)),
        "top_p": (st.floats(0.01, 1), _out_of(1e-9, 1)),
        "top_k": (st.integers(-1, 50), st.one_of(st.integers(max_value=-2), st.sampled_from(_EDGE_INTS),
                                                  _not_number)),
        "min_p": (st.floats(0, 1), _out_of(0, 1)),
        "presence_penalty": (st.floats(-2, 2), _out_of(-2, 2)),
        "frequency_penalty": (st.floats(-2, 2), _out_of(-2, 2)),
        "repetition_penalty": (st.floats(0.01, 2), _out_of(1e-9, 2)),
        "seed": (st.integers(-(2**63), 2**63 - 1), st.one_of(st.sampled_from(_EDGE_INTS), _not_number)),
        "stop": (st.one_of(st.text(min_size=1, max_size=6), st.lists(st.text(min_size=1, max_size=6), min_size=1,
                                                                     max_size=4)),
                 st.one_of(junk, st.sampled_from(["", [""]]), st.lists(st.just("x"), min_size=17, max_size=20))),
        "stop_token_ids": (st.lists(_in_vocab, max_size=3), st.one_of(junk, st.lists(_any_id, max_size=3))),
        "logit_bias": (st.dictionaries(_in_vocab.map(str), st.floats(-100, 100), max_size=3),
                       st.one_of(junk, st.dictionaries(st.one_of(st.text(max_size=6), _any_id.map(str)), junk,
                                                       max_size=3))),
        "ignore_eos": (st.booleans(), not_bool), "min_tokens": (st.integers(0, 1), _out_of(0, 2**40)),
        "include_stop_str_in_output": (st.booleans(), not_bool), "skip_special_tokens": (st.booleans(), not_bool),
    }
    if kind == "chat":
        fields.update(messages=_messages(max_len), logprobs=(st.booleans(), not_bool),
                      max_completion_tokens=(st.integers(1, MAX_TOKENS), _bad_max_tokens(max_len)),
                      top_logprobs=(st.integers(0, 20), _out_of(0, 20)))
    else:
        fields.update(prompt=_prompt(max_len), logprobs=(st.integers(0, 5), _out_of(0, 20)),
                      echo=(st.just(False), junk), suffix=(st.just(""), junk), best_of=(None, junk))
    return fields


@st.composite
def openai_body(draw: st.DrawFn, kind: Literal["chat", "completion"], max_len: int) -> dict[str, Any]:
    """A request body for ``/v1/chat/completions`` or ``/v1/completions``: valid, or with one or several fields
    wrong (type, range, NaN, huge, absent), plus unknown fields."""
    fields = _openai_fields(kind, max_len)
    wrong = draw(_wrong_fields(list(fields)))
    required = ("messages" if kind == "chat" else "prompt", "max_tokens")
    body: dict[str, Any] = draw(st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: k not in fields),
                                                junk, max_size=2))
    for name, (good, bad) in fields.items():
        if name in wrong:
            body[name] = draw(bad)
        elif good is not None and (name in required or draw(st.booleans())):
            body[name] = draw(good)
    for needs, then in (("stream_options", "stream"), ("top_logprobs", "logprobs")):  # valid only together
        if needs in body and not {needs, then} & wrong:
            body[then] = True
    return {k: v for k, v in body.items() if v is not _ABSENT}


def _corrupt(raw: bytes, at: int, how: int) -> bytes:
    at %= max(1, len(raw))
    if how == 0:
        return raw[:at]  # truncated
    if how == 1:
        return raw[:at] + b"\xff\xfe" + raw[at:]  # invalid UTF-8
    return raw[:at] + bytes([raw[at] ^ 0x55]) + raw[at + 1:] if raw else raw


_NUMBERS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "seed", "n", "priority", "logprobs", "top_logprobs", "min_tokens")


def http_cases(max_len: int, max_body_bytes: int = 4 << 20) -> st.SearchStrategy[HttpCase]:
    """OpenAI bodies (half), and malformed ones: corrupted bodies, deep nesting, huge number literals, invalid
    UTF-8 inside strings, raw bytes, JSON that is not an object, empty and oversized bodies."""
    paths = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
    kind: st.SearchStrategy[Literal["chat", "completion"]] = st.sampled_from(["chat", "completion"])
    bodies = kind.flatmap(lambda k: st.builds(
        lambda b: HttpCase(paths[k], json.dumps(b).encode(), f"{k} body"), openai_body(k, max_len)))
    either = kind.map(lambda k: paths[k])
    corrupted = st.builds(lambda c, at, how: HttpCase(c.path, _corrupt(c.body, at, how), "corrupted body"),
                          bodies, st.integers(0, 10**6), st.integers(0, 2))
    deep = st.builds(lambda p, d, o: HttpCase(p, (o * d + b"1" + (b"]" if o == b"[" else b"}") * d),
                                              f"nested {o.decode()} deep"),
                     either, st.integers(1, 20_000), st.sampled_from([b"[", b'{"a":']))
    huge_number = st.builds(lambda p, f, k: HttpCase(p, b'{"prompt":"hi","messages":[{"role":"user","content":"hi"}],'
                                                        b'"max_tokens":2,"' + f.encode() + b'":' + b"9" * k + b"}",
                                                     f"huge number literal ({f})"),
                            either, st.sampled_from(_NUMBERS), st.integers(len(str(max_len)) + 1, 5000))
    bad_utf8 = st.builds(lambda p, s: HttpCase(p, b'{"prompt":"' + s + b'","messages":[{"role":"user","content":"'
                                                  + s + b'"}],"max_tokens":2}', "invalid UTF-8 in a string"),
                         either, st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"]))
    raw = st.builds(lambda p, b: HttpCase(p, b, "raw bytes"), either, st.binary(max_size=300))
    non_object = st.builds(lambda p, v: HttpCase(p, json.dumps(v).encode(), "JSON not an object"), either, junk)
    oversized = either.map(lambda p: HttpCase(p, b'{"prompt":"' + b"x" * max_body_bytes + b'"}', "over the body limit"))
    empty = either.map(lambda p: HttpCase(p, b"", "empty body"))
    malformed = st.one_of(corrupted, deep, huge_number, bad_utf8, raw, non_object, empty, oversized)
    return st.booleans().flatmap(lambda b: malformed if b else bodies)


# -- gRPC requests -----------------------------------------------------------------------------------------
_i32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, -1, 1, 2**31 - 1, -(2**31)]))
_f32 = st.floats(width=32)
_ptext = st.one_of(st.just(""), st.text(max_size=30), st.sampled_from(["\x00", "x" * 100_000]))


_REQUEST_FIELDS = ("request_id", "model", "priority", "cache_salt")


def _proto_fields(max_len: int) -> dict[str, Field]:
    chat = st.builds(tokenizer_pb2.ChatMessages, messages=st.lists(st.builds(
        tokenizer_pb2.ChatMessage, role=st.sampled_from(ROLES), content=_texts(max_len)), min_size=1, max_size=3))
    bad_chat = st.builds(tokenizer_pb2.ChatMessages, messages=st.lists(st.builds(
        tokenizer_pb2.ChatMessage, role=st.one_of(st.sampled_from(ROLES), _ptext), content=_ptext, name=_ptext),
        max_size=3), add_generation_prompt=st.booleans())
    good_input = _weighted((2, st.tuples(st.just("prompt"), _texts(max_len))), (2, st.tuples(st.just("chat"), chat)),
                           (2, st.tuples(st.just("ids"), _ids(max_len, _in_vocab))))
    bad_input = st.one_of(st.tuples(st.just("prompt"), _ptext), st.tuples(st.just("chat"), bad_chat),
                          st.tuples(st.just("ids"), st.one_of(st.just([]), _ids(max_len, _i32))), st.just(("none", None)))
    floats = {name: (st.floats(lo, hi), _f32) for name, lo, hi in (
        ("temperature", 0, 2), ("top_p", 0.01, 1), ("min_p", 0, 1), ("presence_penalty", -2, 2),
        ("frequency_penalty", -2, 2), ("repetition_penalty", 0.01, 2))}
    return {
        "input": (good_input, bad_input),
        "max_tokens": (st.integers(1, MAX_TOKENS), st.one_of(st.integers(-(2**31), 0),
                                                             st.integers(max_len + 1, 2**31 - 1))),
        "request_id": (st.text(max_size=12), _ptext), "model": (st.just(""), _ptext),
        "priority": (st.integers(0, 10), _i32), "cache_salt": (st.text(max_size=8), _ptext),
        **floats,
        "top_k": (st.integers(-1, 50), _i32), "seed": (st.integers(-(2**63), 2**63 - 1), st.sampled_from(
            [0, -1, 2**63 - 1, -(2**63)])),
        "logprobs": (st.integers(0, 5), _i32), "min_tokens": (st.integers(0, 1), _i32),
        "skip_special_tokens": (st.booleans(), st.booleans()), "ignore_eos": (st.booleans(), st.booleans()),
        "include_stop_str_in_output": (st.booleans(), st.booleans()),
        "stop": (st.lists(st.text(min_size=1, max_size=6), max_size=3), st.lists(_ptext, max_size=20)),
        "stop_token_ids": (st.lists(_in_vocab, max_size=3), st.lists(_i32, min_size=1, max_size=3)),
        "logit_bias": (st.dictionaries(_in_vocab, st.floats(-100, 100), max_size=3),
                       st.dictionaries(_i32, _f32, min_size=1, max_size=3)),
    }


def _assign(r: frontend_pb2.GenerateRequest, name: str, value: Any) -> None:
    p = r.params
    if name == "input":
        kind, v = value
        if kind == "prompt":
            r.prompt = v
        elif kind == "chat":
            r.chat.SetInParent()  # set even when empty
            r.chat.MergeFrom(v)
        elif kind == "ids":
            r.prompt_token_ids.SetInParent()
            r.prompt_token_ids.ids.extend(v)
    elif name in _REQUEST_FIELDS:
        setattr(r, name, value)
    elif name in ("stop", "stop_token_ids"):
        getattr(p, name).extend(value)
    elif name == "logit_bias":
        for tid, bias in value.items():
            p.logit_bias[tid] = bias
    else:
        setattr(p, name, value)


@st.composite
def generate_request(draw: st.DrawFn, max_len: int) -> frontend_pb2.GenerateRequest:
    """A ``GenerateRequest``, valid or with fields wrong by any value their types allow: empty and huge strings,
    out-of-vocabulary and negative ids, int32 edges, NaN and infinite floats, no input. max_tokens is always
    set (unset means the rest of the context)."""
    fields = _proto_fields(max_len)
    wrong = draw(_wrong_fields(list(fields)))
    r = frontend_pb2.GenerateRequest()
    for name, (good, bad) in fields.items():
        if name in wrong:
            _assign(r, name, draw(bad))
        elif good is not None and (name in ("input", "max_tokens") or draw(st.booleans())):
            _assign(r, name, draw(good))
    return r


# Appended to raw bytes: a request those bytes happen to parse into asks for 4 tokens, not the whole context.
_CAP = frontend_pb2.GenerateRequest(params=common_pb2.SamplingParams(max_tokens=4)).SerializeToString()


def grpc_cases(max_len: int) -> st.SearchStrategy[GrpcCase]:
    """Serialized ``GenerateRequest``s (half), and raw bytes as the request: random, or a request with a byte
    flipped, invalid UTF-8 inserted, or cut short."""
    messages = generate_request(max_len).map(lambda r: GrpcCase(r.SerializeToString(), "GenerateRequest"))
    raw = st.binary(max_size=300).map(lambda b: GrpcCase(b + _CAP, "raw bytes"))
    mangled = st.builds(lambda c, at, how: GrpcCase(_corrupt(c.body, at, how) + _CAP, "mangled GenerateRequest"),
                        messages, st.integers(0, 10**6), st.integers(0, 2))
    return st.booleans().flatmap(lambda b: st.one_of(raw, mangled) if b else messages)


def cases(max_len: int, max_body_bytes: int = 4 << 20) -> st.SearchStrategy[Case]:
    """Both front doors, about half each."""
    return st.one_of(http_cases(max_len, max_body_bytes), grpc_cases(max_len))


# -- sending, and the properties ---------------------------------------------------------------------------
def _error_shape(body: Any) -> str | None:
    """Why ``body`` is not OpenAI's error object (None: it is)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return "no error object"
    if not isinstance(err.get("message"), str) or not err["message"]:
        return "error without a message"
    if not isinstance(err.get("type"), str):
        return "error without a type"
    return None


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace")


def _check_stream(raw: bytes) -> str | None:
    """Why an SSE body breaks the properties: an event that is not JSON, an error event of 500 or more, or an end
    without ``[DONE]`` or an error."""
    last = None
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return None
        try:
            last = json.loads(data)
        except ValueError:
            return f"stream event is not JSON: {data[:100]!r}"
        if isinstance(last, dict) and "error" in last:
            why = _error_shape(last)
            code = last["error"].get("code") if isinstance(last["error"], dict) else None
            if why is None and isinstance(code, int) and code >= 500:
                why = f"error event {code} in the stream: {last['error']['message'][:200]}"
            return why
    return "stream ended without [DONE]"


async def send_http(session: Any, base_url: str, case: HttpCase, timeout_s: float = 120) -> Outcome:
    """POST ``case``; the answer's status and the property it broke, if any. ``session``: an aiohttp
    ClientSession."""
    import aiohttp

    try:
        async with session.post(base_url + case.path, data=case.body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            raw = await r.read()
            status, ctype = r.status, r.headers.get("Content-Type", "")
    except TimeoutError:
        return Outcome("http", "timeout", f"no answer in {timeout_s:.0f} s")
    except aiohttp.ClientError as e:
        return Outcome("http", "no answer", f"{type(e).__name__}: {e}")
    why = None
    if status >= 500:
        why = f"HTTP {status}: {raw[:300]!r}"
    elif status == 200 and ctype.startswith("text/event-stream"):
        why = _check_stream(raw)
    else:
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if status >= 400:
            why = _error_shape(body)
        elif not (isinstance(body, dict) and isinstance(body.get("choices"), list)):
            why = "a 200 without choices"
        if why is not None:
            why = f"HTTP {status}, {why}: {raw[:300]!r}"
    return Outcome("http", str(status), why, _message(raw) if status >= 400 else "")


async def send_grpc(channel: grpc.aio.Channel, case: GrpcCase, timeout_s: float = 120) -> Outcome:
    """Call ``Generate`` with ``case.body`` as the serialized request, read the stream to its end."""
    call = channel.unary_stream(GENERATE, request_serializer=lambda b: b,
                                response_deserializer=frontend_pb2.GenerateResponse.FromString)
    try:
        async for _ in call(case.body, timeout=timeout_s):
            pass
        code, details = grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        code, details = e.code(), e.details() or ""
    why = None if code in GRPC_ALLOWED else f"{code.name}: {details[:300]}"
    return Outcome("grpc", code.name, why, details)


def describe(case: Case) -> str:
    """A case in one line, for a violation's report."""
    door = f"HTTP {case.path}" if isinstance(case, HttpCase) else "gRPC Generate"
    body = case.body if len(case.body) <= 300 else case.body[:300] + b"...(%d bytes)" % len(case.body)
    return f"{door} [{case.what}] {body!r}"
