"""The Decode service: one engine in continuous batching, KV pulled over NIXL, text beside the loop.

Threads: the asyncio loop (gRPC), the engine loop (``EngineLoop``: steps, NIXL polls), and the detokenizer
(``OutputProcessor``: token ids → text, stop strings, the output filter of the request's tenant or model from the
config's ``output_filter``; a stream it blocks is aborted in the engine, its blocks freed, and its last message
carries ``FINISH_REASON_CONTENT_FILTER`` and ``filter_reason``). The detokenizer takes typed messages from one queue
(``_Add`` … ``_Stop``), drains everything queued at once and wakes the asyncio loop once per drain.

A request with a KV handle (its prompt computed by a prefill worker) first claims its lease, streams its first
token, then pulls the prompt's blocks while the running batch goes on: ``KvPulls`` (services/decode/kv_pull.py) does
the handshakes, claims and releases on the asyncio loop and the pulls on the engine thread, and says when the lease
changes hands (``Lease``). Fault injection for its tests: ``KV_PULL_FAULT`` (see there).
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import grpc
from tokenmill.v1 import common_pb2, decode_pb2, decode_pb2_grpc, router_pb2

from common import rpc, telemetry
from common.cluster_config import ServiceConfig
from common.engine import LLMEngine, RequestOutput, TokenLogprob
from common.output_filter import OutputPolicy, PolicySet
from common.output_processor import OutputProcessor, TextDelta
from common.sampling import SamplingParams
from common.sequence import Tenancy
from common.wire import sampling_params_from_proto, tenancy_from_meta
from common.worker import FINISH_TO_PROTO, WorkerBase, logprob_proto
from services.decode.kv_pull import KvPulls, Lease


# -- what the detokenizer thread takes from ``_detok_q`` (from the asyncio loop and the engine thread) ----------
@dataclass(frozen=True, slots=True)
class _Add:
    """A stream starts (asyncio loop): its prompt, params and output filter, before its first output."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prior_output_ids: list[int]
    policy: OutputPolicy | None


@dataclass(frozen=True, slots=True)
class _Discard:
    """A stream ended unfinished (asyncio loop): forget its text state."""

    request_id: str


@dataclass(frozen=True, slots=True)
class _Out:
    """One output outside a step: a prefilled request's first token (engine thread)."""

    output: RequestOutput


@dataclass(frozen=True, slots=True)
class _Outs:
    """Everything one engine step produced (engine thread): one hand-off per step, not per token."""

    outputs: list[RequestOutput]


@dataclass(frozen=True, slots=True)
class _Stop:
    """The worker stops: the detokenizer thread ends."""


_DetokMsg = _Add | _Discard | _Out | _Outs | _Stop


@dataclass
class _Admission:
    """Whether a stream's request reached the engine: set by ``_admit`` on the engine thread."""

    admitted: bool = False


@dataclass
class _Item:
    """What the detokenizer hands a stream: text plus the engine's token-level facts."""

    delta: TextDelta
    logprobs: list[TokenLogprob] | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int


