"""The Helm chart (helm/tokenmill): lint, render through the helm-python-sdk (Helm v4, no helm binary), validate
every manifest against the Kubernetes 1.30 schemas, and check the wiring against common/cluster_config.py."""

from __future__ import annotations

import copy
import re
import subprocess
from typing import Any

import helm_python as helm
import pytest
import yaml

from common.cluster_config import ROLES, load_cluster_config
from tests.deploy.paths import CHART, KUBE_VALIDATE

RELEASE = "tm"
GPU_ON = {"prefill": {"gpus": 1, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                   "effect": "NoSchedule"}]},
          "decode": {"gpus": 2, "nodeSelector": {"nvidia.com/gpu.present": "true"}}}
# every optional part on: the values that only matter then are exercised too
ALL_ON = {
    **copy.deepcopy(GPU_ON),
    "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
    "apiKeys": {"keys": ["team-a:sk-1", "sk-2"]},
    "tenants": {"acme": {"keys_sha256": ["ab" * 32], "rpm": 600, "tpm": 200000, "max_class": "standard"}},
    "model": {"spec": "/models/host/llama", "volume": {"persistentVolumeClaim": {"claimName": "llama"}}},
    "imagePullSecrets": [{"name": "regcred"}],
    "engine": {"maxModelLen": 4096},
    "config": {"router": {"prefill_threshold_tokens": 512}},
    "gateway": {"service": {"type": "LoadBalancer", "annotations": {"lb": "external"}}},
}
for _pool in ("prefill", "decode"):
    ALL_ON[_pool]["autoscaling"] = {"enabled": True}


