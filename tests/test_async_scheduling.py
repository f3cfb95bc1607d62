"""Async scheduling (``engine.async_scheduling``): a step is launched before the host reads the previous one's
tokens, its decodes' input ids fed from the device. The engine must give the same tokens, finish reasons and
logprobs as the synchronous one, whatever ends a request (EOS, a stop token, max_tokens, an abort, preemption), and
free every block. On the CPU the two run the same ops in the same order, so outputs are compared exactly; the GPU
suite runs the CUDA graphs' feed (tests/gpu)."""

from __future__ import annotations

import json

import pytest

from common.sampling import SamplingParams, StructuredOutput

QUESTIONS = ("What is the capital of France?", "Tell me a joke.", "Name a color.", "Count to five.",
             "Write a haiku about the sea.", "What is 2+2?")


def chat(eng, text: str) -> list[int]:
    tk = eng.tokenizer
    return tk.encode(tk.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def drive(eng, reqs, abort_after: dict[str, int] | None = None) -> dict[str, dict]:
    """Add ``reqs`` [(id, prompt ids, params)], step until done; per request its tokens, finish reason and
    logprobs. ``abort_after``: abort a request once the engine has returned that many of its tokens."""
    for rid, ids, p in reqs:
        eng.add_request(rid, ids, p)
    got: dict[str, dict] = {rid: {"tokens": [], "finish": None, "lps": []} for rid, _, _ in reqs}
    abort_after = dict(abort_after or {})
    while eng.has_unfinished():
        for o in eng.step():
            r = got[o.request_id]
            r["tokens"] += o.new_token_ids
            r["lps"] += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs or ()]
            if o.finished:
                r["finish"] = o.finish_reason.value if o.finish_reason else None
        for rid, n in list(abort_after.items()):
            if len(got[rid]["tokens"]) >= n and got[rid]["finish"] is None:
                assert eng.abort(rid)
                got[rid]["finish"] = "aborted"
                del abort_after[rid]
    return got


@pytest.fixture(scope="module")
def prompts(source):
    from common.loader import load_tokenizer

    class _T:  # chat() needs only the tokenizer
        tokenizer = load_tokenizer()

    return [chat(_T, q) for q in QUESTIONS]


def same(got: dict[str, dict], want: dict[str, dict]) -> None:
    """Tokens and finish reasons equal; logprobs within 1e-4 (a row finished at the step before still runs in
    the async engine's next step, and another batch size rounds a matmul differently in the last bits)."""
    assert got.keys() == want.keys()
    for rid, w in want.items():
        g = got[rid]
        assert (g["tokens"], g["finish"]) == (w["tokens"], w["finish"]), rid
        assert len(g["lps"]) == len(w["lps"]), rid
        for (t1, v1, top1), (t2, v2, top2) in zip(g["lps"], w["lps"]):
            assert t1 == t2 and v1 == pytest.approx(v2, abs=1e-4), rid
            assert [t for t, _ in top1] == [t for t, _ in top2], rid
            assert [v for _, v in top1] == pytest.approx([v for _, v in top2], abs=1e-4), rid


def both(make_engine, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_num_seqs", 8)
    sync, fast = make_engine(async_scheduling=False, **kw), make_engine(async_scheduling=True, **kw)
    assert not sync.async_scheduling and fast.async_scheduling
    return sync, fast


def test_greedy_with_eos_stop_tokens_and_lengths_equals_sync(make_engine, prompts):
    sync, fast = both(make_engine)
    reqs = [(f"r{i}", ids, SamplingParams(max_tokens=m, temperature=0))
            for i, (ids, m) in enumerate(zip(prompts, (40, 3, 1, 40, 17, 40)))]
    first = drive(sync, reqs)
    stop_tok = first["r0"]["tokens"][2]
    reqs.append(("stop", prompts[0], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(stop_tok,))))
    s0, f0 = sync.num_steps, fast.num_steps
    sent: list[str] = []
    fed = [0]
    real_tensor, real_feed = fast._feed_uploads.tensor, fast._feed
    fast._feed_uploads.tensor = lambda name, *a: (sent.append(name), real_tensor(name, *a))[1]
    fast._feed = lambda *a: (f := real_feed(*a), fed.__setitem__(0, fed[0] + (f is not None)))[0]
    want, got = drive(sync, reqs), drive(fast, reqs)
    same(got, want)
    # the feed's index goes to the device when the batch's rows change, not every step: the same tokens above
    assert 0 < sent.count("feed") < fed[0] / 3, (sent.count("feed"), fed[0])
    assert {r["finish"] for r in want.values()} >= {"stop", "length"}
    assert len(want["r2"]["tokens"]) == 1 and want["stop"]["tokens"][-1] == stop_tok
    # no step is added for the token on the device: a row finished by EOS or a stop id runs once more only beside
    # others (the last requests here end at max_tokens), and a request at its max_tokens is not scheduled again
    assert fast.num_steps - f0 == sync.num_steps - s0, (fast.num_steps - f0, sync.num_steps - s0)


