"""Several gateways on one host serving the public ports together (``gateway.share_ports``, SO_REUSEPORT), and how
many ``tokenmill up`` starts on CUDA (``gateway_defaults``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from tokenmill.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

from common.cluster_config import ConfigError, load_cluster_config, load_cluster_config_given
from common.rpc import health_status
from services.cluster.cli import gateway_defaults
from services.cluster.launcher import LaunchError, check_ports_free
from tests.services.harness import HOST, free_base_port, running_cluster
from tests.services.test_cluster_e2e import metric


def test_gateways_of_one_host_share_the_public_ports_and_keep_private_ones():
    c = load_cluster_config(overrides={"gateway.count": 3}, env={})
    assert c.gateways_share_ports
    assert [c.gateway_public_ports(i) for i in range(3)] == [(50051, 8000)] * 3
    assert [c.ports("gateway", i) for i in range(3)] == [(20400, 21400), (20401, 21401), (20402, 21402)]
    assert c.service("gateway", 2).shared_grpc_port == 50051 and c.service("decode").shared_grpc_port is None
    one = load_cluster_config(env={})  # a single gateway: its own port is the public one, nothing shared
    assert not one.gateways_share_ports and one.ports("gateway") == (50051, 21400)
    assert one.service("gateway").shared_grpc_port is None
    apart = load_cluster_config(overrides={"gateway.count": 2, "gateway.share_ports": "false"}, env={})
    assert [apart.gateway_public_ports(i) for i in range(2)] == [(50051, 8000), (50052, 8001)]
    assert apart.ports("gateway", 1) == (50052, 21401) and apart.service("gateway", 1).shared_grpc_port is None
    hosts = load_cluster_config(overrides={"gateway.count": 2, "gateway.hosts": "a,b"}, env={})
    assert not hosts.gateways_share_ports  # each on a host of its own (containers): nothing to share
    with pytest.raises(ConfigError, match="the gateways' shared port 20300 collides with decode-0 port 20300"):
        load_cluster_config(overrides={"gateway.count": 2, "gateway.port": 20300}, env={})
    with pytest.raises(ConfigError, match="gateway-1 port 20401 collides"):  # a private port on the public one
        load_cluster_config(overrides={"gateway.count": 2, "gateway.http_port": 20401}, env={})


def test_up_on_cuda_starts_four_gateways_per_decode_worker_within_the_cores():
    def planned(cores: int, **overrides: object) -> tuple[int, list[str]]:
        cluster, given = load_cluster_config_given(overrides={"engine.device": "cuda", **overrides}, env={})
        out, why = gateway_defaults(cluster, given, cores=cores)
        return out.gateway.count, why

    count, why = planned(16)
    assert count == 4 and why == ["4 gateways sharing the public ports: one relays about 13k streamed tokens/s at a "
                                  "full core, less than a GPU decodes; 4 a decode worker keep each well below that "
                                  "(--gateways N)"]
    assert planned(256, **{"decode.count": 8})[0] == 32
    assert planned(64, **{"decode.count": 8})[0] == 16  # one per 4 cores at most
    assert planned(8)[0] == 2
    assert planned(4) == (1, [])  # a host with few cores keeps one
    assert planned(16, **{"gateway.count": 1}) == (1, [])  # asked for
    assert planned(16, **{"tenants.flood.rpm": 480})[0] == 4  # the host's gateways share the buckets
    assert planned(16, **{"gateway.tenant_max_inflight": 8})[0] == 4  # and the in-flight counts
    assert planned(16, **{"gateway.resume_window_s": 30}) == (
        1, ["one gateway: a resumable stream lives in the gateway that started it (--gateways N)"])
    cluster, given = load_cluster_config_given(env={})
    assert gateway_defaults(cluster, given, cores=16) == (cluster, [])  # the CPU: the engine is the bottleneck


def test_up_on_cuda_dry_run_lists_the_gateways(capsys, monkeypatch, tmp_path):
    from services.cli import main
    from services.cluster import cli, placement_gpu

    monkeypatch.setattr(placement_gpu, "visible_gpus", lambda env=None: ["0"])
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 16)
    code = main(["up", "--device", "cuda", "--tokenizer", "smollm2", "--dry-run", "--state-file",
                 str(tmp_path / "state.json")])
    out = capsys.readouterr().out
    assert code == 0 and "4 gateways sharing the public ports" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert all(f"gateway-{i}" in rows for i in range(4)) and "gateway-4" not in rows


def test_the_port_check_covers_the_shared_public_ports():
    base = free_base_port()
    cfg = load_cluster_config(overrides={"base_port": base, "gateway.count": 2, "gateway.port": base + 450,
                                         "gateway.http_port": base + 460}, env={})
    check_ports_free(cfg)
    with socket.socket() as held:  # another listener, SO_REUSEPORT or not, must not be joined silently
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind((HOST, base + 460))
        held.listen()
        with pytest.raises(LaunchError, match=f"shared public HTTP port {HOST}:{base + 460} is taken.*--http-port"):
            check_ports_free(cfg)


async def _generate_on_fresh_connections(address: str, n: int) -> list[str]:
    """One request on each of ``n`` new connections (the kernel picks a gateway per connection): the texts."""
    async def one(i: int) -> str:
        async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1),
                                                               ("test.connection", i)]) as ch:
            req = frontend_pb2.GenerateRequest(prompt="The capital of France is",
                                               params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0))
            text = ""
            async for resp in frontend_pb2_grpc.FrontendStub(ch).Generate(req, timeout=60):
                text += resp.text
            return text

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _codes_on_fresh_connections(address: str, n: int, tenant: str) -> list[str]:
    """One request of ``tenant`` (x-tenant-id: no keys configured) on each of ``n`` new connections, all at once:
    each call's status code name."""
    async def one(i: int) -> str:
        async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1),
                                                               ("test.connection", i)]) as ch:
            req = frontend_pb2.GenerateRequest(prompt="The capital of France is",
                                               params=common_pb2.SamplingParams(max_tokens=2, temperature=0.0))
            try:
                async for _ in frontend_pb2_grpc.FrontendStub(ch).Generate(req, timeout=60,
                                                                           metadata=[("x-tenant-id", tenant)]):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code().name
            return "OK"

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def _stream_into(address: str, got: list[str], stop: threading.Event) -> None:
    """A long greedy stream through one gateway's own port: each text delta appended to ``got`` until ``stop`` is
    set (the call is then cancelled), it ends, or the gateway cuts it."""
    async def run() -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            req = frontend_pb2.GenerateRequest(prompt="Write a long story.", params=common_pb2.SamplingParams(
                max_tokens=7000, temperature=0.0, ignore_eos=True))
            async for resp in frontend_pb2_grpc.FrontendStub(ch).Generate(req, timeout=300):
                got.append(resp.text)
                if stop.is_set():
                    break

    with contextlib.suppress(grpc.aio.AioRpcError):
        asyncio.run(run())


