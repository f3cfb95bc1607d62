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


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_an_idle_engine_holds_a_prefill_step_for_the_wave_that_drained_it():
    """Four sequences finish together: the next prompts wait for each other (up to ``prefill_gather_ms``) unless
    as many have come, their tokens fill the budget, or the window is over. One that finishes alone holds nothing."""
    import time

    eng = LLMEngine.from_spec("dummy:tiny-llama", EngineConfig(kv_cache_memory=4 << 20, prefill_gather_ms=50,
                                                               max_num_batched_tokens=64))
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"a{i}", [3, 4, 5, 6], p)
    _drain(eng)
    eng.add_request("b0", [3, 4, 5], p)
    assert 0 < eng.gather_wait() <= 0.05
    eng.add_request("b1", [3, 4, 5], p)
    eng.add_request("b2", [3, 4, 5], p)
    assert eng.gather_wait() > 0
    eng.add_request("b3", [3, 4, 5], p)
    assert eng.gather_wait() == 0  # all four back
    steps = eng.num_steps
    _drain(eng)
    assert eng.num_steps - steps == 3  # one prefill step (its first token) and two decode steps

    for i in range(2):
        eng.add_request(f"c{i}", [3, 4, 5], p)
    assert eng.gather_wait() > 0
    time.sleep(0.06)
    assert eng.gather_wait() == 0  # the window is over: the two go
    _drain(eng)
    eng.add_request("d0", list(range(3, 70)), p)  # 67 tokens: over the budget of 64 on its own
    assert eng.gather_wait() == 0
    _drain(eng)
    eng.add_request("e0", [3, 4, 5], p)  # d0 finished alone: nothing to wait for
    assert eng.gather_wait() == 0
    _drain(eng)


def test_the_loop_prefills_a_wave_in_one_step():
    """Through the engine loop: a wave of four prompts submitted a few ms apart is prefilled in one step."""
    import time

    outs: dict[str, list[int]] = {}
    firsts: dict[str, int] = {}
    done = threading.Event()
    eng = LLMEngine.from_spec("dummy:tiny-llama", EngineConfig(kv_cache_memory=4 << 20, prefill_gather_ms=500))
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def on_outputs(batch: list[RequestOutput]) -> None:
        for o in batch:
            if o.request_id not in outs:
                firsts[o.request_id] = eng.num_steps
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if len(outs) == 8 and all(len(v) == 3 for v in outs.values()):
                done.set()

    for i in range(4):  # added before the loop runs: one step takes them all, so they finish together
        eng.add_request(f"a{i}", [3, 4, 5, 6], p)
    loop = EngineLoop(eng, on_outputs)
    loop.start()
    try:
        for i in range(4):
            while len(outs.get(f"a{i}", ())) < 3:
                time.sleep(0.01)
        for i in range(4):
            loop.submit(lambda e, i=i: e.add_request(f"b{i}", [3, 4, 5], p))
            time.sleep(0.02)
        assert done.wait(60)
        assert len({firsts[f"b{i}"] for i in range(4)}) == 1, firsts  # the wave's first tokens: one step
    finally:
        loop.stop()