@pytest.mark.parametrize("knobs", [
    {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "repetition_penalty": 1.1},
    {"temperature": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.7, "logit_bias": {13: 2.0}, "min_p": 0.05,
     "logprobs": 3},
    {"temperature": 0, "logprobs": 2, "min_tokens": 5, "repetition_penalty": 1.3},
], ids=["openai-sampled", "penalties-logprobs", "greedy-processed"])
def test_seeded_and_processed_rows_equal_sync(make_engine, prompts, knobs):
    sync, fast = both(make_engine)
    reqs = [(f"r{i}", ids, SamplingParams(max_tokens=24, seed=100 + i, **knobs)) for i, ids in enumerate(prompts)]
    want, got = drive(sync, reqs), drive(fast, reqs)
    same(got, want)
    if knobs.get("logprobs"):
        assert all(len(r["lps"]) == len(r["tokens"]) for r in got.values())


def test_preemption_gives_the_same_tokens_and_frees_every_block(make_engine, prompts):
    # greedy (penalized: the processed path): the two engines preempt at different steps, so rows share batches
    # differently, and a sampled row's pick can flip where float rounding moves a logit across its draw
    sync, fast = both(make_engine, max_num_seqs=4, num_gpu_blocks_override=7)
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1.2)
    reqs = [(f"r{i}", ids, p) for i, ids in enumerate(prompts)]
    want, got = drive(sync, reqs), drive(fast, reqs)
    assert fast.scheduler.num_preemptions > 0
    same(got, want)


def test_abort_while_a_token_is_on_the_device(make_engine, prompts):
    sync, fast = both(make_engine)
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    reqs = [(f"r{i}", ids, p) for i, ids in enumerate(prompts)]
    got = drive(fast, reqs, abort_after={"r1": 3, "r4": 1})
    want = drive(sync, [r for r in reqs if r[0] not in ("r1", "r4")])
    assert got["r1"]["finish"] == "aborted" and got["r4"]["finish"] == "aborted"
    same({k: v for k, v in got.items() if k in want}, want)
    assert fast.sampler.num_tracked == 0 and not fast.has_unfinished()
    # the id of an aborted request can come back at once, its old token still on the device
    fast.add_request("again", prompts[0], p)
    fast.step()
    assert fast.abort("again")
    fast.add_request("again", prompts[0], SamplingParams(max_tokens=4, temperature=0))
    out = []
    while fast.has_unfinished():
        out += [t for o in fast.step() if o.request_id == "again" for t in o.new_token_ids]
    assert out == want["r0"]["tokens"][:4]


