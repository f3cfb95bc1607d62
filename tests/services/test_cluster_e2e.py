"""The whole cluster as a user runs it: ``tokenmill up`` (real processes, real gRPC, KV over NIXL), driven through
the public ``Frontend.Generate`` API and checked against the single-process engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from tokenmill.v1 import (
    common_pb2,
    frontend_pb2,
    frontend_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    tokenizer_pb2,
)

from common.sampling import SamplingParams
from tests.prompts import CHAT, PLAIN
from tests.services.harness import HOST, running_cluster

MAX_LEN = 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("cluster"), "--decodes", "2", "--tokenizers", "1",
                         "--set", f"engine.max_model_len={MAX_LEN}", "--set", "router.prefill_threshold_tokens=200",
                         "--grace", "3") as info:
        yield info


def procs(info, role):
    return [p for p in info["processes"] if p["role"] == role]


def metric(p, name, **labels: str) -> float:
    """The sum of process ``p``'s ``name`` series (those with ``labels``, when given; a labelled series a process
    never set is 0, otherwise the metric must be there)."""
    text = urllib.request.urlopen(f"http://{HOST}:{p['metrics_port']}/metrics", timeout=5).read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    found = False
    for line in text.splitlines():
        if (line.startswith(name + " ") or line.startswith(name + "{")) and all(w in line for w in want):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found or labels, f"{name} not in {p['name']}'s /metrics"
    return total


def wait_for(pred, timeout=10.0, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def all_blocks_free(info, role):
    return all(metric(p, "tokenmill:kv_blocks_free") == metric(p, "tokenmill:kv_blocks_total")
               for p in procs(info, role) if p.get("alive", True))


async def generate(stub, req):
    text, ids, last = "", [], None
    async for r in stub.Generate(req):
        text += r.text
        ids += list(r.token_ids)
        last = r
    return text, ids, last


def chat_req(content, **params):
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=content)],
                                      add_generation_prompt=True)
    return frontend_pb2.GenerateRequest(chat=chat, params=common_pb2.SamplingParams(**params))


def test_64_concurrent_streams_equal_the_single_process_engine(cluster, engine):
    tk = engine.tokenizer
    short = [(c, tk.encode(tk.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False))
             for c in CHAT]
    longs = [(p * 12, tk.encode(p * 12)) for p in PLAIN]  # 60-250 tokens: several above the prefill threshold
    reqs, ids = [], []
    for i in range(64):
        if i % 4 == 3:
            text, toks = longs[i % len(longs)]
            reqs.append(frontend_pb2.GenerateRequest(prompt=text, params=common_pb2.SamplingParams(
                temperature=0, max_tokens=16)))
        else:
            text, toks = short[i % len(short)]
            reqs.append(chat_req(text, temperature=0, max_tokens=16))
        ids.append(toks)
    refs = engine.generate(ids, SamplingParams(max_tokens=16, temperature=0.0))
    nixl_before = sum(metric(p, "tokenmill:nixl_xfer_bytes") for p in procs(cluster, "decode"))

    async def run():
        async with grpc.aio.insecure_channel(cluster["gateway"]) as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            return await asyncio.gather(*(generate(stub, r) for r in reqs))

    outs = asyncio.run(run())
    for i, ((text, toks, last), ref) in enumerate(zip(outs, refs)):
        assert toks == ref.token_ids, f"stream {i}"
        assert text == ref.text, f"stream {i}"
        assert last.usage.prompt_tokens == len(ids[i]) and last.usage.completion_tokens == len(toks)
    assert sum(metric(p, "tokenmill:nixl_xfer_bytes") for p in procs(cluster, "decode")) > nixl_before
    wait_for(lambda: all_blocks_free(cluster, "decode") and all_blocks_free(cluster, "prefill"), 10, "free blocks")


def test_client_cancel_frees_blocks(cluster):
    async def cancel_after(req, n_msgs):
        async with grpc.aio.insecure_channel(cluster["gateway"]) as ch:
            call = frontend_pb2_grpc.FrontendStub(ch).Generate(req)
            got = 0
            async for _ in call:
                got += 1
                if got >= n_msgs:
                    call.cancel()
                    break
            return got

    # mid-stream, on a decode worker
    assert asyncio.run(cancel_after(chat_req("Tell me a long story.", temperature=0, max_tokens=400,
                                             ignore_eos=True), 3)) == 3
    wait_for(lambda: all_blocks_free(cluster, "decode"), 5, "decode blocks freed after cancel")
    # right after the first token of a remotely prefilled prompt: the lease and the pulled blocks are freed
    long = frontend_pb2.GenerateRequest(prompt="The history of the printing press begins " * 40,
                                        params=common_pb2.SamplingParams(temperature=0, max_tokens=300,
                                                                         ignore_eos=True))
    assert asyncio.run(cancel_after(long, 1)) == 1
    wait_for(lambda: all_blocks_free(cluster, "decode") and all_blocks_free(cluster, "prefill"), 10,
             "blocks freed after cancel between prefill and decode")


def test_disconnect_at_every_phase_returns_every_block(cluster):
    """Clients that go away after 0 ms to 1.5 s, so some leave during tokenization or placement, some while
    their prompt waits for or runs on the prefill worker, some during the KV pull and some mid-decode: every
    worker's free blocks return to the total."""
    delays = [0.0, 0.001, 0.003, 0.01, 0.02, 0.04, 0.07, 0.1, 0.15, 0.25, 0.4, 0.6, 0.9, 1.5]

    async def one(stub, i: int, delay: float) -> None:
        req = frontend_pb2.GenerateRequest(prompt=f"Request {i} asks about printing presses and rivers. " * 30,
                                           params=common_pb2.SamplingParams(temperature=0, max_tokens=300,
                                                                            ignore_eos=True))
        call = stub.Generate(req)
        drain = asyncio.ensure_future(_drain(call))
        await asyncio.wait([drain], timeout=delay)
        call.cancel()
        await asyncio.gather(drain, return_exceptions=True)  # CANCELLED, or done if it finished first

    async def _drain(call) -> None:
        async for _ in call:
            pass

    async def run():
        async with grpc.aio.insecure_channel(cluster["gateway"]) as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            await asyncio.gather(*(one(stub, i, d) for i, d in enumerate(delays)))

    asyncio.run(run())
    def held():
        return {p["name"]: (metric(p, "tokenmill:kv_blocks_free"), metric(p, "tokenmill:kv_blocks_total"),
                            metric(p, "tokenmill:num_requests_running"))
                for role in ("prefill", "decode") for p in procs(cluster, role)}

    deadline = time.monotonic() + 30
    while not (all_blocks_free(cluster, "decode") and all_blocks_free(cluster, "prefill")):
        if time.monotonic() > deadline:
            pytest.fail(f"blocks still held 30 s after disconnects at every phase; free/total/running: {held()}")
        time.sleep(0.2)


