"""The targets a benchmark drives: the gRPC ``tokenmill.v1.Frontend/Generate`` stream and the OpenAI HTTP API
(``/v1/chat/completions``, ``/v1/completions``) with SSE streaming, as any OpenAI-compatible server (vLLM's
included) speaks it. Each ``send`` fills one ``RequestRecord`` and never raises for a failed request: the failure is
the record's outcome.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict, cast

import aiohttp

from loadgen.metrics import CANCELLED, OK, RequestRecord
from loadgen.workloads import RequestSpec, structured_output_valid

BACKENDS = ("grpc", "openai", "openai-chat")


class SamplingFields(TypedDict, total=False):
    """SendOptions' sampling fields that are set (``SendOptions.sampling()``): the same names in the tokenmill.v1
    proto and the OpenAI API (with vLLM's extras), with the types both take."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float


SAMPLING_FIELDS = tuple(SamplingFields.__annotations__)


@dataclass(frozen=True)
class SendOptions:
    """Per-request options common to every target."""

    ignore_eos: bool = False
    temperature: float | None = None  # the sampling fields: None = not sent (the server's default)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    timeout: float | None = None  # seconds; a request past it is cancelled (outcome "cancelled", kind "timeout")
    api_key: str | None = None  # the default key; a tenant's own key wins
    cache_salt: str | None = None  # scopes the server's prefix cache: runs with different salts share no blocks

    def sampling(self) -> SamplingFields:
        """The sampling fields that are set, by their request names (the same on every target)."""
        # the keys are SamplingFields' own and the values this dataclass's fields of the same types
        return cast(SamplingFields, {k: v for k in SAMPLING_FIELDS if (v := getattr(self, k)) is not None})


class Target(Protocol):
    """A serving endpoint. ``open`` before the first ``send``, ``close`` after the last."""

    name: str
    opts: SendOptions

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    def clone(self) -> Target:
        """The same target, not opened (to send from another process)."""
        ...

    async def send(self, spec: RequestSpec, rec: RequestRecord, t0: float) -> None:
        """Send ``spec``; fill ``rec`` (start relative to ``t0``, chunk times, usage, outcome). Never raises for a
        failed request; re-raises CancelledError after recording ``cancelled``."""
        ...


def _key(spec: RequestSpec, opts: SendOptions) -> str | None:
    return (spec.tenant.api_key if spec.tenant and spec.tenant.api_key else None) or opts.api_key


def _check_structured(spec: RequestSpec, rec: RequestRecord) -> None:
    """A constrained request's output checked against its constraint, once the stream has ended."""
    if spec.structured is not None and rec.outcome == OK and rec.text is not None:
        rec.structured_valid = structured_output_valid(spec.structured, rec.text)


async def _timed(coro: Any, rec: RequestRecord, timeout: float | None) -> None:
    try:
        await asyncio.wait_for(coro, timeout) if timeout else await coro
    except TimeoutError:
        rec.outcome, rec.error_kind, rec.error = CANCELLED, "timeout", f"no end after {timeout} s"
    except asyncio.CancelledError:
        rec.outcome, rec.error_kind = CANCELLED, CANCELLED
        raise


class GrpcTarget:
    """``tokenmill.v1.Frontend/Generate``: prompt token ids (exact input length), the tenant as ``x-tenant-id``
    metadata, its priority and class as ``GenerateRequest.priority`` and ``priority_class``, the API key as ``authorization: Bearer``."""

    name = "grpc"

    def __init__(self, address: str, model: str | None, opts: SendOptions, channels: int = 8) -> None:
        self.address, self.model, self.opts, self.n_channels = address, model, opts, channels
        self._stubs: list[Any] = []
        self._channels: list[Any] = []
        self._next = 0

    async def open(self) -> None:
        import grpc
        from tokenmill.v1 import frontend_pb2_grpc

        # several channels (HTTP/2 connections): one connection's flow control caps what hundreds of streams get,
        # and gateways that share a port (SO_REUSEPORT) are given connections, not requests, by the kernel
        for i in range(self.n_channels):
            ch = grpc.aio.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1),
                                                                  ("tokenmill.loadgen.channel", i)])
            self._channels.append(ch)
            self._stubs.append(frontend_pb2_grpc.FrontendStub(ch))

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    def clone(self) -> GrpcTarget:
        return GrpcTarget(self.address, self.model, self.opts, self.n_channels)

    def request(self, spec: RequestSpec) -> Any:
        from tokenmill.v1 import common_pb2, frontend_pb2

        params = common_pb2.SamplingParams(max_tokens=spec.output_len, ignore_eos=self.opts.ignore_eos,
                                           **self.opts.sampling())
        if spec.structured is not None:
            c = spec.structured
            params.structured.CopyFrom(common_pb2.StructuredOutput(json_schema=json.dumps(c["schema"]))
                                       if c["type"] == "json_schema" else
                                       common_pb2.StructuredOutput(json_object=True))
        klass = spec.tenant.priority_class if spec.tenant else None
        return frontend_pb2.GenerateRequest(
            model=self.model or "", prompt_token_ids=frontend_pb2.TokenIds(ids=spec.prompt_ids), params=params,
            priority=spec.tenant.priority if spec.tenant else 0, cache_salt=self.opts.cache_salt or "",
            priority_class=f"PRIORITY_CLASS_{klass.upper()}" if klass else "PRIORITY_CLASS_UNSPECIFIED")

    async def send(self, spec: RequestSpec, rec: RequestRecord, t0: float) -> None:
        import grpc

        md = []
        if spec.tenant:
            md.append(("x-tenant-id", spec.tenant.name))
        if key := _key(spec, self.opts):
            md.append(("authorization", f"Bearer {key}"))
        stub = self._stubs[self._next % len(self._stubs)]
        self._next += 1
        req = self.request(spec)
        req.request_id = rec.request_id = f"lg-{uuid.uuid4().hex}"  # the server's spans carry it

        async def stream() -> None:
            call = stub.Generate(req, metadata=md or None)
            try:
                async for r in call:
                    now = time.perf_counter() - st
                    if r.token_ids or r.text:
                        rec.chunk_times.append(now)
                        rec.chunk_tokens.append(len(r.token_ids))
                        if rec.text is not None:
                            rec.text += r.text
                    if r.HasField("usage"):
                        rec.prompt_tokens = r.usage.prompt_tokens
                        rec.completion_tokens = r.usage.completion_tokens
                        rec.cached_tokens = r.usage.cached_tokens
            except asyncio.CancelledError:
                call.cancel()
                raise
            except grpc.aio.AioRpcError as e:
                rec.outcome, rec.error_kind, rec.error = "error", e.code().name, e.details()

        st = time.perf_counter()
        rec.start = st - t0
        rec.start_wall_ns = time.time_ns()
        if spec.structured is not None:
            rec.text = ""
        await _timed(stream(), rec, self.opts.timeout)
        rec.end = time.perf_counter() - st
        _check_structured(spec, rec)


