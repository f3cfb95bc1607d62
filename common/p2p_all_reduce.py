"""A one-shot all-reduce over peer-to-peer GPU memory: tensor parallelism's per-layer sums at decode sizes.

A decode step of a TP=2 Llama-3.1-8B sums 64 tensors of 8 KiB–1 MiB across the ranks (two a layer), each followed
by the residual add and RMSNorm. On an NVLink pair of H200s NCCL's sum and the norm kernel take 8–16 µs, this
kernel with the norm fused in 5–13 µs (docs/benchmarks.md). Every rank maps the other ranks' buffers once (CUDA
IPC, with peer access over NVLink), and each all-reduce is one Triton kernel of ``NUM_PROGRAMS`` programs. Program
``p`` owns the chunks ``p``, ``p + NUM_PROGRAMS``, ... of the input, and:

1. pushes its chunks of this rank's input into this rank's slot of every peer's buffer (stores over NVLink);
2. raises its flag in every peer's buffer (a release store at system scope, after its threads' stores) and waits
   for the same program of every peer to raise its flag here (acquire);
3. sums the slots in rank order, this rank's own input in its place, so every rank gets the same bits.

No host sync and no data-dependent launch, so CUDA graphs capture it. Each flag carries a call count: every program
keeps its own count in device memory, and every rank makes the same calls in the same order (they run the same
forward), so the n-th call of a rank waits for the n-th call of the others, replayed from a graph or not. The calls
alternate between two halves of the buffer by the count's parity. A rank writes into a half again two calls later,
only after the peer's flag of the call in between, which the peer raises after it has read that half.

Split-K partials (float32 ``[S, T, N]``, common/triton_ops.py) are summed on their rank first and the result is
``[T, N]``: a rank sends one row set, not S. Every row-parallel output of the model feeds a residual add and an
RMSNorm; ``add_rms_norm`` does both in the same kernel, each program a row at a time.

Every kernel on the buffer launches all ``NUM_PROGRAMS`` programs and each of them counts every call, so all the
counts, and the half a call uses, stay equal whichever kernel ran and however it split its input: a rank's programs
write a half only after seeing the peers' flags of the call before, which the peers' next kernel can raise only
once their kernel of the call before that (the last reader of this half) has finished (one stream).

A rank that never reaches the call leaves the others' programs waiting; rank 0 of an engine ends its process when
another rank exits (common/tensor_parallel.py).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl

NUM_PROGRAMS = 32
BLOCK = 1024
# The largest input summed here: with the residual add and RMSNorm after it, the fused kernel beat NCCL + the norm
# kernel up to 1 MiB (0.63–0.79×) and lost at 4 MiB (1.31×) on two H200s (docs/benchmarks.md), so inputs over 2 MiB
# (bf16 [256, 4096], a prompt-carrying step's rows) go to NCCL. Each rank holds 2 halves × ranks × this, plus flags.
MAX_BYTES = 2 << 20
_ALIGN = 256


@triton.jit
def _rank_input(x_ptr, offs, m, n, PARTS: tl.constexpr):
    """This rank's values at ``offs`` in float32: the input, or the sum of its split-K parts in order."""
    if PARTS == 0:
        v = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    else:
        v = tl.zeros(offs.shape, tl.float32)
        for s in range(PARTS):
            v += tl.load(x_ptr + s * n + offs, mask=m, other=0.0).to(tl.float32)
    return v


@triton.jit
def _exchange(addrs_ptr, mine, pid, epoch, RANK: tl.constexpr, WORLD: tl.constexpr, FLAGS: tl.constexpr):
    """After this program's pushes: its flag raised in every peer's buffer (a release store at system scope, after
    every thread's stores), then every peer's same program's flag waited for here (acquire)."""
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        if r != RANK:
            flag = (tl.load(addrs_ptr + r) + FLAGS + (pid * WORLD + RANK) * 8).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
    for r in tl.static_range(WORLD):
        if r != RANK:
            flag = (mine + FLAGS + (pid * WORLD + r) * 8).to(tl.pointer_type(tl.int64))
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            while seen < epoch:
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    tl.debug_barrier()


