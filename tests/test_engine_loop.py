"""EngineLoop: the engine is built on the loop's own thread (the process's only torch thread), runs submitted
work between steps, and a factory that fails fails ``ready`` and everything submitted, never hangs."""

from __future__ import annotations

import threading

import pytest

from common.config import EngineConfig
from common.engine import LLMEngine, RequestOutput
from common.engine_loop import EngineLoop
from common.sampling import SamplingParams


def test_the_factory_runs_on_the_loop_thread_and_the_engine_serves():
    built_on: list[str] = []
    done = threading.Event()
    tokens: dict[str, list[int]] = {}

    def build() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return LLMEngine.from_spec("dummy:tiny-llama", EngineConfig(kv_cache_memory=4 << 20))

    def on_outputs(outs: list[RequestOutput]) -> None:
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                done.set()

    loop = EngineLoop(build, on_outputs)
    assert loop.engine is None  # nothing built on the caller's thread
    loop.start()
    try:
        engine = loop.ready.result(timeout=60)
        assert built_on == ["engine-loop"] and loop.engine is engine
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        loop.submit(lambda e: e.add_request("r", [3, 4, 5, 6], params)).result(timeout=30)
        assert done.wait(60)
        want = LLMEngine.from_spec("dummy:tiny-llama", EngineConfig(kv_cache_memory=4 << 20)).generate(
            [[3, 4, 5, 6]], params)[0].token_ids
        assert tokens["r"] == list(want)
        assert loop.submit(lambda e: e.block_manager.num_free_blocks == e.block_manager.num_blocks).result(30)
    finally:
        loop.stop()


def test_a_factory_that_fails_fails_ready_and_what_was_submitted():
    gate = threading.Event()

    def build() -> LLMEngine:
        gate.wait(10)
        raise FileNotFoundError("no such model: /nowhere.gguf")

    loop = EngineLoop(build, lambda outs: None)
    loop.start()
    pending = loop.submit(lambda e: 1)
    gate.set()
    with pytest.raises(FileNotFoundError, match=r"/nowhere\.gguf"):
        loop.ready.result(timeout=30)
    with pytest.raises(RuntimeError, match="engine loop stopped"):
        pending.result(timeout=30)
    assert isinstance(loop.error, FileNotFoundError)
    loop.stop()


def test_the_work_between_steps_is_timed_by_part_and_waiting_is_idle_time():
    """A tick that sleeps 2 ms and an outputs hook that sleeps 1 ms show in ``loop_seconds`` in proportion to the
    steps; the loop's wait for work before and after the request counts as idle time, not as commands."""
    import time

    from common.engine_loop import LOOP_PARTS
    from loadgen.server_metrics import ENGINE_LOOP_PARTS

    assert LOOP_PARTS == ENGINE_LOOP_PARTS  # the benchmark reads the parts by these names
    done = threading.Event()
    ticks_while_busy = []

    def on_outputs(outs: list[RequestOutput]) -> None:
        time.sleep(0.001)
        if any(o.finished for o in outs):
            done.set()

    def tick(e: LLMEngine) -> None:
        if e.has_unfinished():
            ticks_while_busy.append(1)
            time.sleep(0.002)

    engine = LLMEngine.from_spec("dummy:tiny-llama", EngineConfig(kv_cache_memory=4 << 20))
    loop = EngineLoop(engine, on_outputs, on_tick=tick)
    loop.start()
    try:
        time.sleep(0.5)  # nothing to run: idle
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        loop.submit(lambda e: e.add_request("r", [3, 4, 5, 6], params)).result(timeout=30)
        assert done.wait(60)
        time.sleep(0.5)
        steps = loop.submit(lambda e: e.num_steps).result(30)
    finally:
        loop.stop()
    spent = loop.loop_seconds
    assert set(spent) == set(LOOP_PARTS) and steps == 20
    assert spent["tick"] >= 0.002 * len(ticks_while_busy) and len(ticks_while_busy) >= steps - 1
    assert spent["outputs"] >= 0.001 * steps
    # both waits are idle time (~1 s; a loaded machine may start the loop's thread late, so not all of the first)
    assert spent["commands"] < 0.1 and loop.idle_seconds >= 0.6
    # the thread's CPU time: what it ran, not the sleeps in its hooks nor the idle waits
    busy = engine.step_seconds + sum(spent.values())
    slept = 0.002 * len(ticks_while_busy) + 0.001 * steps
    assert 0 < loop.cpu_seconds < busy - 0.5 * slept
