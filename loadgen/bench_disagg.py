"""``tokenmill bench disagg``: the goodput of prefill/decode disaggregation against aggregated replicas, on the same
two GPUs, one layout after the other.

- ``1p1d``: ``tokenmill up --prefills 1 --decodes 1``, each worker on a GPU of its own (the launcher's placement).
  Prompts over ``router.prefill_threshold_tokens`` are prefilled on the prefill GPU and their KV pulled over NIXL;
  while the prefill worker is saturated (``router.prefill_saturated_tokens``) the decode worker prefills them.
- ``2agg``: ``tokenmill up --prefills 0 --decodes 2``: two replicas behind the router, each prefilling and decoding.

Each layout serves every workload (``long``: prompts of 4,096–8,192 tokens, 256 out; ``short``: 1,024 in, 128 out)
at each of its rates, Poisson arrivals, EOS ignored, every request under a cache salt of its own (no prefix-cache
hit), through the gRPC ``Generate`` client, after a warm-up of a few requests of the workload's shape. The same seed
gives both layouts the same prompts and arrival times.

Per run: goodput (requests that meet both SLOs, TTFT and TPOT per request, ÷ the run's duration), SLO attainment,
whether TTFT p90 and TPOT p90 meet the SLOs, TTFT/ITL/TPOT percentiles, throughput, and where a prefill worker ran,
the KV bandwidth NIXL reached (the decode workers' ``tokenmill:nixl_xfer_bytes`` delta ÷ their
``tokenmill:nixl_xfer_busy_seconds`` delta: time with a READ in flight), per READ its busy time, descriptors and
posting time (``tokenmill:nixl_xfer_reads``, ``_descriptors``, ``_post_seconds``), and the share of prompts the
router sent to the prefill worker. Before the
clusters start, torch's copy from the prefill GPU to the decode GPU (``cuda:0`` → ``cuda:1``) is timed in a
subprocess, bytes counted once: NIXL's figure ÷ that one is how much of the link the transfers use.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
import traceback
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.machine import default_dtype
from loadgen import bench_serve, profile_summary
from loadgen.bench_gpu_serving import (
    REPO_ROOT,
    BenchResult,
    make_log_dir,
    parse_serve_args,
    report_end,
    spec_arg,
    start_cluster,
)
from loadgen.bench_offline import _machine, _say, _source_state
from loadgen.clients import GrpcTarget, SendOptions
from loadgen.metrics import Slo
from loadgen.runner import LoadConfig, run_warmups
from loadgen.server_metrics import Sample, parse
from loadgen.workloads import PromptBuilder, WorkloadConfig, build_requests

WARMUP_REQUESTS = 4  # per layout and workload, sent together: full-length prompts, a few tokens each
WARMUP_OUTPUT = 16
COPY_ITERS = 10


@dataclass(frozen=True, slots=True)
class Layout:
    """One way to serve on the same GPUs: the pool counts ``tokenmill up`` gets."""

    name: str
    prefills: int
    decodes: int

    def up_args(self, device: str, gpus: int) -> list[str]:
        """The layout's ``tokenmill up`` flags on ``gpus`` GPUs (ignored on the CPU). On two or more the launcher
        gives each worker a GPU of its own; on one, every worker shares ``cuda:0`` and they split its memory."""
        args = ["--prefills", str(self.prefills), "--decodes", str(self.decodes)]
        if device == "cuda" and gpus == 1:
            if self.prefills:
                args += ["--prefill-gpus", ",".join(["cuda:0"] * self.prefills)]
            args += ["--decode-gpus", ",".join(["cuda:0"] * self.decodes)]
        return args


LAYOUTS = {lay.name: lay for lay in (Layout("1p1d", 1, 1), Layout("2agg", 0, 2))}


@dataclass(frozen=True, slots=True)
class Workload:
    """A load shape: prompt lengths uniform in ``input_len`` (inclusive), ``output_len`` tokens each (EOS ignored),
    ``num_prompts`` Poisson arrivals at each of ``rates`` (req/s). ``index`` fixes its seeds, whichever workloads
    a run selects."""

    name: str
    index: int
    input_len: tuple[int, int]
    output_len: int
    rates: tuple[float, ...]
    num_prompts: int

    def seed(self, base: int, k: int) -> int:
        """The seed of the ``k``-th rate: fresh prompts for every run, the same ones for every layout."""
        return base + bench_serve.SWEEP_SEED_STRIDE * (10 * self.index + k)


# the defaults are sized for the Llama-3.1-8B shape on two H100s or H200s (docs/loadgen.md): ~6k-token prompts
# fill one prefill GPU near 5 req/s; 1,024 in / 128 out at 64 req/s ask 8k output tokens/s, more than the two GPUs
# decode
PRESETS = {"long": Workload("long", 0, (4096, 8192), 256, (2.0, 4.0, 8.0), 64),
           "short": Workload("short", 1, (1024, 1024), 128, (16.0, 32.0, 64.0), 192)}
TIE = 0.01  # goodputs within 1 % of the higher one: neither layout is marked as ahead


class SaltedGrpcTarget(GrpcTarget):
    """``Generate`` with a fresh cache salt on every request: no request is served from another's prefix cache."""

    def request(self, spec: Any) -> Any:
        req = super().request(spec)
        req.cache_salt = uuid.uuid4().hex
        return req


