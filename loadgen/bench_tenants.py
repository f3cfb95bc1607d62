"""``tokenmill bench tenants``: the noisy-neighbour benchmark.

It starts a cluster (``tokenmill up`` with the machine's default layout, what ``make up`` runs) with three tenants
in its config, each with an API key of its own, so every request goes through the real key check, quotas and class
resolution at the gateway:

- ``interactive``: default and maximum class interactive, no quota;
- ``flood``: class batch, at most ``--flood-max-inflight`` requests in flight at the gateways (16; over it 429 /
  RESOURCE_EXHAUSTED), and optionally a quota (``--flood-rpm`` requests per minute; its excess gets 429 too) and a
  per-worker cap on its running sequences (``--flood-max-running``). The in-flight cap lets the flood take what the
  interactive tenant leaves (a quota is a fixed rate, whatever the cluster has to spare);
- ``probe``: class standard, no quota, only for the calibration.

Then, over gRPC ``Generate``, every request at ``--temperature`` (default 1, the OpenAI default) and ignoring EOS:

0. calibration: the probe tenant closed-loop at ``--calibrate-concurrency`` for ``--calibrate-seconds``: the
   cluster's capacity in the flood's request shape (requests/s and output tokens/s);
1. (a) the interactive tenant alone at ``--interactive-rate`` (Poisson) for ``--duration`` seconds;
2. (b) the same requests at the same times, beside the flood tenant sending at ``--flood-factor`` × its fair share
   (half the capacity: both weigh 1), Poisson. When the interactive tenant's last request ends the flood is
   cancelled. The flood is sent from client processes of its own (``_FloodProcess``, one per 250 requests a second
   unless ``--flood-processes`` says), as other clients would send it: hundreds of its requests a second, most
   refused, would otherwise share the event loop that times the interactive tenant's (its lag is printed:
   ``LoopLag``), and one process asked for more than it can send falls behind. The result says how the flood's
   requests ended (answered, refused, still waiting) and how late they were sent.

(a) and (b) alternate ``--rounds`` times and the figures pool the rounds, so a change in the machine's load
(a shared machine) falls on both alike.

It prints the interactive tenant's TTFT and TPOT p50/p99 in both runs and their ratio (each p99 ratio with the
central 90% of it over bootstrap resamples of the run's requests: a target inside that is not resolved by this
run), the flood's throughput and its share of the capacity and of what the interactive tenant left, and who got
the 429s. Requests due in the first
``--warmup-seconds`` of a run are sent but left out. Each run has a cache salt of its own, so run (b) does not hit
run (a)'s prefix cache. Around each run it reads every process's ``/metrics`` and prints what stood the cluster
still: the gateway's event loop waking late (over 20 ms, over 100 ms) and garbage collections of 50 ms or more;
and the CPU each process used (``loadgen/proc_cpu.py``: the cluster's, a worker's engine core as its child, the
flood's clients and the load generator), which says which process a flood saturates. The
result keeps the interactive tenant's request ids, send times and TTFTs (``client_records``): run the cluster with
``--set trace_dir=DIR`` and ``python -m loadgen.trace_summary DIR --client RESULT`` splits each TTFT into the way to
the gateway, the gateway's own TTFT and the way back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import multiprocessing as mp
import os
import secrets
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from common.loop_lag import LoopLag
from loadgen import proc_cpu
from loadgen.bench_gpu_serving import free_base_port
from loadgen.bench_offline import _machine, _say, _source_state
from loadgen.bench_serve import _finite
from loadgen.bench_serving_peer import _serving
from loadgen.clients import GrpcTarget, SendOptions
from loadgen.metrics import RequestRecord, ratio_interval, stats, summarize
from loadgen.runner import LoadConfig, run_load, run_warmups
from loadgen.server_metrics import MetricsWatcher, histogram_tail, named_endpoints_from_state
from loadgen.workloads import PromptBuilder, Tenant, WorkloadConfig, iter_requests

REPO_ROOT = Path(__file__).resolve().parents[1]
TTFT_TARGET = 1.20  # the flood may move the interactive tenant's TTFT p99 by less than 20%
TPOT_TARGET = 1.10  # and its TPOT p99 by less than 10%
FLOOD_RPS_PER_PROCESS = 250.0  # the flood's requests a second per client process (--flood-processes 0)
FLOOD_OUTSTANDING = 512  # its requests in flight per client process at most: a client that falls behind stays alive


def _tokens_or_none(v: str) -> str:
    """``--batch-prefill-tokens``: a count >= 0, or "none" (no limit)."""
    if v != "none" and not (v.isdigit() and int(v) >= 0):
        raise argparse.ArgumentTypeError(f"expected a count of tokens >= 0 or 'none', got {v!r}")
    return v


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tenants", help="noisy neighbour: an interactive tenant alone, then beside a flooding one",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=20.0, help="seconds of each run (default 20)")
    p.add_argument("--rounds", type=int, default=10,
                   help="runs (a) and (b) alternate this many times; the figures pool them (default 10: with the "
                        "other defaults about 800 measured interactive requests a window, so a p99 is about the "
                        "eighth-worst request, not the second)")
    p.add_argument("--warmup-seconds", type=float, default=4.0,
                   help="requests due in a run's first S seconds are sent but left out (default 4)")
    p.add_argument("--interactive-rate", type=float, default=5.0,
                   help="the interactive tenant's req/s (default 5: about 80 measured requests a round)")
    p.add_argument("--interactive-input-len", type=int, default=64, help="default 64")
    p.add_argument("--interactive-output-len", type=int, default=32, help="default 32")
    p.add_argument("--flood-factor", type=float, default=10.0,
                   help="the flood's offered rate in multiples of its fair share (default 10)")
    p.add_argument("--flood-input-len", type=int, default=128, help="default 128")
    p.add_argument("--flood-output-len", type=int, default=64, help="default 64")
    p.add_argument("--flood-rpm", type=int, default=0,
                   help="the flood tenant's quota, requests per minute (default 0: none; a quota is a fixed rate, "
                        "not a share of the spare capacity)")
    p.add_argument("--flood-rpm-burst", type=int, default=8, help="its request bucket (default 8)")
    p.add_argument("--flood-max-running", type=int, default=0,
                   help="the flood tenant's running sequences per worker (default 0: no cap)")
    p.add_argument("--flood-max-inflight", type=int, default=16,
                   help="the flood tenant's requests in flight at the gateways (tenants.flood.max_inflight; over it "
                        "429; default 16; 0: no cap)")
    p.add_argument("--flood-processes", type=int, default=0,
                   help="client processes that send the flood, its rate split among them (default 0: one per "
                        f"{FLOOD_RPS_PER_PROCESS:g} req/s)")
    p.add_argument("--batch-prefill-tokens", type=_tokens_or_none, default=None, metavar="N|none",
                   help="engine.batch_prefill_tokens_beside_urgent: the flood's prompt tokens in a step that runs "
                        "the interactive tenant's (default: the engine's, 0: the prompts pause; "
                        "none: no limit)")
    p.add_argument("--calibrate-seconds", type=float, default=12.0, help="default 12")
    p.add_argument("--calibrate-concurrency", type=int, default=16, help="default 16")
    p.add_argument("--base-port", type=int, default=None,
                   help="the cluster's internal ports from here, gateway gRPC +450, HTTP +451 (default: a range "
                        "below 32768 whose ports are free now)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="every request's temperature, both tenants' and the calibration's (default 1, the OpenAI "
                        "default; 0: greedy)")
    p.add_argument("--model", help="passed to `tokenmill up --model` (default: its default, the embedded SmolLM2)")
    p.add_argument("--tokenizer", help="passed to `tokenmill up --tokenizer` (a dummy model's tokenizer)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to `tokenmill up --set` (repeatable), e.g. engine.max_num_seqs=32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", help="write the results as JSON here")
    p.add_argument("--log-dir", help="the cluster's log, config and state file (default: a temporary directory)")
    p.set_defaults(func=run)


# -- the cluster -------------------------------------------------------------------------------------------------
def tenants_config(a: argparse.Namespace, keys: dict[str, str]) -> dict[str, Any]:
    """The cluster config's ``tenants:`` section; ``keys``: tenant → its API key (only the hash goes in)."""
    def sha(k: str) -> list[str]:
        return [hashlib.sha256(k.encode()).hexdigest()]

    return {"tenants": {
        "interactive": {"keys_sha256": sha(keys["interactive"]), "default_class": "interactive",
                        "max_class": "interactive", "weight": 1.0},
        "flood": {"keys_sha256": sha(keys["flood"]), "default_class": "batch", "max_class": "batch", "weight": 1.0,
                  "rpm": a.flood_rpm, "rpm_burst": a.flood_rpm_burst if a.flood_rpm else 0,
                  "max_running": a.flood_max_running, "max_inflight": a.flood_max_inflight},
        "probe": {"keys_sha256": sha(keys["probe"]), "default_class": "standard", "max_class": "standard"},
    }}