def test_two_gateways_serve_one_port_and_a_dead_or_draining_one_is_not_given_connections(tmp_path):
    with running_cluster(tmp_path, "--gateways", "2", "--prefills", "0", "--tokenizers", "1", "--grace", "60",
                         "--set", "tenants.team.rpm=1", "--set", "tenants.team.rpm_burst=6") as c:
        gws = sorted((p for p in c["processes"] if p["role"] == "gateway"), key=lambda p: p["index"])
        # the gateways hold a tenant to one quota together (services/gateway/host_limits.py): of 16 requests over
        # both, 6 (the burst) pass; a bucket in each gateway would pass up to 6 at each
        codes = asyncio.run(_codes_on_fresh_connections(c["gateway"], 16, "team"))
        assert sorted(codes) == ["OK"] * 6 + ["RESOURCE_EXHAUSTED"] * 10, codes
        refused = [metric(p, "tokenmill:tenant_rejected_requests_total", tenant="team", reason="requests")
                   for p in gws]
        assert sum(refused) == 10, refused
        assert [(p["public_grpc_port"], p["http_port"]) for p in gws] == [(c["base"] + 450, c["base"] + 451)] * 2
        assert [p["grpc_port"] for p in gws] == [c["base"] + 400, c["base"] + 401]  # private: health checks
        assert all(health_status(p["address"]) == "SERVING" for p in gws)
        texts = asyncio.run(_generate_on_fresh_connections(c["gateway"], 16))
        assert len(set(texts)) == 1 and texts[0]  # greedy: one answer, whichever gateway relayed it
        served = [metric(p, "tokenmill:request_success_total") for p in gws]
        assert sum(served) == 6 + 16 and min(served) > 0, served  # 16 connections: both got some (p ≈ 3e-5 not)
        oai = openai.OpenAI(base_url=c["http"] + "/v1", api_key="none", max_retries=0)
        done = oai.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4,
                                      temperature=0)
        assert done.choices[0].text == texts[0]

        os.kill(gws[0]["pid"], signal.SIGKILL)  # its listening sockets close with it
        deadline = time.monotonic() + 10
        while health_status(gws[0]["address"], timeout=0.3) != "UNREACHABLE":  # gone (a connection it had
            assert time.monotonic() < deadline  # accepted in the kernel but not yet in Python is reset)
            time.sleep(0.05)
        assert asyncio.run(_generate_on_fresh_connections(c["gateway"], 8)) == [texts[0]] * 8
        deadline = time.monotonic() + 60  # the launcher starts it again, on the same ports
        while True:
            now = {p["name"]: p for p in json.loads(Path(c["state"]).read_text())["processes"]}
            if now["gateway-0"]["restarts"] == 1 and health_status(now["gateway-0"]["address"]) == "SERVING":
                break
            assert time.monotonic() < deadline, "gateway-0 was not started again"
            time.sleep(0.3)
        again = asyncio.run(_generate_on_fresh_connections(c["gateway"], 16))
        assert again == [texts[0]] * 16
        assert metric(now["gateway-0"], "tokenmill:request_success_total") > 0  # it takes connections again

        # a gateway that drains (SIGTERM; a long stream on its private port keeps it draining, up to the 60 s grace)
        # stops listening on the shared ports at once: new connections, HTTP or gRPC, reach the other one and none
        # is refused with 503 / UNAVAILABLE
        private = now["gateway-1"]["address"]
        got: list[str] = []
        stop = threading.Event()
        long = threading.Thread(target=_stream_into, args=(private, got, stop), daemon=True)
        long.start()
        deadline = time.monotonic() + 60
        while not got:
            assert time.monotonic() < deadline and long.is_alive(), "the long stream did not start"
            time.sleep(0.05)
        os.kill(now["gateway-1"]["pid"], signal.SIGTERM)
        while health_status(private, timeout=0.3) == "SERVING":  # NOT_SERVING, then no listener at all
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.2)  # its health turns as its gRPC servers begin to stop, at the start of the drain
        streamed = len(got)
        for _ in range(8):  # urllib: a new connection a request
            req = urllib.request.Request(c["http"] + "/v1/completions", method="POST", data=json.dumps(
                {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).encode(),
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                assert r.status == 200 and json.loads(r.read())["choices"][0]["text"] == texts[0]
        assert asyncio.run(_generate_on_fresh_connections(c["gateway"], 8)) == [texts[0]] * 8
        assert long.is_alive() and len(got) > streamed  # all of that while it drained, still streaming
        stop.set()  # the long stream's call cancelled: the drain ends
        long.join(30)
        assert not long.is_alive()
