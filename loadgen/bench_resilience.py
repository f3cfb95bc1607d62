"""``tokenmill bench soak`` and ``tokenmill bench chaos``: does the cluster stay whole over time and through failures?

- **soak**: first a closed-loop probe measures the cluster's capacity (completed requests/s at ``--probe-concurrency``;
  it doubles as the warm-up), then Poisson arrivals at ``--fraction`` of it for ``--duration`` seconds. Every
  ``--interval`` seconds it samples each process's RSS and each worker's free KV blocks. The report gives every
  process's RSS at the start of the soak, at its end, its peak and growth, the blocks free once the last request is
  done, and the requests that failed. Targets: RSS growth < 5%, 0 leaked blocks, 0 failed requests.
- **chaos**: Poisson load all along; each role in turn (``--roles``) loses one process to SIGKILL, and the launcher
  starts it again. Per role: the requests that failed (a stream cut after its first token counts as lost, one
  refused before it as failed), the streams the gateway moved to another decode worker, and the time until the new
  process is SERVING again. The load goes to every gateway replica in turn; a connection refused before the request
  was sent is retried on the next replica, as a load balancer in front of them does.

Both run against a cluster of ``tokenmill up``: the one in ``--state-file``, or one they start with ``--up 'ARGS'``
(its flags) and stop at the end. Requests are streamed completions of ``--input-len`` random token ids and
``--output-len`` tokens (EOS ignored), temperature ``--temperature`` (1, OpenAI's default), through the OpenAI HTTP
API. Each prints progress, a table, and writes the JSON with ``--output``; exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.arrivals import inter_arrivals
from loadgen.bench_fuzz import block_report
from loadgen.clients import SseDecoder
from loadgen.server_metrics import parse

RSS_GROWTH_TARGET = 0.05
VOCAB_FOR_PROMPTS = 49_152  # random prompt ids are drawn below this (SmolLM2's vocabulary; any model's is larger)


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the cluster: processes from the state file ------------------------------------------------------------------
def processes(state_file: str) -> list[dict[str, Any]]:
    return json.loads(Path(state_file).read_text())["processes"]


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gateway_urls(state_file: str) -> list[str]:
    return [f"http://127.0.0.1:{p['http_port']}" for p in processes(state_file) if p["role"] == "gateway"]


async def scrape(session: Any, port: int) -> dict[str, float]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        return parse(await r.text())


def metric_total(sample: dict[str, float], name: str) -> float:
    return sum(v for k, v in sample.items() if k == name or k.startswith(name + "{"))


# -- the load -----------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    sent: float
    tokens: int = 0
    end: float | None = None
    error: str | None = None  # None: completed
    failovers: int = 0  # connections refused by a gateway replica and retried on the next

    @property
    def lost(self) -> bool:
        """A stream cut after its first token (the client saw part of an answer)."""
        return self.error is not None and self.tokens > 0


@dataclass
class Load:
    """Streamed completions sent to the gateway replicas in turn."""

    urls: list[str]
    input_len: int
    output_len: int
    temperature: float
    timeout_s: float
    seed: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    _next: int = 0
    _errors_seen: set[str] = field(default_factory=set)

    def payload(self, rng: random.Random) -> dict[str, Any]:
        return {"prompt": [rng.randrange(VOCAB_FOR_PROMPTS) for _ in range(self.input_len)],
                "max_tokens": self.output_len, "temperature": self.temperature, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}

    async def one(self, session: Any, body: dict[str, Any]) -> Outcome:
        out = Outcome(sent=time.monotonic())
        self.outcomes.append(out)
        await self._send(session, body, out)
        if out.error is not None and out.error[:40] not in self._errors_seen:  # each kind of error once, as it comes
            self._errors_seen.add(out.error[:40])
            _say(f"  request failed: {out.error}")
        return out

    async def _send(self, session: Any, body: dict[str, Any], out: Outcome) -> None:
        import aiohttp

        start, n = self._next, len(self.urls)
        self._next += 1
        for attempt in range(n):  # each replica once, from this request's turn on
            url = self.urls[(start + attempt) % n]
            try:
                async with session.post(url + "/v1/completions", json=body,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                    if r.status != 200:
                        out.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                        return
                    finished = False
                    sse = SseDecoder()
                    async for raw in r.content.iter_any():
                        for data in sse.feed(raw):
                            if data.strip() == "[DONE]":
                                break
                            chunk = json.loads(data)
                            if "error" in chunk:
                                out.error = f"stream error: {chunk['error'].get('message', '')[:200]}"
                                return
                            for c in chunk.get("choices", []):
                                out.tokens += bool(c.get("text"))
                                finished = finished or bool(c.get("finish_reason"))
                    if not finished:
                        out.error = "stream ended without a finish_reason"
                    out.end = time.monotonic()
                    return
            except aiohttp.ClientConnectorError as e:  # refused before anything was sent: the next replica
                out.failovers += 1
                if attempt == n - 1:
                    out.error = f"no gateway replica accepted the connection: {e}"
            except (TimeoutError, aiohttp.ClientError) as e:
                out.error = f"{type(e).__name__}: {e}"[:200]
                return

    async def closed_loop(self, session: Any, concurrency: int, seconds: float) -> float:
        """``concurrency`` requests in flight for ``seconds``; returns completed requests/s."""
        rng = random.Random(self.seed)
        t0 = time.monotonic()
        done = 0

        async def worker() -> None:
            nonlocal done
            while time.monotonic() - t0 < seconds:
                o = await self.one(session, self.payload(rng))
                done += o.error is None
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.monotonic() - t0)

    async def poisson(self, session: Any, rate: float, seconds: float, stop: asyncio.Event | None = None) -> None:
        """Poisson arrivals at ``rate``/s for ``seconds`` (or until ``stop``), then waits for those in flight."""
        rng = random.Random(self.seed + 1)
        gaps = np.random.default_rng(self.seed)
        t0 = time.monotonic()
        due = 0.0
        tasks: list[asyncio.Task[Outcome]] = []
        while True:
            due += float(inter_arrivals(rate, 1.0, 1, gaps)[0])
            if due >= seconds or (stop is not None and stop.is_set()):
                break
            await asyncio.sleep(max(0.0, t0 + due - time.monotonic()))
            tasks.append(asyncio.create_task(self.one(session, self.payload(rng))))
        await asyncio.gather(*tasks)


@contextlib.contextmanager
def cluster(a: argparse.Namespace) -> Any:
    """The state file of the cluster to test: ``--state-file``, or one started here with ``--up``."""
    if not a.up:
        yield a.state_file
        return
    import shlex
    import tempfile

    from loadgen.bench_gpu_serving import start_cluster

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM (or SIGINT, which a background job ignores) still stops the cluster

    signal.signal(signal.SIGTERM, interrupted)
    with tempfile.TemporaryDirectory(prefix="tokenmill-resilience-") as d, \
            start_cluster("resilience", shlex.split(a.up), Path(d), a.startup_timeout) as c:
        yield c["state"]


# -- soak ---------------------------------------------------------------------------------------------------------
async def _soak(a: argparse.Namespace, state: str) -> dict[str, Any]:
    import aiohttp

    procs = processes(state)
    load = Load(gateway_urls(state), a.input_len, a.output_len, a.temperature, a.timeout, a.seed)
    workers = [p for p in procs if p["role"] in ("prefill", "decode")]
    async with aiohttp.ClientSession() as s:
        _say(f"probe: {a.probe_concurrency} in flight for {a.probe_s:.0f} s (capacity, and the warm-up)")
        capacity = await load.closed_loop(s, a.probe_concurrency, a.probe_s)
        rate = a.fraction * capacity
        _say(f"capacity {capacity:.2f} req/s; soak at {rate:.2f} req/s ({a.fraction:.0%}) for {a.duration:.0f} s")
        probe_failed = sum(o.error is not None for o in load.outcomes)
        load.outcomes.clear()
        samples: list[dict[str, Any]] = []
        stop = asyncio.Event()

        async def sampler() -> None:
            t0 = time.monotonic()
            while True:
                free = {}
                for p in workers:
                    with contextlib.suppress(Exception):
                        free[p["name"]] = metric_total(await scrape(s, p["metrics_port"]), "tokenmill:kv_blocks_free")
                samples.append({"t": round(time.monotonic() - t0, 1),
                                "rss": {p["name"]: rss_bytes(int(p["pid"])) for p in procs}, "free_blocks": free,
                                "done": sum(o.end is not None for o in load.outcomes),
                                "failed": sum(o.error is not None for o in load.outcomes)})
                last = samples[-1]
                _say(f"  {last['t']:.0f} s: {last['done']} done, {last['failed']} failed, RSS "
                     f"{sum(v or 0 for v in last['rss'].values()) / 2**30:.2f} GiB in all")
                if stop.is_set():
                    return
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), a.interval)

        task = asyncio.create_task(sampler())
        await load.poisson(s, rate, a.duration)
        stop.set()
        await task
    blocks, leaks = await block_report(state)
    first, last = samples[0]["rss"], samples[-1]["rss"]
    rows = []
    for p in procs:
        seen = [x["rss"][p["name"]] for x in samples if x["rss"].get(p["name"])]
        start, end = first.get(p["name"]), last.get(p["name"])
        growth = (end - start) / start if start and end else None
        rows.append({"name": p["name"], "role": p["role"], "rss_start": start, "rss_end": end,
                     "rss_peak": max(seen) if seen else None, "growth": growth})
    failed = [o.error for o in load.outcomes if o.error is not None]
    return {"capacity_rps": capacity, "rate_rps": rate, "duration_s": a.duration, "probe_failed": probe_failed,
            "requests": len(load.outcomes), "failed": len(failed), "errors": sorted(set(failed))[:10],
            "processes": rows, "blocks": blocks, "leaks": leaks, "samples": samples}


def _gib(v: int | None) -> str:
    return f"{v / 2**30:.3f}" if v else "-"


def soak_table(r: dict[str, Any]) -> str:
    lines = [f"capacity {r['capacity_rps']:.2f} req/s; soak at {r['rate_rps']:.2f} req/s for {r['duration_s']:.0f} s: "
             f"{r['requests']} requests, {r['failed']} failed", "",
             "| process | RSS at start GiB | at end GiB | peak GiB | growth | target < 5% |",
             "|---|---:|---:|---:|---:|:-:|"]
    for p in r["processes"]:
        g = p["growth"]
        ok = "-" if g is None else ("yes" if g < RSS_GROWTH_TARGET else "NO")
        lines.append(f"| {p['name']} | {_gib(p['rss_start'])} | {_gib(p['rss_end'])} | {_gib(p['rss_peak'])} | "
                     f"{'-' if g is None else f'{g:+.1%}'} | {ok} |")
    lines.append(f"\nKV blocks after the run: {', '.join(r['blocks'])}; leaked: {len(r['leaks'])}")
    return "\n".join(lines)


def run_soak(a: argparse.Namespace) -> int:
    with cluster(a) as state:
        r = asyncio.run(_soak(a, state))
    print("\n" + soak_table(r))
    if a.output:
        Path(a.output).write_text(json.dumps(r, indent=1))
    missed = [p["name"] for p in r["processes"] if p["growth"] is not None and p["growth"] >= RSS_GROWTH_TARGET]
    return 1 if missed or r["leaks"] or r["failed"] else 0


# -- chaos --------------------------------------------------------------------------------------------------------
async def _serving(address: str, timeout_s: float) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        async with grpc.aio.insecure_channel(address) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.aio.AioRpcError:
        return False


async def recover(state: str, name: str, old_pid: int, timeout_s: float) -> float | None:
    """Seconds until the launcher has started ``name`` again (a new pid in the state file) and it is SERVING."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with contextlib.suppress(OSError, ValueError, KeyError):
            p = next(p for p in processes(state) if p["name"] == name)
            if int(p["pid"]) != old_pid and await _serving(p["address"], 1.0):
                return time.monotonic() - t0
        await asyncio.sleep(0.2)
    return None


