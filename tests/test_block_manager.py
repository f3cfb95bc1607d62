"""Block manager and scheduler on their own: reference counts, the prefix cache, LRU reuse, preemption."""

from __future__ import annotations

import hashlib
import struct

import pytest

from common import block_manager
from common.block_manager import BlockManager
from common.hashing import HashKeys, prefix_block_hashes
from common.sampling import SamplingParams
from common.scheduler import Scheduler
from common.sequence import Sequence


def seq(rid: str, tokens: list[int], salt: str = "", priority: int = 0) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), seed=0, max_tokens=16, cache_salt=salt, priority=priority)


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    bm.admit(s)
    bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)


def test_prefix_hit_shares_blocks_and_counts():
    bm = BlockManager(16, 4, "m")
    a = seq("a", list(range(10)))
    run_prefill(bm, a)
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 13
    b = seq("b", [*range(8), 99, 98, 97])
    bm.admit(b)
    assert b.block_ids == a.block_ids[:2]  # two full blocks shared
    assert all(bm.blocks[i].ref_count == 2 for i in b.block_ids)
    assert b.num_computed_tokens == 8
    assert bm.stats.hits == 8 and bm.stats.queries == 21
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_block_hashes_are_blake2b_over_parent_tokens_and_keys():
    """The hash format every worker and the router share, against a plain reference: blake2b-64 over the parent's
    hash (little-endian u64), the block's ids (little-endian int64) and the keys, chained from ROOT_HASH."""
    tokens = [5, 0, 49151, 7, 2**40, 3, 1, 9, 11]
    keys = HashKeys("m", adapter="a", cache_salt="t")
    parent, want = 0, []
    for i in range(0, 8, 4):
        h = hashlib.blake2b(digest_size=8)
        h.update(parent.to_bytes(8, "little"))
        h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[i:i + 4]))
        h.update(b"m\x00a\x00t")
        parent = int.from_bytes(h.digest(), "little")
        want.append(parent)
    assert prefix_block_hashes(tokens, 4, keys) == want


@pytest.mark.parametrize("cached_blocks", [0, 3, 6])
def test_an_admission_looks_its_prefix_up_once(monkeypatch, cached_blocks):
    """The scheduler's admission hashes a waiting prompt's blocks once (up to its first miss), not again when the
    block manager takes the hit."""
    bm = BlockManager(64, 4, "m")
    first = seq("a", [*range(24), 99])
    run_prefill(bm, first)
    passes = []
    real = block_manager.iter_block_hashes

    def counted(*args):
        passes.append(1)
        return real(*args)

    monkeypatch.setattr(block_manager, "iter_block_hashes", counted)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    second = seq("b", [*range(4 * cached_blocks), *(1000 + i for i in range(30 - 4 * cached_blocks))])
    sch.add(second)
    out = sch.schedule()
    assert [i.seq.request_id for i in out.prefills] == ["b"]
    assert second.num_cached_tokens == 4 * cached_blocks
    assert second.block_ids[:cached_blocks] == first.block_ids[:cached_blocks]
    assert len(passes) == 1


def test_salt_and_model_separate_caches():
    bm = BlockManager(16, 4, "m")
    run_prefill(bm, seq("a", list(range(10))))
    s = seq("b", list(range(10)), salt="tenant-2")
    assert bm.match_prefix(s) == []
    keys = HashKeys("m")
    assert prefix_block_hashes(list(range(10)), 4, keys) != prefix_block_hashes(list(range(10)), 4, HashKeys("m2"))


def test_freed_blocks_keep_their_hash_until_reused():
    bm = BlockManager(4, 4, "m")
    a = seq("a", list(range(9)))
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    again = seq("a2", list(range(9)))
    assert len(bm.match_prefix(again)) == 2  # still cached while free
    c = seq("c", [50 + i for i in range(16)])  # needs all four blocks: evicts the cached ones
    run_prefill(bm, c)
    assert bm.match_prefix(seq("a3", list(range(9)))) == []
    bm.free(c)


def test_whole_prompt_cached_still_computes_one_token():
    bm = BlockManager(8, 4, "m")
    a = seq("a", list(range(8)))
    run_prefill(bm, a)
    b = seq("b", list(range(8)))
    assert len(bm.match_prefix(b)) == 1  # the last block is recomputed so a token gets sampled


