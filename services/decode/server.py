"""The Decode service: one engine in continuous batching, KV pulled over NIXL, text beside the loop.

Threads: the asyncio loop (gRPC), the engine loop (``EngineLoop``: steps, NIXL polls), and the detokenizer
(``OutputProcessor``: token ids → text, stop strings). A request with a KV handle streams its first token at once,
then its blocks are pulled with one NIXL READ, polled once per step; when it lands the sequence joins the running
batch. A pull that fails, or a lease too close to expiry, falls back to recomputing the prompt here.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import grpc
from tokenmill.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, router_pb2

from common import rpc, telemetry
from common.cluster_config import ServiceConfig
from common.engine import LLMEngine, RequestOutput, TokenLogprob
from common.kv_transfer import KvCompat, KvIncompatibleError, KvReadHandle
from common.output_processor import OutputProcessor, TextDelta
from common.sampling import SamplingParams
from common.wire import sampling_params_from_proto
from common.worker import FINISH_TO_PROTO, WorkerBase, compat_proto, logprob_proto

log = logging.getLogger(__name__)

LEASE_SAFETY_S = 2.0  # never start a READ this close to the lease's end: the prefill worker may reuse the blocks


class PeerRefused(rpc.Unavailable):
    """The prefill worker's KV layout differs from ours (the message names every difference)."""


@dataclass
class _Pull:
    handle: KvReadHandle
    peer: str
    lease_id: str
    aborted: bool = False
    started_ns: int = 0  # tracing: READ started (its span is made on the asyncio loop when it ends)
    trace_ctx: Any = None  # the request's ``decode`` span: the parent of ``kv_transfer``


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
        self._detok_q: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._detok_thread: threading.Thread | None = None
        self._pulls: dict[str, _Pull] = {}  # engine thread only
        self._peers: dict[str, str] = {}  # prefill address → its agent name (handshake done)
        self._peer_locks: dict[str, asyncio.Lock] = {}

    def register(self, server: grpc.aio.Server) -> list[str]:
        decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(self), server)
        return [decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name]

    async def start(self) -> None:
        await super().start()
        assert self.engine is not None
        self._detok_thread = threading.Thread(
            target=self._detok_run, args=(OutputProcessor(self.engine.tokenizer),), name="detok", daemon=True
        )
        self._detok_thread.start()

    async def stop(self) -> None:
        await super().stop()
        self._detok_q.put(("stop",))

    def fail_requests(self, exc: Exception) -> None:
        for q in self.streams.values():
            q.put_nowait(exc)

    # -- engine thread -----------------------------------------------------------------------------------
    def on_outputs(self, outs: list[RequestOutput]) -> None:
        self._detok_q.put(("outs", outs))  # one hand-off per step, not per token
        self.metrics.generation_tokens.inc(len(outs))

    def busy(self) -> bool:
        return bool(self._pulls)

    def on_tick(self, engine: LLMEngine) -> None:
        assert self.agent is not None
        for rid, pull in list(self._pulls.items()):
            state = self.agent.poll(pull.handle)
            if state == "PROC":
                continue
            self.agent.release(pull.handle)
            del self._pulls[rid]
            h = pull.handle
            self.call_in_aio(telemetry.record_span, "kv_transfer", pull.started_ns, time.time_ns(), pull.trace_ctx,
                             {"bytes": h.nbytes, "blocks": h.num_blocks, "peer": pull.peer},
                             None if state == "DONE" else f"KV pull {state}: {h.error}")
            if pull.aborted:
                engine.abort(rid)
            elif state == "DONE":
                engine.kv_ready(rid)
            else:
                log.warning("KV pull for %s from %s failed (%s): recomputing here", rid, pull.peer, pull.handle.error)
                engine.kv_failed(rid)

    def _admit(self, engine: LLMEngine, rid: str, req: decode_pb2.DecodeRequest, params: SamplingParams,
               trace_ctx: Any = None) -> None:
        meta = req.meta
        if not req.HasField("kv"):
            engine.add_request(rid, list(req.prompt_token_ids), params, meta.priority, meta.cache_salt)
            return
        first_lp = None
        if req.HasField("first_logprob"):
            lp = req.first_logprob
            first_lp = TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
        out, plan = engine.add_prefilled(
            rid, list(req.prompt_token_ids), req.first_token_id, params, meta.priority, meta.cache_salt, first_lp
        )
        self._detok_q.put(("out", out))  # the first token streams before the pull
        kv = req.kv
        peer = self._peers[kv.address]
        if plan is None:  # finished already, or recomputed here: the prefill worker can free its blocks
            self.agent.send_notification(peer, kv.lease_id.encode())  # type: ignore[union-attr]
            return
        if kv.lease_expires_unix_ms / 1000 - time.time() < LEASE_SAFETY_S:
            log.warning("lease %s for %s is about to expire: recomputing here", kv.lease_id, rid)
            engine.kv_failed(rid)
            return
        remote = list(kv.block_ids[plan.num_cached_blocks :])
        handle = self.agent.start_read(peer, remote, plan.local_block_ids, kv.lease_id.encode())  # type: ignore[union-attr]
        self._pulls[rid] = _Pull(handle, peer, kv.lease_id, started_ns=time.time_ns(), trace_ctx=trace_ctx)

    def _abort(self, engine: LLMEngine, rid: str) -> None:
        pull = self._pulls.get(rid)
        if pull is not None:
            pull.aborted = True  # its blocks are freed when the READ is over, never under it
        else:
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
                kind = msg[0]
                if kind == "stop":
                    return
                if kind == "add":
                    proc.add(msg[1], msg[2], msg[3])
                elif kind == "discard":
                    proc.discard(msg[1])
                elif kind == "out":
                    self._detok_one(proc, msg[1], ready)
                elif kind == "outs":
                    for o in msg[1]:
                        self._detok_one(proc, o, ready)
            if ready:
                self.call_in_aio(self._deliver_many, ready)

    def _detok_one(self, proc: OutputProcessor, o: RequestOutput, ready: list[tuple[str, _Item]]) -> None:
        d = proc.process(o.request_id, o.new_token_ids, o.finished, o.finish_reason)
        if d is None:
            return
        if d.stopped_by_string:
            self.loop.submit(lambda e, rid=o.request_id: self._abort(e, rid))  # type: ignore[union-attr]
        if d.finished:
            self.metrics.requests.labels(d.finish_reason.value if d.finish_reason else "abort").inc()
        ready.append((o.request_id, _Item(d, o.logprobs, o.num_prompt_tokens, o.num_output_tokens,
                                          o.num_cached_tokens)))

    def _deliver_many(self, ready: list[tuple[str, _Item]]) -> None:
        for rid, item in ready:
            self._deliver(rid, item)

    def _deliver(self, rid: str, item: _Item) -> None:
        q = self.streams.get(rid)
        if q is not None:
            q.put_nowait(item)

    # -- handshake with prefill workers (asyncio) --------------------------------------------------------
    async def ensure_peer(self, kv: common_pb2.KvHandle) -> None:
        """Handshake with a prefill worker once; again after the agent dropped it (it restarted or died)."""
        assert self.agent is not None
        known = self._peers.get(kv.address)
        if known is not None and self.agent.has_peer(known):
            return
        lock = self._peer_locks.setdefault(kv.address, asyncio.Lock())
        async with lock:
            known = self._peers.get(kv.address)
            if known is not None and self.agent.has_peer(known):
                return
            hs = self.agent.handshake_payload()
            async with grpc.aio.insecure_channel(kv.address, options=rpc.GRPC_OPTIONS) as ch:
                resp = await prefill_pb2_grpc.PrefillStub(ch).KvHandshake(
                    prefill_pb2.KvHandshakeRequest(
                        peer_agent=hs.agent_name, peer_metadata=hs.agent_metadata, compat=compat_proto(hs.compat)
                    ),
                    timeout=10,
                )
            try:
                self.agent.add_peer(resp.agent_name, resp.agent_metadata, resp.kv_descriptors,
                                    KvCompat.from_message(resp.compat))
            except KvIncompatibleError as e:
                raise PeerRefused(f"{self.cfg.name} refuses prefill worker {resp.agent_name}: {e}") from e
            self._peers[kv.address] = resp.agent_name