async def _chaos(a: argparse.Namespace, state: str) -> dict[str, Any]:
    import aiohttp

    load = Load(gateway_urls(state), a.input_len, a.output_len, a.temperature, a.timeout, a.seed)
    rows = []
    async with aiohttp.ClientSession() as s:
        _say(f"warm-up: {a.probe_concurrency} in flight for 10 s")
        await load.closed_loop(s, a.probe_concurrency, 10)
        load.outcomes.clear()
        for role in a.roles.split(","):
            victims = [p for p in processes(state) if p["role"] == role]
            if not victims:
                rows.append({"role": role, "skipped": f"no {role} process in this cluster"})
                continue
            victim = victims[-1]
            migrations_before = await _migrations(s, state)
            start = len(load.outcomes)
            stop = asyncio.Event()
            traffic = asyncio.create_task(load.poisson(s, a.rate, math.inf, stop))
            await asyncio.sleep(a.before_s)
            _say(f"{role}: SIGKILL {victim['name']} (pid {victim['pid']}) under {a.rate:g} req/s")
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(victim["pid"]), signal.SIGKILL)
            took = await recover(state, victim["name"], int(victim["pid"]), a.recover_timeout)
            _say(f"{role}: " + (f"SERVING again after {took:.1f} s" if took is not None else
                                f"not back after {a.recover_timeout:.0f} s"))
            await asyncio.sleep(a.after_s)
            stop.set()
            await traffic
            window = load.outcomes[start:]
            errors = [o.error for o in window if o.error is not None]
            rows.append({"role": role, "killed": victim["name"], "requests": len(window),
                         "failed": sum(o.error is not None and not o.lost for o in window),
                         "lost": sum(o.lost for o in window), "failovers": sum(o.failovers for o in window),
                         "migrated": _moved(migrations_before, await _migrations(s, state)),
                         "recover_s": took, "errors": sorted(set(errors))[:5]})
    blocks, leaks = await block_report(state)
    return {"rate_rps": a.rate, "roles": rows, "blocks": blocks, "leaks": leaks}


