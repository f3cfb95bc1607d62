"""``python -m loadgen.bench_kv_transfer`` on the CPU (host-memory pools, UCX's cma): the module runs as documented,
its READs bring the exact bytes, and a GPU-only option is refused with a message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl")
ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loadgen.bench_kv_transfer", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=300)


def test_the_module_reads_exact_bytes_and_prints_its_table():
    r = _run("--reps", "2", "--sizes", "64", "256")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| defaults")]
    # scattered and contiguous, each at 64 and 256 tokens: 4 and 16 blocks of SmolLM2's 720 KiB
    assert len(rows) == 4, r.stdout
    assert all(" | yes | " in row for row in rows), rows  # the bytes compared by hash on both sides
    assert "scattered | tcp,cma | 256 | 11.2 | 16 |" in rows[1], rows  # every block its own descriptor
    assert "contiguous | tcp,cma | 256 | 11.2 | 1 |" in rows[3], rows  # one run: one descriptor


def test_busy_gpus_are_refused_on_host_pools():
    r = _run("--busy", "decode")
    assert r.returncode == 2 and "--busy needs the pools on GPUs" in r.stderr
    r = _run("--own-gpu")
    assert r.returncode == 2 and "--own-gpu needs the pools on GPUs" in r.stderr


def test_the_benchmark_reads_as_an_engine_polls_out_of_a_larger_pool():
    """``loadgen.bench_kv_transfer`` in its engine mode (Python a step, one poll a step) from a pool larger than the
    READs: every READ lands whole and is timed."""
    from loadgen.bench_kv_transfer import CONFIGS, run_config

    r = run_config(CONFIGS["defaults (kv_transfer.py)"], sizes=(64,), reps=2, pattern="contiguous",
                   engine=(0.004, 0.001, 0.0005), pool_blocks=40, profile=True)
    row = r["rows"][0]
    assert row["profile"] == {"reads": 0}  # profiled, but a host pool's READ copies on the CPU: no GPU copy
    assert row["exact"] and row["blocks"] == 4 and row["bytes"] == 4 * 30 * 2 * 16 * 3 * 64 * 4  # smollm2, float32
    assert r["sent"] == 3 and r["notifs"] == 3  # a warm-up and two timed READs, each notified
    assert 0 < row["min_s"] <= row["median_s"] <= row["max_s"]


def test_idle_gaps_and_a_warm_up_read_before_each():
    """``--gap-ms`` and ``--warm-lead-ms`` (the instruments of docs/performance-notes.md, "A cold link"): every
    measured READ still lands whole, the warm-up READs carry no notification, and the gap lengthens the run."""
    import time

    from loadgen.bench_kv_transfer import CONFIGS, run_config

    t0 = time.monotonic()
    r = run_config(CONFIGS["defaults (kv_transfer.py)"], sizes=(64, 32), reps=2, pattern="scattered", gap=0.2,
                   warm_lead=0.001)
    assert time.monotonic() - t0 >= 6 * 0.2  # three READs a size, each after its gap
    assert [row["exact"] for row in r["rows"]] == [True, True]
    assert r["sent"] == 6 and r["notifs"] == 6  # the measured READs' notifications only
    # the agent's warm_link before each READ, every one after a gap longer than WARM_IDLE_S: posted, not counted
    # with the READs
    c = r["counters"]
    assert c["warmups"] == 6 and c["posted"] == 6 and c["failures"] == 0


def test_the_module_prints_its_gap_in_each_row():
    r = _run("--reps", "1", "--sizes", "64", "--pattern", "contiguous", "--gap-ms", "5", "--warm-lead-ms", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| defaults")]
    assert len(rows) == 1 and "5 ms idle before each READ; warm_link 0 ms before each" in rows[0], rows
    assert " | yes | " in rows[0]
