"""Engine behaviour on the real model: sampling controls, stops, priorities, aborts, bad input."""

from __future__ import annotations

import pytest
import torch

from common import cpu_kernels, model_cpu
from common.engine import LLMEngine, RequestError
from common.loader import load_model_source
from common.sampling import SamplingParams


def chat(engine, text: str) -> list[int]:
    tk = engine.tokenizer
    return tk.encode(tk.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


@pytest.fixture(scope="module")
def france(engine):
    return chat(engine, "What is the capital of France?")


def test_greedy_answer_and_eos(engine, france):
    [r] = engine.generate([france], SamplingParams(max_tokens=32, temperature=0))
    assert r.text == "The capital of France is Paris."
    assert r.finish_reason == "stop"
    assert r.token_ids[-1] == 2  # <|im_end|> ends it and is reported among the ids


def test_max_tokens_and_ignore_eos(engine, france):
    [r] = engine.generate([france], SamplingParams(max_tokens=5, temperature=0))
    assert len(r.token_ids) == 5 and r.finish_reason == "length"
    [r] = engine.generate([france], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert len(r.token_ids) == 20 and r.finish_reason == "length"
    assert 2 in r.token_ids  # ran through EOS


def test_stop_strings(engine, france):
    [r] = engine.generate([france], SamplingParams(max_tokens=32, temperature=0, stop=("Paris",)))
    assert r.text == "The capital of France is " and r.finish_reason == "stop"
    [r] = engine.generate(
        [france], SamplingParams(max_tokens=32, temperature=0, stop=("Paris",), include_stop_str_in_output=True)
    )
    assert r.text == "The capital of France is Paris"
    [r] = engine.generate([france], SamplingParams(max_tokens=32, temperature=0, stop=("of Fr",)))
    assert r.text == "The capital " and r.finish_reason == "stop"  # a stop string spanning tokens


def test_stop_token_ids(engine, france):
    [full] = engine.generate([france], SamplingParams(max_tokens=32, temperature=0))
    stop_tok = full.token_ids[3]
    [r] = engine.generate([france], SamplingParams(max_tokens=32, temperature=0, stop_token_ids=(stop_tok,)))
    assert r.token_ids == full.token_ids[:4] and r.finish_reason == "stop"


@pytest.mark.parametrize("knobs", [
    {"top_p": 0.95},
    {"top_k": 50, "top_p": 0.9, "repetition_penalty": 1.1, "frequency_penalty": 0.5, "logit_bias": {13: 2.0}},
], ids=["top_p", "top_k-top_p-penalties"])
def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(engine, make_engine, france, knobs):
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True, **knobs)
    [alone] = engine.generate([france], p)
    others = [chat(engine, q) for q in ("Tell me a joke.", "Name a color.", "Count to five.")]
    batch = engine.generate([*others, france], [SamplingParams(max_tokens=24, temperature=1.0)] * 3 + [p])
    assert batch[-1].token_ids == alone.token_ids
    small = make_engine(dtype="float32", max_num_seqs=4, num_gpu_blocks_override=6)  # forces preemption
    again = small.generate([*others, france], [SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)] * 3 + [p])
    assert small.scheduler.num_preemptions > 0
    assert again[-1].token_ids == alone.token_ids
    [other_seed] = engine.generate([france], SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True))
    assert other_seed.token_ids != alone.token_ids


def test_truncation_knobs_reduce_to_greedy(engine, france):
    [greedy] = engine.generate([france], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p in (
        SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, min_p=1.0, seed=3, ignore_eos=True),
    ):
        [r] = engine.generate([france], p)
        assert r.token_ids == greedy.token_ids, p


def test_penalties_change_a_repetitive_continuation(engine):
    ids = engine.tokenizer.encode("one-to-many, many-to-many, one-to-one, many-to-one, one-to-many")
    [plain] = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    top = max(set(plain.token_ids), key=plain.token_ids.count)
    assert plain.token_ids.count(top) >= 2, plain.text
    for kw in ({"repetition_penalty": 1.8},):  # the exact penalty arithmetic is in test_sampling.py
        [r] = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **kw))
        assert r.token_ids.count(top) < plain.token_ids.count(top), (kw, r.text)