async def _migrations(session: Any, state: str) -> dict[tuple[str, int], float]:
    """Each gateway's stream moves so far, by (name, pid): a restarted gateway starts its counter again."""
    out = {}
    for p in processes(state):
        if p["role"] == "gateway":
            with contextlib.suppress(Exception):
                out[(p["name"], int(p["pid"]))] = metric_total(await scrape(session, p["metrics_port"]),
                                                               "tokenmill:request_migrations_total")
    return out


def _moved(before: dict[tuple[str, int], float], after: dict[tuple[str, int], float]) -> float:
    """Stream moves between two scrapes, over the gateway processes alive at both (a killed one's are lost)."""
    return sum(v - before[k] for k, v in after.items() if k in before)


def chaos_table(r: dict[str, Any]) -> str:
    lines = [f"Poisson load at {r['rate_rps']:g} req/s through every kill", "",
             "| role | process killed | requests | failed before a token | lost mid-stream | migrated | failovers "
             "| SERVING again after |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for x in r["roles"]:
        if "skipped" in x:
            lines.append(f"| {x['role']} | {x['skipped']} | | | | | | |")
            continue
        rec = "not back" if x["recover_s"] is None else f"{x['recover_s']:.1f} s"
        lines.append(f"| {x['role']} | {x['killed']} | {x['requests']} | {x['failed']} | {x['lost']} | "
                     f"{x['migrated']:.0f} | {x['failovers']} | {rec} |")
    lines.append(f"\nKV blocks after the run: {', '.join(r['blocks'])}; leaked: {len(r['leaks'])}")
    return "\n".join(lines)


def run_chaos(a: argparse.Namespace) -> int:
    with cluster(a) as state:
        r = asyncio.run(_chaos(a, state))
    print("\n" + chaos_table(r))
    for x in r["roles"]:
        for e in x.get("errors", []):
            print(f"{x['role']}: {e}", file=sys.stderr)
    if a.output:
        Path(a.output).write_text(json.dumps(r, indent=1))
    return 1 if r["leaks"] or any(x.get("recover_s") is None and "skipped" not in x for x in r["roles"]) else 0


def _common(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--state-file", help="the cluster's state file (tokenmill up --state-file; default: the "
                       "one `tokenmill status` reads)")
    where.add_argument("--up", metavar="'ARGS'", help="start a cluster with these `tokenmill up` flags, stop it at "
                       "the end")
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds --up waits for the cluster (600)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request (256)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request, EOS ignored (64)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (1, OpenAI's default)")
    p.add_argument("--probe-concurrency", type=int, default=8, help="requests in flight in the probe (8)")
    p.add_argument("--timeout", type=float, default=300, help="seconds one request may take (300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write the result JSON here")


def _state_default(a: argparse.Namespace) -> argparse.Namespace:
    """``a``, its state file defaulted to the launcher's when the run neither starts a cluster nor names one."""
    if not a.up and not a.state_file:
        from services.cluster.launcher import default_state_file

        a.state_file = str(default_state_file())
    return a


def add_parser(sub: argparse._SubParsersAction) -> None:
    soak = sub.add_parser("soak", help="a long run at a fraction of capacity: RSS growth and leaked KV blocks",
                          description="A capacity probe, then Poisson load at a fraction of it for a duration, "
                                      "sampling every process's RSS and every worker's free KV blocks.")
    _common(soak)
    soak.add_argument("--duration", type=float, default=3600, help="seconds of soak after the probe (3600)")
    soak.add_argument("--fraction", type=float, default=0.5, help="of the probed capacity (0.5)")
    soak.add_argument("--probe-s", type=float, default=60, help="seconds of capacity probe (60)")
    soak.add_argument("--interval", type=float, default=30, help="seconds between samples (30)")
    soak.set_defaults(func=lambda a: run_soak(_state_default(a)))
    chaos = sub.add_parser("chaos", help="kill each role in turn under load: errors, lost and migrated streams, "
                           "time to recover", description="Under Poisson load, SIGKILL one process of each role "
                           "in turn; the launcher restarts it. Reports failed, lost and migrated streams and the "
                           "time until the process is SERVING again.")
    _common(chaos)
    chaos.add_argument("--roles", default="router,tokenizer,prefill,decode,gateway",
                       help="roles to kill, in order, one process each (default: all five)")
    chaos.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second (1)")
    chaos.add_argument("--before-s", type=float, default=5, help="seconds of load before each kill (5)")
    chaos.add_argument("--after-s", type=float, default=10, help="seconds of load after the process is back (10)")
    chaos.add_argument("--recover-timeout", type=float, default=120, help="seconds to wait for a restart (120)")
    chaos.set_defaults(func=lambda a: run_chaos(_state_default(a)))
