"""The Decode service: one engine in continuous batching, KV pulled over NIXL, text beside the loop.

The engine, its steps and its NIXL polls are the engine core's (``DecodeCore``, services/decode/core.py), in a
process of its own by default (common/engine_core.py). This front has the asyncio loop (gRPC) and the detokenizer
thread (``OutputProcessor``: token ids → text, stop strings, the output filter of the request's tenant or model from
the config's ``output_filter``; a stream it blocks is aborted in the engine, its blocks freed, and its last message
carries ``FINISH_REASON_CONTENT_FILTER`` and ``filter_reason``). The detokenizer takes typed messages from one queue
(``_Add`` … ``_Stop``), drains everything queued at once and wakes the asyncio loop once per drain.

Two ways in: ``Decode``, one call per request (its deltas go through an asyncio queue to the call's handler), and
``DecodeStream``, many requests on one call (a gateway keeps one per worker): a request's deltas go straight into
the stream's outbox, and each message out carries every delta produced since the last one, so a step of 64
sequences costs one gRPC message instead of 64. Both share the request's set-up and clean-up
(``DecodeWorker._prepare`` / ``_begin`` / ``_end``).

A request with a KV handle (its prompt computed by a prefill worker) first wakes the link to that worker if it sat
idle (a one-block READ into a scratch block, ``KvTransferAgent.warm_link``), claims its lease, streams its first
token, then pulls the prompt's blocks while the running batch goes on (services/decode/kv_pull.py): ``KvPeers`` does
the handshakes, claims and releases here, ``KvPulls`` the pulls in the engine core, and ``Lease`` says when the lease
changes hands. Fault injection for its tests: ``KV_PULL_FAULT`` (see there).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from tokenmill.v1 import common_pb2, decode_pb2, decode_pb2_grpc, router_pb2

from common import rpc, telemetry
from common.cluster_config import ServiceConfig
from common.engine import RequestOutput, TokenLogprob
from common.output_filter import OutputPolicy, PolicySet
from common.output_processor import OutputProcessor, TextDelta
from common.sampling import SamplingParams
from common.sequence import PriorityClass, Tenancy
from common.wire import sampling_params_from_proto, tenancy_from_meta
from common.worker import FINISH_TO_PROTO, WorkerBase, logprob_proto
from services.decode.core import DecodeCore
from services.decode.kv_pull import KvPeers, Lease

log = logging.getLogger(__name__)

# With the engine on a thread of this process (``worker_engine_process`` false), the detokenizer gives the GIL up
# after every this many outputs of a step: the engine thread, waiting to launch its next step, takes it then, instead
# of after the whole step's text (a Python thread that works after each step stretches the engine's steps:
# docs/benchmarks.md, the served cluster on a GPU). With the engine in its own process nothing here waits on the
# step, and each yield would only hand the GIL to the asyncio loop for up to a switch interval mid-step.
DETOK_YIELD_EVERY = 8


# -- what the detokenizer thread takes from ``_detok_q`` (from the asyncio loop and the engine thread) ----------
@dataclass(frozen=True, slots=True)
class _Add:
    """A stream starts (asyncio loop): its prompt, params and output filter, before its first output."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prior_output_ids: list[int]
    policy: OutputPolicy | None
    batch_class: bool  # its outputs wait for every other class's in a step (``_turns``)


@dataclass(frozen=True, slots=True)
class _Discard:
    """A stream ended unfinished (asyncio loop): forget its text state."""

    request_id: str


@dataclass(frozen=True, slots=True)
class _Out:
    """One output outside a step: a prefilled request's first token (the core's event)."""

    output: RequestOutput


@dataclass(frozen=True, slots=True)
class _Outs:
    """Everything one engine step produced (the core's event): one hand-off per step, not per token."""

    outputs: list[RequestOutput]


@dataclass(frozen=True, slots=True)
class _Stop:
    """The worker stops: the detokenizer thread ends."""


_DetokMsg = _Add | _Discard | _Out | _Outs | _Stop


@dataclass
class _Item:
    """What the detokenizer hands a stream: text plus the engine's token-level facts."""

    delta: TextDelta
    logprobs: list[TokenLogprob] | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class _Req:
    """One request on this worker, from ``_prepare`` to ``_end``."""

    rid: str
    request: decode_pb2.DecodeRequest
    params: SamplingParams
    prompt: list[int]
    prior: list[int]
    tenancy: Tenancy
    lease: Lease | None
    admitted: bool = False  # its ``admit`` call was made (it runs before any later call)
    span: Any = None
    finished: bool = False