def up_command(a: argparse.Namespace, config: Path, base: int, work: Path) -> list[str]:
    """The ``tokenmill up`` command line of the benchmark's cluster (gateway gRPC on ``base`` + 450, HTTP + 451)."""
    cmd = [sys.executable, "-m", "services.cli", "up", "--config", str(config), "--base-port", str(base),
           "--gateway-port", str(base + 450), "--http-port", str(base + 451), "--state-file",
           str(work / "state.json")]
    if a.model:
        cmd += ["--model", a.model]
    if a.tokenizer:
        cmd += ["--tokenizer", a.tokenizer]
    if a.batch_prefill_tokens is not None:  # "none": no limit (null)
        cmd += ["--set", f"engine.batch_prefill_tokens_beside_urgent={a.batch_prefill_tokens.replace('none', 'null')}"]
    for item in a.set:
        cmd += ["--set", item]
    return cmd


@contextlib.contextmanager
def cluster(a: argparse.Namespace, keys: dict[str, str], work: Path):
    """``tokenmill up`` with the tenants' config; yields the gateway's gRPC address once /health is 200."""
    cfg = work / "tenants-cluster.yaml"
    cfg.write_text(yaml.safe_dump(tenants_config(a, keys)))
    base = a.base_port if a.base_port is not None else free_base_port()
    cmd = up_command(a, cfg, base, work)
    _say(f"starting the cluster: {' '.join(cmd)} (log {work / 'cluster.log'})")
    with _serving(cmd, work / "cluster.log", base + 451, 600, "tokenmill", cwd=REPO_ROOT):
        yield f"127.0.0.1:{base + 450}"


