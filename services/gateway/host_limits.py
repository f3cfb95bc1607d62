"""The quota state a host's gateways share: every tenant's token buckets (``rpm``, ``tpm``) and in-flight counts in
one memory-mapped file, so that N gateways behind one port hold a tenant to its quota once, not N times.

``tokenmill up`` starting more than one gateway on its host (``gateway.count`` > 1, no ``gateway.hosts``) with
quotas or in-flight caps configured (``has_limits``) creates the file, zeroed, in its run directory and names it in
``gateway.shared_limits_file``; every gateway maps it. A gateway counts its requests in flight in the file only
where a cap reads the counts (``in_flight_capped``).
Gateways on several hosts (``gateway.hosts``: compose, Helm replicas, Ray) keep their own state, each holding
``1 / gateway.quota_shares`` of every quota (``tenancy``).

The layout follows from the config, which every gateway of the cluster reads (a size check catches a file made for
another config):

- a bucket slot per quota of each configured tenant, tenants in name order: three float64s (set, level, time); a
  slot not yet set is a full bucket;
- in-flight counts, int64: one row per configured tenant and ``HASH_ROWS`` rows shared by hash among the names
  the config does not list (client-claimed tenants under ``gateway.tenant_max_inflight``: two such names on one
  row count together, so the cap errs on refusing); one column per gateway. A gateway adds to its own column only,
  and zeroes it when it starts: a restarted gateway's requests died with it.

Every operation holds an exclusive ``flock`` on the file for its few loads and stores (two system calls, a few
µs). The clock is ``time.monotonic`` (CLOCK_MONOTONIC): one clock for every process of the host.
"""

from __future__ import annotations

import fcntl
import mmap
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from common.cluster_config import ClusterConfig

HASH_ROWS = 256
_SLOT = struct.Struct("=3d")  # set (0 or 1), level, time
_COUNT = struct.Struct("=q")
QUOTAS = ("requests", "tokens")  # a tenant's rpm and tpm buckets


def in_flight_capped(cluster: ClusterConfig) -> bool:
    """Whether any tenant has an in-flight cap (its own ``max_inflight``, or ``gateway.tenant_max_inflight``)."""
    return cluster.gateway.tenant_max_inflight is not None or any(t.max_inflight for t in cluster.tenants.values())


