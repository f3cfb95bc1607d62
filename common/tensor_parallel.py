"""Tensor parallelism inside one engine (Megatron-style): ``engine.tensor_parallel_size`` processes, one a rank,
each holding 1/N of every layer.

- The model (``common/model.py``): q/k/v and gate/up column-parallel (a rank holds its query heads, its KV heads and
  its slice of the intermediate dimension), o_proj and down row-parallel, each followed by one all-reduce; the
  embedding and the LM head replicated, or split by vocabulary (``engine.tp_vocab_parallel``). A rank's KV pool
  holds its KV heads: ``[blocks, layers, 2, block_size, kv_heads / N, head_dim]``.
- Execution: rank 0 is the engine (scheduler, block manager, sampler); ranks 1..N-1 are daemon processes it spawns
  (``TensorParallelWorkers``) that run ``_rank_main``. Each step rank 0 sends the model inputs as integers
  (``send_step``) and every rank runs the same forward on its shard, so the all-reduces line up. The messages go
  through a ring in shared memory that the other ranks poll (``StepChannel``; a message longer than a slot sends
  its rest over a gloo group), or, on hosts other than x86-64, as gloo broadcasts.
- The all-reduces: on CUDA (rank r on ``cuda:r``), the one-shot peer-to-peer kernel of common/p2p_all_reduce.py
  where the GPUs can map each other's memory and the input fits its buffer, else NCCL; inside the captured graphs
  too. On the CPU, gloo.
- With the peer-to-peer all-reduce, a rank that dies leaves the others' kernels waiting on the GPU: rank 0 ends its
  process when another rank exits unasked (the worker's supervisor restarts it).
- The group is torch.distributed's default group, so a process holds one tensor-parallel engine at a time; closing
  the engine stops the other ranks and destroys the group.
"""

from __future__ import annotations

import logging
import os
import platform
import random
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.config import EngineConfig, ModelConfig

if TYPE_CHECKING:
    from common.loader import ModelSource

log = logging.getLogger(__name__)

# How long a rank waits for the others to join; model loading comes after, so this covers process start-up only.
_JOIN_TIMEOUT = timedelta(minutes=5)
# Without the step channel, ranks other than 0 wait in a broadcast while the engine is idle: an idle engine must
# not time them out.
_IDLE_TIMEOUT = timedelta(days=365)
# int64 words a step message carries in its slot or first broadcast (64 KiB: a 2,048-token prefill, a batch of 64
# decodes of 1,000-token contexts); a longer message sends the rest in a gloo broadcast.
_INLINE = 8192
# The step channel: slots of one message each, after _CTRL control words (word 0: messages rank 0 has written; word
# r: messages rank r has read). A reader polls without sleeping for _SPIN_S after its last message (a wake-up from a
# sleep took ~0.2 ms in the GPU machines' sandbox), then every millisecond.
_SLOTS = 4
_CTRL = 16
_SPIN_S = 1.0
# The channel publishes a message by one store after the slot's: x86-64 keeps stores in order; elsewhere gloo.
_SHARED_STEPS = platform.machine() in ("x86_64", "AMD64")