# -- figures -----------------------------------------------------------------------------------------------------
def _pcts(d: dict[str, float | None]) -> dict[str, float | None]:
    return {k: d[k] for k in ("p50", "p90", "p99")}


def run_row(layout: str, workload: str, rate: float, summary: dict[str, Any], slo: Slo) -> dict[str, Any]:
    """One run's figures from ``summarize(records, slo)``: goodput (requests meeting every bound ÷ the run's
    duration), attainment, and whether the p90s meet the bounds (a run without a completed request meets none)."""
    ttft90, tpot90 = summary["ttft_ms"]["p90"], summary["tpot_ms"]["p90"]
    return {"layout": layout, "workload": workload, "rate": rate, "requests": summary["requests"],
            "completed": summary["completed"], "failed": summary["failed"], "errors": summary["errors"],
            "duration_s": summary["duration_s"], "goodput": summary["goodput"],
            "slo_attainment": summary["slo_attainment"],
            "ttft_p90_met": ttft90 is not None and slo.ttft_ms is not None and ttft90 <= slo.ttft_ms,
            "tpot_p90_met": tpot90 is not None and slo.tpot_ms is not None and tpot90 <= slo.tpot_ms,
            "ttft_ms": _pcts(summary["ttft_ms"]), "itl_ms": _pcts(summary["itl_ms"]),
            "tpot_ms": _pcts(summary["tpot_ms"]), "output_tok_s": summary["output_throughput"],
            "request_throughput": summary["request_throughput"]}


def nixl_figures(nbytes: float, seconds: float, peer_Bps: float | None, reads: float = 0.0,
                 descriptors: float = 0.0, post_seconds: float = 0.0, warmups: float = 0.0) -> dict[str, float | None]:
    """NIXL's bytes and seconds over a span, its bandwidth (None without a transfer) and that ÷ the peer copy's;
    with the READs posted, their descriptors and the seconds spent posting them: each per READ; and the warm-up
    READs that woke an idle link before them (counted in none of the others)."""
    bps = nbytes / seconds if nbytes > 0 and seconds > 0 else None
    per = (lambda v: v / reads) if reads > 0 else (lambda v: None)
    return {"bytes": nbytes, "seconds": seconds, "Bps": bps,
            "vs_peer_copy": bps / peer_Bps if bps is not None and peer_Bps else None,
            "reads": reads, "descriptors": descriptors, "post_seconds": post_seconds, "warmups": warmups,
            "descriptors_per_read": per(descriptors), "busy_ms_per_read": per(1e3 * seconds),
            "post_ms_per_read": per(1e3 * post_seconds)}


NIXL_METRICS = {"bytes": "tokenmill:nixl_xfer_bytes", "seconds": "tokenmill:nixl_xfer_busy_seconds",
                "reads": "tokenmill:nixl_xfer_reads", "descriptors": "tokenmill:nixl_xfer_descriptors",
                "post_seconds": "tokenmill:nixl_xfer_post_seconds", "warmups": "tokenmill:nixl_xfer_warmups"}


def _nixl_of(v: dict[str, float], peer_Bps: float | None) -> dict[str, float | None]:
    return nixl_figures(v["bytes"], v["seconds"], peer_Bps, v["reads"], v["descriptors"], v["post_seconds"],
                        v.get("warmups", 0.0))


