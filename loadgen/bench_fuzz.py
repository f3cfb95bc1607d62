"""Bad input at scale: the generators of ``loadgen/fuzz.py`` (the tests run a few hundred of them) against a live
cluster's two front doors, the OpenAI HTTP API and gRPC ``Frontend/Generate``.

Run: ``tokenmill bench fuzz --url http://127.0.0.1:8000 --grpc 127.0.0.1:50051 --cases 10000 --state-file S``.

Prints progress, then the cases per front door, the status codes seen and the violations: a 5xx, a gRPC code
outside ``fuzz.GRPC_ALLOWED``, a malformed error body; with ``--state-file``, also a process that died or was
restarted and a worker whose KV blocks are not all free after the run. Exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadgen.server_metrics import parse
from services.cluster.launcher import pid_alive

if TYPE_CHECKING:  # loadgen.fuzz needs hypothesis (the dev extra): imported when the command runs
    from loadgen import fuzz

CHUNK = 200  # cases drawn at a time, the next chunk drawn while this one is sent


def draw_cases(n: int, seed: int, max_len: int, max_body_bytes: int) -> list[fuzz.Case]:
    """``n`` cases from hypothesis's generate phase (no shrinking, no example database), reproducible by seed."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    from loadgen import fuzz

    out: list[fuzz.Case] = []
    strategy = fuzz.cases(max_len, max_body_bytes)
    while len(out) < n:  # hypothesis may stop a run early (too many rejected draws)

        @with_seed(seed + len(out))
        @settings(max_examples=n - len(out), phases=[Phase.generate], database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def collect(case: fuzz.Case) -> None:
            out.append(case)

        collect()
    return out[:n]


# -- the cluster's side: processes and KV blocks (from the state file of `tokenmill up`) -------------------------
def _processes(state_file: str) -> list[dict[str, Any]]:
    return json.loads(Path(state_file).read_text())["processes"]


def process_violations(before: list[dict[str, Any]], state_file: str) -> list[str]:
    """Processes that died, or were restarted by the launcher (a new pid or a higher restart count)."""
    now = {p["name"]: p for p in _processes(state_file)}
    out = []
    for p in before:
        q = now.get(p["name"])
        if q is None or q["pid"] != p["pid"] or q.get("restarts", 0) != p.get("restarts", 0):
            out.append(f"{p['name']} (pid {p['pid']}) was restarted")
        elif not pid_alive(int(p["pid"])):
            out.append(f"{p['name']} (pid {p['pid']}) is dead")
    return out


async def _blocks(session: Any, host: str, p: dict[str, Any]) -> tuple[float, float]:
    async with session.get(f"http://{host}:{p['metrics_port']}/metrics") as r:
        m = parse(await r.text())

    def total(name: str) -> float:
        return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))

    return total("tokenmill:kv_blocks_free"), total("tokenmill:kv_blocks_total")


async def block_report(state_file: str, settle_s: float = 30.0) -> tuple[list[str], list[str]]:
    """(each worker's free/total blocks, the workers that still hold blocks after ``settle_s``)."""
    import aiohttp

    workers = [p for p in _processes(state_file) if p["role"] in ("prefill", "decode")]
    deadline = time.monotonic() + settle_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        while True:
            got = {}
            for p in workers:
                host = p.get("address", "127.0.0.1:0").rsplit(":", 1)[0]
                got[p["name"]] = await _blocks(s, host, p)
            leaks = [f"{name} holds {int(t - f)} of {int(t)} KV blocks after the run" for name, (f, t) in got.items()
                     if f != t]
            if not leaks or time.monotonic() > deadline:
                return [f"{name} {int(f)}/{int(t)} free" for name, (f, t) in got.items()], leaks
            await asyncio.sleep(1.0)


# -- the run ---------------------------------------------------------------------------------------------------
async def _max_model_len(url: str) -> int:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
        return int((await r.json())["data"][0]["max_model_len"])


