"""``tokenmill ray up | down | status``: the cluster's pools as Ray actors on an existing Ray cluster.

Every instance of every pool is one detached, named Ray actor (``<name>-<role>-<index>`` in the Ray namespace
``tokenmill``) that owns one ``tokenmill serve <role>`` process on its node: the same gRPC service, health and
``/metrics`` as under ``tokenmill up``, Docker or Kubernetes. Ray places the actors (``SPREAD`` over the nodes,
GPUs for prefill and decode when asked); the services then find each other the way containers do
(``common/cluster_config.py``): each binds its node's IP and advertises it, and ``router.hosts`` /
``tokenizer.hosts`` list where the router and the tokenizers landed. The gateway binds ``--gateway-host``
(all interfaces by default) so that clients outside the Ray cluster reach it.

GPUs: a prefill or decode actor asks Ray for ``--prefill-gpus`` / ``--decode-gpus`` (``num_gpus``; with
``--device cuda`` one each by default) and Ray sets its ``CUDA_VISIBLE_DEVICES``, so the worker runs on ``cuda:0``
of its own GPU. A fraction (0.5) shares a GPU on purpose: the worker's ``gpu_memory_utilization`` is that
fraction of the cluster's.

The actors outlive ``tokenmill ray up`` (it returns once every service is SERVING); ``tokenmill ray down``
drains and removes them. Tokenmill must be installed on every node (the actors run the nodes' own Python).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from common.cluster_config import ROLES, ClusterConfig, Role
from services.cluster.placement_gpu import split_utilization

log = logging.getLogger(__name__)

NAMESPACE = "tokenmill"
_WORKERS: tuple[Role, ...] = ("prefill", "decode")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the actor's process dies (ray.kill, a lost node)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ServiceProcess:
    """The body of a pool's Ray actor: one ``tokenmill serve <role>`` child on the actor's node.

    Methods are called through Ray (``ray.remote(ServiceProcess)``); none raises for a child that died: ``health``
    says ``EXITED`` and ``log_tail`` says why."""

    def __init__(self, role: str, index: int) -> None:
        self.role, self.index = role, index
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = Path(tempfile.mkdtemp(prefix=f"tokenmill-{role}-{index}-"))
        self.log_path = self.dir / "service.log"
        self.address = ""

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def start(self, config_yaml: str, address: str, env: dict[str, str]) -> int:
        """Write the config and start the service; returns the child's pid. ``address``: where it listens."""
        cfg = self.dir / "cluster.yaml"
        cfg.write_text(config_yaml)
        self.address = address
        cmd = [sys.executable, "-m", "services.cluster", "serve", self.role, "--index", str(self.index),
               "--config", str(cfg)]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **env}, preexec_fn=_die_with_parent)
        return self.proc.pid

    def health(self) -> str:
        """SERVING / NOT_SERVING / UNREACHABLE of the service, or EXITED (code N) / NOT_STARTED."""
        if self.proc is None:
            return "NOT_STARTED"
        code = self.proc.poll()
        if code is not None:
            return f"EXITED ({code})"
        from common.rpc import health_status

        return health_status(self.address.replace("0.0.0.0", "127.0.0.1"), timeout=1.0)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (the service drains), then SIGKILL after ``timeout_s``; removes the config and the log.
        Returns the exit code (None: never started)."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
            code = self.proc.returncode
        shutil.rmtree(self.dir, ignore_errors=True)
        return code


@dataclass(frozen=True, slots=True)
class Member:
    """One actor of the cluster as ``ray up`` placed it."""

    role: str
    index: int
    actor_name: str
    node_ip: str
    address: str


class RayUpError(RuntimeError):
    """The pools could not be started; the message says which service and why."""


def actor_name(name: str, role: str, index: int) -> str:
    return f"{name}-{role}-{index}"


