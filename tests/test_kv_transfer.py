"""common.kv_transfer: a decode process READs a prefill process's KV blocks over NIXL, byte for byte.

Real separate processes (multiprocessing spawn), the SmolLM2 KV shape in float32 (30 layers, block 16, 3 KV heads,
head dim 64: 720 KiB a block), 64 blocks a pool. The scenario runs once per module and pool placement (host memory;
both pools on one GPU; prefill on GPU 0 and decode on GPU 1); the tests check its parts.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

from common.kv_transfer import (  # noqa: E402
    VRAM_POLL_S,
    KvCompat,
    KvIncompatibleError,
    KvReadHandle,
    KvTransferAgent,
    decode_descriptors,
    encode_descriptors,
)

SHAPE = (64, 30, 2, 16, 3, 64)
REMOTE = [5, 9, 10, 40]
LOCAL = [0, 1, 2, 3]
NOTIF = b"lease-7f3a"
RUN_REMOTE = list(range(20, 28))
RUN_LOCAL = list(range(30, 38))
DEAD_LOCAL = [40, 41, 42, 43]
TIMEOUT = 60.0


def _err(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


def _prefill_main(conn, device: str) -> None:
    torch.set_num_threads(1)
    from common.kv_transfer import KvCompat, KvTransferAgent

    g = torch.Generator().manual_seed(7)
    kv = torch.randn(SHAPE, generator=g).to(device)
    agent = KvTransferAgent("test-prefill", kv, KvCompat.for_pool(kv, "smollm2"), role="prefill")
    conn.send(agent.handshake_payload())
    notifs: list[tuple[str, bytes]] = []
    while True:
        notifs.extend(agent.completed_notifications())
        if not conn.poll(0.002):
            continue
        cmd, arg = conn.recv()
        if cmd == "add_peer":  # what the KvHandshake RPC does: decode's metadata and compat, no descriptors
            try:
                agent.add_peer(arg[0], arg[1], b"", arg[3])
                conn.send(None)
            except Exception as e:
                conn.send(_err(e))
        elif cmd == "blocks":
            conn.send(kv[arg].cpu())
        elif cmd == "notifs":
            deadline = time.monotonic() + arg
            while not notifs and time.monotonic() < deadline:
                notifs.extend(agent.completed_notifications())
                time.sleep(0.001)
            conn.send(notifs)
            notifs = []
        elif cmd == "stop":
            agent.close()
            conn.send(None)
            return


def _decode_main(conn, device: str) -> None:
    torch.set_num_threads(1)
    from common.kv_transfer import KvTransferAgent

    kv = torch.zeros(SHAPE, device=device)
    agent = None
    try:
        hs = conn.recv()
        # warm-ups on in every scenario (a host pool's default is off), so the host run checks them too
        agent = KvTransferAgent("test-decode", kv, KvCompat.for_pool(kv, "smollm2"), role="decode", warm_links=True)
        conn.send(agent.handshake_payload())
        out = {}
        try:  # no handshake with this peer yet
            agent.start_read(hs.agent_name, REMOTE, LOCAL)
        except Exception as e:
            out["unknown_peer"] = _err(e)
        bad = KvCompat(**{**hs.compat.as_dict(), "block_size": 32, "dtype": "bfloat16"})
        try:
            agent.add_peer(hs.agent_name, hs.agent_metadata, hs.kv_descriptors, bad)
        except Exception as e:
            out["mismatch"] = _err(e)
        out["has_peer_after_mismatch"] = agent.has_peer(hs.agent_name)
        agent.add_peer(*hs)
        agent.add_peer(*hs)  # idempotent
        try:
            agent.start_read(hs.agent_name, [64], [0])
        except Exception as e:
            out["out_of_range"] = _err(e)
        h = agent.start_read(hs.agent_name, REMOTE, LOCAL, notif=NOTIF)
        deadline = time.monotonic() + TIMEOUT
        polls = 0
        while agent.poll(h) == "PROC" and time.monotonic() < deadline:
            polls += 1
            time.sleep(0.0005)
        out["state"], out["error"], out["polls"] = h.state, h.error, polls
        agent.release(h)
        out["blocks"] = kv[: len(LOCAL)].cpu()
        out["rest_untouched"] = bool((kv[len(LOCAL):] == 0).all())
        out["counters"] = agent.counters()
        out["bytes_per_block"] = agent.bytes_per_block
        # a second, blocking read of the same blocks in another order lands in other local blocks
        agent.read_blocks(hs.agent_name, REMOTE[::-1], [60, 50, 20, 11], timeout=TIMEOUT)
        out["reversed"] = kv[[60, 50, 20, 11]].cpu()
        # a run contiguous on both sides, handed over in descending order (as the free list returns a freed
        # sequence's blocks), is posted as one descriptor and lands in order
        h = agent.start_read(hs.agent_name, RUN_REMOTE[::-1], RUN_LOCAL[::-1])
        while agent.poll(h) == "PROC" and time.monotonic() < deadline:
            time.sleep(0.0005)
        out["run_state"], out["runs"] = h.state, h.runs
        agent.release(h)
        out["run_blocks"] = kv[RUN_LOCAL].cpu()
        import common.kv_transfer as kt

        # the idle threshold set for each check, so no scheduling delay of a loaded machine decides it
        kt.WARM_IDLE_S = 60.0  # every READ above ended within it: the link is awake
        out["warm_recent"] = agent.warm_link(hs.agent_name, REMOTE[0])
        kt.WARM_IDLE_S = 0.0  # any pause counts as idle
        out["warm_idle"] = agent.warm_link(hs.agent_name, REMOTE[0])
        kt.WARM_IDLE_S = 60.0
        out["warm_again"] = agent.warm_link(hs.agent_name, REMOTE[0])  # one just posted
        kt.WARM_IDLE_S = 0.0
        out["warm_unknown"] = agent.warm_link("nobody", REMOTE[0])
        out["warm_out_of_range"] = agent.warm_link(hs.agent_name, 64)
        if kv.is_cuda:
            torch.cuda.synchronize()  # UCX's copy streams are this process's too
        out["scratch"] = agent._scratch.cpu().numpy().tobytes()
        out["warm_counters"] = agent.counters()
        conn.send(out)
        conn.recv()  # prefill is gone now: a READ must fail or (VRAM) bring the exact bytes, never hang
        t0 = time.monotonic()
        try:
            agent.read_blocks(hs.agent_name, REMOTE, DEAD_LOCAL, timeout=20)
            # bytes, not a tensor: a CPU tensor crosses the pipe as a shared-memory fd that dies with this process
            out = {"dead_peer": None, "dead_peer_bytes": kv[DEAD_LOCAL].cpu().numpy().tobytes()}
        except Exception as e:
            out = {"dead_peer": _err(e)}
        out["dead_peer_s"] = time.monotonic() - t0
        out["has_peer_after_death"] = agent.has_peer(hs.agent_name)
        out["failures"] = agent.failures
        conn.send(out)
    except BaseException:
        conn.send({"crash": traceback.format_exc()})
    finally:
        if agent is not None:
            agent.close()


def _recv(conn, proc, what: str):
    deadline = time.monotonic() + TIMEOUT
    while not conn.poll(0.1):
        if not proc.is_alive():
            pytest.fail(f"the {proc.name} process died (exit {proc.exitcode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
    return conn.recv()


@pytest.fixture(scope="module", params=[
    ("cpu", "cpu"),
    pytest.param(("cuda:0", "cuda:0"), marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="no CUDA device")),
    pytest.param(("cuda:0", "cuda:1"), marks=[pytest.mark.gpu2, pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two CUDA devices")]),
], ids=["host", "one-gpu", "two-gpus"])
def scenario(request):
    """Both pools in host memory (local mode), both on one GPU, or prefill's on GPU 0 and decode's on GPU 1 (VRAM,
    where UCX picks cuda_ipc)."""
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    pre_dev, dec_dev = request.param
    pre = ctx.Process(name="prefill", target=_prefill_main, args=(p_child, pre_dev), daemon=True)
    dec = ctx.Process(name="decode", target=_decode_main, args=(d_child, dec_dev), daemon=True)
    pre.start()
    dec.start()
    try:
        res: dict = {}
        prefill_hs = _recv(p_conn, pre, "the prefill handshake")
        d_conn.send(prefill_hs)
        decode_hs = _recv(d_conn, dec, "the decode handshake")
        p_conn.send(("add_peer", decode_hs))
        res["prefill_add_peer"] = _recv(p_conn, pre, "prefill's add_peer")
        res.update(_recv(d_conn, dec, "the decode results"))
        if "crash" in res:
            pytest.fail("decode process failed:\n" + res["crash"])
        p_conn.send(("notifs", 10.0))
        res["notifs"] = _recv(p_conn, pre, "notifications")
        p_conn.send(("blocks", REMOTE))
        res["expected"] = _recv(p_conn, pre, "the prefill blocks")
        p_conn.send(("blocks", RUN_REMOTE))
        res["run_expected"] = _recv(p_conn, pre, "the prefill run")
        pre.kill()  # SIGKILL: no goodbye to UCX
        pre.join(10)
        d_conn.send("go")
        res.update(_recv(d_conn, dec, "the dead-peer read"))
        res["decode_hs"] = decode_hs
        yield res
    finally:
        for p in (dec, pre):
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


def test_scattered_blocks_arrive_exactly(scenario):
    assert scenario["state"] == "DONE", scenario["error"]
    exp, got = scenario["expected"], scenario["blocks"]
    assert got.shape == exp.shape == (4, *SHAPE[1:])
    assert got.numpy().tobytes() == exp.numpy().tobytes()  # bit for bit
    assert scenario["rest_untouched"], "a READ wrote outside the requested local blocks"
    assert scenario["reversed"].numpy().tobytes() == exp.flip(0).numpy().tobytes()


def test_a_descending_run_is_one_descriptor_and_lands_in_order(scenario):
    assert scenario["run_state"] == "DONE"
    assert scenario["runs"] == 1
    assert scenario["run_blocks"].numpy().tobytes() == scenario["run_expected"].numpy().tobytes()


def test_counters(scenario):
    c = scenario["counters"]
    assert c["transfers"] == 1 and c["failures"] == 0
    assert c["bytes_transferred"] == len(REMOTE) * scenario["bytes_per_block"] == 4 * 737_280
    assert c["transfer_seconds"] > 0
    assert c["busy_seconds"] == pytest.approx(c["transfer_seconds"])  # one READ at a time: busy while it ran
    # one READ posted; remote 5, 9-10, 40 against local 0, 1-2, 3: three runs contiguous on both sides
    assert c["posted"] == 1 and c["posted_descriptors"] == 3
    assert 0 < c["post_seconds"] <= c["transfer_seconds"]


def test_a_warm_up_read_wakes_an_idle_link_and_only_then(scenario):
    """``warm_link``: one block of the peer's into the agent's own scratch block, only after the link sat idle
    ``WARM_IDLE_S`` (set per check in the decode process), once, and only from a known peer's real block; no
    notification, no transfer counted."""
    assert scenario["warm_recent"] is False and scenario["warm_idle"] is True and scenario["warm_again"] is False
    assert scenario["warm_unknown"] is False and scenario["warm_out_of_range"] is False
    assert scenario["scratch"] == scenario["expected"][0].numpy().tobytes()  # REMOTE[0]'s bytes, exact
    c = scenario["warm_counters"]
    assert c["warmups"] == 1 and c["transfers"] == 3 and c["failures"] == 0  # the three READs before it
    assert scenario["notifs"] == [("test-decode", NOTIF)]  # the one notified READ's, nothing from the warm-up


def test_host_pools_and_prefill_agents_do_not_warm_links():
    """A host pool's READ is a copy by the CPU: no link to wake, so no scratch block and no warm-up READ."""
    from common.kv_transfer import KvTransferAgent

    kv = torch.zeros(SHAPE)
    with KvTransferAgent("test-no-warm", kv, KvCompat.for_pool(kv, "smollm2"), role="decode") as agent:
        assert agent.warm_links is False and agent._scratch is None
        assert agent.warm_link("anyone", 0) is False and agent.counters()["warmups"] == 0
    # a prefill agent reads nothing, so it warms nothing, even when asked (engine.kv_warm_links=true)
    with KvTransferAgent("test-prefill-no-warm", kv, KvCompat.for_pool(kv, "smollm2"), role="prefill",
                         warm_links=True) as agent:
        assert agent.warm_links is False and agent._scratch is None


