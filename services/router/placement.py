"""Placement: which prefill worker (or none) and which decode worker serve a request.

Every worker streams its load; the router keeps, per worker, its last report, the hashes of the KV blocks it holds
(from "stored"/"removed" events) and what was placed on it since that report. For a prompt of ``n`` tokens the
router computes its block hashes with ``common.hashing.prefix_block_hashes`` — the engine's own function, with
the worker's model id, block size and the request's cache salt — so the prefix overlap it counts is exact.

The cost of giving a request to worker ``w`` (Dynamo-style, in KV blocks of ``w``)::

    cost(w) = prefill_weight * max(queued_prefill_blocks(w) + prefill_blocks - overlap_blocks(w), 0)
              + decode_blocks_in_use_after(w)

- ``queued_prefill_blocks`` = ceil((reported queued prefill tokens + prefill tokens placed since) / block size);
- ``prefill_blocks`` = ceil(n / block size) when ``w`` computes the prompt (a prefill worker, or a decode worker
  that prefills locally), else 0 (a decode worker that pulls the KV: only its queued prefills count);
- ``overlap_blocks`` = the leading prompt blocks already in ``w``'s cache;
- ``decode_blocks_in_use_after`` = (total − free blocks reported) + blocks placed since the report + the new
  blocks this request takes there: ceil((n + max_tokens) / block size) − overlap on a decode worker,
  ceil(n / block size) − overlap on a prefill worker (it keeps only the prompt, under a lease).

A higher ``prefill_weight`` favours cache hits (TTFT); a lower one even KV load (ITL). The lowest cost wins;
workers where the request's new blocks fit in the free blocks come first; ties go to the smallest worker id.
Placements since a worker's last report are counted in-flight and cleared when its next report arrives.

Conditional disaggregation: the decode worker is chosen as if it prefilled locally; if the part of the prompt it
lacks is shorter than ``prefill_threshold_tokens``, it does (no prefill worker). Otherwise the cheapest prefill
worker that is not saturated (queued tokens ≥ ``prefill_saturated_tokens`` or too few free blocks) computes the
prompt, and the decode worker is re-chosen on load (its prefill term is only its existing queue). Draining,
excluded and silent workers (no report for ``worker_timeout_s``) are never chosen.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from common.cluster_config import RouterConfig
from common.hashing import HashKeys, prefix_block_hashes


class Role(Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class NoWorkers(Exception):
    """No decode worker can take the request; the message says why (→ UNAVAILABLE)."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One worker's report (the in-process mirror of ``tokenmill.v1.WorkerLoad``)."""

    worker_id: str
    address: str
    role: Role
    model_id: str
    block_size: int
    free_blocks: int
    total_blocks: int
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    stored: Sequence[int] = ()
    removed: Sequence[int] = ()
    reset: bool = False
    draining: bool = False


