"""``tokenmill up``: the whole cluster as local child processes, one per service instance.

The launcher writes the resolved config to a file every child reads (so all agree on every port), starts the
children (router, tokenizers, prefill, decode, gateway), waits until each reports SERVING over grpc.health.v1,
records them in a state file (for ``tokenmill status``) and then watches them. On CUDA each prefill and decode
worker gets its own GPU(s) by ``CUDA_VISIBLE_DEVICES`` and its share of them on its command line
(``placement_gpu.py``); the other children see no GPU. Ctrl-C / SIGTERM: SIGTERM to
every child (gateway first: it stops taking requests), ``grace_s`` + 5 s to drain, then SIGKILL. A child that
dies during start-up takes the cluster down, with its role, exit code and last log lines on stderr; one that dies
later is reported the same way and started again, as a process supervisor does: after 1 s, doubling with each
death in a row up to ``restart_backoff_max_s``; its restarts are counted in the state file (``tokenmill status``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from common.cluster_config import ENV_PREFIX, ROLES, ClusterConfig, ServiceConfig
from common.rpc import health_status
from services.cluster.placement_gpu import WORKERS, Placement
from services.gateway.host_limits import HostLimits, has_limits

STATE_VERSION = 1
RESTART_RESET_S = 60.0  # a child that lived this long before dying is restarted after the shortest backoff again


def default_state_file() -> Path:
    """``$XDG_RUNTIME_DIR/tokenmill/cluster.json``, else ``~/.cache/tokenmill/cluster.json``."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    root = Path(base) / "tokenmill" if base else Path.home() / ".cache" / "tokenmill"
    return root / "cluster.json"


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """How one child is started: its command, what its environment adds to ``child_env``, and where it computes
    (``devices``: ``cuda:0 (GPU 1)``, ``cpu``, or empty for a service that runs no model)."""

    svc: ServiceConfig
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    devices: str = ""
    gpu_memory_utilization: float | None = None

    def shell(self) -> str:
        """The command as a shell line, with the variables it sets (``tokenmill up --dry-run``)."""
        return shlex.join([*(f"{k}={v}" for k, v in self.env.items()), *self.argv])


@dataclass
class Child:
    """One running service process."""

    spec: ChildSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready: bool = False
    restarts: int = 0
    deaths_in_a_row: int = 0  # deaths with less than RESTART_RESET_S of life between them
    restart_at: float | None = None  # time.monotonic() of the next start, while it is dead
    started: float = field(default_factory=time.monotonic)

    @property
    def svc(self) -> ServiceConfig:
        return self.spec.svc

    @property
    def name(self) -> str:
        return self.svc.name

    def record(self) -> dict[str, Any]:
        return {"role": self.svc.role, "index": self.svc.index, "name": self.name, "pid": self.proc.pid,
                "address": self.svc.address, "grpc_port": self.svc.grpc_port,
                "metrics_port": self.svc.metrics_port, "log": str(self.log_path), "devices": self.spec.devices,
                "gpu_memory_utilization": self.spec.gpu_memory_utilization, "restarts": self.restarts,
                **(dict(zip(("public_grpc_port", "http_port"), self.svc.cluster.gateway_public_ports(self.svc.index),
                            strict=True)) if self.svc.role == "gateway" else {})}


class LaunchError(RuntimeError):
    """The cluster cannot start or keep running; the message says which process and why."""


