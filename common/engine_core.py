"""A model worker's two halves: the engine core (the engine, its KV pool, its NIXL agent) and the front (gRPC,
detokenization, load reports), in two processes by default.

Why two processes: the engine thread gives up the GIL at every GPU wait and must take it back before it can launch
the next step. In one process it takes it from the gRPC and detokenizer threads, which run Python for every step's
outputs, and the served step grew 25–39% over the engine's own (docs/benchmarks.md, the served cluster on a GPU).
In a process of its own the engine shares its GIL with nobody (vLLM's EngineCore process, SGLang's scheduler
process).

The engine side is a ``WorkerCore`` (its subclasses: services/decode/core.py, services/prefill/core.py). The front
calls its methods by name (``CoreHandle.call``); each runs on the engine thread between two steps, and a call, once
made, runs even if its caller stops waiting. The core tells the front what happened through events
(``WorkerCore.emit(kind, *args)``), which the front's ``on_core_event`` takes: ``outputs`` (a step's outputs),
``stats`` (the engine's counters, every ``STATS_INTERVAL_S`` while it works and at once when it is idle: what
``/metrics`` reads) and the role's own (a KV pull's first token, a lease to give back, a transfer's figures).
``validate`` is the one call that runs off the engine thread, on a thread of its own (it reads only the engine's
configuration, and may compile a grammar).

Two handles, one interface:
- ``ProcessCore`` (``worker_engine_process``, the default): the core in a spawned child process, its calls and
  events pickled over a pipe. In the child, calls come in on a reader thread and run on the engine loop; the results
  and events of one loop iteration leave in one message, after the commands ran and again after the step. The
  front reads the pipe on a thread of its own and hands each event to ``on_core_event`` there. The child exits
  when the pipe closes (the front died); the front fails when the child does (EOF), as when an engine thread dies.
- ``ThreadCore``: the core on an ``EngineLoop`` thread of the worker's own process; events are handed over on the
  engine thread. Tests that reach into the engine use it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from tokenmill.v1 import router_pb2

from common.cluster_config import ServiceConfig
from common.engine import LLMEngine, OutputBatch, RequestLimits, RequestOutput
from common.engine_loop import EngineLoop
from common.gc_watch import GcTimer, freeze_startup_heap
from common.kv_transfer import KvCompat, KvHandshake, KvTransferAgent
from common.load_report import engine_load
from common.loader import load_model_source
from common.model_runner import KV_LAYOUT
from common.profiling import EngineProfiler
from common.sampling import SamplingParams
from common.sequence import PriorityClass
from common.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

Emit = Callable[..., None]


def build_engine(cfg: ServiceConfig) -> LLMEngine:
    """Load the model and warm it up (one short request) so the first real one pays no start-up cost. Raises
    ValueError for a tensor-parallel prefill worker: the KV transfer would carry rank 0's shard alone."""
    tp = cfg.cluster.engine.tensor_parallel_size
    if cfg.role == "prefill" and tp > 1:
        raise ValueError(f"{cfg.name}: engine.tensor_parallel_size={tp} on a prefill worker: the KV transfer between "
                         f"the pools does not carry a tensor-parallel worker's shards; serve the aggregated layout "
                         f"(prefill.count=0)")
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    t0 = time.perf_counter()
    engine = LLMEngine(load_model_source(cfg.cluster.model, cfg.cluster.tokenizer_spec), cfg.cluster.engine)
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0.0))
    engine.reset_step_counters()  # /metrics counts served work only
    log.info("%s: model %s loaded and warmed in %.1f s (%d KV blocks)", cfg.name, engine.source.model_id,
             time.perf_counter() - t0, engine.block_manager.num_blocks)
    return engine


def make_agent(cfg: ServiceConfig, engine: LLMEngine) -> KvTransferAgent:
    kv = engine.runner.kv_cache
    role = cfg.role
    if role != "prefill" and role != "decode":
        raise ValueError(f"{cfg.name}: a KV transfer agent belongs to a prefill or decode worker")
    # the name is unique to this process: a restarted worker's peers see a new agent, never READ through the old
    return KvTransferAgent(f"{cfg.name}.{os.getpid()}", kv, KvCompat.for_pool(kv, engine.source.model_id, KV_LAYOUT),
                           role=role, warm_links=engine.cfg.kv_warm_links)