# -- the runs ----------------------------------------------------------------------------------------------------
def _workload(inp: int, out: int, seed: int) -> WorkloadConfig:
    return WorkloadConfig(dataset="random", input_len=(inp, inp), output_len=(out, out), seed=seed)


async def _phase(target: GrpcTarget, builder: PromptBuilder, loads: list[tuple[Tenant, WorkloadConfig, LoadConfig]],
                 background: tuple[_FloodProcess, float, LoadConfig] | None = None
                 ) -> tuple[list[list[RequestRecord]], list[RequestRecord], float]:
    """Run ``loads`` to the end, and ``background`` (the flood's process, its rate and load) beside them until they
    end (then it is cancelled).

    Returns each load's records, the background's (their ``start`` moved to this phase's clock), and the phase's
    start (perf_counter)."""
    target.opts = dataclasses.replace(target.opts, cache_salt=uuid.uuid4().hex)
    t0 = time.perf_counter()
    if background is not None:
        flood, rate, load = background
        assert load.duration_s is not None
        flood.go(rate, load.duration_s, load.seed, target.opts.cache_salt or "")
    bg_recs: list[RequestRecord] = []
    try:
        out = await asyncio.gather(*(run_load(target, iter_requests(w, builder, [t]), load)
                                     for t, w, load in loads))
    finally:
        if background is not None:
            bt0, bg_recs = await background[0].stop()
            for r in bg_recs:
                r.start += bt0 - t0
    return list(out), bg_recs, t0


def flood_processes(a: argparse.Namespace, rate: float) -> int:
    """How many client processes send a flood of ``rate`` requests a second."""
    return a.flood_processes or max(1, math.ceil(rate / FLOOD_RPS_PER_PROCESS))