class DecodeWorker(WorkerBase):
    role_proto = router_pb2.WORKER_ROLE_DECODE

    def __init__(self, cfg: ServiceConfig) -> None:
        super().__init__(cfg)
        self.streams: dict[str, asyncio.Queue[_Item | BaseException]] = {}
        self._detok_q: queue.SimpleQueue[_DetokMsg] = queue.SimpleQueue()
        self._detok_thread: threading.Thread | None = None
        self.pulls = KvPulls(cfg.name, self.metrics, self.call_in_aio, lambda out: self._detok_q.put(_Out(out)),
                             os.environ.get("KV_PULL_FAULT"))
        self.policies = PolicySet(cfg.cluster.output_filter, cfg.cluster.model)

    def register(self, server: grpc.aio.Server) -> list[str]:
        decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(self), server)
        return [decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name]

    async def start(self) -> None:
        await super().start()
        assert self.engine is not None
        self.pulls.agent = self.agent  # made on the engine thread; no request has come yet
        self._detok_thread = threading.Thread(
            target=self._detok_run, args=(OutputProcessor(self.engine.tokenizer),), name="detok", daemon=True
        )
        self._detok_thread.start()

    async def stop(self) -> None:
        await super().stop()
        self._detok_q.put(_Stop())
        await self.pulls.close()

    def fail_requests(self, exc: Exception) -> None:
        for q in self.streams.values():
            q.put_nowait(exc)

    # -- engine thread -----------------------------------------------------------------------------------
    def on_outputs(self, outs: list[RequestOutput]) -> None:
        self._detok_q.put(_Outs(outs))  # one hand-off per step, not per token
        self.metrics.generation_tokens.inc(len(outs))

    def busy(self) -> bool:
        return self.pulls.busy()

    def on_tick(self, engine: LLMEngine) -> None:
        self.pulls.on_tick(engine)

    def _admit(self, engine: LLMEngine, rid: str, req: decode_pb2.DecodeRequest, params: SamplingParams,
               tenancy: Tenancy, lease: Lease | None, admission: _Admission, trace_ctx: Any = None) -> None:
        """Add the request (engine thread); one with a lease goes to ``KvPulls``, which owns the lease from here."""
        admission.admitted = True
        if lease is not None:
            self.pulls.admit(engine, rid, req, params, tenancy, lease, trace_ctx)
            return
        meta = req.meta
        engine.add_request(rid, list(req.prompt_token_ids), params, meta.priority, meta.cache_salt,
                           prior_output_ids=list(req.prior_output_ids), tenancy=tenancy)

    def _end_stream(self, engine: LLMEngine, rid: str, lease: Lease | None, admission: _Admission) -> None:
        """The stream ended unfinished (engine thread, after its ``_admit`` ran or was cancelled before running)."""
        if admission.admitted:
            self._abort(engine, rid)
        elif lease is not None:  # never admitted, so no READ of ours runs under the lease: give it back
            self.pulls.end_unadmitted(lease)

    def _abort(self, engine: LLMEngine, rid: str) -> None:
        if not self.pulls.abort(rid):  # a pull in flight aborts the request when its READ is over
            engine.abort(rid)

    # -- detokenizer thread ------------------------------------------------------------------------------
    def _detok_run(self, proc: OutputProcessor) -> None:
        """Drain everything queued, turn it into text, and wake the asyncio loop once per drain."""
        while True:
            batch = [self._detok_q.get()]
            while not self._detok_q.empty():
                batch.append(self._detok_q.get_nowait())
            ready: list[tuple[str, _Item]] = []
            for msg in batch:
                match msg:
                    case _Stop():
                        return
                    case _Add(rid, prompt, params, prior, policy):
                        proc.add(rid, prompt, params, prior, policy)
                    case _Discard(rid):
                        proc.discard(rid)
                    case _Out(o):
                        self._detok_one(proc, o, ready)
                    case _Outs(outs):
                        for o in outs:
                            self._detok_one(proc, o, ready)
            if ready:
                self.call_in_aio(self._deliver_many, ready)

    def _detok_one(self, proc: OutputProcessor, o: RequestOutput, ready: list[tuple[str, _Item]]) -> None:
        d = proc.process(o.request_id, o.new_token_ids, o.finished, o.finish_reason, o.logprobs)
        if d is None:
            return
        if d.stopped_by_string or d.filter_reason:
            assert self.loop is not None  # outputs come from the running loop
            rid = o.request_id
            self.loop.submit(lambda e: self._abort(e, rid))
        if d.finished:
            self.metrics.requests.labels(d.finish_reason.value if d.finish_reason else "abort").inc()
        ready.append((o.request_id, _Item(d, d.logprobs, o.num_prompt_tokens, o.num_output_tokens,
                                          o.num_cached_tokens)))

    def _deliver_many(self, ready: list[tuple[str, _Item]]) -> None:
        for rid, item in ready:
            self._deliver(rid, item)

    def _deliver(self, rid: str, item: _Item) -> None:
        q = self.streams.get(rid)
        if q is not None:
            q.put_nowait(item)