def child_env(cluster: ClusterConfig) -> dict[str, str]:
    """The children's environment: thread counts for a shared machine, no TOKENMILL_* (the file is resolved)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    n = str(cluster.threads_for_children())
    env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, RAYON_NUM_THREADS=n, PYTHONUNBUFFERED="1")
    return env


def planned(cluster: ClusterConfig) -> list[ServiceConfig]:
    return [cluster.service(role, i) for role in ROLES for i in range(cluster.pool(role).count)]


def child_specs(cluster: ClusterConfig, config_path: Path,
                placements: Mapping[str, Placement] | None = None) -> list[ChildSpec]:
    """Every child in start order. ``placements`` (by worker name, from ``plan_gpus``): on CUDA, each model
    worker's GPUs and utilization share; the other children get an empty ``CUDA_VISIBLE_DEVICES``."""
    on_cuda = cluster.engine.device == "cuda"
    out = []
    for svc in planned(cluster):
        argv = (sys.executable, "-m", "services.cluster", "serve", svc.role, "--config", str(config_path),
                "--index", str(svc.index))
        if svc.role not in WORKERS:
            out.append(ChildSpec(svc, argv, {"CUDA_VISIBLE_DEVICES": ""} if on_cuda else {}))
        elif not on_cuda:
            out.append(ChildSpec(svc, argv, devices="cpu"))
        else:
            place = (placements or {}).get(svc.name)
            if place is None:
                raise LaunchError(f"{svc.name} has no GPU placement (plan the cluster with plan_gpus)")
            share = f"engine.gpu_memory_utilization={place.gpu_memory_utilization:g}"
            out.append(ChildSpec(svc, (*argv, "--set", share), {"CUDA_VISIBLE_DEVICES": place.cuda_visible_devices},
                                 place.describe(), place.gpu_memory_utilization))
    return out


def with_shared_limits(cluster: ClusterConfig, run_dir: Path) -> ClusterConfig:
    """``cluster`` with ``gateway.shared_limits_file`` in ``run_dir`` where this launcher starts several gateways on
    its host and the config has quotas or in-flight caps: they then hold each tenant to them together
    (services/gateway/host_limits.py)."""
    g = cluster.gateway
    if g.count <= 1 or g.hosts is not None or g.shared_limits_file or not has_limits(cluster):
        return cluster
    return dataclasses.replace(cluster, gateway=dataclasses.replace(
        g, shared_limits_file=str(run_dir / "gateway-limits.bin")))