class _FloodProcess:
    """The flood tenant's clients in processes of their own (spawned once, reused by every run (b)), the rate split
    among them: ``go`` starts an open-loop load in each, ``stop`` cancels them and returns the earliest start
    (``time.perf_counter``, the same clock in every process of the machine) and every record, from that start.

    A Python gRPC client sends a few hundred calls a second; one asked for more falls behind, and an open loop that
    catches up at once piles up calls it never gets to send (every one then ends cancelled, nothing reaching the
    gateway). So the flood takes several processes (``flood_processes``), each with at most ``FLOOD_OUTSTANDING``
    calls in flight, and the result says how late its requests were sent."""

    def __init__(self, address: str, key: str, a: argparse.Namespace, processes: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(processes):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_flood_main, name=f"tenants-flood-{i}", daemon=True,
                               args=(child, address, key, a.flood_input_len, a.flood_output_len,
                                     a.seed + 2 + 1000 * i, a.temperature))
            proc.start()
            self.conns.append(conn)
            self.procs.append(proc)
        for conn in self.conns:
            if not conn.poll(300) or conn.recv() != "ready":
                raise RuntimeError("a flood client process did not start")

    def go(self, rate: float, duration: float, seed: int, salt: str) -> None:
        for i, conn in enumerate(self.conns):
            conn.send(("go", rate / len(self.conns), duration, seed + 7919 * i, salt))

    async def stop(self) -> tuple[float, list[RequestRecord]]:
        for conn in self.conns:
            conn.send("stop")
        loop = asyncio.get_running_loop()
        got = await asyncio.gather(*(loop.run_in_executor(None, conn.recv) for conn in self.conns))
        t0 = min(t for t, _ in got)
        recs: list[RequestRecord] = []
        for t, rs in got:
            for r in rs:
                r.start += t - t0
                r.scheduled += t - t0
            recs += rs
        return t0, recs

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send("exit")
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _flood_main(conn: Any, address: str, key: str, inp: int, out: int, seed: int, temperature: float) -> None:
    asyncio.run(_flood_loop(conn, address, key, inp, out, seed, temperature))


async def _flood_loop(conn: Any, address: str, key: str, inp: int, out: int, seed: int, temperature: float) -> None:
    from common.loader import load_tokenizer

    builder = PromptBuilder(load_tokenizer(None))
    target = GrpcTarget(address, None, SendOptions(ignore_eos=True, temperature=temperature, timeout=120.0))
    await target.open()
    loop = asyncio.get_running_loop()
    conn.send("ready")
    try:
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg == "exit":
                return
            _, rate, duration, lseed, salt = msg
            target.opts = dataclasses.replace(target.opts, cache_salt=salt)
            recs: list[RequestRecord] = []
            load = LoadConfig(request_rate=rate, num_requests=None, duration_s=duration, seed=lseed,
                              max_concurrency=FLOOD_OUTSTANDING)
            t0 = time.perf_counter()
            task = asyncio.create_task(run_load(target, iter_requests(_workload(inp, out, seed), builder,
                                                                      [Tenant("flood", rate, api_key=key)]),
                                                load, into=recs))
            stop = loop.run_in_executor(None, conn.recv)
            await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if not stop.done():
                await stop
            conn.send((t0, recs))
    finally:
        await target.close()


def _tokens_in_window(recs: list[RequestRecord], lo: float, hi: float) -> int:
    """Output tokens that reached the client between run times ``lo`` and ``hi`` (cancelled requests too)."""
    n = 0
    for r in recs:
        for t, k in zip(r.chunk_times, r.chunk_tokens):
            if lo <= r.start + t <= hi:
                n += k
    return n


def _was_sent(r: RequestRecord) -> bool:
    """Whether the client sent the request (it stamps the wall clock as it sends; one cancelled while due keeps
    ``start`` 0 and would read as sent on time)."""
    return r.start_wall_ns is not None


def _refused(recs: list[RequestRecord]) -> int:
    return sum(1 for r in recs if r.error_kind == "RESOURCE_EXHAUSTED")


def _late(s: dict[str, Any]) -> str:
    if s["p50"] is None:
        return "none"
    return f"p50 / p99 / max {s['p50']:.1f} / {s['p99']:.1f} / {s['max']:.0f} ms after their due time"