@dataclass(frozen=True)
class TokenizerParts:
    """A ``TextTokenizer`` as plain data, to rebuild it in another process."""

    json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos: bool

    @classmethod
    def of(cls, t: TextTokenizer) -> TokenizerParts:
        return cls(t.tk.to_str(), t.chat_template, t.bos_token, t.eos_token, t.add_bos)

    def build(self) -> TextTokenizer:
        from tokenizers import Tokenizer

        return TextTokenizer(Tokenizer.from_str(self.json), self.chat_template, self.bos_token, self.eos_token,
                             self.add_bos)


@dataclass(frozen=True)
class CoreInfo:
    """What the front needs to know of the engine once it is up."""

    model_id: str
    num_blocks: int
    agent_name: str
    bytes_per_block: int
    tokenizer: TokenizerParts | None
    limits: RequestLimits  # the front checks requests against these itself (``WorkerBase.validate``)


# While the engine works its counters go to the front at most this often: a report is ~60 counters gathered and
# pickled on the engine thread (the grammar mask process's answers read for them), too much for every step, and
# /metrics is read every few seconds. An engine with nothing left to do reports at once.
STATS_INTERVAL_S = 0.05


class WorkerCore:
    """The engine side of a worker: the engine, its NIXL agent, and the methods the front calls by name (on the
    engine thread). Subclasses add their role's calls and hooks."""

    def __init__(self, cfg: ServiceConfig, emit: Emit) -> None:
        self.cfg = cfg
        self.emit = emit
        self.engine: LLMEngine | None = None
        self.agent: KvTransferAgent | None = None
        self.loop: EngineLoop | None = None
        self.profiler = EngineProfiler(cfg.cluster.profile_dir, cfg.name)
        self._stats_at = -STATS_INTERVAL_S  # when the counters last went to the front (monotonic s)

    def setup(self) -> LLMEngine:
        """Build the engine and the agent (on the engine thread: the process's only torch thread)."""
        self.engine = build_engine(self.cfg)
        self.engine.track_latencies = True  # each request's queue time and TTFT go to the front's histograms
        self.agent = make_agent(self.cfg, self.engine)
        return self.engine

    def info(self) -> CoreInfo:
        assert self.engine is not None and self.agent is not None
        tok = self.engine.tokenizer
        return CoreInfo(self.engine.source.model_id, self.engine.block_manager.num_blocks, self.agent.name,
                        self.agent.bytes_per_block, TokenizerParts.of(tok) if tok is not None else None,
                        self.engine.limits)

    # -- hooks of the engine loop (engine thread) ---------------------------------------------------------
    def on_outputs(self, outs: list[RequestOutput]) -> None:
        self.emit("outputs", OutputBatch(outs))

    def on_tick(self, engine: LLMEngine) -> None:
        return None

    def busy(self) -> bool:
        return False

    def after(self, end: bool) -> None:
        """Before a step (``end`` False) and at the end of each loop iteration: the front's view of the counters
        (and the requests' queue times and TTFTs for its histograms) is renewed at the end, every
        ``STATS_INTERVAL_S`` while the engine works and at once when it has nothing left to do."""
        if not end:
            return
        assert self.engine is not None
        now = time.monotonic()
        if now - self._stats_at < STATS_INTERVAL_S and (self.engine.has_unfinished() or self.busy()):
            return
        self._stats_at = now
        queued, first = self.engine.drain_latencies()
        if queued or first:
            self.emit("latencies", queued, first)
        self.emit("stats", self.stats())

    def stats(self) -> dict[str, float]:
        """The numbers ``/metrics`` shows of the engine and the agent (``WorkerMetrics.bind``, ``STATS_GAUGES``)."""
        e, a = self.engine, self.agent
        assert e is not None
        bm = e.block_manager
        s = {
            "steps": e.num_steps, "step_seconds": e.step_seconds, "step_decode_rows": e.step_decode_rows,
            "step_prompt_tokens": e.step_prompt_tokens, "idle_seconds": self.loop.idle_seconds if self.loop else 0.0,
            "cpu_seconds": self.loop.cpu_seconds if self.loop else 0.0,
            "running": e.num_running, "waiting": e.num_waiting, "kv_used": bm.usage(),
            "kv_free": bm.num_free_blocks, "kv_total": bm.num_blocks, "prefix_queries": bm.stats.queries,
            "prefix_hits": bm.stats.hits,
            **{f"phase_{k}": v for k, v in e.step_phases().items()},
            **{f"loop_{k}": v for k, v in (self.loop.loop_seconds.items() if self.loop else ())},
            **{f"grammar_masks_{k}": v for k, v in e.grammar_mask_counts().items()},
            **{f"grammar_mask_{k}": v for k, v in e.grammar_fill_stats().items()},
        }
        for klass in PriorityClass:
            waiting, running = e.num_by_class(klass)
            s[f"waiting_{klass.name.lower()}"] = waiting
            s[f"running_{klass.name.lower()}"] = running
        if a is not None:
            s.update(nixl_bytes=a.bytes_transferred, nixl_seconds=a.transfer_seconds, nixl_busy=a.busy_seconds,
                     nixl_failures=a.failures, nixl_reads=a.posted, nixl_descriptors=a.posted_descriptors,
                     nixl_post=a.post_seconds, nixl_warmups=a.warmups)
        return s

    # -- calls every worker takes -----------------------------------------------------------------------
    def validate(self, prompt: list[int], params: SamplingParams) -> int:
        """Off the engine thread (it reads only configuration; a grammar is compiled and cached here)."""
        assert self.engine is not None
        return self.engine.validate(prompt, params)

    def load(self, worker_id: str, address: str, role: router_pb2.WorkerRole, full: bool,
             draining: bool) -> tuple[router_pb2.WorkerLoad, list[int], list[int]]:
        """A load report, and the block manager's KV events since the last one (the front keeps them per router)."""
        assert self.engine is not None
        stored, removed = self.engine.block_manager.drain_events()
        return engine_load(self.engine, worker_id, address, role, full=full, draining=draining), stored, removed

    def handshake(self) -> KvHandshake:
        assert self.agent is not None
        return self.agent.handshake_payload()

    def add_peer(self, name: str, metadata: bytes, descriptors: bytes | None, compat: KvCompat) -> None:
        assert self.agent is not None
        self.agent.add_peer(name, metadata, descriptors, compat)

    def has_peer(self, name: str) -> bool:
        assert self.agent is not None
        return self.agent.has_peer(name)

    def remove_peer(self, name: str) -> None:
        assert self.agent is not None
        self.agent.remove_peer(name)

    def profile(self, start: bool) -> str:
        """Start the torch profiler around the engine's steps, or stop it and write its trace (its path)."""
        if start:
            self.profiler.start()
            if self.loop is not None:
                self.loop.profiling = True
            return ""
        if self.loop is not None:
            self.loop.profiling = False
        return self.profiler.stop()

    def close(self) -> None:
        self.profiler.close()
        if self.engine is not None:
            self.engine.close()  # the engine thread has ended: stop the other tensor-parallel ranks, if any
        if self.agent is not None:
            self.agent.close()


