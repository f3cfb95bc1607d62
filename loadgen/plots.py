"""PNG plots of a benchmark: latency CDFs (every run overlaid) and, for a sweep, TTFT/TPOT, throughput and goodput
against the offered load (rate, or concurrency for a closed-loop sweep). Headless (matplotlib's Agg backend)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if not values:
        return
    x = np.sort(np.asarray(values) * 1000)
    ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def latency_cdfs(runs: list[dict[str, Any]], path: Path) -> Path:
    """TTFT, TPOT, ITL and e2e CDFs, one line per run. ``runs``: the JSON runs (``label``, ``records``)."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, key, title in zip(axes.flat, ("ttft", "tpot", "itls", "e2e"),
                              ("time to first token", "time per output token", "inter-token latency",
                               "end-to-end latency")):
        for run in runs:
            ok = [r for r in run["records"] if r["outcome"] == "ok" and not r["warmup"] and r["e2e"] is not None]
            if key == "itls":
                vals = [b - a for r in ok for a, b in itertools.pairwise(r["chunk_times"])]
            elif key == "tpot":
                vals = [r["tpot"] for r in ok if r["output_tokens"] > 1]
            else:
                vals = [r[key] for r in ok]
            _cdf(ax, vals, run["label"])
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itls" else "fraction of gaps")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes.flat[0].legend(fontsize=8)
    fig.suptitle("latency CDFs")
    _save(fig, path)
    return path


def _x(runs: list[dict[str, Any]]) -> tuple[list[float], str]:
    """The swept dimension: the offered rate, unless the concurrency is what varies."""
    rates = [r["load"]["request_rate"] for r in runs]
    concs = [r["load"]["max_concurrency"] or 0 for r in runs]
    if len(set(concs)) > 1 or not all(v is not None and math.isfinite(v) for v in rates):
        return concs, "concurrency (requests in flight)"
    return rates, "offered request rate (req/s)"


def sweep_plots(runs: list[dict[str, Any]], prefix: Path) -> list[Path]:
    """Three PNGs for a sweep: ``_latency`` (TTFT and TPOT p50/p90/p99), ``_throughput``, ``_goodput``."""
    x, xlabel = _x(runs)
    out = []
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((a1, "ttft_ms", "TTFT"), (a2, "tpot_ms", "TPOT")):
        for p in ("p50", "p90", "p99"):
            ax.plot(x, [r["summary"][key][p] for r in runs], marker="o", label=p)
        ax.set_title(f"{title} vs load")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms")
        ax.legend()
        ax.grid(alpha=0.3)
    out.append(_save(fig, prefix.with_name(prefix.name + "_latency.png")))

    fig, a1 = plt.subplots(figsize=(7, 4.5))
    a1.plot(x, [r["summary"]["request_throughput"] for r in runs], marker="o", color="C0", label="requests/s")
    a1.set_xlabel(xlabel)
    a1.set_ylabel("completed requests/s", color="C0")
    if xlabel.startswith("offered"):
        a1.plot(x, x, ls="--", color="grey", label="offered")
    a2 = a1.twinx()
    a2.plot(x, [r["summary"]["output_throughput"] for r in runs], marker="s", color="C1")
    a2.set_ylabel("output tokens/s", color="C1")
    a1.set_title("throughput vs load")
    a1.grid(alpha=0.3)
    out.append(_save(fig, prefix.with_name(prefix.name + "_throughput.png")))

    fig, a1 = plt.subplots(figsize=(7, 4.5))
    if any("goodput" in r["summary"] for r in runs):
        a1.plot(x, [r["summary"].get("goodput", math.nan) for r in runs], marker="o", label="goodput (req/s)")
        a1.plot(x, [r["summary"]["request_throughput"] for r in runs], marker="s", ls=":", label="throughput")
        a2 = a1.twinx()
        a2.plot(x, [100 * r["summary"].get("slo_attainment", math.nan) for r in runs], color="C2", marker="^",
                label="attainment")
        a2.set_ylabel("SLO attainment (%)", color="C2")
        a2.set_ylim(0, 105)
        a1.set_title(f"goodput vs load (SLO {runs[0]['summary'].get('slo', '')})")
    else:
        a1.text(0.5, 0.5, "no SLO given (--goodput ttft:MS tpot:MS e2e:MS)", ha="center", transform=a1.transAxes)
        a1.set_title("goodput vs load")
    a1.set_xlabel(xlabel)
    a1.set_ylabel("requests/s")
    a1.legend(loc="upper left")
    a1.grid(alpha=0.3)
    out.append(_save(fig, prefix.with_name(prefix.name + "_goodput.png")))
    return out
