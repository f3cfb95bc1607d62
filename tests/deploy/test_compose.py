"""docker-compose.yml, the image and the monitoring assets, checked without a Docker engine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from common.cluster_config import ROLES, load_cluster_config
from tests.deploy.paths import COMPOSE, ROOT
from tests.services.harness import HOST, free_base_port

TOKENMILL_IMAGES = ("tokenmill:cpu", "tokenmill:cuda")


def compose(*args: str, profiles: str = "cpu") -> subprocess.CompletedProcess[str]:
    assert COMPOSE.exists(), f"{COMPOSE} is missing: run `make install`"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENMILL_", "COMPOSE_"))}
    return subprocess.run([str(COMPOSE), "-f", str(ROOT / "docker-compose.yml"), *args], cwd=ROOT,
                          env={**env, "COMPOSE_PROFILES": profiles}, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def resolved() -> dict:
    """The compose file as docker-compose resolves it (anchors, merges, ${VAR:-default}), every profile on."""
    r = compose("config", profiles="cpu,gpu")
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def tokenmill_services(resolved: dict) -> dict[str, dict]:
    return {n: s for n, s in resolved["services"].items() if s.get("image") in TOKENMILL_IMAGES}


def service_config(svc: dict):
    """The ClusterConfig and (role, index) the container's `tokenmill serve` would run with."""
    env = {"TOKENMILL_HOST": "0.0.0.0",  # set by the Dockerfile
           **{k: str(v) for k, v in (svc.get("environment") or {}).items()}}
    cmd = svc["command"]
    index = int(cmd[cmd.index("--index") + 1]) if "--index" in cmd else 0
    return load_cluster_config(env=env), cmd[0], index


@pytest.mark.parametrize("profiles", ["cpu", "gpu"])
def test_docker_compose_config_is_valid(profiles):
    r = compose("config", "-q", profiles=profiles)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


def test_every_service_runs_a_known_role_and_publishes_the_port_it_listens_on(resolved):
    services = tokenmill_services(resolved)
    roles = {name: s["command"][0] for name, s in services.items()}
    assert set(roles.values()) == set(ROLES), roles
    assert sorted(r for n, r in roles.items() if "gpu" not in n) == sorted(
        ["gateway", "router", "tokenizer", "tokenizer", "prefill", "decode"])
    for name, svc in services.items():
        cfg, role, index = service_config(svc)
        assert role in ROLES, f"{name} runs {role!r}, which `tokenmill serve` does not know"
        grpc_port, metrics_port = cfg.ports(role, index)
        listens = {grpc_port, metrics_port} | ({cfg.gateway.http_port} if role == "gateway" else set())
        for p in svc.get("ports", []):
            target = int(p["target"]) if isinstance(p, dict) else int(str(p).rsplit(":", 1)[-1])
            assert target in listens, f"{name} ({role}) publishes {target}; it listens on {sorted(listens)}"
        # what the others dial: this service's name at this service's port
        assert cfg.advertise_host == name
        # its health check asks the port it serves on
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "tokenmill", "health"], test
        want = (f"http://127.0.0.1:{cfg.gateway.http_port}/health" if role == "gateway"
                else f"127.0.0.1:{grpc_port}")
        assert test[3] == want, (name, test)
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond["condition"] == "service_healthy", (name, dep)
    gateway = services["gateway"]
    published = {int(p["target"]) for p in gateway["ports"]}
    assert published == {8000, 50051}, "the OpenAI port (and public gRPC) must be published"


def test_addresses_in_the_config_name_services_of_that_role_on_their_ports(resolved):
    services = tokenmill_services(resolved)
    listening = {}
    for name, svc in services.items():
        cfg, role, index = service_config(svc)
        listening[f"{name}:{cfg.ports(role, index)[0]}"] = role
    for name, svc in services.items():
        cfg, _, _ = service_config(svc)
        for role in ("router", "tokenizer"):
            addrs = cfg.addresses(role)
            assert addrs, (name, role)
            for a in addrs:
                assert listening.get(a) == role, f"{name} dials {role} at {a}, where no {role} listens"


def test_gpu_profile_gives_prefill_and_decode_a_gpu_each(resolved):
    services = tokenmill_services(resolved)
    gpu = {n: s for n, s in services.items() if "gpu" in (s.get("profiles") or [])}
    assert sorted(s["command"][0] for s in gpu.values()) == ["decode", "prefill"]
    ids = []
    for name, svc in gpu.items():
        [device] = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
        ids += device["device_ids"]
        assert svc["image"] == "tokenmill:cuda" and svc["build"]["args"]["VARIANT"] == "cuda"
        assert svc["environment"]["TOKENMILL_ENGINE__DEVICE"] == "cuda"
        engine = service_config(svc)[0].engine  # bfloat16 by default on CUDA; the whole of its own GPU's share
        assert (engine.device, engine.dtype, engine.gpu_memory_utilization) == ("cuda", "bfloat16", 0.9), name
    assert sorted(ids) == ["0", "1"], "prefill and decode must get a GPU each"
    for name, svc in services.items():
        if name not in gpu:
            assert "deploy" not in svc and svc["image"] == "tokenmill:cpu", name
            assert svc["command"][0] not in ("prefill", "decode") or svc["profiles"] == ["cpu"], name
    assert (ROOT / ".env").read_text().count("COMPOSE_PROFILES=cpu") == 1