def _outcomes(recs: list[RequestRecord]) -> dict[str, Any]:
    """How ``recs`` ended: ``summarize``'s counts (``ok``; ``cancelled``: still waiting when the run ended; each
    error kind) and one message of each error kind."""
    s = summarize(recs)
    sample: dict[str, str] = {}
    for r in recs:
        if r.outcome == "error" and str(r.error_kind) not in sample:
            sample[str(r.error_kind)] = (r.error or "")[:200]
    counts = {"ok": s["completed"]}
    for k, n in s["errors"].items():
        counts["ended without a token" if k == "ok" else k] = n
    return {"counts": dict(sorted(counts.items(), key=lambda kv: -kv[1])), "error_samples": sample}


def _measured(records: list[RequestRecord], key: str) -> list[float]:
    """The measured requests' TTFTs or TPOTs (s), as ``summarize`` takes them."""
    done = [r for r in records if not r.warmup and r.ok]
    if key == "ttft":
        return [r.ttft for r in done if r.ttft is not None]
    return [r.tpot for r in done if r.tpot is not None and r.output_tokens > 1]


def _verdict(ratio: float, target: float, interval: Any) -> str:
    """"met" / "MISSED" by the ratio, and whether the requests measured could tell (the interval's side)."""
    said = "met" if ratio < target else "MISSED"
    if interval is None or any(x is None or math.isnan(x) for x in interval):  # no requests on a side
        return said
    lo, hi = interval
    span = f"90% interval from sampling {100 * (lo - 1):+.0f}% … {100 * (hi - 1):+.0f}%"
    if lo < target <= hi:
        return f"{said}, not resolved: {span}"
    return f"{said}; {span}"


def _p(s: dict[str, Any], key: str, q: str) -> float:
    v = s[key][q]
    return math.nan if v is None else float(v)


def _stalls(w: MetricsWatcher, names: dict[str, str]) -> dict[str, Any]:
    """What stood the cluster's processes still over one window, from their /metrics before and after it: the
    gateway's event loop waking a 10 ms timer late (over 20 ms, over 100 ms, the highest bucket reached) and every
    process's garbage collections of 50 ms or more."""
    out: dict[str, Any] = {"gc_over_50ms": {}, "gc_top_s": {}}
    for url, name in names.items():
        if url not in w.before or url not in w.after:
            continue
        b, af = w.before[url], w.after[url]
        if name.startswith("gateway"):
            n, over20, top = histogram_tail(b, af, "tokenmill:gateway_loop_lag_seconds", 0.02)
            out[f"{name}_loop_lag"] = {"wakes": n, "over_20ms": over20,
                                       "over_100ms": histogram_tail(b, af, "tokenmill:gateway_loop_lag_seconds", 0.1)[1],
                                       "top_bucket_s": top}
        n, over, top = histogram_tail(b, af, "tokenmill:gc_pause_seconds", 0.05)
        if over:
            out["gc_over_50ms"][name] = over
            out["gc_top_s"][name] = top
    return out


def _cpu_line(window: str, rounds: list[dict[str, float]]) -> str:
    """The processes' CPU in a window, averaged over its rounds, the busiest first."""
    names = {k for r in rounds for k in r}
    avg = sorted(((sum(r.get(k, 0.0) for r in rounds) / len(rounds), k) for k in names), reverse=True)
    return f"CPU, % of a core, {window}: " + ", ".join(f"{k} {v:.0f}" for v, k in avg if v >= 1)


def _stall_line(window: str, s: dict[str, Any]) -> str:
    parts = []
    for k, v in s.items():
        if k.endswith("_loop_lag"):
            top = v["top_bucket_s"]
            parts.append(f"{k[:-9]}'s loop woke over 20 ms late {v['over_20ms']:.0f} times, over 100 ms "
                         f"{v['over_100ms']:.0f} (the worst ≤ {'-' if top is None else f'{top * 1e3:g} ms'})")
    gcs = ", ".join(f"{n} {c:.0f} (worst ≤ {s['gc_top_s'][n] * 1e3:g} ms)" for n, c in s["gc_over_50ms"].items())
    parts.append(f"collections of 50 ms or more: {gcs or 'none'}")
    return f"{window}: " + "; ".join(parts)


