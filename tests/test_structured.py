"""Structured outputs below the services: the grammar compiler and its cache, the sampler's per-row mask (a masked
row never picks a disallowed token, on every path), and the engine's matcher through replays, preemption and a
prefill done elsewhere."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from common import grammar_proc
from common.engine import RequestError
from common.grammar_proc import RELEASED
from common.loader import load_tokenizer
from common.sampler import Sampler, SampleRow
from common.sampling import SamplingParams, StructuredOutput
from common.sequence import FinishReason
from common.structured import GrammarCompiler, GrammarError, check
from tests.test_disaggregation import prefill, run
from tests.test_sampling import DEVICES

V = 49152
EOS = (2,)
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
PERSON_SO = StructuredOutput("json_schema", json.dumps(PERSON))


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(load_tokenizer().tk.to_str(), V, EOS)


def allowed_ids(matcher) -> set[int]:
    """The matcher's allowed tokens, from llguidance's own per-token bytes (not the sampler's bitmask)."""
    bias = matcher.raw.compute_logit_bias()
    return {i for i, b in enumerate(bias) if b}


def spiked_logits(n: int, spike_at: list[int], seed: int) -> torch.Tensor:
    """Random logits whose largest entry in row i is ``spike_at[i]`` by a wide margin."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g)
    x[torch.arange(n), torch.tensor(spike_at)] = 30.0
    return x


@pytest.mark.parametrize("knobs", [
    {"temperature": 0.0},  # all greedy: the argmax fast path
    {"temperature": 0.0, "repetition_penalty": 1.2},  # greedy through the processed logits
    {"temperature": 1.0},  # the full-vocabulary pick
    {"temperature": 1.5, "top_k": 5},  # the top-k candidate pick: every candidate but the disallowed may be masked
    {"temperature": 1.0, "top_p": 0.9, "min_p": 0.05},
], ids=["greedy-fast", "greedy-processed", "sampled", "top-k", "top-p-min-p"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_masked_row_never_picks_a_masked_token(compiler, knobs, device):
    """Rows under a grammar beside unconstrained ones: each constrained pick is allowed, although the raw logits
    put a disallowed token far on top; the unconstrained rows pick as if no grammar were in the batch."""
    sampler = Sampler(V, device, max_rows=8)
    constraints = [PERSON_SO, StructuredOutput("choice", choices=("yes", "no")),
                   StructuredOutput("regex", r"[0-9]{2,4}")]
    prefix = load_tokenizer().encode('{"name": "', add_special_tokens=False)
    for step_seed in range(8):
        matchers = [compiler.matcher(so) for so in constraints]
        # advance the JSON row a little so its mask is not the first one
        for t in prefix[: step_seed % 4]:
            assert matchers[0].accept(t)
        allowed = [allowed_ids(m) for m in matchers]
        banned = [min(set(range(1000, V)) - a) for a in allowed]  # a disallowed token per constrained row
        logits = spiked_logits(5, [*banned, 777, 1234], step_seed).to(device)
        p = SamplingParams(seed=step_seed, **knobs)
        rows = [SampleRow(p, step_seed, 0, [1], [], EOS, grammar=m) for m in matchers]
        rows += [SampleRow(p, step_seed, 0, [1], [], EOS) for _ in range(2)]
        got = sampler.sample(logits, rows).token_ids
        for i in range(3):
            assert got[i] in allowed[i], (i, got[i])
        if p.greedy:
            assert got[3:] == [777, 1234]
        if knobs == {"temperature": 0.0}:  # exactly the argmax over the allowed tokens
            for i in range(3):
                masked = logits[i].float().cpu().clone()
                masked[sorted(set(range(V)) - allowed[i])] = float("-inf")
                assert got[i] == int(masked.argmax()), (i, got[i])
        alone = Sampler(V, device).sample(logits[3:], rows[3:]).token_ids
        assert got[3:] == alone


def test_masked_sampling_draws_only_allowed_tokens_over_many_seeds(compiler):
    """Sampled at temperature 2 on flat logits: hundreds of draws, every one allowed by the choice grammar."""
    so = StructuredOutput("choice", choices=("alpha", "beta", "gamma", "delta"))
    allowed = allowed_ids(compiler.matcher(so))
    x = torch.zeros(1, V)
    picks = set()
    for seed in range(300):
        [t] = Sampler(V, "cpu").sample(x, [SampleRow(SamplingParams(temperature=2.0), seed, 0, [1], [], EOS,
                                                     grammar=compiler.matcher(so))]).token_ids
        assert t in allowed
        picks.add(t)
    assert len(picks) > 1  # it samples among them, not one fixed token


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_constrained_picks_replayed_as_cuda_graphs_equal_eager_picks(compiler):
    """A sampled step with constrained rows replays the pick's CUDA graph with the masks in its table, and gives
    the eager pick's tokens, step after step, every constrained pick allowed; rows without a constraint beside
    them, and a batch that shrinks (padded to 8 rows all along)."""
    graphs, eager = Sampler(V, "cuda", max_rows=8), Sampler(V, "cuda", max_rows=8, cuda_graphs=False)
    constraints = [PERSON_SO, StructuredOutput("regex", r"[0-9]{2,40}"), StructuredOutput("json_object")]
    kinds = [dict(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1), dict(temperature=0.0),
             dict(temperature=0.8, min_p=0.05, presence_penalty=0.3)]
    rows: dict[str, list[SampleRow]] = {}
    for i in range(5):
        p = SamplingParams(seed=i, **kinds[i % 3])
        rows[f"r{i}"] = [SampleRow(p, i, 0, [1, 5, 9], [], EOS, key=f"r{i}",
                                   grammar=compiler.matcher(constraints[i]) if i < 3 else None) for _ in range(2)]
    def leave(k: str) -> None:
        graphs.release(k)
        eager.release(k)
        del rows[k]

    for step in range(12):
        if step == 6:  # a smaller batch: an unconstrained row leaves
            leave("r4")
        logits = (torch.randn(len(rows), V, generator=torch.Generator().manual_seed(step)) * 4).cuda()
        a = graphs.sample(logits, [g for g, _ in rows.values()]).token_ids
        b = eager.sample(logits, [e for _, e in rows.values()]).token_ids
        assert a == b, f"step {step}"
        for (g, e), t in zip(rows.values(), a):
            for r in (g, e):
                if r.grammar is not None:
                    assert r.grammar.accept(t), f"step {step}: {t} is not allowed"
                r.output_ids.append(t)
                r.position += 1
        for k in [k for k, (g, _) in rows.items() if g.grammar is not None and g.grammar.terminated]:
            leave(k)  # its grammar is complete: the engine would end the sequence here
    pg = graphs._graphs
    assert pg is not None and pg.replays >= 12 and any(k.masked for k in pg.graphs), pg.graphs.keys()


def test_compiled_grammars_are_cached_by_constraint(compiler):
    before = compiler.misses
    a = compiler.compile(StructuredOutput("regex", "[a-c]+x"))
    assert compiler.compile(StructuredOutput("regex", "[a-c]+x")) is a
    assert compiler.misses == before + 1
    assert compiler.compile(StructuredOutput("regex", "[a-c]+y")) is not a


@pytest.mark.parametrize("so, message", [
    (StructuredOutput("json_schema", "{not json"), "json_schema is not valid JSON"),
    (StructuredOutput("json_schema", '{"type": "strnig"}'), "invalid json schema: .*strnig"),
    (StructuredOutput("json_schema", '{"type": "integer", "minimum": 5, "maximum": 2}'), "Unsatisfiable"),
    (StructuredOutput("regex", "a[b"), "invalid regex: .*unclosed character class"),
    (StructuredOutput("grammar", "start: foo"), 'invalid grammar: .*unknown name: "foo"'),
    (StructuredOutput("choice"), "choice needs at least one string"),
])
def test_bad_constraints_are_refused_with_the_problem_named(compiler, so, message):
    with pytest.raises(GrammarError, match=message):
        check(so)
    with pytest.raises(GrammarError, match=message):
        compiler.compile(so)


def test_gbnf_grammars_are_taken_too():
    check(StructuredOutput("grammar", 'root ::= "yes" | "no"'))


# -- the engine --------------------------------------------------------------------------------------------------
def chat(engine, q):
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))


def test_constrained_outputs_match_their_constraints(engine):
    prompts = [chat(engine, q) for q in ("Describe a person as JSON.", "Is water wet?", "A code?", "A cat as JSON.")]
    params = [SamplingParams(max_tokens=40, temperature=0, structured=PERSON_SO),
              SamplingParams(max_tokens=10, temperature=1.0, seed=5, structured=StructuredOutput(
                  "choice", choices=("yes", "no", "maybe"))),
              SamplingParams(max_tokens=12, temperature=1.0, seed=6, structured=StructuredOutput(
                  "regex", r"[0-9]{3}-[a-z]{2}")),
              SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutput("json_object"),
                             min_tokens=3)]
    person, choice, code, obj = engine.generate(prompts, params)
    assert person.finish_reason == "stop"
    jsonschema.validate(json.loads(person.text), PERSON)
    assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"
    assert len(code.text) == 6 and code.text[:3].isdigit() and code.text[3] == "-" and code.finish_reason == "stop"
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict)


def test_a_model_under_a_smaller_tokenizer_ends_its_grammar_on_the_tokenizer_eos(tmp_path):
    """Random weights at a Llama 3 vocabulary (EOS 128001) under SmolLM2's 49,152-token tokenizer, as the GPU
    benchmarks run real-size models: constraints compile against the tokenizer's own EOS, and the output keeps to
    them."""
    from common.config import EngineConfig
    from common.engine import LLMEngine
    from common.loader import load_model_source

    cfg = json.loads(Path("common/model_configs/tiny-llama.json").read_text())
    cfg.update(vocab_size=128256, bos_token_id=128000, eos_token_id=[128001, 128009])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    eng = LLMEngine(load_model_source(f"dummy:{tmp_path / 'config.json'}", "smollm2"),
                    EngineConfig(kv_cache_memory=16 << 20))
    outs = eng.generate([[1, 2, 3]] * 3, [SamplingParams(max_tokens=12, temperature=1.0, seed=s, structured=so)
                                          for s, so in enumerate([
                                              StructuredOutput("choice", choices=("yes", "no", "maybe")),
                                              StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"),
                                              PERSON_SO])])
    assert outs[0].text in ("yes", "no", "maybe") and outs[0].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[1].text) and outs[1].finish_reason == "stop"
    if outs[2].finish_reason == "stop":
        jsonschema.validate(json.loads(outs[2].text), PERSON)
    else:
        assert outs[2].finish_reason == "length" and outs[2].text.startswith('{"')


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(engine):
    [r] = engine.generate([chat(engine, "Describe a person.")],
                          SamplingParams(max_tokens=4, temperature=0, structured=PERSON_SO))
    assert r.finish_reason == "length" and len(r.token_ids) == 4 and r.text.startswith('{"name": ')


def test_a_grammar_complete_on_its_last_token_ends_with_stop(engine):
    """No room left for the EOS a complete grammar allows: the request still ends with stop (the mirrored matcher
    catches up to say the grammar is complete)."""
    [r] = engine.generate([chat(engine, "A number?")],
                          SamplingParams(max_tokens=3, temperature=0, structured=StructuredOutput("regex", "[0-9]{3}")))
    assert r.finish_reason == "stop" and len(r.token_ids) == 3 and r.text.isdigit()


def test_a_bad_constraint_is_refused_before_any_block_is_taken(engine):
    p = SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "(unclosed"))
    with pytest.raises(RequestError, match="invalid regex"):
        engine.add_request("bad-regex", [1, 2, 3], p)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=0, structured=PERSON_SO),
    SamplingParams(max_tokens=40, temperature=1.0, seed=21, top_p=0.9, structured=PERSON_SO),
], ids=["greedy", "seeded"])
def test_replayed_outputs_keep_the_matcher_in_step(make_engine, params):
    """A moved stream's prior outputs are replayed into its matcher: the rest equals the undisturbed run's tail.
    Outputs that do not follow the constraint are refused."""
    eng = make_engine(dtype="float32")
    ids = chat(eng, "Describe a person as JSON.")
    [full] = eng.generate([ids], params)
    k = 5
    eng.add_request("moved", ids, params, prior_output_ids=full.token_ids[:k])
    assert full.token_ids[:k] + run(eng, "moved") == full.token_ids
    bad = eng.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(RequestError, match=r"output token 0 .* does not follow the json schema constraint"):
        eng.add_request("bad", ids, params, prior_output_ids=bad)


def test_preempted_constrained_sequences_finish_as_they_would_alone(engine, make_engine):
    prompts = [chat(engine, f"Describe {n}, a person from a small town by the sea, as a JSON object with a name and "
                            f"an age.") for n in ("Ada", "Bob", "Eve", "Max")]  # 54 tokens: 4 of 8 blocks
    ps = [SamplingParams(max_tokens=30, temperature=1.0, seed=40 + i, structured=PERSON_SO) for i in range(4)]
    alone = [engine.generate([p], q)[0].token_ids for p, q in zip(prompts, ps)]
    small = make_engine(dtype="float32", max_num_seqs=4, num_gpu_blocks_override=8)
    got = small.generate(prompts, ps)
    assert small.scheduler.num_preemptions > 0
    assert [r.token_ids for r in got] == alone


def test_prefill_elsewhere_samples_the_first_token_under_the_grammar(make_engine):
    """The prefill worker's first token obeys the grammar, and the decode worker's matcher starts after it: the
    whole output equals one engine's."""
    pre, dec, whole = (make_engine(dtype="float32") for _ in range(3))
    ids = chat(whole, "Give me a number.")
    p = SamplingParams(max_tokens=12, temperature=0, structured=StructuredOutput("regex", r"\[[0-9]{1,3}\]"))
    [ref] = whole.generate([ids], p)
    assert ref.text.startswith("[") and ref.text.endswith("]")
    o = prefill(pre, "pd", ids, p)
    assert whole.tokenizer.decode(o.new_token_ids).startswith("[")
    first, plan = dec.add_prefilled("pd", ids, o.new_token_ids[0], p)
    assert plan is not None
    dec.runner.kv_cache[plan.local_block_ids] = pre.runner.kv_cache[o.kv_block_ids[plan.num_cached_blocks:]]
    pre.release("pd")
    dec.kv_ready("pd")
    assert first.new_token_ids + run(dec, "pd") == ref.token_ids
    with pytest.raises(RequestError, match=r"first token .* does not follow"):
        dec.add_prefilled("pd2", ids, eng_token(dec, "x"), p)


def eng_token(engine, text):
    [t] = engine.tokenizer.encode(text, add_special_tokens=False)
    return t


# -- the grammar mask process (common/grammar_proc.py) ------------------------------------------------------------
ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "string", "enum": ["tea", "bread", "jam"]}, "minItems": 1},
    "total": {"type": "number"}}, "required": ["items", "total"], "additionalProperties": False}