def has_limits(cluster: ClusterConfig) -> bool:
    """Whether the config gives the gateways anything to share: a tenant quota (rpm, tpm) or an in-flight cap."""
    return in_flight_capped(cluster) or any(t.rpm or t.tpm for t in cluster.tenants.values())


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each piece of state lives in the file."""

    buckets: dict[tuple[str, str], int]  # (tenant, "requests" | "tokens") → byte offset of its slot
    rows: dict[str, int]  # configured tenant → its in-flight row
    columns: int  # gateways
    counts_at: int  # byte offset of the in-flight table
    size: int

    @classmethod
    def of(cls, cluster: ClusterConfig) -> Layout:
        buckets: dict[tuple[str, str], int] = {}
        off = 0
        names = sorted(cluster.tenants)
        for name in names:
            t = cluster.tenants[name]
            for what, rate in zip(QUOTAS, (t.rpm, t.tpm), strict=True):
                if rate:
                    buckets[(name, what)] = off
                    off += _SLOT.size
        columns = max(1, cluster.gateway.count)
        rows = {name: i for i, name in enumerate(names)}
        return cls(buckets, rows, columns, off, off + (len(rows) + HASH_ROWS) * columns * _COUNT.size)

    def row(self, tenant: str) -> int:
        r = self.rows.get(tenant)
        return r if r is not None else len(self.rows) + zlib.crc32(tenant.encode()) % HASH_ROWS


class HostLimits:
    """One gateway's view of the shared file (gateway ``index`` of the cluster)."""

    def __init__(self, path: str | Path, cluster: ClusterConfig, index: int) -> None:
        self.layout = Layout.of(cluster)
        if not 0 <= index < self.layout.columns:
            raise ValueError(f"gateway index {index} is outside the {self.layout.columns} gateways of the config")
        self.index = index
        self._file = open(path, "r+b")  # noqa: SIM115  # held open for the process's life: the lock and the map
        try:
            size = Path(path).stat().st_size
            if size != self.layout.size:
                raise ValueError(f"gateway.shared_limits_file {path} holds {size} bytes; this config's tenants and "
                                 f"gateways need {self.layout.size} (a file made for another config?)")
            self._fd = self._file.fileno()
            self._mm = mmap.mmap(self._fd, self.layout.size)
        except BaseException:
            self._file.close()
            raise
        with self:  # this gateway's requests in flight: none yet
            for row in range(len(self.layout.rows) + HASH_ROWS):
                _COUNT.pack_into(self._mm, self._count_at(row, index), 0)

    @staticmethod
    def create(path: str | Path, cluster: ClusterConfig) -> None:
        """A fresh, zeroed file for ``cluster`` (``tokenmill up`` before it starts the gateways)."""
        Path(path).write_bytes(bytes(Layout.of(cluster).size))

    def close(self) -> None:
        self._mm.close()
        self._file.close()

    # the lock: ``with limits:`` around a group of loads and stores
    def __enter__(self) -> HostLimits:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    # -- buckets -----------------------------------------------------------------------------------------------
    def bucket_cell(self, tenant: str, quota: str, capacity: float,
                    clock: Callable[[], float] = time.monotonic) -> SharedCell:
        """The state of ``tenant``'s ``quota`` bucket ("requests" or "tokens"), for ``tenancy.TokenBucket``."""
        return SharedCell(self, self.layout.buckets[(tenant, quota)], capacity, clock)

    # -- in flight ---------------------------------------------------------------------------------------------
    def _count_at(self, row: int, column: int) -> int:
        return self.layout.counts_at + (row * self.layout.columns + column) * _COUNT.size

    def in_flight(self, tenant: str) -> int:
        """``tenant``'s requests in flight at every gateway of the host."""
        row = self.layout.row(tenant)
        with self:
            return sum(_COUNT.unpack_from(self._mm, self._count_at(row, c))[0] for c in range(self.layout.columns))

    def add_in_flight(self, tenant: str, delta: int, below: int | None = None) -> bool:
        """Count ``delta`` more (or fewer) of ``tenant``'s requests in flight at this gateway. ``below``: only if the
        tenant's count at every gateway is below it, checked and added under one lock (no other gateway's request
        slips in between); False: it was not, and nothing was added."""
        row = self.layout.row(tenant)
        at = self._count_at(row, self.index)
        with self:
            if below is not None and sum(_COUNT.unpack_from(self._mm, self._count_at(row, c))[0]
                                         for c in range(self.layout.columns)) >= below:
                return False
            _COUNT.pack_into(self._mm, at, _COUNT.unpack_from(self._mm, at)[0] + delta)
            return True


class SharedCell:
    """A token bucket's level and time in the shared file: ``with cell as c`` locks the file and loads them, its end
    stores them and unlocks (tenancy.TokenBucket's protocol; ``LocalCell`` is the one-process kind)."""

    __slots__ = ("_capacity", "_clock", "_limits", "_offset", "at", "level")

    def __init__(self, limits: HostLimits, offset: int, capacity: float, clock: Callable[[], float]) -> None:
        self._limits, self._offset, self._capacity, self._clock = limits, offset, capacity, clock
        self.level = self.at = 0.0

    def __enter__(self) -> SharedCell:
        self._limits.__enter__()
        is_set, self.level, self.at = _SLOT.unpack_from(self._limits._mm, self._offset)
        if not is_set:
            self.level, self.at = self._capacity, self._clock()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        try:
            _SLOT.pack_into(self._limits._mm, self._offset, 1.0, self.level, self.at)
        finally:
            self._limits.__exit__(et, e, tb)
