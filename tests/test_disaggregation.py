"""Prefill-only and prefilled requests at the engine level: the KV handed from one engine to another
(copied here; over NIXL in the services) continues exactly as a single engine would."""

from __future__ import annotations

from common.output_processor import OutputProcessor
from common.sampling import SamplingParams
from tests.prompts import prompt_ids

P = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def run(engine, rid):
    toks = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                toks += o.new_token_ids
    return toks


def prefill(engine, rid, ids, params=P):
    engine.add_request(rid, ids, params, prefill_only=True)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    [o] = outs
    return o


def test_prefill_then_decode_elsewhere_equals_one_engine(make_engine, source):
    prompts = prompt_ids(source.tokenizer)
    pre = make_engine(dtype="float32")
    dec = make_engine(dtype="float32")
    whole = make_engine(dtype="float32")
    for i, ids in enumerate((prompts[0], prompts[12], prompts[3] * 3)):
        [ref] = whole.generate([ids], P)
        o = prefill(pre, f"r{i}", ids)
        assert o.leased and not o.finished and o.finish_reason is None and o.kv_block_ids
        assert len(o.kv_block_ids) == -(-len(ids) // 16)
        assert pre.num_leased == 1
        first, plan = dec.add_prefilled(f"r{i}", ids, o.new_token_ids[0], P)
        assert plan is not None and not first.finished
        remote = o.kv_block_ids[plan.num_cached_blocks :]
        dec.runner.kv_cache[plan.local_block_ids] = pre.runner.kv_cache[remote]
        assert pre.release(f"r{i}") and pre.num_leased == 0
        dec.kv_ready(f"r{i}")
        toks = first.new_token_ids + run(dec, f"r{i}")
        assert toks == ref.token_ids, f"prompt {i}"
    # the decode worker's own prefix cache now holds those prompts: a repeat pulls fewer blocks
    o = prefill(pre, "again", prompts[0])
    _, plan = dec.add_prefilled("again", prompts[0], o.new_token_ids[0], P)
    assert plan is not None and plan.num_cached_blocks >= 2
    dec.abort("again")
    pre.release("again")


def test_failed_pull_recomputes_with_the_same_output(make_engine, source):
    ids = prompt_ids(source.tokenizer)[5]
    pre = make_engine(dtype="float32")
    dec = make_engine(dtype="float32", enable_prefix_caching=False)
    [ref] = make_engine(dtype="float32").generate([ids], P)
    o = prefill(pre, "x", ids)
    first, plan = dec.add_prefilled("x", ids, o.new_token_ids[0], P)
    assert plan is not None
    dec.kv_failed("x")  # e.g. the lease expired before the pull
    assert first.new_token_ids + run(dec, "x") == ref.token_ids
    pre.release("x")


def test_prefilled_request_without_room_is_recomputed_locally(make_engine, source):
    prompts = prompt_ids(source.tokenizer)
    ids = prompts[0]  # 37 tokens: 3 blocks
    p8 = SamplingParams(max_tokens=8, temperature=0.0)
    pre = make_engine(dtype="float32")
    dec = make_engine(dtype="float32", num_gpu_blocks_override=4, enable_prefix_caching=False)
    dec.add_request("hog", prompts[2], p8)  # 40 tokens: 3 of the 4 blocks
    dec.step()
    [ref] = make_engine(dtype="float32").generate([ids], p8)
    o = prefill(pre, "y", ids, p8)
    first, plan = dec.add_prefilled("y", ids, o.new_token_ids[0], p8)
    assert plan is None  # no room for 3 blocks now: queued to recompute once the hog is done
    assert first.new_token_ids + run(dec, "y") == ref.token_ids
    pre.release("y")


def test_first_token_that_finishes_frees_the_prefill_blocks(make_engine, source):
    ids = prompt_ids(source.tokenizer)[0]
    pre = make_engine(dtype="float32")
    o = prefill(pre, "one", ids, SamplingParams(max_tokens=1, temperature=0.0))
    assert o.finished and not o.leased and o.finish_reason is not None and o.kv_block_ids is None
    assert pre.num_leased == 0


def test_abort_of_a_pending_import_frees_its_blocks(make_engine, source):
    ids = prompt_ids(source.tokenizer)[1]
    dec = make_engine(dtype="float32")
    _, plan = dec.add_prefilled("z", ids, 42, P)
    assert plan is not None and dec.block_manager.num_free_blocks < dec.block_manager.num_blocks
    assert dec.abort("z")
    assert dec.block_manager.num_free_blocks == dec.block_manager.num_blocks


def test_output_processor_streams_text_and_stop_strings(source):
    tk = source.tokenizer
    proc = OutputProcessor(tk)
    ids = tk.encode(" Héllo wörld 日本語, the end")
    proc.add("a", [1, 2], SamplingParams(stop=("the end",)))
    text = ""
    finished = None
    for t in ids:
        d = proc.process("a", [t], False, None)
        if d is None:
            break
        text += d.text
        if d.finished:
            finished = d
            break
    assert finished is not None and finished.stopped_by_string
    assert text == " Héllo wörld 日本語, "
    assert proc.process("a", [5], False, None) is None  # later tokens are dropped


def test_a_decode_worker_that_pulls_kv_chunks_its_own_prompts_beside_decodes(make_engine, source):
    """Once a decode worker pulls KV (``pulls_kv``), the prompts it computes itself (the router's fallbacks) take
    at most DISAGG_PROMPT_TOKENS_BESIDE_DECODES tokens a step while it decodes; a configured cap wins."""
    from common.engine import DISAGG_PROMPT_TOKENS_BESIDE_DECODES as CAP

    dec = make_engine(dtype="float32", max_num_batched_tokens=2048)
    assert dec.scheduler.prompt_tokens_beside_decodes is None and not dec.block_manager.find_runs
    dec.pulls_kv()
    assert dec.scheduler.prompt_tokens_beside_decodes == CAP and dec.block_manager.find_runs
    dec.add_request("short", prompt_ids(source.tokenizer)[0], P)
    dec.step()
    dec.step()  # "short" decodes now
    long_prompt = [(7 * i) % 40_000 + 100 for i in range(CAP + 300)]
    dec.add_request("long", long_prompt, P)
    dec.step()
    assert dec._seqs["long"].num_computed_tokens == CAP  # the cap, not the step budget's 2,048
    dec.abort("short")
    dec.abort("long")
    while dec.has_unfinished():
        dec.step()
    mine = make_engine(dtype="float32", prompt_tokens_beside_decodes=64)
    mine.pulls_kv()
    assert mine.scheduler.prompt_tokens_beside_decodes == 64
