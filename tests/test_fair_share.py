"""Fair share on the real Scheduler and Sequence: the Virtual Token Counter, classes, caps, preemption order.

A step loop without a model: every scheduled item advances as the engine's would, a sampled item gets one output
token, a sequence with ``max_tokens`` outputs finishes and frees its blocks.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from common.block_manager import BlockManager
from common.config import EngineConfig
from common.fair_share import DECODE_WEIGHT, PREFILL_WEIGHT
from common.sampling import SamplingParams
from common.scheduler import Scheduler, SchedulerOutput
from common.sequence import PriorityClass, Sequence, SequenceStatus, Tenancy

BAT, INT, STD = PriorityClass.BATCH, PriorityClass.INTERACTIVE, PriorityClass.STANDARD
_ids = itertools.count()


def seq(tenant: str = "", klass: PriorityClass = STD, weight: float = 1.0, cap: int | None = None, prompt: int = 16,
        max_tokens: int = 16, priority: int = 0) -> Sequence:
    n = next(_ids)
    return Sequence(f"{tenant}-{n}", [(n * 7 + i) % 1000 for i in range(prompt)], SamplingParams(), seed=0,
                    max_tokens=max_tokens, priority=priority, arrival=float(n), arrival_seq=n,
                    tenancy=Tenancy(tenant, klass, weight, cap))


class Loop:
    """The engine's step loop on the real scheduler, without a model; counts the weighted tokens served."""

    def __init__(self, blocks: int = 256, budget: int = 64, max_seqs: int = 8, batch_prefill: int | None = None,
                 batch_rows: int | None = None, yield_steps: int | None = None) -> None:
        self.sch = Scheduler(BlockManager(blocks, 4, "m", enable_prefix_caching=False), budget, max_seqs,
                             batch_prefill_tokens_beside_urgent=batch_prefill,
                             batch_decode_rows_beside_urgent=batch_rows, batch_yield_max_steps=yield_steps)
        self.served: Counter[str] = Counter()
        self.admitted: list[Sequence] = []

    def step(self) -> SchedulerOutput:
        out = self.sch.schedule()
        self.admitted += [i.seq for i in out.prefills if i.seq.num_computed_tokens == 0 and not i.seq.output_ids]
        for item in (*out.prefills, *out.decodes):
            s = item.seq
            prompt = max(0, min(s.num_computed_tokens + item.num_tokens, s.num_prompt_tokens) - s.num_computed_tokens)
            self.served[s.tenancy.tenant] += PREFILL_WEIGHT * prompt + (DECODE_WEIGHT if item.samples else 0)
        sampled = [i.seq for i in (*out.prefills, *out.decodes) if i.samples]
        self.sch.update_after_step(out)
        for s in sampled:
            s.output_ids.append(1)
            if len(s.output_ids) >= s.max_tokens:
                self.sch.remove(s)
        return out

    def waiting(self, tenant: str) -> int:
        return sum(1 for s in self.sch.waiting if s.tenancy.tenant == tenant)

    def top_up(self, tenant: str, backlog: int, **kw) -> None:
        """Keep ``backlog`` of the tenant's sequences waiting (a tenant that always has work)."""
        for _ in range(backlog - self.waiting(tenant)):
            self.sch.add(seq(tenant, **kw))

    def drain(self) -> None:
        while self.sch.has_work():
            self.step()
        assert self.sch.bm.num_free_blocks == self.sch.bm.num_blocks


def shares(loop: Loop, steps: int, backlogs: dict[str, int], weights: dict[str, float]) -> dict[str, float]:
    """Run ``steps`` with every tenant backlogged; each tenant's share of the weighted tokens served."""
    before = Counter(loop.served)
    for _ in range(steps):
        for t, n in backlogs.items():
            loop.top_up(t, n, weight=weights[t])
        loop.step()
    got = {t: loop.served[t] - before[t] for t in backlogs}
    total = sum(got.values())
    return {t: v / total for t, v in got.items()}


def test_a_flooding_tenant_gets_its_share_not_more():
    loop = Loop()
    shares(loop, 50, {"flood": 100, "calm": 2}, {"flood": 1.0, "calm": 1.0})  # warm up
    got = shares(loop, 400, {"flood": 100, "calm": 2}, {"flood": 1.0, "calm": 1.0})
    assert got["calm"] == pytest.approx(0.5, abs=0.05)
    loop.drain()