def member_configs(cluster: ClusterConfig, members: list[tuple[str, int, str]], gateway_host: str,
                   gpus: dict[str, float] | None = None) -> dict[tuple[str, int], tuple[str, str]]:
    """Per (role, index): (config YAML, listen address), from where each landed (``(role, index, node_ip)``).

    Every service listens on its node's IP at the role's port for its index (so two on one node never collide);
    the gateway listens on ``gateway_host``. ``router.hosts`` / ``tokenizer.hosts`` point at the nodes. A worker
    that asks for a fraction of a GPU (``gpus``, per role) budgets that fraction of ``gpu_memory_utilization``.
    Gateways on several nodes count their own quotas, so each holds 1/N of every tenant's (``gateway.quota_shares``
    = the gateways, unless the config sets it)."""
    hosts: dict[str, list[str]] = {}
    for role, index, ip in members:
        hosts.setdefault(role, []).append(f"{ip}:{cluster.ports(role, index)[0]}")
    base = cluster.to_dict()
    for role in ("router", "tokenizer"):
        base[role]["hosts"] = hosts.get(role, [])
    if cluster.gateway.quota_shares == 1:
        base["gateway"] = {**base["gateway"], "quota_shares": max(1, len(hosts.get("gateway", [])))}
    out = {}
    for role, index, ip in members:
        d = {**base, "host": gateway_host if role == "gateway" else ip, "advertise_host": ip}
        share = (gpus or {}).get(role, 0.0)
        if role in _WORKERS and 0 < share < 1:
            d["engine"] = {**base["engine"], "gpu_memory_utilization":
                           split_utilization(cluster.engine.gpu_memory_utilization, share)}
        out[(role, index)] = (yaml.safe_dump(d, sort_keys=False), f"{d['host']}:{cluster.ports(role, index)[0]}")
    return out


def _connect(address: str) -> Any:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)


def _ours(name: str) -> list[str]:
    import ray

    prefix = f"{name}-"
    names = [a["name"] if isinstance(a, dict) else a for a in ray.util.list_named_actors(all_namespaces=False)]
    return sorted(n for n in names if n.startswith(prefix) and _role_of(name, n) in ROLES)


def up(cluster: ClusterConfig, address: str, name: str = "tokenmill", gateway_host: str = "0.0.0.0",
       gpus: dict[str, float] | None = None, cpus: dict[str, float] | None = None,
       timeout_s: float | None = None) -> list[Member]:
    """Start every pool as actors and wait until all are SERVING; returns where they run.

    On any failure everything started is stopped again and RayUpError raised (with the service's log tail)."""
    import ray

    _connect(address)
    try:
        taken = _ours(name)
        if taken:
            raise RayUpError(f"a cluster named {name!r} is already up ({', '.join(taken)}); "
                             f"run `tokenmill ray down --name {name}` first or pick another --name")
        gpus, cpus = gpus or {}, cpus or {}
        remote_cls = ray.remote(ServiceProcess)
        actors: dict[tuple[str, int], Any] = {}
        placed_all = False
        try:
            for role in ROLES:
                for i in range(cluster.pool(role).count):
                    actors[(role, i)] = remote_cls.options(
                        name=actor_name(name, role, i), lifetime="detached", max_restarts=0,
                        num_cpus=cpus.get(role, 1.0) if role in _WORKERS else 0.0,
                        num_gpus=gpus.get(role, 0.0), scheduling_strategy="SPREAD",
                    ).remote(role, i)
            timeout_s = timeout_s or cluster.startup_timeout_s
            try:
                placed = ray.get([a.node_ip.remote() for a in actors.values()], timeout=timeout_s)
            except ray.exceptions.GetTimeoutError as e:
                raise RayUpError(f"Ray could not place every actor within {timeout_s:.0f} s: does the cluster have "
                                 f"the GPUs ({gpus}) and CPUs ({cpus or 'default'}) asked for?") from e
            placed_all = True
            ips = dict(zip(actors, placed))
            configs = member_configs(cluster, [(r, i, ip) for (r, i), ip in ips.items()], gateway_host, gpus)
            ray.get([actors[(r, i)].start.remote(*configs[(r, i)], _child_env(cluster, r, cpus))
                     for (r, i) in actors], timeout=120)
            _wait_serving(actors, timeout_s)
        except BaseException:
            _stop_all([(r, a) for (r, _), a in actors.items()], grace_s=2.0, drain=placed_all)
            raise
        return [Member(r, i, actor_name(name, r, i), ips[(r, i)], configs[(r, i)][1]) for (r, i) in actors]
    finally:
        ray.shutdown()