@dataclass(slots=True)
class WorkerState:
    """What the router knows of one worker: its last report, its cached blocks, and placements since."""

    last: LoadReport
    last_seen: float
    stream: object  # the Report stream that owns this entry (a later stream with the same id replaces it)
    cached: set[int] = field(default_factory=set)
    inflight_requests: int = 0
    inflight_blocks: int = 0
    inflight_prefill_tokens: int = 0

    @property
    def block_size(self) -> int:
        return max(1, self.last.block_size)

    def overlap(self, hashes: Sequence[int]) -> int:
        """Leading blocks of the prompt already cached here."""
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def queued_prefill_blocks(self) -> int:
        return _ceil(self.last.queued_prefill_tokens + self.inflight_prefill_tokens, self.block_size)

    def blocks_in_use(self) -> int:
        return self.last.total_blocks - self.last.free_blocks + self.inflight_blocks

    def free_after_inflight(self) -> int:
        return self.last.free_blocks - self.inflight_blocks


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker priced for one request."""

    worker: WorkerState
    cost: float
    overlap_blocks: int
    new_blocks: int
    fits: bool

    @property
    def key(self) -> tuple[bool, float, str]:
        return (not self.fits, self.cost, self.worker.last.worker_id)


@dataclass(frozen=True, slots=True)
class Decision:
    prefill: WorkerState | None
    decode: WorkerState
    cached_blocks: int
    reason: str


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def price(w: WorkerState, n_tokens: int, max_tokens: int, hashes: Sequence[int], prefill_here: bool,
          weight: float) -> Candidate:
    """The cost of giving a request of ``n_tokens`` (+ ``max_tokens``) to ``w`` (see the module docstring)."""
    bs = w.block_size
    overlap = w.overlap(hashes)
    prompt_blocks = _ceil(n_tokens, bs)
    prefill_blocks = prompt_blocks if prefill_here else 0
    keeps = n_tokens if w.last.role is Role.PREFILL else n_tokens + max(max_tokens, 0)
    new = max(_ceil(keeps, bs) - overlap, 0)
    prefill = max(w.queued_prefill_blocks() + prefill_blocks - (overlap if prefill_here else 0), 0)
    cost = weight * prefill + w.blocks_in_use() + new
    return Candidate(w, cost, overlap, new, fits=new <= w.free_after_inflight())


class WorkerTable:
    """Every live worker's state, and the placement policy over it. Not thread-safe: one event loop owns it."""

    def __init__(self, policy: RouterConfig) -> None:
        self.policy = policy
        self.workers: dict[str, WorkerState] = {}

    # -- reports -----------------------------------------------------------------------------------------
    def report(self, r: LoadReport, now: float, stream: object) -> None:
        """Apply a report: replaces the load, clears the in-flight counters, applies the KV events."""
        w = self.workers.get(r.worker_id)
        if w is None or w.stream is not stream:
            w = self.workers[r.worker_id] = WorkerState(r, now, stream)
        w.last, w.last_seen = r, now
        w.inflight_requests = w.inflight_blocks = w.inflight_prefill_tokens = 0
        if r.reset:
            w.cached.clear()
        w.cached.difference_update(r.removed)
        w.cached.update(r.stored)

    def touch(self, worker_id: str, now: float, stream: object) -> bool:
        """A heartbeat: the worker lives, its load and in-flight counts stay. False when this stream does not own
        the worker's entry (then the heartbeat is applied as a report)."""
        w = self.workers.get(worker_id)
        if w is None or w.stream is not stream:
            return False
        w.last_seen = now
        return True

    def forget_stream(self, worker_id: str, stream: object) -> bool:
        """The worker's stream ended: forget it, unless a newer stream already took its place."""
        w = self.workers.get(worker_id)
        if w is not None and w.stream is stream:
            del self.workers[worker_id]
            return True
        return False

    def forget_silent(self, now: float) -> list[str]:
        gone = [k for k, w in self.workers.items() if now - w.last_seen > self.policy.worker_timeout_s]
        for k in gone:
            del self.workers[k]
        return gone

    def live(self, role: Role, now: float, exclude: Iterable[str] = ()) -> list[WorkerState]:
        ex = set(exclude)
        return [
            w for k, w in self.workers.items()
            if w.last.role is role and not w.last.draining and k not in ex
            and now - w.last_seen <= self.policy.worker_timeout_s
        ]

    # -- placement ---------------------------------------------------------------------------------------
    def place(self, prompt: Sequence[int], max_tokens: int, cache_salt: str, now: float,
              exclude: Iterable[str] = ()) -> Decision:
        """Choose workers for a request and count it in-flight on them. Raises NoWorkers."""
        exclude = set(exclude)
        decodes = self.live(Role.DECODE, now, exclude)
        if not decodes:
            known = sum(1 for w in self.workers.values() if w.last.role is Role.DECODE)
            why = (f"all {known} decode workers are draining, silent or excluded" if known
                   else "no decode worker has registered with the router")
            raise NoWorkers(f"no decode worker can take the request: {why}")
        n = len(prompt)
        hashes = _HashCache(prompt, cache_salt)
        p = self.policy

        def best(ws: list[WorkerState], prefill_here: bool) -> Candidate:
            return min((price(w, n, max_tokens, hashes.of(w), prefill_here, p.prefill_weight) for w in ws),
                       key=lambda c: c.key)

        local = best(decodes, prefill_here=True)
        uncached = n - min(local.overlap_blocks * local.worker.block_size, n)
        if uncached < p.prefill_threshold_tokens:
            return self._commit(None, local, uncached,
                                f"local prefill: {uncached} uncached tokens < threshold {p.prefill_threshold_tokens}")
        prefills = self.live(Role.PREFILL, now, exclude)
        if not prefills:
            return self._commit(None, local, uncached, "local prefill: no prefill worker available")
        open_ = [w for w in prefills if w.last.queued_prefill_tokens + w.inflight_prefill_tokens
                 < p.prefill_saturated_tokens]
        priced = [price(w, n, max_tokens, hashes.of(w), True, p.prefill_weight) for w in open_]
        priced = [c for c in priced if c.fits]
        if not priced:
            return self._commit(None, local, uncached, "local prefill: every prefill worker is saturated")
        pre = min(priced, key=lambda c: c.key)
        dec = best(decodes, prefill_here=False)
        pre_uncached = n - min(pre.overlap_blocks * pre.worker.block_size, n)
        return self._commit(pre, dec, pre_uncached, f"remote prefill: {uncached} uncached tokens")

    def _commit(self, pre: Candidate | None, dec: Candidate, prefill_tokens: int, reason: str) -> Decision:
        if pre is not None:
            pre.worker.inflight_requests += 1
            pre.worker.inflight_blocks += pre.new_blocks
            pre.worker.inflight_prefill_tokens += prefill_tokens
        dec.worker.inflight_requests += 1
        dec.worker.inflight_blocks += dec.new_blocks
        if pre is None:
            dec.worker.inflight_prefill_tokens += prefill_tokens
        cached = (pre or dec).overlap_blocks
        return Decision(pre.worker if pre else None, dec.worker, cached, reason)


class _HashCache:
    """The prompt's block hashes, computed once per (model id, block size) among the candidates."""

    def __init__(self, prompt: Sequence[int], cache_salt: str) -> None:
        self.prompt, self.salt = prompt, cache_salt
        self._by_key: dict[tuple[str, int], list[int]] = {}

    def of(self, w: WorkerState) -> list[int]:
        key = (w.last.model_id, w.block_size)
        if key not in self._by_key:
            if not isinstance(self.prompt, list):  # a message's repeated field: one copy, not a copy per block
                self.prompt = list(self.prompt)
            self._by_key[key] = prefix_block_hashes(self.prompt, w.block_size,
                                                    HashKeys(w.last.model_id, cache_salt=self.salt))
        return self._by_key[key]