@pytest.mark.parametrize("deferred", [False, True], ids=["constrained-sync", "async-constrained"])
def test_structured_rows_equal_sync(make_engine, prompts, deferred):
    """Constrained rows beside unconstrained ones, greedy and sampled, masks filled inline or in the mask process;
    ``async_constrained``: the constrained step's pick waits for the next call."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    so = StructuredOutput("json_schema", json.dumps(schema))
    for grammar_process in (False, True):
        sync = make_engine(async_scheduling=False, dtype="float32", max_num_seqs=8, grammar_process=grammar_process)
        fast = make_engine(async_scheduling=True, dtype="float32", max_num_seqs=8, grammar_process=grammar_process,
                           async_constrained=None if deferred else False)  # None: the default, deferred
        reqs = [(f"r{i}", ids, SamplingParams(max_tokens=48, temperature=0.7 if i % 2 else 0, seed=i,
                                              structured=so if i < 4 else None))
                for i, ids in enumerate(prompts)]
        launched = []
        launch = fast._launch

        def spy(sampling, logits, launch=launch, launched=launched):
            step = launch(sampling, logits)
            launched.append(None if step is None else step.picks is None)  # True: left for the next call
            return step

        fast._launch = spy
        want, got = drive(sync, reqs), drive(fast, reqs)
        same(got, want)
        assert any(launched) is deferred
        for rid in ("r0", "r2"):  # greedy and sampled, both constrained
            assert got[rid]["finish"] == "stop"
            assert set(json.loads(fast.tokenizer.decode(got[rid]["tokens"]))) == {"name", "age"}
        if deferred and grammar_process:  # aborts of constrained rows whose pick waits, then a new request
            got = drive(fast, reqs, abort_after={"r1": 2, "r2": 5})
            assert got["r1"]["finish"] == got["r2"]["finish"] == "aborted"
            same({k: v for k, v in got.items() if k not in ("r1", "r2")},
                 {k: v for k, v in want.items() if k not in ("r1", "r2")})
            assert fast.sampler.num_tracked == 0 and not fast.has_unfinished()


def test_prefill_only_requests_lease_after_their_first_token(make_engine, prompts):
    sync, fast = both(make_engine)
    for eng in (sync, fast):
        eng.add_request("lease", prompts[0], SamplingParams(max_tokens=8, temperature=0), prefill_only=True)
        eng.add_request("plain", prompts[1], SamplingParams(max_tokens=8, temperature=0))
    outs = {}
    for eng in (sync, fast):
        got = []
        while eng.has_unfinished():
            got += [(o.request_id, o.new_token_ids, o.leased, o.finished) for o in eng.step()]
        outs[eng.async_scheduling] = got
        assert eng.num_leased == 1
        blocks = eng.block_manager.num_blocks - eng.block_manager.num_free_blocks
        assert blocks == eng.block_manager.blocks_needed(len(prompts[0]))  # only the lease's, no extra block
        # its first token was not fed to a decode step (it is the decode worker's to compute)
        assert eng._leased["lease"].num_computed_tokens == len(prompts[0])
        assert eng.release("lease")
    lease_sync = [o for o in outs[False] if o[0] == "lease"]
    assert [o for o in outs[True] if o[0] == "lease"] == lease_sync == [("lease", lease_sync[0][1], True, False)]
    assert sorted(outs[True]) == sorted(outs[False])


def test_the_default_is_on_for_cuda_only(make_engine):
    from common.config import EngineConfig

    assert EngineConfig().async_scheduling is None
    assert not make_engine(dtype="float32").async_scheduling  # this CPU: nothing to overlap with
    assert EngineConfig(async_scheduling=True, tensor_parallel_size=2).async_scheduling  # rank 0 sends the fed ids


@pytest.mark.parametrize("rows", [0, 1])
def test_batch_decodes_held_back_beside_urgent_work_give_the_same_tokens(make_engine, prompts, rows):
    """``batch_decode_rows_beside_urgent``: batch-class rows skip the steps that run an interactive one past the cap,
    their token from the step before still on the device when a step skips them. Every request gets the tokens
    the synchronous engine without a cap gives, in more steps, and every block comes back."""
    from common.sequence import PriorityClass, Tenancy

    sync = make_engine(async_scheduling=False, dtype="float32", batch_decode_rows_beside_urgent=None,
                       batch_prefill_tokens_beside_urgent=None)
    fast = make_engine(async_scheduling=True, dtype="float32", batch_decode_rows_beside_urgent=rows)
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run(eng):
        got: dict[str, list[int]] = {}
        for i, ids in enumerate(prompts[:4]):
            eng.add_request(f"b{i}", ids, p, tenancy=Tenancy("flood", PriorityClass.BATCH, 1.0, None))
        n0 = eng.num_steps
        while eng.has_unfinished():
            if eng.num_steps - n0 == 3:  # the batch rows are decoding: an interactive request arrives
                eng.add_request("u", prompts[4], SamplingParams(max_tokens=8, temperature=0),
                                tenancy=Tenancy("calm", PriorityClass.INTERACTIVE, 1.0, None))
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        return got, eng.num_steps - n0

    (want, sync_steps), (got, fast_steps) = run(sync), run(fast)
    assert got == want and len(got) == 5 and all(len(v) == 24 for k, v in got.items() if k != "u")
    assert fast_steps > sync_steps  # the batch rows waited while the interactive one ran
    assert fast.block_manager.num_free_blocks == fast.block_manager.num_blocks and not fast.has_unfinished()
