"""``KvPeers`` (the decode front's handshakes with prefill workers) without processes: a known peer costs no call to
the engine core, whose calls wait for a step boundary; a peer the core reports dropped, or another agent at the same
address, is handshaken again."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenmill.v1 import common_pb2, prefill_pb2

from common.kv_transfer import KvCompat, KvHandshake
from common.worker import compat_proto
from services.decode.kv_pull import KvPeers

COMPAT = KvCompat(protocol_version=1, model_id="smollm2", dtype="float32", num_layers=30, num_kv_heads=3, head_dim=64,
                  block_size=16, layout="block-major")


class _Prefill:
    """The prefill worker's side of the handshake: its agent's name per call."""

    def __init__(self) -> None:
        self.agent = "prefill-0.100"
        self.handshakes = 0

    async def KvHandshake(self, req: prefill_pb2.KvHandshakeRequest, timeout: float) -> prefill_pb2.KvHandshakeResponse:
        self.handshakes += 1
        return prefill_pb2.KvHandshakeResponse(agent_name=self.agent, agent_metadata=b"meta",
                                               kv_descriptors=b"descs", compat=compat_proto(COMPAT))


def _kv(worker: str) -> common_pb2.KvHandle:
    return common_pb2.KvHandle(worker_id=worker, address="127.0.0.1:9000", block_ids=[4, 5], lease_id="l1")


def test_known_peers_cost_no_core_call_and_dropped_ones_are_handshaken_again() -> None:
    calls: list[tuple[Any, ...]] = []
    agents: set[str] = set()

    async def call(method: str, *args: Any) -> Any:  # the engine core's agent, as the core answers for it
        calls.append((method, *args))
        if method == "handshake":
            return KvHandshake("decode-0.200", b"dmeta", b"", COMPAT)
        if method == "add_peer":
            agents.add(args[0])
        elif method == "remove_peer":
            agents.discard(args[0])
        elif method == "has_peer":
            return args[0] in agents
        return None

    async def run() -> None:
        prefill = _Prefill()
        peers = KvPeers("decode-0", call)
        peers._prefills.get = lambda address, stub: prefill  # type: ignore[method-assign]
        await peers.ensure_peer(_kv("prefill-0.100"))
        assert [c[0] for c in calls] == ["handshake", "add_peer"] and prefill.handshakes == 1
        calls.clear()
        for _ in range(3):  # known: neither the core nor the prefill worker is asked again
            await peers.ensure_peer(_kv("prefill-0.100"))
        assert calls == [] and prefill.handshakes == 1
        peers.forget("prefill-0.100")  # the core's agent dropped it (a READ found it gone)
        agents.discard("prefill-0.100")
        await peers.ensure_peer(_kv("prefill-0.100"))
        assert [c[0] for c in calls] == ["handshake", "add_peer"] and prefill.handshakes == 2
        calls.clear()
        prefill.agent = "prefill-0.101"  # the worker restarted at the same address: a new agent
        await peers.ensure_peer(_kv("prefill-0.101"))
        assert [c[0] for c in calls] == ["remove_peer", "handshake", "add_peer"], calls
        assert calls[0][1] == "prefill-0.100" and agents == {"prefill-0.101"}

    asyncio.run(run())


def test_a_failed_pull_reports_a_peer_its_agent_dropped() -> None:
    """``KvPulls`` after a READ that failed or could not be posted: ``peer_dropped`` only for a peer the agent
    forgot (it disconnected), so the front's cache above handshakes again."""
    from services.decode.kv_pull import KvPulls

    events: list[tuple[Any, ...]] = []
    pulls = KvPulls(lambda kind, *args: events.append((kind, *args)))

    class _Agent:
        def has_peer(self, name: str) -> bool:
            return name == "prefill-0.100"

    pulls.agent = _Agent()  # type: ignore[assignment]
    pulls._report_if_dropped("prefill-0.100")
    pulls._report_if_dropped("prefill-1.300")
    assert events == [("peer_dropped", "prefill-1.300")]
