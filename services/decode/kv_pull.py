"""A decode worker's KV pulls: a prompt computed by a prefill worker comes here over NIXL, under that worker's lease.

Two halves. ``KvPeers``, in the worker's front (asyncio, a request's handler, before the request reaches the engine):
the handshake with each prefill worker (``ensure_peer``, through the engine core's agent), then the claim of the
request's lease (``Prefill.Claim``: the prefill worker holds the blocks for a stated time from then), and
``Prefill.Release`` for a lease no READ of ours ran under. ``KvPulls``, in the engine core (engine thread): ``admit``
adds the prefilled request (its first token streams at once) and posts one NIXL READ of the prompt's blocks;
``on_tick`` checks every READ once per step while the running batch goes on, and a landed READ makes the sequence
join the batch. What the front must do about a pull, KvPulls sends it as an event (``emit``): ``first_token``,
``release_lease``, ``span``, ``recompute``, ``transfer`` and ``peer_dropped`` (services/decode/server.py takes
them). A refused claim, a READ that fails or cannot be posted, or a READ still
running ``LEASE_SAFETY_S`` before the claim's hold ends (timed on this worker's monotonic clock from before the Claim
was sent) is given up and the prompt recomputed here, so no READ ever runs past the hold. An aborted request's
blocks are freed only when its READ is over, never under it.

The lease goes back once no READ of ours can run under it: the prefill worker frees it on the NIXL notification a
READ sends when it is over. Every other end (a READ that failed, was cancelled or never posted, blocks not needed, a
stream that ended before its request was admitted) releases it with ``Prefill.Release`` (``Lease``: who gives it
back when): a NIXL notification sent with no READ before it, on a new connection, was seen never to arrive. A lease
whose claim failed is left to expire.

Fault injection for tests (``KV_PULL_FAULT``): ``before:S`` holds each pull S seconds between its claim and its
READ; ``after:S`` treats each READ as in flight for at least S seconds after posting it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from tokenmill.v1 import common_pb2, decode_pb2, prefill_pb2, prefill_pb2_grpc

from common import rpc
from common.engine import LLMEngine, TokenLogprob
from common.kv_transfer import KvCompat, KvIncompatibleError, KvReadHandle, KvTransferAgent, KvTransferError
from common.leases import release_lease
from common.sampling import SamplingParams
from common.sequence import Tenancy
from common.worker import compat_proto

log = logging.getLogger(__name__)

LEASE_SAFETY_S = 2.0  # a READ still running this close to the end of its claim's hold (or its last quarter) is given up
CLAIM_TIMEOUT_S = 5.0


def fault_delays(spec: str | None) -> tuple[float, float]:
    """``KV_PULL_FAULT`` (``before:S`` / ``after:S``) as (delay before the READ, minimum READ time)."""
    if not spec:
        return 0.0, 0.0
    where, _, secs = spec.partition(":")
    if where not in ("before", "after"):
        raise ValueError(f"KV_PULL_FAULT={spec!r}: expected before:SECONDS or after:SECONDS")
    return (float(secs), 0.0) if where == "before" else (0.0, float(secs))


class PeerRefused(rpc.Unavailable):
    """The prefill worker's KV layout differs from ours (the message names every difference)."""


@dataclass(slots=True)
class Lease:
    """A request's prefill lease and who gives it back: its handler (``end_unadmitted``) while the request has not
    reached the engine, and from ``admit`` on, on the engine thread, the request's pull."""

    kv: common_pb2.KvHandle
    deadline: float | None = None  # time.monotonic() by which the READ must be over; None: not claimed (recompute)
    peer: str = ""  # the prefill worker's agent, once the handshake is done


@dataclass
class _Pull:
    handle: KvReadHandle | None  # None: not posted yet (fault injection ``before``)
    peer: str
    kv: common_pb2.KvHandle  # the lease
    deadline: float  # time.monotonic(): give the READ up after this (LEASE_SAFETY_S inside the claim's hold)
    remote: list[int]
    local: list[int]
    post_at: float = 0.0  # time.monotonic(): post the READ then (fault injection ``before``)
    observe_after: float = 0.0  # time.monotonic(): count it in flight until then (fault injection ``after``)
    aborted: bool = False
    started_ns: int = 0  # tracing: READ started (its span is made in the front when it ends)


