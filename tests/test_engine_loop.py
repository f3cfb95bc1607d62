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