class _Outbox:
    """What a ``DecodeStream`` sends next: the deltas of its requests since its last message, by request."""

    def __init__(self) -> None:
        self.pending: dict[str, list[_Item]] = {}
        self.errors: list[decode_pb2.TokenDelta] = []
        self.event = asyncio.Event()

    def add(self, rid: str, item: _Item) -> None:
        got = self.pending.get(rid)
        if got is None:
            self.pending[rid] = [item]
        else:
            got.append(item)
        self.event.set()

    def fail(self, rid: str, exc: BaseException) -> None:
        code, message = rpc.status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("unexpected error serving %s on a DecodeStream", rid, exc_info=exc)
        self.errors.append(decode_pb2.TokenDelta(request_id=rid, error=decode_pb2.RequestError(
            code=code.value[0], message=rpc.clip_message(message))))
        self.event.set()

    def take(self) -> decode_pb2.TokenDeltaBatch:
        deltas = [_merge(items, rid) for rid, items in self.pending.items()]
        deltas += self.errors  # after the request's last deltas
        self.pending, self.errors = {}, []
        return decode_pb2.TokenDeltaBatch(deltas=deltas)


class _StreamSink:
    """A ``DecodeStream`` request's place in ``DecodeWorker.streams``: its items go to the stream's outbox; ``done``
    holds its last item (or the error that ended it)."""

    __slots__ = ("done", "out", "rid")

    def __init__(self, out: _Outbox, rid: str) -> None:
        self.out, self.rid = out, rid
        self.done: asyncio.Future[_Item] = asyncio.get_running_loop().create_future()

    def put_nowait(self, item: _Item | BaseException) -> None:
        if self.done.done():
            return
        if isinstance(item, BaseException):
            self.done.set_exception(item)
            return
        self.out.add(self.rid, item)
        if item.delta.finished:
            self.done.set_result(item)


_Sink = asyncio.Queue[_Item | BaseException] | _StreamSink


