"""Where a request's time goes, from the spans a cluster writes to its ``trace_dir`` (common/telemetry.py).

Run the cluster with ``--set trace_dir=DIR`` (or ``TOKENMILL_TRACE_DIR=DIR``; every service then writes
``DIR/SERVICE-PID.jsonl``), put load on it, stop it, then ``python -m loadgen.trace_summary DIR``. For every
request (a trace whose root is the gateway's span: ``generate`` over gRPC, ``openai.*`` over HTTP) it derives:

- ``ttft``: the root's start to its ``first_token`` event;
- ``to decode``: the root's start to the decode worker's ``decode`` span start (tokenizing, routing, the hops);
- ``decode to first token``: ``decode`` start to the gateway's ``first_token`` (the engine's queue and prefill,
  and the way back);
- ``e2e``: the root span;

and prints those and every span name's duration as p50 / p90 / p99 in ms. The services share one host's clock.
``--tenant NAME`` keeps the requests of one tenant (the root's ``tenant`` attribute); ``--slowest N`` lists the N
requests with the longest TTFT, each with its stages and spans: where a p99 request waited.

``--client FILE`` lines the client's view up with the spans: FILE is a JSON result with ``client_records`` (``tokenmill
bench tenants`` writes them: each request's id, its send time on the wall clock and the TTFT the client measured, by
window). Each request's client TTFT then splits into **client to gateway** (its send to the gateway's span start:
the client's own sending, the network and the gateway's gRPC server before the handler runs), the gateway's TTFT
(its span start to its ``first_token`` event) and **gateway to client** (that event to the client's first token:
the gateway's gRPC server after the handler, the network, the client's own reading).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def load_spans(directory: Path) -> list[dict[str, Any]]:
    """Every span of every ``*.jsonl`` file in ``directory``."""
    spans = []
    for path in sorted(directory.glob("*.jsonl")):
        with path.open() as f:
            spans += [json.loads(line) for line in f if line.strip()]
    return spans


def is_request_root(span: dict[str, Any]) -> bool:
    """The gateway's span of a request: the root of its trace."""
    return span.get("parent_id") is None and (span["name"] == "generate" or span["name"].startswith("openai."))


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def traces(spans: list[dict[str, Any]], tenant: str | None = None) -> list[list[dict[str, Any]]]:
    """The spans grouped by trace, the traces of ``tenant``'s requests only when given (a request's trace: its root
    is the gateway's span, whose ``tenant`` attribute names it)."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for sp in spans:
        by_trace[sp["trace_id"]].append(sp)
    if tenant is None:
        return list(by_trace.values())
    return [t for t in by_trace.values()
            if any(is_request_root(s) and s.get("attributes", {}).get("tenant") == tenant for s in t)]


def request_stages(trace: list[dict[str, Any]]) -> dict[str, float]:
    """One request's derived stages in ms (those it has), from its trace; empty without a gateway root span."""
    gen = next((s for s in trace if is_request_root(s)), None)
    if gen is None:
        return {}
    first = next((e["time_ns"] for e in gen.get("events", ()) if e["name"] == "first_token"), None)
    decode = min((s for s in trace if s["name"] == "decode"), key=lambda s: s["start_ns"], default=None)
    out = {"e2e": (gen["end_ns"] - gen["start_ns"]) / 1e6}
    if first is not None:
        out["ttft"] = (first - gen["start_ns"]) / 1e6
    if decode is not None:
        out["to decode"] = (decode["start_ns"] - gen["start_ns"]) / 1e6
        if first is not None:
            out["decode to first token"] = (first - decode["start_ns"]) / 1e6
    return out


def _durations(trace: list[dict[str, Any]]) -> list[tuple[str, float]]:
    return [(sp["name"], (sp["end_ns"] - sp["start_ns"]) / 1e6) for sp in sorted(trace, key=lambda s: s["start_ns"])
            if sp.get("end_ns") is not None and sp.get("start_ns") is not None]


def stages(spans: list[dict[str, Any]], tenant: str | None = None) -> dict[str, list[float]]:
    """Milliseconds by stage: the derived request stages, then ``span:NAME`` for every span's duration."""
    out: dict[str, list[float]] = defaultdict(list)
    for trace in traces(spans, tenant):
        for name, ms in _durations(trace):
            out[f"span:{name}"].append(ms)
        for k, v in request_stages(trace).items():
            out[k].append(v)
    return dict(out)


def slowest(spans: list[dict[str, Any]], n: int, tenant: str | None = None) -> str:
    """The ``n`` requests with the longest TTFT: their stages and every span of their trace, in start order."""
    rows = [(st["ttft"], st, t) for t in traces(spans, tenant) if "ttft" in (st := request_stages(t))]
    lines = []
    for ttft, st, t in sorted(rows, key=lambda r: -r[0])[:n]:
        root = next(s for s in t if is_request_root(s))
        rid = root.get("attributes", {}).get("request_id", root["trace_id"][:16])
        parts = ", ".join(f"{k} {v:.1f}" for k, v in st.items() if k != "ttft")
        spans_ms = ", ".join(f"{name} {ms:.1f}" for name, ms in _durations(t) if not name.startswith(("generate",
                                                                                                   "openai.")))
        lines.append(f"ttft {ttft:.1f} ms  {rid}: {parts}; spans: {spans_ms}")
    return "\n".join(lines)


