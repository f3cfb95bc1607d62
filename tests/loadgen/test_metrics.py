"""Metrics computed from a synthetic timeline are exact; SLO parsing; server /metrics deltas and peaks."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from loadgen.metrics import RequestRecord, Slo, stats, summarize
from loadgen.report import engine_line, format_compare, format_run
from loadgen.server_metrics import GRAMMAR_MASK_SOURCES, MetricsWatcher, endpoints_from_state, parse
from tests.services.harness import free_port

approx = pytest.approx


def _timeline() -> list[RequestRecord]:
    # r0: four one-token chunks; the server's usage says 4 tokens
    r0 = RequestRecord(0, 10, 4, start=0.0, chunk_times=[0.1, 0.15, 0.25, 0.30], chunk_tokens=[1, 1, 1, 1],
                       end=0.31, completion_tokens=4, prompt_tokens=10)
    # r1: two chunks, the second carrying 3 tokens (a gRPC message batched while the client lagged); no usage
    r1 = RequestRecord(1, 20, 4, start=0.5, chunk_times=[0.2, 0.6], chunk_tokens=[1, 3], end=0.6)
    r2 = RequestRecord(2, 10, 4, start=0.2, end=0.05, outcome="error", error_kind="UNAVAILABLE", error="gone")
    r3 = RequestRecord(3, 10, 4, start=0.0, chunk_times=[9.0], chunk_tokens=[4], warmup=True)  # excluded
    r4 = RequestRecord(4, 10, 4, start=0.4, chunk_times=[0.3], chunk_tokens=[1], end=0.5, outcome="cancelled",
                       error_kind="timeout")
    # r5: a one-token answer: TPOT 0 (meets any TPOT bound), not in the TPOT distribution
    r5 = RequestRecord(5, 30, 1, start=0.6, chunk_times=[0.05], chunk_tokens=[1], end=0.05, completion_tokens=1)
    return [r0, r1, r2, r3, r4, r5]


def test_per_request_metrics_are_exact():
    r0, r1, *_ , r5 = _timeline()
    assert (r0.ttft, r0.e2e, r0.output_tokens) == (0.1, 0.30, 4)
    assert r0.itls == approx([0.05, 0.10, 0.05], abs=1e-15)
    assert r0.tpot == approx((0.30 - 0.1) / 3, abs=1e-15)
    assert (r1.ttft, r1.e2e, r1.output_tokens, r1.itls) == (0.2, 0.6, 4, approx([0.4]))
    assert r1.tpot == approx(0.4 / 3, abs=1e-15)
    assert r5.tpot == 0.0 and r5.itls == []


def test_summary_is_exact():
    s = summarize(_timeline(), Slo.parse("ttft:150 tpot:100"))
    # measured: r0 r1 r2 r4 r5 (r3 is warm-up); completed r0 r1 r5
    assert (s["requests"], s["completed"], s["failed"]) == (5, 3, 2)
    assert s["errors"] == {"UNAVAILABLE": 1, "timeout": 1}
    dur = 0.5 + 0.6  # first start 0.0 → r1 ends at 1.1
    assert s["duration_s"] == approx(dur, abs=1e-15)
    assert s["request_throughput"] == approx(3 / dur)
    assert s["output_throughput"] == approx((4 + 4 + 1) / dur)
    assert s["input_tokens"] == 10 + 20 + 30 and s["total_token_throughput"] == approx((60 + 9) / dur)
    assert s["ttft_ms"]["mean"] == approx((100 + 200 + 50) / 3)
    assert s["ttft_ms"]["p50"] == approx(100)
    assert s["ttft_ms"]["p90"] == approx(100 + 0.8 * 100)  # linear between the 2nd and 3rd order statistics
    assert s["ttft_ms"]["max"] == approx(200)
    assert s["tpot_ms"]["mean"] == approx((200 / 3 + 400 / 3) / 2)  # one-token answers have no TPOT
    assert s["itl_ms"]["mean"] == approx((50 + 100 + 50 + 400) / 4)
    assert s["e2e_ms"]["p50"] == approx(300)
    assert s["output_len_mismatch"] == 0
    # SLO: r0 (ttft 100, tpot 66.7) and r5 (50, 0) meet it; r1's TTFT 200 misses; errors miss
    assert s["goodput"] == approx(2 / dur) and s["slo_attainment"] == approx(2 / 5) and s["slo"] == "ttft:150 tpot:100"
    assert summarize(_timeline(), Slo.parse(["e2e:250"]))["slo_attainment"] == approx(1 / 5)
    text = format_run({"label": "t", "summary": s, "records": [r.to_json() for r in _timeline()]}, "grpc", "x")
    assert text.splitlines()[1].startswith("!! 2 of 5 requests FAILED: UNAVAILABLE ×1, timeout ×1")  # at the top
    empty = summarize([])
    assert empty["requests"] == 0 and math.isnan(empty["request_throughput"]) and empty["ttft_ms"]["p50"] is None


def test_stats_and_slo_parsing():
    st = stats([1.0, 2.0, 3.0, 4.0], 1000)
    assert st == {"mean": 2500.0, "p50": 2500.0, "p90": approx(3700.0), "p99": approx(3970.0), "min": 1000.0,
                  "max": 4000.0}
    assert Slo.parse(["ttft:500", "tpot:50", "e2e:1e4"]) == Slo(500, 50, 10000)
    assert Slo.parse("ttft:500,e2el:9") == Slo(500, None, 9) and Slo.parse(None) is None
    for bad in ("ttft", "foo:3", "ttft:-1", "ttft:x"):
        with pytest.raises(ValueError):
            Slo.parse(bad)


def test_compare_prints_ratios_and_reads_vllm_results(tmp_path):
    ours = {"label": "a", "summary": summarize(_timeline(), Slo.parse("ttft:150"))}
    vllm = {"completed": 3, "num_prompts": 5, "duration": 2.2, "request_throughput": 1.5 / 1.1,
            "output_throughput": 9 / 2.2, "total_token_throughput": 1.0, "mean_ttft_ms": 350 / 3,
            "median_ttft_ms": 200.0, "p99_ttft_ms": 1.0, "mean_tpot_ms": 1.0, "p50_tpot_ms": 5.0, "latencies": [0.1, 0.3, 0.5],
            "total_input_tokens": 60, "total_output_tokens": 9}
    (tmp_path / "v.json").write_text(json.dumps(vllm))
    from loadgen.report import load_runs

    text = format_compare([ours], load_runs(tmp_path / "v.json"), "ours", "vllm")
    rows = {ln[:26].strip(): ln[26:].split() for ln in text.splitlines() if ln[:1].isalpha()}
    assert rows["request throughput req/s"] == ["2.73", "1.36", "0.500"]
    assert rows["TTFT mean ms"][2] == "1.000" and rows["TTFT p50 ms"][2] == "2.000"
    assert rows["TPOT p50 ms"][1] == "5.00"  # --metric-percentiles 50 names it p50, not median
    assert rows["failed"][:2] == ["2.00", "2.00"] and rows["input tokens"][2] == "1.000"
    assert rows["E2E mean ms"][1:] == ["300.00", f"{300 / s_e2e_mean(ours):.3f}"]  # from vLLM's per-request list
    with pytest.raises(ValueError, match="runs"):
        format_compare([ours, ours], [ours], "a", "b")


def s_e2e_mean(run: dict) -> float:
    return run["summary"]["e2e_ms"]["mean"]


def test_server_metrics_deltas_and_peaks_from_real_endpoints(tmp_path):
    regs, servers, urls = [], [], []
    for _ in range(2):
        r = CollectorRegistry()
        g = {n: Gauge(f"tokenmill:{n}", n, registry=r) for n in
             ("prefix_cache_queries", "prefix_cache_hits", "kv_cache_usage_perc", "nixl_xfer_bytes")}
        c = Counter("tokenmill:prompt_tokens", "p", registry=r)
        g["engine_steps"] = Gauge("tokenmill:engine_steps", "steps", registry=r)
        g["grammar_masks"] = Gauge("tokenmill:grammar_masks", "masks", ["source"], registry=r)
        for k in ("batches", "fill_seconds", "slow_batches"):
            g[k] = Gauge(f"tokenmill:grammar_mask_{k}", k, registry=r)
        port = free_port()
        srv, _ = start_http_server(port, "127.0.0.1", registry=r)
        regs.append((g, c))
        servers.append(srv)
        urls.append(f"http://127.0.0.1:{port}/metrics")
    (g0, c0), (g1, _) = regs
    g0["prefix_cache_queries"].set(100)
    g0["prefix_cache_hits"].set(10)
    g1["nixl_xfer_bytes"].set(5)
    assert parse("# TYPE x counter\nx_total{b=\"2\",a=\"1\"} 3\n") == {'x_total{"a": "1", "b": "2"}': 3.0}

    async def run() -> MetricsWatcher:
        w = MetricsWatcher([*urls, "http://127.0.0.1:1/metrics"], interval=0.05)
        await w.start()
        g0["kv_cache_usage_perc"].set(0.75)  # a peak seen only while the run goes on
        await asyncio.sleep(0.3)
        g0["kv_cache_usage_perc"].set(0.25)
        g0["prefix_cache_queries"].set(300)
        g0["prefix_cache_hits"].set(110)
        g1["nixl_xfer_bytes"].set(4096 + 5)
        g0["engine_steps"].set(10)
        for src, n in (("cache", 30), ("process", 10)):  # GRAMMAR_MASK_SOURCES: "inline" not exported here
            g0["grammar_masks"].labels(src).set(n)
        g0["batches"].set(8)
        g0["fill_seconds"].set(0.006)
        g0["slow_batches"].set(2)
        c0.inc(7)
        await w.stop()
        return w

    try:
        rep = asyncio.run(run()).report()
    finally:
        for s in servers:
            s.shutdown()
    assert (rep["endpoints"], rep["read"]) == (3, 2) and "http://127.0.0.1:1/metrics" in rep["unreachable"]
    assert (rep["prefix_cache_queries"], rep["prefix_cache_hits"]) == (200, 100)
    assert rep["prefix_cache_hit_rate"] == 0.5 and rep["nixl_bytes"] == 4096 and rep["kv_usage_peak"] == 0.75
    assert rep["by_endpoint"][urls[0]]["prefix_cache_hit_rate"] == 0.5
    # the worker's constrained rows' masks by source, named as the workers export them
    from common.worker import GRAMMAR_MASK_SOURCES as WORKER_SOURCES

    assert GRAMMAR_MASK_SOURCES == WORKER_SOURCES
    line = engine_line(rep["by_endpoint"][urls[0]])
    assert line.startswith("engine 10 steps") and line.endswith(
        "constrained rows' masks: 75% cache, 25% process, 0% inline of 40; the mask process's fill 0.750 ms a batch, "
        "25% of 8 over 1 ms"), line
    assert "constrained" not in engine_line({"engine_steps": 10.0})
    state = tmp_path / "s.json"
    state.write_text(json.dumps({"processes": [{"address": "127.0.0.1:20300", "metrics_port": 21300}]}))
    assert endpoints_from_state(state) == ["http://127.0.0.1:21300/metrics"]


def test_the_local_cluster_is_found_from_its_default_state_file(tmp_path, monkeypatch):
    from loadgen.server_metrics import local_cluster_endpoints

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert local_cluster_endpoints("127.0.0.1:50051") == []
    (tmp_path / "tokenmill").mkdir()
    (tmp_path / "tokenmill" / "cluster.json").write_text(json.dumps({"processes": [
        {"role": "gateway", "address": "127.0.0.1:50051", "metrics_port": 21400},
        {"role": "decode", "address": "127.0.0.1:20300", "metrics_port": 21300}]}))
    assert local_cluster_endpoints("127.0.0.1:50051") == ["http://127.0.0.1:21400/metrics",
                                                          "http://127.0.0.1:21300/metrics"]
    assert local_cluster_endpoints("127.0.0.1:50052") == []  # another cluster's gateway
    # gateways sharing the public port (what `tokenmill up --device cuda` starts): each has its own address
    (tmp_path / "tokenmill" / "cluster.json").write_text(json.dumps({"processes": [
        {"role": "gateway", "address": f"127.0.0.1:2040{i}", "public_grpc_port": 50051, "metrics_port": 21400 + i}
        for i in range(2)]}))
    assert local_cluster_endpoints("127.0.0.1:50051") == ["http://127.0.0.1:21400/metrics",
                                                          "http://127.0.0.1:21401/metrics"]
    assert local_cluster_endpoints("127.0.0.1:50052") == local_cluster_endpoints("10.0.0.1:50051") == []


def test_result_json_is_strict_and_records_are_compact():
    from loadgen.bench_serve import _finite

    s = summarize([])
    text = json.dumps(_finite({"s": s, "x": [math.inf, 1.5, (math.nan,)]}), allow_nan=False)
    assert json.loads(text)["x"] == [None, 1.5, [None]] and json.loads(text)["s"]["request_throughput"] is None
    d = _timeline()[0].to_json()
    assert "itls" not in d and d["chunk_times"] == [0.1, 0.15, 0.25, 0.3] and d["tpot"] == round(0.2 / 3, 6)


def test_histogram_tail_counts_the_observations_above_a_bound_between_two_scrapes():
    """A real histogram (two label sets, summed) scraped before and after: the window's observations, those above
    the bound, and the highest bucket that gained any."""
    from prometheus_client import Histogram, generate_latest

    from loadgen.server_metrics import histogram_tail

    reg = CollectorRegistry()
    h = Histogram("t:pause_seconds", "p", ["generation"], registry=reg, buckets=(0.01, 0.05, 0.1, 1.0))
    h.labels("0").observe(0.001)
    h.labels("2").observe(0.07)
    before = parse(generate_latest(reg).decode())
    for v in (0.002, 0.03):
        h.labels("0").observe(v)
    for v in (0.06, 0.5):
        h.labels("2").observe(v)
    after = parse(generate_latest(reg).decode())
    assert histogram_tail(before, after, "t:pause_seconds", 0.05) == (4.0, 2.0, 1.0)
    assert histogram_tail(before, after, "t:pause_seconds", 0.1) == (4.0, 1.0, 1.0)
    assert histogram_tail(after, after, "t:pause_seconds", 0.05) == (0.0, 0.0, None)
    h.labels("0").observe(5.0)  # past the last finite bound
    assert histogram_tail(after, parse(generate_latest(reg).decode()), "t:pause_seconds", 0.05) == (1.0, 1.0, math.inf)
    assert histogram_tail({}, {}, "t:absent_seconds", 0.05) == (0.0, 0.0, None)


def test_a_ratio_of_percentiles_comes_with_how_far_sampling_alone_moves_it():
    """The bootstrap interval of a p99 ratio: it holds the true ratio, narrows as the samples grow, is the same for
    the same seed, and is NaN without samples on a side."""
    import numpy as np

    from loadgen.metrics import ratio_interval

    rng = np.random.default_rng(1)
    small_a, small_b = rng.lognormal(0, 0.5, 160), 1.5 * rng.lognormal(0, 0.5, 160)
    big_a, big_b = rng.lognormal(0, 0.5, 20000), 1.5 * rng.lognormal(0, 0.5, 20000)
    lo, hi = ratio_interval(small_a, small_b, 99)
    blo, bhi = ratio_interval(big_a, big_b, 99, resamples=400)
    assert lo < 1.5 < hi and blo < 1.5 < bhi
    assert bhi - blo < (hi - lo) / 3  # 125x the samples: a much narrower interval
    assert hi - lo > 0.3  # 160 requests' p99 is their second-worst: it moves a lot
    assert ratio_interval(small_a, small_b, 99) == (lo, hi)
    assert all(math.isnan(x) for x in ratio_interval([], small_b, 99))
    mlo, mhi = ratio_interval(small_a, small_b, 50)
    assert mhi - mlo < hi - lo  # the median's ratio is far steadier than the p99's
