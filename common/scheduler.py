"""Continuous batching by token budget, chunked prefill, priorities, fair share, preemption by recompute.

Every step the scheduler hands out at most ``max_num_batched_tokens`` tokens: running sequences first (a decode
takes one token, an unfinished prefill takes a chunk), then waiting sequences while their blocks fit, interactive
and standard ones before batch ones (running batch sequences come after waiting urgent ones, so a batch prompt's
chunk never takes an urgent sequence's budget); waiting ones in the order of ``common/fair_share.py``: class by class, then the tenant with the lowest virtual token counter, then
(priority, arrival); a tenant at its per-worker cap waits. With one tenant and one class that is (priority,
arrival) order. An interactive or standard sequence that finds no free slot (``max_num_seqs``) or no blocks for
its first chunk preempts batch-class running ones. With ``batch_prefill_tokens_beside_urgent`` set, batch-class prompts get at most that many tokens in a
step that also runs interactive or standard work, and with ``batch_decode_rows_beside_urgent`` set at most that many
batch-class sequences decode in such a step (the others skip it, keeping their blocks); after
``batch_yield_max_steps`` such steps in a row that held batch work back, one step lets every batch decode in and
batch prompts at least a block's worth of tokens (so batch work never starves under steady urgent work); with
``prompt_tokens_beside_decodes`` set, all prompts together get
at most that many in a step while sequences are decoding (their next token then waits for a short step). When a running sequence cannot get a block, one not yet scheduled this step is preempted: batch
class first, then the tenant furthest ahead on its counter, then the lowest priority and latest arrival. Its
blocks are freed (their hashes stay in the prefix cache) and it goes back to waiting, to be recomputed later with
its generated tokens — it finishes with the same output.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from common.block_manager import BlockManager
from common.fair_share import FairQueue
from common.sequence import PriorityClass, Sequence, SequenceStatus


def _running_key(s: Sequence) -> tuple[int, int, float, int]:
    return (s.tenancy.klass, *s.order_key)


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs twice as much, and one is made per row a step
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence's tokens (with one still on the device: that one),
        so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens + self.seq.pending


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What to run this step: prefill chunks first, then decodes."""

    prefills: list[ScheduledSeq]
    decodes: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


@dataclass(slots=True)
class _Step:
    """What one ``schedule`` call has handed out so far."""

    budget: int
    batch_prefill: int | None  # batch-class prompt tokens left for a step with urgent work (None: no limit)
    batch_rows: int | None = None  # batch-class decodes left for a step with urgent work (None: no limit)
    prompt_left: int | None = None  # prompt tokens left for a step beside decoding sequences (None: no limit)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    starved: bool = False  # a running sequence had to be preempted: nothing is admitted
    urgent: bool = False  # the step runs an interactive or standard sequence
    held: bool = False  # a cap held batch-class work back beside urgent work