def deep_merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def render(values: dict | None = None) -> list[dict[str, Any]]:
    out = helm.Chart.load(CHART).render(values or {}, name=RELEASE, namespace="default", is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def cluster_yaml(docs: list[dict]) -> str:
    return by_kind(docs, "ConfigMap")[f"{RELEASE}-tokenmill-config"]["data"]["cluster.yaml"]


def container(docs: list[dict], role: str) -> dict:
    return by_kind(docs, "Deployment")[f"{RELEASE}-tokenmill-{role}"]["spec"]["template"]["spec"]["containers"][0]


def test_helm_lint_strict_has_no_findings_above_info():
    for values in ({}, GPU_ON, ALL_ON):
        report = helm.lint(CHART, values, strict=True, kube_version="v1.30.0")
        bad = [m for m in report["messages"] if m["severity"] >= 2]
        assert not report["errors"] and not bad, report


@pytest.mark.parametrize("values", [{}, GPU_ON, ALL_ON], ids=["default", "gpu", "all-on"])
def test_every_rendered_manifest_is_valid_for_kubernetes_1_30(values, tmp_path):
    docs = render(values)
    builtin = [d for d in docs if d["kind"] != "ServiceMonitor"]
    f = tmp_path / "rendered.yaml"
    f.write_text(yaml.safe_dump_all(builtin))
    r = subprocess.run([str(KUBE_VALIDATE), "--strict", "-k", "1.30.0", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed for resource") == len(builtin), r.stdout
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    assert len(by_kind(docs, "Deployment")) == len(ROLES) and len(by_kind(docs, "PodDisruptionBudget")) == len(ROLES)


def test_gpu_values_on_and_off():
    off = render()
    for role in ROLES:
        c = container(off, role)
        assert "nvidia.com/gpu" not in str(c["resources"]) and c["image"].endswith(":0.1.0-cpu"), role
        assert not any(e["name"] == "TOKENMILL_ENGINE__DEVICE" for e in c["env"]), role
    on = render(GPU_ON)
    for role, n in (("prefill", 1), ("decode", 2)):
        c = container(on, role)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == n and c["resources"]["requests"]["nvidia.com/gpu"] == n
        assert c["resources"]["limits"]["memory"] == "8Gi"  # the pool's own limits are kept
        assert c["image"].endswith(":0.1.0-cuda")
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["TOKENMILL_ENGINE__DEVICE"] == "cuda" and env["TOKENMILL_ENGINE__DTYPE"] == "bfloat16"
    pod = {r: by_kind(on, "Deployment")[f"{RELEASE}-tokenmill-{r}"]["spec"]["template"]["spec"]
           for r in ("prefill", "decode")}
    assert pod["prefill"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["decode"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    for role in ("router", "tokenizer", "gateway"):
        assert "nvidia.com/gpu" not in str(container(on, role)["resources"]), role


def test_config_wires_every_address_to_a_service_by_dns_and_ports_agree(tmp_path):
    docs = render(ALL_ON)
    f = tmp_path / "cluster.yaml"
    f.write_text(cluster_yaml(docs))
    # what a decode pod loads: the ConfigMap, then its own pod IP and name from the environment
    cfg = load_cluster_config(f, env={"TOKENMILL_ADVERTISE_HOST": "10.1.2.3",
                                      "TOKENMILL_INSTANCE_NAME": "tm-tokenmill-decode-abc"})
    assert cfg.model == "/models/host/llama" and cfg.router.prefill_threshold_tokens == 512
    assert cfg.engine.max_model_len == 4096 and cfg.host == "0.0.0.0"
    acme = cfg.tenants["acme"]
    assert (acme.keys_sha256, acme.rpm, acme.tpm, acme.max_class) == (("ab" * 32,), 600, 200000, "standard")
    assert cfg.service("decode").address == "10.1.2.3:20300" and cfg.service("decode").name.endswith("abc")
    services = by_kind(docs, "Service")
    for role in ("router", "tokenizer"):
        [addr] = cfg.addresses(role)
        host, port = addr.rsplit(":", 1)
        assert not re.match(r"^\d+\.\d+\.\d+\.\d+$", host), f"{role} is dialled by IP: {addr}"
        svc = services[host]
        assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["selector"]["app.kubernetes.io/component"] == role
        assert int(port) in [p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"]
    for role in ("prefill", "decode"):
        assert services[f"{RELEASE}-tokenmill-{role}"]["spec"]["clusterIP"] == "None"  # headless
    for role in ROLES:
        c = container(docs, role)
        grpc_port, metrics_port = cfg.ports(role)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == grpc_port and ports["metrics"] == metrics_port, role
        assert c["args"] == [role, "--config", "/etc/tokenmill/cluster.yaml"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == grpc_port, (role, probe)
        env = {e["name"]: e for e in c["env"]}
        assert env["TOKENMILL_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    gw = container(docs, "gateway")
    assert {p["name"]: p["containerPort"] for p in gw["ports"]}["http"] == cfg.gateway.http_port
    ref = {e["name"]: e for e in gw["env"]}["TOKENMILL_GATEWAY__API_KEYS"]["valueFrom"]["secretKeyRef"]
    secret = by_kind(docs, "Secret")[ref["name"]]
    assert secret["stringData"][ref["key"]] == "team-a:sk-1,sk-2"
    assert load_cluster_config(env={"TOKENMILL_GATEWAY__API_KEYS": secret["stringData"][ref["key"]]}
                               ).gateway.api_keys == ("team-a:sk-1", "sk-2")


def test_gateway_replicas_split_each_tenants_quotas(tmp_path):
    """The gateway pods count their own quotas, so the chart tells each it holds 1/replicas of every quota."""
    for replicas in (1, 3):
        docs = render(deep_merge(ALL_ON, {"gateway": {"replicas": replicas}}))
        assert by_kind(docs, "Deployment")[f"{RELEASE}-tokenmill-gateway"]["spec"]["replicas"] == replicas
        f = tmp_path / "cluster.yaml"
        f.write_text(cluster_yaml(docs))
        assert load_cluster_config(f, env={}).gateway.quota_shares == replicas


def test_autoscalers_pdbs_and_service_monitor():
    default = render()
    assert not by_kind(default, "HorizontalPodAutoscaler") and not by_kind(default, "ServiceMonitor")
    assert not by_kind(default, "Secret")  # no keys, no Secret
    docs = render(ALL_ON)
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert sorted(hpas) == [f"{RELEASE}-tokenmill-decode", f"{RELEASE}-tokenmill-prefill"]
    for name, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"]["name"] == name
        metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
        assert metrics == ["tokenmill_num_requests_waiting", "tokenmill_kv_cache_usage_perc"]
        assert "replicas" not in by_kind(docs, "Deployment")[name]["spec"]  # the HPA owns the count
    for name, pdb in by_kind(docs, "PodDisruptionBudget").items():
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert by_kind(docs, "Deployment")[name]["spec"]["selector"]["matchLabels"] == sel
    [sm] = by_kind(docs, "ServiceMonitor").values()
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    [relabel] = sm["spec"]["endpoints"][0]["relabelings"]  # the dashboard's `role` label
    assert relabel["targetLabel"] == "role"
    assert relabel["sourceLabels"] == ["__meta_kubernetes_service_label_app_kubernetes_io_component"]
    for svc in by_kind(docs, "Service").values():
        assert all(svc["metadata"]["labels"][k] == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
        assert "metrics" in [p["name"] for p in svc["spec"]["ports"]]


def test_more_than_one_router_is_refused():
    with pytest.raises(helm.HelmError, match=r"router\.replicas must be 1"):
        render({"router": {"replicas": 2}})


# -- values.yaml: documented line by line, and every value used --------------------------------------------
def _leaves(d: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(d, dict) and d:
        return [leaf for k, v in d.items() for leaf in _leaves(v, (*prefix, k))]
    return [prefix]


def _set(d: dict, path: tuple[str, ...], value: Any) -> dict:
    out = copy.deepcopy(d)
    cur = out
    for k in path[:-1]:
        cur = cur.setdefault(k, {})
    cur[path[-1]] = value
    return out


def _mutant(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 3
    if isinstance(value, float):
        return round(value / 2, 3)
    if isinstance(value, list):
        return [*value, {"name": "zz-mutant", "key": "zz", "operator": "Exists"}] if not value or isinstance(
            value[0], dict) else [*value, "zz-mutant"]
    if isinstance(value, dict):
        return {"zz-mutant": "zz"}
    if value == "auto":
        return "true"
    if re.fullmatch(r"\d+(\.\d+)?[a-zA-Z]*", str(value)):
        return re.sub(r"^\d+", lambda m: str(int(m.group()) + 1), str(value))
    return f"{value}x"


def test_every_value_in_values_yaml_is_used_by_a_template():
    """Change each value alone (from the defaults and from everything on): some rendered manifest must change."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    bases = [{}, ALL_ON]
    rendered = [render(b) for b in bases]
    unused = []
    for path in _leaves(defaults):
        for base, before in zip(bases, rendered):
            current: Any = deep_merge(defaults, base)
            for k in path:
                current = current[k]
            try:
                after = render(deep_merge(base, _set({}, path, _mutant(current))))
            except helm.HelmError:
                break  # a value that can make the chart refuse to render is used
            if after != before:
                break
        else:
            unused.append(".".join(path))
    assert not unused, f"values.yaml keys that no template uses: {unused}"


def test_values_yaml_is_documented_line_by_line():
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z][\w.-]*:", line) and "#" not in line:
            prev = lines[i - 1].strip() if i else ""
            if not prev.startswith("#"):
                undocumented.append(f"{i + 1}: {line.strip()}")
    assert not undocumented, f"values.yaml lines without a comment: {undocumented}"


def test_tensor_parallel_workers_get_tp_and_a_gpu_per_rank():
    tp = {"engine": {"tp": 2}, "prefill": {"replicas": 0}, "decode": {"gpus": 2}}
    docs = render(tp)
    c = container(docs, "decode")
    assert c["args"] == ["decode", "--config", "/etc/tokenmill/cluster.yaml", "--tp", "2"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container(docs, "router")["args"] == ["router", "--config", "/etc/tokenmill/cluster.yaml"]
    for values, message in [
        ({"engine": {"tp": 2}}, r"engine\.tp=2 with a prefill pool: .* set prefill\.replicas to 0"),
        (deep_merge(tp, {"decode": {"gpus": 1}}), r"decode\.gpus=1 but engine\.tp=2: a tensor-parallel worker runs "
                                                 r"one rank on each of its pod's GPUs; set decode\.gpus to 2"),
        ({"engine": {"tp": 0}}, r"engine\.tp must be >= 1, got 0"),
    ]:
        with pytest.raises(helm.HelmError, match=message):
            render(values)
