"""The prefill worker's engine core (common/engine_core.py): prompts into the engine, and the leases that hold their
blocks for a decode worker's READ (the lease protocol: services/prefill/server.py).

Its events: ``prefilled`` (a step's outputs, each with when its prompt left the waiting queue, for tracing),
``expired_lease`` and ``transfer`` (a READ's figures, timed from the claim).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tokenmill.v1 import common_pb2

from common import rpc
from common.cluster_config import ServiceConfig
from common.engine import LLMEngine, RequestOutput
from common.engine_core import Emit, WorkerCore
from common.sampling import SamplingParams
from common.sequence import Tenancy

log = logging.getLogger(__name__)


@dataclass
class _Lease:
    request_id: str
    num_blocks: int
    granted: float  # time.monotonic()
    expires: float  # time.monotonic()
    claimed: float | None = None  # time.monotonic() of the Claim: a READ may be in flight


class PrefillCore(WorkerCore):
    def __init__(self, cfg: ServiceConfig, emit: Emit) -> None:
        super().__init__(cfg, emit)
        self.lease_s = cfg.cluster.prefill.kv_lease_s
        self._leases: dict[str, _Lease] = {}
        self._released: dict[str, float] = {}  # lease ids released before their grant → forget at
        # tracing: request id → when its prompt left the waiting queue (the tick before the step that took it; 0:
        # not yet). Approximate: the start of the first engine step that included it
        self._queued: dict[str, int] = {}
        self._tick_ns = 0  # the last tick, i.e. just before the step that follows it

    def setup(self) -> LLMEngine:
        engine = super().setup()
        engine.block_manager.find_runs = True  # every prompt's blocks are READ by a decode worker
        return engine

    def on_outputs(self, outs: list[RequestOutput]) -> None:
        done = []
        for o in outs:
            scheduled = self._queued.pop(o.request_id, None)
            done.append((o, scheduled or self._tick_ns))  # not seen leaving: computed in the one step it was in
        self.emit("prefilled", done)

    def busy(self) -> bool:
        return bool(self._leases)

    def on_tick(self, engine: LLMEngine) -> None:
        assert self.agent is not None
        if any(v == 0 for v in self._queued.values()):  # tracing: which prefills the last step took
            waiting = {s.request_id for s in engine.scheduler.waiting}
            for rid, v in self._queued.items():
                if v == 0 and rid not in waiting:
                    self._queued[rid] = self._tick_ns
        self._tick_ns = time.time_ns()
        for _peer, msg in self.agent.completed_notifications():
            self._end_lease(msg.decode(errors="replace"), read=True)
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
                self.emit("expired_lease")
                self._end_lease(lease_id)

    def _end_lease(self, lease_id: str, read: bool = False) -> bool:
        """Free a lease's blocks. ``read``: the decode worker's notification ended it: its transfer figures are
        recorded, timed from the claim (the READ's post and copy, and the notification's way back)."""
        assert self.engine is not None and self.agent is not None
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self.engine.release(lease.request_id)
        if read and lease.claimed is not None:
            self.emit("transfer", time.monotonic() - lease.claimed, lease.num_blocks * self.agent.bytes_per_block,
                      lease.num_blocks)
        return True

    # -- calls ----------------------------------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], params: SamplingParams, meta: common_pb2.RequestMeta,
            tenancy: Tenancy) -> None:
        assert self.engine is not None
        self.engine.add_request(rid, prompt, params, meta.priority, meta.cache_salt, prefill_only=True,
                                tenancy=tenancy)
        self._queued[rid] = 0

    def abort(self, rid: str) -> None:
        """The caller left: frees the blocks, computed or not."""
        assert self.engine is not None
        self._queued.pop(rid, None)
        self.engine.abort(rid)

    def release_request(self, rid: str) -> None:
        """A leased prompt nobody waits for any more: free its blocks at once."""
        assert self.engine is not None
        self.engine.release(rid)

    def release(self, lease_id: str, unclaimed_only: bool) -> bool:
        """The caller's Release. A lease not granted yet is remembered for ``lease_s``, so its grant frees the
        blocks at once; a claimed one is left to its claimer when ``unclaimed_only``."""
        lease = self._leases.get(lease_id)
        if lease is None:
            self._released[lease_id] = time.monotonic() + self.lease_s
            return False
        if unclaimed_only and lease.claimed is not None:
            return False
        return self._end_lease(lease_id)

    def claim(self, lease_id: str) -> float:
        """A decode worker is about to READ: hold the blocks ``lease_s`` from now; returns that hold in seconds."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise rpc.NotFound(f"lease {lease_id!r} is unknown or expired on {self.cfg.name} (leases wait "
                               f"{self.lease_s:g} s for a claim); recompute the prompt")
        lease.claimed = time.monotonic()
        lease.expires = lease.claimed + self.lease_s
        return self.lease_s

    def grant(self, rid: str, num_blocks: int, lease_id: str) -> bool:
        """Hold the prompt's blocks under the lease. False: its caller released it already (the blocks are free)."""
        assert self.engine is not None
        if lease_id in self._leases:
            self.engine.release(rid)
            raise ValueError(f"lease id {lease_id!r} is already in use on {self.cfg.name}; send a unique one")
        if self._released.pop(lease_id, None) is not None:
            self.engine.release(rid)
            return False
        now = time.monotonic()
        self._leases[lease_id] = _Lease(rid, num_blocks, now, now + self.lease_s)
        return True

    def drop(self, lease_id: str, rid: str) -> None:
        """The caller left while its lease was granted: free the blocks, granted or not."""
        assert self.engine is not None
        if not self._end_lease(lease_id):
            self.engine.release(rid)
