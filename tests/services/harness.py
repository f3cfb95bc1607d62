"""Helpers for service tests: free ports below 32768, in-process servers, fake workers' Report streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
from tokenmill.v1 import router_pb2, router_pb2_grpc

from common.cluster_config import ClusterConfig, ConfigError, load_cluster_config
from common.config import EngineConfig, field_default
from common.rpc import RunningServer, ServiceApp, start_server

HOST = "127.0.0.1"
_taken: set[int] = set()


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port in 12000..31999 that binds now (tests must not use the ephemeral range from 32768)."""
    for _ in range(1000):
        p = random.randrange(12000, 32000)
        if p not in _taken and port_free(p):
            _taken.add(p)
            return p
    raise RuntimeError("no free port below 32768")


def free_base_port(span: int = 1500) -> int:
    """A base port with ``span`` ports above it (the cluster's derived ports) that all bind now."""
    for _ in range(200):
        base = random.randrange(10000, 32000 - span, 100)
        if all(port_free(base + off + i) for off in (0, 100, 200, 300, 400, 1000, 1100, 1200, 1300, 1400)
               for i in range(3)):
            return base
    raise RuntimeError("no free port range below 32768")


def cluster(**overrides: Any) -> ClusterConfig:
    """A cluster config for tests. Unless ``base_port`` is given, the derived ports start at a base whose ports are
    free now, retried until they also miss the ports the test chose itself (a random ``router.port`` can otherwise
    land on the default base's derived metrics ports and be refused as a collision)."""
    overrides = {"gateway.http_port": free_port(), **overrides}  # never the shared default 8000
    if "base_port" in overrides:
        return load_cluster_config(overrides=overrides, env={})
    last: ConfigError | None = None
    for _ in range(50):
        try:
            return load_cluster_config(overrides={"base_port": free_base_port(), **overrides}, env={})
        except ConfigError as e:
            if "collides" not in str(e):
                raise
            last = e
    raise RuntimeError(f"no base port without collisions: {last}")


@contextlib.asynccontextmanager
async def serving(app: ServiceApp, cfg: ClusterConfig, role: str, port: int | None = None
                  ) -> AsyncIterator[RunningServer]:
    """Run ``app`` in this event loop until the block exits (health SERVING once started)."""
    svc = cfg.service(role, 0, port=port, metrics_port=free_port())
    srv = await start_server(app, HOST, svc.grpc_port, svc.metrics_port)
    try:
        await app.start()
        await srv.set_serving(True)
        yield srv
    finally:
        await srv.drain(0.5)
        await app.stop()


class Reporter:
    """A fake worker's Report stream to a router."""

    def __init__(self, router_address: str) -> None:
        self.channel = grpc.aio.insecure_channel(router_address)
        self.call = router_pb2_grpc.RouterStub(self.channel).Report()

    async def send(self, **fields: Any) -> None:
        await self.call.write(router_pb2.WorkerLoad(**fields))

    async def close(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.call.done_writing()
            await self.call
        await self.channel.close()


async def wait_for_workers(router_address: str, n: int, timeout: float = 5.0) -> list[router_pb2.WorkerLoad]:
    """Poll ListWorkers until exactly ``n`` workers are known."""
    async with grpc.aio.insecure_channel(router_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            ws = list((await stub.ListWorkers(router_pb2.ListWorkersRequest())).workers)
            if len(ws) == n:
                return ws
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"router knows {len(ws)} workers, expected {n}: {ws}")
            await asyncio.sleep(0.02)


def _pinned(args: tuple[str, ...]) -> list[str]:
    """What the tests' clusters fix that ``tokenmill up`` would otherwise take from the machine (common/machine.py):
    float32 (outputs are compared with the float32 engine), on the CPU one prefill worker, and the engine's own step
    budget (tests that time steps count on it, whatever the machine's cores)."""
    joined = " ".join(args)
    out = [] if "--dtype" in args or "engine.dtype=" in joined else ["--dtype", "float32"]
    if "cuda" not in args and "--prefills" not in args and "prefill.count=" not in joined:
        out += ["--prefills", "1"]
    if "engine.max_num_batched_tokens=" not in joined:
        out += ["--set", f"engine.max_num_batched_tokens={field_default(EngineConfig, 'max_num_batched_tokens')}"]
    return out


@contextlib.contextmanager
def running_cluster(tmp: Path, *args: str, timeout: float = 240,
                    env: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """``tokenmill up`` as a user runs it, on a free port range, until the block exits (then SIGTERM, and the
    launcher must exit 0). ``args``: more ``up`` options; ``env``: more environment. Yields the state file's content plus ``base``,
    ``gateway`` (gRPC HOST:PORT), ``http`` (the OpenAI API root URL) and ``state`` (its path)."""
    base = free_base_port()
    state = tmp / "state.json"
    cmd = [sys.executable, "-m", "services.cli", "up", "--base-port", str(base), "--gateway-port", str(base + 450),
           "--http-port", str(base + 451), "--state-file", str(state), *_pinned(args), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    deadline = time.monotonic() + timeout
    try:
        while not (state.exists() and json.loads(state.read_text()).get("ready")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("tokenmill up was not ready")
            time.sleep(0.3)
        info = json.loads(state.read_text())
        info.update(base=base, gateway=f"{HOST}:{base + 450}", http=f"http://{HOST}:{base + 451}", state=str(state))
        yield info
    except BaseException as e:  # the body's failure is the one to report; the cluster just goes away
        proc.kill()
        e.add_note(f"tokenmill up stderr, last lines: {proc.communicate()[1][-3000:]}")
        raise
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
