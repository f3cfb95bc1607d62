"""Tenants at the gateway: who sent a request (API key → tenant), whether its quotas admit it (token buckets of
requests and tokens per minute), which priority class it runs in, and how its prefix cache is scoped.

Identity. Keys come from ``tenants.<name>.keys_sha256`` (SHA-256 of each key, hex) and from ``gateway.api_keys``
(``TENANT:KEY`` in plain text, hashed at start-up). A presented key is hashed and its digest looked up: one
dictionary probe whatever the number of keys. The lookup's timing can only tell about the SHA-256 of what was sent,
which says nothing of a stored key. With any key configured, a request without a known key is refused (HTTP 401, gRPC
UNAUTHENTICATED) and the client's ``x-tenant-id`` header is ignored; with none, there is no identity and a request's
tenant is whatever ``x-tenant-id`` says (a development cluster).

Quotas. Each tenant with ``rpm`` / ``tpm`` has a bucket per quota, refilled continuously at that rate per minute and
holding at most the burst. A request takes one request token at the front door; after tokenization (before
placement) it takes its input tokens plus ``max_tokens`` (without ``max_tokens``: its input tokens; the output is
charged when it is known, so the bucket may end below zero and later requests wait for it). At the end the bill is
settled with the real output: the unused part goes back. A refused request takes nothing: its request token is
given back, and it never reaches the router or a worker. The gateways ``tokenmill up`` starts on one host keep the
buckets (and the in-flight counts) in one shared file (``host_limits``); elsewhere each gateway keeps its own, holding
1/N of each quota's rate and burst with ``gateway.quota_shares`` N (the gateways behind one load balancer).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from tokenmill.v1 import common_pb2

from common.cluster_config import OTHER_TENANT, ClusterConfig, TenantConfig
from common.rpc import ResourceExhausted, Unauthenticated

if TYPE_CHECKING:
    from services.gateway.host_limits import HostLimits

Clock = Callable[[], float]

CLASS_ENUM = {"interactive": common_pb2.PRIORITY_CLASS_INTERACTIVE, "standard": common_pb2.PRIORITY_CLASS_STANDARD,
              "batch": common_pb2.PRIORITY_CLASS_BATCH}
CLASS_NAME = {v: k for k, v in CLASS_ENUM.items()}
_BEARER = "bearer "


class QuotaExceeded(ResourceExhausted):
    """A tenant's quota refuses the request now: HTTP 429, gRPC RESOURCE_EXHAUSTED. ``retry_after_s``: when the
    bucket will hold what the request needs; ``headers``: Retry-After and the tenant's x-ratelimit-* headers."""

    def __init__(self, message: str, quota: str, retry_after_s: float, headers: dict[str, str],
                 openai_code: str = "rate_limit_exceeded") -> None:
        super().__init__(message)
        self.quota, self.retry_after_s, self.headers = quota, retry_after_s, headers
        self.openai_code = openai_code  # the HTTP error body's code


class RequestTooLarge(ValueError):
    """The request needs more tokens than the tenant's bucket can ever hold: HTTP 400, gRPC INVALID_ARGUMENT."""


def hash_key(key: str) -> str:
    """The SHA-256 (hex) of an API key, as ``tenants.<name>.keys_sha256`` holds it."""
    return hashlib.sha256(key.encode()).hexdigest()


class LocalCell:
    """A token bucket's level and time in this process (``host_limits.SharedCell``: in the host's shared file);
    ``with cell as c`` gives the state to read and write."""

    __slots__ = ("at", "level")

    def __init__(self, level: float, at: float) -> None:
        self.level, self.at = level, at

    def __enter__(self) -> LocalCell:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class BucketCell(Protocol):
    level: float
    at: float

    def __enter__(self) -> BucketCell: ...

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
                 ) -> None: ...