def test_weights_two_to_one():
    loop = Loop()
    w = {"gold": 2.0, "bronze": 1.0}
    shares(loop, 50, {"gold": 20, "bronze": 20}, w)
    got = shares(loop, 400, {"gold": 20, "bronze": 20}, w)
    assert got["gold"] / got["bronze"] == pytest.approx(2.0, rel=0.1)
    loop.drain()


def test_an_idle_tenant_banks_no_credit():
    loop = Loop()
    both = {"a": 10, "b": 10}
    w = {"a": 1.0, "b": 1.0}
    shares(loop, 100, both, w)
    while loop.waiting("b") or any(s.tenancy.tenant == "b" for s in loop.sch.running):
        loop.top_up("a", 10)
        loop.step()
    shares(loop, 300, {"a": 10}, {"a": 1.0})  # b idle, a alone: a's counter runs far ahead
    fq = loop.sch.waiting
    assert fq.counter("a") > fq.counter("b") + 1000
    loop.sch.add(seq("b"))
    assert fq.counter("b") == fq.counter("a")  # lifted on return: the idle time bought nothing
    got = shares(loop, 300, both, w)
    assert got["b"] == pytest.approx(0.5, abs=0.05)
    loop.drain()


def test_the_last_idle_tenants_counter_is_the_floor():
    loop = Loop()
    shares(loop, 100, {"a": 10}, {"a": 1.0})
    loop.drain()  # nobody active now
    loop.sch.add(seq("b"))
    assert loop.sch.waiting.counter("b") == loop.sch.waiting.counter("a") > 0
    loop.drain()


def test_classes_are_admitted_in_order_whatever_the_counters():
    loop = Loop(budget=16, max_seqs=1)  # one admission at a time
    loop.sch.add(seq("poor", STD))  # arrives first, runs to its end, and its decodes put poor's counter ahead
    loop.step()
    for s in [seq("poor", BAT), seq("rich", BAT), seq("poor", STD), seq("rich", STD), seq("poor", INT), seq("rich", INT)]:
        loop.sch.add(s)
    loop.step()
    assert loop.sch.waiting.counter("poor") > loop.sch.waiting.counter("rich")
    loop.drain()
    order = [(s.tenancy.klass, s.tenancy.tenant) for s in loop.admitted[1:]]
    # interactive, standard, batch; within a class the tenant behind on its counter first, whatever its arrival
    assert [k for k, _ in order] == [INT, INT, STD, STD, BAT, BAT]
    assert order[0] == (INT, "rich")


def test_a_tenant_is_capped_per_worker():
    loop = Loop(max_seqs=8)
    for _ in range(10):
        loop.sch.add(seq("capped", cap=2))
    others = [seq("other") for _ in range(3)]
    for s in others:
        loop.sch.add(s)
    most = 0
    while loop.sch.has_work():
        loop.step()
        running = Counter(s.tenancy.tenant for s in loop.sch.running)
        most = max(most, running["capped"])
        if len(loop.admitted) == 5:  # two of capped, then every other one though capped came first
            assert {s.request_id for s in others} <= {s.request_id for s in loop.admitted}
    assert most == 2
    assert sum(1 for s in loop.admitted if s.tenancy.tenant == "capped") == 10


def test_batch_prompts_go_on_in_small_chunks_beside_urgent_work():
    loop = Loop(budget=64, batch_prefill=8)
    urgent = seq("u", INT, prompt=4, max_tokens=6)
    loop.sch.add(urgent)
    loop.step()  # the interactive prompt; it decodes from now on
    big, other = seq("b", BAT, prompt=40), seq("b", BAT, prompt=40)
    loop.sch.add(big)
    loop.sch.add(other)
    chunks = []
    while urgent.status is not SequenceStatus.FINISHED:
        out = loop.sch.schedule()
        chunks.append(sum(i.num_tokens for i in out.prefills if i.seq.tenancy.klass == BAT))
        assert [i.seq for i in out.decodes] == [urgent]
        loop.sch.update_after_step(out)
        urgent.output_ids.append(1)
        if len(urgent.output_ids) >= urgent.max_tokens:
            urgent.status = SequenceStatus.FINISHED
            loop.sch.remove(urgent)
    assert chunks == [8] * 5  # 8 prompt tokens a step in all, shared by both batch prompts
    out = loop.sch.schedule()  # nothing urgent left: both prompts' remaining 40 tokens at once
    assert sum(i.num_tokens for i in out.prefills) == 80 - 40 and all(i.samples for i in out.prefills)
    loop.sch.update_after_step(out)
    for s in (big, other):
        loop.sch.remove(s)


