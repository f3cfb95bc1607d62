"""The engine's profiler (common/profiling.py): started and stopped between steps on the engine thread, it writes
a gzipped Chrome trace in which every step is a range with the torch ops it ran; asked in the wrong state, it says
what to do."""

from __future__ import annotations

import gzip
import json
import threading

import pytest

from common.config import EngineConfig
from common.engine import LLMEngine
from common.engine_loop import STEP_RANGE, EngineLoop
from common.profiling import EngineProfiler, ProfileStateError
from common.rpc import status_for
from common.sampling import SamplingParams


def test_a_profile_of_the_engine_loop_has_a_range_per_step(tmp_path):
    done = threading.Event()
    loop = EngineLoop(lambda: LLMEngine.from_spec("dummy:tiny-llama", EngineConfig(kv_cache_memory=4 << 20)),
                      lambda outs: done.set() if any(o.finished for o in outs) else None)
    prof = EngineProfiler(str(tmp_path / "traces"), "decode-0")
    loop.start()
    try:
        loop.ready.result(timeout=60)

        def start(_e: LLMEngine) -> None:
            prof.start()
            loop.profiling = True

        loop.submit(start).result(timeout=30)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        loop.submit(lambda e: e.add_request("r", [3, 4, 5, 6], params)).result(timeout=30)
        assert done.wait(60)

        def stop(_e: LLMEngine) -> str:
            loop.profiling = False
            return prof.stop()

        path = loop.submit(stop).result(timeout=60)
    finally:
        loop.stop()
    assert path.startswith(str(tmp_path / "traces" / "decode-0-")) and path.endswith(".trace.json.gz")
    with gzip.open(path) as f:
        trace = json.loads(f.read())
    events = trace["traceEvents"]
    steps = [e for e in events if e.get("name") == STEP_RANGE and e.get("ph") == "X"]
    assert len(steps) >= 6, len(steps)  # a prompt step, then a step a token
    first, last = min(s["ts"] for s in steps), max(s["ts"] + s["dur"] for s in steps)
    ops = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("aten::")
           and first <= e["ts"] <= last]
    assert ops, "no torch op inside the steps"
    assert not prof.active


def test_profiles_asked_in_the_wrong_state_say_what_to_do(tmp_path):
    off = EngineProfiler(None, "decode-0")
    with pytest.raises(ProfileStateError, match="--set profile_dir=DIR"):
        off.start()
    prof = EngineProfiler(str(tmp_path), "decode-0")
    with pytest.raises(ProfileStateError, match="not profiling: start it first") as e:
        prof.stop()
    assert status_for(e.value)[0].name == "FAILED_PRECONDITION"
    prof.start()
    try:
        with pytest.raises(ProfileStateError, match="already profiling: stop it first"):
            prof.start()
    finally:
        prof.close()  # ends it without a trace
    assert not prof.active and not list(tmp_path.iterdir())


def test_the_summary_pairs_each_read_post_with_the_copy_after_it(tmp_path, capsys):
    """``loadgen.profile_summary`` on a trace in the profiler's format (a GPU's copies cannot be made here): each
    posted READ with the first peer copy after it, the copy's rate, and the GPU work beside it."""
    from common.kv_transfer import POST_RANGE, WARM_RANGE
    from loadgen import profile_summary

    mib = 1 << 20
    events = [
        {"name": STEP_RANGE, "ph": "X", "cat": "user_annotation", "ts": 0, "dur": 4000},
        {"name": POST_RANGE, "ph": "X", "cat": "user_annotation", "ts": 1000, "dur": 300},
        {"name": "Memcpy PtoP (Device -> Device)", "ph": "X", "cat": "gpu_memcpy", "ts": 1200, "dur": 500,
         "args": {"bytes": 128 * mib}},
        {"name": "gemv", "ph": "X", "cat": "kernel", "ts": 1600, "dur": 200},
        # a warm-up READ before the next one: its copy is nobody's READ
        {"name": WARM_RANGE, "ph": "X", "cat": "user_annotation", "ts": 5000, "dur": 100},
        {"name": "Memcpy PtoP (Device -> Device)", "ph": "X", "cat": "gpu_memcpy", "ts": 5050, "dur": 20,
         "args": {"bytes": 2 * mib}},
        {"name": POST_RANGE, "ph": "X", "cat": "user_annotation", "ts": 9000, "dur": 100},  # no copy after it
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = profile_summary.reads(profile_summary.load_events(path))
    assert len(rows) == 1
    r = rows[0]
    assert (r["copy_starts_us"], r["copy_us"], r["ends_us"], r["overlapping_ops"]) == (200, 500, 700, 1)
    assert r["GBps"] == pytest.approx(128 * mib / 500e-6 / 1e9)
    assert profile_summary.main([str(path)]) == 0
    out = capsys.readouterr().out
    st = profile_summary.steps(profile_summary.load_events(path))
    assert st["steps"] == 1 and st["gpu_busy_share"] == pytest.approx(600 / 4000)  # the copy and the gemv overlap
    assert "1 engine steps, host ms: p50 4.00" in out and "the GPU busy 15%" in out and "| 0 | 128 | 0.30 | 0.20 | 1 | 0.50 | 268 | 0.70 | 1 |" in out
