"""The Decode service: one engine in continuous batching, KV pulled over NIXL, text beside the loop.

Threads: the asyncio loop (gRPC), the engine loop (``EngineLoop``: steps, NIXL polls), and the detokenizer
(``OutputProcessor``: token ids → text, stop strings, the output filter of the request's tenant or model from the
config's ``output_filter``; a stream it blocks is aborted in the engine, its blocks freed, and its last message
carries ``FINISH_REASON_CONTENT_FILTER`` and ``filter_reason``). A request with a KV handle first claims its lease
(``Prefill.Claim``: the prefill worker holds the blocks for a stated time from then), streams its first token, then
pulls the blocks with one NIXL READ, checked once per step while the running batch goes on; when it lands the
sequence joins the batch. A refused claim, a failed READ, or a READ still running ``LEASE_SAFETY_S`` before the
claim's hold ends (timed on this worker's monotonic clock from before the Claim was sent) is given up and the prompt
recomputed here, so no READ ever runs past the hold. A stream that ends before its request reached the engine
(cancelled during the handshake or the claim) releases the lease itself (``Prefill.Release``).

Fault injection for tests (``KV_PULL_FAULT``): ``before:S`` holds each pull S seconds between its claim
and its READ; ``after:S`` treats each READ as in flight for at least S seconds after posting it.
"""

from __future__ import annotations

import asyncio
import logging
import os
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
from common.kv_transfer import KvCompat, KvIncompatibleError, KvReadHandle, KvTransferError
from common.output_filter import OutputPolicy, PolicySet
from common.output_processor import OutputProcessor, TextDelta
from common.sampling import SamplingParams
from common.sequence import Tenancy
from common.wire import sampling_params_from_proto, tenancy_from_meta
from common.worker import FINISH_TO_PROTO, WorkerBase, compat_proto, logprob_proto

log = logging.getLogger(__name__)

LEASE_SAFETY_S = 2.0  # a READ still running this close to the end of its claim's hold (or its last quarter) is given up
CLAIM_TIMEOUT_S = 5.0


def _fault_delays(spec: str | None) -> tuple[float, float]:
    """``KV_PULL_FAULT`` (``before:S`` / ``after:S``) as (delay before the READ, minimum READ time)."""
    if not spec:
        return 0.0, 0.0
    where, _, secs = spec.partition(":")
    if where not in ("before", "after"):
        raise ValueError(f"KV_PULL_FAULT={spec!r}: expected before:SECONDS or after:SECONDS")
    return (float(secs), 0.0) if where == "before" else (0.0, float(secs))


class PeerRefused(rpc.Unavailable):
    """The prefill worker's KV layout differs from ours (the message names every difference)."""


@dataclass
class _Pull:
    handle: KvReadHandle | None  # None: not posted yet (fault injection ``before``)
    peer: str
    lease_id: str
    deadline: float  # time.monotonic(): give the READ up after this (LEASE_SAFETY_S inside the claim's hold)
    remote: list[int]
    local: list[int]
    post_at: float = 0.0  # time.monotonic(): post the READ then (fault injection ``before``)
    observe_after: float = 0.0  # time.monotonic(): count it in flight until then (fault injection ``after``)
    aborted: bool = False
    started_ns: int = 0  # tracing: READ started (its span is made on the asyncio loop when it ends)
    trace_ctx: Any = None  # the request's ``decode`` span: the parent of ``kv_transfer``