class KvPulls:
    """The pulls in flight (engine thread, in the engine core). ``emit(kind, *args)`` sends the front an event;
    ``agent`` is set once the engine thread has made it, before any request comes."""

    def __init__(self, emit: Callable[..., None], fault: str | None = None) -> None:
        self.agent: KvTransferAgent | None = None
        self.emit = emit
        self._pulls: dict[str, _Pull] = {}
        self._delay_before, self._delay_after = fault_delays(fault)

    def busy(self) -> bool:
        return bool(self._pulls)

    def admit(self, engine: LLMEngine, rid: str, req: decode_pb2.DecodeRequest, params: SamplingParams,
              tenancy: Tenancy, lease: Lease) -> None:
        """Add the prefilled request and start its pull; the lease is the pull's from here. With no claim
        (``lease.deadline`` None) the prompt is recomputed here."""
        engine.pulls_kv()
        meta = req.meta
        first_lp = None
        if req.HasField("first_logprob"):
            lp = req.first_logprob
            first_lp = TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
        try:
            out, plan = engine.add_prefilled(
                rid, list(req.prompt_token_ids), req.first_token_id, params, meta.priority, meta.cache_salt, first_lp,
                tenancy,
            )
        except Exception:  # refused before it took a block (its first token breaks its grammar): the lease goes back
            self.end_unadmitted(lease)
            raise
        self.emit("first_token", out)  # the first token streams before the pull
        kv, deadline = lease.kv, lease.deadline
        pull = _Pull(None, lease.peer or kv.worker_id, kv, deadline or 0.0, [], [])
        if plan is None:  # finished already, or no room: recomputed here; the prefill worker can free its blocks
            if deadline is not None:
                self._give_back(pull)
            if not out.finished:
                self.emit("recompute", "no_room")
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

    def abort(self, rid: str) -> bool:
        """Abort the request when its pull is over (its blocks are freed then, never under the READ). False: it
        has no pull in flight (the caller aborts it in the engine)."""
        pull = self._pulls.get(rid)
        if pull is None:
            return False
        pull.aborted = True
        return True

    def on_tick(self, engine: LLMEngine) -> None:
        """Between two steps: post the READs due, check each READ once, and settle those that are over."""
        if not self._pulls:
            return
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
            self.emit("span", rid, "kv_transfer", pull.started_ns, time.time_ns(),
                      {"bytes": h.nbytes, "blocks": h.num_blocks, "runs": h.runs, "peer": pull.peer},
                      None if state == "DONE" else f"KV pull {state}: {h.error}")
            if state == "DONE":
                self.emit("transfer", h.seconds, h.nbytes, h.num_blocks)
            else:
                self._give_back(pull)  # the READ failed: no completion notification frees the lease
            if pull.aborted:
                engine.abort(rid)
            elif state == "DONE":
                engine.kv_ready(rid)
            else:
                log.warning("KV pull for %s from %s failed (%s): recomputing here", rid, pull.peer, h.error)
                self._recompute(engine, rid, "read_failed")
            if state != "DONE":
                self._report_if_dropped(pull.peer)

    def _report_if_dropped(self, peer: str) -> None:
        """After a failed READ: if the agent forgot the peer (it disconnected), tell the front, whose handshake
        cache (``KvPeers``) then handshakes again with that worker's next request."""
        if self.agent is not None and not self.agent.has_peer(peer):
            self.emit("peer_dropped", peer)

    def _recompute(self, engine: LLMEngine, rid: str, reason: str) -> None:
        self.emit("recompute", reason)
        engine.kv_failed(rid)

    def _give_back(self, pull: _Pull) -> None:
        """No READ of ours runs under the pull's lease (none was posted, or it is over without its notification)."""
        self.emit("release_lease", pull.kv)

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
        """Post the READ; a READ that cannot be posted (the peer went away) is recomputed."""
        assert self.agent is not None
        try:
            pull.handle = self.agent.start_read(pull.peer, pull.remote, pull.local, pull.kv.lease_id.encode())
        except (KvTransferError, ValueError) as e:  # the peer went away, or its handle names blocks it lacks
            del self._pulls[rid]
            self._give_back(pull)
            log.warning("KV pull for %s from %s could not start (%s): recomputing here", rid, pull.peer, e)
            self._report_if_dropped(pull.peer)
            self._recompute(engine, rid, "read_failed")
            return
        pull.started_ns = time.time_ns()
        pull.observe_after = time.monotonic() + self._delay_after

    def end_unadmitted(self, lease: Lease) -> None:
        """The lease's stream ended before its admission (engine thread, so ``admit`` will not run): no READ of
        ours runs under the lease: release it."""
        self.emit("release_lease", lease.kv)


