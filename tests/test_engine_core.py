"""The engine core in a process of its own (common/engine_core.py): calls run there and answer here, results and
errors keep their types, events come back in order, and a core that dies fails what waits on it. The core is the
decode worker's (services/decode/core.py) on a real engine (a tiny dummy Llama on the CPU) in a spawned process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tokenmill.v1 import common_pb2, decode_pb2

from common.cluster_config import ServiceConfig
from common.config import EngineConfig
from common.engine import LLMEngine, OutputBatch, RequestError, RequestOutput, TokenLogprob
from common.engine_core import CoreInfo, ProcessCore, ThreadCore
from common.sampling import SamplingParams, StructuredOutput
from common.sequence import FinishReason, Tenancy
from services.decode.core import DecodeCore
from services.decode.server import DecodeWorker
from tests.services.harness import cluster

MODEL = "dummy:tiny-llama"
PROMPT = [3, 4, 5, 6, 7]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class _Front:
    """What a worker's front does with the core's events: keeps them, in order, and wakes the test."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, threading.Event] = {}
        self.stats: dict[str, float] = {}
        self.kinds: list[str] = []
        self.failures: list[BaseException] = []
        self.failed = threading.Event()
        self.collections: list[tuple[int, float]] = []
        self.marks: list[tuple[Any, ...]] = []

    def on_event(self, kind: str, *args: Any) -> None:
        self.kinds.append(kind)
        if kind == "marked":
            self.marks.append(args)
        if kind == "engine_gc":
            self.collections.append(args)
        if kind == "stats":
            self.stats = args[0]
        elif kind == "outputs":
            outs: list[RequestOutput] = args[0]
            for o in outs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    self.finished.setdefault(o.request_id, threading.Event()).set()

    def done(self, rid: str) -> threading.Event:
        return self.finished.setdefault(rid, threading.Event())

    def on_failure(self, e: BaseException) -> None:
        self.failures.append(e)
        self.failed.set()


@dataclasses.dataclass
class _Running:
    core: ProcessCore | ThreadCore
    front: _Front
    info: CoreInfo
    cfg: ServiceConfig


@contextlib.contextmanager
def _running(handle: type[ProcessCore] | type[ThreadCore] = ProcessCore,
             core_cls: type[DecodeCore] = DecodeCore) -> Iterator[_Running]:
    """A decode core of ``core_cls`` on the tiny model, started and ready; stopped afterwards."""
    cfg = cluster(**{"model": MODEL, "engine.kv_cache_memory": 8 << 20}).service("decode")
    front = _Front()
    core = handle(core_cls, cfg, front.on_event, front.on_failure)
    core.start()
    try:
        yield _Running(core, front, core.ready.result(timeout=120), cfg)
    finally:
        core.stop()


class _MarkingCore(DecodeCore):
    """A decode core with one more method: it says which thread ran it."""

    def mark(self, value: int) -> None:
        self.emit("marked", value, threading.current_thread().name)


@pytest.mark.parametrize("handle", [ProcessCore, ThreadCore])
def test_now_runs_at_once_off_the_engine_thread_and_survives_an_error(
        handle: type[ProcessCore] | type[ThreadCore]) -> None:
    """``CoreHandle.now`` (the decode front's link warm-ups): not on the engine thread, no result, and a method
    that raises is logged without taking the core down."""
    with _running(handle, _MarkingCore) as r:
        r.core.call("mark", 1).result(timeout=30)  # on the engine thread
        r.core.now("mark", 2)
        r.core.now("no_such_method")
        r.core.call("mark", 3).result(timeout=30)
        deadline = time.monotonic() + 30
        while len(r.front.marks) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        by_value = {v: thread for v, thread in r.front.marks}
        assert set(by_value) == {1, 2, 3}, r.front.marks
        assert by_value[1] == by_value[3] != by_value[2], by_value
        assert not r.front.failures


def _request(rid: str) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(meta=common_pb2.RequestMeta(request_id=rid), prompt_token_ids=PROMPT)


@pytest.fixture(scope="module")
def want() -> list[int]:
    engine = LLMEngine.from_spec(MODEL, EngineConfig(kv_cache_memory=8 << 20))
    return list(engine.generate([PROMPT], PARAMS)[0].token_ids)