@pytest.mark.parametrize("spin", [0.0, 0.002], ids=["asleep", "spinning"])
def test_the_mask_process_fills_the_masks_the_matchers_fill_inline(spin, monkeypatch):
    """Mirrored matchers walk instances of three constraints token by token: every step's rows from the child
    equal the inline fill, bit for bit. A matcher made with no slot free stays inline; a dropped matcher's slot is
    taken again. Both ways the child waits on the pipe (asleep in select; polling it, as on a GPU host)."""
    monkeypatch.setenv("TOKENMILL_GRAMMAR_SPIN_S", str(spin))
    tok = load_tokenizer()
    inline = GrammarCompiler(tok.tk.to_str(), V, EOS)
    mirrored = GrammarCompiler(tok.tk.to_str(), V, EOS, fill_process=True)
    masks = mirrored.masks
    assert masks is not None and masks.wait_ready()
    masks._free = masks._free[-3:]  # three slots: the fourth matcher stays inline
    cases = [(PERSON_SO, '{"name": "Ada", "age": 36}'),
             (StructuredOutput("json_schema", json.dumps(ORDER)), '{"items": ["tea", "jam"], "total": 4.5}'),
             (StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"), "123-ab"),
             (PERSON_SO, '{"name": "Bob", "age": 7}')]
    walks = [tok.encode(text, add_special_tokens=False) for _, text in cases]
    pairs = [(mirrored.matcher(so), inline.matcher(so)) for so, _ in cases]
    assert [m.slot_in(masks) is not None for m, _ in pairs] == [True, True, True, False]
    for step in range(max(map(len, walks))):
        live = [i for i, w in enumerate(walks) if step < len(w)]
        mirrored.flush()
        # without waiting, as on a GPU: the reader waits until the child's ``answered`` word reaches the batch
        at, need = mirrored.table.fill([pairs[i][0] for i in live], wait=False)
        assert need == (masks._sent if any(i < 3 for i in live) else 0)
        deadline = time.monotonic() + 10
        while mirrored.table.answered[0] < need and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert mirrored.table.answered[0] == need, "the child did not write its answered word"
        # the mirrored rows are read where the child wrote them (its slots); the fourth's in the engine's rows
        assert [a < masks.capacity for a in at] == [i < 3 for i in live]
        got = mirrored.table.host[at]
        want = inline.table.host[inline.table.fill([pairs[i][1] for i in live])[0]]
        assert (got == want).all(), f"step {step}: the child's masks differ from the inline fill"
        for i in live:
            assert pairs[i][0].accept(walks[i][step]) and pairs[i][1].accept(walks[i][step])
    assert masks.remote_rows > 0 and masks.inline_rows > 0
    slot = pairs[0][0].slot_in(masks)
    del pairs[0]
    again = mirrored.matcher(PERSON_SO)
    assert again.slot_in(masks) == slot  # the dropped matcher's slot, reused
    mirrored.flush()
    got = mirrored.table.host[mirrored.table.fill([again])[0]]
    want = inline.table.host[inline.table.fill([inline.matcher(PERSON_SO)])[0]]
    assert (got == want).all()
    mirrored.close()


def _mirrored_engine(make_engine, **kw):
    eng = make_engine(dtype="float32", **kw)  # the default: the mask process
    assert eng.grammars.masks is not None and eng.grammars.masks.wait_ready()
    return eng


MIXED = [SamplingParams(max_tokens=40, temperature=0, structured=PERSON_SO),
         SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured=StructuredOutput(
             "json_schema", json.dumps(ORDER))),
         SamplingParams(max_tokens=12, temperature=1.0, seed=6, top_k=20, structured=StructuredOutput(
             "regex", r"[0-9]{3}-[a-z]{2}")),
         SamplingParams(max_tokens=20, temperature=0.8, seed=9),  # unconstrained, in the same batch
         SamplingParams(max_tokens=30, temperature=1.0, seed=12, structured=StructuredOutput(
             "choice", choices=("yes", "no", "maybe")))]