async def _main(a: argparse.Namespace, address: str, keys: dict[str, str], state_file: Path | None = None
                ) -> dict[str, Any]:
    from common.loader import load_tokenizer

    builder = PromptBuilder(load_tokenizer(None))
    target = GrpcTarget(address, None, SendOptions(ignore_eos=True, temperature=a.temperature, timeout=120.0))
    inter = Tenant("interactive", a.interactive_rate, api_key=keys["interactive"])
    probe = Tenant("probe", 1.0, api_key=keys["probe"])
    flood_w = _workload(a.flood_input_len, a.flood_output_len, a.seed + 2)
    inter_w = _workload(a.interactive_input_len, a.interactive_output_len, a.seed + 1)
    await target.open()
    lag = LoopLag(keep=True)  # this process's own event-loop lag: it sends and times every request
    lag.start()
    lags: dict[str, list[float]] = {"alone": [], "beside_flood": []}
    names = named_endpoints_from_state(state_file) if state_file is not None and state_file.exists() else {}
    stalls: dict[str, list[dict[str, Any]]] = {"alone": [], "beside_flood": []}
    cpu: dict[str, list[dict[str, float]]] = {"alone": [], "beside_flood": []}
    cluster = proc_cpu.cluster_pids(state_file) if state_file is not None and state_file.exists() else {}

    async def watched(window: str, phase: Any) -> Any:
        w = MetricsWatcher(list(names), interval=3600)  # one scrape before and one after the window
        roots = {**cluster, os.getpid(): "load generator",
                 **{p.pid: "flood clients" for p in (flood_proc.procs if flood_proc else []) if p.pid}}
        c0, t0 = proc_cpu.snapshot(roots), time.perf_counter()
        await w.start()
        try:
            return await phase
        finally:
            await w.stop()
            stalls[window].append(_stalls(w, names))
            cpu[window].append(proc_cpu.percent(c0, proc_cpu.snapshot(roots), time.perf_counter() - t0))
    flood_proc: _FloodProcess | None = None
    try:
        await run_warmups(target, iter_requests(_workload(a.flood_input_len, 8, a.seed + 9), builder, [probe]),
                          LoadConfig(num_warmups=4, max_concurrency=4))
        _say(f"calibrating: the probe tenant at concurrency {a.calibrate_concurrency} for {a.calibrate_seconds:g} s")
        cal_load = LoadConfig(max_concurrency=a.calibrate_concurrency, num_requests=None,
                              duration_s=a.calibrate_seconds, seed=a.seed + 3)
        [cal], _, _ = await _phase(target, builder, [(probe, flood_w, cal_load)])
        cal_s = summarize(cal)
        capacity_rps, capacity_tok_s = cal_s["request_throughput"], cal_s["output_throughput"]
        fair_rps = capacity_rps / 2  # two tenants of weight 1
        flood = Tenant("flood", a.flood_factor * fair_rps, api_key=keys["flood"])
        _say(f"capacity {capacity_rps:.2f} req/s, {capacity_tok_s:.0f} output tok/s; the flood offers "
             f"{flood.rate:.2f} req/s ({a.flood_factor:g}x its fair share of {fair_rps:.2f})")

        inter_load = LoadConfig(request_rate=a.interactive_rate, num_requests=None, duration_s=a.duration,
                                warmup_s=a.warmup_seconds, seed=a.seed + 4)
        flood_load = LoadConfig(request_rate=flood.rate, num_requests=None, duration_s=a.duration + 60,
                                seed=a.seed + 5)
        # started off the event loop: the child loads a tokenizer for seconds, and this loop's lag is measured
        n_flood = flood_processes(a, flood.rate)
        flood_proc = await asyncio.get_running_loop().run_in_executor(None, _FloodProcess, address, keys["flood"], a,
                                                                      n_flood)
        alone: list[RequestRecord] = []
        beside: list[RequestRecord] = []
        flood_recs: list[RequestRecord] = []
        flood_tokens, inter_tokens, window = 0, 0, 0.0
        for k in range(a.rounds):  # (a) and (b) alternate, so a drift in the machine's load hits both alike
            _say(f"round {k + 1}/{a.rounds}, run (a): the interactive tenant alone, {a.interactive_rate:g} req/s "
                 f"for {a.duration:g} s")
            lag.take()
            [ra], _, _ = await watched("alone", _phase(target, builder, [(inter, inter_w, inter_load)]))
            lags["alone"] += lag.take()
            _say(f"round {k + 1}/{a.rounds}, run (b): the same beside the flood")
            [rb], rf, _ = await watched("beside_flood", _phase(target, builder, [(inter, inter_w, inter_load)],
                                                               (flood_proc, flood.rate, flood_load)))
            lags["beside_flood"] += lag.take()
            alone += ra
            beside += rb
            flood_recs += rf
            # the flood's tokens over run (b)'s measured window: from the warm-up's end to the interactive tenant's
            end = max(r.finished_at for r in rb)
            flood_tokens += _tokens_in_window(rf, a.warmup_seconds, end)
            inter_tokens += _tokens_in_window([r for r in rb if not r.warmup], a.warmup_seconds, end)
            window += max(1e-9, end - a.warmup_seconds)
    finally:
        await lag.stop()
        await target.close()
        if flood_proc is not None:
            flood_proc.close()

    sa, sb = summarize(alone), summarize(beside)
    flood_tok_s, inter_tok_s = flood_tokens / window, inter_tokens / window
    spare = max(1e-9, capacity_tok_s - inter_tok_s)
    sent = [r for r in flood_recs if _was_sent(r)]
    refused = {"interactive": _refused(alone) + _refused(beside), "flood": _refused(flood_recs),
               "probe": _refused(cal)}
    return {
        "tool": "tokenmill bench tenants", "machine": _machine(), "source": _source_state(),
        "config": {k: v for k, v in vars(a).items() if k != "func"},
        "capacity": {"request_throughput": capacity_rps, "output_throughput": capacity_tok_s,
                     "calibration": cal_s},
        "flood": {"offered_rps": flood.rate, "fair_share_rps": fair_rps, "sent": len(sent),
                  "never_sent": len(flood_recs) - len(sent),  # due, then cancelled at the run's end before sending
                  "refused_429": refused["flood"], "outcomes": _outcomes(flood_recs), "client_processes": n_flood,
                  # how long after its due time each flood request was sent: its clients keeping up, or not
                  "send_late_ms": stats([max(0.0, r.start - r.scheduled) for r in sent], 1e3),
                  "output_throughput": flood_tok_s,
                  "share_of_capacity": flood_tok_s / capacity_tok_s if capacity_tok_s else math.nan,
                  "share_of_spare": flood_tok_s / spare,
                  "spare_output_throughput": spare},
        "interactive": {"alone": sa, "beside_flood": sb, "output_throughput_beside": inter_tok_s},
        "refused_429": refused,
        # how late the load generator's own event loop ran (10 ms timer): it inflates the TTFT and ITL it measures
        "client_loop_lag_ms": {k: stats(v, 1e3) for k, v in lags.items()},
        # the cluster's own stalls in each window (one entry per round): gateway loop lag, long collections
        "server_stalls": stalls,
        # percent of a core each process used in each window (one entry per round): the cluster's (a descendant,
        # such as a worker's engine core, as NAME/child), the flood's clients and this process
        "process_cpu_percent": cpu,
        # the interactive tenant's measured requests, to line up with the cluster's spans when it ran with
        # trace_dir: `python -m loadgen.trace_summary DIR --client RESULT`
        "client_records": {w: [{"request_id": r.request_id, "start_wall_ns": r.start_wall_ns,
                                "ttft_ms": None if r.ttft is None else r.ttft * 1e3}
                               for r in recs if not r.warmup and r.request_id]
                           for w, recs in (("alone", alone), ("beside_flood", beside))},
        # how far each p99 ratio moves from sampling alone (the bootstrap's central 90%): a target inside it is
        # neither met nor missed by this run's requests
        "ratio_interval_90": {f"{k}_p99": ratio_interval(_measured(alone, k), _measured(beside, k), 99)
                              for k in ("ttft", "tpot")},
        "ratio": {"ttft_p50": _p(sb, "ttft_ms", "p50") / _p(sa, "ttft_ms", "p50"),
                  "ttft_p99": _p(sb, "ttft_ms", "p99") / _p(sa, "ttft_ms", "p99"),
                  "tpot_p50": _p(sb, "tpot_ms", "p50") / _p(sa, "tpot_ms", "p50"),
                  "tpot_p99": _p(sb, "tpot_ms", "p99") / _p(sa, "tpot_ms", "p99")},
    }


