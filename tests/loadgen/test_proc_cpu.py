"""``loadgen.proc_cpu``: CPU seconds of named processes from /proc, a descendant's under its root's name."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from loadgen import proc_cpu

# the root starts a child that spins until it has used 0.3 s of CPU, writes a line, and sleeps until killed
_ROOT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import sys, time
while time.process_time() < 0.3:
    pass
print("spun", flush=True)
time.sleep(60)
'''], stdout=sys.stdout)
time.sleep(60)
"""


def test_a_descendants_cpu_counts_under_its_roots_name(tmp_path):
    root = subprocess.Popen([sys.executable, "-c", _ROOT], stdout=subprocess.PIPE, text=True)
    try:
        roots = {root.pid: "worker"}
        before = proc_cpu.snapshot(roots)
        t0 = time.perf_counter()
        assert root.stdout is not None and root.stdout.readline().strip() == "spun"
        after = proc_cpu.snapshot(roots)
        assert after["worker/child"] - before.get("worker/child", 0.0) >= 0.25
        assert after["worker"] < 0.3  # the root itself only started the child
        pct = proc_cpu.percent({"worker/child": 0.0, "worker": 0.0}, after, time.perf_counter() - t0)
        assert list(pct) == ["worker/child", "worker"] and pct["worker/child"] > pct["worker"]
    finally:
        subprocess.run(["pkill", "-P", str(root.pid)], check=False)
        root.kill()
        root.wait()
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"processes": [{"name": "gateway-0", "pid": 11}, {"role": "router", "pid": 12},
                                               {"name": "gone", "pid": None}]}))
    assert proc_cpu.cluster_pids(state) == {11: "gateway-0", 12: "router"}