@pytest.mark.parametrize("threads", [0, 1], ids=["pool", "one-thread"])
def test_an_engine_with_the_mask_process_gives_the_inline_outputs(engine, make_engine, threads, monkeypatch):
    """With llguidance's thread pool (0; here for any batch of two masks or more) and with every mask filled one
    after the other on the filling thread (1), in the mask process and inline."""
    monkeypatch.setenv("TOKENMILL_GRAMMAR_SERIAL_ROWS", "1")  # the child's
    monkeypatch.setattr(grammar_proc, "SERIAL_ROWS", 1)  # the inline fill's
    prompts = [chat(engine, q) for q in ("A person as JSON.", "An order as JSON.", "A code?", "Say hi.", "Yes?")]
    inline = make_engine(dtype="float32", grammar_process=False, grammar_threads=threads)
    want = [r.token_ids for r in inline.generate(prompts, MIXED)]
    assert inline.grammars.masks is None
    assert (inline.grammars.table.executor is None) == (threads == 1)
    eng = _mirrored_engine(make_engine, grammar_threads=threads)
    got = [r.token_ids for r in eng.generate(prompts, MIXED)]
    assert got == want
    masks = eng.grammars.masks
    assert masks.remote_rows > 0 and masks.inline_rows == 0  # each first mask too: sent before the forward
    fills = eng.grammars.fill_stats()  # every batch answered was timed (the ready word is not a batch)
    assert 0 < fills["batches"] <= masks.remote_rows and fills["fill_seconds"] > 0, fills
    assert 0 <= fills["slow_batches"] <= fills["batches"], fills
    eng.close()