def _merge(items: list[_Item]) -> decode_pb2.TokenDelta:
    """Several deltas of one stream in one message (a stream that fell behind catches up in one send)."""
    last = items[-1]
    msg = decode_pb2.TokenDelta(
        text="".join(i.delta.text for i in items),
        token_ids=[t for i in items for t in i.delta.token_ids],
        logprobs=[logprob_proto(lp) for i in items for lp in (i.logprobs or [])],
        finish_reason=(FINISH_TO_PROTO[last.delta.finish_reason] if last.delta.finished
                       else common_pb2.FINISH_REASON_UNSPECIFIED),
        filter_reason=last.delta.filter_reason,
    )
    if last.delta.finished:
        msg.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=last.prompt_tokens, completion_tokens=last.output_tokens, cached_tokens=last.cached_tokens
        ))
    return msg


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Thin: validate, hand the request to the engine thread, stream what the detokenizer produces."""

    def __init__(self, w: DecodeWorker) -> None:
        self.w = w

    @rpc.translate_errors
    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        w = self.w
        if w.draining:
            raise rpc.Unavailable(f"{w.cfg.name} is draining; send the request to another decode worker")
        assert w.engine is not None and w.loop is not None
        rid = request.meta.request_id or uuid.uuid4().hex
        if rid in w.streams:
            raise ValueError(f"request id {rid!r} is already streaming on {w.cfg.name}")
        params = sampling_params_from_proto(request.params)
        prompt = list(request.prompt_token_ids)
        prior = list(request.prior_output_ids)
        if prior and request.HasField("kv"):
            raise ValueError("prior_output_ids and kv cannot come together: a moved stream recomputes its context")
        w.engine.validate(prompt, params)  # reads only config: safe off the engine thread
        tenancy = tenancy_from_meta(request.meta)
        lease = Lease(request.kv) if request.HasField("kv") else None
        admission = _Admission()
        q: asyncio.Queue[_Item | BaseException] = asyncio.Queue()
        w.streams[rid] = q
        w.metrics.prompt_tokens.inc(len(prompt))
        finished = False
        span = telemetry.start_span("decode", attributes={"request_id": rid, "prompt_tokens": len(prompt)})
        trace_ctx = telemetry.context_with(span)
        try:
            if lease is not None:
                await w.pulls.claim(lease)  # before the first token; no claim: the prompt is recomputed here
            w._detok_q.put(_Add(rid, prompt, params, prior, w.policies.for_request(request.meta.tenant_id)))
            await asyncio.wrap_future(w.loop.submit(lambda e: w._admit(e, rid, request, params, tenancy, lease,
                                                                        admission, trace_ctx)))
            while not finished:
                got = [await q.get()]
                while not q.empty():
                    got.append(q.get_nowait())
                items: list[_Item] = []
                for it in got:
                    if isinstance(it, BaseException):
                        raise it
                    items.append(it)
                finished = items[-1].delta.finished
                if finished:
                    last = items[-1]
                    reason = last.delta.finish_reason.value if last.delta.finish_reason else "abort"
                    telemetry.finish(span, attributes={"output_tokens": last.output_tokens, "finish_reason": reason})
                yield _merge(items)
        except BaseException as e:
            if not finished:  # cancelled, or failed
                telemetry.finish(span, attributes={"finish_reason": "abort"}, error=e)
            raise
        finally:
            w.streams.pop(rid, None)
            if not finished:  # the client went away (or an error): free the blocks (and lease) within a step
                w.loop.submit(lambda e: w._end_stream(e, rid, lease, admission))
                w._detok_q.put(_Discard(rid))


def serve(cfg: ServiceConfig) -> int:
    """``tokenmill serve decode``."""
    return rpc.run(DecodeWorker(cfg), cfg)
