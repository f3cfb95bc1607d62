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


def table(st: dict[str, list[float]]) -> str:
    derived = [k for k in ("ttft", "to decode", "decode to first token", "e2e") if k in st]
    names = derived + sorted(k for k in st if k.startswith("span:"))
    lines = [f"{'stage':32s} {'count':>7s} {'p50 ms':>9s} {'p90 ms':>9s} {'p99 ms':>9s}"]
    for k in names:
        v = st[k]
        lines.append(f"{k:32s} {len(v):7d} {_pct(v, 0.5):9.2f} {_pct(v, 0.9):9.2f} {_pct(v, 0.99):9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory", type=Path, help="the trace_dir the cluster wrote")
    ap.add_argument("--json", help="write the stages' milliseconds here")
    ap.add_argument("--tenant", help="only this tenant's requests")
    ap.add_argument("--slowest", type=int, default=0, help="list the N requests with the longest TTFT, stage by stage")
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
    if a.json:
        Path(a.json).write_text(json.dumps(st))
    return 0


if __name__ == "__main__":
    sys.exit(main())
