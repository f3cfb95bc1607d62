"""Router placement: the cost (prefix overlap vs load, accounting between reports, conditional disaggregation)
as unit tests, then the service over real gRPC with workers' Report streams."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from tokenmill.v1 import common_pb2, router_pb2, router_pb2_grpc

from common.cluster_config import RouterConfig
from common.hashing import HashKeys, prefix_block_hashes
from services.router.placement import LoadReport, NoWorkers, Role, WorkerTable, price
from services.router.server import RouterService
from tests.services.harness import HOST, Reporter, cluster, free_port, serving, wait_for_workers

MODEL = "SmolLM2-135M-Instruct"
BS = 16
PROMPT = list(range(100, 100 + 160))  # 10 full blocks
HASHES = prefix_block_hashes(PROMPT, BS, HashKeys(MODEL))


def load(wid: str, role: Role = Role.DECODE, free: int = 1000, total: int = 1000, queued: int = 0,
         stored=(), **kw) -> LoadReport:
    return LoadReport(wid, f"{HOST}:1{len(wid)}", role, MODEL, BS, free, total, queued_prefill_tokens=queued,
                      stored=list(stored), **kw)


def table(*reports: LoadReport, **policy) -> WorkerTable:
    t = WorkerTable(RouterConfig(**{"prefill_threshold_tokens": 256, **policy}))
    for r in reports:
        t.report(r, now=0.0, stream=r.worker_id)
    return t


def test_prefix_overlap_wins_when_loads_are_equal():
    t = table(load("decode-a"), load("decode-b", stored=HASHES[:8]))
    d = t.place(PROMPT, 32, "", now=1.0)
    assert d.decode.last.worker_id == "decode-b" and d.prefill is None
    assert d.cached_blocks == 8
    # the router's hashes are the engine's: a different cache salt shares nothing
    t2 = table(load("decode-a"), load("decode-b", stored=HASHES[:8]))
    assert t2.place(PROMPT, 32, "tenant-x", now=1.0).cached_blocks == 0


def test_load_wins_when_imbalance_is_large():
    # b holds 8 of the 10 blocks but 900 of its 1000 blocks are in use; a is idle
    t = table(load("decode-a"), load("decode-b", free=100, stored=HASHES[:8]))
    d = t.place(PROMPT, 32, "", now=1.0)
    assert d.decode.last.worker_id == "decode-a"
    # the same imbalance with a heavy weight on prefill still prefers a: 900 blocks outweigh 8 saved
    t = table(load("decode-a"), load("decode-b", free=100, stored=HASHES[:8]), prefill_weight=4.0)
    assert t.place(PROMPT, 32, "", now=1.0).decode.last.worker_id == "decode-a"
    # a small imbalance loses to the cache hit
    t = table(load("decode-a"), load("decode-b", free=995, stored=HASHES[:8]))
    assert t.place(PROMPT, 32, "", now=1.0).decode.last.worker_id == "decode-b"


def test_cost_matches_the_documented_formula():
    t = table(load("decode-a", free=900, queued=40, stored=HASHES[:3]))
    w = t.workers["decode-a"]
    c = price(w, len(PROMPT), 64, HASHES, prefill_here=True, weight=2.0)
    queued_blocks, prompt_blocks, overlap = 3, 10, 3  # ceil(40/16), 160/16
    new = (160 + 64) // 16 - overlap
    assert c.overlap_blocks == overlap and c.new_blocks == new
    assert c.cost == 2.0 * (queued_blocks + prompt_blocks - overlap) + (100 + new)
    c = price(w, len(PROMPT), 64, HASHES, prefill_here=False, weight=2.0)  # KV pulled: only its queue counts
    assert c.cost == 2.0 * queued_blocks + (100 + new)


def test_placements_between_reports_are_counted_until_the_next_report():
    t = table(load("decode-a"), load("decode-b"))
    first = t.place(PROMPT, 32, "", now=1.0)
    assert first.decode.last.worker_id == "decode-a"  # a tie goes to the smaller id
    assert t.workers["decode-a"].inflight_blocks == 12 and t.workers["decode-a"].inflight_requests == 1
    second = t.place(PROMPT, 32, "", now=1.0)
    assert second.decode.last.worker_id == "decode-b"  # a's in-flight request counts against it
    third = t.place(PROMPT, 32, "", now=1.0)
    assert third.decode.last.worker_id == "decode-a"
    # a reports (its load now includes what was placed): in-flight counters reset, the report is the truth
    t.report(load("decode-a", free=1000 - 24), now=1.5, stream="decode-a")
    assert t.workers["decode-a"].inflight_blocks == 0
    assert t.workers["decode-b"].inflight_blocks == 12
    # a: 24 blocks in use (reported); b: 12 blocks and 160 prefill tokens still in flight → 46 vs 44
    assert t.place(PROMPT, 32, "", now=1.6).decode.last.worker_id == "decode-b"


def test_conditional_disaggregation():
    long_prompt = list(range(1000, 1000 + 600))
    t = table(load("decode-a"), load("prefill-a", Role.PREFILL))
    d = t.place(long_prompt, 16, "", now=1.0)
    assert d.prefill is not None and d.prefill.last.worker_id == "prefill-a" and "remote" in d.reason
    assert t.workers["prefill-a"].inflight_prefill_tokens == 600
    assert t.workers["decode-a"].inflight_prefill_tokens == 0  # it pulls the KV, it does not compute it
    d = t.place(PROMPT, 16, "", now=1.0)  # 160 tokens < 256
    assert d.prefill is None and "< threshold 256" in d.reason
    # a cached prefix makes the uncached part short: local
    cached = prefix_block_hashes(long_prompt, BS, HashKeys(MODEL))
    t = table(load("decode-a", stored=cached[:30]), load("prefill-a", Role.PREFILL))
    assert t.place(long_prompt, 16, "", now=1.0).prefill is None
    # a saturated prefill pool: local
    t = table(load("decode-a"), load("prefill-a", Role.PREFILL, queued=20000))
    d = t.place(long_prompt, 16, "", now=1.0)
    assert d.prefill is None and "saturated" in d.reason


def test_draining_excluded_and_silent_workers_are_skipped():
    t = table(load("decode-a"), load("decode-b", draining=True), load("decode-c"), worker_timeout_s=5.0)
    assert t.place(PROMPT, 1, "", now=1.0, exclude=["decode-a"]).decode.last.worker_id == "decode-c"
    t.report(load("decode-c"), now=10.0, stream="decode-c")
    assert t.place(PROMPT, 1, "", now=10.0).decode.last.worker_id == "decode-c"  # a is silent since 0
    assert sorted(t.forget_silent(now=10.0)) == ["decode-a", "decode-b"]
    with pytest.raises(NoWorkers, match="draining, silent or excluded"):
        t.place(PROMPT, 1, "", now=10.0, exclude=["decode-c"])
    with pytest.raises(NoWorkers, match="no decode worker has registered"):
        table().place(PROMPT, 1, "", now=0.0)


def test_router_over_grpc():
    async def body():
        port = free_port()
        cfg = cluster(**{"router.port": port, "router.worker_timeout_s": 1.0})
        async with serving(RouterService(cfg.service("router", 0)), cfg, "router", port):
            addr = f"{HOST}:{port}"
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                place = router_pb2.PlaceRequest(meta=common_pb2.RequestMeta(request_id="r1"),
                                                prompt_token_ids=PROMPT, max_tokens=16)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Place(place)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "no decode worker has registered" in e.value.details()

                a, b = Reporter(addr), Reporter(addr)
                common = dict(role=router_pb2.WORKER_ROLE_DECODE, model_id=MODEL, block_size=BS,
                              free_blocks=1000, total_blocks=1000)
                await a.send(worker_id="decode-a", address="127.0.0.1:1", **common)
                await b.send(worker_id="decode-b", address="127.0.0.1:2", **common,
                             kv_events=router_pb2.KvEvents(stored=HASHES[:5]))
                ws = await wait_for_workers(addr, 2)
                assert [w.worker_id for w in ws] == ["decode-a", "decode-b"]
                p = await stub.Place(place)
                assert (p.decode.worker_id, p.decode.address, p.cached_blocks) == ("decode-b", "127.0.0.1:2", 5)
                assert not p.HasField("prefill") and p.reason

                await b.close()  # stream ended: forgotten at once
                await wait_for_workers(addr, 1)
                assert (await stub.Place(place)).decode.worker_id == "decode-a"
                await asyncio.sleep(1.5)  # a keeps its stream open but stops reporting: forgotten
                await wait_for_workers(addr, 0)
                await a.close()

                bad = Reporter(addr)
                await bad.send(worker_id="w", address="x:1", role=router_pb2.WORKER_ROLE_DECODE, block_size=0)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await bad.call
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "block_size" in e.value.details()
                await bad.channel.close()

    asyncio.run(body())


def test_a_worker_in_a_long_step_sends_heartbeats_and_is_not_forgotten():
    """The engine thread takes the snapshots; while one waits on a step longer than the router's timeout, the
    worker's stream sends heartbeats: the router keeps the worker, and its placements since the last real report
    stay counted."""
    from common.load_report import report_forever

    async def body():
        port = free_port()
        cfg = cluster(**{"router.port": port, "router.worker_timeout_s": 0.5})
        app = RouterService(cfg.service("router", 0))
        async with serving(app, cfg, "router", port):
            addr = f"{HOST}:{port}"
            step = asyncio.Event()  # set: the "engine" finishes its long step
            calls = 0

            async def snapshot(first: bool) -> router_pb2.WorkerLoad:
                nonlocal calls
                calls += 1
                if calls == 3:
                    await step.wait()
                return router_pb2.WorkerLoad(worker_id="decode-a", address="127.0.0.1:1", model_id=MODEL,
                                             role=router_pb2.WORKER_ROLE_DECODE, block_size=BS, free_blocks=100,
                                             total_blocks=100, kv_events=router_pb2.KvEvents(reset=first))

            stop = asyncio.Event()
            task = asyncio.create_task(report_forever(addr, snapshot, 0.05, stop))
            await wait_for_workers(addr, 1)
            while calls < 3:  # the third snapshot is the long step
                await asyncio.sleep(0.01)
            async with grpc.aio.insecure_channel(addr) as ch:
                await router_pb2_grpc.RouterStub(ch).Place(router_pb2.PlaceRequest(
                    meta=common_pb2.RequestMeta(request_id="r"), prompt_token_ids=PROMPT, max_tokens=16))
            await asyncio.sleep(1.5)  # three timeouts long
            w = app.table.workers["decode-a"]
            assert w.inflight_requests == 1  # heartbeats kept the placement counted
            await wait_for_workers(addr, 1)
            step.set()
            while w.inflight_requests:  # the next real report clears it
                await asyncio.sleep(0.01)
            stop.set()
            await task

    asyncio.run(body())


def test_place_stream_answers_each_request_by_its_id_as_place_would():
    """``PlaceStream``: each request's reply carries its id and what ``Place`` gives for it (a placement, or the
    status ``Place`` would have ended with), and a refused request does not end the call."""
    async def body():
        port = free_port()
        cfg = cluster(**{"router.port": port})
        async with serving(RouterService(cfg.service("router", 0)), cfg, "router", port):
            addr = f"{HOST}:{port}"
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                call = stub.PlaceStream()

                def req(i: int, prompt: list[int]) -> router_pb2.PlaceStreamRequest:
                    return router_pb2.PlaceStreamRequest(id=i, request=router_pb2.PlaceRequest(
                        meta=common_pb2.RequestMeta(request_id=f"r{i}"), prompt_token_ids=prompt, max_tokens=16))

                await call.write(req(7, PROMPT))  # no worker yet
                r = await call.read()
                assert r.id == 7 and not r.HasField("placement")
                assert r.error_code == grpc.StatusCode.UNAVAILABLE.value[0]
                assert "no decode worker has registered" in r.error_message

                rep = Reporter(addr)
                await rep.send(worker_id="decode-a", address="127.0.0.1:1", role=router_pb2.WORKER_ROLE_DECODE,
                               model_id=MODEL, block_size=BS, free_blocks=1000, total_blocks=1000,
                               kv_events=router_pb2.KvEvents(stored=HASHES[:3]))
                await wait_for_workers(addr, 1)
                for i, prompt in ((8, PROMPT), (9, []), (10, PROMPT)):
                    await call.write(req(i, prompt))
                got = {r.id: r for r in [await call.read() for _ in range(3)]}
                assert sorted(got) == [8, 9, 10]
                for i in (8, 10):
                    p = got[i].placement
                    assert got[i].error_code == 0 and (p.decode.worker_id, p.cached_blocks) == ("decode-a", 3)
                    assert p == await stub.Place(req(i, PROMPT).request)  # what Place gives for it
                assert got[9].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert "prompt_token_ids is empty" in got[9].error_message
                await call.done_writing()
                assert await call.read() is grpc.aio.EOF
                await rep.close()

    asyncio.run(body())