def _merge(items: list[_Item]) -> decode_pb2.TokenDelta:
    """Several deltas of one stream in one message (a stream that fell behind catches up in one send)."""
    last = items[-1]
    msg = decode_pb2.TokenDelta(
        text="".join(i.delta.text for i in items),
        token_ids=[t for i in items for t in i.delta.token_ids],
        logprobs=[logprob_proto(lp) for i in items for lp in (i.logprobs or [])],
        finish_reason=FINISH_TO_PROTO[last.delta.finish_reason] if last.delta.finished else 0,
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
        w.engine.validate(prompt, params)  # reads only config: safe off the engine thread
        if request.HasField("kv"):
            await w.ensure_peer(request.kv)
        q: asyncio.Queue[_Item | BaseException] = asyncio.Queue()
        w.streams[rid] = q
        w.metrics.prompt_tokens.inc(len(prompt))
        finished = False
        span = telemetry.start_span("decode", attributes={"request_id": rid, "prompt_tokens": len(prompt)})
        trace_ctx = telemetry.context_with(span)
        try:
            w._detok_q.put(("add", rid, prompt, params))
            await asyncio.wrap_future(w.loop.submit(lambda e: w._admit(e, rid, request, params, trace_ctx)))
            while not finished:
                items = [await q.get()]
                while not q.empty():
                    items.append(q.get_nowait())
                for it in items:
                    if isinstance(it, BaseException):
                        raise it
                finished = items[-1].delta.finished  # type: ignore[union-attr]
                if finished:
                    last: _Item = items[-1]  # type: ignore[assignment]
                    reason = last.delta.finish_reason.value if last.delta.finish_reason else "abort"
                    telemetry.finish(span, attributes={"output_tokens": last.output_tokens, "finish_reason": reason})
                yield _merge(items)  # type: ignore[arg-type]
        except BaseException as e:
            if not finished:  # cancelled, or failed
                telemetry.finish(span, attributes={"finish_reason": "abort"}, error=e)
            raise
        finally:
            w.streams.pop(rid, None)
            if not finished:  # the client went away (or an error): free the blocks within a step
                w.loop.submit(lambda e: w._abort(e, rid))
                w._detok_q.put(("discard", rid))


def serve(cfg: ServiceConfig) -> int:
    """``tokenmill serve decode``."""
    return rpc.run(DecodeWorker(cfg), cfg)
