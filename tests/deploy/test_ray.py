"""``tokenmill ray up / status / down`` on a real two-node Ray cluster on loopback (a head on 127.0.0.2 and a
worker node on 127.0.0.3, token auth on), with one request streamed through the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from tokenmill.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

from common.rpc import health_status
from tests.deploy.paths import VENV_BIN
from tests.services.harness import free_base_port, port_free

HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"


def ray_ports(base: int) -> list[str]:
    """Every port a Ray node opens, fixed below 32768 (Ray would otherwise pick some in the ephemeral range),
    and a small object store."""
    return [f"--node-manager-port={base}", f"--object-manager-port={base + 1}",
            f"--ray-client-server-port={base + 2}", f"--dashboard-agent-listen-port={base + 3}",
            f"--dashboard-agent-grpc-port={base + 4}", f"--runtime-env-agent-port={base + 5}",
            f"--metrics-export-port={base + 6}", f"--min-worker-port={base + 10}", f"--max-worker-port={base + 60}",
            "--object-store-memory=100000000"]  # the test moves no objects; Ray's default is 30% of memory


def free_range(n: int) -> int:
    for _ in range(200):
        base = free_base_port(span=0)
        if all(port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free port range")


class RayNodes:
    """``ray start --block`` processes this test owns (each its own process group): stopped by pid, always."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.env, self.tmp, self.procs = env, tmp, []

    def start(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        out = open(self.tmp / log, "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen([str(VENV_BIN / "ray"), "start", "--block", "--disable-usage-stats", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs.append((proc, out))
        return proc

    def wait_started(self, log: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in (self.tmp / log).read_text(errors="replace"):
            for proc, _ in self.procs:
                assert proc.poll() is None, (self.tmp / log).read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, (self.tmp / log).read_text(errors="replace")[-3000:]
            time.sleep(0.3)

    def stop(self) -> None:
        for proc, _ in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, out in reversed(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            # whatever the node left behind in the process group this test created for it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            out.close()


@pytest.fixture(scope="module")
def ray_cluster():
    # short: Ray's unix socket paths must fit in 107 bytes
    tmp = Path(tempfile.mkdtemp(prefix="tmray-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TOKENMILL_"))}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    nodes = RayNodes(env, tmp)
    try:
        base = free_range(200)
        gcs = base
        nodes.start(["--head", f"--node-ip-address={HEAD_IP}", f"--port={gcs}", "--include-dashboard=false",
                     "--num-cpus=3", f"--temp-dir={tmp}/h", *ray_ports(base + 1)], "head.log")
        # the worker node waits for the head's GCS by itself
        nodes.start([f"--address={HEAD_IP}:{gcs}", f"--node-ip-address={WORKER_IP}", "--num-cpus=3",
                     *ray_ports(base + 100)], "worker.log")
        nodes.wait_started("head.log")
        nodes.wait_started("worker.log")
        yield {"address": f"{HEAD_IP}:{gcs}", "env": env, "tmp": tmp}
    finally:
        nodes.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def tokenmill(args: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_gateways_on_ray_nodes_split_each_tenants_quotas(tmp_path):
    """Each gateway actor counts its own quotas: its config says it holds 1/N of them, unless the config set N."""
    from common.cluster_config import load_cluster_config
    from services.cluster.ray_pools import member_configs

    members = [("gateway", 0, HEAD_IP), ("gateway", 1, WORKER_IP), ("router", 0, HEAD_IP), ("decode", 0, WORKER_IP)]
    for overrides, shares in (({}, 2), ({"gateway.quota_shares": 5}, 5)):
        configs = member_configs(load_cluster_config(overrides={"gateway.count": 2, **overrides}, env={}), members,
                                 "0.0.0.0")
        for (role, index), (text, _) in configs.items():
            f = tmp_path / f"{role}-{index}.yaml"
            f.write_text(text)  # what the member's actor loads
            assert load_cluster_config(f, env={}).gateway.quota_shares == shares, (role, index)


def test_ray_up_streams_a_request_through_pools_on_two_nodes_then_down(ray_cluster):
    env, address = ray_cluster["env"], ray_cluster["address"]
    base = free_base_port()
    gw_port, http_port = base + 450, base + 451
    common = ["--address", address, "--name", "tmtest"]
    up = tokenmill(["ray", "up", *common, "--base-port", str(base), "--gateway-port", str(gw_port),
                    "--http-port", str(http_port), "--gateway-host", "127.0.0.1", "--tokenizers", "1",
                    "--set", "engine.max_model_len=512", "--set", "engine.kv_cache_memory=32MiB",
                    "--startup-timeout", "180"], env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        rows = re.findall(r"^(tmtest-(\w+)-\d+)\s+(\S+)\s+(\S+)$", up.stdout, re.M)
        assert sorted(r[1] for r in rows) == ["decode", "gateway", "prefill", "router", "tokenizer"], up.stdout
        assert {r[2] for r in rows} == {HEAD_IP, WORKER_IP}, f"the actors were not spread over both nodes: {rows}"
        gateway = f"127.0.0.1:{gw_port}"
        assert f"gateway: grpc {gateway}" in up.stdout

        async def generate() -> tuple[str, int, int]:
            async with grpc.aio.insecure_channel(gateway) as ch:
                stub = frontend_pb2_grpc.FrontendStub(ch)
                chat = tokenizer_pb2.ChatMessages(
                    messages=[tokenizer_pb2.ChatMessage(role="user", content="What is the capital of France?")],
                    add_generation_prompt=True)
                req = frontend_pb2.GenerateRequest(chat=chat, params=common_pb2.SamplingParams(
                    temperature=0, max_tokens=12))
                text, n, finish = "", 0, 0
                async for r in stub.Generate(req, timeout=60):
                    text += r.text
                    n += len(r.token_ids)
                    finish = r.finish_reason or finish
                return text, n, finish

        text, n, finish = asyncio.run(generate())
        assert n > 0 and text.strip(), (text, n)
        assert "Paris" in text, text
        assert finish in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)

        st = tokenmill(["ray", "status", *common], env, timeout=120)
        assert st.returncode == 0 and st.stdout.count("SERVING") == 5, st.stdout + st.stderr
    finally:
        down = tokenmill(["ray", "down", *common, "--grace", "2"], env, timeout=180)
    assert down.returncode == 0 and "removed 5 actors" in down.stdout, down.stdout + down.stderr
    assert health_status(f"127.0.0.1:{gw_port}", timeout=0.5) == "UNREACHABLE"


def test_a_service_that_fails_to_start_is_named_and_nothing_is_left_behind(ray_cluster):
    env, address = ray_cluster["env"], ray_cluster["address"]
    common = ["--address", address, "--name", "tmfail"]
    up = tokenmill(["ray", "up", *common, "--base-port", str(free_base_port()), "--gateways", "0",
                    "--tokenizers", "0", "--prefills", "0", "--model", "dummy:no-such-config",
                    "--startup-timeout", "120"], env)
    assert up.returncode == 1, up.stdout + up.stderr
    assert "decode-0 exited" in up.stderr and "no-such-config" in up.stderr, up.stderr
    st = tokenmill(["ray", "status", *common], env, timeout=120)
    assert st.returncode == 1 and "tmfail-" not in st.stdout, st.stdout


def test_pools_asking_for_gpus_the_cluster_lacks_are_refused_and_removed(ray_cluster):
    env, address = ray_cluster["env"], ray_cluster["address"]
    common = ["--address", address, "--name", "tmgpu"]
    up = tokenmill(["ray", "up", *common, "--base-port", str(free_base_port()), "--gateways", "0",
                    "--tokenizers", "0", "--prefills", "0", "--decode-gpus", "1", "--startup-timeout", "4"], env)
    assert up.returncode == 1 and "could not place every actor" in up.stderr, up.stdout + up.stderr
    down = tokenmill(["ray", "down", *common], env, timeout=120)
    assert down.returncode == 0 and "removed 0 actors" in down.stdout, down.stdout + down.stderr
