"""Text reports: one run's table (errors first, never hidden), a sweep's one-line-per-point table, and
``tokenmill bench compare A.json B.json`` (ratios side by side; reads vLLM's ``--save-result`` JSON too)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from loadgen.metrics import stats
from loadgen.server_metrics import ENGINE_LOOP_PARTS, ENGINE_STEP_PHASES, GRAMMAR_MASK_SOURCES

_LAT = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _f(v: Any, fmt: str = ".1f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt)


def format_run(run: dict[str, Any], backend: str, where: str) -> str:
    s, srv = run["summary"], run.get("server", {})
    lines = [f"==== tokenmill bench serve: {backend} {where} — {run['label']} ===="]
    if run.get("interrupted"):
        lines.append("!! INTERRUPTED: the run was stopped early; requests in flight count as cancelled")
    if s["failed"]:
        kinds = ", ".join(f"{k} ×{n}" for k, n in s["errors"].items())
        lines.append(f"!! {s['failed']} of {s['requests']} requests FAILED: {kinds}")
        first = next((r for r in run["records"] if r["outcome"] != "ok" and not r["warmup"]), None)
        if first and first.get("error"):
            lines.append(f"!! first error: {first['error'][:200]}")
    if s.get("output_len_mismatch"):
        lines.append(f"!  {s['output_len_mismatch']} completed requests returned another output length than asked "
                     "(no --ignore-eos, or the server stopped early)")
    rows = [
        ("requests", f"{s['completed']} completed of {s['requests']}"),
        ("duration", f"{_f(s['duration_s'], '.2f')} s"),
        ("request throughput", f"{_f(s['request_throughput'], '.2f')} req/s"),
        ("output throughput", f"{_f(s['output_throughput'], '.1f')} tok/s"),
        ("total token throughput", f"{_f(s['total_token_throughput'], '.1f')} tok/s"),
        ("tokens in / out", f"{s['input_tokens']} / {s['output_tokens']}"),
    ]
    if "client_cpu_s" in s:
        n = s.get("client_processes", 1)
        rows.append(("client CPU", f"{s['client_cpu_s']:.2f} s ({_f(100 * s['client_cpu_share'])} % of one core"
                                   + (f" in the busiest of {n} processes)" if n > 1 else ")")))
    if st := s.get("structured"):
        rows.append(("structured outputs", f"{st['valid']} of {st['requests']} valid "
                                           f"({_f(100 * st['valid_rate'], '.1f')} %)"))
    if "goodput" in s:
        rows.append((f"goodput (SLO {s['slo']})",
                     f"{_f(s['goodput'], '.2f')} req/s, attainment {_f(100 * s['slo_attainment'], '.1f')} %"))
    w = max(len(k) for k, _ in rows)
    lines += [f"{k:<{w}}  {v}" for k, v in rows]
    lines.append(f"{'latency (ms)':<12} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}")
    for key, name in _LAT:
        st = s[key]
        lines.append(f"{name:<12} " + " ".join(f"{_f(st[q]):>9}" for q in ("mean", "p50", "p90", "p99", "max")))
    if srv.get("read"):
        parts = []
        if "prefix_cache_hit_rate" in srv:
            parts.append(f"prefix-cache hit rate {_f(100 * srv['prefix_cache_hit_rate'])} % "
                         f"({srv['prefix_cache_hits']:.0f} of {srv['prefix_cache_queries']:.0f} prompt tokens)")
        if "kv_usage_peak" in srv:
            parts.append(f"KV usage peak {_f(100 * srv['kv_usage_peak'])} %")
        if "nixl_bytes" in srv:
            parts.append(f"NIXL {srv['nixl_bytes'] / 2**20:.1f} MiB in {srv.get('nixl_seconds', 0):.2f} s"
                         + (f" ({srv['nixl_failures']:.0f} failed)" if srv.get("nixl_failures") else ""))
        if "ttft_mean_ms" in srv:
            parts.append(f"gateway TTFT mean {_f(srv['ttft_mean_ms'])} ms, e2e mean {_f(srv.get('e2e_mean_ms'))} ms")
        if not any(k in srv for k in ("prefix_cache_queries", "kv_usage_peak", "nixl_bytes")):
            parts.append("no worker metrics (prefix cache, KV and NIXL live on the workers: pass --cluster-state or "
                         "--metrics-url)")
        lines.append(f"server ({srv['read']} of {srv['endpoints']} /metrics): " + "; ".join(parts))
        for url, d in (srv.get("by_endpoint") or {}).items():
            if "prefix_cache_hit_rate" in d:
                lines.append(f"  {url}: prefix-cache hit rate {_f(100 * d['prefix_cache_hit_rate'])} % of "
                             f"{d['prefix_cache_queries']:.0f} prompt tokens")
            if d.get("engine_steps"):
                lines.append(f"  {url}: {engine_line(d)}")
    elif srv.get("endpoints"):
        lines.append(f"server: no /metrics could be read ({srv.get('unreachable')})")
    for name, ts in (s.get("by_tenant") or {}).items():
        good = f", goodput {_f(ts['goodput'], '.2f')} req/s ({_f(100 * ts['slo_attainment'])} %)" if "goodput" in ts \
            else ""
        lines.append(f"tenant {name}: {ts['completed']}/{ts['requests']} ok, {_f(ts['request_throughput'], '.2f')} "
                     f"req/s, TTFT p50 {_f(ts['ttft_ms']['p50'])} p99 {_f(ts['ttft_ms']['p99'])} ms{good}")
    return "\n".join(lines)


def engine_line(d: dict[str, Any]) -> str:
    """A worker's engine thread over the run, a step on average: its rows, its host phases
    (``tokenmill:engine_step_phase_seconds``), the work between steps (``tokenmill:engine_loop_seconds``), and the
    share of that busy time its thread ran on a CPU (``tokenmill:engine_thread_cpu_seconds``); with constrained
    rows, where their grammar masks came from (``tokenmill:grammar_masks``) and the mask process's fill time a batch
    (``tokenmill:grammar_mask_*``)."""
    n = d["engine_steps"]

    def ms(key: str) -> str:
        return f"{1e3 * d.get(key, 0.0) / n:.3f}"

    phases = ", ".join(f"{p} {ms('engine_phase_' + p)}" for p in ENGINE_STEP_PHASES if f"engine_phase_{p}" in d)
    loop = ", ".join(f"{p} {ms('engine_loop_' + p)}" for p in ENGINE_LOOP_PARTS if f"engine_loop_{p}" in d)
    busy = d.get("engine_step_seconds", 0.0) + sum(d.get(f"engine_loop_{p}", 0.0) for p in ENGINE_LOOP_PARTS)
    on_cpu = (f"; its thread on a CPU {100 * d['engine_cpu_seconds'] / busy:.0f}% of that time"
              if busy > 0 and "engine_cpu_seconds" in d else "")
    masks = {s: d.get(f"grammar_masks_{s}", 0.0) for s in GRAMMAR_MASK_SOURCES}
    total = sum(masks.values())
    constrained = ("; constrained rows' masks: " + ", ".join(f"{100 * v / total:.0f}% {s}" for s, v in masks.items())
                   + f" of {total:.0f}" if total > 0 else "")
    if batches := d.get("grammar_mask_batches", 0.0):
        constrained += (f"; the mask process's fill {1e3 * d.get('grammar_mask_fill_seconds', 0.0) / batches:.3f} ms a "
                        f"batch, {100 * d.get('grammar_mask_slow_batches', 0.0) / batches:.0f}% of {batches:.0f} "
                        f"over 1 ms")
    return (f"engine {n:.0f} steps, {d.get('engine_step_decode_rows', 0.0) / n:.1f} decode rows + "
            f"{d.get('engine_step_prompt_tokens', 0.0) / n:.1f} prompt tokens a step; ms a step: "
            f"{ms('engine_step_seconds')} in the step ({phases}); between steps: {loop}{on_cpu}{constrained}")


def format_sweep(runs: list[dict[str, Any]]) -> str:
    head = (f"{'load':<28} {'ok':>6} {'fail':>5} {'req/s':>8} {'out tok/s':>10} {'goodput':>8} "
            f"{'TTFT p50':>9} {'p99':>9} {'TPOT p50':>9} {'p99':>9}")
    lines = ["==== sweep ====", head]
    for r in runs:
        s = r["summary"]
        lines.append(f"{r['label']:<28} {s['completed']:>6} {s['failed']:>5} {_f(s['request_throughput'], '.2f'):>8} "
                     f"{_f(s['output_throughput']):>10} {_f(s.get('goodput'), '.2f'):>8} "
                     f"{_f(s['ttft_ms']['p50']):>9} {_f(s['ttft_ms']['p99']):>9} "
                     f"{_f(s['tpot_ms']['p50']):>9} {_f(s['tpot_ms']['p99']):>9}")
    return "\n".join(lines)


# -- compare -------------------------------------------------------------------------------------------------

_VLLM_LAT = {"ttft_ms": "ttft", "tpot_ms": "tpot", "itl_ms": "itl", "e2e_ms": "e2el"}


def _from_vllm(d: dict[str, Any]) -> dict[str, Any]:
    """A ``vllm bench serve --save-result`` JSON as one of our runs' summaries (the figures it has)."""
    s: dict[str, Any] = {k: d.get(k) for k in ("request_throughput", "output_throughput", "total_token_throughput",
                                                "duration")}
    s["duration_s"] = s.pop("duration")
    s["completed"] = d.get("completed")
    s["failed"] = d.get("failed", (d.get("num_prompts") or 0) - (d.get("completed") or 0))
    s["goodput"] = d.get("request_goodput")
    s["input_tokens"], s["output_tokens"] = d.get("total_input_tokens"), d.get("total_output_tokens")
    for ours, theirs in _VLLM_LAT.items():
        s[ours] = {"mean": d.get(f"mean_{theirs}_ms"),
                   "p50": d.get(f"median_{theirs}_ms", d.get(f"p50_{theirs}_ms")),
                   "p90": d.get(f"p90_{theirs}_ms"), "p99": d.get(f"p99_{theirs}_ms")}
    # the per-request lists it saves (latencies always; ttfts and itls with --save-detailed), in seconds
    for ours, key in (("e2e_ms", "latencies"), ("ttft_ms", "ttfts")):
        vals = [v for v in d.get(key) or [] if v]
        if vals:
            s[ours] = stats(vals, 1000)
    if d.get("itls"):
        s["itl_ms"] = stats([x for r in d["itls"] for x in r], 1000)
    label = f"vllm {d.get('request_rate', '')} req/s, concurrency {d.get('max_concurrency')}"
    return {"label": label, "summary": s}


