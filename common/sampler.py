"""The batched sampler: one pass of batched tensor ops over a step's logits, on the logits' device.

Every row's randomness is ONE uniform number, a pure function of (request seed, output position) through a
counter-based hash (splitmix64), and the pick is the inverse CDF of the row's final distribution taken in
vocabulary order. So a row's token depends only on its own logits, seed and position: the same alone, in any
batch, after preemption. A batch takes the top-k candidate path when every sampled row has a top_k (up to
``_CANDIDATE_CAP``), the whole-vocabulary kernel when no row has one, with no sort (on a GPU Triton kernels summing
by segments of the vocabulary, ``triton_ops.pick_full``; on the CPU one C++ function summing by blocks in double,
``cpu_kernels.pick_rows``), and PyTorch's full-vocabulary ops when it mixes both (a sort for top-p; on the CPU only
of the rows whose nucleus is wider than their top candidates). On the CPU the candidate path and PyTorch's
full-vocabulary ops sum the same probabilities in the same vocabulary order; the whole-vocabulary kernels sum them
in other orders, so a row's token can differ between batches that take different paths only where its uniform
number lies within rounding of a boundary between two tokens. Requests without a seed get one drawn at arrival by
the engine, so every row draws the same way and no device generator is needed.

Penalties read per-request state kept on the device (:class:`Sampler` slots): the distinct tokens a request has
seen and how often each came out; penalizing touches those tokens only. The pick folds its own tokens into that
state on the device, so a decoding row costs the host nothing there; a slot is built from the row's token ids
when it is new, and rebuilt whenever the host's count of its outputs disagrees with the row's, so a slot lost or
evicted is only a rebuild, never a wrong answer. On CUDA the penalties, the fold and the pick (among top-k candidates,
or over the whole vocabulary with no sort: ``pick_full``) are Triton kernels (``common/triton_ops.py``); the CPU
runs the same steps as PyTorch ops, but for the pick over the whole vocabulary, a C++ kernel
(``cpu_kernels.pick_rows``) where the CPU kernels compiled.

A constrained row (structured outputs) carries its grammar matcher, and its allowed tokens are a row of int32 words
in the grammar mask table, in host memory (``common/structured.py``: filled by the grammar mask process or inline).
They are applied to the constrained rows only, after the penalties and before temperature, top-k/p and the pick,
so no path (greedy or sampled) can pick a token the grammar disallows (on the CPU as a 0 / -inf bias unpacked
with one gather). On the CPU's all-greedy fast path the argmax is checked against the masks first and only rows
whose argmax is disallowed are picked again, by one pass of the C++ kernel that takes the argmax over the allowed
tokens (``cpu_kernels.masked_argmax_rows``). On a GPU nothing is copied: the table is registered with CUDA and
the kernels read each row's mask in place, over PCIe, through a small index (each row's row of the table, -1 for
none) in registered memory too. The host does not wait for the grammar mask process either: the kernels are
queued behind a wait on the device (``triton_ops.wait_masks``) until the mask process's answered batch, a word of
the same memory, reaches the one the rows need. One Triton kernel sets the disallowed logits to -inf (``common/triton_ops.py``),
as a node of the pick's CUDA graph (:class:`_PickGraphs`); an all-greedy batch takes one kernel instead, each
row's argmax over its allowed tokens (on an H200's host its launch cost less than a graph's loads and replay). Rows
without a constraint keep their logits.

One device→host copy per step returns the picked ids (and the asked logprobs with them). ``Sampler.launch`` queues
the pick and that copy and returns at once (:class:`PendingSample`): the picked ids stay on the device too, where
the engine's next step reads its input ids from them before the host has seen them (async scheduling,
``common/engine.py``); ``Sampler.sample`` waits for the copy.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from common import cpu_kernels
from common.grammar_proc import READY_BYTES
from common.sampling import SamplingParams
from common.structured import GrammarMatcher, MaskTable

log = logging.getLogger(__name__)

_MASK = float("-inf")
_M64 = (1 << 64) - 1
# top-k at most this large is sampled among the top-k candidates only; a larger k (or none) takes the full vocabulary
_CANDIDATE_CAP = 1024
# columns of the per-step parameter tensor
_TEMP, _TOPK, _TOPP, _MINP, _REP, _PRES, _FREQ, _U, _SLOT, _GREEDY = range(10)
_U_MAX = 1.0 - 2.0**-23  # u × total stays below total in float32: the pick never runs off the end
# a padding row of a CUDA graph's parameter table: greedy, no penalties, slot 0
_PAD_ROW = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
_GRAPH_MAX_ROWS = 1024
_PAD_TABLE = np.tile(np.asarray(_PAD_ROW, dtype=np.float32), (_GRAPH_MAX_ROWS, 1))
_PACK_WORDS = len(_PAD_ROW) // 2 + 2  # a graph's row as int64 words: the table's float32 columns, the seed hash, the position


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one row. ``key`` (the request id) lets the sampler keep the row's
    token counts on the device across steps; without one, they are rebuilt for this call."""

    params: SamplingParams
    seed: int  # the request's seed (drawn at arrival when the request gave none)
    position: int  # index of the token being sampled among the outputs
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    eos_ids: tuple[int, ...]
    key: str | None = None
    grammar: GrammarMatcher | None = None  # a constrained row: only the tokens its matcher allows


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # per row: (sampled logprob, [(token id, logprob) × top-n]) or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class PendingSample:
    """A step's picks, queued on the logits' device: ``tokens`` ([rows] int64 there) can feed the next step before
    the host reads them; :meth:`result` waits for the step's one device→host copy and decodes it."""

    __slots__ = ("_decode", "_event", "_flat", "_result", "tokens")

    def __init__(self, tokens: torch.Tensor, flat: torch.Tensor | None = None, event: torch.cuda.Event | None = None,
                 decode: Any = None, result: SampleResult | None = None) -> None:
        self.tokens = tokens
        self._flat, self._event, self._decode, self._result = flat, event, decode, result

    def result(self) -> SampleResult:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            assert self._flat is not None
            self._result = self._decode(self._flat.tolist())
            self._flat = None
        return self._result


class _Readback:
    """The per-step device→host copy into pinned memory, queued (``non_blocking``) with an event to wait on. Two
    buffers per dtype, used in turn: a step's copy is read (``PendingSample.result``) before the step after the
    next one launches its own."""

    def __init__(self) -> None:
        self._bufs: dict[torch.dtype, list[tuple[torch.Tensor, torch.cuda.Event]]] = {}
        self._turn = 0

    def __call__(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if flat.device.type != "cuda":
            return flat, None
        bufs = self._bufs.setdefault(flat.dtype, [])
        self._turn ^= 1
        n = flat.numel()
        while len(bufs) < 2:
            bufs.append((torch.empty(0, dtype=flat.dtype, pin_memory=True), torch.cuda.Event()))
        buf, event = bufs[self._turn]
        if buf.numel() < n:
            buf = torch.empty(max(n, 256), dtype=flat.dtype, pin_memory=True)
            bufs[self._turn] = (buf, event)
        host = buf[:n]
        host.copy_(flat, non_blocking=True)
        record(event)
        return host, event


def record(event: torch.cuda.Event) -> None:
    """``event.record()`` on the current stream of the current device, asked for directly: without a stream, torch
    finds it through a dozen Python calls (a CUDA availability check and an environment read among them), every
    time; a step records several events."""
    event.record(torch.cuda.current_stream(torch.cuda.current_device()))


def _mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def row_uniform(seed: int, position: int) -> float:
    """The row's uniform draw in [0, 1): 24 bits, exact in float32, from splitmix64 over (seed, position)."""
    return _uniform(_mix64(seed & _M64), position)


def _uniform(seed_hash: int, position: int) -> float:
    return (_mix64(seed_hash ^ (position & _M64)) >> 40) * 2.0**-24


def _uniforms(seed_hashes: list[int], positions: list[int]) -> np.ndarray:
    """``_uniform`` of each (seed hash, position), as float64: the same splitmix64, in numpy's wrapping uint64."""
    z = np.array(seed_hashes, dtype=np.uint64) ^ np.array(positions, dtype=np.uint64)
    z += np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(40)).astype(np.float64) * 2.0**-24


