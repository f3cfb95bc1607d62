"""What a decode worker's KV pull must survive, as checks over a running 1P+1D cluster (``tokenmill up``): the same
checks run on the CPU (tests/services/test_kv_pulls.py, pools in host memory) and with prefill and decode on two
GPUs (tests/gpu/test_two_gpus.py, VRAM to VRAM).

Two clusters per placement, each with the decode workers' fault injection (``KV_PULL_FAULT``, services/decode):
- ``held``: every pull waits ``HELD_S`` between its claim and its READ, inside the claim's hold, with two prefill
  workers (one may be killed; the launcher stops a cluster that has none left);
- ``late``: leases of ``LATE_LEASE_S`` and pulls that wait longer than that, so every claim's hold runs out first.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc
from tokenmill.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    frontend_pb2,
    frontend_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

HOST = "127.0.0.1"
HELD_S = 1.5
LATE_LEASE_S = 2.0
LATE_HOLD_S = 3.0
MAX_TOKENS = 24
THRESHOLD = 64  # router.prefill_threshold_tokens: every prompt here is longer, so each goes through remote prefill

HELD = dict(args=("--prefills", "2", "--decodes", "1", "--tokenizers", "1", "--grace", "3",
                  "--set", f"router.prefill_threshold_tokens={THRESHOLD}"),
            env={"KV_PULL_FAULT": f"before:{HELD_S}"})
LATE = dict(args=("--prefills", "1", "--decodes", "1", "--tokenizers", "1", "--grace", "3",
                  "--set", f"router.prefill_threshold_tokens={THRESHOLD}",
                  "--set", f"prefill.kv_lease_s={LATE_LEASE_S}"),
            env={"KV_PULL_FAULT": f"before:{LATE_HOLD_S}"})

LONG_TEXTS = [
    "The history of the printing press begins in the workshops of the Rhine valley. " * 8,
    "A river delta forms where a slow river meets the sea and drops the sand it carried. " * 8,
    "Every compiler turns a program into a sequence of simpler steps, one pass at a time. " * 8,
    "The old lighthouse keeper wrote down the weather twice a day for forty years. " * 8,
    "Bread rises because yeast turns sugar into gas that the dough traps in small pockets. " * 8,
    "A chess clock has two faces, and only one of them runs at any moment of the game. " * 8,
]
PD, CANCEL, FORGED, KILL = (0, 1, 2), 3, 5, 4  # which prompt each check of the ``held`` cluster takes: none hits
# a cache


# -- a cluster's processes and metrics --------------------------------------------------------------------------
def procs(info: dict[str, Any], role: str) -> list[dict[str, Any]]:
    return [p for p in info["processes"] if p["role"] == role and p.get("alive", True)]


def metric(p: dict[str, Any], name: str, labels: str = "") -> float:
    """The sum of a metric's samples on one process (``labels``: a substring the sample's labels must hold)."""
    text = urllib.request.urlopen(f"http://{HOST}:{p['metrics_port']}/metrics", timeout=5).read().decode()
    total, found = 0.0, False
    for line in text.splitlines():
        if (line.startswith(name + " ") or line.startswith(name + "{")) and labels in line:
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found or labels, f"{name} not in {p['name']}'s /metrics"
    return total


def role_metric(info: dict[str, Any], role: str, name: str, labels: str = "") -> float:
    return sum(metric(p, name, labels) for p in procs(info, role))


def wait_for(pred: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s: {what()}")
        time.sleep(0.1)


def free_blocks(info: dict[str, Any]) -> dict[str, tuple[float, float]]:
    return {p["name"]: (metric(p, "tokenmill:kv_blocks_free"), metric(p, "tokenmill:kv_blocks_total"))
            for role in ("prefill", "decode") for p in procs(info, role)}


def wait_all_blocks_free(info: dict[str, Any], timeout: float = 15) -> None:
    wait_for(lambda: all(f == t for f, t in free_blocks(info).values()), timeout,
             lambda: f"free/total KV blocks per worker: {free_blocks(info)}")


# -- requests --------------------------------------------------------------------------------------------------
def greedy(prompt_ids: list[int], n: int = MAX_TOKENS) -> frontend_pb2.GenerateRequest:
    return frontend_pb2.GenerateRequest(prompt_token_ids=frontend_pb2.TokenIds(ids=prompt_ids),
                                        params=common_pb2.SamplingParams(temperature=0, max_tokens=n,
                                                                         ignore_eos=True))


async def _generate(stub: frontend_pb2_grpc.FrontendStub, req: frontend_pb2.GenerateRequest) -> list[int]:
    ids: list[int] = []
    async for r in stub.Generate(req, timeout=120):
        ids += list(r.token_ids)
    return ids


def generate(info: dict[str, Any], req: frontend_pb2.GenerateRequest) -> list[int]:
    async def run() -> list[int]:
        async with grpc.aio.insecure_channel(info["gateway"]) as ch:
            return await _generate(frontend_pb2_grpc.FrontendStub(ch), req)

    return asyncio.run(run())


def prompts(tokenizer: Any) -> list[list[int]]:
    out = [tokenizer.encode(t) for t in LONG_TEXTS]
    assert all(len(p) > THRESHOLD for p in out), [len(p) for p in out]
    return out


# -- the checks ------------------------------------------------------------------------------------------------
def check_pd_equals_engine(info: dict[str, Any], ids: list[list[int]], refs: list[list[int]],
                           warm_links: bool = False) -> None:
    """Greedy through 1P+1D equals one engine's; every prompt's KV moved over NIXL, seen on both sides. With
    ``warm_links`` (VRAM pools), a request to a prefill worker already met woke the idle link before its READ; a
    host pool never does."""
    moved0 = role_metric(info, "decode", "tokenmill:nixl_xfer_bytes")
    warm0 = role_metric(info, "decode", "tokenmill:nixl_xfer_warmups")
    dec0 = role_metric(info, "decode", "tokenmill:kv_transfer_seconds_count")
    pre0 = role_metric(info, "prefill", "tokenmill:kv_transfer_seconds_count")
    ids, refs = [ids[i] for i in PD], [refs[i] for i in PD]
    for i, (p, ref) in enumerate(zip(ids, refs)):
        got = generate(info, greedy(p))
        assert got == ref, f"prompt {i} ({len(p)} tokens): 1P+1D {got} vs one engine {ref}"
    assert role_metric(info, "decode", "tokenmill:nixl_xfer_bytes") > moved0, "no KV bytes moved over NIXL"
    assert role_metric(info, "decode", "tokenmill:kv_transfer_seconds_count") - dec0 == len(ids)
    wait_for(lambda: role_metric(info, "prefill", "tokenmill:kv_transfer_seconds_count") - pre0 == len(ids), 10,
             lambda: "the prefill workers did not record every transfer")
    blocks = role_metric(info, "decode", "tokenmill:kv_transfer_blocks_sum")
    assert blocks >= sum(len(p) // 16 for p in ids)
    # three requests, each held longer than WARM_IDLE_S before its READ, to at most two prefill workers: at least
    # one went to a worker this decode worker had met, over a link idle since
    warmed = role_metric(info, "decode", "tokenmill:nixl_xfer_warmups") - warm0
    assert (warmed >= 1) if warm_links else (warmed == 0), f"{warmed:.0f} warm-up READs (warm links: {warm_links})"
    wait_all_blocks_free(info)


def check_cancel_during_pull(info: dict[str, Any], prompt_ids: list[int]) -> None:
    """A client that goes away while its pull is held (claimed, READ not yet done): both sides free its blocks."""
    async def run() -> int:
        async with grpc.aio.insecure_channel(info["gateway"]) as ch:
            call = frontend_pb2_grpc.FrontendStub(ch).Generate(greedy(prompt_ids, n=200))
            async for _ in call:  # the first token streams before the pull
                break
            # the pull holds its blocks for HELD_S; /metrics shows them once the engine's loop iteration that
            # admitted it has reported its counters, which may come after the first token
            await asyncio.to_thread(
                wait_for, lambda: role_metric(info, "decode", "tokenmill:kv_blocks_free") < role_metric(
                    info, "decode", "tokenmill:kv_blocks_total"), HELD_S / 2, lambda: "no decode blocks held for the pull")
            call.cancel()
            return 1

    asyncio.run(run())
    wait_all_blocks_free(info, timeout=HELD_S + 10)


def check_claim_refused_recomputes(info: dict[str, Any], prompt_ids: list[int], ref: list[int]) -> None:
    """A decode worker that comes after the lease expired is refused (NOT_FOUND) and recomputes: same output."""
    [pre] = procs(info, "prefill")
    [dec] = procs(info, "decode")
    before = metric(dec, "tokenmill:kv_recomputes_total", 'reason="claim_refused"')
    expired0 = metric(pre, "tokenmill:nixl_expired_leases_total")
    params = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with grpc.insecure_channel(pre["address"]) as ch:
        res = prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
            meta=common_pb2.RequestMeta(request_id="late-claim"), prompt_token_ids=prompt_ids, params=params),
            timeout=120)
        assert res.kv.lease_ms == int(LATE_LEASE_S * 1000)
        wait_for(lambda: metric(pre, "tokenmill:nixl_expired_leases_total") > expired0, LATE_LEASE_S + 5,
                 lambda: "the unclaimed lease did not expire")
        try:
            prefill_pb2_grpc.PrefillStub(ch).Claim(prefill_pb2.ClaimRequest(lease_id=res.kv.lease_id), timeout=5)
            raise AssertionError("an expired lease was claimed")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND and "expired" in e.details(), e.details()
    ids: list[int] = []
    with grpc.insecure_channel(dec["address"]) as ch:
        for d in decode_pb2_grpc.DecodeStub(ch).Decode(decode_pb2.DecodeRequest(
                meta=common_pb2.RequestMeta(request_id="late-claim"), prompt_token_ids=prompt_ids, params=params,
                first_token_id=res.first_token_id, kv=res.kv), timeout=120):
            ids += list(d.token_ids)
    assert ids == ref, f"recomputed after a refused claim: {ids} vs one engine {ref}"
    assert metric(dec, "tokenmill:kv_recomputes_total", 'reason="claim_refused"') == before + 1
    wait_all_blocks_free(info)


def check_bad_block_ids_recompute(info: dict[str, Any], prompt_ids: list[int], ref: list[int]) -> None:
    """A KV handle naming blocks its prefill worker does not have (a bug or a forged handle) costs a recompute,
    not the decode worker: the stream completes, and the real lease is given back at once."""
    pre = procs(info, "prefill")[0]
    [dec] = procs(info, "decode")
    failed0 = metric(dec, "tokenmill:kv_recomputes_total", 'reason="read_failed"')
    params = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with grpc.insecure_channel(pre["address"]) as ch:
        res = prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
            meta=common_pb2.RequestMeta(request_id="forged"), prompt_token_ids=prompt_ids, params=params),
            timeout=120)
    kv = common_pb2.KvHandle()
    kv.CopyFrom(res.kv)
    kv.block_ids[-1] = 1 << 30
    ids: list[int] = []
    with grpc.insecure_channel(dec["address"]) as ch:
        for d in decode_pb2_grpc.DecodeStub(ch).Decode(decode_pb2.DecodeRequest(
                meta=common_pb2.RequestMeta(request_id="forged"), prompt_token_ids=prompt_ids, params=params,
                first_token_id=res.first_token_id, kv=kv), timeout=120):
            ids += list(d.token_ids)
    assert ids == ref, f"recomputed after a bad handle: {ids} vs one engine {ref}"
    assert metric(dec, "tokenmill:kv_recomputes_total", 'reason="read_failed"') == failed0 + 1
    wait_all_blocks_free(info, timeout=5)  # given back, not left to expire (kv_lease_s is 30 s here)


def check_first_token_against_its_grammar_gives_the_lease_back(info: dict[str, Any], prompt_ids: list[int]) -> None:
    """A Decode call whose first token breaks its own grammar is refused (INVALID_ARGUMENT) after the claim: the
    claimed lease is given back at once, not left to expire."""
    pre = procs(info, "prefill")[0]
    [dec] = procs(info, "decode")
    params = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                       structured=common_pb2.StructuredOutput(regex="[0-9]{4}"))
    with grpc.insecure_channel(pre["address"]) as ch:
        res = prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
            meta=common_pb2.RequestMeta(request_id="off-grammar"), prompt_token_ids=prompt_ids, params=params),
            timeout=120)
    with grpc.insecure_channel(dec["address"]) as ch:
        try:
            list(decode_pb2_grpc.DecodeStub(ch).Decode(decode_pb2.DecodeRequest(
                meta=common_pb2.RequestMeta(request_id="off-grammar"), prompt_token_ids=prompt_ids, params=params,
                first_token_id=prompt_ids[0], kv=res.kv), timeout=120))  # a prompt token: not a digit's
            raise AssertionError("a first token off its grammar was accepted")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint" in e.details(), e.details()
    wait_all_blocks_free(info, timeout=5)  # given back, not left to expire (kv_lease_s is 30 s here)


def check_pull_outliving_its_hold_recomputes(info: dict[str, Any], prompt_ids: list[int], ref: list[int]) -> None:
    """A pull not over before its claim's hold ends is given up (no READ runs past the hold) and recomputed; the
    prefill worker frees the blocks then, or at the hold's end at the latest."""
    [dec] = procs(info, "decode")
    before = metric(dec, "tokenmill:kv_recomputes_total", 'reason="read_timeout"')
    reads0 = metric(dec, "tokenmill:kv_transfer_seconds_count")
    got = generate(info, greedy(prompt_ids))
    assert got == ref, f"recomputed after the hold ran out: {got} vs one engine {ref}"
    assert metric(dec, "tokenmill:kv_recomputes_total", 'reason="read_timeout"') == before + 1
    assert metric(dec, "tokenmill:kv_transfer_seconds_count") == reads0, "a READ ran although the hold was over"
    wait_all_blocks_free(info, timeout=LATE_LEASE_S + 10)


