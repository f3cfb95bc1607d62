"""The Prefill service: computes a prompt (chunked, prefix-cached), samples the first token, and holds the
prompt's blocks under a lease until the decode worker has pulled them.

A lease waits ``prefill.kv_lease_s`` for the decode worker's ``Claim``; a claim holds the blocks for that long
again, for the READ. It ends on the NIXL notification of the decode worker's READ (the READ is over), on
``Release`` (no READ will run under it: the caller left, or the decode worker gave its pull up), or on expiry. The caller names the lease in its request, so a caller that gives up on a
Prefill call releases the lease whether or not the result reached it: a Release that comes before the grant
makes the grant free the blocks at once. Every time is on this worker's own monotonic clock: the decode worker learns
only durations, and gives up its READ well inside the hold (services/decode), so expiry never frees blocks under a
READ, and a late decode gets NOT_FOUND and recomputes instead of another request's bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
from tokenmill.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc, router_pb2

from common import rpc, telemetry
from common.cluster_config import ServiceConfig
from common.engine import LLMEngine, RequestOutput
from common.kv_transfer import KvCompat, KvIncompatibleError
from common.sampling import SamplingParams
from common.sequence import Tenancy
from common.wire import sampling_params_from_proto, tenancy_from_meta
from common.worker import FINISH_TO_PROTO, WorkerBase, compat_proto, logprob_proto

log = logging.getLogger(__name__)



@dataclass
class _Lease:
    request_id: str
    num_blocks: int
    granted: float  # time.monotonic()
    expires: float  # time.monotonic()
    claimed: float | None = None  # time.monotonic() of the Claim: a READ may be in flight


@dataclass
class _Queued:
    """Tracing: when a prefill left the waiting queue. Approximate: the start of the first engine step that
    included it (the tick before that step; found by the next tick, or by its output). 0: not yet."""

    scheduled_ns: int = 0


class PrefillWorker(WorkerBase):
    role_proto = router_pb2.WORKER_ROLE_PREFILL

    def __init__(self, cfg: ServiceConfig) -> None:
        super().__init__(cfg)
        self.lease_s = cfg.cluster.prefill.kv_lease_s
        self._waiters: dict[str, asyncio.Future[RequestOutput]] = {}  # asyncio side
        self._leases: dict[str, _Lease] = {}  # engine thread only
        self._released: dict[str, float] = {}  # engine thread only: lease ids released before their grant → forget at
        self._unscheduled: dict[str, _Queued] = {}  # engine thread only (tracing)
        self._tick_ns = 0  # engine thread: the last tick, i.e. just before the step that follows it

    def fail_requests(self, exc: Exception) -> None:
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(exc)
        self._waiters.clear()

    def register(self, server: grpc.aio.Server) -> list[str]:
        prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(self), server)
        return [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name]

    # -- engine thread -----------------------------------------------------------------------------------
    def on_outputs(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            queued = self._unscheduled.pop(o.request_id, None)
            if queued is not None:  # computed in the one step it was scheduled in
                queued.scheduled_ns = self._tick_ns
            self.call_in_aio(self._resolve, o)

    def _resolve(self, o: RequestOutput) -> None:
        fut = self._waiters.pop(o.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(o)
        elif o.leased:  # nobody waits any more (cancelled): free at once
            assert self.loop is not None  # the output came from the running loop
            self.loop.submit(lambda e: e.release(o.request_id))

    def busy(self) -> bool:
        return bool(self._leases)

    def on_tick(self, engine: LLMEngine) -> None:
        assert self.agent is not None
        if self._unscheduled:  # tracing: which prefills the last step took from the waiting queue
            waiting = {s.request_id for s in engine.scheduler.waiting}
            for rid in [r for r in self._unscheduled if r not in waiting]:
                self._unscheduled.pop(rid).scheduled_ns = self._tick_ns
        self._tick_ns = time.time_ns()
        for _peer, msg in self.agent.completed_notifications():
            self._end_lease(engine, msg.decode(errors="replace"), read=True)
        now = time.monotonic()
        for lease_id in [k for k, forget in self._released.items() if forget <= now]:
            del self._released[lease_id]
        for lease_id, lease in list(self._leases.items()):
            if lease.expires <= now:
                if lease.claimed is None:
                    log.warning("lease %s (%s) expired unclaimed after %.1f s: freeing its blocks", lease_id,
                                lease.request_id, self.lease_s)
                else:
                    log.warning("lease %s (%s) expired %.1f s after its claim with no word from the decode "
                                "worker (which gives its READ up before then): freeing its blocks", lease_id,
                                lease.request_id, self.lease_s)
                self.metrics.expired_leases.inc()
                self._end_lease(engine, lease_id)

    def _end_lease(self, engine: LLMEngine, lease_id: str, read: bool = False) -> bool:
        """Free a lease's blocks. ``read``: the decode worker's notification ended it: its transfer figures are
        recorded, timed from the claim (the READ's post and copy, and the notification's way back)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        engine.release(lease.request_id)
        if read and lease.claimed is not None:
            assert self.agent is not None
            self.metrics.observe_transfer(time.monotonic() - lease.claimed,
                                          lease.num_blocks * self.agent.bytes_per_block, lease.num_blocks)
        return True

    def _release(self, engine: LLMEngine, lease_id: str, unclaimed_only: bool) -> bool:
        """The caller's Release. A lease not granted yet is remembered for ``lease_s``, so its grant frees the
        blocks at once; a claimed one is left to its claimer when ``unclaimed_only``."""
        lease = self._leases.get(lease_id)
        if lease is None:
            self._released[lease_id] = time.monotonic() + self.lease_s
            return False
        if unclaimed_only and lease.claimed is not None:
            return False
        return self._end_lease(engine, lease_id)

    def _claim(self, lease_id: str) -> float:
        """A decode worker is about to READ: hold the blocks ``lease_s`` from now; returns that hold in seconds."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise rpc.NotFound(f"lease {lease_id!r} is unknown or expired on {self.cfg.name} (leases wait "
                               f"{self.lease_s:g} s for a claim); recompute the prompt")
        lease.claimed = time.monotonic()
        lease.expires = lease.claimed + self.lease_s
        return self.lease_s

    def _add(self, engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
             meta: common_pb2.RequestMeta, tenancy: Tenancy, queued: _Queued) -> None:
        engine.add_request(rid, prompt, params, meta.priority, meta.cache_salt, prefill_only=True, tenancy=tenancy)
        self._unscheduled[rid] = queued

    def _grant(self, engine: LLMEngine, o: RequestOutput, lease_id: str) -> bool:
        """Hold the prompt's blocks under the lease. False: its caller released it already (the blocks are free)."""
        if lease_id in self._leases:
            engine.release(o.request_id)
            raise ValueError(f"lease id {lease_id!r} is already in use on {self.cfg.name}; send a unique one")
        if self._released.pop(lease_id, None) is not None:
            engine.release(o.request_id)
            return False
        now = time.monotonic()
        self._leases[lease_id] = _Lease(o.request_id, len(o.kv_block_ids or ()), now, now + self.lease_s)
        return True

    def _drop(self, engine: LLMEngine, lease_id: str, request_id: str) -> None:
        """The caller left while its lease was granted: free the blocks, granted or not."""
        if not self._end_lease(engine, lease_id):
            engine.release(request_id)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, w: PrefillWorker) -> None:
        self.w = w

    @rpc.translate_errors
    @telemetry.traced("prefill")
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        w = self.w
        if w.draining:
            raise rpc.Unavailable(f"{w.cfg.name} is draining")
        assert w.engine is not None and w.loop is not None and w.agent is not None
        rid = request.meta.request_id or uuid.uuid4().hex
        if rid in w._waiters:  # a second waiter under its id would orphan the first one's, which then waits forever
            raise ValueError(f"request id {rid!r} is already prefilling on {w.cfg.name}")
        params = sampling_params_from_proto(request.params)
        prompt = list(request.prompt_token_ids)
        w.engine.validate(prompt, params)
        tenancy = tenancy_from_meta(request.meta)
        fut: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        w._waiters[rid] = fut
        w.metrics.prompt_tokens.inc(len(prompt))
        meta = request.meta
        telemetry.current_span().set_attributes({"request_id": rid, "prompt_tokens": len(prompt)})
        queued, submitted_ns = _Queued(), time.time_ns()
        try:
            await asyncio.wrap_future(w.loop.submit(lambda e: w._add(e, rid, prompt, params, meta, tenancy, queued)))
            o = await fut
        except asyncio.CancelledError:
            w._waiters.pop(rid, None)
            w.loop.submit(lambda e: e.abort(rid))  # frees the blocks, computed or not
            raise
        finally:
            w._waiters.pop(rid, None)
        done_ns = time.time_ns()
        scheduled_ns = queued.scheduled_ns or done_ns
        telemetry.record_span("prefill.queue", submitted_ns, scheduled_ns)
        telemetry.record_span("prefill.compute", scheduled_ns, done_ns, None, {"cached_tokens": o.num_cached_tokens})
        result = prefill_pb2.PrefillResult(
            first_token_id=o.new_token_ids[0],
            cached_tokens=o.num_cached_tokens,
            finish_reason=FINISH_TO_PROTO[o.finish_reason],
        )
        if o.logprobs:
            result.first_logprob.CopyFrom(logprob_proto(o.logprobs[0]))
        if o.leased:
            lease_id = request.lease_id or uuid.uuid4().hex
            try:
                granted = await asyncio.wrap_future(w.loop.submit(lambda e: w._grant(e, o, lease_id)))
            except asyncio.CancelledError:  # the caller left while the lease was made (or before the grant ran)
                w.loop.submit(lambda e: w._drop(e, lease_id, o.request_id))
                raise
            if not granted:
                raise rpc.NotFound(f"lease {lease_id!r} was released by its caller before it was granted")
            result.kv.CopyFrom(common_pb2.KvHandle(
                worker_id=w.agent.name, address=w.cfg.address, block_ids=o.kv_block_ids,
                num_tokens=len(prompt), lease_id=lease_id, lease_ms=int(w.lease_s * 1000),
            ))
        return result

    @rpc.translate_errors
    async def Release(self, request: prefill_pb2.ReleaseRequest, context: grpc.aio.ServicerContext):
        w = self.w
        assert w.loop is not None
        lease_id, unclaimed_only = request.lease_id, request.unclaimed_only
        ok = await asyncio.wrap_future(w.loop.submit(lambda e: w._release(e, lease_id, unclaimed_only)))
        return prefill_pb2.ReleaseResponse(released=ok)

    @rpc.translate_errors
    async def Claim(self, request: prefill_pb2.ClaimRequest, context: grpc.aio.ServicerContext):
        w = self.w
        assert w.loop is not None
        hold_s = await asyncio.wrap_future(w.loop.submit(lambda e: w._claim(request.lease_id)))
        return prefill_pb2.ClaimResponse(hold_ms=int(hold_s * 1000))

    @rpc.translate_errors
    async def KvHandshake(self, request: prefill_pb2.KvHandshakeRequest, context: grpc.aio.ServicerContext):
        w = self.w
        assert w.agent is not None
        # accept the decode worker (its metadata lets our notifications and its READs flow); refuse a mismatch
        try:
            w.agent.add_peer(request.peer_agent, request.peer_metadata, b"", KvCompat.from_message(request.compat))
        except KvIncompatibleError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{w.cfg.name} refuses {request.peer_agent}: {e}")
        hs = w.agent.handshake_payload()
        return prefill_pb2.KvHandshakeResponse(
            agent_name=hs.agent_name, agent_metadata=hs.agent_metadata, kv_descriptors=hs.kv_descriptors,
            compat=compat_proto(hs.compat),
        )


def serve(cfg: ServiceConfig) -> int:
    """``tokenmill serve prefill``."""
    return rpc.run(PrefillWorker(cfg), cfg)