# lists with no maxItems, the first with no minItems either (what pydantic makes of ``list[int]``)
LISTS = {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"}},
                                          "tags": {"type": "array", "minItems": 1, "items": {"type": "string"}}},
         "required": ["numbers", "tags"], "additionalProperties": False}


def test_items_of_an_unbounded_list_take_the_masks_of_their_own_place(engine, make_engine):
    """The mask process keeps masks by place: the place after a list's comma (a space and an item must follow) is
    not the place after its ``[`` (where ``]`` may follow, and no space)."""
    prompts = [chat(engine, q) for q in ("Count to twelve as JSON.", "Some numbers and tags as JSON.")] * 2
    params = [SamplingParams(max_tokens=64, temperature=t, seed=i, structured=StructuredOutput(
        "json_schema", json.dumps(LISTS))) for i, t in enumerate((0.0, 0.0, 1.0, 1.0))]
    want = [r.token_ids for r in make_engine(dtype="float32", grammar_process=False).generate(prompts, params)]
    eng = _mirrored_engine(make_engine)
    got = eng.generate(prompts, params)
    assert [r.token_ids for r in got] == want
    assert eng.grammars.masks.cached_rows > 0  # the cache served places of these lists
    assert max(r.text.count(", ") for r in got) >= 3, [r.text for r in got]  # lists of several items
    for r in got:
        assert r.finish_reason == "length" or (jsonschema.validate(json.loads(r.text), LISTS) is None), r.text
    eng.close()


