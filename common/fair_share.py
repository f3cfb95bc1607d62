"""Fair share between tenants inside one worker: priority classes, then the Virtual Token Counter.

Waiting sequences are admitted class by class (interactive, standard, batch). Within a class the tenant with the
lowest counter goes first (ties: the (priority, arrival) order of the tenants' first waiting sequences). This is the
Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024):

- a tenant's counter advances with the tokens it is served, ``PREFILL_WEIGHT`` per prompt token the engine
  computes (prefix-cache hits and recomputes after a preemption are not billed) and ``DECODE_WEIGHT`` per
  generated token (the paper's w_p = 1, w_q = 2), divided by the tenant's weight;
- a tenant that becomes active (its first waiting or running sequence on this worker) is lifted to the lowest
  counter of the active tenants, or, when none is active, to the counter of the last tenant that was: idle time
  banks no credit.

A tenant's running sequences are capped per worker (``Tenancy.max_running``): a capped tenant's sequences wait
while other tenants' are admitted.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator
from dataclasses import dataclass

from common.sequence import PriorityClass, Sequence

PREFILL_WEIGHT = 1.0
DECODE_WEIGHT = 2.0
_PRUNE_AT = 1024  # tenant records kept before inactive ones that would be lifted anyway are dropped


@dataclass(slots=True)
class TenantState:
    """One tenant's counter and its sequences on this worker."""

    counter: float = 0.0
    weight: float = 1.0
    max_running: int | None = None
    running: int = 0
    waiting: int = 0

    @property
    def active(self) -> bool:
        return self.running > 0 or self.waiting > 0

    @property
    def capped(self) -> bool:
        return self.max_running is not None and self.running >= self.max_running


def _order_key(s: Sequence) -> tuple[int, float, int]:
    return s.order_key