def test_batch_prompts_pause_beside_urgent_work_at_zero():
    """``batch_prefill_tokens_beside_urgent=0``: a batch prompt, running or waiting, gets no token in a step that
    runs urgent work, and goes on whole once none does; nothing is preempted."""
    loop = Loop(budget=64, batch_prefill=0)
    started = seq("b", BAT, prompt=40)
    loop.sch.add(started)
    loop.sch.add(urgent := seq("u", INT, prompt=4, max_tokens=6))
    out = loop.step()  # the urgent prompt first; the batch prompt gets none of the step beside it
    assert [i.seq for i in out.prefills] == [urgent]
    waiting = seq("b", BAT, prompt=40)
    loop.sch.add(waiting)
    while urgent.status is not SequenceStatus.FINISHED:
        out = loop.step()
        assert [i.seq for i in (*out.prefills, *out.decodes)] == [urgent]
        if len(urgent.output_ids) >= urgent.max_tokens:
            urgent.status = SequenceStatus.FINISHED
    assert started.num_computed_tokens == waiting.num_computed_tokens == 0 and loop.sch.num_preemptions == 0
    out = loop.step()  # nothing urgent left: both prompts at once
    assert sorted(i.num_tokens for i in out.prefills) == [24, 40]  # the step's budget of 64
    loop.drain()
    assert len(started.output_ids) == len(waiting.output_ids) == 16


def test_batch_work_held_back_beside_urgent_work_moves_every_yield_max_steps():
    """``batch_yield_max_steps``: under steady urgent work, batch work paused by the caps (0 rows, 0 prompt tokens)
    gets one step in every ``batch_yield_max_steps`` + 1: every batch decode, and a block of a batch prompt."""
    loop = Loop(budget=64, batch_prefill=0, batch_rows=0, yield_steps=3)
    flood = [seq("b", BAT, prompt=4, max_tokens=200) for _ in range(3)]
    for s in flood:
        loop.sch.add(s)
    loop.step()  # their prompts; they decode from now on
    urgent = seq("u", INT, prompt=4, max_tokens=200)  # steady urgent work
    loop.sch.add(urgent)
    loop.step()
    prompt = seq("b", BAT, prompt=40)
    loop.sch.add(prompt)
    rows, chunks = [], []
    for _ in range(12):
        out = loop.step()
        assert urgent in [i.seq for i in out.decodes]
        rows.append(sum(1 for i in out.decodes if i.seq.tenancy.klass == BAT))
        chunks.append(sum(i.num_tokens for i in out.prefills if i.seq is prompt))
    # the urgent prompt's step held the flood back first: the streak starts there
    assert rows == [0, 0, 3] + [0, 0, 0, 3] * 2 + [0]
    assert chunks == [0, 0, 4] + [0, 0, 0, 4] * 2 + [0]  # a block (4 tokens) of the batch prompt in each relief step
    assert loop.sch.num_preemptions == 0
    assert EngineConfig().batch_yield_max_steps == 32
    with pytest.raises(ValueError, match="batch_yield_max_steps must be >= 1"):
        EngineConfig(batch_yield_max_steps=0)


def test_batch_prefill_tokens_negative_is_refused():
    assert EngineConfig(batch_prefill_tokens_beside_urgent=0).batch_prefill_tokens_beside_urgent == 0
    with pytest.raises(ValueError, match="batch_prefill_tokens_beside_urgent must be >= 0"):
        EngineConfig(batch_prefill_tokens_beside_urgent=-1)


@pytest.mark.parametrize("rows", [0, 2])
def test_batch_decodes_beside_urgent_work_are_capped_and_keep_their_blocks(rows):
    """With ``batch_decode_rows_beside_urgent`` at most that many batch sequences decode in a step with urgent work
    (in the running order: priority, then arrival); the others skip it with their blocks held, and all decode
    again once no urgent work runs. Every sequence still finishes with all its tokens."""
    loop = Loop(budget=64, batch_rows=rows)
    flood = [seq("b", BAT, prompt=4, max_tokens=40) for _ in range(4)]
    for s in flood:
        loop.sch.add(s)
    loop.step()  # their prompts; they decode from now on
    held = loop.sch.bm.num_free_blocks
    urgent = seq("u", INT, prompt=4, max_tokens=6)
    loop.sch.add(urgent)
    beside = []
    while urgent in loop.sch.running or urgent in loop.sch.waiting:
        out = loop.step()
        assert urgent in [i.seq for i in (*out.prefills, *out.decodes)]
        beside.append(sum(1 for i in out.decodes if i.seq.tenancy.klass == BAT))
    assert beside == [rows] * len(beside) and len(beside) == 6
    assert all(s.status is SequenceStatus.RUNNING for s in flood) and loop.sch.num_preemptions == 0
    assert loop.sch.bm.num_free_blocks <= held  # the skipped ones kept their blocks
    out = loop.sch.schedule()  # no urgent work: every batch sequence decodes
    assert sorted(i.seq.request_id for i in out.decodes) == sorted(s.request_id for s in flood)
    loop.sch.update_after_step(out)
    for s in flood:
        s.output_ids.append(1)
    loop.drain()
    assert all(len(s.output_ids) == 40 for s in flood)


