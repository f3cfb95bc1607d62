"""The engine alone on CUDA, SmolLM2 in float32: the fast path (Triton kernels, CUDA graphs for decode, async
scheduling) gives transformers' greedy tokens; decode through CUDA graphs gives the eager fast path's tokens; seeded
sampled rows give the same tokens in a batch of 32, in another batch composition, and one at a time (the device
sampler); the async engine gives the synchronous one's tokens."""

from __future__ import annotations

import pytest

from common.sampling import SamplingParams
from tests.gpu.helpers import N_REF, first_diff, release_cuda

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=N_REF, min_tokens=N_REF, temperature=0.0)


def _engine(source, model=None, **kw):
    from common.config import EngineConfig
    from common.engine import LLMEngine

    cfg = EngineConfig(**{"device": "cuda", "dtype": "float32", "max_num_seqs": 32, "kv_cache_memory": 1 << 30, **kw})
    return LLMEngine(source, cfg, model=model)


def _assert_no_leak(eng) -> None:
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"KV blocks leaked: {bm.num_blocks - bm.num_free_blocks} in use"


@pytest.fixture(scope="module")
def graphs_engine(source):
    eng = _engine(source)
    yield eng
    del eng
    release_cuda()


@pytest.fixture(scope="module")
def graph_outputs(graphs_engine, gpu_prompts) -> tuple[list[list[int]], int]:
    """Greedy tokens of the twenty prompts in one batch through the fast path, and the graph replays it took."""
    eng = graphs_engine
    assert eng.runner.fast_cuda and eng.runner.model.backend.name == "cuda", "the CUDA fast path is off"
    assert eng.runner.graphs is not None, "no CUDA graphs captured"
    assert eng.async_scheduling, "async scheduling is not the default on CUDA"
    r0 = eng.runner.graphs.replays
    outs = [r.token_ids for r in eng.generate(gpu_prompts, GREEDY)]
    _assert_no_leak(eng)
    return outs, eng.runner.graphs.replays - r0


def test_fast_path_greedy_equals_transformers(graph_outputs, hf_reference):
    outs, replays = graph_outputs
    # one prefill step, then every decode-only step is one graph replay
    assert replays >= N_REF // 2, f"only {replays} CUDA-graph replays for {N_REF} decode steps"
    bad = {i: first_diff(o, r) for i, (o, r) in enumerate(zip(outs, hf_reference)) if o != r}
    assert not bad, f"prompts diverging from transformers (prompt: first differing token): {bad}"


def test_prompts_joining_running_decodes_replay_graphs_and_equal_transformers(graphs_engine, gpu_prompts,
                                                                            hf_reference):
    """The prompts arrive one a step, so each joins the running decodes; the short ones run as rows of the step's
    CUDA graph (``engine.cuda_graph_prefill_tokens``). Greedy tokens still equal transformers'."""
    eng = graphs_engine
    g = eng.runner.graphs
    short = sum(len(p) <= eng.cfg.cuda_graph_prefill_tokens for p in gpu_prompts)
    assert short >= 5, [len(p) for p in gpu_prompts]
    r0, p0, s0 = g.replays, g.prompt_replays, eng.num_steps
    outs: dict[str, list[int]] = {}
    pending = list(enumerate(gpu_prompts))
    done = 0
    while done < len(gpu_prompts):
        if pending:
            i, p = pending.pop(0)
            outs[f"join-{i}"] = []
            eng.add_request(f"join-{i}", p, GREEDY, cache_salt="join")  # no hits on the other tests' prompts
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
            done += o.finished
    _assert_no_leak(eng)
    steps = eng.num_steps - s0
    assert g.prompt_replays - p0 >= short, f"{g.prompt_replays - p0} graph steps with a prompt; {short} short prompts"
    assert g.replays - r0 >= steps - (len(gpu_prompts) - short), f"{g.replays - r0} replays in {steps} steps"
    bad = {i: first_diff(outs[f"join-{i}"], r) for i, r in enumerate(hf_reference) if outs[f"join-{i}"] != r}
    assert not bad, f"prompts diverging from transformers (prompt: first differing token): {bad}"


def test_cuda_graph_decode_equals_eager(source, graphs_engine, graph_outputs, gpu_prompts):
    eager = _engine(source, model=graphs_engine.runner.model, cuda_graphs=False)
    assert eager.runner.graphs is None and eager.runner.fast_cuda
    outs = [r.token_ids for r in eager.generate(gpu_prompts, GREEDY)]
    _assert_no_leak(eager)
    bad = {i: first_diff(o, g) for i, (o, g) in enumerate(zip(outs, graph_outputs[0])) if o != g}
    assert not bad, f"eager decode diverges from CUDA-graph decode (prompt: first differing token): {bad}"