def test_min_tokens_masks_eos(engine, france):
    [r] = engine.generate([france], SamplingParams(max_tokens=20, min_tokens=12, temperature=0))
    assert len(r.token_ids) >= 12 and 2 not in r.token_ids[:12]


def test_logprobs_with_alternatives(engine, france):
    [r] = engine.generate([france], SamplingParams(max_tokens=6, temperature=0, logprobs=3))
    assert r.logprobs is not None and len(r.logprobs) == 6
    for lp in r.logprobs:
        assert len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy: the sampled token is the most likely
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob <= 0.0


def test_priority_orders_waiting_requests(make_engine, france):
    eng = make_engine(dtype="float32", max_num_seqs=1)
    p = SamplingParams(max_tokens=3, temperature=0)
    eng.add_request("low", france, p, priority=5)
    eng.add_request("high", france, p, priority=0)
    order = []
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["high", "low"]


def test_abort_frees_blocks(make_engine, france):
    eng = make_engine(dtype="float32")
    eng.add_request("a", france, SamplingParams(max_tokens=50, temperature=0))
    eng.step()
    eng.step()
    assert eng.block_manager.num_free_blocks < eng.block_manager.num_blocks
    assert eng.abort("a")
    assert not eng.abort("a")
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert not eng.has_unfinished()