class FairQueue:
    """The waiting sequences (one queue per class and tenant, each in (priority, arrival) order) and every
    tenant's counter and running count. Not thread-safe: only the scheduler calls it."""

    def __init__(self) -> None:
        self._queues: list[dict[str, list[Sequence]]] = [{} for _ in PriorityClass]  # [class][tenant]
        self._tenants: dict[str, TenantState] = {}
        self._floor = 0.0  # the counter of the last tenant that went idle while no other one was active
        self.num_waiting_by_class = [0] * len(PriorityClass)

    # -- the waiting sequences -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(self.num_waiting_by_class)

    def __bool__(self) -> bool:
        return any(self.num_waiting_by_class)

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence, in no particular order."""
        for queues in self._queues:
            for q in queues.values():
                yield from q

    def __contains__(self, seq: object) -> bool:
        if not isinstance(seq, Sequence):
            return False
        q = self._queues[seq.tenancy.klass].get(seq.tenancy.tenant)
        return q is not None and seq in q

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; its tenant's weight and cap are taken from it (the latest request's win)."""
        t = self._state(seq)
        q = self._queues[seq.tenancy.klass].setdefault(seq.tenancy.tenant, [])
        bisect.insort(q, seq, key=_order_key)
        t.waiting += 1
        self.num_waiting_by_class[seq.tenancy.klass] += 1

    def admit(self, seq: Sequence) -> None:
        """A waiting ``seq`` joins the running batch (its tenant stays active throughout)."""
        self._tenants[seq.tenancy.tenant].running += 1
        self.remove(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a waiting ``seq`` out (aborted). Raises ValueError if it is not waiting."""
        queues = self._queues[seq.tenancy.klass]
        q = queues.get(seq.tenancy.tenant)
        if q is None:
            raise ValueError(f"{seq.request_id} is not waiting")
        q.remove(seq)
        if not q:
            del queues[seq.tenancy.tenant]
        self.num_waiting_by_class[seq.tenancy.klass] -= 1
        t = self._tenants[seq.tenancy.tenant]
        t.waiting -= 1
        self._maybe_idle(t)

    def candidates(self) -> Iterator[Sequence]:
        """Waiting sequences in admission order, for one scheduling pass: class by class, within a class the
        uncapped tenant with the lowest counter, its first sequence. The caller admits what it takes (``admit``,
        then ``charge``) before asking for the next one, or stops asking; what that changes
        (counters, caps, queue heads) is seen by the next one. O(tenants + admitted × log tenants) a pass."""
        for queues in self._queues:
            heap = [(self._tenants[name].counter, q[0].order_key, name) for name, q in queues.items()]
            heapq.heapify(heap)
            while heap:
                name = heap[0][2]
                q = queues.get(name)
                t = self._tenants[name]
                if not q or t.capped:
                    heapq.heappop(heap)
                    continue
                current = (t.counter, q[0].order_key, name)
                if current != heap[0]:  # admitted from since it was pushed: its counter and head moved
                    heapq.heapreplace(heap, current)
                    continue
                yield q[0]

    # -- the tenants ---------------------------------------------------------------------------------------
    def counter(self, tenant: str) -> float:
        """The tenant's virtual token counter (0.0 for one never seen)."""
        t = self._tenants.get(tenant)
        return t.counter if t is not None else 0.0

    def tenant(self, tenant: str) -> TenantState | None:
        return self._tenants.get(tenant)

    def started(self, seq: Sequence) -> None:
        """``seq`` joined the running batch without waiting (its KV was pulled from a peer)."""
        self._state(seq).running += 1

    def stopped(self, seq: Sequence) -> None:
        """``seq`` left the running batch (finished, aborted, preempted, or its blocks went to a lease)."""
        t = self._tenants[seq.tenancy.tenant]
        t.running -= 1
        self._maybe_idle(t)

    def charge(self, seq: Sequence, num_tokens: int, samples: bool) -> None:
        """Bill ``num_tokens`` computed from ``seq.num_computed_tokens`` on, and a generated token if ``samples``:
        prompt positions not billed before at ``PREFILL_WEIGHT``, the new token at ``DECODE_WEIGHT``."""
        end = min(seq.num_computed_tokens + num_tokens, seq.num_prompt_tokens)
        new_prompt = max(0, end - max(seq.num_computed_tokens, seq.num_charged_tokens))
        seq.num_charged_tokens = max(seq.num_charged_tokens, end)
        cost = PREFILL_WEIGHT * new_prompt + (DECODE_WEIGHT if samples else 0.0)
        if cost:
            t = self._tenants[seq.tenancy.tenant]
            t.counter += cost / t.weight

    def charge_decode(self, seq: Sequence) -> None:
        """:meth:`charge` of a decode: one token computed past the prompt, one generated."""
        if seq.num_charged_tokens < len(seq.prompt_ids):  # its prompt was computed elsewhere (a pulled KV)
            seq.num_charged_tokens = len(seq.prompt_ids)
        t = self._tenants[seq.tenancy.tenant]
        t.counter += DECODE_WEIGHT / t.weight

    def _state(self, seq: Sequence) -> TenantState:
        name = seq.tenancy.tenant
        t = self._tenants.get(name)
        if t is None or not t.active:
            level = self._lift_level()
            if t is None:
                if len(self._tenants) >= _PRUNE_AT:
                    self._prune(level)
                t = self._tenants[name] = TenantState()
            t.counter = max(t.counter, level)
        t.weight = seq.tenancy.weight
        t.max_running = seq.tenancy.max_running
        return t

    def _lift_level(self) -> float:
        """Where a tenant that becomes active starts: the lowest counter of the active tenants, or the floor."""
        return min((t.counter for t in self._tenants.values() if t.active), default=self._floor)

    def _maybe_idle(self, t: TenantState) -> None:
        if not t.active and not any(o.active for o in self._tenants.values()):
            self._floor = max(self._floor, t.counter)

    def _prune(self, level: float) -> None:
        """Forget inactive tenants at or below ``level``: they would be lifted to it when they come back (the lift
        level never falls), so their records carry nothing."""
        for name in [n for n, t in self._tenants.items() if not t.active and t.counter <= level]:
            del self._tenants[name]
