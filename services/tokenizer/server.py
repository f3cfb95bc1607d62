"""The Tokenizer service: ``Tokenize`` (text, or chat messages through the model's chat template) and
``Detokenize``. Loads only the tokenizer, never the weights. Encodes in token-aware batches (``batcher.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from tokenmill.v1 import tokenizer_pb2, tokenizer_pb2_grpc

from common import rpc, telemetry
from common.cluster_config import ServiceConfig
from common.loader import load_tokenizer
from common.sequence import PriorityClass
from common.tokenizer import TextTokenizer
from common.wire import priority_class_from_proto
from services.tokenizer.batcher import BatchStats, EncodeBatcher

log = logging.getLogger(__name__)

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class TokenizerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("tokenmill:tokenizer_requests", "Tokenizer RPCs by method and status code",
                                ["method", "code"], registry=registry)
        self.latency = Histogram("tokenmill:tokenizer_request_latency_seconds", "Tokenizer RPC latency",
                                 ["method"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.batch_requests = Histogram("tokenmill:tokenizer_batch_size_requests", "Requests per encoded batch",
                                        buckets=_SIZE_BUCKETS, registry=registry)
        self.batch_seconds = Histogram("tokenmill:tokenizer_batch_encode_seconds", "Time to encode one batch",
                                       buckets=_LATENCY_BUCKETS, registry=registry)
        self.tokens = Counter("tokenmill:tokenizer_tokens", "Token ids produced by Tokenize", registry=registry)

    def on_batch(self, s: BatchStats) -> None:
        self.batch_requests.observe(s.requests)
        self.batch_seconds.observe(s.seconds)


def chat_messages(chat: tokenizer_pb2.ChatMessages) -> list[dict[str, Any]]:
    """Proto chat messages → the dicts the chat template expects (``name``, ``tool_calls`` and ``tool_call_id``
    only when set; a call's arguments as an object where they are JSON, as Hugging Face templates take them)."""
    out = []
    for m in chat.messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            d["name"] = m.name
        if m.tool_calls_json:
            d["tool_calls"] = [_template_call(c) for c in _json_list(m.tool_calls_json, "tool_calls_json")]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def chat_tools(chat: tokenizer_pb2.ChatMessages) -> list[dict[str, Any]] | None:
    return _json_list(chat.tools_json, "tools_json") if chat.tools_json else None


def _json_list(text: str, what: str) -> list[Any]:
    try:
        v = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(v, list):
        raise ValueError(f"{what} must be a JSON list")
    return v


def _template_call(c: Any) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict):
        raise ValueError("a tool call must be {id, type: function, function: {name, arguments}}")
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):  # not JSON: the template gets the text as it came
            args = json.loads(args)
    return {**c, "function": {**fn, "arguments": args}}


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Thin: validate, render, hand the text to the batcher; errors become INVALID_ARGUMENT."""

    def __init__(self, app: TokenizerService) -> None:
        self.app = app

    @rpc.translate_errors
    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
                       ) -> tokenizer_pb2.TokenizeResponse:
        with self.app.observe("Tokenize"), telemetry.span("tokenize", telemetry.SERVER) as span:
            ids = await self.app.tokenize(request)
            span.set_attribute("tokens", len(ids))
        return tokenizer_pb2.TokenizeResponse(token_ids=ids)

    @rpc.translate_errors
    async def Detokenize(self, request: tokenizer_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
                         ) -> tokenizer_pb2.DetokenizeResponse:
        with self.app.observe("Detokenize"):
            text = await self.app.detokenize(list(request.token_ids), request.skip_special_tokens)
        return tokenizer_pb2.DetokenizeResponse(text=text)


class _Observe:
    """Counts and times one RPC; ``__exit__`` records the status code (translation happens in ``rpc``)."""

    def __init__(self, m: TokenizerMetrics, method: str) -> None:
        self.m, self.method, self.t0 = m, method, time.perf_counter()

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        code = "OK" if e is None else rpc.status_for(e)[0].name
        if isinstance(e, asyncio.CancelledError):
            code = "CANCELLED"
        self.m.requests.labels(self.method, code).inc()
        self.m.latency.labels(self.method).observe(time.perf_counter() - self.t0)


class TokenizerService:
    """The ``rpc.ServiceApp`` for the tokenizer pool."""

    role = "tokenizer"

    def __init__(self, cfg: ServiceConfig, tokenizer: TextTokenizer | None = None) -> None:
        self.cfg = cfg
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = TokenizerMetrics(self.registry)
        self.tok = tokenizer
        self._batcher: EncodeBatcher | None = None

    def register(self, server: grpc.aio.Server) -> list[str]:
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(TokenizerServicer(self), server)
        return [tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name]

    async def start(self) -> None:
        if self.tok is None:
            c = self.cfg.cluster
            self.tok = await asyncio.to_thread(load_tokenizer, c.tokenizer_spec or c.model)
        tok = self.tok
        tcfg = self.cfg.cluster.tokenizer
        self._batcher = EncodeBatcher(
            lambda texts, special: tok.encode_batch(texts, add_special_tokens=special),
            tcfg.batch_max_tokens, {k: tcfg.window_s(k.name.lower()) for k in PriorityClass}, self.metrics.on_batch,
        )
        await self._batcher.encode("warm up the tokenizer", True)

    async def stop(self) -> None:
        if self._batcher is not None:
            await self._batcher.close()

    def observe(self, method: str) -> _Observe:
        return _Observe(self.metrics, method)

    async def tokenize(self, req: tokenizer_pb2.TokenizeRequest) -> list[int]:
        """Raises ValueError (→ INVALID_ARGUMENT) for a missing input or messages the template refuses."""
        assert self.tok is not None and self._batcher is not None, "tokenize before start()"
        which = req.WhichOneof("input")
        if which == "chat":
            text = self.tok.apply_chat_template(chat_messages(req.chat), req.chat.add_generation_prompt,
                                                tools=chat_tools(req.chat),
                                                tool_format=self.cfg.cluster.gateway.tool_parser)
            special = False  # the template writes its own special tokens
        elif which == "text":
            text, special = req.text, req.add_special_tokens
        else:
            raise ValueError("TokenizeRequest needs 'text' or 'chat'")
        ids = await self._batcher.encode(text, special, priority_class_from_proto(req.meta.priority_class))
        self.metrics.tokens.inc(len(ids))
        return ids

    async def detokenize(self, ids: list[int], skip_special_tokens: bool) -> str:
        assert self.tok is not None
        vocab = self.tok.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) > 4096:  # long texts off the loop
            return await asyncio.to_thread(self.tok.decode, ids, skip_special_tokens)
        return self.tok.decode(ids, skip_special_tokens)


def serve(cfg: ServiceConfig) -> int:
    """``tokenmill serve tokenizer``."""
    return rpc.run(TokenizerService(cfg), cfg)
