"""What a worker's profile shows (a trace from ``POST /stop_profile``, common/profiling.py): its engine steps and
its KV READs.

    python -m loadgen.profile_summary DIR/decode-0-*.trace.json.gz

- steps: the ``tokenmill.engine_step`` ranges (host time of each ``engine.step()``), p50 / p90 / max, and the share
  of their span in which the GPU ran anything (an engine that waits on its host leaves the GPU idle);
- READs: for each ``tokenmill.kv_read_post`` range (posting a READ on the engine thread), the first peer-to-peer
  copy (``Memcpy PtoP``) that starts after it on the GPU: when it started after the post began, how long it ran,
  its rate, and how many other GPU operations overlapped it. The copy is what UCX's ``cuda_ipc`` queued for the READ.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import gzip
import json
import statistics
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from common.engine_loop import STEP_RANGE
from common.kv_transfer import POST_RANGE, WARM_RANGE
from services.cluster.cli import profile_call


def load_events(path: str | Path) -> list[dict[str, Any]]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def reads(events: list[dict[str, Any]]) -> list[dict[str, float]]:
    """One row per posted READ that a peer copy followed (times in µs, rate in GB/s): its copies are those that
    start after its post and before the next post, a READ's or a warm-up's (``warm_link``, whose copy is left out)."""
    posts = sorted((e for e in events if e.get("name") == POST_RANGE and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    marks = sorted(e["ts"] for e in events
                   if e.get("name") in (POST_RANGE, WARM_RANGE) and e.get("cat") == "user_annotation")
    copies = sorted((e for e in events if str(e.get("name", "")).startswith("Memcpy PtoP")), key=lambda e: e["ts"])
    others = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
              and not str(e.get("name", "")).startswith("Memcpy PtoP")]
    rows = []
    for p in posts:
        nxt = marks[bisect.bisect_right(marks, p["ts"])] if marks[-1] > p["ts"] else float("inf")
        mine = [c for c in copies if p["ts"] <= c["ts"] < nxt]
        if not mine:
            continue
        start = mine[0]["ts"]
        end = max(c["ts"] + c["dur"] for c in mine)
        nbytes = sum(float(c.get("args", {}).get("bytes", 0)) for c in mine)
        busy = sum(c["dur"] for c in mine)
        overlap = sum(1 for o in others if o["ts"] < end and o["ts"] + o["dur"] > start)
        rows.append({"post_us": p["dur"], "copy_starts_us": start - p["ts"], "copies": len(mine),
                     "copy_us": end - start, "bytes": nbytes, "GBps": nbytes / busy / 1e3 if busy else 0.0,
                     "ends_us": end - p["ts"], "overlapping_ops": overlap})
    return rows


def steps(events: list[dict[str, Any]]) -> dict[str, float]:
    """The engine's steps in a trace: how many, their host time (ms, p50 / p90 / max), and the share of the time
    from the first step's start to the last one's end in which the GPU ran something (kernels, copies, sets)."""
    ranges = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == STEP_RANGE and e.get("ph") == "X")
    if not ranges:
        return {"steps": 0}
    host = sorted((b - a) / 1e3 for a, b in ranges)
    lo, hi = ranges[0][0], max(b for _, b in ranges)
    spans = sorted((max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["ts"] < hi and e["ts"] + e["dur"] > lo)
    busy, end = 0.0, lo
    for a, b in spans:  # the union of the GPU's intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    return {"steps": len(host), "host_ms_p50": statistics.median(host), "host_ms_p90": host[int(0.9 * (len(host) - 1))],
            "host_ms_max": host[-1], "gpu_busy_share": busy / (hi - lo) if hi > lo else 0.0}


def read_medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """The medians of ``reads``' rows (ms, GB/s), and how many READs."""
    if not rows:
        return {"reads": 0}
    med = {k: statistics.median(r[k] for r in rows) for k in ("post_us", "copy_starts_us", "copy_us", "ends_us")}
    return {"reads": len(rows), "post_ms": med["post_us"] / 1e3, "copy_starts_ms": med["copy_starts_us"] / 1e3,
            "copy_ms": med["copy_us"] / 1e3, "done_ms": med["ends_us"] / 1e3,
            "copy_GBps": statistics.median(r["GBps"] for r in rows)}


@contextlib.asynccontextmanager
async def profiled(http_root: str | None) -> AsyncIterator[dict[str, str]]:
    """The gateway's ``POST /start_profile`` on entry and ``/stop_profile`` at exit (the cluster runs with
    ``profile_dir`` set); the dict yielded fills, at exit, with each worker's trace path. None: no profile."""
    traces: dict[str, str] = {}
    if http_root is None:
        yield traces
        return
    await asyncio.to_thread(profile_call, http_root, "start")
    try:
        yield traces
    finally:
        stopped = await asyncio.to_thread(profile_call, http_root, "stop")
        traces.update({w["worker_id"]: w["trace_path"] for w in stopped["workers"]})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="a worker's .trace.json.gz (or .json)")
    a = ap.parse_args(argv)
    events = load_events(a.trace)
    st = steps(events)
    if st["steps"]:
        print(f"{st['steps']} engine steps, host ms: p50 {st['host_ms_p50']:.2f}, p90 {st['host_ms_p90']:.2f}, max "
              f"{st['host_ms_max']:.2f}; the GPU busy {100 * st['gpu_busy_share']:.0f}% of the time from the first "
              f"step's start to the last one's end")
    rows = reads(events)
    if not rows:
        print("no KV READ in this trace (no kv_read_post range followed by a peer-to-peer copy)")
        return 0
    print("| READ | MiB | post ms | copy starts after ms | copies | copy ms | GB/s | done after ms | GPU ops beside |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(rows):
        print(f"| {i} | {r['bytes'] / 2**20:.0f} | {r['post_us'] / 1e3:.2f} | {r['copy_starts_us'] / 1e3:.2f} | "
              f"{r['copies']} | {r['copy_us'] / 1e3:.2f} | {r['GBps']:.0f} | {r['ends_us'] / 1e3:.2f} | "
              f"{r['overlapping_ops']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