class KvPeers:
    """The handshakes, claims and releases with prefill workers (the front's asyncio loop). ``call(method, *args)``
    awaits a call of the engine core (its agent's handshake, peers)."""

    def __init__(self, name: str, call: Callable[..., Awaitable[Any]],
                 now: Callable[..., None] | None = None) -> None:
        self.name = name
        self._call = call
        self._now = now  # a core call at once, off the engine thread (CoreHandle.now)
        self._peers: dict[str, str] = {}  # prefill address → its agent name (handshake done)
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._prefills = rpc.StubCache()  # Claim, Release and KvHandshake, one channel per prefill worker
        self._background = rpc.Background()

    async def close(self) -> None:
        await self._background.drain(timeout=2)  # the releases in flight, before their channels close
        await self._prefills.close()

    def forget(self, agent_name: str) -> None:
        """The engine core's agent dropped this prefill worker's agent (``peer_dropped``): the next request to
        that worker handshakes again."""
        for address, name in list(self._peers.items()):
            if name == agent_name:
                del self._peers[address]

    def warm(self, kv: common_pb2.KvHandle) -> None:
        """Wake the link to the lease's prefill worker ahead of the READ, which follows after the claim and the
        request's admission (a few ms): the engine core's agent reads one of the lease's blocks into its scratch
        block if the link sat idle (``KvTransferAgent.warm_link``). Only once the handshake with that worker is
        done; a first request to it goes without."""
        if self._now is not None and kv.block_ids and self._peers.get(kv.address) == kv.worker_id:
            self._now("warm_link", kv.worker_id, kv.block_ids[0])

    async def claim(self, lease: Lease) -> None:
        """Handshake with the lease's prefill worker if need be, then claim the lease: sets ``lease.deadline``
        (left None when the worker is gone or the claim refused: the prompt is recomputed here). Raises
        PeerRefused for a worker whose KV layout differs from ours."""
        try:
            await self.ensure_peer(lease.kv)
        except grpc.aio.AioRpcError as e:  # the prefill worker is gone: recompute here
            log.warning("no KV handshake with %s (%s: %s): recomputing here", lease.kv.address, e.code().name,
                        e.details())
            return
        lease.deadline = await self._claim(lease.kv)
        lease.peer = self._peers.get(lease.kv.address, lease.kv.worker_id)

    async def _claim(self, kv: common_pb2.KvHandle) -> float | None:
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

    def release_lease(self, kv: common_pb2.KvHandle) -> None:
        """Release a lease we took no READ under (claimed or not), in the background."""
        release_lease(self._prefills, self._background, kv)

    async def ensure_peer(self, kv: common_pb2.KvHandle) -> None:
        """Handshake with a prefill worker once; again when the handle names another agent at that address (the
        worker restarted: an agent's name is unique to its process) or the agent dropped the peer (it died: the
        core reports it, ``forget``). A known peer costs no call to the engine core, whose calls wait for a step
        boundary: a request's first token would wait with them. A peer dropped since its report was sent costs one
        recompute, as any READ that cannot be posted does."""
        known = self._peers.get(kv.address)
        if known == kv.worker_id:
            return
        lock = self._peer_locks.setdefault(kv.address, asyncio.Lock())
        async with lock:
            known = self._peers.get(kv.address)
            if known == kv.worker_id and await self._call("has_peer", known):
                return
            if known is not None:
                await self._call("remove_peer", known)  # a restarted worker's old agent: never READ through it again
            hs = await self._call("handshake")
            resp = await self._prefills.get(kv.address, prefill_pb2_grpc.PrefillStub).KvHandshake(
                prefill_pb2.KvHandshakeRequest(
                    peer_agent=hs.agent_name, peer_metadata=hs.agent_metadata, compat=compat_proto(hs.compat)
                ),
                timeout=10,
            )
            try:
                await self._call("add_peer", resp.agent_name, resp.agent_metadata, resp.kv_descriptors,
                                 KvCompat.from_message(resp.compat))
            except KvIncompatibleError as e:
                raise PeerRefused(f"{self.name} refuses prefill worker {resp.agent_name}: {e}") from e
            self._peers[kv.address] = resp.agent_name
