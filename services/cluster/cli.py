"""The cluster commands: ``tokenmill up``, ``tokenmill serve ROLE``, ``tokenmill status``, ``tokenmill health``,
``tokenmill ray up|status|down`` (``services/cluster/ray_pools.py``)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

from common.cluster_config import (
    METRICS_OFFSET,
    ROLES,
    ClusterConfig,
    ConfigError,
    load_cluster_config_given,
    parse_set_option,
)
from common.config import field_default
from common.machine import cpu_defaults, gpu_step_budget

# Entry points: ``serve(cfg: ServiceConfig) -> int | None`` (a coroutine function is run with asyncio.run).
ENTRY_POINTS = {role: f"services.{role}.server" for role in ROLES}


def default_of(key: str) -> Any:
    """``ClusterConfig``'s default of a dotted key (``gateway.port``), as the help text names it: the flags themselves
    default to None, so that the file and the environment are not overridden by a flag that was not given."""
    return field_default(ClusterConfig, key)


def _common_args(p: argparse.ArgumentParser) -> None:
    d = default_of
    g = p.add_argument_group("cluster config (file → TOKENMILL_* env → these flags)")
    g.add_argument("--config", type=Path, help="YAML file with any ClusterConfig field (common/cluster_config.py)")
    g.add_argument("--set", action="append", metavar="KEY=VALUE", dest="set_items",
                   help="set any config field by its dotted key, e.g. --set router.prefill_weight=2 "
                        "--set engine.max_num_seqs=32 (repeatable)")
    g.add_argument("--host", help=f"interface every service binds (default {d('host')})")
    g.add_argument("--model", help=f"model spec for every pool (default: {d('model')}, the embedded SmolLM2-135M)")
    g.add_argument("--tokenizer", dest="tokenizer_spec", metavar="SPEC",
                   help="tokenizer for every pool: a .gguf, an HF directory or smollm2 (default: the model's own); "
                        "e.g. with --model dummy:llama-3.1-8b")
    g.add_argument("--device", choices=["cpu", "cuda"],
                   help=f"where the model workers run (engine.device, default {d('engine.device')}); on cuda the "
                        "dtype defaults to bfloat16")
    g.add_argument("--tp", type=int, metavar="N",
                   help="engine.tensor_parallel_size: each model worker splits the model over N processes and, on "
                        f"cuda, N GPUs (default {d('engine.tensor_parallel_size')}; N > 1 runs the aggregated "
                        "layout, no prefill pool)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="engine.dtype (default: from the machine: bfloat16 on cuda and on CPUs with bf16 "
                        "arithmetic, else float32)")
    g.add_argument("--base-port", type=int,
                   help=f"first internal port (default {d('base_port')}; metrics from +{METRICS_OFFSET})")
    g.add_argument("--grace", type=float, dest="grace_s",
                   help=f"seconds to drain in-flight RPCs on SIGTERM ({d('grace_s'):g})")


def _overrides(a: argparse.Namespace) -> dict[str, Any]:
    ov: dict[str, Any] = {"host": a.host, "model": a.model, "tokenizer_spec": a.tokenizer_spec,
                          "base_port": a.base_port, "grace_s": a.grace_s, "engine.device": a.device,
                          "engine.dtype": a.dtype,
                          "engine.tensor_parallel_size": a.tp}
    for role in ROLES:
        ov[f"{role}.count"] = getattr(a, f"{role}_count", None)
        ov[f"{role}.port"] = getattr(a, f"{role}_port", None)
    for role in ("prefill", "decode"):
        ov[f"{role}.gpus"] = getattr(a, f"{role}_gpus_spec", None)
    ov["gateway.http_port"] = getattr(a, "http_port", None)
    ov["startup_timeout_s"] = getattr(a, "startup_timeout", None)
    ov.update(parse_set_option(a.set_items))
    return ov


def add_parsers(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="start the whole cluster as local processes (Ctrl-C stops it)",
                        description="Start every pool as local child processes, wait until all are SERVING "
                                    "(grpc.health.v1), print where to connect; Ctrl-C drains and stops them.")
    _common_args(up)
    g = up.add_argument_group("pools (counts and first ports)")
    for role in ("gateway", "router", "tokenizer", "prefill", "decode"):
        g.add_argument(f"--{role}s", type=int, dest=f"{role}_count", metavar="N",
                       help=f"{role} processes (default {default_of(f'{role}.count')})")
        g.add_argument(f"--{role}-port", type=int, dest=f"{role}_port", metavar="PORT",
                       help=f"public gRPC port (default {default_of('gateway.port')})" if role == "gateway"
                       else f"first {role} gRPC port (default: from --base-port)")
    g.add_argument("--http-port", type=int,
                   help=f"the gateway's OpenAI HTTP port (default {default_of('gateway.http_port')})")
    g = up.add_argument_group("GPUs (with --device cuda; default: an aggregated replica on every GPU, no prefill "
                              "worker; with --prefills N, a GPU per prefill worker and a decode worker on each GPU "
                              "left)")
    for role in ("prefill", "decode"):
        g.add_argument(f"--{role}-gpus", dest=f"{role}_gpus_spec", metavar="N|LIST",
                       help=f"{role}.gpus: GPUs per {role} worker (1; as in Helm and Ray) or a device list "
                            f"(0,1; 0,0 or a device also named by the other pool: shared on purpose, splitting "
                            f"engine.gpu_memory_utilization; one device: cuda:1)")
    up.add_argument("--dry-run", action="store_true",
                    help="print each process's devices and command line, start nothing")
    up.add_argument("--startup-timeout", type=float,
                    help=f"seconds to wait for every service to be SERVING ({default_of('startup_timeout_s'):g})")
    up.add_argument("--state-file", type=Path, help="where `status` finds the cluster "
                                                    "(default $XDG_RUNTIME_DIR/tokenmill or ~/.cache/tokenmill)")
    up.set_defaults(func=cmd_up)

    serve = sub.add_parser("serve", help="run one service in the foreground (for containers)",
                           description="Run one service: it listens at once, turns SERVING when ready, and "
                                       "drains on SIGTERM.")
    serve.add_argument("role", choices=ROLES)
    _common_args(serve)
    serve.add_argument("--index", type=int, default=0, help="which instance of the role (ports: first + index)")
    serve.add_argument("--port", type=int, help="gRPC port (default: from the config)")
    serve.add_argument("--metrics-port", type=int, help="/metrics port (default: from the config)")
    serve.set_defaults(func=cmd_serve)

    status = sub.add_parser("status", help="every process of the local cluster: role, pid, ports, health")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--state-file", type=Path, help="the file `tokenmill up` wrote (default as for up)")
    status.set_defaults(func=cmd_status)

    health = sub.add_parser("health", help="exit 0 if a service is SERVING (container health checks)",
                            description="Exit 0 when the gRPC service at HOST:PORT answers SERVING on "
                                        "grpc.health.v1, or when an http(s):// URL answers 200 (the gateway's "
                                        "/health); else print why and exit 1.")
    health.add_argument("target", help="HOST:PORT of a gRPC service, or a URL such as http://127.0.0.1:8000/health")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds (default %(default)g)")
    health.set_defaults(func=cmd_health)

    prof = sub.add_parser("profile", help="profile the model workers' engines (needs --set profile_dir=DIR at up)",
                          description="Start or stop the torch profiler in every model worker of the running "
                                      "cluster, through the gateway's POST /start_profile and /stop_profile (vLLM's); "
                                      "`for SECONDS` starts, waits and stops. A stop prints each worker's trace.")
    prof.add_argument("action", choices=["start", "stop", "for"], help="start, stop, or for SECONDS")
    prof.add_argument("seconds", nargs="?", type=float, help="with `for`: how long to profile")
    prof.add_argument("--url", help="the gateway's HTTP root, e.g. http://127.0.0.1:8000 (default: from the state "
                                    "file)")
    prof.add_argument("--state-file", type=Path, help="the file `tokenmill up` wrote (default as for up)")
    prof.add_argument("--api-key", help="a key, where the cluster has tenants' keys (default $TOKENMILL_API_KEY)")
    prof.set_defaults(func=cmd_profile)

    keys = sub.add_parser("keys", help="API keys for the tenants: section (stored as SHA-256 hashes)")
    ksub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    khash = ksub.add_parser("hash", help="print the SHA-256 of a key, for tenants.NAME.keys_sha256",
                            description="Print the SHA-256 (hex) of each KEY, or of each line of stdin without "
                                        "one (which keeps the key out of the shell's history).")
    khash.add_argument("key", nargs="*", help="the API key(s); none: read them from stdin, one a line")
    khash.set_defaults(func=cmd_keys_hash)
    knew = ksub.add_parser("new", help="make a random key; print it (give it to the tenant) and its hash (config)")
    knew.add_argument("--tenant", default="NAME", help="the tenant's name in the printed config lines")
    knew.set_defaults(func=cmd_keys_new)

    from services.cluster import ray_pools  # its own module: it imports this one

    ray_pools.add_parser(sub)


def cmd_keys_hash(a: argparse.Namespace) -> int:
    from services.gateway.tenancy import hash_key

    keys = a.key or [line.strip() for line in sys.stdin if line.strip()]
    if not keys:
        print("tokenmill keys hash: no key given (as an argument or on stdin)", file=sys.stderr)
        return 2
    for k in keys:
        print(hash_key(k))
    return 0


def cmd_keys_new(a: argparse.Namespace) -> int:
    import secrets

    from services.gateway.tenancy import hash_key

    key = "sk-" + secrets.token_urlsafe(32)
    print(f"key (give it to the tenant; it is not stored): {key}")
    print(f"config:\ntenants:\n  {a.tenant}:\n    keys_sha256: [\"{hash_key(key)}\"]")
    return 0


def _load(a: argparse.Namespace) -> ClusterConfig | None:
    loaded = _load_given(a)
    return None if loaded is None else loaded[0]


def _load_given(a: argparse.Namespace) -> tuple[ClusterConfig, frozenset[str]] | None:
    try:
        return load_cluster_config_given(a.config, _overrides(a))
    except ConfigError as e:
        print(f"tokenmill {a.command}: {e}", file=sys.stderr)
        return None


def cmd_up(a: argparse.Namespace) -> int:
    from services.cluster.launcher import Launcher, LaunchError, default_state_file
    from services.cluster.placement_gpu import GpuPlanError, plan_gpus, visible_gpus

    loaded = _load_given(a)
    if loaded is None:
        return 2
    cluster, given = loaded
    cluster, why = machine_defaults(cluster, given)
    try:
        plan = plan_gpus(cluster, visible_gpus() if cluster.engine.device == "cuda" else [], given)
    except GpuPlanError as e:
        print(f"tokenmill up: {e}", file=sys.stderr)
        return 2
    planned, gateways_why = gateway_defaults(plan.cluster, given)
    why[-1:-1] = gateways_why  # before the line that says what overrides them
    if why:
        print(f"tokenmill up: {_layout_line(planned)} ({'; '.join(why)})")
    launcher = Launcher(planned, a.state_file or default_state_file(), placements=plan.placements)
    if a.dry_run:
        return launcher.dry_run()
    if plan.cluster.decode.count == 0:
        print("tokenmill up: warning: no decode workers; Generate will answer UNAVAILABLE", file=sys.stderr)
    try:
        return launcher.run()
    except LaunchError as e:
        print(f"tokenmill up: {e}", file=sys.stderr)
        return 1


def machine_defaults(cluster: ClusterConfig, given: frozenset[str]) -> tuple[ClusterConfig, list[str]]:
    """The dtype and layout ``tokenmill up`` takes from the machine where nothing set them
    (``common/machine.py``), and why, one phrase each (empty: everything was asked for)."""
    why = []
    engine, prefill = cluster.engine, cluster.prefill
    if cluster.engine.device == "cpu":
        d = cpu_defaults()
        if "engine.dtype" not in given:
            engine = dataclasses.replace(engine, dtype=d.dtype)
            why.append(f"{d.dtype}: {d.why_dtype}")
        if "prefill.count" not in given and "prefill.gpus" not in given and d.aggregated:
            prefill = dataclasses.replace(cluster.prefill, count=0)
            why.append(f"aggregated: {d.why_layout}")
        if "engine.max_num_batched_tokens" not in given and d.max_num_batched_tokens != engine.max_num_batched_tokens:
            engine = dataclasses.replace(engine, max_num_batched_tokens=d.max_num_batched_tokens)
            why.append(f"{d.max_num_batched_tokens} tokens a step: {d.why_budget}")
    else:
        if "engine.dtype" not in given:
            why.append("bfloat16 on cuda")
        if "prefill.count" not in given and "prefill.gpus" not in given:
            why.append("aggregated replicas: the most goodput measured on two GPUs")
        if "engine.max_num_batched_tokens" not in given:
            from common.loader import load_model_source

            try:
                params = load_model_source(cluster.model).config.num_params()
            except (OSError, ValueError):  # the workers report a bad model spec
                params = 0
            tp = engine.tensor_parallel_size
            budget = gpu_step_budget(params, tp, engine.max_num_batched_tokens) if params else 0
            if budget and budget < engine.max_num_batched_tokens:
                engine = dataclasses.replace(engine, max_num_batched_tokens=budget)
                why.append(f"{budget} tokens a step: {params / 1e9:.1f}B parameters on {tp} GPU{'s' if tp > 1 else ''}")
    if why:
        why.append("--dtype, --prefills N and --set engine.max_num_batched_tokens=N override")
    return dataclasses.replace(cluster, engine=engine, prefill=prefill), why


GATEWAY_CORES = 4  # host cores per gateway process at most, when tokenmill up chooses how many run on CUDA
GATEWAYS_PER_DECODE = 4  # gateways a decode worker gets on CUDA, within GATEWAY_CORES


def gateway_defaults(cluster: ClusterConfig, given: frozenset[str],
                     cores: int | None = None) -> tuple[ClusterConfig, list[str]]:
    """How many gateways ``tokenmill up`` starts where ``gateway.count`` was not given, and why (empty: one).

    On CUDA ``GATEWAYS_PER_DECODE`` per decode worker, sharing the public ports (``gateway.share_ports``), within one
    per ``GATEWAY_CORES`` of the host's cores: one gateway process relays about 13,000 streamed tokens a second at a
    full core on an H200's host, less than one GPU decodes with a 1B model, and a gateway near a full core queues
    every request it takes, the interactive ones too; four per worker keep each at a third of a core or less under a
    flood of over-quota requests beside a GPU's full stream (docs/benchmarks.md, "The gateways per decode worker").
    The host's gateways share the tenants' quotas (services/gateway/host_limits.py). It keeps one where state lives
    in a gateway process: resumable streams (a client's new connection may reach another gateway)."""
    if cluster.engine.device != "cuda" or "gateway.count" in given:
        return cluster, []
    if cluster.gateway.resume_window_s > 0:
        return cluster, ["one gateway: a resumable stream lives in the gateway that started it (--gateways N)"]
    n = min(max(2, GATEWAYS_PER_DECODE * cluster.decode.count), max(1, (cores or os.cpu_count() or 1) // GATEWAY_CORES))
    if n <= cluster.gateway.count:
        return cluster, []
    shared = " sharing the public ports" if cluster.gateway.share_ports else ""
    return (dataclasses.replace(cluster, gateway=dataclasses.replace(cluster.gateway, count=n)),
            [f"{n} gateways{shared}: one relays about 13k streamed tokens/s at a full core, less than a GPU decodes; "
             f"{GATEWAYS_PER_DECODE} a decode worker keep each well below that (--gateways N)"])


def _layout_line(c: ClusterConfig) -> str:
    layout = (f"{c.decode.count} aggregated decode worker{'s' if c.decode.count != 1 else ''}" if not c.prefill.count
              else f"{c.prefill.count} prefill + {c.decode.count} decode workers")
    return f"{layout}, {c.engine.dtype} on {c.engine.device}"


def cmd_serve(a: argparse.Namespace) -> int:
    cluster = _load(a)
    if cluster is None:
        return 2
    if not 0 <= a.index < max(1, cluster.pool(a.role).count):
        print(f"tokenmill serve: --index {a.index} is outside the {cluster.pool(a.role).count} {a.role} "
              f"instances in the config", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(ENTRY_POINTS[a.role])
    except ModuleNotFoundError as e:
        if e.name != ENTRY_POINTS[a.role] and not ENTRY_POINTS[a.role].startswith(f"{e.name}."):
            raise
        print(f"tokenmill serve: the {a.role} service is not available in this build ({e.name} is missing)",
              file=sys.stderr)
        return 2
    result = module.serve(cluster.service(a.role, a.index, a.port, a.metrics_port))
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    return int(result or 0)


def cmd_status(a: argparse.Namespace) -> int:
    from services.cluster.launcher import cluster_status, default_state_file, pid_alive, read_state

    path = a.state_file or default_state_file()
    state = read_state(path)
    if state is None or not pid_alive(int(state.get("launcher_pid", -1))):
        msg = f"no cluster is running (no live launcher in {path})"
        print(json.dumps({"running": False, "state_file": str(path)}) if a.json else msg)
        return 3
    procs = cluster_status(state)
    healthy = all(p["health"] == "SERVING" for p in procs)
    if a.json:
        print(json.dumps({"running": True, "ready": bool(state.get("ready")), "healthy": healthy,
                          "launcher_pid": state["launcher_pid"],
                          "state_file": str(path), "processes": procs}, indent=1))
    else:
        phase = "ready" if state.get("ready") else "starting"
        print(f"cluster {phase}: launcher pid {state['launcher_pid']}, model {state.get('model')}, state {path}")
        print(f"{'process':<12} {'pid':>8}  {'grpc':<21} {'metrics':>7}  {'devices':<16} {'restarts':>8}  health")
        for p in procs:
            print(f"{p['name']:<12} {p['pid']:>8}  {p['address']:<21} {p['metrics_port']:>7}  "
                  f"{p.get('devices') or '-':<16} {p.get('restarts', 0):>8}  {p['health']}")
    return 0 if healthy else 1


def profile_call(url: str, what: str, api_key: str | None = None) -> dict[str, Any]:
    """The gateway's ``POST /start_profile`` (``what`` "start") or ``/stop_profile`` ("stop") at the HTTP root
    ``url``: its JSON answer. RuntimeError with the gateway's message (or why it did not answer) otherwise."""
    import contextlib
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    req = urllib.request.Request(f"{url.rstrip('/')}/{what}_profile", method="POST",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with opener.open(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")
        with contextlib.suppress(ValueError, KeyError, TypeError):  # an OpenAI error: its message
            body = json.loads(body)["error"]["message"]
        raise RuntimeError(f"{what}: {e.code}: {body}") from None
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"{what}: the gateway at {url} did not answer ({e})") from None


def cmd_profile(a: argparse.Namespace) -> int:
    import os
    import time

    from services.cluster.launcher import default_state_file, read_state

    if (a.action == "for") != (a.seconds is not None) or (a.seconds is not None and a.seconds <= 0):
        print("tokenmill profile: `for` takes a positive number of seconds (tokenmill profile for 5); start and stop "
              "take none", file=sys.stderr)
        return 2
    url = a.url
    if url is None:
        path = a.state_file or default_state_file()
        state = read_state(path) or {}
        gws = [p for p in state.get("processes", []) if p.get("role") == "gateway" and p.get("http_port")]
        if not gws:
            print(f"tokenmill profile: no gateway in {path}: is a cluster running (tokenmill status)? Or give --url",
                  file=sys.stderr)
            return 3
        url = f"http://{gws[0]['address'].rsplit(':', 1)[0]}:{gws[0]['http_port']}"
    key = a.api_key or os.environ.get("TOKENMILL_API_KEY")

    def post(what: str) -> dict[str, Any]:
        try:
            return profile_call(url, what, key)
        except RuntimeError as e:
            raise SystemExit(f"tokenmill profile: {e}") from None

    if a.action in ("start", "for"):
        started = post("start")
        print(f"profiling {', '.join(w['worker_id'] for w in started['workers'])}")
        if a.action == "start":
            return 0
        time.sleep(a.seconds)
    for w in post("stop")["workers"]:
        print(f"{w['worker_id']}: {w['trace_path']}")
    return 0


def cmd_health(a: argparse.Namespace) -> int:
    if a.target.startswith(("http://", "https://")):
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(a.target, timeout=a.timeout) as r:
                code = r.status
        except (urllib.error.URLError, OSError) as e:
            print(f"{a.target}: {getattr(e, 'code', None) or getattr(e, 'reason', e)}", file=sys.stderr)
            return 1
        return 0 if code == 200 else 1
    from common.rpc import health_status

    status = health_status(a.target, timeout=a.timeout)
    if status != "SERVING":
        print(f"{a.target}: {status}", file=sys.stderr)
        return 1
    return 0