def test_mirrored_matchers_leave_the_advance_to_the_mask_process(engine, make_engine):
    """The engine thread does not advance a mirrored matcher (it keeps the tokens, to catch up only if needed): the
    child's masks alone steer the row, and the completed grammar ends the request on the EOS it then allows."""
    eng = _mirrored_engine(make_engine)
    eng.add_request("a", chat(engine, "A person as JSON."), MIXED[0])
    out: list[int] = []
    lagged = 0
    while eng.has_unfinished():
        for o in eng.step():
            out += o.new_token_ids
            s = eng._seqs.get("a")
            if s is not None:
                assert s.matcher._lag == s.output_ids  # every token taken, none consumed here
                lagged += 1
    assert lagged > 5 and out[-1] in EOS and o.finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(eng.tokenizer.decode(out[:-1])), PERSON)
    eng.close()


def test_matchers_made_before_the_mask_process_was_ready_are_mirrored_once_it_is():
    """A burst of constrained requests right after the compiler is made finds its mask process still loading: their
    matchers start inline, and the first flush after it is ready mirrors them with the tokens they took, so every
    later mask comes from the child, equal to the inline fill's."""
    tok = load_tokenizer()
    inline = GrammarCompiler(tok.tk.to_str(), V, EOS)
    mirrored = GrammarCompiler(tok.tk.to_str(), V, EOS, fill_process=True)
    masks = mirrored.masks
    assert masks is not None and not masks.ready  # still loading its tokenizer
    walk = tok.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)
    early, ref = mirrored.matcher(PERSON_SO), inline.matcher(PERSON_SO)
    assert early.slot_in(masks) is None and early.stray is not None
    for t in walk[:3]:
        assert early.accept(t) and ref.accept(t)
    mirrored.mirror_strays()
    assert early.stray is not None  # not ready yet: still inline
    assert masks.wait_ready()
    mirrored.mirror_strays()  # mirrored now, with the three tokens it took
    mirrored.flush()
    assert early.slot_in(masks) is not None and early.stray is None
    for t in walk[3:]:
        at, _ = mirrored.table.fill([early])
        assert at[0] < masks.capacity  # the child's row
        assert (mirrored.table.host[at] == inline.table.host[inline.table.fill([ref])[0]]).all()
        assert early.accept(t) and ref.accept(t)
        mirrored.flush()
    assert masks.remote_rows == len(walk) - 3
    mirrored.close()