# -- the handles (the front's side) ------------------------------------------------------------------------
class CoreHandle:
    """How the front reaches its core. ``on_event(kind, *args)`` gets the core's events (engine thread or pipe
    reader: keep it cheap); ``on_failure`` the exception that ended the core, once."""

    ready: Future[CoreInfo]

    def start(self) -> None:
        raise NotImplementedError

    def call(self, method: str, *args: Any) -> Future[Any]:
        """Run ``core.method(*args)`` on the engine thread before its next step; the future gets its result."""
        raise NotImplementedError

    def validate(self, prompt: list[int], params: SamplingParams) -> Future[int]:
        raise NotImplementedError

    def now(self, method: str, *args: Any) -> None:
        """Run ``core.method(*args)`` at once, off the engine thread (in the child, on the thread that reads the
        pipe; on a thread of its own beside an engine thread), for a method safe beside the engine thread that must
        not wait for a step (``warm_link``). No result; an error is logged."""
        raise NotImplementedError

    def stop(self, timeout: float = 30.0) -> None:
        raise NotImplementedError


class ThreadCore(CoreHandle):
    """The core on an engine thread of this process."""

    def __init__(self, core_cls: type[WorkerCore], cfg: ServiceConfig, on_event: Emit,
                 on_failure: Callable[[BaseException], None]) -> None:
        self.core = core_cls(cfg, on_event)
        self.ready = Future()
        self._now: ThreadPoolExecutor | None = None

        def setup() -> LLMEngine:
            engine = self.core.setup()
            self.ready.set_result(self.core.info())
            return engine

        self.loop = EngineLoop(setup, self.core.on_outputs, self.core.on_tick, self.core.busy, idle_tick_s=0.005,
                               on_failure=on_failure, after=self.core.after)
        self.core.loop = self.loop
        self.loop.ready.add_done_callback(self._failed_start)

    def _failed_start(self, f: Future[LLMEngine]) -> None:
        e = f.exception()
        if e is not None and not self.ready.done():
            self.ready.set_exception(e)

    def start(self) -> None:
        self.loop.start()

    def call(self, method: str, *args: Any) -> Future[Any]:
        fn = getattr(self.core, method)
        return _detached(self.loop.submit(lambda e: fn(*args)))

    def now(self, method: str, *args: Any) -> None:
        # a thread of its own, so the caller (the front's asyncio loop) never waits on the core's locks
        if self._now is None:
            self._now = ThreadPoolExecutor(1, thread_name_prefix="engine-core-now")
        self._now.submit(_run_now, self.core, method, args)

    def validate(self, prompt: list[int], params: SamplingParams) -> Future[int]:
        out: Future[int] = Future()
        try:
            out.set_result(self.core.validate(prompt, params))
        except BaseException as e:
            out.set_exception(e)
        return out

    def stop(self, timeout: float = 30.0) -> None:
        self.loop.stop(timeout)
        if self._now is not None:
            self._now.shutdown(wait=True, cancel_futures=True)
        self.core.close()


