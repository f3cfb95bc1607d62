"""Span files: a cluster started with ``trace_dir`` set (``tokenmill up``: real processes, the real model)
writes every service's spans as JSON lines, and ``loadgen.trace_summary`` breaks its requests' time down by stage."""

from __future__ import annotations

import asyncio
import json
import time

import openai

from loadgen import trace_summary
from loadgen.clients import GrpcTarget, SendOptions
from loadgen.metrics import RequestRecord
from loadgen.workloads import RequestSpec
from tests.services.harness import running_cluster

REQUESTS = 3


def _generates(spans: list[dict]) -> list[dict]:
    return [s for s in spans if trace_summary.is_request_root(s)]


def test_a_cluster_writes_its_spans_and_the_summary_breaks_the_first_token_down(tmp_path, capsys):
    spans_dir = tmp_path / "spans"
    with running_cluster(tmp_path, "--tokenizers", "1", "--grace", "3", "--set", f"trace_dir={spans_dir}") as info:
        c = openai.OpenAI(base_url=info["http"] + "/v1", api_key="none", max_retries=0, timeout=120)
        for i in range(REQUESTS):  # the last one as tenant "solo"
            c.completions.create(model="smollm2", prompt=f"Count to {i + 3}:", max_tokens=8, temperature=0,
                                 extra_headers={"x-tenant-id": "solo"} if i == REQUESTS - 1 else None)
        rec = RequestRecord(index=0, input_len=3, output_len=4)  # and one as the load generator sends it

        async def one() -> None:
            target = GrpcTarget(info["gateway"], None, SendOptions(ignore_eos=True, temperature=0.0))
            await target.open()
            try:
                await target.send(RequestSpec(0, (1, 2, 3), "", 3, 4), rec, time.perf_counter())
            finally:
                await target.close()

        asyncio.run(one())
        assert rec.ok and rec.request_id and rec.start_wall_ns, rec
        deadline = time.monotonic() + 30  # the exporters write in batches, every few seconds
        while time.monotonic() < deadline:
            spans = trace_summary.load_spans(spans_dir) if spans_dir.exists() else []
            if len(_generates(spans)) > REQUESTS and sum(s["name"] == "decode" for s in spans) > REQUESTS:
                break
            time.sleep(0.5)
    spans = trace_summary.load_spans(spans_dir)
    assert {"tokenmill-gateway", "tokenmill-tokenizer", "tokenmill-router", "tokenmill-decode"} <= {
        s["service"] for s in spans}
    grpc_root = [s for s in _generates(spans) if s["attributes"].get("request_id") == rec.request_id]
    assert len(grpc_root) == 1 and grpc_root[0]["name"] == "generate"  # the client's id is the span's
    # the client's TTFT splits into its way to the gateway, the gateway's TTFT and the way back, all positive
    records = [{"request_id": rec.request_id, "start_wall_ns": rec.start_wall_ns, "ttft_ms": rec.ttft * 1e3,
                "window": "w"}]
    split = trace_summary.client_split(spans, records)
    parts = [split[f"w: {k}"][0] for k in ("client to gateway", "gateway ttft", "gateway to client")]
    assert all(p > 0 for p in parts) and abs(sum(parts) - rec.ttft * 1e3) < 1e-3, (parts, rec.ttft)
    (tmp_path / "client.json").write_text(json.dumps({"client_records": {"w": records}}))
    assert trace_summary.main([str(spans_dir), "--client", str(tmp_path / "client.json"), "--slowest", "1"]) == 0
    assert "w: gateway to client" in capsys.readouterr().out
    gens = [g for g in _generates(spans) if g["name"] != "generate"]
    assert len(gens) == REQUESTS
    for g in gens:  # a request's spans share its trace: the gateway's root and the decode worker's span under it
        assert g["name"] == "openai.completion" and [e["name"] for e in g["events"]] == ["first_token"]
        decode = [s for s in spans if s["trace_id"] == g["trace_id"] and s["name"] == "decode"]
        assert len(decode) == 1 and g["start_ns"] < decode[0]["start_ns"] < g["events"][0]["time_ns"] < g["end_ns"]
    st = trace_summary.stages(spans)
    for stage in ("ttft", "to decode", "decode to first token", "e2e"):
        assert len(st[stage]) == REQUESTS + 1 and min(st[stage]) > 0
    assert max(st["ttft"]) <= max(st["e2e"])
    assert trace_summary.main([str(spans_dir)]) == 0
    out = capsys.readouterr().out
    assert "decode to first token" in out and "span:tokenize" in out
    # one tenant's requests, and the slowest request's stages and spans
    solo = trace_summary.stages(spans, tenant="solo")
    assert len(solo["ttft"]) == 1 and solo["ttft"][0] in st["ttft"]
    assert trace_summary.main([str(spans_dir), "--tenant", "solo", "--slowest", "5"]) == 0
    out = capsys.readouterr().out
    [line] = [ln for ln in out.splitlines() if "spans:" in ln]  # the tenant has one request
    assert "decode to first token" in line and "decode " in line.split("spans:")[1], line
    assert trace_summary.main([str(spans_dir), "--tenant", "nobody"]) == 1