def test_release_frees_a_lease_nobody_pulls(cluster, engine):
    [pre] = procs(cluster, "prefill")
    ids = engine.tokenizer.encode("An unpulled prompt. " * 30)
    with grpc.insecure_channel(pre["address"]) as ch:
        stub = prefill_pb2_grpc.PrefillStub(ch)
        res = stub.Prefill(prefill_pb2.PrefillRequest(
            meta=common_pb2.RequestMeta(request_id="lonely"), prompt_token_ids=ids,
            params=common_pb2.SamplingParams(temperature=0, max_tokens=8)), timeout=60)
        assert len(res.kv.block_ids) == -(-len(ids) // 16)
        assert metric(pre, "tokenmill:kv_blocks_free") < metric(pre, "tokenmill:kv_blocks_total")
        assert stub.Release(prefill_pb2.ReleaseRequest(lease_id=res.kv.lease_id)).released
        assert not stub.Release(prefill_pb2.ReleaseRequest(lease_id=res.kv.lease_id)).released
    wait_for(lambda: all_blocks_free(cluster, "prefill"), 5, "prefill blocks freed by Release")


def test_release_before_the_grant_frees_the_blocks_at_once(cluster, engine):
    """A caller that gave up on its Prefill call releases the lease by the id it chose, before the worker granted
    it: the grant then frees the blocks at once; a claimed lease is not freed by an unclaimed-only Release."""
    [pre] = procs(cluster, "prefill")
    ids = engine.tokenizer.encode("A prompt released before its grant. " * 30)
    with grpc.insecure_channel(pre["address"]) as ch:
        stub = prefill_pb2_grpc.PrefillStub(ch)
        assert not stub.Release(prefill_pb2.ReleaseRequest(lease_id="early")).released
        with pytest.raises(grpc.RpcError) as e:
            stub.Prefill(prefill_pb2.PrefillRequest(
                meta=common_pb2.RequestMeta(request_id="early"), prompt_token_ids=ids, lease_id="early",
                params=common_pb2.SamplingParams(temperature=0, max_tokens=8)), timeout=60)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "released by its caller" in e.value.details()
        assert all_blocks_free(cluster, "prefill")

        res = stub.Prefill(prefill_pb2.PrefillRequest(
            meta=common_pb2.RequestMeta(request_id="claimed"), prompt_token_ids=ids, lease_id="claimed",
            params=common_pb2.SamplingParams(temperature=0, max_tokens=8)), timeout=60)
        assert res.kv.lease_id == "claimed"
        assert stub.Claim(prefill_pb2.ClaimRequest(lease_id="claimed")).hold_ms > 0
        assert not stub.Release(prefill_pb2.ReleaseRequest(lease_id="claimed", unclaimed_only=True)).released
        assert metric(pre, "tokenmill:kv_blocks_free") < metric(pre, "tokenmill:kv_blocks_total")
        assert stub.Release(prefill_pb2.ReleaseRequest(lease_id="claimed")).released
    wait_for(lambda: all_blocks_free(cluster, "prefill"), 5, "prefill blocks freed by Release")


def test_a_prefill_cancelled_while_its_lease_is_granted_leaves_no_lease(cluster):
    """A prefill computed in one step has its lease granted when the engine thread is between steps, i.e. after the
    step in progress. Calls cancelled in that gap (timed from an uncancelled run of the same traffic) free their
    blocks at once, not when a lease expires; the others' leases are released as they come back."""
    [pre] = procs(cluster, "prefill")

    def prompt(wave: int, i: int, n: int) -> list[int]:  # distinct first tokens: no prefix-cache hits
        return [1000 + 10 * wave + i] + [504 + j % 300 for j in range(n - 1)]

    async def wave(n: int, cancel_a_at: float | None = None) -> tuple[float, float, bool]:
        """A blocker (1000 tokens, one step), then a short prompt A with three long ones: A is done in the second
        step and its grant waits for the third. Returns when the blocker's and A's results came back, and whether
        A's call was cancelled before its result."""
        async with grpc.aio.insecure_channel(pre["address"]) as ch:
            stub = prefill_pb2_grpc.PrefillStub(ch)
            t0 = time.monotonic()

            async def call(i: int, length: int, delay: float = 0.0) -> float | None:
                await asyncio.sleep(delay)
                c = stub.Prefill(prefill_pb2.PrefillRequest(
                    meta=common_pb2.RequestMeta(request_id=f"w{n}-{i}"), prompt_token_ids=prompt(n, i, length),
                    params=common_pb2.SamplingParams(temperature=0, max_tokens=8)), timeout=120)
                if i == 1 and cancel_a_at is not None:
                    asyncio.get_running_loop().call_later(cancel_a_at - (time.monotonic() - t0), c.cancel)
                try:
                    res = await c
                except asyncio.CancelledError:
                    return None
                back = time.monotonic() - t0
                await stub.Release(prefill_pb2.ReleaseRequest(lease_id=res.kv.lease_id))
                return back

            done = await asyncio.gather(call(0, 1000), call(1, 10, 0.05), *(call(i, 1000, 0.05) for i in (2, 3, 4)))
            return done[0], done[1] or 0.0, done[1] is None

    blocker_back, a_back, _ = asyncio.run(wave(0))
    assert a_back > blocker_back, (blocker_back, a_back)
    # a loaded machine times the next waves a little differently: cancel at a few points of the gap
    cancelled = []
    for n, at in enumerate((0.35, 0.5, 0.65), start=1):
        cancelled.append(asyncio.run(wave(n, cancel_a_at=blocker_back + at * (a_back - blocker_back)))[2])
        wait_for(lambda: all_blocks_free(cluster, "prefill"), 5, "the cancelled prefill's blocks freed")
    assert any(cancelled), "every cancel came after A's result: the waves did not reach the grant's gap"


def test_prompt_lengths_at_the_edges(cluster):
    async def run(req):
        async with grpc.aio.insecure_channel(cluster["gateway"]) as ch:
            return await generate(frontend_pb2_grpc.FrontendStub(ch), req)

    one = frontend_pb2.GenerateRequest(prompt_token_ids=frontend_pb2.TokenIds(ids=[504]),
                                       params=common_pb2.SamplingParams(temperature=0, max_tokens=4))
    _, toks, last = asyncio.run(run(one))
    assert len(toks) == 4 and last.usage.prompt_tokens == 1
    full = frontend_pb2.GenerateRequest(prompt_token_ids=frontend_pb2.TokenIds(ids=[504] * (MAX_LEN - 4)),
                                        params=common_pb2.SamplingParams(temperature=0, max_tokens=4,
                                                                         ignore_eos=True))
    _, toks, last = asyncio.run(run(full))  # exactly the context limit: prompt + max_tokens = 1024
    assert len(toks) == 4 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    over = frontend_pb2.GenerateRequest(prompt_token_ids=frontend_pb2.TokenIds(ids=[504] * (MAX_LEN - 3)),
                                        params=common_pb2.SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(run(over))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1021" in e.value.details() and "1024" in e.value.details(), e.value.details()


def test_metrics_count_requests(cluster):
    [gw] = procs(cluster, "gateway")
    assert metric(gw, "tokenmill:request_success_total") >= 64
    assert metric(gw, "tokenmill:time_to_first_token_seconds_count") >= 64
    for p in procs(cluster, "decode"):
        metric(p, "tokenmill:num_requests_running")
        metric(p, "tokenmill:prefix_cache_queries")
    assert sum(metric(p, "tokenmill:nixl_xfer_seconds") for p in procs(cluster, "decode")) > 0
    # every service times its garbage collections (the gateway's allocations have run generation 0 many times)
    assert metric(gw, "tokenmill:gc_pause_seconds_count") > 0
    # the engines' step counters: every decode row made one token, and every engine has waited idle between tests
    for role in ("decode", "prefill"):
        for p in procs(cluster, role):
            steps, secs = metric(p, "tokenmill:engine_steps"), metric(p, "tokenmill:engine_step_seconds")
            assert steps > 0 and 0 < secs < 1e4, (p["name"], steps, secs)
            # the steps' host time by phase adds up to their seconds; the forward is launched and outputs handed out
            phases = {ph: metric(p, f'tokenmill:engine_step_phase_seconds{{phase="{ph}"}}')
                      for ph in ("schedule", "launch", "wait", "outputs", "sample", "other")}
            assert sum(phases.values()) == pytest.approx(secs, rel=1e-3), (p["name"], phases, secs)
            assert min(phases.values()) >= 0 and phases["launch"] > 0 and phases["outputs"] > 0, (p["name"], phases)
            assert metric(p, "tokenmill:engine_idle_seconds") > 0, p["name"]
            # the engine thread's work between steps, by part: outputs handed on, counters sent at intervals
            between = {part: metric(p, f'tokenmill:engine_loop_seconds{{part="{part}"}}')
                       for part in ("commands", "tick", "before", "outputs", "after")}
            assert min(between.values()) >= 0 and between["after"] > 0 and between["outputs"] > 0, (p["name"], between)
            # the engine thread's CPU time: some, and no more than its wall time since the engine was ready
            cpu = metric(p, "tokenmill:engine_thread_cpu_seconds")
            wall = secs + sum(between.values()) + metric(p, "tokenmill:engine_idle_seconds")
            assert 0 < cpu < wall + 1.0, (p["name"], cpu, wall)
            assert metric(p, "tokenmill:engine_step_prompt_tokens") > 0, p["name"]
            rows = metric(p, "tokenmill:engine_step_decode_rows")
            assert rows <= metric(p, "tokenmill:generation_tokens_total"), p["name"]
            assert (rows > 0) == (role == "decode"), (p["name"], rows)
            # each request's queue time in the engine, and its first token's time there: a prefill worker computes
            # the first token of each prompt it takes (all but the cancelled ones)
            queued = metric(p, "tokenmill:request_queue_time_seconds_count")
            firsts = metric(p, "tokenmill:engine_time_to_first_token_seconds_count")
            assert metric(p, "tokenmill:request_queue_time_seconds_sum") >= 0 and firsts <= queued, p["name"]
            if role == "prefill":
                assert firsts > 0, p["name"]


def test_killed_decode_worker_mid_stream_moves_its_streams_and_loses_nothing(cluster, engine):
    """SIGKILL one of the two decode workers while eight greedy streams run: every stream completes, token for
    token and character for character the single-process engine's output (the moved ones included: no token
    twice, none missing). Destructive: the next test checks the victim's restart."""
    victim = procs(cluster, "decode")[0]
    [gw] = procs(cluster, "gateway")
    tk = engine.tokenizer
    asks = [f"Count slowly from {i} to a thousand." for i in range(8)]
    ids = [tk.encode(tk.apply_chat_template([{"role": "user", "content": a}]), add_special_tokens=False)
           for a in asks]
    n = 160
    refs = engine.generate(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    moved0 = metric(gw, "tokenmill:request_migrations_total")

    async def run():
        async with grpc.aio.insecure_channel(cluster["gateway"]) as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            calls = [asyncio.ensure_future(generate(stub, chat_req(a, temperature=0, max_tokens=n, ignore_eos=True)))
                     for a in asks]
            await asyncio.sleep(3.0)  # every stream is running on one of the two workers, tokens sent
            os.kill(victim["pid"], signal.SIGKILL)
            victim["alive"] = False
            return await asyncio.wait_for(asyncio.gather(*calls), 180)

    outs = asyncio.run(run())
    moved = metric(gw, "tokenmill:request_migrations_total") - moved0
    assert moved >= 1, "no stream was on the killed worker"
    for i, ((text, toks, last), ref) in enumerate(zip(outs, refs)):
        assert toks == ref.token_ids, f"stream {i}: differs from the engine at token " \
                                      f"{next((k for k, (a, b) in enumerate(zip(toks, ref.token_ids)) if a != b), -1)}"
        assert text == ref.text, f"stream {i}"
        assert last.usage.completion_tokens == n and last.usage.prompt_tokens == len(ids[i])
    wait_for(lambda: all_blocks_free(cluster, "decode"), 10, "the survivor's blocks freed")


def test_the_killed_worker_is_restarted_and_counted(cluster):
    """After the test above: the launcher started the killed decode worker again (same name and ports, a new
    pid), `tokenmill status` counts the restart, and the worker serves."""
    victim = next(p for p in cluster["processes"] if p["role"] == "decode" and not p.get("alive", True))

    def status():
        out = subprocess.run([sys.executable, "-m", "services.cli", "status", "--json", "--state-file",
                              cluster["state"]], capture_output=True, text=True, timeout=30)
        return json.loads(out.stdout)

    def back() -> bool:
        p = next(p for p in status()["processes"] if p["name"] == victim["name"])
        return p["restarts"] == 1 and p["pid"] != victim["pid"] and p["health"] == "SERVING"

    wait_for(back, 120, f"{victim['name']} restarted and SERVING")

    async def run():
        async with grpc.aio.insecure_channel(cluster["gateway"]) as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            return await asyncio.gather(*(generate(stub, chat_req(q, temperature=0, max_tokens=8)) for q in CHAT[:6]))

    assert all(len(t) == 8 for _, t, _ in asyncio.run(run()))
