"""The decode worker's engine core (common/engine_core.py): requests into the engine, and KV pulls (``KvPulls``).

The front (services/decode/server.py) calls ``warm_link`` as a request with a lease comes in (off the engine thread,
at once), ``admit`` once a request is checked and its lease claimed, ``end_stream``
when a stream ends unfinished, and ``abort`` when the detokenizer saw a stop string or the output filter blocked
the stream. The step's outputs go to the front as ``outputs`` events; a pull's as ``first_token``, ``release_lease``,
``span``, ``recompute``, ``transfer`` and ``peer_dropped``.
"""

from __future__ import annotations

import os

from tokenmill.v1 import decode_pb2

from common.cluster_config import ServiceConfig
from common.engine import LLMEngine
from common.engine_core import Emit, WorkerCore
from common.sampling import SamplingParams
from common.sequence import Tenancy
from services.decode.kv_pull import KvPulls, Lease


class DecodeCore(WorkerCore):
    def __init__(self, cfg: ServiceConfig, emit: Emit) -> None:
        super().__init__(cfg, emit)
        # fault injection for the pulls' tests (services/decode/kv_pull.py)
        self.pulls = KvPulls(emit, os.environ.get("KV_PULL_FAULT"))

    def setup(self) -> LLMEngine:
        engine = super().setup()
        self.pulls.agent = self.agent
        return engine

    def busy(self) -> bool:
        return self.pulls.busy()

    def on_tick(self, engine: LLMEngine) -> None:
        self.pulls.on_tick(engine)

    def admit(self, rid: str, req: decode_pb2.DecodeRequest, params: SamplingParams, tenancy: Tenancy,
              lease: Lease | None) -> None:
        """Add the request; one with a lease goes to ``KvPulls``, which owns the lease from here."""
        assert self.engine is not None
        if lease is not None:
            self.pulls.admit(self.engine, rid, req, params, tenancy, lease)
            return
        meta = req.meta
        self.engine.add_request(rid, list(req.prompt_token_ids), params, meta.priority, meta.cache_salt,
                                prior_output_ids=list(req.prior_output_ids), tenancy=tenancy)

    def warm_link(self, peer: str, remote_block: int) -> None:
        """Off the engine thread (``CoreHandle.now``): wake the link to ``peer`` ahead of a pull from it."""
        if self.agent is not None:
            self.agent.warm_link(peer, remote_block)

    def end_stream(self, rid: str, lease: Lease | None, admitted: bool) -> None:
        """The stream ended unfinished. ``admitted``: its ``admit`` call was made (and so ran before this one)."""
        if admitted:
            self.abort(rid)
        elif lease is not None:  # never admitted, so no READ of ours runs under the lease: give it back
            self.pulls.end_unadmitted(lease)

    def abort(self, rid: str) -> None:
        assert self.engine is not None
        if not self.pulls.abort(rid):  # a pull in flight aborts the request when its READ is over
            self.engine.abort(rid)