def test_notification_reaches_prefill(scenario):
    assert scenario["prefill_add_peer"] is None
    assert ("test-decode", NOTIF) in scenario["notifs"]


def test_read_from_unknown_peer_is_refused(scenario):
    name, msg = scenario["unknown_peer"]
    assert name == "UnknownPeerError"
    assert "test-prefill" in msg and "add_peer" in msg


def test_compat_mismatch_is_refused_at_add_peer(scenario):
    name, msg = scenario["mismatch"]
    assert name == "KvIncompatibleError"
    assert "block_size: ours 16, peer 32" in msg and "dtype: ours float32, peer bfloat16" in msg
    assert scenario["has_peer_after_mismatch"] is False


def test_out_of_range_block_ids_are_refused(scenario):
    name, msg = scenario["out_of_range"]
    assert name == "ValueError" and "64 blocks" in msg


def test_dead_peer_fails_instead_of_hanging(scenario, request):
    """Host memory: the READ fails (process_vm_readv finds no process) and the peer is forgotten. VRAM: UCX's
    cuda_ipc mapping of the peer's pool keeps that memory alive in the driver after the peer dies, so the READ may
    also complete, and then with the exact bytes the peer wrote."""
    assert scenario["dead_peer_s"] < 20
    if scenario["dead_peer"] is None:
        assert "gpu" in request.node.callspec.id, "a READ from a killed peer in host memory succeeded"
        assert scenario["dead_peer_bytes"] == scenario["expected"].numpy().tobytes(), "a dead peer's READ brought junk"
        return
    assert scenario["dead_peer"][0] in ("KvTransferError", "KvTransferTimeout")
    assert scenario["failures"] >= 1
    assert scenario["has_peer_after_death"] is False  # forgotten: the next request redoes the handshake


