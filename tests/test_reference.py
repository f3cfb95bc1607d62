"""The engine against the transformers reference, token for token, and its batch invariance.

Greedy outputs for 20 varied prompts (64 tokens each; EOS masked for the first 64 tokens on both sides so every
prompt runs the full length) must equal transformers' ``generate``: alone, in a batch of 32, with 32-token
chunked prefill, with the prefix cache hit, and after preemption.
"""

from __future__ import annotations

import pytest
import torch

from common.sampling import SamplingParams
from tests.prompts import prompt_ids

N_NEW = 64
GREEDY = SamplingParams(max_tokens=N_NEW, min_tokens=N_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def prompts(source):
    return prompt_ids(source.tokenizer)


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    """transformers' greedy continuations, one left-padded batch."""
    width = max(len(p) for p in prompts)
    pad = 2
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=N_NEW, min_new_tokens=N_NEW,
            pad_token_id=pad, eos_token_id=2,
        )
    return [row[width:].tolist() for row in out]


def _prefill_logits(engine, ids: list[int]) -> torch.Tensor:
    return engine.runner.score([ids])[0][-1]


def test_first_forward_logits_match_transformers(engine, hf_model, prompts):
    # these reference checks run float32 on the CPU fast path (C++ kernels where they compile with AVX-512, packed
    # matmuls from 4 rows up), the path the engine takes by default
    from common import cpu_kernels

    model = engine.runner.model
    assert (model.backend.name == "cpu") == cpu_kernels.vectorized()
    assert model.packed is not None and model.packed.min_rows == 4
    for ids in (prompts[0], prompts[13], prompts[19]):
        ours = _prefill_logits(engine, ids)
        with torch.inference_mode():
            ref = hf_model(torch.tensor([ids])).logits[0, -1].float()
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < 1e-3, f"logits differ by {rel:.2e} (relative) for a {len(ids)}-token prompt"
        assert int(ours.argmax()) == int(ref.argmax())


def test_greedy_batch_of_32_matches_transformers(engine, prompts, reference):
    # 20 reference prompts plus 12 others sharing the batch
    fillers = [p[::-1] for p in prompts[:12]]
    results = engine.generate(prompts + fillers, GREEDY)
    for i, (r, ref) in enumerate(zip(results[:20], reference)):
        assert r.token_ids == ref, f"prompt {i} diverges at token {_first_diff(r.token_ids, ref)}"
        assert r.finish_reason == "length"


def test_greedy_alone_matches_transformers(make_engine, prompts, reference):
    eng = make_engine(dtype="float32", max_num_seqs=1, enable_prefix_caching=False)
    results = eng.generate(prompts, GREEDY)
    assert eng.num_steps >= len(prompts) * N_NEW  # one sequence per step: each prompt really ran alone
    for i, (r, ref) in enumerate(zip(results, reference)):
        assert r.token_ids == ref, f"prompt {i} diverges at token {_first_diff(r.token_ids, ref)}"


def test_greedy_with_small_chunked_prefill_matches(make_engine, prompts, reference):
    eng = make_engine(dtype="float32", max_num_batched_tokens=32, max_num_seqs=32, enable_prefix_caching=False)
    long_prompts = [p * 3 for p in prompts[:4]]  # 100+ tokens: split into several 32-token chunks
    long_ref = eng.generate(long_prompts, GREEDY)
    results = eng.generate(prompts, GREEDY)
    for i, (r, ref) in enumerate(zip(results, reference)):
        assert r.token_ids == ref, f"prompt {i} diverges at token {_first_diff(r.token_ids, ref)}"
    # the long prompts, chunked, equal the same prompts run with one unchunked prefill
    big = make_engine(dtype="float32", max_num_seqs=4, enable_prefix_caching=False)
    assert [r.token_ids for r in big.generate(long_prompts, GREEDY)] == [r.token_ids for r in long_ref]


def test_greedy_with_prefix_cache_hit_matches(make_engine, prompts, reference):
    eng = make_engine(dtype="float32", max_num_seqs=32)
    eng.generate(prompts[:12], SamplingParams(max_tokens=1, temperature=0.0))  # warm the cache with the prompts
    hits_before = eng.block_manager.stats.hits
    results = eng.generate(prompts, GREEDY)
    assert eng.block_manager.stats.hits > hits_before, "the second run should hit the prefix cache"
    assert sum(r.num_cached_tokens for r in results[:12]) >= 12 * 32
    for i, (r, ref) in enumerate(zip(results, reference)):
        assert r.token_ids == ref, f"prompt {i} diverges at token {_first_diff(r.token_ids, ref)}"


def test_greedy_after_preemption_matches(make_engine, prompts, reference):
    # 24 blocks of 16 tokens cannot hold 20 sequences of up to 107 tokens: the scheduler must preempt
    eng = make_engine(dtype="float32", max_num_seqs=32, num_gpu_blocks_override=24)
    results = eng.generate(prompts, GREEDY)
    assert eng.scheduler.num_preemptions > 0
    for i, (r, ref) in enumerate(zip(results, reference)):
        assert r.token_ids == ref, f"prompt {i} diverges at token {_first_diff(r.token_ids, ref)}"


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