def test_a_dead_mask_process_leaves_the_fills_inline(engine, make_engine):
    """The child killed in the middle of a batch: the engine fills inline from then on, with the same outputs."""
    import os
    import signal

    prompts = [chat(engine, q) for q in ("A person as JSON.", "An order as JSON.", "A code?", "Say hi.", "Yes?")]
    want = [r.token_ids for r in make_engine(dtype="float32", grammar_process=False).generate(prompts, MIXED)]
    eng = _mirrored_engine(make_engine)
    masks = eng.grammars.masks
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, MIXED)):
        eng.add_request(f"r{i}", p, sp)
    steps = 0
    while eng.has_unfinished():
        if steps == 4:
            assert masks.remote_rows > 0 and not masks.dead
            os.kill(masks._proc.pid, signal.SIGKILL)
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
        steps += 1
    assert masks.dead and list(got.values()) == want
    assert masks.answered[0] == RELEASED  # a pick waiting on a GPU for the dead child's answer goes on
    eng.close()


def test_a_wait_that_gave_up_on_the_device_ends_the_mask_process():
    """A pick's wait on the device for the child's answer that gave up (a hung child) flags it, and the child is
    taken for dead: fills go inline and waits pass."""
    tok = load_tokenizer()
    mirrored = GrammarCompiler(tok.tk.to_str(), V, EOS, fill_process=True)
    masks = mirrored.masks
    assert masks is not None and masks.wait_ready()
    m = mirrored.matcher(PERSON_SO)
    mirrored.flush()
    at, need = mirrored.table.fill([m], wait=False)
    assert at == [m.slot_in(masks)] and need == masks._sent > 0
    masks.hung()
    assert masks.dead and masks.answered[0] == RELEASED
    at, need = mirrored.table.fill([m], wait=False)
    assert at[0] >= masks.capacity and need == 0  # filled inline, in the engine's rows: nothing to wait for
    t = load_tokenizer().encode("{", add_special_tokens=False)[0]
    m.send(t)
    type(m).send_all([m, None], [t, t], masks)
    assert masks._ops == []  # the tokens of a mirror that is gone are not kept for a flush that never comes
    mirrored.close()