def table(st: dict[str, list[float]], names: list[str] | None = None) -> str:
    """p50 / p90 / p99 of each of ``names`` (default: the derived stages, then every span)."""
    if names is None:
        derived = [k for k in ("ttft", "to decode", "decode to first token", "e2e") if k in st]
        names = derived + sorted(k for k in st if k.startswith("span:"))
    width = max(32, *(len(k) + 1 for k in names))
    lines = [f"{'stage':{width}s} {'count':>7s} {'p50 ms':>9s} {'p90 ms':>9s} {'p99 ms':>9s}"]
    for k in names:
        v = st[k]
        lines.append(f"{k:{width}s} {len(v):7d} {_pct(v, 0.5):9.2f} {_pct(v, 0.9):9.2f} {_pct(v, 0.99):9.2f}")
    return "\n".join(lines)


_CLIENT_PARTS = ("client ttft", "client to gateway", "gateway ttft", "gateway to client")


def _client_parts(roots: dict[Any, dict[str, Any]], r: dict[str, Any]) -> tuple[float, ...] | None:
    """One client record (``request_id``, ``start_wall_ns``, ``ttft_ms``) against its request's root span, in ms,
    as :data:`_CLIENT_PARTS`; None when the spans lack it or its first token."""
    root = roots.get(r.get("request_id"))
    if root is None or r.get("ttft_ms") is None or r.get("start_wall_ns") is None:
        return None
    first = next((e["time_ns"] for e in root.get("events", ()) if e["name"] == "first_token"), None)
    if first is None:
        return None
    client_first = r["start_wall_ns"] + r["ttft_ms"] * 1e6
    return (r["ttft_ms"], (root["start_ns"] - r["start_wall_ns"]) / 1e6, (first - root["start_ns"]) / 1e6,
            (client_first - first) / 1e6)


def _roots(spans: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    return {s.get("attributes", {}).get("request_id"): s for s in spans if is_request_root(s)}


def client_split(spans: list[dict[str, Any]], records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per window of ``records`` (dicts with ``window``, ``request_id``, ``start_wall_ns``, ``ttft_ms``), in ms: the
    client's TTFT, client to gateway, the gateway's TTFT and gateway to client, for the requests the spans have."""
    roots = _roots(spans)
    out: dict[str, list[float]] = defaultdict(list)
    for r in records:
        parts = _client_parts(roots, r)
        for name, v in zip(_CLIENT_PARTS, parts or ()):
            out[f"{r.get('window', 'all')}: {name}"].append(v)
    return dict(out)


def slowest_clients(spans: list[dict[str, Any]], records: list[dict[str, Any]], n: int) -> str:
    """The ``n`` requests with the longest client TTFT, split as in :func:`client_split`."""
    roots = _roots(spans)
    lines = []
    for r in sorted((r for r in records if r.get("ttft_ms") is not None), key=lambda r: -r["ttft_ms"])[:n]:
        parts = _client_parts(roots, r)
        head = f"client ttft {r['ttft_ms']:.1f} ms  {r.get('request_id')} ({r.get('window', '')})"
        lines.append(f"{head}: no span" if parts is None else
                     f"{head}: " + ", ".join(f"{k} {v:.1f}" for k, v in zip(_CLIENT_PARTS[1:], parts[1:])))
    return "\n".join(lines)


def load_client_records(path: Path) -> list[dict[str, Any]]:
    """``client_records`` of a JSON result: a list, or lists by window (each record then gets its ``window``)."""
    got = json.loads(path.read_text()).get("client_records", [])
    if isinstance(got, dict):
        return [dict(r, window=w) for w, rs in got.items() for r in rs]
    return list(got)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory", type=Path, help="the trace_dir the cluster wrote")
    ap.add_argument("--json", help="write the stages' milliseconds here")
    ap.add_argument("--tenant", help="only this tenant's requests")
    ap.add_argument("--slowest", type=int, default=0, help="list the N requests with the longest TTFT, stage by stage")
    ap.add_argument("--client", type=Path, help="a JSON result with client_records (tokenmill bench tenants): "
                    "split each client TTFT into client to gateway, the gateway's TTFT and gateway to client")
    a = ap.parse_args(argv)
    spans = load_spans(a.directory)
    if not spans:
        print(f"no spans in {a.directory}/*.jsonl", file=sys.stderr)
        return 1
    st = stages(spans, a.tenant)
    if not st:
        print(f"no requests{' of tenant ' + a.tenant if a.tenant else ''} in {a.directory}", file=sys.stderr)
        return 1
    print(table(st))
    if a.slowest:
        print(f"\nthe {a.slowest} longest TTFTs (ms):")
        print(slowest(spans, a.slowest, a.tenant))
    if a.client:
        records = load_client_records(a.client)
        split = client_split(spans, records)
        if not split:
            print(f"no request of {a.client} has a span here", file=sys.stderr)
            return 1
        print("\nthe client's TTFT, split (ms):")
        print(table(split, list(split)))
        if a.slowest:
            print(f"\nthe {a.slowest} longest client TTFTs (ms):")
            print(slowest_clients(spans, records, a.slowest))
    if a.json:
        Path(a.json).write_text(json.dumps(st))
    return 0


if __name__ == "__main__":
    sys.exit(main())