def check_killed_prefill_recomputes(info: dict[str, Any], prompt_ids: list[int], ref: list[int],
                                    read_may_complete: bool = False) -> None:
    """The prefill worker that holds a request's KV is killed while the decode worker's pull is held: the stream
    completes with the same tokens. In host memory the READ fails and the decode worker recomputes; with
    ``read_may_complete`` (VRAM: the decode worker's cuda_ipc mapping keeps the dead peer's pool alive) the READ may
    instead bring the prompt's KV. Destructive: run last."""
    pres = procs(info, "prefill")
    seen0 = {p["name"]: metric(p, "tokenmill:prompt_tokens_total") for p in pres}
    [dec] = procs(info, "decode")
    failed0 = metric(dec, "tokenmill:kv_recomputes_total", 'reason="read_failed"')

    async def run() -> list[int]:
        async with grpc.aio.insecure_channel(info["gateway"]) as ch:
            ids: list[int] = []
            async for r in frontend_pb2_grpc.FrontendStub(ch).Generate(greedy(prompt_ids), timeout=120):
                if not ids:  # the first token: prefill is done, the pull is held; kill who computed it
                    [victim] = [p for p in pres if metric(p, "tokenmill:prompt_tokens_total") > seen0[p["name"]]]
                    os.kill(victim["pid"], signal.SIGKILL)
                    victim["alive"] = False
                ids += list(r.token_ids)
            return ids

    reads0 = metric(dec, "tokenmill:kv_transfer_seconds_count")
    got = asyncio.run(run())
    assert got == ref, f"after the prefill worker died mid-pull: {got} vs one engine {ref}"
    recomputed = metric(dec, "tokenmill:kv_recomputes_total", 'reason="read_failed"') - failed0
    read = metric(dec, "tokenmill:kv_transfer_seconds_count") - reads0
    if read_may_complete:
        assert (recomputed, read) in ((1, 0), (0, 1)), f"recomputed {recomputed}, READs completed {read}"
    else:
        assert (recomputed, read) == (1, 0), f"recomputed {recomputed}, READs completed {read}"
    wait_all_blocks_free(info)