@triton.jit
def _push(v, offs, m, addrs_ptr, half, RANK: tl.constexpr, WORLD: tl.constexpr, SLOT: tl.constexpr):
    """``v`` (this rank's values at ``offs``) into this rank's slot of every peer's buffer, this call's half."""
    for r in tl.static_range(WORLD):
        if r != RANK:
            dst = tl.multiple_of(tl.load(addrs_ptr + r) + half + RANK * SLOT, 16).to(tl.pointer_type(v.dtype))
            tl.store(dst + offs, v, mask=m)


@triton.jit
def _rank_sum(x_ptr, offs, m, n, mine, half, elt: tl.constexpr, PARTS: tl.constexpr, RANK: tl.constexpr,
              WORLD: tl.constexpr, SLOT: tl.constexpr):
    """The sum at ``offs`` over the ranks in rank order (float32), this rank's own values as it pushed them."""
    acc = tl.zeros(offs.shape, tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += _rank_input(x_ptr, offs, m, n, PARTS).to(elt).to(tl.float32)
        else:
            src = tl.multiple_of(mine + half + r * SLOT, 16).to(tl.pointer_type(elt))
            acc += tl.load(src + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    return acc


@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, n, addrs_ptr, counts_ptr, PARTS: tl.constexpr, RANK: tl.constexpr,
                     WORLD: tl.constexpr, SLOT: tl.constexpr, FLAGS: tl.constexpr, BLOCK: tl.constexpr,
                     NPROG: tl.constexpr):
    pid = tl.program_id(0)
    epoch = tl.load(counts_ptr + pid) + 1
    half = (epoch % 2) * (WORLD * SLOT)  # this call's half of every buffer, in bytes
    elt = out_ptr.dtype.element_ty
    mine = tl.load(addrs_ptr + RANK)
    for start in range(pid * BLOCK, n, NPROG * BLOCK):  # 1. this program's chunks to the peers
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        _push(_rank_input(x_ptr, offs, m, n, PARTS).to(elt), offs, m, addrs_ptr, half, RANK, WORLD, SLOT)
    _exchange(addrs_ptr, mine, pid, epoch, RANK, WORLD, FLAGS)  # 2. flags
    for start in range(pid * BLOCK, n, NPROG * BLOCK):  # 3. the sum in rank order
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        acc = _rank_sum(x_ptr, offs, m, n, mine, half, elt, PARTS, RANK, WORLD, SLOT)
        tl.store(out_ptr + offs, acc.to(elt), mask=m)
    tl.store(counts_ptr + pid, epoch)


@triton.jit
def _one_shot_add_norm_kernel(d_ptr, x_ptr, w_ptr, h_ptr, t, n, eps, addrs_ptr, counts_ptr, PARTS: tl.constexpr,
                              RANK: tl.constexpr, WORLD: tl.constexpr, SLOT: tl.constexpr, FLAGS: tl.constexpr,
                              BLOCK_N: tl.constexpr, NPROG: tl.constexpr):
    """The all-reduce of ``d`` by rows, each summed row then added to the residual ``x`` (in place) and normed into
    ``h``: ``common/triton_ops.add_rms_norm(x, all_reduce(d), w, eps)`` in one kernel, with its rounding."""
    pid = tl.program_id(0)
    epoch = tl.load(counts_ptr + pid) + 1
    half = (epoch % 2) * (WORLD * SLOT)
    elt = d_ptr.dtype.element_ty  # the sum travels, and is rounded, in the delta's dtype
    mine = tl.load(addrs_ptr + RANK)
    cols = tl.arange(0, BLOCK_N)
    cm = cols < n
    total = t * n
    for row in range(pid, t, NPROG):
        offs = row * n + cols
        _push(_rank_input(d_ptr, offs, cm, total, PARTS).to(elt), offs, cm, addrs_ptr, half, RANK, WORLD, SLOT)
    _exchange(addrs_ptr, mine, pid, epoch, RANK, WORLD, FLAGS)
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    for row in range(pid, t, NPROG):
        offs = row * n + cols
        d = _rank_sum(d_ptr, offs, cm, total, mine, half, elt, PARTS, RANK, WORLD, SLOT).to(elt).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=cm, other=0.0)
        x = (x.to(tl.float32) + d).to(x.dtype)
        tl.store(x_ptr + offs, x, mask=cm)
        xf = x.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
        normed = (xf * r).to(x.dtype).to(tl.float32)
        tl.store(h_ptr + offs, (w * normed).to(h_ptr.dtype.element_ty), mask=cm)
    tl.store(counts_ptr + pid, epoch)