@dataclass(frozen=True, slots=True)
class Shard:
    """This process's place in a tensor-parallel group: its rank, the group's size, and its two process groups
    (None with one rank, where nothing touches torch.distributed)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the forward's all-reduces: NCCL on CUDA, gloo on the CPU
    meta_group: Any = None  # rank 0's step messages and start-up agreements: gloo, host memory
    p2p: Any = None  # CUDA: the one-shot peer-to-peer all-reduce (common/p2p_all_reduce.py), where it could be built
    steps: StepChannel | None = None  # rank 0's step messages in shared memory (None: gloo broadcasts)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group: ``x`` summed in place and returned, except that float32 split-K parts
        ``[S, T, N]`` (common/triton_ops.py) may come back summed over their parts too, as ``[T, N]``; with one
        rank, ``x`` as it is."""
        if self.size == 1:
            return x
        if self.p2p is not None and self.p2p.fits(x):
            return self.p2p(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Every rank's ``x`` (``[rows, n]``, the same shape on each) side by side in rank order, ``[rows, n ·
        size]``, cut to its first ``total`` columns: the vocab-parallel LM head's logits."""
        out = torch.empty((self.size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.contiguous(), group=self.group)  # the ranks' blocks of rows, one after another
        return out.view(self.size, *x.shape).permute(1, 0, 2).reshape(x.shape[0], -1)[:, :total]

    def broadcast_from_0(self, x: torch.Tensor) -> None:
        """Rank 0's ``x`` into every rank's ``x``, in place, on the forward's group (queued on the device's stream
        on CUDA): the input ids rank 0's previous pick holds on its device, with async scheduling."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)

    def part(self, w: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's equal slice of ``w`` along ``dim`` (a view)."""
        n = w.shape[dim] // self.size
        return w.narrow(dim, self.rank * n, n)

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` of all ranks (every rank must call it): the KV pool's block count, so that every
        rank's pool has the same blocks."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.meta_group)
        return int(t.item())

    def barrier(self) -> None:
        """Wait for every rank over gloo, which sees a rank that died (NCCL would wait for it until its timeout)."""
        if self.size > 1:
            dist.barrier(group=self.meta_group)


SINGLE = Shard()
# torch >= 2.12 names the one-tensor all-gather all_gather_single (all_gather_into_tensor warns it is deprecated)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError, naming the numbers, unless ``size`` ranks can each hold whole query and KV heads and an equal
    slice of the MLP. Heads are never replicated to make a size fit."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    for what, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide {what} {n} of model {cfg.name}: each rank holds an "
                f"equal share; use a size that divides num_attention_heads {cfg.num_heads}, num_key_value_heads "
                f"{cfg.num_kv_heads} and intermediate_size {cfg.intermediate_size}")


def rank_device(device: str, rank: int) -> torch.device:
    """Where rank ``rank`` runs: ``cuda:rank`` on CUDA (no CUDA_VISIBLE_DEVICES per rank), else the CPU."""
    return torch.device("cuda", rank) if device == "cuda" else torch.device(device)


# ---- step messages -------------------------------------------------------------------------------------------
class Op(IntEnum):
    """What rank 0 asks of the other ranks: the first word of every step message."""

    STEP = 1  # an eager forward of a packed StepPlan (common/model_runner.py)
    GRAPH = 2  # a decode step replayed from a CUDA graph: the staged rows (common/cuda_graphs.py)
    SCORE = 3  # a scoring prefill on a scratch cache: the prompts
    STOP = 4  # leave the loop and exit


class StepChannel:
    """Rank 0's step messages to the other ranks of its host: a ring of ``_SLOTS`` slots in shared memory. Rank 0
    writes a slot, then the count of messages written; a reader polls that count, copies the slot and stores how
    many it has read. Rank 0 waits for the slowest reader only when the ring is full (``check`` raises there when a
    reader is gone). One writer, every other rank a reader."""

    def __init__(self, words: torch.Tensor, rank: int, size: int) -> None:
        arr = words.numpy()
        self.words = words  # keeps the shared memory mapped
        self.ctrl = arr[:_CTRL]
        self.slots = arr[_CTRL:].reshape(_SLOTS, 2 + _INLINE)
        self.rank, self.size = rank, size
        self.count = 0  # messages written (rank 0) or read (the others)
        self.last = time.monotonic()
        self.check: Any = None  # rank 0: raises RuntimeError when a reader has exited

    @staticmethod
    def allocate(size: int) -> torch.Tensor:
        if size > _CTRL:
            raise ValueError(f"the step channel serves at most {_CTRL} ranks, got {size}")
        return torch.zeros(_CTRL + _SLOTS * (2 + _INLINE), dtype=torch.int64).share_memory_()

    def _wait(self) -> None:
        if time.monotonic() - self.last > _SPIN_S:
            time.sleep(0.001)

    def send(self, op: Op, data: np.ndarray) -> None:
        """Rank 0: one message (its first ``_INLINE`` words; the caller sends the rest)."""
        while self.count - int(self.ctrl[1 : self.size].min()) >= _SLOTS:
            if self.check is not None:
                self.check()
            self._wait()
        slot = self.slots[self.count % _SLOTS]
        k = min(len(data), _INLINE)
        slot[0], slot[1] = int(op), len(data)
        slot[2 : 2 + k] = data[:k]
        self.count += 1
        self.ctrl[0] = self.count  # published after the slot's words
        self.last = time.monotonic()

    def recv(self) -> tuple[Op, int, np.ndarray]:
        """A reader: the next message's op, its length and its first ``_INLINE`` words (a copy)."""
        while int(self.ctrl[0]) <= self.count:
            self._wait()
        slot = self.slots[self.count % _SLOTS]
        op, n = Op(int(slot[0])), int(slot[1])
        words = slot[2 : 2 + min(n, _INLINE)].copy()
        self.count += 1
        self.ctrl[self.rank] = self.count
        self.last = time.monotonic()
        return op, n, words


def send_step(shard: Shard, op: Op, payload: Any = ()) -> None:
    """Rank 0: one message (integers: a list, array or tensor) to the other ranks: through the step channel, else a
    gloo broadcast; a message longer than ``_INLINE`` words sends its rest in a (second) broadcast."""
    data = torch.as_tensor(payload, dtype=torch.int64).reshape(-1)
    n = data.numel()
    if shard.steps is not None:
        shard.steps.send(op, data.numpy())
    else:
        buf = torch.empty(2 + _INLINE, dtype=torch.int64)
        buf[0], buf[1] = int(op), n
        k = min(n, _INLINE)
        buf[2 : 2 + k] = data[:k]
        dist.broadcast(buf, src=0, group=shard.meta_group)
    if n > _INLINE:
        dist.broadcast(data[_INLINE:].contiguous(), src=0, group=shard.meta_group)


def recv_step(shard: Shard) -> tuple[Op, torch.Tensor]:
    """A rank other than 0: wait for rank 0's next message; returns its op and its int64 payload."""
    if shard.steps is not None:
        op, n, words = shard.steps.recv()
        head = torch.from_numpy(words)
    else:
        buf = torch.empty(2 + _INLINE, dtype=torch.int64)
        dist.broadcast(buf, src=0, group=shard.meta_group)
        op, n = Op(int(buf[0])), int(buf[1])
        head = buf[2 : 2 + min(n, _INLINE)]
    if n <= _INLINE:
        return op, head
    rest = torch.empty(n - _INLINE, dtype=torch.int64)
    dist.broadcast(rest, src=0, group=shard.meta_group)
    return op, torch.cat([head, rest])


# ---- the group -----------------------------------------------------------------------------------------------
def _master_store(size: int) -> tuple[Any, int]:
    """Rank 0's rendezvous store on a free loopback port below the kernel's ephemeral range (32768 and up)."""
    last: Exception | None = None
    for _ in range(50):
        port = random.randrange(10000, 32768)
        try:
            store = dist.TCPStore("127.0.0.1", port, size, is_master=True, timeout=_JOIN_TIMEOUT,
                                  wait_for_workers=False)
            return store, port
        except (RuntimeError, OSError) as e:  # taken: another port
            last = e
    raise RuntimeError(f"no free loopback port for the tensor-parallel rendezvous: {last}")


def _join(rank: int, size: int, store: Any, device: str, all_reduce: str = "nccl",
          steps: torch.Tensor | None = None) -> Shard:
    """Join the default process group, make the gloo group of the step messages, the step channel on ``steps``
    (shared memory from ``StepChannel.allocate``) and, on CUDA with ``all_reduce`` "auto", the peer-to-peer
    all-reduce; returns this rank's Shard."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: it holds one "
                           "tensor-parallel engine at a time (close the other first)")
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    meta = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    p2p = None
    if device == "cuda" and all_reduce == "auto":
        from common.p2p_all_reduce import PeerAllReduce, peers_reachable

        if peers_reachable(size):  # the same answer on every rank, so all of them build it or none
            try:
                p2p = PeerAllReduce(rank, size, torch.device("cuda", rank), meta)
            except RuntimeError as e:
                log.warning("tensor-parallel all-reduces stay on NCCL: %s", e)
        elif rank == 0:
            log.warning("tensor-parallel all-reduces stay on NCCL: the GPUs cannot map each other's memory")
    channel = StepChannel(steps, rank, size) if steps is not None else None
    return Shard(rank, size, dist.group.WORLD, meta, p2p, channel)


@dataclass(frozen=True, slots=True)
class _RankArgs:
    """What a spawned rank needs to build its runner (all picklable)."""

    rank: int
    size: int
    port: int
    spec: str  # re-resolved there unless the weights are random (then the config is enough)
    model_cfg: ModelConfig
    random_weights: bool
    cfg: EngineConfig
    parent_pid: int
    threads: int
    steps: torch.Tensor | None  # the step channel's shared memory (None: gloo broadcasts)


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1: spawns them as daemon processes, joins the group with them (``shard`` is
    rank 0's), and stops them in ``close``. Raises ValueError for a size the model or the machine cannot take."""

    def __init__(self, source: ModelSource, cfg: EngineConfig) -> None:
        size = cfg.tensor_parallel_size
        check_divisible(source.config, size)
        if cfg.device == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} CUDA devices (rank r runs on cuda:r); torch "
                             f"sees {torch.cuda.device_count()}")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: it holds one "
                               "tensor-parallel engine at a time (close the other first)")
        # gloo carries data over its own sockets: keep them on loopback (the ranks are on this host)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store, port = _master_store(size)
        threads = max(1, torch.get_num_threads() // size) if cfg.device == "cpu" else torch.get_num_threads()
        steps = StepChannel.allocate(size) if _SHARED_STEPS else None
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(target=_rank_main, name=f"tokenmill-tp-rank-{r}", daemon=True,
                        args=(_RankArgs(r, size, port, source.spec, source.config, source.weights is None, cfg,
                                        os.getpid(), threads, steps),))
            for r in range(1, size)
        ]
        for p in self.procs:
            p.start()
        try:
            self.shard = _join(0, size, store, cfg.device, cfg.tp_all_reduce, steps)
        except BaseException:
            self._end_processes(0.0)
            raise
        if self.shard.steps is not None:
            self.shard.steps.check = self._check_ranks
        self._store = store  # the other ranks' rendezvous lives as long as the group
        self._closed = False
        if self.shard.p2p is not None:
            threading.Thread(target=self._exit_if_a_rank_dies, name="tp-rank-watch", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def close(self, timeout: float = 30.0) -> None:
        """Stop the other ranks (a STOP message; every rank then leaves the group at once) and wait for their exit;
        one still alive after ``timeout`` s is killed. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        healthy = all(p.is_alive() for p in self.procs)
        if healthy:
            try:
                send_step(self.shard, Op.STOP)
            except RuntimeError as e:  # a rank is gone: the others are ended below
                log.warning("tensor-parallel stop message failed: %s", e)
                healthy = False
        # NCCL's destroy waits for the other ranks' (seen on two GPUs: it never returned once they had exited), so
        # rank 0 leaves together with them, not after their exit; with a rank gone it aborts, which waits for no one
        if not _bounded(dist.destroy_process_group if healthy else _abort_group, timeout):
            log.warning("tensor-parallel group teardown did not finish in %.0f s; left to the process's exit", timeout)
        self._end_processes(timeout)
        if self.shard.p2p is not None:
            self.shard.p2p.close()

    def _check_ranks(self) -> None:
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel rank process {', '.join(dead)} exited")

    def _exit_if_a_rank_dies(self) -> None:
        """With the peer-to-peer all-reduce, rank 0's kernels would wait on the GPU forever for a rank that died:
        end this process instead (its supervisor restarts the worker)."""
        while not self._closed:
            for p in self.procs:
                if not p.is_alive() and not self._closed:
                    log.critical("tensor-parallel rank process %s exited (code %s); the GPU all-reduces would wait "
                                 "for it forever: ending this process", p.name, p.exitcode)
                    logging.shutdown()
                    os._exit(1)
            time.sleep(0.5)

    def _end_processes(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)


def _abort_group() -> None:
    """Leave the group without the other ranks: gloo groups are destroyed (local), NCCL communicators aborted."""
    if not dist.is_initialized():
        return
    if dist.get_backend() != "nccl":
        dist.destroy_process_group()
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    (abort or dist.destroy_process_group)()


def _bounded(fn: Any, timeout: float) -> bool:
    """Run ``fn`` on a daemon thread; whether it returned within ``timeout`` s (a teardown must not hang ``close``)."""
    if not dist.is_initialized():
        return True
    t = threading.Thread(target=fn, name="tp-teardown", daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def _exit_with_parent(parent_pid: int) -> None:
    """A rank whose engine process died exits too (its broadcast would also fail, but only once it is sent one)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def _rank_main(a: _RankArgs) -> None:
    """A spawned rank: join the group, load this rank's part of the model, then run what rank 0 sends until STOP."""
    from common.loader import ModelSource, load_model_source
    from common.model_runner import ModelRunner

    _exit_with_parent(a.parent_pid)
    torch.set_num_threads(a.threads)
    store = dist.TCPStore("127.0.0.1", a.port, a.size, is_master=False, timeout=_JOIN_TIMEOUT)
    shard = _join(a.rank, a.size, store, a.cfg.device, a.cfg.tp_all_reduce, a.steps)
    try:
        if a.random_weights:
            source = ModelSource(a.spec, a.model_cfg.name, a.model_cfg, None, None)
        else:
            source = load_model_source(a.spec)
            if source.config != a.model_cfg:
                raise RuntimeError(f"rank {a.rank}: model {a.spec!r} resolved to another config than rank 0's")
        runner = ModelRunner(source, a.cfg, shard=shard)
        while True:
            op, payload = recv_step(shard)
            if op is Op.STOP:
                break
            runner.follow(op, payload)
    except BaseException:
        # no teardown: NCCL's would wait for rank 0, which learns of this exit from its gloo group (or, inside an
        # NCCL collective, from the NCCL timeout)
        log.exception("tensor-parallel rank %d failed", a.rank)
        logging.shutdown()
        os._exit(1)
    dist.destroy_process_group()  # together with rank 0 (TensorParallelWorkers.close)
