"""The Helm chart's wiring run for real: its rendered ``cluster.yaml`` and the environment its pods get, one process
per "pod", each on a loopback address of its own (Service DNS names mapped to those addresses, as DNS would).
Two decode replicas share index 0 and every port, as the pods of one Deployment do: the router must tell them
apart by pod name, and a long prompt's KV must travel from the prefill pod to a decode pod."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import helm_python as helm
import yaml
from tokenmill.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, router_pb2, router_pb2_grpc

from common.rpc import health_status
from tests.deploy.paths import CHART
from tests.services.harness import free_base_port

RELEASE = "tm"
# pod name → (role, pod IP)
PODS = {
    "tm-tokenmill-router-5d9f-abcde": ("router", "127.0.0.11"),
    "tm-tokenmill-prefill-7c4b-fghij": ("prefill", "127.0.0.13"),
    "tm-tokenmill-decode-6b8d-klmno": ("decode", "127.0.0.14"),
    "tm-tokenmill-decode-6b8d-pqrst": ("decode", "127.0.0.15"),
    "tm-tokenmill-gateway-59c7-uvwxy": ("gateway", "127.0.0.16"),
}
SERVICE_IPS = {"tm-tokenmill-router": "127.0.0.11", "tm-tokenmill-tokenizer": "127.0.0.12"}


def rendered_config(base: int) -> str:
    values = {
        "model": {"spec": "dummy:tiny-llama"},
        "ports": {"router": base, "tokenizer": base + 100, "prefill": base + 200, "decode": base + 300,
                  "gateway": base + 450, "http": base + 451},
        "config": {"engine": {"kv_cache_memory": 8 << 20}, "router": {"prefill_threshold_tokens": 32},
                   "prefill": {"report_interval_s": 0.05}, "decode": {"report_interval_s": 0.05}},
        "gracePeriodSeconds": 1,
    }
    out = helm.Chart.load(CHART).render(values, name=RELEASE, namespace="default")
    [cm] = [d for d in yaml.safe_load_all(out["tokenmill/templates/configmap.yaml"]) if d]
    text = cm["data"]["cluster.yaml"]
    for name, ip in SERVICE_IPS.items():  # what cluster DNS does for the Services
        assert f"{name}:" in text, text
        text = text.replace(f"{name}:", f"{ip}:")
    return text


def test_the_charts_pods_serve_two_decode_replicas_on_one_index(tmp_path):
    base = free_base_port()
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(rendered_config(base))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for pod, (role, ip) in PODS.items():
            # the pod's environment from the chart (status.podIP, metadata.name); a pod binds 0.0.0.0 in its own
            # network namespace, here its own loopback address stands in for it
            env = {**os.environ, "TOKENMILL_HOST": ip, "TOKENMILL_ADVERTISE_HOST": ip,
                   "TOKENMILL_INSTANCE_NAME": pod, "OMP_NUM_THREADS": "1"}
            with open(tmp_path / f"{pod}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "services.cluster", "serve", role, "--config", str(cfg)],
                    stdout=log, stderr=subprocess.STDOUT, env=env))
        ports = {"router": base, "prefill": base + 200, "decode": base + 300, "gateway": base + 450}
        deadline = time.monotonic() + 120
        for (pod, (role, ip)), proc in zip(PODS.items(), procs):
            while health_status(f"{ip}:{ports[role]}", timeout=0.5) != "SERVING":
                assert proc.poll() is None, (tmp_path / f"{pod}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"{pod} is not SERVING"
                time.sleep(0.2)
        asyncio.run(_check(f"127.0.0.11:{base}", f"127.0.0.16:{base + 450}", ports))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
    assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]


async def _check(router: str, gateway: str, ports: dict[str, int]) -> None:
    async with grpc.aio.insecure_channel(router) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        deadline = time.monotonic() + 30
        while True:
            workers = {w.worker_id: w.address for w in (await stub.ListWorkers(router_pb2.ListWorkersRequest())).workers}
            if len(workers) == 3 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    want = {pod: f"{ip}:{ports[role]}" for pod, (role, ip) in PODS.items() if role in ("prefill", "decode")}
    assert workers == want, workers

    async def generate(stub: frontend_pb2_grpc.FrontendStub, n_prompt: int, seed: int) -> int:
        req = frontend_pb2.GenerateRequest(
            prompt_token_ids=frontend_pb2.TokenIds(ids=[(7 * i + seed) % 500 + 3 for i in range(n_prompt)]),
            params=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True))
        return sum([len(r.token_ids) async for r in stub.Generate(req, timeout=60)])

    async with grpc.aio.insecure_channel(gateway) as ch:
        stub = frontend_pb2_grpc.FrontendStub(ch)
        # long prompts are prefilled on the prefill pod and their KV pulled over NIXL; short ones stay on decode
        counts = await asyncio.gather(*(generate(stub, 60 if i % 2 else 8, i) for i in range(8)))
    assert counts == [6] * 8
    prefilled = metric(f"127.0.0.13:{ports['prefill'] + 1000}", "tokenmill:prompt_tokens_total")
    pulled = sum(metric(f"{ip}:{ports['decode'] + 1000}", "tokenmill:nixl_xfer_bytes")
                 for role, ip in PODS.values() if role == "decode")
    assert prefilled >= 4 * 60 and pulled > 0, (prefilled, pulled)


def metric(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))