def test_scheduler_respects_token_budget_and_chunks():
    bm = BlockManager(64, 4, "m", enable_prefix_caching=False)
    sch = Scheduler(bm, max_num_batched_tokens=10, max_num_seqs=8)
    s1, s2 = seq("1", list(range(25))), seq("2", list(range(100, 104)))
    sch.add(s1)
    sch.add(s2)
    out = sch.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in out.prefills] == [("1", 10)]
    sch.update_after_step(out)
    out = sch.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in out.prefills] == [("1", 10)]
    sch.update_after_step(out)
    out = sch.schedule()  # the last 5 tokens of s1 and all 4 of s2 share a step
    assert [(i.seq.request_id, i.num_tokens) for i in out.prefills] == [("1", 5), ("2", 4)]
    assert all(i.samples for i in out.prefills)


def test_scheduler_preempts_lowest_priority_latest():
    bm = BlockManager(4, 4, "m", enable_prefix_caching=False)
    sch = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    hi, lo = seq("hi", list(range(8)), priority=0), seq("lo", list(range(100, 108)), priority=1)
    sch.add(lo)
    sch.add(hi)
    out = sch.schedule()
    assert [i.seq.request_id for i in out.prefills] == ["hi", "lo"]
    sch.update_after_step(out)
    for s in (hi, lo):
        s.output_ids.append(7)
    out = sch.schedule()  # hi needs a third block: lo is preempted, its blocks freed
    assert [s.request_id for s in out.preempted] == ["lo"]
    assert [i.seq.request_id for i in out.decodes] == ["hi"]
    assert lo.num_computed_tokens == 0 and lo in sch.waiting and lo.block_ids == []


def test_blocks_taken_in_one_allocation_ascend():
    """A freed sequence's blocks return to the free list tail first; the next allocation still lays them out in
    ascending order, so a KV transfer of them is one contiguous run on this side."""
    bm = BlockManager(num_blocks=5, block_size=4, model_id="m", enable_prefix_caching=False)
    a = seq("a", list(range(20)))
    run_prefill(bm, a)
    assert a.block_ids == [0, 1, 2, 3, 4]
    bm.free(a)
    b = seq("b", list(range(100, 120)))
    bm.admit(b)
    bm.allocate(b, b.num_tokens)
    assert b.block_ids == [0, 1, 2, 3, 4]  # the free list holds them as 4, 3, 2, 1, 0


def _fragment(bm: BlockManager, layout: list[int]) -> None:
    """Leave the free list holding ``layout``'s blocks in that order (least recently freed first)."""
    bm._free.clear()  # a test's shortcut: every other block held by someone
    for b in bm.blocks:
        b.ref_count = 1
    for bid in layout:
        bm.blocks[bid].ref_count = 0
        bm._free[bid] = None


def test_a_transferring_pool_takes_one_run_where_the_free_list_has_one():
    """With ``find_runs`` (prefill workers, decode workers that pull), a multi-block allocation takes the shortest
    contiguous run that holds it among the least recently freed, not the head of a fragmented free list."""
    bm = BlockManager(num_blocks=64, block_size=4, model_id="m", enable_prefix_caching=False)
    # the head alternates (decode growth took every other block), then a run of 6 and a run of 9
    layout = [0, 2, 4, 6, 8, 10, 12, 14, *range(30, 36), *range(40, 49)]
    _fragment(bm, layout)
    plain = seq("plain", list(range(20)))  # 5 blocks, LRU: the alternating head, then 30
    bm.allocate(plain, plain.num_tokens)
    assert plain.block_ids == [0, 2, 4, 6, 8]
    bm.free(plain)

    _fragment(bm, layout)
    bm.find_runs = True
    a = seq("a", list(range(20)))
    bm.allocate(a, a.num_tokens)
    assert a.block_ids == [30, 31, 32, 33, 34]  # the shortest run that holds 5
    b = seq("b", list(range(32)))  # 8 blocks: only the run of 9 holds them
    bm.allocate(b, b.num_tokens)
    assert b.block_ids == list(range(40, 48))
    assert bm.num_free_blocks == len(layout) - 13 and not {*a.block_ids, *b.block_ids} & set(bm._free)


def test_without_a_run_that_holds_it_the_longest_runs_go_first():
    bm = BlockManager(num_blocks=64, block_size=4, model_id="m", enable_prefix_caching=False)
    _fragment(bm, [1, 3, *range(10, 13), *range(20, 25), 50])
    bm.find_runs = True
    a = seq("a", list(range(32)))  # 8 blocks: the run of 5, the run of 3
    bm.allocate(a, a.num_tokens)
    assert a.block_ids == [10, 11, 12, 20, 21, 22, 23, 24]
    few = seq("few", list(range(8)))  # 2 blocks: below RUN_MIN_BLOCKS, the least recently freed
    bm.allocate(few, few.num_tokens)
    assert few.block_ids == [1, 3]
    # the window is run_window (8) × need of the least recently freed: a run beyond it is not looked at
    bm2 = BlockManager(num_blocks=256, block_size=4, model_id="m", enable_prefix_caching=False)
    _fragment(bm2, [*range(0, 80, 2), *range(100, 110)])
    bm2.find_runs = True
    c = seq("c", list(range(16)))  # 4 blocks: a window of 32 alternating blocks
    bm2.allocate(c, c.num_tokens)
    assert c.block_ids == [0, 2, 4, 6]


