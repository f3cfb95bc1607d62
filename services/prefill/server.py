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

import grpc
from tokenmill.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc, router_pb2

from common import rpc, telemetry
from common.cluster_config import ServiceConfig
from common.engine import RequestOutput
from common.kv_transfer import KvCompat, KvIncompatibleError
from common.wire import sampling_params_from_proto, tenancy_from_meta
from common.worker import FINISH_TO_PROTO, WorkerBase, compat_proto, logprob_proto
from services.prefill.core import PrefillCore

log = logging.getLogger(__name__)



class PrefillWorker(WorkerBase):
    role_proto = router_pb2.WORKER_ROLE_PREFILL
    core_class = PrefillCore

    def __init__(self, cfg: ServiceConfig) -> None:
        super().__init__(cfg)
        self.lease_s = cfg.cluster.prefill.kv_lease_s
        # request id → its caller's future: the output and when its prompt left the waiting queue (ns)
        self._waiters: dict[str, asyncio.Future[tuple[RequestOutput, int]]] = {}

    def fail_requests(self, exc: Exception) -> None:
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(exc)
        self._waiters.clear()

    def register(self, server: grpc.aio.Server) -> list[str]:
        prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(self), server)
        return [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name, *self.register_admin(server)]

    # -- the core's events (engine thread or the core's pipe reader) ------------------------------------
    def ev_prefilled(self, done: list[tuple[RequestOutput, int]]) -> None:
        for o, scheduled_ns in done:
            self.call_in_aio(self._resolve, o, scheduled_ns)

    def ev_expired_lease(self) -> None:
        self.metrics.expired_leases.inc()

    def ev_transfer(self, seconds: float, nbytes: int, blocks: int) -> None:
        self.metrics.observe_transfer(seconds, nbytes, blocks)

    def _resolve(self, o: RequestOutput, scheduled_ns: int) -> None:
        fut = self._waiters.pop(o.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result((o, scheduled_ns))
        elif o.leased:  # nobody waits any more (cancelled): free at once
            self.cast("release_request", o.request_id)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, w: PrefillWorker) -> None:
        self.w = w

    @rpc.translate_errors
    @telemetry.traced("prefill")
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        w = self.w
        if w.draining:
            raise rpc.Unavailable(f"{w.cfg.name} is draining")
        assert w.info is not None
        rid = request.meta.request_id or uuid.uuid4().hex
        if rid in w._waiters:  # a second waiter under its id would orphan the first one's, which then waits forever
            raise ValueError(f"request id {rid!r} is already prefilling on {w.cfg.name}")
        params = sampling_params_from_proto(request.params)
        prompt = list(request.prompt_token_ids)
        await w.validate(prompt, params)
        if rid in w._waiters:  # came in while this one was checked
            raise ValueError(f"request id {rid!r} is already prefilling on {w.cfg.name}")
        tenancy = tenancy_from_meta(request.meta)
        fut: asyncio.Future[tuple[RequestOutput, int]] = asyncio.get_running_loop().create_future()
        w._waiters[rid] = fut
        w.metrics.prompt_tokens.inc(len(prompt))
        meta = request.meta
        telemetry.current_span().set_attributes({"request_id": rid, "prompt_tokens": len(prompt)})
        submitted_ns = time.time_ns()
        try:
            await w.call("add", rid, prompt, params, meta, tenancy)
            o, scheduled_ns = await fut
        except asyncio.CancelledError:
            w._waiters.pop(rid, None)
            w.cast("abort", rid)  # frees the blocks, computed or not
            raise
        finally:
            w._waiters.pop(rid, None)
        done_ns = time.time_ns()
        scheduled_ns = scheduled_ns or done_ns
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
                granted = await w.call("grant", o.request_id, len(o.kv_block_ids or ()), lease_id)
            except asyncio.CancelledError:  # the caller left while the lease was made (the grant runs all the same)
                w.cast("drop", lease_id, o.request_id)
                raise
            if not granted:
                raise rpc.NotFound(f"lease {lease_id!r} was released by its caller before it was granted")
            result.kv.CopyFrom(common_pb2.KvHandle(
                worker_id=w.info.agent_name, address=w.cfg.address, block_ids=o.kv_block_ids,
                num_tokens=len(prompt), lease_id=lease_id, lease_ms=int(w.lease_s * 1000),
            ))
        return result

    @rpc.translate_errors
    async def Release(self, request: prefill_pb2.ReleaseRequest, context: grpc.aio.ServicerContext):
        ok = await self.w.call("release", request.lease_id, request.unclaimed_only)
        return prefill_pb2.ReleaseResponse(released=ok)

    @rpc.translate_errors
    async def Claim(self, request: prefill_pb2.ClaimRequest, context: grpc.aio.ServicerContext):
        hold_s = await self.w.call("claim", request.lease_id)
        return prefill_pb2.ClaimResponse(hold_ms=int(hold_s * 1000))

    @rpc.translate_errors
    async def KvHandshake(self, request: prefill_pb2.KvHandshakeRequest, context: grpc.aio.ServicerContext):
        w = self.w
        # accept the decode worker (its metadata lets our notifications and its READs flow); refuse a mismatch
        try:
            await w.call("add_peer", request.peer_agent, request.peer_metadata, b"",
                         KvCompat.from_message(request.compat))
        except KvIncompatibleError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{w.cfg.name} refuses {request.peer_agent}: {e}")
        hs = await w.call("handshake")
        return prefill_pb2.KvHandshakeResponse(
            agent_name=hs.agent_name, agent_metadata=hs.agent_metadata, kv_descriptors=hs.kv_descriptors,
            compat=compat_proto(hs.compat),
        )


def serve(cfg: ServiceConfig) -> int:
    """``tokenmill serve prefill``."""
    return rpc.run(PrefillWorker(cfg), cfg)