class KvPullTests:
    """The checks above as tests, for a module that provides the fixtures ``late`` and ``held`` (running clusters
    of those layouts) and ``ids_and_refs`` (``prompts`` and one engine's greedy outputs of them)."""

    read_may_complete = False  # see check_killed_prefill_recomputes
    warm_links = False  # the pools' memory wakes idle links before a READ (common/kv_transfer.py, WARM_LINKS_BY_MEM)

    def test_claim_after_expiry_is_refused_and_recomputed(self, late, ids_and_refs):
        ids, refs = ids_and_refs
        check_claim_refused_recomputes(late, ids[0], refs[0])

    def test_pull_outliving_its_hold_is_given_up_and_recomputed(self, late, ids_and_refs):
        ids, refs = ids_and_refs
        check_pull_outliving_its_hold_recomputes(late, ids[1], refs[1])

    def test_disaggregated_equals_one_engine_and_counts_transfers(self, held, ids_and_refs):
        check_pd_equals_engine(held, *ids_and_refs, warm_links=self.warm_links)

    def test_a_handle_naming_missing_blocks_is_recomputed(self, held, ids_and_refs):
        ids, refs = ids_and_refs
        check_bad_block_ids_recompute(held, ids[FORGED], refs[FORGED])

    # before the cancel test: the cancel's pull then gives back a lease to a prefill worker this decode worker has
    # just met, on a new connection (a bare NIXL notification there was lost; Release is not)
    def test_a_first_token_off_its_grammar_gives_the_lease_back(self, held, ids_and_refs):
        check_first_token_against_its_grammar_gives_the_lease_back(held, ids_and_refs[0][FORGED])

    def test_cancel_during_the_pull_frees_both_sides(self, held, ids_and_refs):
        check_cancel_during_pull(held, ids_and_refs[0][CANCEL])

    def test_killed_prefill_worker_during_the_pull_is_recomputed(self, held, ids_and_refs):
        """Destructive: the last test of the class."""
        ids, refs = ids_and_refs
        check_killed_prefill_recomputes(held, ids[KILL], refs[KILL], read_may_complete=self.read_may_complete)