class OpenAITarget:
    """The OpenAI HTTP API, streamed (SSE) with ``stream_options.include_usage``. ``endpoint``: ``chat`` sends the
    prompt as one user message to ``/v1/chat/completions``; ``completions`` sends it as ``prompt`` to
    ``/v1/completions`` (as its token ids with ``prompt_ids``: the ids gRPC gets). The tenant travels as its API
    key (``Authorization: Bearer``) and ``x-tenant-id``; its priority as the request's ``priority`` field (a vLLM
    extension). ``top_k``, ``min_p`` and ``repetition_penalty`` are vLLM's extra fields beside OpenAI's."""

    def __init__(self, base_url: str, endpoint: str, model: str | None, opts: SendOptions,
                 models_key: str | None = None, prompt_ids: bool = False) -> None:
        self.models_key = models_key  # for GET /v1/models when there is no default key (a tenant's)
        self.prompt_ids = prompt_ids
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.endpoint, self.model, self.opts = endpoint, model, opts
        self.name = "openai-chat" if endpoint == "chat" else "openai"
        self.url = f"{self.base_url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
        self._session: aiohttp.ClientSession | None = None

    def clone(self) -> OpenAITarget:
        return OpenAITarget(self.base_url, self.endpoint, self.model, self.opts, self.models_key, self.prompt_ids)

    def headers(self, spec: RequestSpec | None = None) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        key = _key(spec, self.opts) if spec else (self.opts.api_key or self.models_key)
        if key:
            h["Authorization"] = f"Bearer {key}"
        if spec and spec.tenant:
            h["x-tenant-id"] = spec.tenant.name
        return h

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=6 * 3600), trust_env=False)
        if not self.model:
            self.model = await self.served_model()

    async def served_model(self) -> str:
        """The first model of ``GET /v1/models`` (what ``--model`` defaults to, as in vLLM's benchmark)."""
        assert self._session is not None
        async with self._session.get(f"{self.base_url}/v1/models", headers=self.headers()) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {self.base_url}/v1/models: HTTP {r.status} {(await r.text())[:300]}; "
                                   "pass --model")
            return (await r.json())["data"][0]["id"]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        p: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            p["messages"] = [{"role": "user", "content": spec.prompt_text}]
            p["max_completion_tokens"] = spec.output_len
        else:
            p["prompt"] = list(spec.prompt_ids) if self.prompt_ids else spec.prompt_text
            p["max_tokens"] = spec.output_len
        if self.opts.ignore_eos:
            p["ignore_eos"] = True
        p.update(self.opts.sampling())
        if spec.tenant and spec.tenant.priority:
            p["priority"] = spec.tenant.priority
        if spec.tenant and spec.tenant.priority_class:
            p["service_tier"] = spec.tenant.priority_class  # the gateway takes the class names as tiers too
        if self.opts.cache_salt:
            p["cache_salt"] = self.opts.cache_salt
        if (c := spec.structured) is not None:
            p["response_format"] = ({"type": "json_schema", "json_schema": {"name": c["name"], "schema": c["schema"],
                                                                             "strict": True}}
                                    if c["type"] == "json_schema" else {"type": "json_object"})
        return p

    async def send(self, spec: RequestSpec, rec: RequestRecord, t0: float) -> None:
        assert self._session is not None
        session = self._session

        async def stream() -> None:
            try:
                async with session.post(self.url, json=self.payload(spec), headers=self.headers(spec)) as r:
                    if r.status != 200:
                        rec.outcome, rec.error_kind = "error", f"HTTP {r.status}"
                        rec.error = (await r.text())[:500]
                        return
                    sse = SseDecoder()
                    async for data in r.content.iter_any():
                        now = time.perf_counter() - st
                        for ev in sse.feed(data):
                            if self.on_data(ev, rec, now):
                                return
                    for ev in sse.feed(b"\n\n"):  # a last event without its blank line
                        self.on_data(ev, rec, time.perf_counter() - st)
            except (aiohttp.ClientError, json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                rec.outcome, rec.error_kind, rec.error = "error", type(e).__name__, str(e)[:500]

        st = time.perf_counter()
        rec.start = st - t0
        rec.start_wall_ns = time.time_ns()
        if spec.structured is not None:
            rec.text = ""
        await _timed(stream(), rec, self.opts.timeout)
        rec.end = time.perf_counter() - st
        _check_structured(spec, rec)

    def on_data(self, data: str, rec: RequestRecord, now: float) -> bool:
        """One SSE ``data`` payload received at ``now``; True at ``[DONE]`` or an error event."""
        if data.strip() == "[DONE]":
            return True
        msg = json.loads(data)
        if "error" in msg and not msg.get("choices"):
            err = msg["error"]
            rec.outcome, rec.error_kind = "error", "stream error"
            rec.error = str(err.get("message") or err) if isinstance(err, dict) else str(err)
            return True
        if choices := msg.get("choices"):
            c = choices[0]
            text = (c.get("delta") or {}).get("content") if self.endpoint == "chat" else c.get("text")
            if text:  # a role-only or empty first chunk carries no token
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(1)
                if rec.text is not None:
                    rec.text += text
        if usage := msg.get("usage"):
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.completion_tokens = usage.get("completion_tokens")
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return False


class SseDecoder:
    """Server-sent events from a byte stream cut anywhere: ``feed`` returns the ``data`` payloads of the events
    it completed. Lines end in LF, CRLF or CR; an event ends at a blank line; ``:`` lines are comments (pings);
    several ``data:`` lines of one event are joined with LF; other fields (``event:``, ``id:``) are skipped."""

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []
        self._dec = codecs.getincrementaldecoder("utf-8")()

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += self._dec.decode(chunk)
        out: list[str] = []
        held = self._buf.endswith("\r")  # maybe the first half of a CRLF cut between chunks
        text = self._buf[:-1] if held else self._buf
        *lines, rest = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._buf = rest + ("\r" if held else "")
        for line in lines:
            if not line:
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
        return out