@pytest.mark.parametrize("handle", [ProcessCore, ThreadCore])
def test_calls_results_errors_and_events_cross_to_the_core(handle: type[ProcessCore] | type[ThreadCore],
                                                           want: list[int]) -> None:
    with _running(handle) as r:
        core, front, info, cfg = r.core, r.front, r.info, r.cfg
        assert info.num_blocks > 0 and info.agent_name.startswith(cfg.name)
        if handle is ProcessCore:
            assert not info.agent_name.endswith(f".{os.getpid()}")  # the agent lives in the child
        assert core.validate(PROMPT, PARAMS).result(timeout=30) == PARAMS.max_tokens
        with pytest.raises(RequestError, match="outside the vocabulary"):  # the type survives the pipe
            core.validate([10**9], PARAMS).result(timeout=30)

        core.call("admit", "a", _request("a"), PARAMS, Tenancy(), None).result(timeout=30)
        assert front.done("a").wait(60)
        assert front.tokens["a"] == want  # the same greedy tokens as the engine in this process

        with pytest.raises(ValueError, match="already running"):  # an engine error comes back to the caller
            core.call("admit", "b", _request("b"), SamplingParams(max_tokens=2000, temperature=0.0,
                                                                  ignore_eos=True), Tenancy(), None).result(30)
            core.call("admit", "b", _request("b"), PARAMS, Tenancy(), None).result(timeout=30)
        core.call("end_stream", "b", None, True).result(timeout=30)  # the stream ended: its blocks come back
        load, _stored, _removed = core.call("load", cfg.name, cfg.address, 0, True, False).result(timeout=30)
        assert load.free_blocks == load.total_blocks == info.num_blocks and load.running == 0
        assert front.stats["steps"] >= len(want) and front.stats["kv_free"] == info.num_blocks
        assert "stats" in front.kinds[front.kinds.index("outputs"):] and not front.failures  # counters after a step


def test_the_front_checks_a_request_itself_and_sends_only_a_grammar_to_the_core() -> None:
    """A worker's front checks a request against the limits its core reported (``CoreInfo.limits``) in its own
    process, with the engine's messages: no round trip to the core's process on a request's way in. A grammar still
    goes to the core, which compiles it. The core here is a real engine process (the tiny model)."""
    kv = 1 << 19  # a pool smaller than the context
    cfg = cluster(**{"model": MODEL, "engine.kv_cache_memory": kv}).service("decode")
    engine = LLMEngine.from_spec(MODEL, EngineConfig(kv_cache_memory=kv))  # the same engine, here
    pool = engine.block_manager.num_blocks * engine.block_manager.block_size
    assert pool < engine.max_model_len  # so a request can exceed the pool within the context
    n = pool // 2
    cases = [
        ([], PARAMS),
        ([10**9], PARAMS),
        ([-1, 3], PARAMS),
        (PROMPT, SamplingParams(temperature=-1.0)),
        ([3] * engine.max_model_len, PARAMS),
        (PROMPT, SamplingParams(max_tokens=engine.max_model_len)),
        ([3] * n, SamplingParams(max_tokens=pool)),  # within the context, beyond the KV pool
    ]

    async def body() -> None:
        worker = DecodeWorker(cfg)
        await worker.start()
        try:
            assert isinstance(worker.core, ProcessCore)
            sent: list[Any] = []
            to_core = worker.core.validate

            def counted(prompt: list[int], params: SamplingParams) -> Any:
                sent.append(params)
                return to_core(prompt, params)

            worker.core.validate = counted  # type: ignore[method-assign]
            assert await worker.validate(PROMPT, PARAMS) == PARAMS.max_tokens
            for prompt, params in cases:
                with pytest.raises(RequestError) as here:
                    engine.validate(prompt, params)
                with pytest.raises(RequestError) as front:
                    await worker.validate(prompt, params)
                assert str(front.value) == str(here.value)
            assert sent == []  # every check above ran in this process
            grammar = SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "[ab]+"))
            with pytest.raises(RequestError) as e:  # the tiny model has no tokenizer to compile a grammar with
                await worker.validate(PROMPT, grammar)
            assert sent == [grammar] and "tokenizer" in str(e.value)
        finally:
            await worker.stop()

    asyncio.run(body())


def test_counters_go_to_the_front_at_intervals_while_busy_and_at_once_when_idle(monkeypatch) -> None:
    """A long request's steps do not each carry the engine's counters (STATS_INTERVAL_S apart at most once
    busy); the iteration that finds the engine idle sends them, current."""
    import common.engine_core as engine_core

    monkeypatch.setattr(engine_core, "STATS_INTERVAL_S", 3600.0)
    with _running(ThreadCore) as r:
        core, front = r.core, r.front
        long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        core.call("admit", "a", _request("a"), long, Tenancy(), None).result(timeout=30)
        assert front.done("a").wait(120) and len(front.tokens["a"]) == 40
        deadline = time.monotonic() + 30
        while front.stats.get("running", 1) != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        first, last = front.kinds.index("outputs"), len(front.kinds) - front.kinds[::-1].index("outputs")
        assert front.kinds.count("outputs") >= 20  # the steps of one request
        assert front.kinds[first:last].count("stats") <= 1  # the engine's first report at most, in its steps
        assert front.stats["running"] == 0 and front.stats["steps"] >= 40  # then the idle iteration's, current