def test_seeded_sampling_same_in_any_batch(source, graphs_engine, gpu_prompts):
    """The device sampler: seeded rows draw their noise from (seed, position), whatever else is in the batch."""
    eng = _engine(source, model=graphs_engine.runner.model, max_num_seqs=64, enable_prefix_caching=False)
    prompts = gpu_prompts + [p[::-1] for p in gpu_prompts[:12]]
    assert len(prompts) == 32
    params = [SamplingParams(max_tokens=24, ignore_eos=True, seed=1000 + i, temperature=1.0, top_p=0.9, top_k=50,
                             repetition_penalty=1.1) for i in range(32)]
    s0 = eng.num_steps
    batch = [r.token_ids for r in eng.generate(prompts, params)]
    assert eng.num_steps - s0 <= 24 + 4, f"{eng.num_steps - s0} steps: the 32 requests did not run as one batch"
    assert all(len(t) == 24 for t in batch), [len(t) for t in batch]
    alone = [eng.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    bad = {i: first_diff(b, a) for i, (b, a) in enumerate(zip(batch, alone)) if b != a}
    assert not bad, f"seeded rows differ between the batch of 32 and one at a time (row: first diff): {bad}"
    # another composition: reversed, with unseeded sampled requests in between
    mixed_p, mixed_sp, where = [], [], []
    for i in reversed(range(32)):
        where.append(len(mixed_p))
        mixed_p.append(prompts[i])
        mixed_sp.append(params[i])
        if i % 2:
            mixed_p.append(prompts[(i * 7) % 32])
            mixed_sp.append(SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, top_p=0.9, top_k=50,
                                           repetition_penalty=1.1))
    mixed = [r.token_ids for r in eng.generate(mixed_p, mixed_sp)]
    bad = {i: first_diff(mixed[w], alone[i]) for w, i in zip(where, reversed(range(32))) if mixed[w] != alone[i]}
    assert not bad, f"seeded rows differ in a reversed batch with unseeded rows (row: first diff): {bad}"
    _assert_no_leak(eng)
    del eng
    release_cuda()


def test_async_scheduling_equals_sync(source, graphs_engine, gpu_prompts):
    """Decodes fed their input ids from the previous step's picks on the device, in graph replays and eager steps:
    the tokens of a synchronous engine, for greedy rows that end at EOS or their max_tokens and for seeded sampled
    rows; a request aborted while its token is on the device frees its blocks."""
    sync = _engine(source, model=graphs_engine.runner.model, async_scheduling=False)
    eager = _engine(source, model=graphs_engine.runner.model, cuda_graphs=False)
    assert not sync.async_scheduling and eager.async_scheduling and graphs_engine.async_scheduling
    [first] = sync.generate([gpu_prompts[1]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    stop = (first.token_ids[4],)  # greedy row 1 stops at its first one: a stop that the host sees one step late
    params = [SamplingParams(max_tokens=8 + 5 * i, temperature=0.0, stop_token_ids=stop) if i % 2 else
              SamplingParams(max_tokens=40, seed=i, temperature=1.0, top_p=0.9, top_k=50, repetition_penalty=1.1)
              for i in range(len(gpu_prompts))]
    want = [(r.token_ids, r.finish_reason) for r in sync.generate(gpu_prompts, params)]
    assert want[1] == (first.token_ids[: first.token_ids.index(stop[0]) + 1], "stop"), want[1]
    assert "length" in {f for _, f in want}, want
    for eng in (graphs_engine, eager):
        got = [(r.token_ids, r.finish_reason) for r in eng.generate(gpu_prompts, params)]
        bad = {i: first_diff(g[0], w[0]) for i, (g, w) in enumerate(zip(got, want)) if g != w}
        assert not bad, f"async engine ({'graphs' if eng is graphs_engine else 'eager'}) diverges from sync: {bad}"
    eng = graphs_engine
    for i, p in enumerate(gpu_prompts[:4]):
        eng.add_request(f"abort-{i}", p, GREEDY)
    for _ in range(3):
        eng.step()
    assert all(eng.abort(f"abort-{i}") for i in range(4))
    while eng.has_unfinished():
        assert not eng.step()
    for e in (sync, eager, eng):
        _assert_no_leak(e)
    del sync, eager
    release_cuda()


def test_constrained_rows_take_their_masks_from_the_mask_process(source, graphs_engine, gpu_prompts):
    """By default the grammar masks come from the process beside the engine (common/grammar_proc.py): 32 constrained
    rows, greedy and seeded, give the tokens of an engine that fills them inline, and every mask after the child
    is ready came from it. Both pick a constrained step in the next call (``engine.async_constrained``, the default
    with async scheduling: the masks fill beside the forward); an engine that picks it before the step returns
    gives the same tokens."""
    import json

    from common.sampling import StructuredOutput

    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    kinds = [StructuredOutput("json_schema", json.dumps(person)), StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"),
             StructuredOutput("choice", choices=("yes", "no", "maybe")), StructuredOutput("json_object")]
    prompts = (gpu_prompts * 2)[:32]
    params = [SamplingParams(max_tokens=32, temperature=0.0 if i % 2 else 1.0, seed=i, structured=kinds[i % 4])
              for i in range(32)]
    model = graphs_engine.runner.model
    mirrored = _engine(source, model=model)  # the default: the mask process
    masks = mirrored.grammars.masks
    assert masks is not None and masks.wait_ready()
    got = [r.token_ids for r in mirrored.generate(prompts, params)]
    assert masks.remote_rows > 0 and masks.inline_rows == 0 and not masks.dead, (masks.remote_rows,
                                                                                   masks.inline_rows)
    inline = _engine(source, model=model, grammar_process=False)
    want = [r.token_ids for r in inline.generate(prompts, params)]
    bad = {i: first_diff(g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w}
    assert not bad, f"masks from the process give other tokens than inline masks (row: first diff): {bad}"
    sync = _engine(source, model=model, async_constrained=False)
    assert sync.async_scheduling and sync.grammars.masks.wait_ready()
    got = [r.token_ids for r in sync.generate(prompts, params)]
    bad = {i: first_diff(g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w}
    assert not bad, f"the synchronous pick gives other tokens than the deferred one (row: first diff): {bad}"
    for eng in (mirrored, inline, sync):
        _assert_no_leak(eng)
        eng.close()
    del mirrored, inline, sync
    release_cuda()
