"""Server-side figures beside the client's: the targets' Prometheus ``/metrics`` read before and after a run (and
sampled during it for peaks), reported as deltas.

Reported: prefix-cache hit rate (hits / queries over the run, in prompt tokens, over every worker's cache: a prompt
prefilled remotely is looked up on the prefill worker and again on the decode worker; ``by_endpoint`` has each
process's own figures), KV usage peak (the highest ``kv_cache_usage_perc`` any worker showed while sampled), NIXL
bytes, seconds and failures (counted by the side that pulls, the decode worker), the engines' steps (how many, their
seconds, decode rows and prompt tokens, the engine thread's work between steps by part, the seconds an engine
waited with nothing to run, where its constrained rows' grammar masks came from, and how long the grammar mask
process took to fill them), and the gateway's mean TTFT and e2e
from its histograms (the server's view: the client's figures should be a little above them; the gap is what the
client and the network add). Counters and gauges of the same name are summed over the endpoints; a name no endpoint
exports is left out (a vLLM server's ``vllm:`` names are read too where they mean the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Sample = dict[str, float]  # metric sample name (labels folded in) → value, summed over endpoints

# where the engine steps' host time went: common/engine.py's STEP_PHASES (this module stays free of torch)
ENGINE_STEP_PHASES = ("schedule", "launch", "wait", "outputs", "sample", "other")
# the engine thread's work between steps: common/engine_loop.py's LOOP_PARTS
ENGINE_LOOP_PARTS = ("commands", "tick", "before", "outputs", "after")
# where a constrained row's mask came from: common/worker.py's GRAMMAR_MASK_SOURCES
GRAMMAR_MASK_SOURCES = ("cache", "process", "inline")

# (report key, sample names that mean it in Tokenmill and in vLLM)
_COUNTERS = {
    "prefix_cache_queries": ("tokenmill:prefix_cache_queries", "vllm:prefix_cache_queries_total"),
    "prefix_cache_hits": ("tokenmill:prefix_cache_hits", "vllm:prefix_cache_hits_total"),
    "nixl_bytes": ("tokenmill:nixl_xfer_bytes",),
    "nixl_seconds": ("tokenmill:nixl_xfer_seconds",),
    "nixl_failures": ("tokenmill:nixl_xfer_failures",),
    # the workers' engine loops: steps, their seconds, decode rows and prompt tokens, and the idle engine's wait
    "engine_steps": ("tokenmill:engine_steps",),
    "engine_step_seconds": ("tokenmill:engine_step_seconds",),
    "engine_step_decode_rows": ("tokenmill:engine_step_decode_rows",),
    "engine_step_prompt_tokens": ("tokenmill:engine_step_prompt_tokens",),
    "engine_idle_seconds": ("tokenmill:engine_idle_seconds",),
    "engine_cpu_seconds": ("tokenmill:engine_thread_cpu_seconds",),
    **{f"engine_phase_{p}": (f'tokenmill:engine_step_phase_seconds{{"phase": "{p}"}}',) for p in ENGINE_STEP_PHASES},
    **{f"engine_loop_{p}": (f'tokenmill:engine_loop_seconds{{"part": "{p}"}}',) for p in ENGINE_LOOP_PARTS},
    **{f"grammar_masks_{s}": (f'tokenmill:grammar_masks{{"source": "{s}"}}',) for s in GRAMMAR_MASK_SOURCES},
    # the grammar mask process's batches, their fill seconds summed, and those over 1 ms
    **{f"grammar_mask_{k}": (f"tokenmill:grammar_mask_{k}",) for k in ("batches", "fill_seconds", "slow_batches")},
    # the workers' engines: arrival to the first prompt step, and to a first token computed there
    "engine_queue_sum": ("tokenmill:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_sum"),
    "engine_queue_count": ("tokenmill:request_queue_time_seconds_count", "vllm:request_queue_time_seconds_count"),
    "engine_ttft_sum": ("tokenmill:engine_time_to_first_token_seconds_sum",),
    "engine_ttft_count": ("tokenmill:engine_time_to_first_token_seconds_count",),
    # the gateway's own latency histograms (vLLM's server has the same names): the server's view of TTFT and e2e
    "ttft_sum": ("tokenmill:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_sum"),
    "ttft_count": ("tokenmill:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
    "e2e_sum": ("tokenmill:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_sum"),
    "e2e_count": ("tokenmill:e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"),
}
_MEANS = ("ttft", "e2e", "engine_queue", "engine_ttft")  # histograms reported as their mean over the run
_KV_USAGE = ("tokenmill:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def fold_means(d: dict[str, Any]) -> dict[str, Any]:
    """Each ``_MEANS`` histogram's ``KEY_sum`` (seconds) in ``d`` becomes ``KEY_mean_ms``, the mean over its
    ``KEY_count`` observations (kept); in place, and returned."""
    for k in _MEANS:
        total = d.pop(f"{k}_sum", 0.0)
        n = d.get(f"{k}_count", 0.0)
        if n > 0:
            d[f"{k}_mean_ms"] = 1000 * total / n
    return d


def parse(text: str) -> Sample:
    """Prometheus text → {sample name[ {labels}]: value}. Label sets are kept in the key (sorted)."""
    out: Sample = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name if not s.labels else s.name + json.dumps(dict(sorted(s.labels.items())))
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def histogram_tail(before: Sample, after: Sample, name: str, over: float) -> tuple[float, float, float | None]:
    """Histogram ``name`` (its label sets summed) between two scrapes of one endpoint: the observations, those above
    ``over`` seconds (``over`` must be a bucket bound), and the upper bound of the highest bucket that gained any
    (``math.inf``: past the last finite bound; None: no observation)."""
    by_le: dict[float, float] = {}
    prefix = name + "_bucket"
    for key, v in after.items():
        if not key.startswith(prefix + "{"):
            continue
        le = float(json.loads(key[len(prefix):])["le"])
        by_le[le] = by_le.get(le, 0.0) + v - before.get(key, 0.0)
    if not by_le:
        return 0.0, 0.0, None
    total = by_le.get(math.inf, 0.0)
    above = total - by_le.get(over, 0.0)
    bounds = sorted(by_le)
    top = None
    for lo, hi in zip([-1.0, *bounds], bounds):  # the highest bucket whose cumulative count grew past the one below
        if by_le[hi] - (by_le.get(lo, 0.0) if lo >= 0 else 0.0) > 0:
            top = hi
    return total, above, top


def endpoints_from_state(path: str | os.PathLike[str], host: str | None = None) -> list[str]:
    """The ``/metrics`` URLs of every process of a ``tokenmill up`` cluster, from its state file."""
    return list(named_endpoints_from_state(path, host))


def named_endpoints_from_state(path: str | os.PathLike[str], host: str | None = None) -> dict[str, str]:
    """Every process of a ``tokenmill up`` cluster from its state file: ``/metrics`` URL → process name."""
    st = json.loads(Path(path).read_text())
    out = {}
    for p in st.get("processes", []):
        h = host or p.get("address", "127.0.0.1:0").rsplit(":", 1)[0]
        out[f"http://{h}:{p['metrics_port']}/metrics"] = p.get("name", p.get("role", ""))
    return out


def local_cluster_endpoints(grpc_address: str) -> list[str]:
    """The ``/metrics`` URLs of the local ``tokenmill up`` cluster whose gateway serves ``grpc_address``, from its
    default state file (``$XDG_RUNTIME_DIR/tokenmill/cluster.json``, else ``~/.cache/tokenmill/cluster.json``);
    empty when there is none or it is another cluster."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = (Path(base) / "tokenmill" if base else Path.home() / ".cache" / "tokenmill") / "cluster.json"
    try:
        st = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    host, _, port = grpc_address.rpartition(":")

    def serves(p: dict[str, Any]) -> bool:  # its own address, or the public port that gateways share
        own = p.get("address", "")
        return own == grpc_address or (own.rpartition(":")[0] == host and str(p.get("public_grpc_port")) == port)

    if not any(p.get("role") == "gateway" and serves(p) for p in st.get("processes", [])):
        return []
    return endpoints_from_state(path)