def check_ports_free(cluster: ClusterConfig) -> None:
    """Raise LaunchError naming the first port (and its role) something else already holds; the gateways' shared
    public ports too (they bind them with SO_REUSEPORT, which would share a port another such listener holds)."""
    ports = [(svc, kind, port, f"--base-port, --{svc.role}-port") for svc in planned(cluster)
             for kind, port in (("gRPC", svc.grpc_port), ("metrics", svc.metrics_port))]
    if cluster.gateways_share_ports:
        grpc_port, http_port = cluster.gateway_public_ports()
        gw = cluster.service("gateway")
        ports += [(gw, "shared public gRPC", grpc_port, "--gateway-port"),
                  (gw, "shared public HTTP", http_port, "--http-port")]
    for svc, kind, port, flags in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # as the servers themselves bind: a port whose last connections are in TIME_WAIT (a cluster stopped a
            # moment ago) is free; one with a listener is not
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((cluster.host, port))
            except OSError as e:
                raise LaunchError(
                    f"{svc.name} {kind} port {cluster.host}:{port} is taken ({e.strerror}); stop what holds "
                    f"it or move the cluster ({flags})") from e


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux): SIGTERM if the launcher dies
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Launcher:
    """Starts, watches and stops the children. ``run()`` blocks until Ctrl-C/SIGTERM or a child dies."""

    def __init__(self, cluster: ClusterConfig, state_file: Path, out: IO[str] | None = None,
                 placements: Mapping[str, Placement] | None = None) -> None:
        """``cluster`` and ``placements`` as ``plan_gpus`` returns them (placements: CUDA only); ``out``: where
        progress goes (default: stdout as it is when the launcher is made)."""
        self.cluster = cluster
        self.state_file = state_file
        self.run_dir = state_file.parent / "logs"
        self.out = out or sys.stdout
        self.placements = placements or {}
        self.children: list[Child] = []
        self.stop_requested = threading.Event()

    def run(self) -> int:
        """0 after a requested stop; 1 when the cluster failed (the reason is on stderr).

        Raises LaunchError before starting anything (a cluster already runs, a port is taken)."""
        self._refuse_if_running()
        check_ports_free(self.cluster)
        previous = {sig: signal.signal(sig, lambda *_: self.stop_requested.set())
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._start_all()
            self._write_state(ready=False)  # `tokenmill status` works during start-up too
            if not self._wait_ready():
                return 0
            self._write_state(ready=True)
            self._print_ready()
            self._watch()
            return 0
        except LaunchError as e:
            print(f"tokenmill up: {e}", file=sys.stderr)
            return 1
        finally:
            self.stop_all()
            self.state_file.unlink(missing_ok=True)
            for sig, handler in previous.items():  # an in-process caller gets its own handlers back
                signal.signal(sig, handler)

    def dry_run(self) -> int:
        """Print every child's devices and command line (with the variables it sets); start nothing."""
        specs = child_specs(self.cluster, self.run_dir / "cluster.yaml", self.placements)
        n = self.cluster.threads_for_children()
        print(f"{len(specs)} processes, model {self.cluster.model}, {self.cluster.engine.device} "
              f"{self.cluster.engine.dtype}; every child also gets OMP_NUM_THREADS={n} (nothing started)",
              file=self.out)
        for sp in specs:
            print(f"{sp.svc.name:<12} {sp.devices or '-':<16} {sp.shell()}", file=self.out)
        return 0

    # -- start -------------------------------------------------------------------------------------------
    def _refuse_if_running(self) -> None:
        state = read_state(self.state_file)
        if state and pid_alive(state.get("launcher_pid", -1)):
            raise LaunchError(f"a cluster is already running (launcher pid {state['launcher_pid']}, "
                             f"state {self.state_file}); see `tokenmill status`, or stop it first")

    def _start_all(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cluster = with_shared_limits(self.cluster, self.run_dir)
        if self.cluster.gateway.shared_limits_file:
            HostLimits.create(self.cluster.gateway.shared_limits_file, self.cluster)
        cfg_path = self.run_dir / "cluster.yaml"
        cfg_path.write_text(yaml.safe_dump(self.cluster.to_dict(), sort_keys=False))
        for spec in child_specs(self.cluster, cfg_path, self.placements):
            log_path = self.run_dir / f"{spec.svc.name}.log"
            self.children.append(Child(spec, self._spawn(spec, log_path, "wb"), log_path))
        print(f"starting {len(self.children)} processes (logs in {self.run_dir})", file=self.out, flush=True)

    def _spawn(self, spec: ChildSpec, log_path: Path, mode: str) -> subprocess.Popen[bytes]:
        with open(log_path, mode) as log:
            return subprocess.Popen(
                spec.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**child_env(self.cluster), **spec.env},
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def _wait_ready(self) -> bool:
        """True when every child is SERVING; False when a stop was requested first. Raises LaunchError."""
        deadline = time.monotonic() + self.cluster.startup_timeout_s
        while not all(c.ready for c in self.children):
            if self.stop_requested.is_set():
                return False
            self._check_alive()
            for c in self.children:
                if not c.ready and health_status(c.svc.address, timeout=0.5) == "SERVING":
                    c.ready = True
            if time.monotonic() > deadline:
                late = [c.name for c in self.children if not c.ready]
                raise LaunchError(f"not SERVING after {self.cluster.startup_timeout_s:.0f} s: {', '.join(late)} "
                                  f"(logs in {self.run_dir})")
            self.stop_requested.wait(0.25)
        return True

    def _check_alive(self) -> None:
        for c in self.children:
            code = c.proc.poll()
            if code is not None:
                raise LaunchError(f"{c.name} (pid {c.proc.pid}) exited with code {code}; "
                                  f"last lines of {c.log_path}:\n{tail(c.log_path)}")

    def _watch(self) -> None:
        """After start-up a dead child is reported (role, exit code, last log lines) and started again after its
        backoff, on the same ports: meanwhile the router stops placing on it and the gateway moves the streams it
        held to the rest of its pool."""
        while not self.stop_requested.wait(0.2):
            for c in self.children:
                now = time.monotonic()
                if c.restart_at is None:
                    code = c.proc.poll()
                    if code is None:
                        continue
                    c.deaths_in_a_row = 1 if now - c.started >= RESTART_RESET_S else c.deaths_in_a_row + 1
                    backoff = min(self.cluster.restart_backoff_max_s, 2.0 ** (c.deaths_in_a_row - 1))
                    c.restart_at = now + backoff
                    print(f"{c.name} (pid {c.proc.pid}) exited with code {code}; restarting it in {backoff:.0f} s; "
                          f"last lines of {c.log_path}:\n{tail(c.log_path)}", file=sys.stderr, flush=True)
                elif now >= c.restart_at:
                    c.proc = self._spawn(c.spec, c.log_path, "ab")
                    c.restarts += 1
                    c.started, c.restart_at = now, None
                    print(f"{c.name} restarted (pid {c.proc.pid}, restart {c.restarts})", file=self.out, flush=True)
                    self._write_state(ready=True)

    # -- report ------------------------------------------------------------------------------------------
    def _write_state(self, ready: bool) -> None:
        state = {"version": STATE_VERSION, "launcher_pid": os.getpid(), "ready": ready, "written_unix": time.time(),
                 "config": str(self.run_dir / "cluster.yaml"), "model": self.cluster.model,
                 "processes": [c.record() for c in self.children]}
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    def _print_ready(self) -> None:
        c = self.cluster
        gw = [ch for ch in self.children if ch.svc.role == "gateway"]
        lines = [f"tokenmill cluster ready: {len(self.children)} processes, model {c.model}"]
        for public in dict.fromkeys(c.gateway_public_ports(g.svc.index) for g in gw):  # shared ports: one line
            grpc_address, serving = f"{c.host}:{public[0]}", f"{len(gw)} gateways" if c.gateways_share_ports else ""
            lines.append(f"  connect: OpenAI API http://{c.host}:{public[1]}/v1 (model {c.model}); grpc "
                         f"{grpc_address} (tokenmill.v1.Frontend/Generate; grpcurl -plaintext {grpc_address} list)"
                         + (f"; {serving} share these ports" if serving else ""))
        lines.append(f"  {'process':<12} {'pid':>8}  {'grpc':<21} {'devices':<16} metrics")
        for ch in self.children:
            lines.append(f"  {ch.name:<12} {ch.proc.pid:>8}  {ch.svc.address:<21} {ch.spec.devices or '-':<16} "
                         f"http://{c.host}:{ch.svc.metrics_port}/metrics")
        lines.append(f"  state: {self.state_file}  (tokenmill status)")
        lines.append("Ctrl-C stops the cluster.")
        print("\n".join(lines), file=self.out, flush=True)

    # -- stop --------------------------------------------------------------------------------------------
    def stop_all(self) -> None:
        """SIGTERM every live child (gateway first), wait grace + 5 s, SIGKILL what is left. Idempotent."""
        live = [c for c in reversed(self.children) if c.proc.poll() is None]
        if not live:
            return
        print(f"stopping {len(live)} processes (grace {self.cluster.grace_s:.0f} s)", file=self.out, flush=True)
        for c in live:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cluster.grace_s + 5
        for c in live:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{c.name} (pid {c.proc.pid}) did not stop in time: killed", file=sys.stderr)
                c.proc.kill()
                c.proc.wait()


# -- state file and status --------------------------------------------------------------------------------
def read_state(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cluster_status(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every recorded process with ``alive`` and ``health`` (SERVING / NOT_SERVING / UNREACHABLE / DEAD)."""
    out = []
    for p in state.get("processes", []):
        alive = pid_alive(int(p["pid"]))
        out.append({**p, "alive": alive, "health": health_status(p["address"]) if alive else "DEAD"})
    return out