def test_prompts_beside_decoding_sequences_get_at_most_their_cap():
    """``prompt_tokens_beside_decodes``: while a sequence decodes, all prompt chunks of a step share the cap; with
    nothing decoding (or only a prefill-only sequence whose first token ends it) a prompt takes the whole budget."""
    bm = BlockManager(64, 4, "m", enable_prefix_caching=False)
    sch = Scheduler(bm, max_num_batched_tokens=40, max_num_seqs=8, prompt_tokens_beside_decodes=12)
    d, p1, p2 = seq("d", list(range(6))), seq("p1", list(range(100, 150))), seq("p2", list(range(200, 210)))
    sch.add(d)
    out = sch.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in out.prefills] == [("d", 6)]  # nothing decodes yet
    sch.update_after_step(out)
    d.output_ids.append(7)
    sch.add(p1)
    sch.add(p2)
    out = sch.schedule()  # d decodes: p1 gets the 12 prompt tokens, p2 none
    assert [(i.seq.request_id, i.num_tokens) for i in out.decodes] == [("d", 1)]
    assert [(i.seq.request_id, i.num_tokens) for i in out.prefills] == [("p1", 12)]
    sch.update_after_step(out)
    d.output_ids.append(8)
    out = sch.schedule()  # the running prompt chunk counts against the cap too
    assert [(i.seq.request_id, i.num_tokens) for i in out.prefills] == [("p1", 12)]
    sch.update_after_step(out)
    sch.remove(d)  # nothing decodes: the budget's 40 again
    out = sch.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in out.prefills] == [("p1", 26), ("p2", 10)]
    sch.update_after_step(out)
    p1.output_ids.append(9)
    p1.pending_final = True  # prefill-only: its first token ends it, it does not decode
    p3 = seq("p3", list(range(300, 340)))
    sch.add(p3)
    out = sch.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in out.prefills] == [("p3", 40)]


def test_without_chunked_prefill_the_cap_beside_decodes_holds_no_prompt_back():
    """A prompt that cannot be split would wait for a step with nothing decoding, which a busy worker never has."""
    bm = BlockManager(64, 4, "m", enable_prefix_caching=False)
    sch = Scheduler(bm, max_num_batched_tokens=40, max_num_seqs=8, enable_chunked_prefill=False,
                    prompt_tokens_beside_decodes=12)
    d, p = seq("d", list(range(6))), seq("p", list(range(100, 130)))
    sch.add(d)
    sch.update_after_step(sch.schedule())
    d.output_ids.append(7)
    sch.add(p)
    out = sch.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in out.prefills] == [("p", 30)]
    assert [i.seq.request_id for i in out.decodes] == ["d"]


def test_blocks_committed_at_once_or_one_by_one_get_the_routers_hashes():
    """A pulled prompt commits all its blocks in one call, a decoding sequence one block at a time, across the
    prompt/output boundary: either way each block's hash is the router's (``prefix_block_hashes``) for the same
    tokens and salt, and a later prompt with those tokens finds them."""
    import random

    rng = random.Random(3)
    prompt = [rng.randrange(1000) for _ in range(37)]
    outputs = [rng.randrange(1000) for _ in range(12)]
    keys = HashKeys("m", cache_salt="t")
    bm = BlockManager(64, 4, "m")
    bm.track_events = True
    s = seq("a", prompt, salt="t")
    run_prefill(bm, s)  # 9 full blocks at once
    assert s.block_hashes == prefix_block_hashes(prompt, 4, keys)
    for t in outputs:  # then one token at a time: blocks fill across the prompt's tail
        s.output_ids.append(t)
        bm.allocate(s, s.num_tokens)
        s.num_computed_tokens = s.num_tokens
        bm.commit_full_blocks(s)
    whole = prompt + outputs
    assert s.block_hashes == prefix_block_hashes(whole, 4, keys) and len(s.block_hashes) == 12
    assert [bm.blocks[b].tokens for b in s.block_ids[:12]] == [struct.pack("<4q", *whole[i:i + 4])
                                                                 for i in range(0, 48, 4)]
    stored, removed = bm.drain_events()
    assert stored == s.block_hashes and removed == []
    again = seq("b", [*whole, 5], salt="t")
    assert bm.match_prefix(again) == s.block_ids[:12]