def _nixl_line(n: dict[str, Any]) -> str:
    """A run's or layout's NIXL figures, one line."""
    if not n.get("Bps"):
        return "no NIXL READ"
    vs = f" ({n['vs_peer_copy']:.2f}× the peer copy)" if n.get("vs_peer_copy") else ""
    per = ""
    if n.get("reads"):
        per = (f"; {n['reads']:.0f} READs, {n['busy_ms_per_read']:.2f} ms each with {n['descriptors_per_read']:.1f} "
               f"descriptors, {n['post_ms_per_read']:.2f} ms of it posting")
        if n.get("warmups"):
            per += f"; {n['warmups']:.0f} warm-up READs before them"
    return f"NIXL {n['Bps'] / 1e9:.2f} GB/s{vs}, {n['bytes'] / 1e9:.2f} GB in {n['seconds']:.3f} s busy{per}"


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and rate: each layout's goodput and ITL p99, the layout with the higher goodput (``tie`` when
    another is within ``TIE`` of it: where both meet the SLOs throughout, they differ only by when their last token
    came) and ITL p99 of 1p1d ÷ 2agg when both ran."""
    out = []
    for key in dict.fromkeys((r["workload"], r["rate"]) for r in rows):
        rs = [r for r in rows if (r["workload"], r["rate"]) == key]
        good = {r["layout"]: r["goodput"] if r["goodput"] is not None and math.isfinite(r["goodput"]) else 0.0
                for r in rs}
        itl = {r["layout"]: r["itl_ms"]["p99"] for r in rs}
        best = max(good.values())
        tops = [name for name, g in good.items() if g >= best * (1 - TIE)]
        higher = tops[0] if len(tops) == 1 else "tie"
        a, b = itl.get("1p1d"), itl.get("2agg")
        out.append({"workload": key[0], "rate": key[1], "goodput": good, "higher": higher, "itl_p99_ms": itl,
                    "itl_p99_1p1d_vs_2agg": a / b if a is not None and b else None})
    return out


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{fmt}}"


def _three(d: dict[str, float | None]) -> str:
    return " / ".join(_f(d[k], ".1f") for k in ("p50", "p90", "p99"))


def build_table(doc: dict[str, Any]) -> str:
    """The runs (the higher goodput of each workload and rate in bold), the layouts side by side, the copies."""
    slo = doc["slo"]
    wins = {(c["workload"], c["rate"]): c["higher"] for c in doc["comparisons"]}
    lines = [f"| workload | rate | layout | goodput req/s | SLO met | TTFT p90 ≤ {slo['ttft_ms']:g} | TPOT p90 ≤ "
             f"{slo['tpot_ms']:g} | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | output tok/s | req/s | remote "
             "prefill | NIXL GB/s |", "|---|---:|---|---:|---:|:-:|:-:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(doc["runs"], key=lambda r: (PRESETS[r["workload"]].index, r["rate"], r["layout"])):
        good = _f(r["goodput"])
        if wins.get((r["workload"], r["rate"])) == r["layout"]:
            good = f"**{good}**"
        failed = f" ({r['failed']} FAILED)" if r["failed"] else ""
        remote = r.get("remote_prefill_share")
        lines.append(f"| {r['workload']} | {r['rate']:g} | {r['layout']}{failed} | {good} | "
                     f"{_f(100 * r['slo_attainment'], '.0f')} % | {'yes' if r['ttft_p90_met'] else 'no'} | "
                     f"{'yes' if r['tpot_p90_met'] else 'no'} | {_three(r['ttft_ms'])} | {_three(r['itl_ms'])} | "
                     f"{_f(r['output_tok_s'], ',.0f')} | {_f(r['request_throughput'])} | "
                     f"{'—' if remote is None else f'{100 * remote:.0f} %'} | {_gbs(r['nixl']['Bps'])} |")
    if any(len(c["goodput"]) > 1 for c in doc["comparisons"]):
        lines += ["", "| workload | rate | goodput 1p1d | goodput 2agg | higher goodput | ITL p99 1p1d ms | "
                      "ITL p99 2agg ms | ITL p99 1p1d ÷ 2agg |", "|---|---:|---:|---:|---|---:|---:|---:|"]
        for c in doc["comparisons"]:
            g, itl = c["goodput"], c["itl_p99_ms"]
            lines.append(f"| {c['workload']} | {c['rate']:g} | {_f(g.get('1p1d'))} | {_f(g.get('2agg'))} | "
                         f"{c['higher']} | {_f(itl.get('1p1d'), '.1f')} | {_f(itl.get('2agg'), '.1f')} | "
                         f"{_f(c['itl_p99_1p1d_vs_2agg'])}{'' if c['itl_p99_1p1d_vs_2agg'] is None else '×'} |")
    pc = doc.get("peer_copy") or {}
    if pc.get("Bps"):
        lines.append(f"\npeer copy {pc['src']} → {pc['dst']}: {pc['Bps'] / 1e9:.1f} GB/s ({pc['bytes'] / 2**30:.2f} "
                     f"GiB, median of {pc['iters']}, bytes counted once)")
    for name, lay in doc["layouts"].items():
        n = lay.get("nixl")
        if n and n["Bps"]:
            lines.append(f"{name}, over all runs: {_nixl_line(n)}")
            by = lay.get("nixl_by_workload") or {}
            if len(by) > 1:
                lines += [f"{name}, {w} runs: {_nixl_line(m)}" for w, m in by.items() if m["Bps"]]
            for w, m in by.items():
                ipc = (doc.get("idle_peer_copy") or {}).get(w)
                if ipc and m.get("vs_idle_peer_copy"):
                    lines.append(f"{name}, {w} runs: the peer copy of a READ's mean {ipc['bytes'] / 2**20:.0f} MiB "
                                 f"after {ipc['idle_s'] * 1e3:.0f} ms idle: {ipc['Bps'] / 1e9:.1f} GB/s; NIXL "
                                 f"{m['vs_idle_peer_copy']:.2f}× that")
    return "\n".join(lines)


def _gbs(bps: float | None) -> str:
    return "—" if bps is None else f"{bps / 1e9:.2f}"


# -- measuring ---------------------------------------------------------------------------------------------------
def copy_bandwidth_between(src: str, dst: str, nbytes: int, iters: int = COPY_ITERS,
                           idle_s: float = 0.0) -> dict[str, Any]:
    """One ``nbytes`` tensor copied from device ``src`` to ``dst`` (torch's ``copy_``: a peer copy between two
    GPUs), wall time between synchronizations of both, median of ``iters`` after 3 untimed copies. Bytes are counted
    once, as NIXL counts them (the bytes that cross), not read + written. ``idle_s``: both GPUs and the link sit
    idle this long before each timed copy, as between the KV pulls of a light load (an NVLink idle for 20 ms or
    more starts a copy slowly: docs/performance-notes.md, "A cold link")."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=src).random_()
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    cuda = sorted({d for d in (src, dst) if d.startswith("cuda")})

    def sync() -> None:
        for d in cuda:
            torch.cuda.synchronize(d)

    for _ in range(3):
        b.copy_(a)
    sync()
    times = []
    for _ in range(iters):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        b.copy_(a)
        sync()
        times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"src": src, "dst": dst, "bytes": nbytes, "iters": iters, "idle_s": idle_s,
                           "seconds_p50": statistics.median(times), "Bps": nbytes / statistics.median(times)}
    if cuda:
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if len(cuda) == 2:
            out["peer_access"] = torch.cuda.can_device_access_peer(torch.device(src).index or 0,
                                                                   torch.device(dst).index or 0)
    return out


