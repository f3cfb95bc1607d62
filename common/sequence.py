"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from common.sampling import SamplingParams
from common.structured import GrammarMatcher

FED = -1  # a step's input id that is still on the device (``Sequence.input_token``), written there before the forward


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class PriorityClass(enum.IntEnum):
    """Admission order (lower first) and preemption order (higher first)."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2


@dataclass(frozen=True, slots=True)
class Tenancy:
    """Whose request this is, as the gateway resolved it: the scheduler's fair share reads it.

    ``weight`` scales the tenant's share of served tokens; ``max_running`` caps its running sequences on this
    worker (None: no cap)."""

    tenant: str = ""
    klass: PriorityClass = PriorityClass.STANDARD
    weight: float = 1.0
    max_running: int | None = None

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"tenant weight must be > 0, got {self.weight}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"tenant max_running must be >= 1 (or unset), got {self.max_running}")


DEFAULT_TENANCY = Tenancy()


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client
    CONTENT_FILTER = "content_filter"  # the output filter blocked the stream (set by the OutputProcessor)


@dataclass(eq=False, slots=True)
class Sequence:
    """A request as the scheduler sees it: ``num_computed_tokens`` catches up to ``num_tokens``.

    Prefill, chunked prefill and decode are the same thing with different gaps between the two.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int
    priority: int = 0  # lower runs first
    arrival: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0  # tie-break for equal arrival times
    cache_salt: str = ""
    tenancy: Tenancy = DEFAULT_TENANCY
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the first admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks registered so far
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    first_scheduled: float | None = None  # time.monotonic() of its first prompt chunk in a step
    admitted: bool = False
    # a constrained request: its grammar, advanced past every output token (outputs survive preemption, so it does)
    matcher: GrammarMatcher | None = None
    num_charged_tokens: int = 0  # tokens billed to the tenant's fair-share counter (a recompute is not billed again)
    # async scheduling: a token sampled on the device and not yet appended to output_ids (0 or 1). A running
    # sequence with one decodes it in the next step (its input id comes from the device); ``pending_final``: that
    # token ends the sequence whatever it is (max_tokens, the context, a prefill-only request), so it is not scheduled
    pending: int = 0
    pending_final: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, i: int) -> int:
        p = len(self.prompt_ids)
        return self.prompt_ids[i] if i < p else self.output_ids[i - p]

    def input_token(self, i: int) -> int:
        """Token ``i`` as a step's input id: ``FED`` for the one still on the device (async scheduling), which the
        step's ``TokenFeed`` writes on the device (and which tells a tensor-parallel rank other than 0 which rows
        rank 0 feeds)."""
        return self.token_at(i) if i < self.num_tokens else FED

    def tokens_range(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def order_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival, self.arrival_seq)