def test_answers_a_pick_did_not_wait_for_are_read_in_bulk_and_counted():
    """Picks that do not wait on the host (a GPU's) leave the child's answers in the pipe (a read is a system call
    on the step's path); the counters behind /metrics read them first, so every answered batch is counted."""
    tok = load_tokenizer()
    mirrored = GrammarCompiler(tok.tk.to_str(), V, EOS, fill_process=True)
    masks = mirrored.masks
    assert masks is not None and masks.wait_ready()
    m = mirrored.matcher(PERSON_SO)
    walk = tok.encode(json.dumps({"name": "Ada", "age": 36}), add_special_tokens=False)
    for t in walk:
        mirrored.flush()
        mirrored.table.fill([m], wait=False)
        m.send(t)
        assert m.consume(t)
    mirrored.flush()
    deadline = time.monotonic() + 10
    while masks.answered[0] < masks._sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert masks.answered[0] == masks._sent == len(walk) + 1
    assert masks._done < masks._sent  # not read on the way
    assert mirrored.fill_stats()["batches"] == len(walk) + 1
    assert sum(mirrored.mask_counts().values()) == len(walk)
    mirrored.close()


def test_without_memfd_the_masks_are_filled_inline(monkeypatch):
    """Where the mask process cannot start (no memfd_create off Linux), the compiler fills inline and says so."""
    import os

    monkeypatch.delattr(os, "memfd_create")
    c = GrammarCompiler(load_tokenizer().tk.to_str(), V, EOS, fill_process=True)
    assert c.masks is None
    m = c.matcher(PERSON_SO)
    assert m._remote is None and m.accept(load_tokenizer().encode("{", add_special_tokens=False)[0])


def test_a_mask_process_that_cannot_start_leaves_nothing_behind(monkeypatch, tmp_path):
    """Popen fails: the compiler fills inline, and the tokenizer file written for the child is gone."""
    import subprocess
    import tempfile

    def refuse(*a, **kw):
        raise OSError("no processes left")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(subprocess, "Popen", refuse)
    c = GrammarCompiler(load_tokenizer().tk.to_str(), V, EOS, fill_process=True)
    assert c.masks is None and list(tmp_path.iterdir()) == []
    assert c.matcher(PERSON_SO)._remote is None