def test_batch_work_pauses_beside_urgent_work_by_default_and_negative_caps_are_refused():
    assert (EngineConfig().batch_decode_rows_beside_urgent, EngineConfig().batch_prefill_tokens_beside_urgent) == (0, 0)
    with pytest.raises(ValueError, match="batch_decode_rows_beside_urgent must be >= 0"):
        EngineConfig(batch_decode_rows_beside_urgent=-1)


def run_until_preempted(loop: Loop, seqs: list[Sequence]) -> list[str]:
    for s in seqs:
        loop.sch.add(s)
    while True:
        out = loop.sch.schedule()
        sampled = [i.seq for i in (*out.prefills, *out.decodes) if i.samples]
        loop.sch.update_after_step(out)
        for s in sampled:
            s.output_ids.append(1)
        if out.preempted:
            victims = [s.request_id for s in out.preempted]
            for s in seqs:
                loop.sch.remove(s)
            return victims


def test_batch_is_preempted_first():
    loop = Loop(blocks=8, budget=64)  # two 16-token prompts take all 8 blocks; the next token needs a ninth
    batch, standard = seq("x", BAT, prompt=16), seq("x", STD, prompt=16)  # batch arrived first
    assert run_until_preempted(loop, [batch, standard]) == [batch.request_id]


def test_the_tenant_furthest_ahead_is_preempted():
    loop = Loop(blocks=8, budget=64)  # 20 + 12 prompt tokens fill the 8 blocks; both need a new one next
    early, late = seq("ahead", prompt=20), seq("behind", prompt=12)  # the latest arrival is not the victim
    assert run_until_preempted(loop, [early, late]) == [early.request_id]
    assert loop.sch.waiting.counter("ahead") > loop.sch.waiting.counter("behind")


def test_one_tenant_keeps_priority_then_arrival_order():
    loop = Loop(budget=16, max_seqs=1)
    seqs = [seq(priority=p) for p in (2, 0, 1, 0, 2, 1)]
    for s in seqs:
        loop.sch.add(s)
    loop.drain()
    assert loop.admitted == sorted(seqs, key=lambda s: s.order_key)


def test_one_tenant_preempts_the_latest_arrival():
    loop = Loop(blocks=12, budget=64)
    a, b, c = seq(prompt=16), seq(prompt=16), seq(prompt=16)
    assert run_until_preempted(loop, [a, b, c]) == [c.request_id]


def test_a_flooding_tenant_does_not_starve_another_on_the_real_model(make_engine):
    """Two slots, twenty of one tenant's requests queued first: the other's request runs within two slot turns,
    where first-come order would have it wait behind all twenty."""
    eng = make_engine(dtype="float32", max_num_seqs=2)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = eng.tokenizer.encode("Tell me about the sea.", add_special_tokens=False)
    for i in range(20):
        eng.add_request(f"flood-{i}", prompt, params, tenancy=Tenancy("flood", BAT))
    for _ in range(3):
        eng.step()
    eng.add_request("calm-0", prompt, params, tenancy=Tenancy("calm", BAT))
    steps, flood_done = 0, 0
    while True:
        steps += 1
        outs = eng.step()
        flood_done += sum(1 for o in outs if o.finished and o.request_id.startswith("flood"))
        if any(o.request_id == "calm-0" for o in outs):
            break
    assert steps <= 2 * params.max_tokens + 2  # two slots freeing at most, not ten rounds of them
    assert flood_done <= 3 and eng.num_waiting >= 15
    waiting, running = eng.num_by_class(BAT)  # what the worker's per-class gauges read
    assert (waiting, running) == (eng.num_waiting, eng.num_running) and eng.num_by_class(INT) == (0, 0)
    for rid in [f"flood-{i}" for i in range(20)] + ["calm-0"]:
        eng.abort(rid)