def _argmax(x: torch.Tensor) -> list[int]:
    """Row-wise argmax, first index on ties; the C++ kernel on the CPU (torch's took 1 ms for 32 rows of 49,152)."""
    if x.device.type == "cpu" and cpu_kernels.available():
        return cpu_kernels.argmax_rows(x).tolist()
    return x.argmax(dim=-1).tolist()


_CUDA_OPS: dict[str, Any] = {}


def _cuda_ops(dev: torch.device) -> Any:
    """``common.triton_ops`` (the grammar masks' and the pick's kernels) on a CUDA device, else None."""
    if dev.type != "cuda":
        return None
    if "ops" not in _CUDA_OPS:
        try:
            from common import triton_ops
        except ImportError:  # no Triton: the portable bias path
            triton_ops = None  # type: ignore[assignment]
        _CUDA_OPS["ops"] = triton_ops
    return _CUDA_OPS["ops"]


def _plain_greedy(r: SampleRow) -> bool:
    """Greedy with nothing that reads or changes the logits first: the pick is the argmax of the raw logits."""
    p = r.params
    return (
        p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.logit_bias
        and not ((p.presence_penalty or p.frequency_penalty) and r.output_ids)
        and len(r.output_ids) >= p.min_tokens
    )


def _needs_counts(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


_NUMPY_DTYPES = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32}