# -- no processes: compat, descriptors, runs -------------------------------------------------------------------
@pytest.mark.parametrize("remote, local, sorted_remote, sorted_local, runs", [
    ([3, 4, 5], [7, 8, 9], [3, 4, 5], [7, 8, 9], 1),
    ([5, 4, 3], [9, 8, 7], [3, 4, 5], [7, 8, 9], 1),  # a freed sequence's blocks come back in descending order
    ([5, 4, 3], [7, 8, 9], [3, 4, 5], [9, 8, 7], 3),  # contiguous on one side only
    ([1, 2, 10, 11, 12], [0, 1, 5, 6, 7], [1, 2, 10, 11, 12], [0, 1, 5, 6, 7], 2),
    ([8], [2], [8], [2], 1),
])
def test_pair_runs_sorts_by_remote_and_counts_runs(remote, local, sorted_remote, sorted_local, runs):
    from common.kv_transfer import pair_runs

    r, loc, n = pair_runs(remote, local)
    assert r.tolist() == sorted_remote and loc.tolist() == sorted_local and n == runs


def _compat(**kw) -> KvCompat:
    base = dict(protocol_version=1, model_id="smollm2", dtype="float32", num_layers=30, num_kv_heads=3,
                head_dim=64, block_size=16, layout="block-major")
    return KvCompat(**{**base, **kw})