class TokenBucket:
    """``capacity`` tokens, refilled at ``per_minute`` / 60 a second. Its state is a ``cell``: this process's own
    (the default; not thread-safe: the gateway's event loop), or a slot of the file the host's gateways share
    (``host_limits``), each operation then under the file's lock.

    ``take`` either takes all it is asked or nothing; ``charge`` and ``give`` settle a bill afterwards, and may
    leave the level below zero (a debt the refill pays first) but never above ``capacity``. ``most``: the largest
    take it ever admits (default ``capacity``); one larger than ``capacity`` waits for a full bucket and leaves the
    rest as a debt (a gateway's share of a quota admits what the whole quota would, at the share's rate)."""

    def __init__(self, per_minute: float, capacity: float, clock: Clock = time.monotonic,
                 cell: BucketCell | None = None, most: float | None = None) -> None:
        if per_minute <= 0 or capacity <= 0:
            raise ValueError(f"a bucket needs a rate and a capacity > 0, got {per_minute}/min and {capacity}")
        self.rate = per_minute / 60.0
        self.capacity = float(capacity)
        self.most = max(self.capacity, float(most if most is not None else capacity))
        self._clock = clock
        self._cell: BucketCell = cell if cell is not None else LocalCell(float(capacity), clock())

    def _refill(self, c: BucketCell) -> float:
        now = self._clock()
        c.level = min(self.capacity, c.level + (now - c.at) * self.rate)
        c.at = now
        return c.level

    def _wait(self, c: BucketCell, n: float) -> float:
        if n > self.most:
            return math.inf
        return max(0.0, (min(n, self.capacity) - self._refill(c)) / self.rate)

    def level(self) -> float:
        with self._cell as c:
            return self._refill(c)

    def wait_s(self, n: float) -> float:
        """Seconds until ``n`` tokens can be taken (0: now; inf: never, ``n`` is over ``most``)."""
        with self._cell as c:
            return self._wait(c, n)

    def take(self, n: float) -> float:
        """Take ``n`` tokens if they are there and return 0; else take nothing and return ``wait_s(n)``."""
        with self._cell as c:
            wait = self._wait(c, n)
            if wait == 0:
                c.level -= n
            return wait

    def give(self, n: float) -> None:
        """Return ``n`` tokens (a refund), up to the capacity."""
        with self._cell as c:
            c.level = min(self.capacity, self._refill(c) + n)

    def charge(self, n: float) -> None:
        """Take ``n`` tokens whether or not they are there (a bill settled after the fact)."""
        with self._cell as c:
            c.level = self._refill(c) - n

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        with self._cell as c:
            return max(0.0, (self.capacity - self._refill(c)) / self.rate)

    def level_and_reset_s(self) -> tuple[float, float]:
        """``level()`` and ``reset_s()`` at one instant, under one lock (a refusal's headers: a shared cell's lock
        is two system calls)."""
        with self._cell as c:
            level = self._refill(c)
            return level, max(0.0, (self.capacity - level) / self.rate)


