"""What each tenant used: per-tenant counters in the gateway's ``/metrics`` and an audit log in JSON lines.

The ``tenant`` label is bounded: tenants the config names (``tenants:`` and ``gateway.api_keys``) by name, every
other one as ``other``. Cost is each tenant's tokens at its configured prices (``price_input_per_mtok``,
``price_output_per_mtok``, per million tokens).

The audit log (``gateway.audit_log``) has one JSON object per line for every generation that ended (each choice of an
HTTP request with ``n`` > 1 is one) and every request refused at the door: ``time`` (UTC, ISO 8601), ``tenant``,
``request_id``, ``model``, ``priority_class``, ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
``status`` (the finish reason, or the error's gRPC code), ``latency_s``, ``migrations``; ``reason`` on a refusal;
``prompt`` and ``output`` only with ``gateway.log_prompts``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import IO, Any

from prometheus_client import CollectorRegistry, Counter

from common.cluster_config import OTHER_TENANT
from services.gateway.tenancy import Tenant

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AuditRecord:
    """One line of the audit log."""

    tenant: str
    request_id: str
    model: str
    status: str
    priority_class: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    latency_s: float = 0.0
    migrations: int = 0
    reason: str | None = None
    prompt: Any = None
    output: str | None = None


_FIELDS = tuple(f.name for f in fields(AuditRecord))
_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # json.dumps's, built once


class Accounting:
    """The tenant counters (in the gateway's registry) and the audit log file (open between ``open`` and
    ``close``). Not thread-safe: the gateway's event loop calls it."""

    def __init__(self, registry: CollectorRegistry, audit_path: str | None, log_prompts: bool,
                 tenants: Iterable[str] = ()) -> None:
        r = registry
        self.requests = Counter("tokenmill:tenant_requests", "Requests admitted, by tenant", ["tenant"], registry=r)
        self.input_tokens = Counter("tokenmill:tenant_input_tokens", "Prompt tokens served, by tenant", ["tenant"],
                                    registry=r)
        self.output_tokens = Counter("tokenmill:tenant_output_tokens", "Generated tokens, by tenant", ["tenant"],
                                     registry=r)
        self.rejected = Counter("tokenmill:tenant_rejected_requests", "Requests refused, by tenant and reason "
                                "(unauthenticated, requests, tokens, too_large, in_flight)", ["tenant", "reason"],
                                registry=r)
        self.cost = Counter("tokenmill:tenant_cost", "Cost of the tokens served at the tenant's configured prices",
                            ["tenant"], registry=r)
        for label in (*tenants, OTHER_TENANT):  # every configured tenant's series from the start, at 0
            for c in (self.requests, self.input_tokens, self.output_tokens, self.cost):
                c.labels(label)
        self.audit_path, self.log_prompts = audit_path, log_prompts
        self._audit: IO[str] | None = None
        # tokenmill:tenant_rejected_requests by (tenant, reason): a refusal counts with a dictionary probe, not
        # prometheus_client's labels() (a lock and a key built every time), as a flooding tenant is refused often
        self._rejected: dict[tuple[str, str], Any] = {}

    def open(self) -> None:
        if self.audit_path:
            self._audit = open(self.audit_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (held open)

    def close(self) -> None:
        if self._audit is not None:
            self._audit.close()
            self._audit = None

    def admitted(self, t: Tenant) -> None:
        self.requests.labels(t.label).inc()

    def refused(self, t: Tenant | None, reason: str, rec: AuditRecord) -> None:
        key = (t.label if t is not None else OTHER_TENANT, reason)
        child = self._rejected.get(key)
        if child is None:
            child = self._rejected[key] = self.rejected.labels(*key)
        child.inc()
        rec.reason = reason
        self.write(rec)

    def served(self, t: Tenant, rec: AuditRecord) -> None:
        """A generation ended (finished, failed or cancelled): its tokens, their cost and its audit line."""
        self.input_tokens.labels(t.label).inc(rec.prompt_tokens)
        self.output_tokens.labels(t.label).inc(rec.completion_tokens)
        cost = (rec.prompt_tokens * t.cfg.price_input_per_mtok
                + rec.completion_tokens * t.cfg.price_output_per_mtok) / 1e6
        if cost:
            self.cost.labels(t.label).inc(cost)
        self.write(rec)

    def write(self, rec: AuditRecord) -> None:
        if self._audit is None:
            return
        line = {"time": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
                **{f: getattr(rec, f) for f in _FIELDS}}  # asdict's keys and values, without its deep copy
        if not self.log_prompts:
            del line["prompt"], line["output"]
        if line["reason"] is None:
            del line["reason"]
        line["latency_s"] = round(line["latency_s"], 4)
        try:
            self._audit.write(_ENCODE(line) + "\n")
        except OSError as e:  # a full disk must not fail requests
            log.error("audit log %s: %s", self.audit_path, e)