async def _fuzz(a: argparse.Namespace, url: str, max_len: int
                ) -> tuple[Counter[tuple[str, str]], list[str], dict[str, str]]:
    import aiohttp
    import grpc

    from common.rpc import GRPC_OPTIONS
    from loadgen import fuzz

    tally: Counter[tuple[str, str]] = Counter()
    violations: list[str] = []
    examples: dict[str, str] = {}  # an error message for each status seen
    sem = asyncio.Semaphore(a.concurrency)
    t0 = time.monotonic()

    async def one(case: fuzz.Case, session: Any, channel: Any) -> None:
        async with sem:
            if isinstance(case, fuzz.HttpCase):
                out = await fuzz.send_http(session, url, case, a.timeout)
            else:
                out = await fuzz.send_grpc(channel, case, a.timeout)
        tally[(out.door, out.status)] += 1
        if out.message:
            examples.setdefault(f"{out.door} {out.status}", out.message[:300])
        if out.violation is not None:
            violations.append(f"{fuzz.describe(case)} → {out.violation}")

    connector = aiohttp.TCPConnector(limit=a.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session, \
            grpc.aio.insecure_channel(a.grpc, options=GRPC_OPTIONS) as channel:
        done = 0
        pending = asyncio.ensure_future(asyncio.to_thread(draw_cases, min(CHUNK, a.cases), a.seed, max_len,
                                                          a.max_body_bytes))
        while done < a.cases:
            chunk = await pending
            if done + len(chunk) < a.cases:
                pending = asyncio.ensure_future(asyncio.to_thread(
                    draw_cases, min(CHUNK, a.cases - done - len(chunk)), a.seed + 1_000_003 * (done + len(chunk)),
                    max_len, a.max_body_bytes))
            await asyncio.gather(*(one(c, session, channel) for c in chunk))
            done += len(chunk)
            print(f"  {done:,}/{a.cases:,} cases, {len(violations)} violations, {time.monotonic() - t0:.0f} s",
                  flush=True)
    return tally, violations, examples


def _codes(tally: Counter[tuple[str, str]], door: str) -> str:
    seen = sorted(((s, n) for (d, s), n in tally.items() if d == door), key=lambda x: (-x[1], x[0]))
    return ", ".join(f"{s} ×{n:,}" for s, n in seen) or "-"


def format_table(tally: Counter[tuple[str, str]], violations: list[str], procs: list[str] | None,
                 blocks: list[str] | None, leaks: list[str]) -> str:
    """The report: cases, status codes and violations per front door, then the cluster's checks."""
    per_door = Counter(d for d, _ in tally.elements())
    bad = Counter("http" if v.startswith("HTTP") else "grpc" for v in violations)
    lines = ["| front door | cases | status codes seen (count) | violations |", "|---|---|---|---|"]
    for door, name in (("http", "HTTP (OpenAI API)"), ("grpc", "gRPC Frontend/Generate")):
        lines.append(f"| {name} | {per_door[door]:,} | {_codes(tally, door)} | {bad[door]} |")
    if procs is not None:
        lines.append(f"| processes (state file) | | {'all alive, none restarted' if not procs else '; '.join(procs)} "
                     f"| {len(procs)} |")
    if blocks is not None:
        lines.append(f"| KV blocks after the run | | {', '.join(blocks)} | {len(leaks)} |")
    return "\n".join(lines)


def run(a: argparse.Namespace) -> int:
    try:
        import hypothesis  # noqa: F401  (the generators' library, in the dev extra)
    except ImportError:
        print("tokenmill bench fuzz needs hypothesis: pip install -e '.[dev]'", file=sys.stderr)
        return 2
    url = a.url.rstrip("/").removesuffix("/v1")
    max_len = a.max_model_len or asyncio.run(_max_model_len(url))
    before = _processes(a.state_file) if a.state_file else None
    print(f"fuzzing {url} and grpc {a.grpc}: {a.cases:,} cases, {a.concurrency} at a time, seed {a.seed}, "
          f"context {max_len} tokens", flush=True)
    t0 = time.monotonic()
    tally, violations, examples = asyncio.run(_fuzz(a, url, max_len))
    seconds = time.monotonic() - t0
    procs = blocks = None
    leaks: list[str] = []
    if a.state_file and before is not None:
        procs = process_violations(before, a.state_file)
        blocks, leaks = asyncio.run(block_report(a.state_file))
    print(f"\n{a.cases:,} cases in {seconds:.0f} s\n")
    print(format_table(tally, violations, procs, blocks, leaks))
    found = violations + (procs or []) + leaks
    for v in found[:a.show]:
        print(f"VIOLATION {v}", file=sys.stderr)
    if a.output:
        Path(a.output).write_text(json.dumps({
            "cases": a.cases, "seed": a.seed, "seconds": seconds, "max_model_len": max_len,
            "status": {f"{d} {s}": n for (d, s), n in sorted(tally.items())}, "examples": examples,
            "violations": found}, indent=1))
    return 1 if found else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fuzz", help="bad input at scale against a live cluster's HTTP and gRPC front doors",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the OpenAI API (default http://127.0.0.1:8000)")
    p.add_argument("--grpc", default="127.0.0.1:50051", help="the gateway's gRPC address (default 127.0.0.1:50051)")
    p.add_argument("--cases", type=int, default=1000, help="cases in all, about half per front door (default 1000)")
    p.add_argument("--concurrency", type=int, default=4, help="cases in flight (default 4)")
    p.add_argument("--seed", type=int, default=0, help="the same seed draws the same cases (default 0)")
    p.add_argument("--state-file", help="the cluster's state file (tokenmill up --state-file): check that every "
                   "process lives through the run and every worker's KV blocks are free after it")
    p.add_argument("--max-model-len", type=int, help="the context, for prompts at and over it (default: /v1/models)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="gateway.max_body_bytes, for bodies just over it (default 4 MiB)")
    p.add_argument("--timeout", type=float, default=120, help="seconds one case may take (default 120)")
    p.add_argument("--show", type=int, default=20, help="violations printed in full (default 20)")
    p.add_argument("--output", help="write the counts and every violation as JSON here")
    p.set_defaults(func=run)