def launch(x: torch.Tensor, out: torch.Tensor, addrs: torch.Tensor, counts: torch.Tensor, rank: int, world: int,
           slot_bytes: int, parts: int) -> None:
    """One call of the all-reduce on raw buffers (``addrs``: every rank's buffer address as seen from this rank,
    int64 on this rank's device; ``counts``: this rank's NUM_PROGRAMS int64 call counts). ``out`` is ``[T, N]``;
    ``x`` is ``out`` itself (summed in place) or ``parts`` split-K parts ``[parts, T, N]``."""
    _one_shot_kernel[(NUM_PROGRAMS,)](
        x, out, out.numel(), addrs, counts, PARTS=parts, RANK=rank, WORLD=world, SLOT=slot_bytes,
        FLAGS=2 * world * slot_bytes, BLOCK=BLOCK, NPROG=NUM_PROGRAMS, num_warps=4,
    )


def launch_add_norm(d: torch.Tensor, x: torch.Tensor, w: torch.Tensor, h: torch.Tensor, eps: float,
                    addrs: torch.Tensor, counts: torch.Tensor, rank: int, world: int, slot_bytes: int,
                    parts: int) -> None:
    """One call of the all-reduce fused with add + RMSNorm on raw buffers (as :func:`launch`): ``x += sum(d)``
    in place, ``h = RMSNorm(x) * w``; ``d`` is ``[T, N]`` or ``parts`` split-K parts ``[parts, T, N]``."""
    t, n = x.shape
    block = triton.next_power_of_2(n)
    _one_shot_add_norm_kernel[(NUM_PROGRAMS,)](
        d, x, w, h, t, n, eps, addrs, counts, PARTS=parts, RANK=rank, WORLD=world, SLOT=slot_bytes,
        FLAGS=2 * world * slot_bytes, BLOCK_N=block, NPROG=NUM_PROGRAMS, num_warps=8 if block >= 2048 else 4,
    )


def buffer_bytes(world: int, max_bytes: int = MAX_BYTES) -> tuple[int, int]:
    """(slot bytes, whole buffer bytes) of a rank's buffer: 2 halves × ``world`` slots, then the flags
    (NUM_PROGRAMS × world int64)."""
    slot = -(-max_bytes // _ALIGN) * _ALIGN
    return slot, 2 * world * slot + NUM_PROGRAMS * world * 8


# ---- CUDA IPC through the driver API ----------------------------------------------------------------------------
class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # bytes, NULs included (a c_char array would stop at one)


_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_libcuda: Any = None


def _cuda() -> Any:
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.c_uint64]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _libcuda = lib
    return _libcuda


def _check(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _cuda().cuGetErrorString(result, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {result} ({(msg.value or b'?').decode()})")


def _export(ptr: int) -> tuple[bytes, int]:
    """An IPC handle of the allocation holding ``ptr``, and ``ptr``'s offset in it."""
    lib = _cuda()
    handle = _IpcHandle()
    _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), ptr), "cuIpcGetMemHandle")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
    return bytes(handle.reserved), ptr - base.value