def test_prometheus_scrapes_every_service_on_its_metrics_port(resolved):
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {}
    for sc in prom["scrape_configs"]:
        for st in sc["static_configs"]:
            for t in st["targets"]:
                targets[t] = st["labels"]["role"]
    for name, svc in tokenmill_services(resolved).items():
        cfg, role, index = service_config(svc)
        assert targets.get(f"{name}:{cfg.ports(role, index)[1]}") == role, f"{name}'s /metrics is not scraped"
    assert "prometheus" in resolved["services"] and "grafana" in resolved["services"]
    mounts = " ".join(str(v) for v in resolved["services"]["grafana"]["volumes"])
    assert "deploy/grafana/provisioning" in mounts and "deploy/grafana/dashboards" in mounts


def _defined_metrics() -> set[str]:
    names = set()
    for path in [*ROOT.glob("services/**/*.py"), *ROOT.glob("common/*.py")]:
        for kind, name in re.findall(r"\b(Counter|Gauge|Histogram)\(\s*\"(tokenmill:[a-z_:]+)\"", path.read_text()):
            names |= {name, f"{name}_total"} if kind == "Counter" else (
                {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "Histogram" else {name})
    return names


def test_dashboard_shows_the_required_panels_on_metrics_the_services_export():
    dash = json.loads((ROOT / "deploy/grafana/dashboards/tokenmill.json").read_text())
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in dash["panels"]}
    for title, metric in [("Time to first token", "tokenmill:time_to_first_token_seconds_bucket"),
                          ("Inter-token latency", "tokenmill:inter_token_latency_seconds_bucket"),
                          ("Throughput", "tokenmill:generation_tokens_total"),
                          ("Queue depth", "tokenmill:num_requests_waiting"),
                          ("KV cache usage", "tokenmill:kv_cache_usage_perc"),
                          ("Prefix cache hit rate", "tokenmill:prefix_cache_hits"),
                          ("NIXL KV transfer", "tokenmill:nixl_xfer_bytes")]:
        assert metric in exprs.get(title, ""), f"panel {title!r} does not show {metric}"
    defined = _defined_metrics()
    used = set(re.findall(r"tokenmill:[a-z_:]+", " ".join(exprs.values())))
    assert used and used <= defined, f"the dashboard uses metrics no service exports: {sorted(used - defined)}"
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert {p["datasource"]["uid"] for p in dash["panels"]} == {ds["datasources"][0]["uid"]}


def test_dockerfile_builds_every_role_as_a_non_root_user():
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines() if ln.strip() and not ln.startswith("#")]
    stages = [ln.split()[-1] for ln in lines if ln.startswith("FROM ")]
    for stage in ("build-cpu", "build-cuda", "runtime-cpu", "runtime-cuda", "runtime"):
        assert stage in stages, f"no {stage} stage"
    assert stages[-1] == "runtime", "the last stage is the image that runs"
    final = lines[max(i for i, ln in enumerate(lines) if ln.startswith("FROM "))]
    assert final == "FROM runtime-${VARIANT} AS runtime"
    tail = lines[lines.index(final):]
    user = [ln for ln in tail if ln.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in ("0", "root")
    assert [ln for ln in tail if ln.startswith("ENTRYPOINT")][-1] == 'ENTRYPOINT ["tokenmill", "serve"]'
    assert "ARG VARIANT=cpu" in lines and "ARG MODEL_DIR=" in lines
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    for ln in lines:
        if ln.startswith("COPY ") and "--from=" not in ln:
            for src in ln.split()[1:-1]:
                if src.startswith("--"):
                    continue
                assert src == "." or (ROOT / src).exists(), f"COPY {src}: not in the build context"
                assert src == "." or src.split("/")[0] not in ignored, f"COPY {src}: excluded by .dockerignore"


def test_health_command_follows_a_real_service():
    base = free_base_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    addr = f"{HOST}:{base}"
    health = [sys.executable, "-m", "services.cli", "health", "--timeout", "0.5"]
    r = subprocess.run([*health, addr], capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 1 and "UNREACHABLE" in r.stderr
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "router", "--base-port", str(base),
                             "--grace", "0.5"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            r = subprocess.run([*health, addr], capture_output=True, text=True, timeout=30, env=env)
            if r.returncode == 0:
                break
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, r.stderr
            time.sleep(0.3)
        r = subprocess.run([*health, f"http://{HOST}:{base + 1000}/metrics"], capture_output=True, text=True,
                           timeout=30, env=env)
        assert r.returncode == 0, r.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    r = subprocess.run([*health, f"http://{HOST}:{base + 1000}/metrics"], capture_output=True, text=True,
                       timeout=30, env=env)
    assert r.returncode == 1 and r.stderr, "a stopped service must fail its health check"


def test_the_sources_the_image_copies_build_a_complete_package(tmp_path):
    """What the build stage COPYs (nothing else of the repository) must make a wheel with every role's service."""
    import shutil
    import zipfile

    lines = (ROOT / "Dockerfile").read_text().splitlines()
    srcs = [src for ln in lines if ln.startswith("COPY ") and "--from=" not in ln
            for src in ln.split()[1:-1] if src != "."]
    assert {"pyproject.toml", "common", "services", "protos"} <= set(srcs)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for src in srcs:
        (shutil.copytree if (ROOT / src).is_dir() else shutil.copy)(ROOT / src, ctx / src)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "whl"), str(ctx)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    [wheel] = (tmp_path / "whl").glob("tokenmill-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for role in ROLES:
        assert f"services/{role}/server.py" in names, role
    assert "tokenmill/v1/frontend_pb2.py" in names and "services/cluster/ray_pools.py" in names
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names)