def format_result(r: dict[str, Any]) -> str:
    sa, sb = r["interactive"]["alone"], r["interactive"]["beside_flood"]
    f, q = r["flood"], r["ratio"]

    def row(name: str, s: dict[str, Any], flood: str) -> str:
        return (f"| {name} | {s['completed']}/{s['requests']} | {_p(s, 'ttft_ms', 'p50'):.0f} / "
                f"{_p(s, 'ttft_ms', 'p99'):.0f} | {_p(s, 'tpot_ms', 'p50'):.1f} / {_p(s, 'tpot_ms', 'p99'):.1f} | "
                f"{flood} |")

    iv = r.get("ratio_interval_90", {})
    lines = [
        f"capacity (calibration, flood-shaped requests): {r['capacity']['request_throughput']:.2f} req/s, "
        f"{r['capacity']['output_throughput']:.0f} output tok/s",
        "",
        "| interactive tenant | completed | TTFT p50 / p99 ms | TPOT p50 / p99 ms | flood output tok/s |",
        "|---|---:|---:|---:|---:|",
        row("(a) alone", sa, "-"),
        row("(b) beside the flood", sb, f"{f['output_throughput']:.0f}"),
        f"| (b) ÷ (a) | | {q['ttft_p50']:.2f}× / {q['ttft_p99']:.2f}× | {q['tpot_p50']:.2f}× / "
        f"{q['tpot_p99']:.2f}× | |",
        "",
        f"flood: offered {f['offered_rps']:.2f} req/s ({f['offered_rps'] / f['fair_share_rps']:.0f}× its fair share "
        f"of {f['fair_share_rps']:.2f}) from {f['client_processes']} client processes, sent {f['sent']} ("
        f"{_late(f['send_late_ms'])}; {f.get('never_sent', 0)} due but cancelled before they were sent), refused "
        f"with 429 {f['refused_429']}",
        f"flood throughput {f['output_throughput']:.0f} output tok/s = {100 * f['share_of_capacity']:.0f}% of the "
        f"capacity, {100 * f['share_of_spare']:.0f}% of the spare capacity ({f['spare_output_throughput']:.0f} tok/s "
        f"left by the interactive tenant's {r['interactive']['output_throughput_beside']:.0f})",
        "the flood's requests ended: " + ", ".join(f"{k} {v}" for k, v in f["outcomes"]["counts"].items())
        + " (cancelled: still waiting when the run ended)",
        *(f"  {k}: {m}" for k, m in f["outcomes"]["error_samples"].items() if k != "RESOURCE_EXHAUSTED"),
        "429s by tenant: " + ", ".join(f"{k} {v}" for k, v in r["refused_429"].items()),
        "the load generator's own event-loop lag (it times every request), p99 / max: " + ", ".join(
            f"{k} " + ("-" if v["p99"] is None else f"{v['p99']:.1f} / {v['max']:.1f} ms")
            for k, v in r.get("client_loop_lag_ms", {}).items()),
        *(_stall_line(f"{window}, round {i + 1}", s) for window, rounds in r.get("server_stalls", {}).items()
          for i, s in enumerate(rounds)),
        *(_cpu_line(window, rounds) for window, rounds in r.get("process_cpu_percent", {}).items() if rounds),
        f"targets: TTFT p99 moved {100 * (q['ttft_p99'] - 1):+.0f}% (< +20%: "
        f"{_verdict(q['ttft_p99'], TTFT_TARGET, iv.get('ttft_p99'))}), "
        f"TPOT p99 moved {100 * (q['tpot_p99'] - 1):+.0f}% (< +10%: "
        f"{_verdict(q['tpot_p99'], TPOT_TARGET, iv.get('tpot_p99'))})",
    ]
    return "\n".join(lines)


def run(a: argparse.Namespace) -> int:
    keys = {t: f"tm-bench-{t}-{secrets.token_urlsafe(12)}" for t in ("interactive", "flood", "probe")}
    with contextlib.ExitStack() as stack:
        work = Path(a.log_dir) if a.log_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        try:
            with cluster(a, keys, work) as address:
                result = asyncio.run(_main(a, address, keys, work / "state.json"))
        except (RuntimeError, OSError, ValueError) as e:
            print(f"tokenmill bench tenants: {e}", file=sys.stderr)
            return 2
    print(format_result(result), flush=True)
    if a.result_file:
        path = Path(a.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_finite(result), indent=1, default=str, allow_nan=False))
        print(f"results: {path}")
    return 0