def measure_peer_copy(src: str, dst: str, nbytes: int, idle_s: float = 0.0) -> dict[str, Any]:
    """``copy_bandwidth_between`` in a subprocess: its CUDA context and buffers are gone before a cluster starts."""
    code = ("import json, sys; from loadgen.bench_disagg import copy_bandwidth_between as f; "
            "print(json.dumps(f(sys.argv[1], sys.argv[2], int(sys.argv[3]), idle_s=float(sys.argv[4]))))")
    r = subprocess.run([sys.executable, "-c", code, src, dst, str(nbytes), str(idle_s)], cwd=REPO_ROOT,
                       capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"the peer copy ({src} → {dst}) failed: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def scrape(urls: list[str]) -> dict[str, Sample]:
    """Each URL's ``/metrics`` now; one that does not answer is left out."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    out = {}
    for u in urls:
        with contextlib.suppress(OSError, ValueError), opener.open(u, timeout=5) as r:
            out[u] = parse(r.read().decode())
    return out


def delta(before: dict[str, Sample], after: dict[str, Sample], name: str, labels: dict[str, str] | None = None
          ) -> float:
    """The change of metric ``name`` (with ``labels``, else summed over every label set), summed over the URLs
    read both times."""
    def value(s: Sample) -> float:
        if labels is not None:
            return s.get(name + json.dumps(dict(sorted(labels.items()))), 0.0)
        return sum(v for k, v in s.items() if k == name or k.startswith(name + "{"))

    return sum(value(after[u]) - value(before[u]) for u in after if u in before)


# -- the run -----------------------------------------------------------------------------------------------------
def _serve_args(a: argparse.Namespace, w: Workload, rate: float, seed: int, state: str) -> argparse.Namespace:
    lo, hi = w.input_len
    return parse_serve_args([
        "--backend", "grpc", "--tokenizer", a.tokenizer, "--random-input-len", f"{lo}:{hi}",
        "--random-output-len", str(w.output_len), "--num-prompts", str(w.num_prompts), "--request-rate", str(rate),
        "--ignore-eos", "--seed", str(seed), "--cache-salt", "auto", "--num-warmups", "0", "--disable-tqdm",
        "--no-plots", "--goodput", f"ttft:{a.slo_ttft_ms}", f"tpot:{a.slo_tpot_ms}", "--cluster-state", state,
        "--temperature", str(a.temperature)])


def _urls(state: dict[str, Any], role: str) -> list[str]:
    return [f"http://{p['address'].rsplit(':', 1)[0]}:{p['metrics_port']}/metrics" for p in state["processes"]
            if p["role"] == role]


async def layout_runs(a: argparse.Namespace, layout: Layout, cluster: dict[str, Any], workloads: list[Workload],
                      builder: PromptBuilder, slo: Slo, res: BenchResult) -> None:
    """Every workload at every rate against the running cluster of ``layout``: a warm-up per workload, then one
    run per rate, a row each (saved as it lands)."""
    state = json.loads(Path(cluster["state"]).read_text())
    decode, router = _urls(state, "decode"), _urls(state, "router")
    peer = (res.doc.get("peer_copy") or {}).get("Bps")
    opts = SendOptions(ignore_eos=True, temperature=a.temperature, timeout=a.request_timeout)
    for w in workloads:
        target = SaltedGrpcTarget(cluster["grpc"], None, opts)
        await target.open()
        try:
            with res.phase(f"{layout.name}: {w.name} warm-up"):
                cfg = WorkloadConfig(input_len=w.input_len, output_len=(min(w.output_len, WARMUP_OUTPUT),) * 2,
                                     seed=a.seed + bench_serve.WARMUP_SEED_OFFSET)
                warm = build_requests(cfg, builder, WARMUP_REQUESTS)
                recs = await run_warmups(target, iter(warm), LoadConfig(num_warmups=len(warm)))
                if bad := [r for r in recs if not r.ok]:
                    _say(f"{layout.name}: {len(bad)} of {len(recs)} warm-up requests failed: {bad[0].error}")
            for k, rate in enumerate(w.rates):
                seed = w.seed(a.seed, k)
                sa = _serve_args(a, w, rate, seed, cluster["state"])
                _say(f"{layout.name}: {w.name} at {rate:g} req/s: {w.num_prompts} requests, about "
                     f"{w.num_prompts / rate:.0f} s of arrivals")
                with res.phase(f"{layout.name}: {w.name} at {rate:g} req/s"):
                    before = await asyncio.to_thread(scrape, decode + router)
                    async with profile_summary.profiled(cluster["http"] if a.profile_dir else None) as traces:
                        run = await bench_serve._one_run(sa, target, builder, [],
                                                         LoadConfig(request_rate=rate, num_requests=w.num_prompts,
                                                                    seed=seed), bench_serve._metrics_urls(sa))
                    after = await asyncio.to_thread(scrape, decode + router)
                    row = run_row(layout.name, w.name, rate, run["summary"], slo)
                    # only the decode workers export NIXL figures, only the router its placements
                    row["nixl"] = _nixl_of({k: delta(before, after, m) for k, m in NIXL_METRICS.items()}, peer)
                    remote, local = (delta(before, after, "tokenmill:router_placements_total", {"prefill": p})
                                     for p in ("remote", "local"))
                    row["placements"] = {"remote": remote, "local": local}
                    placed = remote + local
                    row["remote_prefill_share"] = remote / placed if layout.prefills and placed else None
                    row.update(seed=seed, summary=run["summary"], server=run["server"], records=run["records"])
                    if traces:  # each worker's trace, and the decode workers' READs as their profiles show them
                        row["profile"] = {"traces": traces, "reads": {
                            wid: profile_summary.read_medians(profile_summary.reads(
                                profile_summary.load_events(path))) for wid, path in traces.items()
                            if wid.startswith("decode")}}
                        for wid, r in row["profile"]["reads"].items():
                            if r["reads"]:
                                _say(f"{layout.name}: {w.name} at {rate:g} req/s: {wid}'s profile: {r['reads']} "
                                     f"READs, median posting {r['post_ms']:.2f} ms, copy on the GPU "
                                     f"{r['copy_ms']:.2f} ms ({r['copy_GBps']:.0f} GB/s) from "
                                     f"{r['copy_starts_ms']:.2f} ms after the post began, done after "
                                     f"{r['done_ms']:.2f} ms")
                    res.doc["runs"].append(row)
                    _say(f"{layout.name}: {w.name} at {rate:g} req/s: goodput {_f(row['goodput'])} req/s "
                         f"({_f(100 * row['slo_attainment'], '.0f')} % met), {row['completed']}/{row['requests']} "
                         f"done, TTFT p90 {_f(row['ttft_ms']['p90'], '.0f')} ms, ITL p99 "
                         f"{_f(row['itl_ms']['p99'], '.1f')} ms, {_nixl_line(row['nixl'])}")
        finally:
            await target.close()


def _layout_nixl(doc: dict[str, Any]) -> None:
    """Each layout's NIXL figures over all its runs (``nixl``) and over each workload's (``nixl_by_workload``): a
    READ's fixed costs weigh on short prompts' KV far more than on long ones'."""
    peer = (doc.get("peer_copy") or {}).get("Bps")

    def total(rs: list[dict[str, Any]]) -> dict[str, float | None]:
        return _nixl_of({k: sum(r["nixl"].get(k, 0.0) for r in rs) for k in NIXL_METRICS}, peer)

    for name, lay in doc["layouts"].items():
        rs = [r for r in doc["runs"] if r["layout"] == name]
        lay["nixl"] = total(rs)
        lay["nixl_by_workload"] = {w: total([r for r in rs if r["workload"] == w])
                                   for w in dict.fromkeys(r["workload"] for r in rs)}


IDLE_COPY_S = 0.1  # the link idle before each copy of idle_peer_copies: past the 20-50 ms in which NVLink falls asleep


def idle_peer_copies(doc: dict[str, Any], src: str, dst: str,
                     measure: Callable[..., dict[str, Any]] = measure_peer_copy) -> None:
    """For each workload whose runs made READs: torch's peer copy of its mean READ's bytes after the link sat idle
    ``IDLE_COPY_S`` (``doc["idle_peer_copy"]``), and each layout's NIXL rate for that workload ÷ it
    (``vs_idle_peer_copy``). The peak peer copy (``peer_copy``: 2 GiB back to back) is the link's best; this is the
    same link as a short READ meets it under a light load, so the two ratios part NIXL's own costs from the link's."""
    sizes: dict[str, int] = {}
    for lay in doc["layouts"].values():
        for w, m in (lay.get("nixl_by_workload") or {}).items():
            if m.get("reads") and m.get("bytes"):
                sizes.setdefault(w, int(m["bytes"] / m["reads"]))
    doc["idle_peer_copy"] = {w: measure(src, dst, n, IDLE_COPY_S) for w, n in sizes.items()}
    for lay in doc["layouts"].values():
        for w, m in (lay.get("nixl_by_workload") or {}).items():
            bps = doc["idle_peer_copy"].get(w, {}).get("Bps")
            m["idle_peer_copy_Bps"] = bps
            m["vs_idle_peer_copy"] = m["Bps"] / bps if bps and m.get("Bps") else None


def _csv(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise SystemExit(f"--{what}: give at least one value")
    return items


def _rates(text: str, what: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in _csv(text, what))
    except ValueError:
        raise SystemExit(f"--{what} {text!r}: comma-separated request rates (req/s), e.g. 2,4,8") from None
    if not all(0 < r < math.inf for r in rates):
        raise SystemExit(f"--{what} {text!r}: every rate must be > 0 and finite")
    return rates


def _lengths(text: str, what: str) -> tuple[int, int]:
    parts = text.replace(":", ",").split(",")
    try:
        lo, hi = int(parts[0]), int(parts[-1])
    except ValueError:
        raise SystemExit(f"--{what} {text!r}: a token count N, or LO,HI (uniform, inclusive)") from None
    if len(parts) > 2 or lo < 2 or hi < lo:
        raise SystemExit(f"--{what} {text!r}: a token count N, or LO,HI with 2 <= LO <= HI")
    return lo, hi


def _parse(a: argparse.Namespace) -> tuple[list[Layout], list[Workload]]:
    """The layouts and workloads the flags select; SystemExit (exit 2) naming the flag when one is off."""
    from common.loader import load_model_source

    if not (a.slo_ttft_ms > 0 and a.slo_tpot_ms > 0):
        raise SystemExit("--slo-ttft-ms and --slo-tpot-ms must be > 0")
    layouts = []
    for name in _csv(a.layouts, "layouts"):
        if name not in LAYOUTS:
            raise SystemExit(f"--layouts: unknown layout {name!r}; the layouts are {', '.join(LAYOUTS)}")
        layouts.append(LAYOUTS[name])
    given = {"long": (a.long_len, a.long_output, a.long_rates), "short": (a.short_len, a.short_output,
                                                                          a.short_rates)}
    workloads = []
    for name in _csv(a.workloads, "workloads"):
        if name not in PRESETS:
            raise SystemExit(f"--workloads: unknown workload {name!r}; the workloads are {', '.join(PRESETS)}")
        w, (length, output, rates) = PRESETS[name], given[name]
        w = dataclasses.replace(w, input_len=_lengths(length, f"{name}-len") if length else w.input_len,
                                output_len=output or w.output_len,
                                rates=_rates(rates, f"{name}-rates") if rates else w.rates,
                                num_prompts=a.num_prompts or w.num_prompts)
        if w.output_len < 2 or w.num_prompts < 1:
            raise SystemExit(f"{name}: --{name}-output must be >= 2 and --num-prompts >= 1")
        workloads.append(w)
    try:
        limit = load_model_source(a.model).config.max_position_embeddings
    except (OSError, ValueError) as e:
        raise SystemExit(f"--model {a.model}: {e}") from None
    need = max(w.input_len[1] + w.output_len for w in workloads)
    if need > limit:
        raise SystemExit(f"the longest request is {need} tokens (prompt + output) but {a.model} accepts {limit}; "
                         "shorten --long-len / --short-len")
    return layouts, workloads


def run(a: argparse.Namespace) -> int:
    layouts, workloads = _parse(a)
    gpus = 0
    if a.device == "cuda":
        from services.cluster.placement_gpu import visible_gpus

        gpus = len(visible_gpus())
        if gpus < 2 and not (gpus == 1 and a.allow_one_gpu):
            print(f"tokenmill bench disagg: needs two CUDA devices, torch sees {gpus}; --allow-one-gpu shares one "
                  "for a smoke run, --device cpu runs on the CPU", file=sys.stderr)
            return 2
    from common.loader import load_tokenizer

    dtype = a.dtype or default_dtype(a.device)
    slo = Slo(ttft_ms=a.slo_ttft_ms, tpot_ms=a.slo_tpot_ms)
    path = Path(a.result_file) if a.result_file else None
    log_dir = make_log_dir(a.log_dir, path, "disagg")
    src, dst = ("cuda:0", "cuda:1" if gpus >= 2 else "cuda:0") if a.device == "cuda" else ("cpu", "cpu")
    res = BenchResult(path, {
        "tool": "tokenmill bench disagg", "device": a.device, "gpus": min(gpus, 2), "model": a.model,
        "tokenizer": a.tokenizer, "dtype": dtype, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": _machine(), "source": _source_state(),
        "config": {k: v for k, v in vars(a).items() if not callable(v)},
        "slo": {"ttft_ms": a.slo_ttft_ms, "tpot_ms": a.slo_tpot_ms},
        "workloads": {w.name: dataclasses.asdict(w) for w in workloads}, "layouts": {}, "peer_copy": None,
        "runs": [], "comparisons": [], "errors": [], "phases_s": {},
    })
    _say(f"{a.model} ({dtype}) on {a.device}" + (f", {min(gpus, 2)} GPU(s)" if gpus else "") + "; layouts "
         f"{', '.join(lay.name for lay in layouts)}; workloads " + "; ".join(
             f"{w.name} {w.input_len[0]}-{w.input_len[1]} in / {w.output_len} out, {w.num_prompts} requests at "
             f"{', '.join(f'{r:g}' for r in w.rates)} req/s" for w in workloads)
         + f"; SLO TTFT {a.slo_ttft_ms:g} ms, TPOT {a.slo_tpot_ms:g} ms; logs in {log_dir}")
    with res.phase(f"peer copy {src} → {dst}"):
        try:
            res.doc["peer_copy"] = measure_peer_copy(src, dst, (2 << 30) if a.device == "cuda" else (256 << 20))
            _say(f"peer copy: {res.doc['peer_copy']['Bps'] / 1e9:.1f} GB/s")
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            res.doc["errors"].append(f"peer copy: {e}")
            _say(f"FAILED: peer copy: {e}")
    builder = PromptBuilder(load_tokenizer(a.tokenizer))

    for layout in layouts:
        up = [*layout.up_args(a.device, gpus), "--model", spec_arg(a.model), "--tokenizer", spec_arg(a.tokenizer),
              "--device", a.device, "--set", f"engine.dtype={dtype}"]
        for item in a.set_items or []:
            up += ["--set", item]
        if a.profile_dir:
            up += ["--set", f"profile_dir={Path(a.profile_dir).resolve() / layout.name}"]
        res.doc["layouts"][layout.name] = {"up_args": up}
        try:
            with res.phase(f"{layout.name}: cluster start, runs, stop"), \
                    start_cluster(layout.name, up, log_dir, a.startup_timeout) as cluster:
                res.doc["layouts"][layout.name].update(ready_s=cluster["ready_s"], log=cluster["log"])
                res.doc["phases_s"][f"{layout.name}: cluster start"] = cluster["ready_s"]
                asyncio.run(layout_runs(a, layout, cluster, workloads, builder, slo, res))
        except Exception as e:  # one failing layout must not lose the other: the error is a result too
            traceback.print_exc()
            res.doc["errors"].append(f"{layout.name}: {type(e).__name__}: {e}")
            _say(f"FAILED: {res.doc['errors'][-1]}")
        _layout_nixl(res.doc)
        res.save()

    if res.doc["peer_copy"]:
        with res.phase("peer copies from an idle link"):
            try:
                idle_peer_copies(res.doc, src, dst)
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
                res.doc["errors"].append(f"idle peer copies: {e}")
                _say(f"FAILED: idle peer copies: {e}")
    res.doc["comparisons"] = compare(res.doc["runs"])
    res.doc["table"] = table = build_table(res.doc)
    res.save()
    print(f"\nDisaggregation benchmark: {a.model} ({dtype}) on {a.device}; SLO TTFT ≤ {a.slo_ttft_ms:g} ms and TPOT ≤ "
          f"{a.slo_tpot_ms:g} ms per request; goodput = requests meeting both ÷ the run's duration; temperature "
          f"{a.temperature:g}, EOS ignored")
    return report_end(res, table, path, res.doc["runs"])


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("disagg", help="goodput of 1 prefill + 1 decode GPU against 2 aggregated replicas",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="1p1d,2agg", help="of 1p1d, 2agg (default both)")
    p.add_argument("--workloads", default="long,short", help="of long, short (default both)")
    p.add_argument("--model", default="dummy:llama-3.1-8b", help="model spec (default dummy:llama-3.1-8b)")
    p.add_argument("--tokenizer", default="smollm2", help="tokenizer spec for the prompts and the cluster "
                                                          "(default smollm2)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="default cuda")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--allow-one-gpu", action="store_true",
                   help="with one GPU, run both layouts on it (workers share it: a smoke run, not a measurement)")
    lo, sh = PRESETS["long"], PRESETS["short"]
    p.add_argument("--long-len", help=f"long prompts: N or LO,HI tokens (default {lo.input_len[0]},"
                                      f"{lo.input_len[1]})")
    p.add_argument("--long-output", type=int, help=f"long: output tokens (default {lo.output_len})")
    p.add_argument("--long-rates", help=f"long: req/s, comma-separated (default "
                                        f"{','.join(f'{r:g}' for r in lo.rates)})")
    p.add_argument("--short-len", help=f"short prompts: N or LO,HI tokens (default {sh.input_len[0]})")
    p.add_argument("--short-output", type=int, help=f"short: output tokens (default {sh.output_len})")
    p.add_argument("--short-rates", help=f"short: req/s, comma-separated (default "
                                         f"{','.join(f'{r:g}' for r in sh.rates)})")
    p.add_argument("--num-prompts", type=int, help=f"requests per rate, every workload (default {lo.num_prompts} "
                                                   f"long, {sh.num_prompts} short)")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0, help="TTFT bound per request (default 500)")
    p.add_argument("--slo-tpot-ms", type=float, default=50.0, help="TPOT bound per request (default 50)")
    p.add_argument("--temperature", type=float, default=1.0, help="sent with every request (default 1, OpenAI's)")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default 0)")
    p.add_argument("--profile-dir", metavar="DIR",
                   help="profile every model worker through each run (the gateway's /start_profile and "
                        "/stop_profile): traces under DIR/LAYOUT, and each decode worker's READs as its profile "
                        "shows them (loadgen.profile_summary) in the result")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", dest="set_items",
                   help="passed to `tokenmill up --set` for both layouts (repeatable), e.g. tokenizer.count=1")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a cluster to be ready (600)")
    p.add_argument("--request-timeout", type=float, help="cancel a request after this many seconds")
    p.add_argument("--result-file", help="write every number here as JSON (rewritten after each phase)")
    p.add_argument("--log-dir", help="the clusters' logs and state files (default beside --result-file, else a "
                                     "temporary directory)")
    p.set_defaults(func=run)