def _host_tensor(data: Any, dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on the host, through numpy where it can (2.5x faster for a step's table
    of 64 rows)."""
    nd = _NUMPY_DTYPES.get(dtype)
    return torch.tensor(data, dtype=dtype) if nd is None else torch.from_numpy(np.asarray(data, dtype=nd))


class PinnedUploads:
    """Small per-step host → device copies (the sampler's, the engine's token feed), through pinned buffers on CUDA: a copy from pageable
    memory waits for everything queued on the stream first (the step's forward), so the sampler's host work could
    not overlap the forward; from pinned memory it is queued like a kernel. A buffer is reused once the copy out of
    it has been done (an event per buffer; the step's token read has waited for it already)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._bufs: dict[str, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def tensor(self, name: str, data: Any, dtype: torch.dtype) -> torch.Tensor:
        """``torch.tensor(data, dtype=dtype)`` on the device."""
        t = _host_tensor(data, dtype)
        if not self.pinned:
            return t.to(self.device)
        stage, done = self._stage(name, t)
        out = stage.to(self.device, non_blocking=True)
        record(done)
        return out

    def copy_into(self, name: str, data: Any, dst: torch.Tensor) -> None:
        """``dst.copy_(torch.tensor(data))``, queued from a pinned buffer on CUDA."""
        t = _host_tensor(data, dst.dtype)
        if not self.pinned:
            dst.copy_(t)
            return
        stage, done = self._stage(name, t)
        dst.view(-1).copy_(stage.view(-1), non_blocking=True)
        record(done)

    def _stage(self, name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """``t`` copied into the pinned buffer ``name`` (grown when too small, else first waited for: the last copy
        out of it is done), and the buffer's event, to record once the copy out of it is queued."""
        n = t.numel()
        got = self._bufs.get(name)
        if got is None or got[0].numel() < n or got[0].dtype != t.dtype:
            size = max(n, 2 * got[0].numel() if got is not None else 256)
            got = self._bufs[name] = (torch.empty(size, dtype=t.dtype, pin_memory=True), torch.cuda.Event())
        else:
            got[1].synchronize()
        buf, done = got
        stage = buf[:n].view(t.shape)
        stage.copy_(t)
        return stage, done


class _Slots:
    """Per-request penalty state on the device, sparse: a slot's row of ``ids`` holds the distinct tokens the
    request has seen (prompt ∪ outputs), one column each, ``counts`` how often each came out, and ``nseen`` how
    many columns are its own; the columns past them repeat its column 0 with count 0. A step gathers and scatters
    only those columns, never a pass over the vocabulary. The pick folds each row's token into its slot on the
    device (:func:`_fold`), so a step costs the host no write. A slot is rebuilt from the row's token ids (all of a
    step's in one copy) when it is new, or when the host's count of its outputs disagrees with the row's. Slot 0
    holds nothing: rows without penalties read it (their factors leave the logits as they are)."""

    def __init__(self, vocab: int, device: torch.device, capacity: int, uploads: PinnedUploads, width: int = 1024) -> None:
        self.vocab, self.device, self.uploads = vocab, device, uploads
        self.ids = torch.zeros(capacity + 1, width, dtype=torch.long, device=device)
        self.counts = torch.zeros(capacity + 1, width, dtype=torch.float32, device=device)
        self.nseen = torch.zeros(capacity + 1, dtype=torch.long, device=device)
        self.free = list(range(capacity, 0, -1))
        self.by_key: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.counted: dict[int, int] = {}  # slot → outputs in its counts (-1: to be rebuilt)
        self.bound: dict[int, int] = {}  # slot → at least its nseen: distinct tokens at its rebuild + tokens folded since
        self._rebuilds: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # slot → (distinct ids, their output counts)
        self.rebuilt = 0  # slots rebuilt from token ids, ever

    def _grow(self, rows: int, width: int) -> None:
        """Room for ``rows`` slots and ``width`` columns. The width at least doubles when it grows: a row gains a
        column with each new distinct token, and a copy of the tables every step would cost more than the step's
        penalties."""
        r, w = self.ids.shape
        if rows <= r and width <= w:
            return
        r2, w2 = max(r, rows), (max(width, 2 * w) if width > w else w)
        ids = self.ids.new_zeros(r2, w2)
        counts = self.counts.new_zeros(r2, w2)
        nseen = self.nseen.new_zeros(r2)
        ids[:r, :w], counts[:r, :w], nseen[:r] = self.ids, self.counts, self.nseen
        ids[:, w:] = ids[:, :1]
        self.ids, self.counts, self.nseen = ids, counts, nseen

    def acquire(self, key: str | None, in_use: set[int]) -> int:
        """The slot of ``key`` (None: a fresh one for this call), evicting the least recently used slot that this
        step does not use when none is free."""
        if key is not None and key in self.by_key:
            self.by_key.move_to_end(key)
            return self.by_key[key]
        if not self.free:
            victim = next((k for k, s in self.by_key.items() if s not in in_use), None)
            if victim is None:
                old = self.ids.shape[0]
                self._grow(2 * old, 0)
                self.free.extend(range(2 * old - 1, old - 1, -1))
            else:
                self.release(victim)
        slot = self.free.pop()
        self.counted[slot] = -1  # not built yet
        self.bound[slot] = 0
        if key is not None:
            self.by_key[key] = slot
        return slot

    def release(self, key: str) -> None:
        slot = self.by_key.pop(key, None)
        if slot is not None:
            self.drop(slot)

    def drop(self, slot: int) -> None:
        self.counted.pop(slot, None)
        self.bound.pop(slot, None)
        self._rebuilds.pop(slot, None)
        self.free.append(slot)

    def sync(self, slot: int, row: SampleRow) -> None:
        """Bring the slot up to the row's token ids: a rebuild, queued for :meth:`flush`, unless its counts hold
        the row's outputs already."""
        n = len(row.output_ids)
        if self.counted[slot] == n:
            return
        tokens = np.concatenate((np.asarray(row.prompt_ids, dtype=np.int64), np.asarray(row.output_ids, dtype=np.int64)))
        ids = _distinct(tokens[(tokens >= 0) & (tokens < self.vocab)])  # prompt ids past the sampled vocabulary: no logit
        outs = tokens[len(tokens) - n :]
        outs = outs[(outs >= 0) & (outs < self.vocab)]
        counts = np.bincount(np.searchsorted(ids, outs), minlength=len(ids)).astype(np.float32)
        self._rebuilds[slot] = (ids, counts)
        self.rebuilt += 1
        self.counted[slot], self.bound[slot] = n, len(ids)

    def seen(self, slot: int) -> int:
        return self.bound.get(slot, 0)

    def flush(self, width: int) -> None:
        """Room for ``width`` columns; the step's rebuilt slots written to the device in one copy."""
        need = max([width, *(len(ids) for ids, _ in self._rebuilds.values())])
        self._grow(0, need)
        if not self._rebuilds:
            return
        w = self.ids.shape[1]
        # a row: slot, its distinct tokens' count m, ids (the columns past m repeat column 0), counts; float32 holds
        # every token id exactly (< 2^24)
        packed = np.zeros((len(self._rebuilds), 2 + 2 * w), dtype=np.float32)
        for i, (slot, (ids, counts)) in enumerate(self._rebuilds.items()):
            m = len(ids)
            packed[i, 0], packed[i, 1] = slot, m
            if m:
                packed[i, 2 : 2 + m], packed[i, 2 + m : 2 + w] = ids, ids[0]
                packed[i, 2 + w : 2 + w + m] = counts
        self._rebuilds.clear()
        p = self.uploads.tensor("rebuilds", packed, torch.float32)
        s = p[:, 0].long()
        self.ids[s] = p[:, 2 : 2 + w].long()
        self.counts[s] = p[:, 2 + w :]
        self.nseen[s] = p[:, 1].long()

    def folded(self, slots: list[int], on_device: bool) -> None:
        """The pick just queued folded its tokens into ``slots`` (``on_device``), or did not: rebuilt next time. A
        slot that had seen nothing is rebuilt too: its columns past the first do not repeat the folded token yet. On
        the CPU the fold has run already and its column counts are read back (the portable penalties read ``bound``
        columns); on a GPU ``bound`` grows by one a pick (it only sizes the tables: the kernels read ``nseen``)."""
        exact = self.nseen.tolist() if on_device and slots and self.nseen.device.type == "cpu" else None
        for slot in slots:
            if on_device and self.bound[slot]:
                self.counted[slot] += 1
                self.bound[slot] = exact[slot] if exact is not None else self.bound[slot] + 1
            else:
                self.counted[slot] = -1


def _distinct(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)``, without its general machinery (20x faster on a 1,024-token prompt)."""
    a = np.sort(a)
    if len(a) > 1:
        a = a[np.concatenate(([True], a[1:] != a[:-1]))]
    return a


def _fold(slots: _Slots, prm: torch.Tensor, tok: torch.Tensor, width: int) -> None:
    """Each row's picked token into its slot, on the device: a new column, or one more count of a column it has.
    Rows of slot 0 (no penalties, padding) write nothing there."""
    ops = _cuda_ops(tok.device)
    if ops is not None:  # one kernel
        ops.fold_(tok, prm, slots.ids, slots.counts, slots.nseen, _SLOT)
        return
    slot_t = prm[:, _SLOT].long()
    seen = slots.ids[:, :width].index_select(0, slot_t) == tok.unsqueeze(1)
    found = seen.any(dim=1)
    col = torch.where(found, seen.to(torch.uint8).argmax(dim=1), slots.nseen.index_select(0, slot_t))
    live = slot_t > 0
    flat = slot_t * slots.ids.shape[1] + col.clamp_(max=width - 1)
    slots.ids.view(-1).index_put_((flat,), torch.where(live, tok, 0))
    slots.counts.view(-1).index_put_((flat,), live.float(), accumulate=True)
    slots.nseen.index_put_((slot_t,), (live & ~found).long(), accumulate=True)


class _Workspace:
    """[rows, vocab] buffers reused from step to step. Fresh ones would cost more than the arithmetic on the CPU,
    where each large allocation is new (huge) pages for the kernel to fault in and zero."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[str, torch.Tensor] = {}

    def rank(self, k: int) -> torch.Tensor:
        """[1, k]: 0, 1, …, k − 1."""
        r = self._bufs.get("rank")
        if r is None or r.numel() < k:
            r = self._bufs["rank"] = torch.arange(max(k, 64), dtype=torch.float32, device=self.device)
        return r[:k].unsqueeze(0)

    def get(self, name: str, n: int, v: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n * v:
            buf = self._bufs[name] = torch.empty(n * v, dtype=dtype, device=self.device)
        return buf[: n * v].view(n, v)


class _Fresh(_Workspace):
    """A workspace that allocates every buffer anew: inside a CUDA graph's capture, where buffers come from the
    graph's own memory pool and must not be kept for eager steps."""

    def rank(self, k: int) -> torch.Tensor:
        return torch.arange(k, dtype=torch.float32, device=self.device).unsqueeze(0)

    def get(self, name: str, n: int, v: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(n, v, dtype=dtype, device=self.device)


@dataclass(frozen=True, slots=True)
class _GraphKey:
    """What a captured pick depends on besides its inputs' values: rows (padded), the kept tables' width, and the
    stages the rows need (``_pick`` reads the last five)."""

    rows: int
    width: int
    any_rep: bool
    any_freq_pres: bool
    any_greedy: bool
    any_sampled: bool
    candidates: int
    any_top_p: bool
    any_min_p: bool
    top_k: int  # the full-vocabulary path's largest top-k (0: none)
    masked: bool = False  # grammar masks applied (after the penalties), every row's from the graph's mask table

    @property
    def top_ks(self) -> list[int]:
        return [self.top_k]


class _PickGraphs:
    """The processed pick on CUDA as graphs: penalties from the kept tables, temperature, top-k/p, min-p, the
    inverse-CDF pick, the greedy rows' argmax and the fold of the picks into the kept tables, kernels whose launches
    one by one would cost the host more than they cost the GPU. One graph per
    :class:`_GraphKey`, captured the first time it is needed; rows padded to a power of two (at least 8) with
    greedy rows. A step with grammar masks waits on the device for the mask process's answer, then reads the masks
    in place from the host's mask table, through the index of each row's row of it (-1, left as it is: a row
    without a constraint, and the padding).
    A step with logit_bias, min_tokens bans or logprobs runs eagerly, as does one whose capture failed. The graphs
    read and write the kept tables in place: a table that grew is a new one, and the graphs are captured again."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.graphs: dict[_GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failed: set[_GraphKey] = set()
        self.pool: Any = None
        self.x: torch.Tensor | None = None  # [rows, vocab] float32: the logits a replay reads
        # [rows, 7] int64: what a replay reads of its rows, uploaded in one copy: the parameter table (float32, its
        # ten columns in the first five words, ``prm``), then each row's seed hash and its position less the tick
        # (``seeds``), from which the replay draws the row's uniform number into the table (``_body``)
        self.pack: torch.Tensor | None = None
        self.prm: torch.Tensor | None = None
        self.seeds: torch.Tensor | None = None
        self.tick: torch.Tensor | None = None  # [1] int64: the replays that drew uniforms, counted on the device
        self.ticks = 0  # the same count on the host
        self._sent = b""  # the rows last uploaded into ``pack``: a steady batch's are the same, and not sent again
        self.uploads_skipped = 0
        # the uniforms drawn on the device (Triton's kernel); without Triton the host's go up with the table
        self.device_uniforms = _cuda_ops(sampler._ws.device) is not None
        self.tables: tuple[torch.Tensor, ...] | None = None  # the kept tables the graphs read and write
        # what a masked replay reads in place, in host memory (Sampler._device_masks), every index row
        self.mask_src: _DeviceMasks | None = None
        self.captures = 0
        self.replays = 0

    def key(self, spec: _StepSpec, n: int, masked: bool = False) -> _GraphKey | None:
        if spec.bias or spec.bans or spec.lp_rows or n > _GRAPH_MAX_ROWS:
            return None
        full_k = 0 if spec.candidates or not any(spec.top_ks) else max(spec.top_ks)
        return _GraphKey(max(8, 1 << (n - 1).bit_length()), self.sampler._slots.ids.shape[1] if spec.count_rows else 0,
                         spec.any_rep, spec.any_freq_pres, spec.any_greedy, spec.any_sampled, spec.candidates,
                         spec.any_top_p, spec.any_min_p, full_k, masked)

    def run(self, logits: torch.Tensor, spec: _StepSpec, constrained: list[SampleRow] | None = None
            ) -> torch.Tensor | None:
        """The picks of ``logits``' rows ([n] int64, a copy), or None where this step runs eagerly.
        ``constrained``: the step's rows when some are constrained (their masks are filled here, once the step is
        known to replay)."""
        n = logits.shape[0]
        key = self.key(spec, n, constrained is not None)
        if key is None or key in self.failed:
            return None
        if constrained is not None:
            src = self.sampler._device_masks(constrained, key.rows)
            if src is None:
                return None
            if self.mask_src is None or src.table is not self.mask_src.table:  # one tensor for every row count
                self.graphs = {k: g for k, g in self.graphs.items() if not k.masked}  # they read the old ones
                assert not isinstance(self.sampler._table, bool) and self.sampler._table is not None
                self.mask_src = self.sampler._table[1]
        slots = self.sampler._slots
        if self.tables is None or any(a is not b for a, b in zip(self.tables, (slots.ids, slots.counts, slots.nseen))):
            self.graphs.clear()  # the tables grew: the graphs read the old ones
            self.tables = (slots.ids, slots.counts, slots.nseen)
        if self.x is None or self.x.shape[0] < key.rows:
            rows = max(key.rows, 64)
            self.graphs.clear()
            self.x = torch.zeros(rows, logits.shape[1], dtype=torch.float32, device=logits.device)
            self.pack = torch.zeros(rows, _PACK_WORDS, dtype=torch.int64, device=logits.device)
            self.prm = self.pack[:, : _PACK_WORDS - 2].view(torch.float32)
            self.seeds = self.pack[:, _PACK_WORDS - 2 :]
            self._sent = b""
            if self.tick is None:
                self.tick = torch.zeros(1, dtype=torch.int64, device=logits.device)
        assert self.pack is not None
        self._load(logits, key.rows)
        self._upload(spec, key.rows)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(key)
            if entry is None:
                return None
            self._load(logits, key.rows)  # the capture's warm-up ran the pick in place
        graph, out = entry
        graph.replay()
        if key.any_sampled and self.device_uniforms:
            self.ticks += 1  # the replay drew its uniforms, and advanced the device's tick
        if constrained is not None:
            self.sampler._masks_read()
        self.replays += 1
        return out[:n].clone()

    def _upload(self, spec: _StepSpec, rows: int) -> None:
        """The step's rows into ``pack`` (padded to ``rows``), unless it holds them already: a row's entry changes
        when its parameters, its slot or its place in the batch do, not when its position moves on by a step."""
        n = len(spec.table)
        pack = np.zeros((rows, _PACK_WORDS), dtype=np.int64)
        words = pack[:, : _PACK_WORDS - 2]
        words[:n] = (spec.table if self.device_uniforms else spec.filled()).view(np.int64)
        words[n:] = _PAD_TABLE[: rows - n].view(np.int64)
        if n and self.device_uniforms and spec.any_sampled:
            pack[:n, _PACK_WORDS - 2] = np.array(spec.seed_hashes, dtype=np.uint64).view(np.int64)
            pack[:n, _PACK_WORDS - 1] = np.array(spec.positions, dtype=np.int64) - self.ticks
            if spec.any_greedy:  # a greedy row's number is not used: kept at 0, its entry does not change
                pack[:n, _PACK_WORDS - 2 :][spec.table[:, _GREEDY] > 0] = 0
        sent = pack.tobytes()
        if sent == self._sent:
            self.uploads_skipped += 1
            return
        assert self.pack is not None
        self.sampler._uploads.copy_into("graph_params", pack, self.pack[:rows])
        self._sent = sent

    def _load(self, logits: torch.Tensor, rows: int) -> None:
        """The replay's logits: ``logits``, then zero rows up to ``rows``."""
        assert self.x is not None
        n = logits.shape[0]
        self.x[:n].copy_(logits)
        if n < rows:
            self.x[n:rows].zero_()

    def _body(self, key: _GraphKey, fold: bool = True) -> torch.Tensor:
        """The pick; with ``fold``, its tokens folded into the kept tables too (not in the capture's warm-up run,
        which would count them twice)."""
        assert self.x is not None and self.prm is not None and self.seeds is not None and self.tick is not None
        x, prm = self.x[: key.rows], self.prm[: key.rows]
        if key.any_sampled and self.device_uniforms:  # each row's uniform number (the warm-up keeps the tick)
            _cuda_ops(x.device).row_uniforms_(prm, self.seeds, self.tick, _U, 1 if fold else 0)
        if key.width:
            _penalize(x, prm, self.sampler._slots, key.width, key.any_rep, key.any_freq_pres)
        if key.masked:
            assert self.mask_src is not None
            ops = _cuda_ops(x.device)
            ops.wait_masks(*self.mask_src.wait)
            ops.apply_token_bitmask_(x, self.mask_src.table, self.mask_src.rows[: key.rows])
        tok: torch.Tensor | None = x.argmax(dim=-1) if key.any_greedy else None
        if key.any_sampled:
            picked = _pick(x, prm, key, _Fresh(x.device))
            tok = picked if tok is None else torch.where(prm[:, _GREEDY] > 0, tok, picked)
        assert tok is not None
        if key.width and fold:
            _fold(self.sampler._slots, prm, tok, key.width)
        return tok

    def _capture(self, key: _GraphKey) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        dev = self.sampler._ws.device
        main = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(main)
        try:
            with torch.cuda.stream(side):
                self._body(key, fold=False)  # warm-up: lazy initialisation outside the capture
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._body(key)
        except Exception:  # an op that cannot be captured: this key runs eagerly from now on
            log.warning("sampler: capturing the pick for %s failed; it runs eagerly", key, exc_info=True)
            main.wait_stream(side)
            self.failed.add(key)
            return None
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, out)
        self.captures += 1
        return graph, out


class Sampler:
    """Samples a step's rows in one batched pass on the logits' device. Keeps per-request token counts for the
    penalties between steps: call :meth:`release` when a request ends (a forgotten one is only evicted later)."""

    def __init__(self, vocab_size: int, device: torch.device | str, max_rows: int = 64,
                 cuda_graphs: bool = True) -> None:
        self._uploads = PinnedUploads(torch.device(device))
        self._slots = _Slots(vocab_size, torch.device(device), max_rows, self._uploads)
        self._ws = _Workspace(torch.device(device))
        self._static = _Statics()
        self.vocab_size = vocab_size
        self._byte_bias: torch.Tensor | None = None  # [256, 8] float32: a bitmask byte's 8 tokens as 0 / -inf
        # CUDA: the grammar masks' table and what the device reads beside it (_DeviceMasks; None: not mapped yet;
        # False: it could not be, masks go up as a -inf bias); the registered index (each row's row of the table,
        # int32, -1: none; then the batch the pick waits for and the flag, int64), and the event after the last
        # pick that read them
        self._table: tuple[MaskTable, _DeviceMasks] | bool | None = None
        self._index: _Mapped | None = None
        self._waits = np.zeros(2, np.int64)  # the index's last 16 bytes: the batch the pick waits for, the flag
        self._indexed: tuple[list[int] | None, list[int], int] = (None, [], 0)  # what the index holds: (at, idx, padded)
        self._padded: dict[int, _DeviceMasks] = {}  # the mapped masks with the index cut to a graph's rows
        self._grammars_of: tuple[list[GrammarMatcher | None], tuple[list[int], list[GrammarMatcher], MaskTable]
                                 ] | None = None  # the last _table_of: its rows' matchers and what it found
        # the end of the last pick that read the mask table and index (its token readback's event), and whether a
        # pick queued since has read them and its readback is still to come
        self._read: torch.cuda.Event | None = None
        self._reading = False
        self._readback = _Readback()
        # CUDA: the processed pick as graphs (``cuda_graphs=False``: eager, as on the CPU)
        self._graphs = _PickGraphs(self) if cuda_graphs and torch.device(device).type == "cuda" else None

    def release(self, key: str) -> None:
        self._slots.release(key)
        self._static.release(key)

    @property
    def num_tracked(self) -> int:
        return len(self._slots.by_key)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        """Pick one token per row of ``logits`` ([N, V], V the vocab given at construction; float32, or the
        model's dtype: an all-greedy batch is picked from it as is). Does not modify ``logits``."""
        return self.launch(logits, rows).result()

    def launch(self, logits: torch.Tensor, rows: list[SampleRow]) -> PendingSample:
        """:meth:`sample`, without waiting for the device: the picks are queued behind ``logits``' producer. The
        rows' state (outputs, grammar matchers) must be current; the kept penalty state is updated here."""
        plain = all(_plain_greedy(r) for r in rows)
        constrained = any(r.grammar is not None for r in rows)
        ops = _cuda_ops(logits.device) if constrained else None
        if plain and ops is not None:  # on a GPU: one kernel, each row's argmax over its allowed tokens
            masks = self._device_masks(rows, logits.shape[0])
            if masks is not None:
                ops.wait_masks(*masks.wait)
                picked = ops.masked_argmax(logits, masks.table, masks.rows)
                self._masks_read()
                return self._tokens_only(picked)
        if plain and logits.device.type != "cpu" and not constrained:
            return self._tokens_only(logits.argmax(dim=-1))
        if plain and logits.device.type == "cpu":
            toks = _argmax(logits)
            filled = self._fill(rows)
            if filled is not None:  # a constrained row whose argmax its grammar disallows is picked again, masked
                idx, bitmask = filled
                words = bitmask.numpy()
                redo = [j for j, i in enumerate(idx) if not (int(words[j, toks[i] >> 5]) >> (toks[i] & 31)) & 1]
                if redo:
                    for j, t in zip(redo, self._masked_argmax(logits, [idx[j] for j in redo], bitmask[redo])):
                        toks[idx[j]] = t
            return PendingSample(torch.tensor(toks, dtype=torch.long),
                                 result=SampleResult(toks, [None] * logits.shape[0]))
        spec = self._spec(logits, rows)
        if self._graphs is not None and (ops is not None or not constrained):
            picked = self._graphs.run(logits, spec, rows if constrained else None)
            if picked is not None:
                self._slots.folded(spec.fold_slots, spec.count_rows)
                for slot in spec.temp_slots:
                    self._slots.drop(slot)
                return self._tokens_only(picked)
        x, prm = self._process(logits, rows, spec)
        tok: torch.Tensor | None = None
        if spec.any_greedy:
            tok = x.argmax(dim=-1)
        if spec.any_sampled:
            picked = _pick(x, prm, spec, self._ws)
            tok = picked if tok is None else torch.where(prm[:, _GREEDY] > 0, tok, picked)
        assert tok is not None
        if spec.count_rows:
            _fold(self._slots, prm, tok, min(self._slots.ids.shape[1], spec.max_seen + 1))
        self._slots.folded(spec.fold_slots, spec.count_rows)
        for slot in spec.temp_slots:
            self._slots.drop(slot)
        flat, decode = _fetch(tok, spec.raw_lp, spec)
        host, event = self._read_back(flat)
        return PendingSample(tok, host, event, decode)

    def _tokens_only(self, tok: torch.Tensor) -> PendingSample:
        n = tok.shape[0]
        host, event = self._read_back(tok)
        return PendingSample(tok, host, event, lambda ids: SampleResult(ids, [None] * n))

    def processed_logits(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The float32 logits the pick sees (penalties, logit_bias, min_tokens masks applied); samples nothing and
        leaves the kept counts as they were. For checks against a reference."""
        spec = self._spec(logits, rows)
        x, _ = self._process(logits, rows, spec)
        for slot in spec.temp_slots:
            self._slots.drop(slot)
        if self._reading:  # no readback follows: the end of the masks' read gets an event of its own
            self._reading = False
            self._read = torch.cuda.Event()
            record(self._read)
        return x.clone()

    def _spec(self, logits: torch.Tensor, rows: list[SampleRow]) -> _StepSpec:
        """The step's host side (the kept state brought up to the rows, written to the device)."""
        if logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns; this sampler was made for {self.vocab_size}")
        return _StepSpec(rows, self._slots, self.vocab_size, self._static)

    def _process(self, logits: torch.Tensor, rows: list[SampleRow], spec: _StepSpec
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        dev = logits.device
        n, vocab = logits.shape
        x = self._ws.get("x", n, vocab).copy_(logits)
        prm = self._uploads.tensor("params", spec.filled(), torch.float32)
        if spec.lp_rows:
            spec.lp_index = self._uploads.tensor("lp_rows", spec.lp_rows, torch.long)
            spec.raw_lp = torch.log_softmax(x[spec.lp_index], dim=-1)
        if spec.count_rows:
            _penalize(x, prm, self._slots, spec.max_seen, spec.any_rep, spec.any_freq_pres)
        up = self._uploads
        if spec.bias:
            r_, t_, v_ = zip(*spec.bias)
            x.index_put_((up.tensor("bias_rows", r_, torch.long), up.tensor("bias_ids", t_, torch.long)),
                         up.tensor("bias_values", v_, torch.float32), accumulate=True)
        if spec.bans:
            r_, t_ = zip(*spec.bans)
            x[up.tensor("ban_rows", r_, torch.long), up.tensor("ban_ids", t_, torch.long)] = _MASK
        ops = _cuda_ops(dev) if any(r.grammar is not None for r in rows) else None
        masks = self._device_masks(rows, n) if ops is not None else None
        if masks is not None:  # on a GPU: the disallowed tokens set to -inf in place, the bits read packed
            assert ops is not None
            ops.wait_masks(*masks.wait)
            ops.apply_token_bitmask_(x, masks.table, masks.rows)
            self._masks_read()
            return x, prm
        filled = self._fill(rows)
        if filled is not None:
            idx, bitmask = filled
            bias = self._bias(bitmask, dev)
            if len(idx) == n:  # every row constrained
                x.add_(bias)
            elif dev.type == "cpu":
                for j, i in enumerate(idx):
                    x[i].add_(bias[j])
            else:
                x.index_add_(0, self._uploads.tensor("grammar_rows", idx, torch.long), bias)
        return x, prm

    def _table_of(self, rows: list[SampleRow]) -> tuple[list[int], list[GrammarMatcher], MaskTable] | None:
        """The constrained rows' indices, their matchers and the mask table they fill (one compiler's); None
        without any. The rows' matchers as the last call's (a decode batch, step after step): the same lists back."""
        grammars = [r.grammar for r in rows]
        last = self._grammars_of
        if last is not None and last[0] == grammars:  # identities: a matcher has no __eq__
            return last[1]
        self._grammars_of = None
        if not any(grammars):  # no constrained row (the CPU's plain batches ask every step)
            return None
        idx = [i for i, g in enumerate(grammars) if g is not None]
        matchers = [g for g in grammars if g is not None]
        table = matchers[0].table
        if any(g.table is not table for g in matchers):
            raise ValueError("a step's constrained rows come from different grammar compilers")
        # held until the next call with other rows, as MaskProcess.locate holds them: a finished row's slot is
        # freed a pick late
        self._grammars_of = (grammars, (idx, matchers, table))
        return idx, matchers, table

    def _fill(self, rows: list[SampleRow]) -> tuple[list[int], torch.Tensor] | None:
        """The constrained rows' indices and their masks as one host bitmask [M, words] (int32, bit ``t % 32`` of
        word ``t // 32`` set when token t is allowed), M the constrained rows; None without any."""
        found = self._table_of(rows)
        if found is None:
            return None
        idx, matchers, table = found
        at, _ = table.fill(matchers)
        if at == list(range(at[0], at[0] + len(at))):  # filled here, in a run of rows: read them where they are
            return idx, torch.from_numpy(table.host[at[0] : at[0] + len(at)])
        return idx, torch.from_numpy(table.host[at])  # the mask process's slots: gathered into one bitmask

    def _device_masks(self, rows: list[SampleRow], padded: int) -> _DeviceMasks | None:
        """On CUDA, the rows' masks where the device reads them in place, without a copy, and what the device
        waits on before it reads them (the mask process's answer: the host does not wait for it). None where the
        table cannot be mapped (the masks then go up as a bias)."""
        found = self._table_of(rows)
        if found is None or self._ws.device.type != "cuda" or padded > _GRAPH_MAX_ROWS:
            return None
        idx, matchers, table = found
        if self._table is None or (not isinstance(self._table, bool) and self._table[0] is not table):
            try:
                if self._index is None:  # each row's row of the table, then the batch it waits for and the flag
                    self._index = _Mapped(np.frombuffer(mmap.mmap(-1, 4 * _GRAPH_MAX_ROWS + 16), np.int32),
                                          self._ws.device)
                    self._waits = self._index.host[_GRAPH_MAX_ROWS:].view(np.int64)
                self._table = (table, _DeviceMasks.of(table, _Mapped.of(table.shared, self._ws.device), self._index))
                self._padded = {}
            except RuntimeError as e:
                log.warning("sampler: the grammar mask table cannot be mapped into the device (%s); masks go up as "
                            "a bias, slower", e)
                self._table = False
        if self._table is False:
            return None
        assert not isinstance(self._table, bool) and self._index is not None
        if self._read is not None:
            self._read.synchronize()  # the last pick that read the table and the index (done by now: its tokens were read)
        waits = self._waits  # [the batch the pick waits for, the flag]
        if waits[1]:  # the last wait gave up: the mask process hangs
            waits[1] = 0
            if table.remote is not None:
                table.remote.hung()
        at, waits[0] = table.fill(matchers, wait=False)
        if at is not self._indexed[0] or (idx, padded) != self._indexed[1:]:  # else the index holds them already
            index = self._index.host
            index[:padded] = -1
            index[idx] = at
            self._indexed = (at, idx, padded)
        masks = self._padded.get(padded)
        if masks is None:
            masks = self._padded[padded] = self._table[1].padded(padded)
        return masks

    def _masks_read(self) -> None:
        """The kernels just queued read the mask table and index: the next fill waits for the pick's token
        readback, queued after them (``_read_back``), which needs no event of its own."""
        self._reading = True

    def _read_back(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The pick's device→host copy (``_Readback``); after a pick that read the masks, its event is the one the
        next fill waits for (``_read``: by then that copy is read, so the wait costs nothing; the event is
        recorded again two readbacks later, at a point later still in the stream)."""
        host, event = self._readback(flat)
        if self._reading:
            self._read, self._reading = event, False
        return host, event

    def _masked_argmax(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> list[int]:
        """The argmax of ``logits[rows]`` over their masks' allowed tokens: one pass of the C++ kernel on the CPU
        (building the rows' -inf bias and adding it took ~0.1 ms a 49,152-token row there), else bias + argmax."""
        if logits.device.type == "cpu" and cpu_kernels.available():
            return cpu_kernels.masked_argmax_rows(logits, torch.tensor(rows, dtype=torch.long), bitmask).tolist()
        # rows copied one by one: index_select of bfloat16 rows is slow on the CPU
        sub = torch.stack([logits[i] for i in rows]).float()
        return _argmax(sub.add_(self._bias(bitmask, logits.device)))

    def _bias(self, bitmask: torch.Tensor, dev: torch.device) -> torch.Tensor:
        """Host bitmask rows [M, words] → [M, V] float32 on ``dev``, 0 where allowed and -inf elsewhere: one copy,
        then one gather from a byte → 8-entry table (a bitwise unpack and masked_fill took 5x longer on the CPU)."""
        lut = self._byte_bias
        if lut is None or lut.device != dev:
            bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
            lut = self._byte_bias = torch.where(bits > 0, 0.0, _MASK).to(dev)  # [256, 8]: a byte's 8 tokens
        m = bitmask.shape[0]
        if dev.type == "cpu":  # numpy's take: torch's CPU index_select took 10x longer on this gather
            flat = np.take(lut.numpy(), bitmask.numpy().view(np.uint8).reshape(-1), axis=0)
            return torch.from_numpy(flat).view(m, -1)[:, : self.vocab_size]
        byte_ids = bitmask.to(dev).view(torch.uint8).view(-1).long()
        return lut.index_select(0, byte_ids).view(m, -1)[:, : self.vocab_size]


class _DeviceMasks(NamedTuple):
    """What a pick on CUDA reads in place, in host memory: the mask table ([rows, words] int32), each pick row's
    row of it ([padded] int32, -1: none); and the wait before it (``triton_ops.wait_masks``): the mask process's
    last answered batch, the batch the pick needs, the flag a wait that gave up sets."""

    table: torch.Tensor
    rows: torch.Tensor
    wait: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    mapped: tuple[_Mapped, _Mapped]  # held: the memory stays registered while these tensors are in use

    @classmethod
    def of(cls, table: MaskTable, shared: _Mapped, index: _Mapped) -> _DeviceMasks:
        t = shared.tensor
        answered = t[t.shape[0] - READY_BYTES // 4 :].view(torch.int64)[:1]  # the end of the memory (MaskTable)
        waits = index.tensor[_GRAPH_MAX_ROWS:].view(torch.int64)
        return cls(t[: table.host.size].view(table.host.shape), index.tensor[:_GRAPH_MAX_ROWS],
                   (answered, waits[:1], waits[1:]), (shared, index))

    def padded(self, rows: int) -> _DeviceMasks:
        return self._replace(rows=self.rows[:rows])


class _Mapped:
    """Host memory (an int32 numpy array) that a CUDA device reads in place: page-locked and mapped into the
    device's address space (``cudaHostRegister``) while this lives. Under unified addressing (every 64-bit CUDA
    platform) the device reads it at its host address, over PCIe, inside the kernels that use it: no copy to
    queue, and a CUDA graph can read it. ``tensor``: the device's view."""

    _live: ClassVar[weakref.WeakValueDictionary[tuple[int, int], _Mapped]] = weakref.WeakValueDictionary()

    @classmethod
    def of(cls, host: np.ndarray, device: torch.device) -> _Mapped:
        """The one mapping of ``host``'s memory (memory is registered once: two samplers may share a table)."""
        key = (host.ctypes.data, host.nbytes)
        m = cls._live.get(key)
        if m is None:
            m = cls._live[key] = cls(host, device)
        return m

    def __init__(self, host: np.ndarray, device: torch.device) -> None:
        ptr = host.ctypes.data
        rt = torch.cuda.cudart()
        with torch.cuda.device(device):
            err = rt.cudaHostRegister(ptr, host.nbytes, 3)  # cudaHostRegisterPortable | cudaHostRegisterMapped
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister: {rt.cudaGetErrorString(err)}")
            self.host = host
            weakref.finalize(self, _unregister, ptr, host)  # ``host`` stays alive until then
            self.tensor = torch.as_tensor(_CudaArray(ptr, host.shape))  # on the device whose address space has it


def _unregister(ptr: int, host: np.ndarray) -> None:
    with contextlib.suppress(Exception):  # the CUDA context is gone already (interpreter exit)
        torch.cuda.cudart().cudaHostUnregister(ptr)


class _CudaArray:
    """A pointer the device can read, as ``torch.as_tensor`` takes one (the CUDA array interface)."""

    def __init__(self, ptr: int, shape: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<i4", "data": (ptr, False), "version": 3}


@dataclass(frozen=True, slots=True)
class _RowStatic:
    """What a request's parameters say about every one of its rows, worked out once."""

    head_id: int  # its table row's row of _Statics.heads (_U and _SLOT are the step's)
    counts: bool  # needs the kept penalty state
    rep: bool
    freq_pres: bool
    bias: tuple[tuple[int, float], ...]
    seed_hash: int
    # what its row asks of the pick: greedy, top-k (0: none), top-p, min-p
    kind: tuple[bool, int, bool, bool]
    rare: bool  # min_tokens, logit_bias or logprobs: looked at row by row


class _Statics:
    """The :class:`_RowStatic` of each request (by request id), and the distinct table rows they use as one array,
    so that a step's table is one ``take`` from it, not a conversion of every row's floats. Bounded: a step that
    starts with more than ``MAX_HEADS`` distinct rows drops both (:meth:`trim`), and they are made anew from the
    rows' parameters; within a step the ids only grow."""

    MAX_HEADS = 4096

    def __init__(self) -> None:
        self.by_key: dict[str, _RowStatic] = {}
        self._ids: dict[tuple[float, ...], int] = {}
        self.heads = np.empty((16, len(_PAD_ROW)), dtype=np.float32)

    def release(self, key: str) -> None:
        self.by_key.pop(key, None)

    def of(self, p: SamplingParams, seed: int, vocab: int) -> _RowStatic:
        k = p.top_k if p.top_k is not None and 0 < p.top_k < vocab else 0
        greedy = p.greedy
        # a greedy row is picked by argmax; in the sampling pass it keeps one candidate at temperature 1 (finite)
        head = (1.0 if greedy else p.temperature, 1.0 if greedy else float(k), p.top_p, p.min_p,
                p.repetition_penalty, p.presence_penalty, p.frequency_penalty, 0.0, 0.0, float(greedy))
        bias = tuple((t, b) for t, b in p.logit_bias if t < vocab)
        return _RowStatic(self._head_id(head), _needs_counts(p), p.repetition_penalty != 1.0,
                          bool(p.presence_penalty or p.frequency_penalty), bias, _mix64(seed & _M64),
                          (greedy, k, p.top_p < 1.0, p.min_p > 0.0),
                          p.min_tokens > 0 or bool(bias) or p.logprobs is not None)

    def trim(self) -> None:
        if len(self._ids) > self.MAX_HEADS:
            self._ids.clear()
            self.by_key.clear()

    def _head_id(self, head: tuple[float, ...]) -> int:
        i = self._ids.get(head)
        if i is not None:
            return i
        i = self._ids[head] = len(self._ids)
        if i >= len(self.heads):
            self.heads = np.concatenate((self.heads, np.empty_like(self.heads)))
        self.heads[i] = head
        return i


class _StepSpec:
    """The host side of one step: per-row parameters as one table, and which stages any row needs."""

    def __init__(self, rows: list[SampleRow], slots: _Slots, vocab: int, statics: _Statics) -> None:
        self.bans: list[tuple[int, int]] = []
        self.bias: list[tuple[int, int, float]] = []
        self.lp_rows: list[int] = []
        self.lp_k: list[int] = []  # top logprobs asked, per row of lp_rows
        self.temp_slots: list[int] = []
        self.fold_slots: list[int] = []  # the kept slots of rows with penalties: the pick folds its tokens into them
        self.any_rep = self.any_freq_pres = self.any_greedy = self.any_sampled = False
        self.any_top_p = self.any_min_p = False
        self.top_ks: list[int] = []
        self.max_seen = 0  # most distinct tokens of a penalized row
        self.raw_lp: torch.Tensor | None = None  # log_softmax of the raw logits of lp_rows
        self.lp_index: torch.Tensor | None = None  # lp_rows on the device
        n = len(rows)
        heads: list[int] = []
        statics.trim()
        cache = statics.by_key
        row_slots: list[int] = []
        no_rep: list[int] = []  # penalized rows whose slot has seen nothing: nothing to penalize
        hashes: list[int] = []
        positions: list[int] = []
        kinds: set[tuple[bool, int, bool, bool]] = set()
        in_use: set[int] = set()
        by_key, counted, bound = slots.by_key, slots.counted, slots.bound
        for i, r in enumerate(rows):
            key = r.key
            st = cache.get(key) if key is not None else None  # a request's params and seed never change
            if st is None:
                st = statics.of(r.params, r.seed, vocab)
                if key is not None:
                    cache[key] = st
            heads.append(st.head_id)
            hashes.append(st.seed_hash)
            positions.append(r.position)
            kinds.add(st.kind)
            slot = 0
            if st.counts:
                slot = by_key.get(key, 0) if key is not None else 0
                if slot and counted[slot] == len(r.output_ids):  # its kept counts are current: most rows, most steps
                    by_key.move_to_end(key)  # type: ignore[arg-type]  # slot != 0: key is not None
                else:
                    slot = slots.acquire(key, in_use)
                    slots.sync(slot, r)
                in_use.add(slot)
                (self.fold_slots if key is not None else self.temp_slots).append(slot)
                seen = bound[slot]
                if seen:
                    if seen > self.max_seen:
                        self.max_seen = seen
                    self.any_rep |= st.rep
                    self.any_freq_pres |= st.freq_pres
                else:  # nothing seen: nothing to penalize (its ids row may be stale)
                    no_rep.append(i)
            row_slots.append(slot)
            if st.rare:
                p = r.params
                if len(r.output_ids) < p.min_tokens and r.grammar is None:  # a grammar decides when EOS may come
                    self.bans += [(i, t) for t in {*r.eos_ids, *p.stop_token_ids} if 0 <= t < vocab]
                if st.bias:
                    self.bias += [(i, t, b) for t, b in st.bias]
                if p.logprobs is not None:
                    self.lp_rows.append(i)
                    self.lp_k.append(p.logprobs)
        for greedy, top_k, top_p, min_p in kinds:  # the stages the step's rows need, from their distinct kinds
            if greedy:
                self.any_greedy = True
            else:
                self.any_sampled = True
                self.top_ks.append(top_k)
                self.any_top_p |= top_p
                self.any_min_p |= min_p
        table = np.empty((n, len(_PAD_ROW)), dtype=np.float32)
        if n:
            statics.heads.take(heads, axis=0, out=table)
            table[:, _U] = 0.0  # each row's uniform number: ``filled`` (the host's) or the graph's draw on the device
            table[:, _SLOT] = row_slots
            if no_rep:
                table[no_rep, _REP] = 1.0
        self.table = table
        self.seed_hashes, self.positions = hashes, positions
        self._filled = False
        slots.flush(self.max_seen + 1)  # a fold may add a column
        self.count_rows = self.max_seen > 0
        # every sampled row has a small top-k: sample among the top candidates only
        self.candidates = max(self.top_ks) if self.top_ks and all(
            0 < k <= _CANDIDATE_CAP for k in self.top_ks) else 0

    def filled(self) -> np.ndarray:
        """The table with each row's uniform number, drawn on the host (the eager pick's; a CUDA graph's pick draws
        the same numbers on the device, ``triton_ops.row_uniforms_``)."""
        if not self._filled and len(self.table):
            self.table[:, _U] = np.minimum(_uniforms(self.seed_hashes, self.positions), _U_MAX)
        self._filled = True
        return self.table


def _penalize(x: torch.Tensor, prm: torch.Tensor, slots: _Slots, width: int, rep: bool, freq_pres: bool) -> None:
    """The penalties, in place, from the kept tables' first ``width`` columns of each row's slot."""
    ops = _cuda_ops(x.device)
    if ops is not None:  # one kernel, over each row's own columns
        ops.penalize_(x, prm, slots.ids, slots.counts, slots.nseen, (_REP, _PRES, _FREQ, _SLOT), rep, freq_pres)
        return
    slot_t = prm[:, _SLOT].long()
    ids = slots.ids[:, :width].index_select(0, slot_t)  # a row's padding repeats its column 0
    if rep:  # x / rp where x > 0, x · rp elsewhere, once per token seen
        v = x.gather(1, ids)
        rp = prm[:, _REP : _REP + 1]
        x.scatter_(1, ids, torch.where(v > 0, v / rp, v * rp))
    if freq_pres:  # x − frequency · count − presence · (count > 0); padding counts are 0
        c = slots.counts[:, :width].index_select(0, slot_t)
        x.scatter_add_(1, ids, c * -prm[:, _FREQ : _FREQ + 1])
        x.scatter_add_(1, ids, (c > 0).float() * -prm[:, _PRES : _PRES + 1])


def _pick(x: torch.Tensor, prm: torch.Tensor, spec: _StepSpec | _GraphKey, ws: _Workspace) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then the inverse-CDF pick in vocabulary order; may overwrite ``x``. Greedy
    rows' picks here are discarded (they take temperature 1 to stay finite). A batch whose sampled rows all have a
    top_k up to ``_CANDIDATE_CAP`` picks among the top-k candidates; the others take one kernel over the whole
    vocabulary, with no sort (``triton_ops.pick_full`` on a GPU, ``cpu_kernels.pick_rows`` on the CPU where the C++
    kernels compiled), their top-k rows' tokens under the k-th largest dropped first; where neither is there,
    PyTorch's ops over the whole vocabulary."""
    temp = prm[:, _TEMP : _TEMP + 1]
    k_row = prm[:, _TOPK : _TOPK + 1]
    ops = _cuda_ops(x.device)
    if spec.candidates:
        vals, ids = torch.topk(x, spec.candidates, dim=-1)  # sorted, largest first
        if ops is not None:  # the rest in one kernel
            return ops.pick_candidates(vals, ids, prm, (_TEMP, _TOPK, _TOPP, _MINP, _U), spec.any_top_p, spec.any_min_p)
        vals = vals.div_(temp).masked_fill_(ws.rank(spec.candidates) >= k_row, _MASK)
        probs = torch.softmax(vals, dim=-1)
        if spec.any_top_p:
            # keep the smallest set whose mass reaches top_p
            probs = probs.masked_fill(probs.cumsum(-1) - probs >= prm[:, _TOPP : _TOPP + 1], 0.0)
        if spec.any_min_p:
            probs = probs.masked_fill(probs < prm[:, _MINP : _MINP + 1] * probs[:, :1], 0.0)
        order = ids.argsort(dim=-1)  # back to vocabulary order, so the pick matches the full-vocabulary path
        ids, probs = ids.gather(1, order), probs.gather(1, order)
        return ids.gather(1, _inverse_cdf(probs, prm, probs.cumsum(-1))).squeeze(1)
    n, v = x.shape
    if any(spec.top_ks):
        # every full-vocabulary path: each top-k row's tokens under its k-th largest logit dropped first (ties with
        # it kept; the order of x is z's), then the pick below over the whole vocabulary
        kmax = min(max(spec.top_ks), v)
        kth = torch.topk(x, kmax, dim=-1).values.gather(1, (k_row.long() - 1).clamp(0, kmax - 1))
        x.masked_fill_(torch.lt(x, kth, out=ws.get("mask", n, v, torch.bool)).logical_and_(k_row > 0), _MASK)
    if ops is not None:  # on a GPU, Triton kernels with no sort (triton_ops.pick_full)
        return ops.pick_full(x, prm, (_TEMP, _TOPP, _MINP, _U), spec.any_top_p, spec.any_min_p)
    if x.device.type == "cpu" and x.dtype == torch.float32 and cpu_kernels.available():
        # on the CPU, the same pick in one C++ function (cpu_kernels.pick_rows), no sort either
        return cpu_kernels.pick_rows(x, prm, _TEMP, _TOPP, _MINP, _U, spec.any_top_p, spec.any_min_p)
    z = x.div_(temp)
    mask = ws.get("mask", n, v, torch.bool)
    # unnormalized probabilities in place (the largest is 1): top-p and the pick compare against the row's total
    probs = z.sub_(z.amax(-1, keepdim=True)).exp_()
    if spec.any_top_p:
        cut = prm[:, _TOPP : _TOPP + 1] * probs.sum(-1, keepdim=True)
        if probs.device.type == "cpu" and v > 2 * _CANDIDATE_CAP:
            _top_p_by_candidates(probs, cut)
        else:
            _nucleus(probs, *probs.sort(dim=-1, descending=True), cut)
    if spec.any_min_p:
        probs.masked_fill_(torch.lt(probs, prm[:, _MINP : _MINP + 1], out=mask), 0.0)
    return _inverse_cdf(probs, prm, torch.cumsum(probs, -1, out=ws.get("cdf", n, v))).squeeze(1)


def _top_p_by_candidates(probs: torch.Tensor, cut: torch.Tensor) -> None:
    """Top-p in place on the CPU without sorting whole rows where it need not: a row whose largest
    ``_CANDIDATE_CAP`` probabilities reach its cut has its nucleus among them, and every other token is dropped;
    only the rows whose do not are sorted whole (a model's nucleus is usually a few tokens, and sorting every row
    of the vocabulary was the CPU sampler's largest cost). The same tokens kept as sorting every row."""
    sp, si = probs.topk(_CANDIDATE_CAP, dim=-1)  # sorted, largest first
    wide = torch.nonzero(sp.sum(-1, keepdim=True) < cut)[:, 0]
    whole = probs.index_select(0, wide) if len(wide) else None
    _nucleus(probs.zero_(), sp, si, cut)
    if whole is not None:
        probs.index_copy_(0, wide, _nucleus(whole, *whole.sort(dim=-1, descending=True), cut.index_select(0, wide)))


def _nucleus(out: torch.Tensor, sp: torch.Tensor, si: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """Write into ``out`` (at ids ``si``) the probabilities ``sp`` (largest first) whose mass before them is below
    ``cut``: the smallest set whose mass reaches it; returns ``out``."""
    return out.scatter_(1, si, sp.masked_fill_(sp.cumsum(-1) - sp >= cut, 0.0))


def _inverse_cdf(probs: torch.Tensor, prm: torch.Tensor, cdf: torch.Tensor) -> torch.Tensor:
    """Index [N, 1] of the first entry whose running mass ``cdf`` exceeds u × total. The target is below the total,
    so the entry's mass is above the one before it: never an entry of probability 0."""
    target = prm[:, _U : _U + 1] * cdf[:, -1:]  # u ≤ _U_MAX: below the total
    # a row of NaN (a broken model's logits) finds no entry: the clamp keeps it an index, not a device assert
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)


def _fetch(tok: torch.Tensor, raw_lp: torch.Tensor | None, spec: _StepSpec) -> tuple[torch.Tensor, Any]:
    """What the step's one device→host copy carries: the picked ids, then the asked rows' sampled logprob and
    top-k ids and logprobs, as one flat tensor; and the function that turns its values into the SampleResult."""
    n = tok.shape[0]
    if raw_lp is None:
        return tok, lambda ids: SampleResult(ids, [None] * n)
    assert spec.lp_index is not None
    sel = raw_lp.gather(1, tok[spec.lp_index].unsqueeze(1)).squeeze(1)
    parts = [tok.double(), sel.double()]
    k = max(spec.lp_k)
    if k:
        tv, ti = torch.topk(raw_lp, k, dim=-1)
        parts += [ti.double().flatten(), tv.double().flatten()]
    m = len(spec.lp_rows)
    lp_rows, lp_k = list(spec.lp_rows), list(spec.lp_k)

    def decode(flat: list[float]) -> SampleResult:
        top_i, top_v = flat[n + m : n + m + m * k], flat[n + m + m * k :]
        lps: list[tuple[float, list[tuple[int, float]]] | None] = [None] * n
        for j, (i, own) in enumerate(zip(lp_rows, lp_k)):
            lps[i] = (flat[n + j], [(int(top_i[j * k + t]), top_v[j * k + t]) for t in range(own)])
        return SampleResult([int(t) for t in flat[:n]], lps)

    return torch.cat(parts), decode


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """Sample without state kept between calls (each penalized row's counts are built from its ids)."""
    return Sampler(logits.shape[1], logits.device, max_rows=1).sample(logits, rows)