class MetricsWatcher:
    """Scrapes ``urls`` at start, every ``interval`` s during the run (peaks) and at stop. Unreachable endpoints are
    counted, never fatal: the client-side figures stand on their own."""

    def __init__(self, urls: Sequence[str], interval: float = 0.5, headers: dict[str, str] | None = None) -> None:
        self.urls = list(urls)
        self.interval = interval
        self.headers = headers or {}
        self.before: dict[str, Sample] = {}
        self.after: dict[str, Sample] = {}
        self.kv_peak: float | None = None
        self.failures: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _scrape(self) -> dict[str, Sample]:
        assert self._session is not None

        async def one(url: str) -> tuple[str, Sample | None]:
            try:
                async with self._session.get(url, headers=self.headers,  # type: ignore[union-attr]
                                             timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status != 200:
                        self.failures[url] = f"HTTP {r.status}"
                        return url, None
                    return url, parse(await r.text())
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                self.failures[url] = f"{type(e).__name__}: {e}"
                return url, None

        got = await asyncio.gather(*(one(u) for u in self.urls))
        snap = {u: s for u, s in got if s is not None}
        for s in snap.values():
            for name in _KV_USAGE:
                if name in s:
                    self.kv_peak = max(self.kv_peak or 0.0, s[name])
        return snap

    async def start(self) -> None:
        if not self.urls:
            return
        self._session = aiohttp.ClientSession()
        self.before = await self._scrape()
        self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self._scrape()

    async def stop(self) -> None:
        if self._session is None:
            return
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.after = await self._scrape()
        await self._session.close()
        self._session = None

    def report(self) -> dict[str, Any]:
        """Deltas over the run, summed over the endpoints read both before and after."""
        both = [u for u in self.urls if u in self.before and u in self.after]
        out: dict[str, Any] = {"endpoints": len(self.urls), "read": len(both)}
        if self.failures:
            out["unreachable"] = dict(self.failures)
        if not both:
            return out
        for key, names in _COUNTERS.items():
            vals = [self.after[u][n] - self.before[u].get(n, 0.0) for u in both for n in names if n in self.after[u]]
            if vals:
                out[key] = sum(vals)
        q, h = out.get("prefix_cache_queries"), out.get("prefix_cache_hits")
        if q is not None and h is not None:
            out["prefix_cache_hit_rate"] = h / q if q > 0 else math.nan
        if self.kv_peak is not None:
            out["kv_usage_peak"] = self.kv_peak
        fold_means(out)  # the client's TTFT minus the gateway's is the client's share
        by = {}
        for u in both:  # per process: prefill and decode workers each look prompts up in their own cache
            d = {k: sum(self.after[u][n] - self.before[u].get(n, 0.0) for n in names if n in self.after[u])
                 for k, names in _COUNTERS.items()
                 if any(n in self.after[u] for n in names) and not k.startswith(_MEANS)}
            if any(d.values()):
                if d.get("prefix_cache_queries"):
                    d["prefix_cache_hit_rate"] = d.get("prefix_cache_hits", 0.0) / d["prefix_cache_queries"]
                by[u] = d
        if by:
            out["by_endpoint"] = by
        return out