def go_duration(seconds: float) -> str:
    """OpenAI's form of a reset time (Go's duration): ``250ms``, ``6s``, ``1m30s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds)
    m, s = divmod(s, 60)
    h, m = divmod(m, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{s}s"


@dataclass(slots=True)
class Tenant:
    """One tenant as the gateway serves it: its config, the metrics' label, and its buckets (None: no quota)."""

    name: str
    cfg: TenantConfig
    label: str  # the name when the config names this tenant, else OTHER_TENANT: bounded metrics
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    shares: int = 1  # gateway.quota_shares: this gateway's buckets hold 1/shares of the quotas

    def remaining(self, b: TokenBucket) -> tuple[int, float]:
        """What is left of a quota, whole-quota terms (this gateway's level times the shares; the others are
        assumed alike), and the seconds until it is full."""
        level, reset = b.level_and_reset_s()
        return max(0, min(math.floor(b.most), math.floor(level * self.shares))), reset

    def share_note(self) -> str:
        """A refusal's words on the split, when the quota is split between gateways."""
        return (f"; each of the {self.shares} gateways that split it holds 1/{self.shares} (gateway.quota_shares)"
                if self.shares > 1 else "")

    @property
    def has_quotas(self) -> bool:
        return self.requests is not None or self.tokens is not None

    def ratelimit_headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the quotas this tenant has (none without quotas)."""
        h = {}
        for what, b in (("requests", self.requests), ("tokens", self.tokens)):
            if b is not None:
                left, reset = self.remaining(b)
                h[f"x-ratelimit-limit-{what}"] = str(int(b.most))
                h[f"x-ratelimit-remaining-{what}"] = str(left)
                h[f"x-ratelimit-reset-{what}"] = go_duration(reset)
        return h


@dataclass(slots=True)
class Charge:
    """The tokens one generation was charged at admission; ``Tenancy.settle`` bills the real use once."""

    tenant: Tenant
    tokens: int
    settled: bool = False


@dataclass(slots=True)
class Tenancy:
    """Identity, quotas, classes and cache scope for every request of one gateway."""

    tenants: dict[str, Tenant]
    keys: dict[bytes, str] = field(default_factory=dict)  # SHA-256 digest → tenant name
    _default: TenantConfig = field(default_factory=TenantConfig)

    @classmethod
    def from_config(cls, cluster: ClusterConfig, clock: Clock = time.monotonic,
                    shared: HostLimits | None = None) -> Tenancy:
        """Every configured tenant, its buckets full; ``shared``: the buckets live in the host's shared file. With
        ``gateway.quota_shares`` N each bucket holds 1/N of its quota's rate and burst."""
        shares = cluster.gateway.quota_shares
        tenants = {name: _tenant(name, t, clock, shared, shares) for name, t in cluster.tenants.items()}
        keys = {bytes.fromhex(h): name for name, t in cluster.tenants.items() for h in t.keys_sha256}
        for i, entry in enumerate(cluster.gateway.api_keys):
            name, sep, key = entry.rpartition(":")
            name = name if sep and name else f"key-{i}"  # a bare key's tenant is never the key itself
            keys[hashlib.sha256(key.encode()).digest()] = name
            if name not in tenants:
                tenants[name] = _tenant(name, TenantConfig(), clock)
        return cls(tenants, keys)

    def identify(self, authorization: str | None, claimed: str = "") -> Tenant:
        """The tenant of a request from its ``Authorization`` value (``Bearer KEY``); ``claimed`` (the client's
        ``x-tenant-id``) counts only while no key is configured. Raises Unauthenticated."""
        if not self.keys:
            return self.get(claimed)
        if not authorization:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>' (an HTTP header, or gRPC "
                                  "metadata)")
        if authorization[:len(_BEARER)].lower() != _BEARER:
            raise Unauthenticated("invalid API key; send it as 'Authorization: Bearer <key>'")
        digest = hashlib.sha256(authorization[len(_BEARER):].strip().encode()).digest()
        found = self.keys.get(digest)
        if found is None:
            raise Unauthenticated("invalid API key; check the key you were given")
        return self.tenants[found]

    def get(self, name: str) -> Tenant:
        """The tenant of that name; one the config does not name has the defaults and no quotas."""
        t = self.tenants.get(name)
        return t if t is not None else Tenant(name, self._default, OTHER_TENANT)

    # -- quotas ------------------------------------------------------------------------------------------
    def admit_request(self, t: Tenant) -> None:
        """Take one request token (the front door, before any work). Raises QuotaExceeded."""
        if t.requests is None:
            return
        wait = t.requests.take(1)
        if wait:
            raise self._refused(t, "requests", f"tenant {t.name} is over its quota of {t.cfg.rpm} requests per "
                                f"minute (rpm, burst {int(t.requests.most)}){t.share_note()}", wait)

    def refund_request(self, t: Tenant) -> None:
        """Give back the request token of a request that was refused later (nothing is half-admitted)."""
        if t.requests is not None:
            t.requests.give(1)

    def charge(self, t: Tenant, prompt_tokens: int, max_tokens: int) -> Charge:
        """Take ``prompt_tokens + max_tokens`` from the token bucket (after tokenization, before placement).
        Raises QuotaExceeded (not now) or RequestTooLarge (never)."""
        n = prompt_tokens + max_tokens
        if t.tokens is None:
            return Charge(t, n)
        wait = t.tokens.take(n)
        if wait == math.inf:
            raise RequestTooLarge(
                f"the request needs {n} tokens ({prompt_tokens} input + {max_tokens} max_tokens) and tenant "
                f"{t.name}'s quota of tokens per minute (tpm) holds at most {int(t.tokens.most)}; lower "
                "max_tokens or shorten the prompt")
        if wait:
            raise self._refused(t, "tokens", f"tenant {t.name} is over its quota of {t.cfg.tpm} tokens per minute "
                                f"(tpm): this request needs {n} ({prompt_tokens} input + {max_tokens} max_tokens), "
                                f"{t.remaining(t.tokens)[0]} are left{t.share_note()}", wait)
        return Charge(t, n)

    def settle(self, c: Charge, used: int) -> None:
        """Bill ``used`` tokens (input + real output) for a charge: the unused part goes back, an excess is taken."""
        if c.settled:
            return
        c.settled = True
        if c.tenant.tokens is None:
            return
        if used < c.tokens:
            c.tenant.tokens.give(c.tokens - used)
        elif used > c.tokens:
            c.tenant.tokens.charge(used - c.tokens)

    @staticmethod
    def _refused(t: Tenant, quota: str, message: str, wait: float) -> QuotaExceeded:
        retry = max(1, math.ceil(wait))
        headers = {"Retry-After": str(retry), **t.ratelimit_headers()}
        return QuotaExceeded(f"{message}; retry after {retry} s", quota, wait, headers)

    # -- what the workers are told -------------------------------------------------------------------------------
    @staticmethod
    def priority_class(t: Tenant, asked: common_pb2.PriorityClass) -> common_pb2.PriorityClass:
        """The class a request runs in: the one it asks for (unset: the tenant's default), no more urgent than
        the tenant's maximum (the enum's order: interactive 1 < standard 2 < batch 3)."""
        want = asked if asked in CLASS_NAME else CLASS_ENUM[t.cfg.default_class]
        return max(want, CLASS_ENUM[t.cfg.max_class])

    @staticmethod
    def cache_salt(t: Tenant, salt: str) -> str:
        """The prefix cache's scope: the request's own salt inside its tenant's scope, or, for a tenant that
        shares, inside the scope all sharing tenants have in common. A client's salt cannot name another tenant's
        scope: a private scope starts with ``tenant``, a shared salt is prefixed with ``shared``."""
        if not t.name:
            return salt  # no identity (no key configured, no x-tenant-id): the client's salt as it is
        if t.cfg.share_prefix_cache:
            return f"shared\x00{salt}" if salt else ""
        return f"tenant\x00{t.name}\x00{salt}"

    def fill_meta(self, t: Tenant, meta: common_pb2.RequestMeta, asked_class: common_pb2.PriorityClass) -> None:
        """The tenant's fields of a request's RequestMeta (every worker call carries it)."""
        meta.tenant_id = t.name
        meta.priority_class = self.priority_class(t, asked_class)
        meta.tenant_weight = t.cfg.weight
        meta.tenant_max_running = t.cfg.max_running
        meta.cache_salt = self.cache_salt(t, meta.cache_salt)


def _tenant(name: str, cfg: TenantConfig, clock: Clock, shared: HostLimits | None = None, shares: int = 1
            ) -> Tenant:
    def bucket(quota: str, rate: int, capacity: int) -> TokenBucket | None:
        if not rate:
            return None
        cell = shared.bucket_cell(name, quota, capacity / shares, clock) if shared is not None else None
        return TokenBucket(rate / shares, capacity / shares, clock, cell, most=capacity)

    return Tenant(name, cfg, name, bucket("requests", cfg.rpm, cfg.rpm_capacity),
                  bucket("tokens", cfg.tpm, cfg.tpm_capacity), shares)