def test_compat_check_names_every_difference():
    ours = _compat()
    ours.check(_compat())
    with pytest.raises(KvIncompatibleError) as ei:
        ours.check(_compat(block_size=32, dtype="bfloat16"))
    msg = str(ei.value)
    assert "block_size: ours 16, peer 32" in msg and "dtype: ours float32, peer bfloat16" in msg
    assert "model_id" not in msg


def test_compat_from_pool_and_message():
    kv = torch.zeros(SHAPE)
    c = KvCompat.for_pool(kv, "smollm2", "block-major")
    assert c == _compat()
    assert KvCompat.from_message(type("Msg", (), c.as_dict())()) == c


def test_descriptor_round_trip_and_garbage():
    import numpy as np

    addrs = np.arange(5, dtype=np.uint64) * 4096 + 1 << 20
    arr, mem = decode_descriptors(encode_descriptors(addrs, 4096, "VRAM", 3))
    assert mem == "VRAM" and arr.shape == (5, 3)
    assert (arr[:, 0] == addrs).all() and (arr[:, 1] == 4096).all() and (arr[:, 2] == 3).all()
    from common.kv_transfer import KvTransferError

    for junk in (b"", b"\x80\x04pickle", encode_descriptors(addrs, 4096, "DRAM", 0)[:-1]):
        with pytest.raises(KvTransferError):
            decode_descriptors(junk)