def _detached(inner: Future[Any]) -> Future[Any]:
    """A future that follows ``inner``; cancelling it leaves ``inner`` (the call runs all the same)."""
    out: Future[Any] = Future()

    def copy(f: Future[Any]) -> None:
        if out.set_running_or_notify_cancel():
            e = f.exception()
            if e is not None:
                out.set_exception(e)
            else:
                out.set_result(f.result())

    inner.add_done_callback(copy)
    return out


# the pipe's messages. Front → child: ("call", id, method, args), ("validate", id, args), ("stop",).
# Child → front: ("ready", info), ("failed", exc), and ("batch", [item, ...]) with items ("result", id, ok, value)
# and ("event", kind, args).


class ProcessCore(CoreHandle):
    """The core in a child process of its own (see the module's docstring)."""

    def __init__(self, core_cls: type[WorkerCore], cfg: ServiceConfig, on_event: Emit,
                 on_failure: Callable[[BaseException], None]) -> None:
        self.ready = Future()
        self._on_event = on_event
        self._on_failure = on_failure
        ctx = multiprocessing.get_context("spawn")  # the child initializes CUDA; a fork would copy this process
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child, core_cls, cfg), name=f"{cfg.name}-engine",
                                 daemon=True)
        self._child_end = child
        self._send_lock = threading.Lock()
        self._pending: dict[int, Future[Any]] = {}
        self._ids = 0
        self._closed = False  # no more calls: stopping, or the child is gone
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self.name = cfg.name

    def start(self) -> None:
        self._proc.start()
        self._child_end.close()  # the child holds its end; EOF here when it exits
        self._reader.start()

    def _send(self, msg: tuple[Any, ...], fut: Future[Any] | None) -> None:
        with self._send_lock:
            if self._closed:
                if fut is not None:
                    fut.set_exception(RuntimeError(f"{self.name}: the engine process is not running"))
                return
            if fut is not None:
                self._ids += 1
                self._pending[self._ids] = fut
                msg = (msg[0], self._ids, *msg[1:])
            try:
                self._conn.send(msg)
            except (OSError, ValueError) as e:  # the child is gone: the reader reports it
                if fut is not None:
                    self._pending.pop(self._ids, None)
                    fut.set_exception(RuntimeError(f"{self.name}: the engine process is gone ({e})"))

    def call(self, method: str, *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self._send(("call", method, args), fut)
        return fut

    def validate(self, prompt: list[int], params: SamplingParams) -> Future[int]:
        fut: Future[int] = Future()
        self._send(("validate", (prompt, params)), fut)
        return fut

    def now(self, method: str, *args: Any) -> None:
        self._send(("now", method, args), None)

    def _resolve(self, call_id: int, ok: bool, value: Any) -> None:
        with self._send_lock:
            fut = self._pending.pop(call_id, None)
        if fut is None or not fut.set_running_or_notify_cancel():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def _read(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "batch":
                    for item in msg[1]:
                        if item[0] == "event":
                            self._on_event(item[1], *item[2])
                        else:
                            self._resolve(item[1], item[2], item[3])
                elif kind == "ready":
                    self.ready.set_result(msg[1])
                elif kind == "failed":
                    error = msg[1]
                    break
        except (EOFError, OSError) as e:
            error = RuntimeError(f"the engine process exited (code {self._proc.exitcode})") if not self._stopping \
                else None
            if error is not None:
                log.error("%s: %s (%s)", self.name, error, type(e).__name__)
        except BaseException as e:  # an event handler failed: nothing more can be trusted
            log.exception("%s: reading the engine process failed", self.name)
            error = e
        with self._send_lock:
            self._closed = True
            pending, self._pending = self._pending, {}
        gone = error or RuntimeError(f"{self.name}: the engine process stopped")
        for fut in pending.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(gone)
        if not self.ready.done():
            self.ready.set_exception(gone)
        elif error is not None and not self._stopping:
            self._on_failure(error)

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        if self._proc.pid is None:  # never started
            return
        with self._send_lock, contextlib.suppress(OSError, ValueError):  # also after a failure closed the calls
            self._conn.send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("%s: the engine process did not stop within %.0f s; killing it", self.name, timeout)
            self._proc.kill()
            self._proc.join(5)
        with self._send_lock:
            self._closed = True
        self._conn.close()
        self._reader.join(5)


def _run_now(core: WorkerCore, method: str, args: tuple[Any, ...]) -> None:
    """``CoreHandle.now``'s body: the call, its error logged, never raised into the thread that runs it."""
    try:
        getattr(core, method)(*args)
    except Exception:
        log.exception("%s: %s%r failed", core.cfg.name, method, args)


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _child_main(conn: Connection, core_cls: type[WorkerCore], cfg: ServiceConfig) -> None:
    """The engine process: build the core on the engine loop, then serve calls until ``stop`` or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C goes to the front, which stops us
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.cluster.worker_switch_interval_ms is not None:
        sys.setswitchinterval(cfg.cluster.worker_switch_interval_ms / 1000)
    # this iteration's results and events: the engine thread's, and a collection's from whichever thread ran it
    out: deque[tuple[Any, ...]] = deque()
    send_lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(msg)

    def emit(kind: str, *args: Any) -> None:
        out.append(("event", kind, args))

    def drain() -> list[tuple[Any, ...]]:
        batch = []
        while out:
            batch.append(out.popleft())
        return batch

    core = core_cls(cfg, emit)

    def after(end: bool) -> None:
        core.after(end)
        if out:
            send(("batch", drain()))

    def failed(e: BaseException) -> None:  # the engine loop died: the front fails its requests and exits
        with contextlib.suppress(OSError, ValueError):
            if out:  # what the iteration produced before it died still leaves
                send(("batch", drain()))
            send(("failed", _picklable(e)))

    loop = EngineLoop(core.setup, core.on_outputs, core.on_tick, core.busy, idle_tick_s=0.005, on_failure=failed,
                      after=after)
    core.loop = loop
    loop.start()
    try:
        loop.ready.result()
    except BaseException as e:
        send(("failed", _picklable(e)))
        return
    if cfg.cluster.gc_freeze:
        freeze_startup_heap()
    # this process's collections stand the engine still: the front's /metrics shows them (engine_gc_pause_seconds)
    GcTimer(f"{cfg.name} (engine)", lambda generation, pause: emit("engine_gc", generation, pause))
    send(("ready", core.info()))

    def runner(call_id: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[[LLMEngine], None]:
        def run(engine: LLMEngine) -> None:
            """On the engine thread: the result leaves with this iteration's batch."""
            try:
                out.append(("result", call_id, True, fn(*args)))
            except BaseException as e:
                out.append(("result", call_id, False, _picklable(e)))
        return run

    def check(call_id: int, args: tuple[Any, ...]) -> None:
        try:
            value: Any = (True, core.validate(*args))
        except BaseException as e:
            value = (False, _picklable(e))
        with contextlib.suppress(OSError, ValueError):
            send(("batch", [("result", call_id, *value)]))

    checks = ThreadPoolExecutor(2, thread_name_prefix="validate")
    try:
        while True:
            msg = conn.recv()
            kind = msg[0]
            if kind == "call":
                _, call_id, method, args = msg
                loop.submit(runner(call_id, getattr(core, method), args))
            elif kind == "validate":  # beside the reader: a grammar's compile must not hold up the calls behind it
                checks.submit(check, msg[1], msg[2])
            elif kind == "now":
                _run_now(core, msg[1], msg[2])
            elif kind == "stop":
                break
    except (EOFError, OSError):
        log.warning("%s: the worker's front went away; the engine process stops", cfg.name)
    checks.shutdown(wait=False, cancel_futures=True)
    loop.stop(timeout=30)
    core.close()
    conn.close()
