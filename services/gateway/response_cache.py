"""The gateway's response cache: a deterministic request asked again within a TTL is answered from here, replayed as
the same stream of ``GenerateResponse``s, without a tokenizer, router or worker call.

- Cached: requests with ``temperature`` 0 (greedy) or a ``seed``, whose answer finished with ``stop`` or
  ``length``; never an aborted, filtered (``content_filter``) or failed one, never a sampled request without seed.
- Key: SHA-256 of the tenant, the served model and the request as sent (its input, model and every sampling
  parameter, structured output and logprobs included; deterministic serialization), less the fields that do not
  change the output (request id, priority, priority class, prefix-cache salt, the bypass flag). Tenants never share
  an entry.
- Bounded by ``gateway.response_cache_bytes`` (an entry weighs its serialized responses plus its key), least
  recently used evicted first; an entry older than ``gateway.response_cache_ttl_s`` is a miss and is dropped.
- ``GenerateRequest.skip_response_cache`` (HTTP: the body field ``skip_response_cache`` or ``Cache-Control:
  no-cache``) answers from a worker; its answer replaces the entry.
- Metrics (the gateway's ``/metrics``): ``tokenmill:response_cache_hits`` / ``_misses`` / ``_evictions`` /
  ``_bypasses``, ``tokenmill:response_cache_bytes`` and ``tokenmill:response_cache_entries``.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge
from tokenmill.v1 import frontend_pb2

ENTRY_OVERHEAD = 64  # bytes counted per entry beyond its key and responses (its bookkeeping)
_IGNORED = ("request_id", "priority", "priority_class", "cache_salt", "skip_response_cache")


def cacheable(req: frontend_pb2.GenerateRequest) -> bool:
    """Whether the request's output is a function of the request: greedy, or sampled with a seed."""
    p = req.params
    return (p.HasField("temperature") and p.temperature == 0.0) or p.HasField("seed")


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.hits = Counter("tokenmill:response_cache_hits", "Requests answered from the response cache",
                            registry=r)
        self.misses = Counter("tokenmill:response_cache_misses", "Cacheable requests the response cache did not "
                              "hold (or held expired)", registry=r)
        self.evictions = Counter("tokenmill:response_cache_evictions", "Entries evicted to stay within "
                                 "gateway.response_cache_bytes", registry=r)
        self.bypasses = Counter("tokenmill:response_cache_bypasses", "Cacheable requests that asked to skip the "
                                "cache", registry=r)
        self.bytes = Gauge("tokenmill:response_cache_bytes", "Bytes held by the response cache", registry=r)
        self.entries = Gauge("tokenmill:response_cache_entries", "Entries in the response cache", registry=r)


@dataclass(slots=True)
class _Entry:
    expires: float
    responses: list[bytes]  # serialized GenerateResponses, request_id and seq cleared
    size: int


class ResponseCache:
    """LRU by bytes with a TTL. Single-threaded (the gateway's event loop)."""

    def __init__(self, max_bytes: int, ttl_s: float, metrics: CacheMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes, self.ttl_s, self.m, self.clock = max_bytes, ttl_s, metrics, clock
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(tenant: str, model: str, req: frontend_pb2.GenerateRequest) -> bytes:
        r = frontend_pb2.GenerateRequest()
        r.CopyFrom(req)
        for name in _IGNORED:
            r.ClearField(name)
        h = hashlib.sha256()
        for part in (tenant.encode(), model.encode(), r.SerializeToString(deterministic=True)):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.digest()

    def get(self, key: bytes) -> list[frontend_pb2.GenerateResponse] | None:
        """The cached stream (fresh messages), or None (a miss: counted; an expired entry is dropped)."""
        e = self._entries.get(key)
        if e is not None and e.expires <= self.clock():
            self._drop(key)
            e = None
        if e is None:
            self.m.misses.inc()
            return None
        self._entries.move_to_end(key)
        self.m.hits.inc()
        return [frontend_pb2.GenerateResponse.FromString(b) for b in e.responses]

    def put(self, key: bytes, responses: list[frontend_pb2.GenerateResponse]) -> bool:
        """Store a finished stream; False when it alone is larger than the whole cache."""
        blobs = []
        for resp in responses:
            r = frontend_pb2.GenerateResponse()
            r.CopyFrom(resp)
            r.ClearField("request_id")
            r.ClearField("seq")
            blobs.append(r.SerializeToString())
        size = len(key) + ENTRY_OVERHEAD + sum(len(b) for b in blobs)
        if size > self.max_bytes:
            return False
        if key in self._entries:
            self._drop(key)
        while self.bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.m.evictions.inc()
        self._entries[key] = _Entry(self.clock() + self.ttl_s, blobs, size)
        self.bytes += size
        self._gauges()
        return True

    def _drop(self, key: bytes) -> None:
        e = self._entries.pop(key)
        self.bytes -= e.size
        self._gauges()

    def _gauges(self) -> None:
        self.m.bytes.set(self.bytes)
        self.m.entries.set(len(self._entries))
