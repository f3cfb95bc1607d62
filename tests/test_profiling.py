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
from common.engine_loop import EngineLoop
from common.profiling import STEP_RANGE, EngineProfiler, ProfileStateError
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