def _open(handle: bytes) -> int:
    """Map another process's allocation into this one's current device; its base address here."""
    h = _IpcHandle.from_buffer_copy(handle)
    ptr = ctypes.c_uint64()
    _check(_cuda().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
           "cuIpcOpenMemHandle")
    return ptr.value


def peers_reachable(world: int) -> bool:
    """Whether every pair of ``cuda:0`` … ``cuda:world-1`` can map each other's memory."""
    if torch.cuda.device_count() < world:
        return False
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(world) for b in range(world) if a != b)


class PeerAllReduce:
    """This rank's side of the one-shot all-reduce: its buffer, the peers' buffers mapped here, and its call counts.

    Built by every rank of the group at once (the handles travel over ``meta_group``, gloo); raises RuntimeError on
    every rank when any rank could not map a peer's buffer (the caller then keeps NCCL)."""

    def __init__(self, rank: int, world: int, device: torch.device, meta_group: Any,
                 max_bytes: int = MAX_BYTES) -> None:
        self.rank, self.world, self.max_bytes = rank, world, max_bytes
        self.slot, total = buffer_bytes(world, max_bytes)
        self.buf = torch.zeros(total, dtype=torch.uint8, device=device)
        self.counts = torch.zeros(NUM_PROGRAMS, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)  # the zeroed flags are in memory before any peer can raise one
        self._mapped: list[int] = []
        error = ""
        try:
            mine = _export(self.buf.data_ptr())
        except RuntimeError as e:
            mine, error = (b"", 0), str(e)
        handles: list[Any] = [None] * world
        dist.all_gather_object(handles, mine, group=meta_group)
        addrs = []
        for r, (handle, offset) in enumerate(handles):
            if r == rank:
                addrs.append(self.buf.data_ptr())
            elif not error and handle:
                try:
                    base = _open(handle)
                    self._mapped.append(base)
                    addrs.append(base + offset)
                except RuntimeError as e:
                    error = str(e)
            elif not error:
                error = f"rank {r} could not export its buffer"
        errors: list[Any] = [None] * world
        dist.all_gather_object(errors, error, group=meta_group)
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if failed:
            self.close()
            raise RuntimeError("peer-to-peer all-reduce unavailable: " + "; ".join(failed))
        self.addrs = torch.tensor(addrs, dtype=torch.int64, device=device)
        dist.barrier(group=meta_group)  # every rank has mapped every buffer before any call

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (or, for split-K parts, one part) fits a slot."""
        one = x[0] if x.dim() == 3 else x
        return x.is_contiguous() and one.numel() * one.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of ``x`` (in place, returned), or of split-K parts ``[S, T, N]`` (a new
        ``[T, N]``). Where :meth:`fits` ``x``."""
        self._require_fit(x)
        if x.dim() == 3:
            out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
            launch(x, out, self.addrs, self.counts, self.rank, self.world, self.slot, x.shape[0])
            return out
        launch(x, x, self.addrs, self.counts, self.rank, self.world, self.slot, 0)
        return x

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``triton_ops.add_rms_norm(x, self(delta), weight, eps)`` in one kernel: ``x`` (contiguous ``[T, N]``)
        gets the sum over the ranks of ``delta`` (``[T, N]``, or split-K parts ``[S, T, N]``) added in place;
        returns RMSNorm(x) · weight. Where :meth:`fits` ``delta``."""
        self._require_fit(delta)
        h = torch.empty_like(x)
        if x.shape[0]:
            launch_add_norm(delta, x, weight, h, eps, self.addrs, self.counts, self.rank, self.world, self.slot,
                            delta.shape[0] if delta.dim() == 3 else 0)
        return h

    def _require_fit(self, x: torch.Tensor) -> None:
        if not self.fits(x):
            raise ValueError(f"the peer-to-peer all-reduce takes contiguous inputs of at most {self.max_bytes} bytes "
                             f"(a part, for split-K parts); got {tuple(x.shape)} {x.dtype}")

    def close(self) -> None:
        lib = _cuda()
        for base in self._mapped:
            lib.cuIpcCloseMemHandle(base)
        self._mapped = []