class DecodeWorker(WorkerBase):
    role_proto = router_pb2.WORKER_ROLE_DECODE
    core_class = DecodeCore

    def __init__(self, cfg: ServiceConfig) -> None:
        super().__init__(cfg)
        self.streams: dict[str, _Sink] = {}
        self._detok_q: queue.SimpleQueue[_DetokMsg] = queue.SimpleQueue()
        self._detok_thread: threading.Thread | None = None
        self.peers = KvPeers(cfg.name, self.call, self.now)
        self._trace: dict[str, Any] = {}  # request id → its ``decode`` span's context, for its KV pull's span
        self.policies = PolicySet(cfg.cluster.output_filter, cfg.cluster.model)
        self._detok_yield_every = 0 if cfg.cluster.worker_engine_process else DETOK_YIELD_EVERY

    def register(self, server: grpc.aio.Server) -> list[str]:
        decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(self), server)
        return [decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name, *self.register_admin(server)]

    async def start(self) -> None:
        await super().start()
        self._detok_thread = threading.Thread(
            target=self._detok_run, args=(OutputProcessor(self.tokenizer),), name="detok", daemon=True
        )
        self._detok_thread.start()

    async def stop(self) -> None:
        await super().stop()
        self._detok_q.put(_Stop())
        await self.peers.close()

    def fail_requests(self, exc: Exception) -> None:
        for q in self.streams.values():
            q.put_nowait(exc)

    # -- the core's events (engine thread or the core's pipe reader) ------------------------------------
    def ev_outputs(self, outs: list[RequestOutput]) -> None:
        self._detok_q.put(_Outs(outs))  # one hand-off per step, not per token
        self.metrics.generation_tokens.inc(len(outs))

    def ev_first_token(self, out: RequestOutput) -> None:
        self._detok_q.put(_Out(out))  # a prefilled request's first token, before its pull

    def ev_release_lease(self, kv: common_pb2.KvHandle) -> None:
        self.call_in_aio(self.peers.release_lease, kv)

    def ev_span(self, rid: str, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any],
                error: str | None) -> None:
        self.call_in_aio(self._record_span, rid, name, start_ns, end_ns, attributes, error)

    def _record_span(self, rid: str, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any],
                     error: str | None) -> None:
        telemetry.record_span(name, start_ns, end_ns, self._trace.pop(rid, None), attributes, error)

    def ev_recompute(self, reason: str) -> None:
        self.metrics.kv_recomputes.labels(reason).inc()

    def ev_transfer(self, seconds: float, nbytes: int, blocks: int) -> None:
        self.metrics.observe_transfer(seconds, nbytes, blocks)

    def ev_peer_dropped(self, agent_name: str) -> None:
        self.call_in_aio(self.peers.forget, agent_name)

    # -- a request's set-up and clean-up (asyncio loop), shared by Decode and DecodeStream --------------------
    async def _prepare(self, request: decode_pb2.DecodeRequest) -> _Req:
        """Check the request (raises before anything is held)."""
        if self.draining:
            raise rpc.Unavailable(f"{self.cfg.name} is draining; send the request to another decode worker")
        rid = request.meta.request_id or uuid.uuid4().hex
        if rid in self.streams:
            raise ValueError(f"request id {rid!r} is already streaming on {self.cfg.name}")
        params = sampling_params_from_proto(request.params)
        prompt = list(request.prompt_token_ids)
        prior = list(request.prior_output_ids)
        if prior and request.HasField("kv"):
            raise ValueError("prior_output_ids and kv cannot come together: a moved stream recomputes its context")
        await self.validate(prompt, params)
        if rid in self.streams:  # came in while this one was checked
            raise ValueError(f"request id {rid!r} is already streaming on {self.cfg.name}")
        lease = Lease(request.kv) if request.HasField("kv") else None
        return _Req(rid, request, params, prompt, prior, tenancy_from_meta(request.meta), lease)

    async def _begin(self, r: _Req, sink: _Sink, parent: Any = None) -> None:
        """Register the request's sink, claim its lease, and hand it to the detokenizer and the engine."""
        self.streams[r.rid] = sink
        self.metrics.prompt_tokens.inc(len(r.prompt))
        r.span = telemetry.start_span("decode", parent=parent,
                                      attributes={"request_id": r.rid, "prompt_tokens": len(r.prompt)})
        if r.lease is not None:
            self._trace[r.rid] = telemetry.context_with(r.span)
            self.peers.warm(r.lease.kv)  # the link to the prefill worker wakes while the claim and admission run
            await self.peers.claim(r.lease)  # before the first token; no claim: the prompt is recomputed here
        self._detok_q.put(_Add(r.rid, r.prompt, r.params, r.prior, self.policies.for_request(r.request.meta.tenant_id),
                                 r.tenancy.klass is PriorityClass.BATCH))
        r.admitted = True
        await self.call("admit", r.rid, r.request, r.params, r.tenancy, r.lease)

    def _finished(self, r: _Req, last: _Item) -> None:
        r.finished = True
        reason = last.delta.finish_reason.value if last.delta.finish_reason else "abort"
        telemetry.finish(r.span, attributes={"output_tokens": last.output_tokens, "finish_reason": reason})

    def _end(self, r: _Req, error: BaseException | None) -> None:
        """The request's stream is over; unfinished (cancelled, failed), its blocks and lease are freed within a
        step."""
        if not r.finished and r.span is not None:
            telemetry.finish(r.span, attributes={"finish_reason": "abort"}, error=error)
        self.streams.pop(r.rid, None)
        self._trace.pop(r.rid, None)
        if not r.finished:
            self.cast("end_stream", r.rid, r.lease, r.admitted)
            self._detok_q.put(_Discard(r.rid))

    # -- detokenizer thread ------------------------------------------------------------------------------
    def _detok_run(self, proc: OutputProcessor) -> None:
        """Drain everything queued, turn it into text, and wake the asyncio loop once per drain (and between a
        step's turns)."""
        batch_rids: set[str] = set()  # the streams of the batch class
        while True:
            batch = [self._detok_q.get()]
            while not self._detok_q.empty():
                batch.append(self._detok_q.get_nowait())
            ready: list[tuple[str, _Item]] = []
            for msg in batch:
                match msg:
                    case _Stop():
                        return
                    case _Add(rid, prompt, params, prior, policy, batch_class):
                        proc.add(rid, prompt, params, prior, policy)
                        if batch_class:
                            batch_rids.add(rid)
                    case _Discard(rid):
                        proc.discard(rid)
                        batch_rids.discard(rid)
                    case _Out(o):
                        self._detok_one(proc, o, ready)
                    case _Outs(outs):
                        # in turns (``_turns``), each handed over before the next; the later outputs of a turn
                        # in chunks, giving the GIL up between them (see the constant)
                        every = self._detok_yield_every
                        for k, (first, turn) in enumerate(_turns(outs, batch_rids)):
                            if k and ready:
                                self.call_in_aio(self._deliver_many, ready)
                                ready = []
                            for i, o in enumerate(turn, 1):
                                self._detok_one(proc, o, ready)
                                if every and not first and i % every == 0:
                                    time.sleep(0)
                        if batch_rids:
                            for o in outs:
                                if o.finished:
                                    batch_rids.discard(o.request_id)
            if ready:
                self.call_in_aio(self._deliver_many, ready)

    def _detok_one(self, proc: OutputProcessor, o: RequestOutput, ready: list[tuple[str, _Item]]) -> None:
        d = proc.process(o.request_id, o.new_token_ids, o.finished, o.finish_reason, o.logprobs)
        if d is None:
            return
        if d.stopped_by_string or d.filter_reason:
            self.cast("abort", o.request_id)
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