def test_request_meta_maps_to_tenancy():
    from tokenmill.v1 import common_pb2

    from common.wire import tenancy_from_meta

    assert tenancy_from_meta(common_pb2.RequestMeta()) == Tenancy()
    t = tenancy_from_meta(common_pb2.RequestMeta(tenant_id="acme", priority_class=common_pb2.PRIORITY_CLASS_BATCH,
                                                 tenant_weight=2.5, tenant_max_running=3))
    assert t == Tenancy("acme", BAT, 2.5, 3)
    with pytest.raises(ValueError, match="tenant_weight"):
        tenancy_from_meta(common_pb2.RequestMeta(tenant_weight=-1))
    with pytest.raises(ValueError, match="priority_class 9 is unknown"):
        tenancy_from_meta(common_pb2.RequestMeta(priority_class=9))


def test_an_urgent_arrival_takes_a_batch_slot():
    loop = Loop(max_seqs=2)
    batch = [seq("b", BAT, max_tokens=100) for _ in range(3)]
    for s in batch:
        loop.sch.add(s)
    loop.step()
    assert [s.request_id for s in loop.sch.running] == [s.request_id for s in batch[:2]]  # the slots are full
    urgent = seq("i", INT)
    loop.sch.add(urgent)
    out = loop.sch.schedule()
    assert [s.request_id for s in out.preempted] == [batch[1].request_id]  # the latest of the batch tenant
    assert urgent in [i.seq for i in out.prefills] and batch[1] in loop.sch.waiting
    loop.sch.update_after_step(out)
    standard = seq("s", STD)  # no batch sequence runs now but the one left: it goes too
    loop.sch.add(standard)
    out = loop.sch.schedule()
    assert [s.request_id for s in out.preempted] == [batch[0].request_id]
    loop.sch.update_after_step(out)
    for s in [*batch, urgent, standard]:
        loop.sch.remove(s)
    assert loop.sch.bm.num_free_blocks == loop.sch.bm.num_blocks


@pytest.mark.parametrize("blocks, batch_prefill, batch_rows", [(256, None, None), (40, 4, 1), (24, None, 0)])
def test_inline_decodes_schedule_as_the_general_path(blocks: int, batch_prefill: int | None,
                                                     batch_rows: int | None) -> None:
    """The scheduler's inline path for plain decodes (``fast_decodes``) hands out exactly what the general path
    does, step after step: the same rows and chunks, the same preemptions, tenants' counters and free blocks; with
    blocks scarce enough to preempt, and the batch-class limits beside urgent work."""
    import random

    rng = random.Random(7)
    arrivals = [(step, rng.choice(["a", "b", "c"]), rng.choice([INT, STD, BAT]), rng.randint(1, 40),
                 rng.randint(1, 24)) for step in range(120) for _ in range(rng.choice([0, 0, 1, 2]))]
    loops = [Loop(blocks=blocks, budget=48, max_seqs=12, batch_prefill=batch_prefill, batch_rows=batch_rows)
             for _ in range(2)]
    loops[1].sch.fast_decodes = False
    trace: list[list[tuple]] = [[], []]
    for k, loop in enumerate(loops):
        made = itertools.count()
        for step in range(400):
            for at, tenant, klass, prompt, out in arrivals:
                if at == step:
                    n = next(made)
                    loop.sch.add(Sequence(f"{tenant}-{n}", [(n * 7 + i) % 1000 for i in range(prompt)],
                                          SamplingParams(), seed=0, max_tokens=out, arrival=float(n), arrival_seq=n,
                                          tenancy=Tenancy(tenant, klass, 1.0 + (tenant == "b"), 3)))
            out_ = loop.step()
            trace[k].append((
                [(i.seq.request_id, i.num_tokens) for i in out_.prefills],
                [(i.seq.request_id, i.num_tokens) for i in out_.decodes],
                [s.request_id for s in out_.preempted],
                {t: loop.sch.waiting.counter(t) for t in "abc"},
                loop.sch.bm.num_free_blocks,
            ))
        loop.drain()
    assert trace[0] == trace[1]
    assert sum(len(t[1]) for t in trace[0]) > 500  # decodes ran
    assert any(t[2] for t in trace[0]) == (blocks < 256)  # preemptions where blocks are scarce