def test_a_core_process_that_dies_fails_its_calls_and_the_front() -> None:
    with _running() as r:
        core, front = r.core, r.front
        assert isinstance(core, ProcessCore)
        long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
        core.call("admit", "long", _request("long"), long, Tenancy(), None).result(timeout=30)
        assert core._proc.pid is not None
        os.kill(core._proc.pid, signal.SIGKILL)  # a device fault that takes the process down
        assert front.failed.wait(30)
        assert "engine process exited" in str(front.failures[0])
        with pytest.raises(RuntimeError, match="not running"):  # later calls fail at once, never hang
            core.call("abort", "long").result(timeout=5)


class _FailingCore(DecodeCore):
    """A decode core whose engine loop dies at the tick after ``break_engine`` (as a device error would)."""

    broken = False

    def break_engine(self) -> None:
        self.broken = True

    def on_tick(self, engine: Any) -> None:
        if self.broken:
            raise RuntimeError("simulated device fault")
        super().on_tick(engine)


def test_an_engine_loop_that_dies_in_the_core_process_fails_the_front_and_stops_at_once() -> None:
    with _running(core_cls=_FailingCore) as r:
        r.core.call("break_engine").result(timeout=30)
        assert r.front.failed.wait(30)
        assert "simulated device fault" in str(r.front.failures[0])  # the child's exception, over the pipe
        t = time.monotonic()
    assert isinstance(r.core, ProcessCore)
    assert time.monotonic() - t < 20 and not r.core._proc.is_alive()  # told to stop, not killed after 30 s


def test_a_request_output_crosses_the_pipe_whole() -> None:
    """Outputs pickle through ``RequestOutput.__reduce__`` (every step's outputs cross to the front): every field,
    none left at its default, comes back, and a field added later without it fails here."""
    o = RequestOutput("r", [5, 6], [TokenLogprob(5, -0.5, [(5, -0.5), (9, -1.0)])], True, FinishReason.LENGTH, 7, 2,
                      3, leased=True, kv_block_ids=[4, 8])
    defaults = RequestOutput("", [], None, False, None, 0, 0, 0)
    assert all(getattr(o, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(RequestOutput))
    assert pickle.loads(pickle.dumps(o)) == o and len(o.__reduce__()[1]) == len(dataclasses.fields(RequestOutput))


def test_a_step_of_outputs_crosses_the_pipe_as_columns_in_its_order() -> None:
    """``OutputBatch``: the common outputs (one token, no logprobs, not finished or leased) cross as columns, the
    others whole; every output comes back equal, in its place."""
    plain = [RequestOutput(f"p{i}", [100 + i], None, False, None, 10 + i, i + 2, i) for i in range(5)]
    odd = [RequestOutput("f", [7], None, True, FinishReason.STOP, 4, 3, 0),
           RequestOutput("lp", [8], [TokenLogprob(8, -0.1, [])], False, None, 4, 2, 0),
           RequestOutput("two", [9, 10], None, False, None, 4, 2, 0),
           RequestOutput("lease", [11], None, False, None, 32, 1, 0, leased=True, kv_block_ids=[3, 4])]
    outs = [odd[0], plain[0], plain[1], odd[1], plain[2], odd[2], odd[3], plain[3], plain[4]]
    cols = OutputBatch(outs).__reduce__()[1]
    assert cols[0] == [o.request_id for o in plain] and [o for _, o in cols[5]] == odd
    back = pickle.loads(pickle.dumps(OutputBatch(outs)))
    assert type(back) is list and back == outs
    assert pickle.loads(pickle.dumps(OutputBatch(plain))) == plain
    assert pickle.loads(pickle.dumps(OutputBatch(odd))) == odd and pickle.loads(pickle.dumps(OutputBatch())) == []


class _CollectingCore(DecodeCore):
    def collect(self) -> None:
        gc.collect()


def test_the_core_process_times_its_garbage_collections_for_the_front() -> None:
    with _running(core_cls=_CollectingCore) as r:
        r.core.call("collect").result(timeout=30)  # its pause leaves with the call's result
        assert any(g == 2 and 0 < secs < 10 for g, secs in r.front.collections), r.front.collections

