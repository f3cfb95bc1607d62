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


def stages(spans: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Milliseconds by stage: the derived request stages, then ``span:NAME`` for every span's duration."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    out: dict[str, list[float]] = defaultdict(list)
    for sp in spans:
        by_trace[sp["trace_id"]].append(sp)
        if sp.get("end_ns") is not None and sp.get("start_ns") is not None:
            out[f"span:{sp['name']}"].append((sp["end_ns"] - sp["start_ns"]) / 1e6)
    for trace in by_trace.values():
        gen = next((s for s in trace if is_request_root(s)), None)
        if gen is None:
            continue
        first = next((e["time_ns"] for e in gen.get("events", ()) if e["name"] == "first_token"), None)
        decode = min((s for s in trace if s["name"] == "decode"), key=lambda s: s["start_ns"], default=None)
        out["e2e"].append((gen["end_ns"] - gen["start_ns"]) / 1e6)
        if first is not None:
            out["ttft"].append((first - gen["start_ns"]) / 1e6)
        if decode is not None:
            out["to decode"].append((decode["start_ns"] - gen["start_ns"]) / 1e6)
            if first is not None:
                out["decode to first token"].append((first - decode["start_ns"]) / 1e6)
    return dict(out)


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
    a = ap.parse_args(argv)
    spans = load_spans(a.directory)
    if not spans:
        print(f"no spans in {a.directory}/*.jsonl", file=sys.stderr)
        return 1
    st = stages(spans)
    print(table(st))
    if a.json:
        Path(a.json).write_text(json.dumps(st))
    return 0


if __name__ == "__main__":
    sys.exit(main())
