"""``tokenmill bench disagg``: goodput and the SLO checks from a synthetic timeline, the comparison and the table,
the refusal without two GPUs, and the whole command on the CPU (both layouts as real clusters)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.engine_loop import STEP_RANGE
from loadgen import profile_summary
from loadgen.bench_disagg import (
    IDLE_COPY_S,
    LAYOUTS,
    build_table,
    compare,
    delta,
    idle_peer_copies,
    nixl_figures,
    run_row,
)
from loadgen.metrics import RequestRecord, Slo, summarize
from services.cli import main

approx = pytest.approx
SLO = Slo(ttft_ms=500, tpot_ms=50)


def _req(i: int, start: float, ttft: float, gap: float, n: int = 5) -> RequestRecord:
    """A request of ``n`` one-token chunks: the first ``ttft`` s after its start, then one every ``gap`` s."""
    times = [ttft + k * gap for k in range(n)]
    return RequestRecord(i, 100, n, start=start, chunk_times=times, chunk_tokens=[1] * n, end=times[-1],
                         completion_tokens=n, prompt_tokens=100)


def _timeline() -> list[RequestRecord]:
    return [
        _req(0, 0.0, 0.2, 0.04),  # meets both: TTFT 200 ms, TPOT 40 ms
        _req(1, 0.5, 0.6, 0.02),  # TTFT 600 ms: misses
        _req(2, 1.0, 0.1, 0.08),  # TPOT 80 ms: misses
        _req(3, 1.5, 0.3, 0.03),  # meets both; ends last, at 1.5 + 0.3 + 4 × 0.03 = 1.92 s
        RequestRecord(4, 100, 5, start=1.6, end=0.01, outcome="error", error_kind="UNAVAILABLE"),  # a miss
    ]


def test_goodput_counts_requests_meeting_both_slos_over_the_runs_duration():
    row = run_row("1p1d", "long", 2.0, summarize(_timeline(), SLO), SLO)
    assert (row["requests"], row["completed"], row["failed"]) == (5, 4, 1)
    assert row["duration_s"] == approx(1.92)
    assert row["goodput"] == approx(2 / 1.92) and row["slo_attainment"] == approx(2 / 5)
    assert row["request_throughput"] == approx(4 / 1.92) and row["goodput"] <= row["request_throughput"]
    assert row["output_tok_s"] == approx(20 / 1.92)
    # TTFT 100, 200, 300, 600 ms: p90 = 300 + 0.7 × 300 (numpy's linear interpolation) = 510 > 500
    assert row["ttft_ms"]["p50"] == approx(250) and row["ttft_ms"]["p90"] == approx(510)
    assert row["ttft_p90_met"] is False
    # TPOT 20, 30, 40, 80 ms: p90 = 40 + 0.7 × 40 = 68 > 50; ITL is the same gaps, four of each request's
    assert row["tpot_ms"]["p90"] == approx(68) and row["tpot_p90_met"] is False
    assert row["itl_ms"]["p50"] == approx(35) and row["itl_ms"]["p99"] == approx(80)
    loose = Slo(ttft_ms=600, tpot_ms=81)  # a bound is inclusive: TTFT 600 ms meets 600
    row = run_row("2agg", "long", 2.0, summarize(_timeline(), loose), loose)
    assert row["slo_attainment"] == approx(4 / 5) and row["ttft_p90_met"] and row["tpot_p90_met"]
    none = run_row("2agg", "long", 2.0, summarize(_timeline()[4:], SLO), SLO)  # nothing completed
    assert none["goodput"] == 0 and not none["ttft_p90_met"] and not none["tpot_p90_met"]


def test_nixl_bandwidth_and_metric_deltas():
    n = nixl_figures(6e9, 2.0, peer_Bps=1.2e10)
    assert n["Bps"] == 3e9 and n["vs_peer_copy"] == approx(0.25)
    assert nixl_figures(0.0, 0.0, 1e10)["Bps"] is None and nixl_figures(1e9, 1.0, None)["vs_peer_copy"] is None
    assert n["descriptors_per_read"] is None  # no READ counted
    n = nixl_figures(6e9, 2.0, 1.2e10, reads=4, descriptors=10, post_seconds=0.002)
    assert n["busy_ms_per_read"] == approx(500) and n["descriptors_per_read"] == approx(2.5)
    assert n["post_ms_per_read"] == approx(0.5)
    before = {"d": {"tokenmill:nixl_xfer_bytes": 100.0, 'tokenmill:router_placements_total{"prefill": "remote"}': 2.0,
                    'tokenmill:router_placements_total{"prefill": "local"}': 1.0}}
    after = {"d": {"tokenmill:nixl_xfer_bytes": 350.0, 'tokenmill:router_placements_total{"prefill": "remote"}': 7.0,
                   'tokenmill:router_placements_total{"prefill": "local"}': 2.0}, "gone": {"x": 5.0}}
    assert delta(before, after, "tokenmill:nixl_xfer_bytes") == 250  # "gone" was not read before: left out
    assert delta(before, after, "tokenmill:router_placements_total", {"prefill": "remote"}) == 5
    assert delta(before, after, "tokenmill:router_placements_total") == 6  # every label set


def test_layout_flags_on_two_gpus_one_gpu_and_the_cpu():
    one_p, agg = LAYOUTS["1p1d"], LAYOUTS["2agg"]
    assert one_p.up_args("cuda", 2) == ["--prefills", "1", "--decodes", "1"]  # the launcher gives each a GPU
    assert agg.up_args("cuda", 4) == ["--prefills", "0", "--decodes", "2"]
    assert one_p.up_args("cuda", 1) == ["--prefills", "1", "--decodes", "1", "--prefill-gpus", "cuda:0",
                                        "--decode-gpus", "cuda:0"]
    assert agg.up_args("cuda", 1)[-2:] == ["--decode-gpus", "cuda:0,cuda:0"]
    assert agg.up_args("cpu", 0) == ["--prefills", "0", "--decodes", "2"]


def _row(layout: str, workload: str, rate: float, goodput: float, itl_p99: float) -> dict:
    pct = {"p50": 1.0, "p90": 2.0, "p99": itl_p99}
    return {"layout": layout, "workload": workload, "rate": rate, "goodput": goodput, "slo_attainment": 0.5,
            "ttft_p90_met": True, "tpot_p90_met": False, "ttft_ms": pct, "itl_ms": pct, "output_tok_s": 1000.0,
            "request_throughput": 2.0, "failed": 0, "remote_prefill_share": 0.9 if layout == "1p1d" else None,
            "nixl": {"Bps": 2.5e10 if layout == "1p1d" else None}}


def test_comparison_marks_the_higher_goodput_and_the_itl_ratio():
    rows = [_row("1p1d", "long", 2.0, 1.5, 30.0), _row("1p1d", "short", 8.0, 4.0, 40.0),
            _row("2agg", "long", 2.0, 1.2, 120.0), _row("2agg", "short", 8.0, 3.97, 20.0)]
    cmp = compare(rows)
    assert [(c["workload"], c["rate"], c["higher"]) for c in cmp] == [("long", 2.0, "1p1d"), ("short", 8.0, "tie")]
    assert cmp[0]["goodput"] == {"1p1d": 1.5, "2agg": 1.2} and cmp[0]["itl_p99_1p1d_vs_2agg"] == approx(0.25)
    assert cmp[1]["itl_p99_1p1d_vs_2agg"] == approx(2.0)  # 3.97 is within 1 % of 4.00: a tie
    doc = {"slo": {"ttft_ms": 500.0, "tpot_ms": 50.0}, "runs": rows, "comparisons": cmp,
           "peer_copy": {"src": "cuda:0", "dst": "cuda:1", "bytes": 2 << 30, "iters": 10, "Bps": 5e10},
           "layouts": {"1p1d": {"nixl": nixl_figures(8e9, 0.32, 5e10, reads=16, descriptors=40, post_seconds=0.004),
                                "nixl_by_workload": {
                                    "long": nixl_figures(6e9, 0.2, 5e10, reads=6, descriptors=6, post_seconds=0.001),
                                    "short": nixl_figures(2e9, 0.12, 5e10, reads=10, descriptors=34,
                                                          post_seconds=0.003)}},
                       "2agg": {"nixl": {"bytes": 0.0, "seconds": 0.0, "Bps": None, "vs_peer_copy": None}}}}
    table = build_table(doc)
    assert "| long | 2 | 1p1d | **1.50** | 50 % | yes | no | 1.0 / 2.0 / 30.0 |" in table
    assert "| long | 2 | 2agg | 1.20 | 50 % |" in table and "| 90 % | 25.00 |" in table
    assert "| short | 8 | 1p1d | 4.00 |" in table  # a tie: neither in bold
    assert "| long | 2 | 1.50 | 1.20 | 1p1d | 30.0 | 120.0 | 0.25× |" in table
    assert "| short | 8 | 4.00 | 3.97 | tie | 40.0 | 20.0 | 2.00× |" in table
    assert "peer copy cuda:0 → cuda:1: 50.0 GB/s (2.00 GiB, median of 10, bytes counted once)" in table
    assert ("1p1d, over all runs: NIXL 25.00 GB/s (0.50× the peer copy), 8.00 GB in 0.320 s busy; 16 READs, "
            "20.00 ms each with 2.5 descriptors, 0.25 ms of it posting") in table
    assert "1p1d, long runs: NIXL 30.00 GB/s (0.60× the peer copy)" in table
    assert "1p1d, short runs: NIXL 16.67 GB/s (0.33× the peer copy)" in table
    assert "idle" not in table  # no idle-link copies measured: no line for them

    asked = []

    def measure(src, dst, nbytes, idle_s):
        asked.append((src, dst, nbytes, idle_s))
        return {"src": src, "dst": dst, "bytes": nbytes, "idle_s": idle_s, "iters": 10, "Bps": 2.5e10}

    idle_peer_copies(doc, "cuda:0", "cuda:1", measure)
    # one copy per workload with READs, of its mean READ's bytes, after the link sat idle
    assert asked == [("cuda:0", "cuda:1", 1_000_000_000, IDLE_COPY_S), ("cuda:0", "cuda:1", 200_000_000, IDLE_COPY_S)]
    by = doc["layouts"]["1p1d"]["nixl_by_workload"]
    assert by["long"]["vs_idle_peer_copy"] == approx(1.2) and by["short"]["vs_idle_peer_copy"] == approx(16.67 / 25, 1e-3)
    table = build_table(doc)
    assert ("1p1d, short runs: the peer copy of a READ's mean 191 MiB after 100 ms idle: 25.0 GB/s; NIXL 0.67× "
            "that") in table


def test_refuses_without_two_gpus(monkeypatch, capsys):
    import services.cluster.placement_gpu as placement

    monkeypatch.setattr(placement, "visible_gpus", lambda env=None: ["0"])
    assert main(["bench", "disagg", "--result-file", "/nonexistent/never-written.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("tokenmill bench disagg: needs two CUDA devices, torch sees 1; --allow-one-gpu shares one for a "
                   "smoke run, --device cpu runs on the CPU")


def test_both_layouts_end_to_end_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "disagg.json"
    code = main(["bench", "disagg", "--device", "cpu", "--model", "smollm2", "--workloads", "long",
                 "--long-len", "300,400", "--long-output", "8", "--long-rates", "2", "--num-prompts", "4",
                 "--set", "tokenizer.count=1", "--set", "engine.kv_cache_memory=128MiB", "--result-file", str(out),
                 "--profile-dir", str(tmp_path / "prof")])
    text = capsys.readouterr().out
    assert code == 0, text
    res = json.loads(out.read_text())
    assert set(res["layouts"]) == {"1p1d", "2agg"} and res["errors"] == []
    assert res["peer_copy"]["Bps"] > 0 and res["peer_copy"]["src"] == res["peer_copy"]["dst"] == "cpu"
    # the copy of the long READs' mean bytes from an idle link, and NIXL's rate against it
    idle = res["idle_peer_copy"]["long"]
    assert idle["idle_s"] == IDLE_COPY_S and idle["Bps"] > 0
    assert idle["bytes"] == int(res["layouts"]["1p1d"]["nixl"]["bytes"] / res["layouts"]["1p1d"]["nixl"]["reads"])
    assert res["layouts"]["1p1d"]["nixl_by_workload"]["long"]["vs_idle_peer_copy"] > 0
    runs = {r["layout"]: r for r in res["runs"]}
    assert set(runs) == {"1p1d", "2agg"}
    for r in runs.values():
        s = r["summary"]
        assert (r["workload"], r["rate"], r["requests"], r["completed"], r["failed"]) == ("long", 2.0, 4, 4, 0)
        assert s["output_len_mismatch"] == 0 and s["output_tokens"] == 32
        assert 0 <= r["goodput"] <= r["request_throughput"] and 0 <= r["slo_attainment"] <= 1
        assert r["goodput"] == approx(r["slo_attainment"] * r["requests"] / r["duration_s"])
        assert r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p99"] > 0 and r["output_tok_s"] > 0
        assert r["server"]["prefix_cache_hits"] == 0  # every request under its own cache salt
    # the same prompts and arrival times for both layouts
    recs = {k: [(x["input_len"], x["scheduled"]) for x in r["records"]] for k, r in runs.items()}
    assert recs["1p1d"] == recs["2agg"] and all(300 <= n <= 400 for n, _ in recs["1p1d"])
    for name, r in runs.items():  # every worker profiled through the run: a trace each, with its engine's steps
        traces = r["profile"]["traces"]
        assert set(traces) == ({"prefill-0", "decode-0"} if name == "1p1d" else {"decode-0", "decode-1"}), traces
        for path in traces.values():
            assert Path(path).parent == tmp_path / "prof" / name
            assert any(e.get("name") == STEP_RANGE for e in profile_summary.load_events(path))
        # host-memory pools: UCX copies on the CPU, so no GPU copy follows a READ's post in the trace
        assert all(v == {"reads": 0} for v in r["profile"]["reads"].values()), r["profile"]["reads"]
    one_p, agg = runs["1p1d"], runs["2agg"]
    # prompts over router.prefill_threshold_tokens (256) go to the prefill worker; their KV comes over NIXL
    assert one_p["placements"]["remote"] >= 1 and 0 < one_p["remote_prefill_share"] <= 1
    assert one_p["nixl"]["bytes"] > 0 and one_p["nixl"]["Bps"] > 0 and one_p["nixl"]["vs_peer_copy"] > 0
    assert res["layouts"]["1p1d"]["nixl"]["bytes"] == one_p["nixl"]["bytes"]
    assert res["layouts"]["1p1d"]["nixl_by_workload"]["long"]["reads"] == one_p["nixl"]["reads"]
    # every remote prompt is one READ, of at least one descriptor, posted in less time than it was in flight
    assert one_p["nixl"]["reads"] == one_p["placements"]["remote"]
    assert one_p["nixl"]["descriptors_per_read"] >= 1
    assert 0 < one_p["nixl"]["post_ms_per_read"] <= one_p["nixl"]["busy_ms_per_read"]
    assert agg["nixl"]["bytes"] == 0 and agg["remote_prefill_share"] is None
    [c] = res["comparisons"]
    assert c["higher"] in ("1p1d", "2agg", "tie") and c["itl_p99_1p1d_vs_2agg"] > 0
    assert {"1p1d: cluster start", "2agg: cluster start", "1p1d: long at 2 req/s"} <= set(res["phases_s"])
    assert "| long | 2 | 1p1d" in text and "| long | 2 | 2agg" in text and "1p1d, over all runs: NIXL" in text