def _child_env(cluster: ClusterConfig, role: str, cpus: dict[str, float]) -> dict[str, str]:
    """A worker computes with the CPUs Ray reserved for it (``threads_per_process`` when set); others need one."""
    threads = cluster.threads_per_process or (int(cpus.get(role, 1.0)) if role in _WORKERS else 1)
    return {"OMP_NUM_THREADS": str(max(1, threads)), "PYTHONUNBUFFERED": "1"}


def _wait_serving(actors: dict[tuple[str, int], Any], timeout_s: float) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        states = dict(zip(actors, ray.get([a.health.remote() for a in actors.values()], timeout=60)))
        dead = [k for k, s in states.items() if s.startswith("EXITED")]
        if dead:
            role, i = dead[0]
            tail = ray.get(actors[dead[0]].log_tail.remote())
            raise RayUpError(f"{role}-{i} {states[dead[0]].lower()}; last lines of its log:\n{tail}")
        if all(s == "SERVING" for s in states.values()):
            return
        if time.monotonic() > deadline:
            late = ", ".join(f"{r}-{i} ({s})" for (r, i), s in states.items() if s != "SERVING")
            raise RayUpError(f"not SERVING after {timeout_s:.0f} s: {late}")
        time.sleep(0.5)


def _stop_all(actors: list[tuple[str, Any]], grace_s: float, drain: bool = True) -> None:
    """Drain every service (SIGTERM) and remove the actors: the gateways first (no new requests), then the
    tokenizers and workers together, the routers last. ``drain`` False: remove them at once (actors that Ray
    has not placed would never answer)."""
    import ray

    if not drain:
        for _, a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        return

    waves: dict[int, list[Any]] = {}
    for role, a in actors:
        waves.setdefault(0 if role == "gateway" else 2 if role == "router" else 1, []).append(a)
    for _, wave in sorted(waves.items()):
        refs = [a.stop.remote(grace_s + 20.0) for a in wave]
        for ref in refs:
            with contextlib.suppress(Exception):  # an actor that is already gone
                ray.get(ref, timeout=grace_s + 60.0)
        for a in wave:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)


def down(address: str, name: str = "tokenmill", grace_s: float = 10.0) -> list[str]:
    """Drain and remove every actor of cluster ``name``; returns their names (empty: there was none)."""
    import ray

    _connect(address)
    try:
        names = _ours(name)
        _stop_all([(_role_of(name, n), ray.get_actor(n)) for n in names], grace_s)
        return names
    finally:
        ray.shutdown()


def _role_of(name: str, actor: str) -> str:
    return actor[len(name) + 1:].split("-")[0]


def status(address: str, name: str = "tokenmill") -> list[tuple[str, str, str]]:
    """(actor name, node IP, health) of every actor of cluster ``name``."""
    import ray

    _connect(address)
    try:
        names = _ours(name)
        actors = [ray.get_actor(n) for n in names]
        ips: list[str] = ray.get([a.node_ip.remote() for a in actors], timeout=60)
        return list(zip(names, ips, ray.get([a.health.remote() for a in actors], timeout=60)))
    finally:
        ray.shutdown()


