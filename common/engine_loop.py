"""The engine on its own thread: other threads submit work as closures, outputs go to a callback.

A worker service (prefill or decode) has one ``EngineLoop``. The gRPC handlers never touch the engine directly:
they ``submit`` a function that runs on the engine thread between two steps, and get a future for its result.
So the engine, its scheduler and its block manager stay single-threaded, and a step never waits on the network.

The loop's thread is also the only one that runs torch in the process: given a factory, it builds (loads and warms
up) the engine itself, since every thread that runs torch gets an OpenMP team of its own and more teams than cores
slow every op (docs/performance-notes.md).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from torch.profiler import record_function

from common.engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")
STEP_RANGE = "tokenmill.engine_step"  # a profile's range around each step (common/profiling.py)
# the loop's own work between steps, timed (/metrics: tokenmill:engine_loop_seconds{part}): the commands run
# without waiting (a wait with nothing to run is idle time), the tick, the hook before a step, the outputs handed
# on, the hook at the end of an iteration
LOOP_PARTS = ("commands", "tick", "before", "outputs", "after")


class EngineLoop:
    """Runs ``engine.step()`` while there is work; runs submitted closures between steps.

    ``on_outputs`` gets every step's outputs (on the engine thread: keep it cheap, e.g. a queue put).
    ``on_tick`` runs once per iteration (poll transfers, expire leases); ``busy`` says whether ticks are
    needed even when the engine is idle (a transfer in flight). ``on_failure`` gets the exception that ended the
    loop (on the engine thread, once), so the service can fail what waits on it and go down. ``after(end)``
    runs before each step (``end`` False: what the commands produced can leave before the step) and at the end of
    each iteration (True)."""

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        on_outputs: Callable[[list[RequestOutput]], None],
        on_tick: Callable[[LLMEngine], None] | None = None,
        busy: Callable[[], bool] | None = None,
        idle_tick_s: float = 0.05,
        on_failure: Callable[[BaseException], None] | None = None,
        after: Callable[[bool], None] | None = None,
    ) -> None:
        # an engine, or a factory the loop's thread calls first (see the module's docstring); ``ready`` holds it
        self._factory: Callable[[], LLMEngine] | None = None
        self.engine: LLMEngine | None = None
        self.ready: Future[LLMEngine] = Future()
        if isinstance(engine, LLMEngine):
            self.engine = engine
            self.ready.set_result(engine)
        else:
            self._factory = engine
        self._on_outputs = on_outputs
        self._on_tick = on_tick
        self._busy = busy or (lambda: False)
        self._idle_tick_s = idle_tick_s
        self._on_failure = on_failure
        self._after = after
        self._cmds: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stopping = False
        self.error: BaseException | None = None
        self.idle_seconds = 0.0  # blocked for a command with no sequence to run (/metrics: tokenmill:engine_idle_seconds)
        self.loop_seconds = dict.fromkeys(LOOP_PARTS, 0.0)  # the time between steps by part, summed
        # CPU time of the loop's thread since the engine was ready, renewed each iteration: against its busy wall time
        # (the steps and loop_seconds), the rest is time it could not run (the GIL, a blocking write)
        self.cpu_seconds = 0.0
        self.profiling = False  # each step in a profiler range of its own (common/profiling.py)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._cmds.put(None)
        self._thread.join(timeout)

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the engine thread before its next step. Exceptions land in the future."""
        fut: Future[T] = Future()
        if self._stopping:
            fut.set_exception(RuntimeError("the engine loop is stopping"))
        else:
            self._cmds.put((fn, fut))
        return fut

    def _run_commands(self, eng: LLMEngine, block: bool) -> None:
        timeout = self._idle_tick_s if self._busy() else 0.5
        try:
            item = self._cmds.get(timeout=timeout) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(eng))
                except BaseException as e:
                    fut.set_exception(e)
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                return
        self._stopping = True

    def _run(self) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
            except BaseException as e:
                self.error = e
                self._stopping = True  # later submits fail at once
                self.ready.set_exception(e)
                self._fail_pending()
                return
            self.ready.set_result(self.engine)
        eng = self.engine
        assert eng is not None
        spent = self.loop_seconds
        clock, cpu = time.perf_counter, time.thread_time
        cpu0 = cpu()
        try:
            while not self._stopping:
                self.cpu_seconds = cpu() - cpu0
                t = clock()
                if eng.has_unfinished():
                    self._run_commands(eng, block=False)
                    spent["commands"] += clock() - t
                else:
                    self._run_commands(eng, block=True)
                    self.idle_seconds += clock() - t
                t = clock()
                if self._on_tick is not None:
                    self._on_tick(eng)
                spent["tick"] += clock() - t
                if eng.has_unfinished():
                    t = clock()
                    if self._after is not None:
                        self._after(False)
                    spent["before"] += clock() - t
                    if self.profiling:
                        with record_function(STEP_RANGE):
                            outs = eng.step()
                    else:
                        outs = eng.step()
                    t = clock()
                    if outs:
                        self._on_outputs(outs)
                    spent["outputs"] += clock() - t
                t = clock()
                if self._after is not None:
                    self._after(True)
                spent["after"] += clock() - t
        except BaseException as e:  # the worker fails what waits on the engine and goes down
            self.error = e
            self._stopping = True  # later submits fail at once
            log.exception("engine loop failed")
            if self._on_failure is not None:
                self._on_failure(e)
        finally:
            self.cpu_seconds = cpu() - cpu0
            self._fail_pending()

    def _fail_pending(self) -> None:
        while True:  # nothing submitted is left hanging
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                break
            if item is not None and not item[1].done():
                item[1].set_exception(RuntimeError("the engine loop stopped"))