class Scheduler:
    """Owns the waiting and running queues. Not thread-safe: only the engine loop calls it."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_chunked_prefill: bool = True,
        batch_prefill_tokens_beside_urgent: int | None = None,
        prompt_tokens_beside_decodes: int | None = None,
        batch_decode_rows_beside_urgent: int | None = None,
        batch_yield_max_steps: int | None = None,
    ) -> None:
        """``batch_prefill_tokens_beside_urgent``: the most prompt tokens batch-class sequences get in a step that
        also runs an interactive or standard sequence (None: no limit). ``prompt_tokens_beside_decodes``: the most
        prompt tokens a step takes while running sequences are decoding (None: the step budget; only with chunked
        prefill). ``batch_decode_rows_beside_urgent``: the most batch-class sequences that decode in a step with an
        interactive or standard one (None: no limit); the others skip it, keeping their blocks.
        ``batch_yield_max_steps``: after that many steps in a row in which those caps held batch work back, the next
        step lets every batch decode in and batch prompts at least a block of tokens (None: no bound)."""
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.batch_prefill_tokens_beside_urgent = batch_prefill_tokens_beside_urgent
        self.prompt_tokens_beside_decodes = prompt_tokens_beside_decodes
        self.batch_decode_rows_beside_urgent = batch_decode_rows_beside_urgent
        self.batch_yield_max_steps = batch_yield_max_steps
        self.held_streak = 0  # steps in a row in which a cap held batch work back beside urgent work
        self.waiting = FairQueue()
        self.running: list[Sequence] = []  # sorted by (class, priority, arrival)
        self.num_running_by_class = [0] * len(PriorityClass)
        self.num_preemptions = 0
        self.fast_decodes = True  # ``_run`` schedules plain decodes inline (False: every row by the general path)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose blocks are allocated and computed already (its KV was pulled from a peer)."""
        seq.status = SequenceStatus.RUNNING
        self._insert_running(seq)
        self.waiting.started(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of whichever queue holds it and free its blocks (finish or abort)."""
        if seq in self.running:
            self.detach(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)

    def detach(self, seq: Sequence) -> None:
        """Take a running ``seq`` out of the batch, keeping its blocks (a prefill-only request's go to a lease)."""
        self.running.remove(seq)
        self.num_running_by_class[seq.tenancy.klass] -= 1
        self.waiting.stopped(seq)

    def _insert_running(self, seq: Sequence) -> None:
        bisect.insort(self.running, seq, key=_running_key)
        self.num_running_by_class[seq.tenancy.klass] += 1

    def _victim(self, candidates: list[Sequence]) -> Sequence:
        """Batch class first, then the tenant furthest ahead on its counter, then lowest priority, latest arrival."""
        return max(candidates, key=lambda s: (s.tenancy.klass, self.waiting.counter(s.tenancy.tenant), s.order_key))

    def _make_room(self, st: _Step) -> None:
        """Preempt batch-class running sequences while the next waiting one is more urgent and lacks a slot or the
        blocks of its first chunk (the prefix cache is not counted: it may free a little more than it needs)."""
        head = next(self.waiting.candidates(), None)
        if head is None or head.tenancy.klass == PriorityClass.BATCH:
            return
        need = self.bm.blocks_needed(min(head.num_tokens, self.max_num_batched_tokens))
        while len(self.running) >= self.max_num_seqs or not self.bm.can_allocate(need):
            victims = [s for s in self.running if s.tenancy.klass == PriorityClass.BATCH]
            if not victims:
                return
            victim = self._victim(victims)
            self._preempt(victim)
            st.preempted.append(victim)

    def _preempt(self, victim: Sequence) -> None:
        self.bm.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.add(victim)  # queued before it stops running, so its tenant stays active and is not lifted
        self.detach(victim)

    def schedule(self) -> SchedulerOutput:
        prompts, rows = self.batch_prefill_tokens_beside_urgent, self.batch_decode_rows_beside_urgent
        relief = self.batch_yield_max_steps is not None and self.held_streak >= self.batch_yield_max_steps
        if relief:
            # batch work has yielded that many steps in a row: this one lets its decodes in, and a block of prompt
            rows = None
            if prompts is not None:
                prompts = max(prompts, self.bm.block_size)
        st = _Step(self.max_num_batched_tokens, prompts, rows)
        # without chunked prefill a prompt cannot be split, so a cap would hold a longer one back while anything
        # decodes: it applies only with chunks
        if (self.prompt_tokens_beside_decodes is not None and self.enable_chunked_prefill
                and any(_decoding(s) for s in self.running)):
            st.prompt_left = self.prompt_tokens_beside_decodes
        # 0. an interactive or standard sequence that finds no free slot or blocks takes them from batch-class ones
        self._make_room(st)
        # 1. running interactive and standard sequences, then those waiting (unless one had to be preempted), then
        # running batch ones and waiting batch ones: a batch prompt's chunk never takes the budget of an urgent one
        i = self._run(st, 0, urgent_only=True)
        if not st.starved:
            self._admit(st, urgent_only=True)
        i = sum(self.num_running_by_class[:PriorityClass.BATCH])  # admissions were inserted before the batch ones
        self._run(st, i, urgent_only=False)
        if not st.starved:
            self._admit(st, urgent_only=False)
        self.held_streak = self.held_streak + 1 if st.held and not relief else 0
        return SchedulerOutput(st.prefills, st.decodes, st.preempted)

    def _limit(self, st: _Step, seq: Sequence, n: int) -> int:
        """``n`` tokens for ``seq``, fewer when it is a prompt chunk beside decoding sequences or a batch-class
        prompt chunk beside urgent work; none for a batch-class decode beside urgent work past the step's rows."""
        if st.prompt_left is not None and _prompt_chunk(seq):
            n = min(n, st.prompt_left)
        if self._limited(st, seq) and st.batch_prefill is not None and n > st.batch_prefill:
            n = st.batch_prefill
            st.held = True
        if self._row_limited(st, seq) and st.batch_rows is not None and st.batch_rows <= 0:
            n = 0
            st.held = True
        return n

    @staticmethod
    def _limited(st: _Step, seq: Sequence) -> bool:
        return (st.urgent and st.batch_prefill is not None and seq.tenancy.klass == PriorityClass.BATCH
                and _prompt_chunk(seq))

    @staticmethod
    def _row_limited(st: _Step, seq: Sequence) -> bool:
        return (st.urgent and st.batch_rows is not None and seq.tenancy.klass == PriorityClass.BATCH
                and not _prompt_chunk(seq))

    def _scheduled(self, st: _Step, item: ScheduledSeq, prefill: bool) -> None:
        seq, n = item.seq, item.num_tokens
        (st.prefills if prefill else st.decodes).append(item)
        self.waiting.charge(seq, n, item.samples)
        st.budget -= n
        if st.prompt_left is not None and prefill and _prompt_chunk(seq):
            st.prompt_left -= n
        if self._limited(st, seq):
            assert st.batch_prefill is not None
            st.batch_prefill -= n
        if self._row_limited(st, seq):
            assert st.batch_rows is not None
            st.batch_rows -= 1
        st.urgent = st.urgent or seq.tenancy.klass != PriorityClass.BATCH

    def _run(self, st: _Step, i: int, urgent_only: bool) -> int:
        """Schedule running sequences from index ``i`` (only interactive and standard ones if ``urgent_only``),
        preempting when blocks run out. Returns the index it stopped at."""
        bm, bs, running = self.bm, self.bm.block_size, self.running
        while i < len(running) and st.budget > 0:
            seq = running[i]
            klass = seq.tenancy.klass
            if urgent_only and klass == PriorityClass.BATCH:
                break
            c = seq.num_computed_tokens
            if (self.fast_decodes and (seq.output_ids or seq.pending)
                    and c == len(seq.prompt_ids) + len(seq.output_ids) + seq.pending - 1
                    and not (st.urgent and st.batch_rows is not None and klass == PriorityClass.BATCH)):
                # a decode no row cap applies to (most rows of most steps): what the general path below does for
                # it, without its per-row calls; one whose token needs a block when none is free goes on below
                # (it preempts)
                if seq.pending_final:
                    i += 1
                    continue
                grows = c >= len(seq.block_ids) * bs  # its token starts a block
                if not grows or bm.can_allocate(1):
                    if grows:
                        bm.allocate(seq, c + 1)
                    st.decodes.append(ScheduledSeq(seq, 1))
                    self.waiting.charge_decode(seq)
                    st.budget -= 1
                    st.urgent = st.urgent or klass != PriorityClass.BATCH
                    i += 1
                    continue
            n = self._limit(st, seq, min(seq.num_tokens + seq.pending - seq.num_computed_tokens, st.budget))
            if n == 0 or seq.pending_final:  # a batch prompt or decode that waits for a step without urgent work,
                i += 1  # or a sequence whose token on the device ends it
                continue
            while not self.bm.can_allocate(self.bm.num_new_blocks(seq, seq.num_computed_tokens + n)):
                victim = self._victim(self.running[i:])  # never what this step already runs
                self._preempt(victim)
                st.preempted.append(victim)
                st.starved = True
                if victim is seq:
                    break
            else:
                self.bm.allocate(seq, seq.num_computed_tokens + n)
                self._scheduled(st, ScheduledSeq(seq, n), prefill=not (n == 1 and (seq.output_ids or seq.pending)))
                i += 1
                continue
            if victim is seq:
                continue  # seq left the running list; the index now points at the next one
        return i

    def _admit(self, st: _Step, urgent_only: bool) -> None:
        """Admit waiting sequences in fair-share order while the budget, the slots and the blocks allow."""
        for seq in self.waiting.candidates():
            if st.budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if urgent_only and seq.tenancy.klass == PriorityClass.BATCH:
                break
            if seq.pending:  # preempted with a token still on the device: admitted once that token is known (the
                break  # next step; the queue's head is only passed over by admitting it)
            hit = self.bm.match_prefix(seq) if not seq.block_ids else []
            computed = len(hit) * self.bm.block_size
            remaining = seq.num_tokens - computed
            n = self._limit(st, seq, min(remaining, st.budget))
            if n == 0 or (n < remaining and not self.enable_chunked_prefill):
                break
            # blocks to add beyond the cached hit; hit blocks that sit in the free list are taken from it too
            need = self.bm.blocks_needed(computed + n) - len(hit)
            need += sum(1 for b in hit if self.bm.blocks[b].ref_count == 0)
            if not self.bm.can_allocate(need):
                break
            self.waiting.admit(seq)
            self.bm.admit(seq, None if seq.block_ids else hit)
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self._insert_running(seq)
            self._scheduled(st, ScheduledSeq(seq, n), prefill=True)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` for everything that ran, and register newly full blocks. A sequence
        that finished meanwhile (async scheduling: its last token was known only after this step was scheduled) is
        left as it is: its blocks are freed."""
        bm = self.bm
        bs = bm.block_size if bm.enable_prefix_caching else 0
        finished = SequenceStatus.FINISHED
        for item in (*out.prefills, *out.decodes):
            seq = item.seq
            if seq.status is finished:
                continue
            seq.num_computed_tokens += item.num_tokens
            if bs and seq.num_computed_tokens // bs > len(seq.block_hashes):  # a block filled up: most steps none
                bm.commit_full_blocks(seq)


def _prompt_chunk(seq: Sequence) -> bool:
    """``seq``'s next tokens are a prompt chunk (more than its last token left to compute)."""
    return seq.num_computed_tokens < seq.num_tokens - 1


def _decoding(seq: Sequence) -> bool:
    """A running ``seq`` that has produced a token and goes on (not a prefill-only one whose first token ends it)."""
    return bool(seq.output_ids or seq.pending) and not seq.pending_final and not _prompt_chunk(seq)