@dataclass
class _Handoff:
    """Who frees a request's prefill lease: this handler until ``_admit`` runs on the engine thread (then the pull)."""

    kv: common_pb2.KvHandle | None
    admitted: bool = False  # engine thread


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
        self._pulls: dict[str, _Pull] = {}  # engine thread only
        self._peers: dict[str, str] = {}  # prefill address → its agent name (handshake done)
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._prefills = rpc.StubCache()  # Claim, Release and KvHandshake, one channel per prefill worker
        self._releases: set[asyncio.Task[None]] = set()
        self._delay_before, self._delay_after = _fault_delays(os.environ.get("KV_PULL_FAULT"))
        self.policies = PolicySet(cfg.cluster.output_filter, cfg.cluster.model)

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
        self._detok_q.put(_Stop())
        await self._prefills.close()

    def fail_requests(self, exc: Exception) -> None:
        for q in self.streams.values():
            q.put_nowait(exc)

    # -- engine thread -----------------------------------------------------------------------------------
    def on_outputs(self, outs: list[RequestOutput]) -> None:
        self._detok_q.put(_Outs(outs))  # one hand-off per step, not per token
        self.metrics.generation_tokens.inc(len(outs))

    def busy(self) -> bool:
        return bool(self._pulls)

    def on_tick(self, engine: LLMEngine) -> None:
        assert self.agent is not None
        for rid, pull in list(self._pulls.items()):
            now = time.monotonic()
            if pull.handle is None:  # fault injection: the READ is posted late
                if pull.aborted or now >= pull.deadline:
                    del self._pulls[rid]
                    self._give_back(pull)
                    if pull.aborted:
                        engine.abort(rid)
                    else:
                        log.warning("KV pull for %s from %s not started before its claim's hold: recomputing "
                                    "here", rid, pull.peer)
                        self._recompute(engine, rid, "read_timeout")
                elif now >= pull.post_at:
                    self._post(engine, rid, pull)
                continue
            state = self.agent.poll(pull.handle)
            if state == "PROC" and now >= pull.deadline:
                self._give_up(engine, rid, pull)
                continue
            if state == "PROC" or now < pull.observe_after:
                continue
            self.agent.release(pull.handle)
            del self._pulls[rid]
            h = pull.handle
            self.call_in_aio(telemetry.record_span, "kv_transfer", pull.started_ns, time.time_ns(), pull.trace_ctx,
                             {"bytes": h.nbytes, "blocks": h.num_blocks, "runs": h.runs, "peer": pull.peer},
                             None if state == "DONE" else f"KV pull {state}: {h.error}")
            if state == "DONE":
                self.metrics.observe_transfer(h.seconds, h.nbytes, h.num_blocks)
            else:
                self._give_back(pull)  # the READ failed: no completion notification frees the lease
            if pull.aborted:
                engine.abort(rid)
            elif state == "DONE":
                engine.kv_ready(rid)
            else:
                log.warning("KV pull for %s from %s failed (%s): recomputing here", rid, pull.peer, h.error)
                self._recompute(engine, rid, "read_failed")

    def _recompute(self, engine: LLMEngine, rid: str, reason: str) -> None:
        self.metrics.kv_recomputes.labels(reason).inc()
        engine.kv_failed(rid)

    def _give_back(self, pull: _Pull) -> None:
        """Tell the prefill worker its lease is free (no READ of ours runs under it); best effort."""
        try:
            self.agent.send_notification(pull.peer, pull.lease_id.encode())  # type: ignore[union-attr]
        except Exception as e:  # it went away (its blocks went with it), or NIXL refused: the lease expires
            log.info("could not give lease %s back to %s: %s", pull.lease_id, pull.peer, e)

    def _give_up(self, engine: LLMEngine, rid: str, pull: _Pull) -> None:
        """The READ outlived its claim's hold (less LEASE_SAFETY_S): cancel it and recompute here."""
        assert pull.handle is not None and self.agent is not None
        cancelled = self.agent.release(pull.handle)
        del self._pulls[rid]
        log.warning("KV pull for %s from %s still running %.1f s after its claim: %s, recomputing here", rid,
                    pull.peer, pull.handle.seconds, "cancelled" if cancelled else "NIXL could not cancel it")
        if cancelled:
            self._give_back(pull)
        if pull.aborted:
            engine.abort(rid)
        else:
            self._recompute(engine, rid, "read_timeout")

    def _post(self, engine: LLMEngine, rid: str, pull: _Pull) -> None:
        """Post the READ (engine thread); a READ that cannot be posted (the peer went away) is recomputed."""
        assert self.agent is not None
        try:
            pull.handle = self.agent.start_read(pull.peer, pull.remote, pull.local, pull.lease_id.encode())
        except (KvTransferError, ValueError) as e:  # the peer went away, or its handle names blocks it lacks
            del self._pulls[rid]
            self._give_back(pull)
            log.warning("KV pull for %s from %s could not start (%s): recomputing here", rid, pull.peer, e)
            self._recompute(engine, rid, "read_failed")
            return
        pull.started_ns = time.time_ns()
        pull.observe_after = time.monotonic() + self._delay_after

    def _admit(self, engine: LLMEngine, rid: str, req: decode_pb2.DecodeRequest, params: SamplingParams,
               tenancy: Tenancy, handoff: _Handoff, trace_ctx: Any = None, deadline: float | None = None) -> None:
        """Add the request (engine thread). With a KV handle: ``deadline`` is its claim's (None: the claim was
        refused, so the prompt is recomputed here)."""
        handoff.admitted = True
        meta = req.meta
        if not req.HasField("kv"):
            engine.add_request(rid, list(req.prompt_token_ids), params, meta.priority, meta.cache_salt,
                               prior_output_ids=list(req.prior_output_ids), tenancy=tenancy)
            return
        first_lp = None
        if req.HasField("first_logprob"):
            lp = req.first_logprob
            first_lp = TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
        out, plan = engine.add_prefilled(
            rid, list(req.prompt_token_ids), req.first_token_id, params, meta.priority, meta.cache_salt, first_lp,
            tenancy,
        )
        self._detok_q.put(_Out(out))  # the first token streams before the pull
        kv = req.kv
        peer = self._peers.get(kv.address, kv.worker_id)
        pull = _Pull(None, peer, kv.lease_id, deadline or 0.0, [], [], trace_ctx=trace_ctx)
        if plan is None:  # finished already, or no room: recomputed here; the prefill worker can free its blocks
            if deadline is not None:
                self._give_back(pull)
            if not out.finished:
                self.metrics.kv_recomputes.labels("no_room").inc()
            return
        if deadline is None:
            self._recompute(engine, rid, "claim_refused")
            return
        pull.remote = list(kv.block_ids[plan.num_cached_blocks :])
        pull.local = plan.local_block_ids
        self._pulls[rid] = pull
        if self._delay_before:
            pull.post_at = time.monotonic() + self._delay_before
        else:
            self._post(engine, rid, pull)

    def _end_stream(self, engine: LLMEngine, rid: str, handoff: _Handoff) -> None:
        """The stream ended unfinished (engine thread, after its ``_admit`` ran or was cancelled before running)."""
        if handoff.admitted:
            self._abort(engine, rid)
        elif handoff.kv is not None:  # never admitted, so no READ of ours runs under the lease: give it back
            self.call_in_aio(self.release_lease, handoff.kv)

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
            self.loop.submit(lambda e, rid=o.request_id: self._abort(e, rid))  # type: ignore[union-attr]
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

    # -- leases and handshakes with prefill workers (asyncio) -------------------------------------------
    def release_lease(self, kv: common_pb2.KvHandle) -> None:
        """Release a lease we took no READ under (claimed or not), in the background; best effort (it expires)."""

        async def release() -> None:
            try:
                await self._prefills.get(kv.address, prefill_pb2_grpc.PrefillStub).Release(
                    prefill_pb2.ReleaseRequest(lease_id=kv.lease_id), timeout=CLAIM_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.info("could not release lease %s on %s: %s (it expires)", kv.lease_id, kv.address, e.details())

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def claim(self, kv: common_pb2.KvHandle) -> float | None:
        """Claim the lease: the monotonic time by which our READ must be over (LEASE_SAFETY_S inside the hold,
        counted from before the Claim left), or None when the lease is gone or its holder unreachable."""
        stub = self._prefills.get(kv.address, prefill_pb2_grpc.PrefillStub)
        sent = time.monotonic()
        try:
            resp = await stub.Claim(prefill_pb2.ClaimRequest(lease_id=kv.lease_id), timeout=CLAIM_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("claim of lease %s on %s refused (%s: %s): recomputing here", kv.lease_id, kv.address,
                        e.code().name, e.details())
            return None
        hold = resp.hold_ms / 1000
        deadline = sent + hold - min(LEASE_SAFETY_S, hold / 4)
        return deadline if deadline > time.monotonic() else None

    async def ensure_peer(self, kv: common_pb2.KvHandle) -> None:
        """Handshake with a prefill worker once; again when the handle names another agent at that address (the
        worker restarted: an agent's name is unique to its process) or the agent dropped the peer (it died)."""
        assert self.agent is not None
        known = self._peers.get(kv.address)
        if known == kv.worker_id and self.agent.has_peer(known):
            return
        lock = self._peer_locks.setdefault(kv.address, asyncio.Lock())
        async with lock:
            known = self._peers.get(kv.address)
            if known == kv.worker_id and self.agent.has_peer(known):
                return
            if known is not None:
                self.agent.remove_peer(known)  # a restarted worker's old agent: never READ through it again
            hs = self.agent.handshake_payload()
            resp = await self._prefills.get(kv.address, prefill_pb2_grpc.PrefillStub).KvHandshake(
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
        handoff = _Handoff(request.kv if request.HasField("kv") else None)
        q: asyncio.Queue[_Item | BaseException] = asyncio.Queue()
        w.streams[rid] = q
        w.metrics.prompt_tokens.inc(len(prompt))
        finished = False
        span = telemetry.start_span("decode", attributes={"request_id": rid, "prompt_tokens": len(prompt)})
        trace_ctx = telemetry.context_with(span)
        try:
            deadline = None
            if handoff.kv is not None:
                try:
                    await w.ensure_peer(handoff.kv)
                except grpc.aio.AioRpcError as e:  # the prefill worker is gone: recompute here
                    log.warning("no KV handshake with %s (%s: %s): recomputing here", handoff.kv.address,
                                e.code().name, e.details())
                else:
                    deadline = await w.claim(handoff.kv)
            w._detok_q.put(_Add(rid, prompt, params, prior, w.policies.for_request(request.meta.tenant_id)))
            await asyncio.wrap_future(w.loop.submit(lambda e: w._admit(e, rid, request, params, tenancy, handoff,
                                                                        trace_ctx, deadline)))
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
            if not finished:  # the client went away (or an error): free the blocks (and lease) within a step
                w.loop.submit(lambda e: w._end_stream(e, rid, handoff))
                w._detok_q.put(_Discard(rid))


def serve(cfg: ServiceConfig) -> int:
    """``tokenmill serve decode``."""
    return rpc.run(DecodeWorker(cfg), cfg)
