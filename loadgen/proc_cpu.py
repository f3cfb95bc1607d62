"""CPU time of named processes and their descendants, read from ``/proc`` (Linux): what each process of a
benchmark's cluster, and of its clients, used over a window.

``snapshot(roots)`` reads every process's user + system time once; a descendant of a root (a worker's engine core,
its grammar-mask process) counts under ``"<root's name>/child"``. ``percent(before, after, seconds)`` turns two
snapshots into percent of one core. Elsewhere than Linux both are empty.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_table() -> dict[int, tuple[int, float]]:
    """pid → (parent pid, CPU seconds: user + system) of every process now (empty without /proc)."""
    out = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        out[pid] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def snapshot(roots: dict[int, str]) -> dict[str, float]:
    """CPU seconds by name: each root's own (``roots``: pid → name; names may repeat, they add up), and its
    descendants' under ``name + "/child"``."""
    stats = process_table()
    out: dict[str, float] = {}
    for pid, (_, cpu) in stats.items():
        cur, depth = pid, 0
        while cur not in roots and cur in stats and depth < 16:
            cur, depth = stats[cur][0], depth + 1
        if cur in roots:
            name = roots[cur] if cur == pid else f"{roots[cur]}/child"
            out[name] = out.get(name, 0.0) + cpu
    return out


def percent(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Percent of one core each name used between two snapshots (names in both), largest first."""
    got = {k: (after[k] - before[k]) / seconds * 100 for k in after if k in before and seconds > 0}
    return dict(sorted(got.items(), key=lambda kv: -kv[1]))


def cluster_pids(state_file: str | os.PathLike[str]) -> dict[int, str]:
    """pid → name of every process of a ``tokenmill up`` cluster, from its state file."""
    st = json.loads(Path(state_file).read_text())
    return {int(p["pid"]): p.get("name", p.get("role", "")) for p in st.get("processes", []) if p.get("pid")}