def load_runs(path: str | Path) -> list[dict[str, Any]]:
    d = json.loads(Path(path).read_text())
    if "runs" in d:
        return d["runs"]
    if "request_throughput" in d:
        return [_from_vllm(d)]
    raise ValueError(f"{path}: neither a `tokenmill bench serve` nor a `vllm bench serve` result")


_ROWS = [("completed", ("completed",)), ("failed", ("failed",)), ("duration s", ("duration_s",)),
         ("input tokens", ("input_tokens",)), ("output tokens", ("output_tokens",)),
         ("request throughput req/s", ("request_throughput",)), ("output throughput tok/s", ("output_throughput",)),
         ("total throughput tok/s", ("total_token_throughput",)), ("goodput req/s", ("goodput",)),
         ("SLO attainment", ("slo_attainment",))] + [
    (f"{name} {q} ms", (key, q)) for key, name in _LAT for q in ("mean", "p50", "p90", "p99")]


def _get(s: dict[str, Any], path: tuple[str, ...]) -> float | None:
    v: Any = s
    for k in path:
        if not isinstance(v, dict):
            return None
        v = v.get(k)
    return v if isinstance(v, int | float) else None


def format_compare(a: list[dict[str, Any]], b: list[dict[str, Any]], name_a: str, name_b: str) -> str:
    if len(a) != len(b):
        raise ValueError(f"{name_a} has {len(a)} runs, {name_b} has {len(b)}: compare results of the same sweep")
    lines = []
    for ra, rb in zip(a, b):
        lines.append(f"==== {ra['label']}  vs  {rb['label']} ====")
        lines.append(f"{'metric':<26} {'A':>12} {'B':>12} {'B/A':>8}")
        for label, path in _ROWS:
            va, vb = _get(ra["summary"], path), _get(rb["summary"], path)
            if va is None and vb is None:
                continue
            ratio = f"{vb / va:.3f}" if va and vb is not None else "-"
            lines.append(f"{label:<26} {_f(va, '.2f'):>12} {_f(vb, '.2f'):>12} {ratio:>8}")
    return f"A = {name_a}\nB = {name_b}\n" + "\n".join(lines)


def compare(a: argparse.Namespace) -> int:
    try:
        print(format_compare(load_runs(a.a), load_runs(a.b), a.a, a.b))
    except (OSError, ValueError, KeyError) as e:
        print(f"tokenmill bench compare: {e}")
        return 2
    return 0


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="two `bench serve` results (or vLLM's) side by side, with ratios",
                       description="Print the summaries of A and B side by side with B/A; run by run for a sweep.")
    p.add_argument("a", help="result JSON A (tokenmill bench serve, or vllm bench serve --save-result)")
    p.add_argument("b", help="result JSON B")
    p.set_defaults(func=compare)