def _turns(outs: list[RequestOutput], batch_rids: set[str]) -> list[tuple[bool, list[RequestOutput]]]:
    """A step's outputs in the order the detokenizer takes them, each turn handed to the asyncio loop before the
    next (and flagged when it holds first tokens): first tokens, which make a request's TTFT, then the others; and
    the batch class's after every other class's, so a batch tenant's stream of tokens does not hold up an
    interactive one's in this process."""
    groups = [outs]
    if batch_rids:
        urgent = [o for o in outs if o.request_id not in batch_rids]
        if len(urgent) < len(outs):
            groups = [urgent, [o for o in outs if o.request_id in batch_rids]]
    turns = []
    for group in groups:
        first = [o for o in group if o.num_output_tokens <= len(o.new_token_ids)]
        rest = [o for o in group if o.num_output_tokens > len(o.new_token_ids)] if first else group
        turns += [(True, first)] if first else []
        turns += [(False, rest)] if rest else []
    return turns


def _merge(items: list[_Item], request_id: str = "") -> decode_pb2.TokenDelta:
    """Several deltas of one stream in one message (a stream that fell behind catches up in one send)."""
    last = items[-1]
    msg = decode_pb2.TokenDelta(
        request_id=request_id,
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
        r = await w._prepare(request)
        q: asyncio.Queue[_Item | BaseException] = asyncio.Queue()
        error: BaseException | None = None
        try:
            await w._begin(r, q)
            while not r.finished:
                got = [await q.get()]
                while not q.empty():
                    got.append(q.get_nowait())
                items: list[_Item] = []
                for it in got:
                    if isinstance(it, BaseException):
                        raise it
                    items.append(it)
                if items[-1].delta.finished:
                    w._finished(r, items[-1])
                yield _merge(items)
        except BaseException as e:
            error = e
            raise
        finally:
            w._end(r, error)  # the client went away, or an error: the blocks (and lease) are freed within a step

    @rpc.translate_errors
    async def DecodeStream(self, requests: AsyncIterator[decode_pb2.DecodeStreamRequest],
                           context: grpc.aio.ServicerContext):
        """Many requests on one call: each runs as a task that sets it up, waits for its last item and cleans up;
        the deltas go to one outbox, sent as one message whenever there is something in it."""
        w = self.w
        out = _Outbox()
        tasks: dict[str, asyncio.Task[None]] = {}
        loop = asyncio.get_running_loop()

        async def one(m: decode_pb2.DecodeStreamRequest, rid: str) -> None:
            try:
                r = await w._prepare(m.request)
                sink = _StreamSink(out, rid)
                error: BaseException | None = None
                try:
                    await w._begin(r, sink, telemetry.incoming_context(list(m.trace.items())))
                    w._finished(r, await sink.done)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    w._end(r, error)
            except asyncio.CancelledError:  # cancelled by the client, or the stream ended: nothing to send
                pass
            except Exception as e:
                out.fail(rid, e)
            finally:
                if tasks.get(rid) is asyncio.current_task():
                    del tasks[rid]
                out.event.set()

        async def read() -> None:
            try:
                async for m in requests:
                    kind = m.WhichOneof("kind")
                    if kind == "request":
                        rid = m.request.meta.request_id
                        if not rid or rid in tasks:
                            out.fail(rid, ValueError(f"a request on a DecodeStream needs a request id unique on the "
                                                     f"stream; got {rid!r}"))
                            continue
                        tasks[rid] = loop.create_task(one(m, rid))
                    elif kind == "cancel_request_id":
                        t = tasks.get(m.cancel_request_id)
                        if t is not None:
                            t.cancel()
            finally:
                out.event.set()

        reader = loop.create_task(read())
        try:
            while True:
                out.event.clear()
                if out.pending or out.errors:
                    yield out.take()
                    continue
                if reader.done() and not tasks:
                    reader.result()  # the client's side failed: end the call with its error
                    return
                await out.event.wait()
        finally:
            reader.cancel()
            for t in list(tasks.values()):
                t.cancel()  # each frees its request's blocks


def serve(cfg: ServiceConfig) -> int:
    """``tokenmill serve decode``."""
    return rpc.run(DecodeWorker(cfg), cfg)