# -- the command ----------------------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> None:
    from services.cluster.cli import _common_args, default_of

    p = sub.add_parser("ray", help="run the pools as Ray actors on an existing Ray cluster",
                       description="The same pools as `tokenmill up`, each instance a Ray actor running "
                                   "`tokenmill serve <role>` on the node Ray picked.")
    rs = p.add_subparsers(dest="ray_command", metavar="ACTION", required=True)

    def target(q: argparse.ArgumentParser) -> None:
        q.add_argument("--address", required=True, help="the Ray cluster, e.g. 10.0.0.1:6379 or ray://HOST:10001")
        q.add_argument("--name", default="tokenmill", help="names this deployment's actors (default %(default)s)")

    u = rs.add_parser("up", help="start every pool as actors, wait until all are SERVING, print the gateway")
    target(u)
    _common_args(u)
    g = u.add_argument_group("pools")
    for role in ROLES:
        g.add_argument(f"--{role}s", type=int, dest=f"{role}_count", metavar="N", help=f"{role} actors")
    g.add_argument("--gateway-port", type=int, dest="gateway_port", metavar="PORT",
                   help=f"public gRPC ({default_of('gateway.port')})")
    g.add_argument("--http-port", type=int, help=f"the gateway's OpenAI HTTP port ({default_of('gateway.http_port')})")
    g.add_argument("--gateway-host", default="0.0.0.0",
                   help="interface the gateway binds on its node (default %(default)s: reachable from outside)")
    for role in _WORKERS:
        g.add_argument(f"--{role}-gpus", type=float, metavar="N",
                       help=f"GPUs per {role} actor (Ray num_gpus; >0 also sets engine.device=cuda; default 1 with "
                            f"--device cuda, else 0; a fraction shares a GPU and that fraction of "
                            f"engine.gpu_memory_utilization)")
        g.add_argument(f"--{role}-cpus", type=int, default=1, metavar="N",
                       help=f"CPUs Ray reserves per {role} actor, and its compute threads (default %(default)s)")
    u.add_argument("--startup-timeout", type=float,
                   help=f"seconds to wait for every service to be SERVING ({default_of('startup_timeout_s'):g})")
    u.set_defaults(func=cmd_up)

    d = rs.add_parser("down", help="drain and remove the actors")
    target(d)
    d.add_argument("--grace", type=float, default=default_of("grace_s"), dest="grace_s",
                   help="seconds to drain (%(default)g)")
    d.set_defaults(func=cmd_down)

    s = rs.add_parser("status", help="every actor: node, health")
    target(s)
    s.set_defaults(func=cmd_status)


def cmd_up(a: argparse.Namespace) -> int:
    from services.cluster.cli import _load

    asked: dict[str, float | None] = {role: getattr(a, f"{role}_gpus") for role in _WORKERS}
    if any(asked.values()) and a.device is None:
        a.device = "cuda"
    cluster = _load(a)
    if cluster is None:
        return 2
    on_cuda = cluster.engine.device == "cuda"
    gpus = {role: g if g is not None else (1.0 if on_cuda else 0.0) for role, g in asked.items()}
    for role in _WORKERS:
        if on_cuda and cluster.pool(role).count and gpus[role] <= 0:
            print(f"tokenmill ray up: engine.device is cuda but --{role}-gpus is {gpus[role]:g}: a {role} actor "
                  f"must ask Ray for a GPU (a fraction, e.g. 0.5, shares one)", file=sys.stderr)
            return 2
    try:
        members = up(cluster, a.address, a.name, a.gateway_host, gpus=gpus,
                     cpus={role: float(getattr(a, f"{role}_cpus")) for role in _WORKERS},
                     timeout_s=a.startup_timeout)
    except RayUpError as e:
        print(f"tokenmill ray up: {e}", file=sys.stderr)
        return 1
    print(f"{len(members)} actors SERVING on Ray at {a.address} (namespace {NAMESPACE}, name {a.name})")
    print(f"{'actor':<28} {'node':<16} listens")
    for m in members:
        print(f"{m.actor_name:<28} {m.node_ip:<16} {m.address}")
    for m in members:
        if m.role == "gateway":
            host = m.node_ip if a.gateway_host in ("0.0.0.0", "::") else a.gateway_host
            grpc_port, http_port = cluster.gateway_public_ports(m.index)
            print(f"gateway: grpc {host}:{grpc_port} (tokenmill.v1.Frontend/Generate), http http://{host}:{http_port}")
    print(f"stop with: tokenmill ray down --address {a.address} --name {a.name}")
    return 0


def cmd_down(a: argparse.Namespace) -> int:
    names = down(a.address, a.name, a.grace_s)
    print(f"removed {len(names)} actors" + (f": {', '.join(names)}" if names else f" (no cluster {a.name!r})"))
    return 0


def cmd_status(a: argparse.Namespace) -> int:
    rows = status(a.address, a.name)
    for n, ip, h in rows:
        print(f"{n:<28} {ip:<16} {h}")
    return 0 if rows and all(h == "SERVING" for _, _, h in rows) else 1