def test_the_poller_sleeps_through_most_of_a_reads_expected_time():
    """A VRAM READ is checked every VRAM_POLL_S only near its expected end: its bytes at the agent's expected rate
    (none yet: from the start). The rate learns from READs a check saw in flight after their due time; one first
    seen DONE by then grows it RATE_PROBE times."""
    kv = torch.zeros(SHAPE)
    with KvTransferAgent("pause", kv, KvCompat.for_pool(kv, "smollm2"), role="decode") as agent:
        assert agent._poll_pause(0.0) == VRAM_POLL_S  # no rate known yet
        done = KvReadHandle("p", 64, 64 << 20, started=time.perf_counter() - 0.01)
        agent._expect(done)
        agent._inflight.add(done)
        assert agent._settle(done, "DONE") == "DONE"
        assert agent._rate == pytest.approx((64 << 20) / 0.01, rel=0.2)  # the first: 64 MiB in ~10 ms
        agent._rate = 1e9
        h = KvReadHandle("p", 64, 100_000_000, started=10.0)  # 0.1 s at 1 GB/s
        agent._expect(h)
        agent._inflight.add(h)
        assert agent._poll_pause(10.0) == pytest.approx(0.075)  # VRAM_POLL_EARLY of its 0.1 s
        assert agent._poll_pause(10.074) == pytest.approx(0.001)
        assert agent._poll_pause(10.2) == VRAM_POLL_S  # overdue: checked closely
        agent._inflight.discard(h)
        small = KvReadHandle("p", 1, 1 << 20, started=time.perf_counter() - 0.01)
        agent._inflight.add(small)
        agent._settle(small, "DONE")
        assert agent._rate == 1e9  # a small READ's rate is mostly overhead: not counted
        # seen DONE at its first check after a sleep: it ended some time before, the rate was too low
        late = KvReadHandle("p", 64, 100_000_000, started=time.perf_counter() - 0.2)  # 0.2 s: 0.5 GB/s seen
        agent._expect(late)
        agent._inflight.add(late)
        agent._settle(late, "DONE")
        assert agent._rate == 2e9
        # in flight at a check after its due time, DONE at the next: the rate from between the two
        now = time.perf_counter()
        tight = KvReadHandle("p", 64, 100_000_000, started=now - 0.2, due=now - 0.15, checked=now - 0.1)
        agent._inflight.add(tight)
        agent._settle(tight, "DONE")
        assert agent._rate == pytest.approx(0.7 * 2e9 + 0.3 * 100_000_000 / 0.15, rel=0.01)
        for _ in range(80):  # READs that end at their post (a host pool's): the probes stop at a ceiling
            h = KvReadHandle("p", 64, 64 << 20, started=time.perf_counter())
            agent._expect(h)
            agent._inflight.add(h)
            agent._settle(h, "DONE")
        assert agent._rate == 10e12


@pytest.mark.parametrize("wake_s", [50e-6, 190e-6, 500e-6])
def test_a_late_wake_up_does_not_slow_the_next_reads_checks(monkeypatch, wake_s):
    """The checker wakes ``wake_s`` late every time (a GIL held elsewhere, a timer). READs of 0.42 ms: once the
    rate has settled, each is seen DONE within one check interval and one wake-up of its end. (Learning from the
    time a READ was seen DONE settled at four wake-ups a READ: 0.76 ms beside a 0.19 ms wake-up.)"""
    import common.kv_transfer as kt

    clock = [100.0]
    monkeypatch.setattr(kt, "time", type("T", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    kv = torch.zeros(SHAPE)
    true_s, nbytes = 0.42e-3, 128 << 20
    with KvTransferAgent("wake", kv, KvCompat.for_pool(kv, "smollm2"), role="decode") as agent:
        seen = []
        for i in range(40):
            start = clock[0]
            h = KvReadHandle("p", 64, nbytes, started=start)
            agent._expect(h)
            agent._inflight.add(h)
            agent._settle(h, "PROC")  # posted
            end = start + (15e-3 if i == 0 else true_s)  # the first READ sets up the connection
            clock[0] = start + agent._poll_pause(start) + wake_s
            while agent._settle(h, "DONE" if clock[0] >= end else "PROC") == "PROC":
                clock[0] += VRAM_POLL_S + wake_s
            seen.append(h.seconds)
            clock[0] += 0.01
        settled = seen[20:]
        assert max(settled) <= true_s + VRAM_POLL_S + 2 * wake_s + 1e-9, [round(x * 1e3, 3) for x in seen]


def test_without_nixl_the_agent_says_what_to_install():
    """A Python where NIXL does not import (a hand-built environment) gets one line naming the package, not a bare
    ModuleNotFoundError from deep in a worker's start."""
    import subprocess
    import sys

    code = f"""
import sys
sys.modules["nixl"] = sys.modules["nixl._api"] = None  # as if not installed
import torch
from common.kv_transfer import KvCompat, KvTransferAgent
kv = torch.zeros({SHAPE})
try:
    KvTransferAgent("no-nixl", kv, KvCompat.for_pool(kv, "smollm2"), role="decode")
except RuntimeError as e:
    print("error:", e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "error: the KV transfer agent needs NIXL" in r.stdout and "pip install nixl==" in r.stdout, r.stdout
