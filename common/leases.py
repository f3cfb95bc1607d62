"""The prefill lease's ``Release`` as the gateway and the decode worker call it: in the background, best effort (a
lease not released expires on its prefill worker after ``prefill.kv_lease_s``)."""

from __future__ import annotations

import logging

import grpc
from tokenmill.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

from common.rpc import Background, StubCache

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0


def release_lease(stubs: StubCache, background: Background, kv: common_pb2.KvHandle, unclaimed_only: bool = False
                  ) -> None:
    """Release ``kv``'s lease on its prefill worker (also from a cancelled handler). ``unclaimed_only``: only while
    no decode worker has claimed it (a claimed lease may have a READ under it)."""
    if not (kv.lease_id and kv.address):
        return

    async def release() -> None:
        try:
            await stubs.get(kv.address, prefill_pb2_grpc.PrefillStub).Release(
                prefill_pb2.ReleaseRequest(lease_id=kv.lease_id, unclaimed_only=unclaimed_only),
                timeout=RELEASE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("release of lease %s on %s failed: %s (it expires on its own)", kv.lease_id, kv.address,
                        e.details())

    background.spawn(release())