@pytest.mark.parametrize(
    ("ids", "params", "message"),
    [
        ([], SamplingParams(), "prompt is empty"),
        ([1] * 8192, SamplingParams(max_tokens=1), "8192 tokens; this model accepts at most 8192"),
        ([1] * 8000, SamplingParams(max_tokens=500), "8500 exceeds this model's context of 8192"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens must be at least 1, got 0"),
        ([1, 2], SamplingParams(max_tokens=-3), "max_tokens must be at least 1, got -3"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        ([1, 2], SamplingParams(temperature=-1), "temperature must be in [0, 100], got -1"),
        ([1, 99999], SamplingParams(), "token id 99999 is outside the vocabulary [0, 49152)"),
        ([1, 2], SamplingParams(logprobs=50), "logprobs must be in [0, 20], got 50"),
    ],
)
def test_bad_requests_are_refused_with_the_value_and_the_limit(engine, ids, params, message):
    free = engine.block_manager.num_free_blocks
    with pytest.raises(RequestError) as e:
        engine.add_request("bad", ids, params)
    assert message in str(e.value)
    assert engine.block_manager.num_free_blocks == free
    assert not engine.has_unfinished()


def test_unknown_model_path_names_it():
    with pytest.raises(FileNotFoundError, match=r"model '/nonexistent/model.gguf' not found"):
        load_model_source("/nonexistent/model.gguf")
    with pytest.raises(FileNotFoundError, match="dummy config 'nope' not found"):
        load_model_source("dummy:nope")


def test_bfloat16_runs_on_any_cpu_packed_where_onednn_can(make_engine, france):
    """bfloat16 on a CPU whose oneDNN has no bf16 matmul (no AVX-512 bw/vl/dq, no AVX-NE-CONVERT: an AVX2-only
    EPYC) keeps its plain matrices and the plain matmul; elsewhere they are packed. Greedy output holds either way."""
    eng = make_engine(dtype="bfloat16")
    model = eng.runner.model
    assert (model.packed is not None) == model_cpu.bf16_packing_supported()
    assert (model.layers[0].qkv.numel() == 0) == (model.packed is not None)  # packed: the plain copies are freed
    [r] = eng.generate([france], SamplingParams(max_tokens=12, temperature=0))
    assert r.text.startswith("The capital of France is Paris")


@pytest.mark.skipif(not model_cpu.bf16_packing_supported(),
                    reason="oneDNN's bfloat16 matmul needs AVX-512 (bw, vl, dq) or AVX-NE-CONVERT")
def test_bfloat16_prepacked_matmuls_pick_as_plain_ones(make_engine, source, france):
    from common.config import EngineConfig
    from common.model import LlamaModel

    eng = make_engine(dtype="bfloat16")
    model = eng.runner.model
    assert model.packed is not None, "CPU bfloat16 should prepack its matrices"
    assert model.layers[0].qkv.numel() == 0, "the plain copies of packed matrices are freed"
    # with AMX, batches of up to 32 rows (this prompt too) take the small-batch matmul
    assert bool(model.packed.small) == cpu_kernels.amx_bf16()
    # the same weights, never packed: a model handed to an engine is used as it is
    plain_model = LlamaModel(source.config, torch.bfloat16, "cpu")
    plain_model.load_weights(source.weights())
    plain_eng = LLMEngine(source, EngineConfig(dtype="bfloat16", kv_cache_memory=32 << 20), model=plain_model)
    assert plain_model.packed is None
    # the same backend, so the same attention: this compares the matmuls
    assert plain_model.backend.name == model.backend.name == "cpu"
    assert plain_model.backend.prefill_kernel == model.backend.prefill_kernel == cpu_kernels.amx_bf16()
    # Packing changes which oneDNN kernel runs and so the order of a matmul's sums. On the CI machines where this
    # test was written the two layouts gave the same logits bit for bit; on a Xeon with AVX-512 but neither AMX nor
    # AVX512-BF16, some prompt lengths differ by bfloat16 rounding carried through the layers (up to ~1 in a
    # logit; 560 of 563 greedy tokens the same: the others where two logits nearly tie). What holds on every CPU:
    # the same greedy token at nearly every position of the reference prompts (a wrong packing agrees at few).
    from tests.prompts import prompt_ids

    same = total = 0
    for ids in [france, *prompt_ids(eng.tokenizer)]:
        a, b = eng.runner.score([ids])[0], plain_eng.runner.score([ids])[0]
        same += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    assert same >= 0.98 * total, f"packed and plain bfloat16 matmuls pick the same token at {same} of {total}"
    [r] = eng.generate([france], SamplingParams(max_tokens=12, temperature=0))
    assert r.text.startswith("The capital of France is Paris")


def test_noop_model_runs_the_control_plane_only(make_engine):
    eng = make_engine(noop_model=True, max_num_seqs=8)
    res = eng.generate([[1, 2, 3]] * 8, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [len(r.token_ids) for r in res] == [5] * 8
    sampled = SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, repetition_penalty=1.2, ignore_eos=True)
    assert [r.token_ids for r in eng.generate([[1, 2, 3]] * 8, sampled)] == [[0] * 5] * 8


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=11, repetition_penalty=1.3,
                   frequency_penalty=0.5, ignore_eos=True),
], ids=["greedy", "seeded-with-penalties"])
def test_prior_outputs_continue_where_another_worker_stopped(make_engine, france, params):
    """A stream moved off a failed worker comes back with the tokens it already sent: they count as outputs
    (max_tokens, penalties, a seeded row's positions), so the rest equals the tail of an undisturbed run."""
    eng = make_engine(dtype="float32")
    [full] = eng.generate([france], params)
    assert len(full.token_ids) == 24
    k = 9
    eng.add_request("moved", france, params, prior_output_ids=full.token_ids[:k])
    rest = []
    while eng.has_unfinished():
        for o in eng.step():
            rest += o.new_token_ids
            if o.finished:
                assert o.num_output_tokens == 24 and o.num_prompt_tokens == len(france)
    assert rest == full.token_ids[k:]
    with pytest.raises(RequestError, match="24 tokens were already generated and max_tokens is 24"):
        eng.add_request("done", france, params, prior_output_ids=full.token_ids)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
