"""The sampler on synthetic logits: exact penalty arithmetic, truncation, seeded noise."""

from __future__ import annotations

import pytest
import torch

from common.sampler import SampleRow, sample
from common.sampling import SamplingParams


def row(params: SamplingParams, prompt=(), output=(), seed=0, position=0) -> SampleRow:
    return SampleRow(params, seed, position, list(prompt), list(output), eos_ids=(0,))


def test_greedy_is_argmax():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    assert sample(logits.clone(), [row(SamplingParams(temperature=0))]).token_ids == [2]


def test_frequency_and_presence_penalties_are_openai_arithmetic():
    logits = torch.tensor([[0.0, 1.5, 3.0, 2.0]])
    p = SamplingParams(temperature=0, frequency_penalty=0.6, presence_penalty=0.5)
    # 2: 3.0 - 1.2 - 0.5 = 1.3; 3: 2.0 - 0.6 - 0.5 = 0.9; 1: 1.5 untouched → token 1 wins
    assert sample(logits.clone(), [row(p, output=[2, 2, 3])]).token_ids == [1]
    assert sample(logits.clone(), [row(SamplingParams(temperature=0), output=[2, 2, 3])]).token_ids == [2]


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[-1.0, 2.0, 1.5, -0.2]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    # 1 is in the prompt: 2.0 / 2 = 1.0 < 1.5 → token 2
    assert sample(logits.clone(), [row(p, prompt=[1])]).token_ids == [2]
    # a negative logit is multiplied: -0.3 * 2 = -0.6 < -0.5 → token 2
    logits = torch.tensor([[-1.0, -0.3, -0.5, -2.0]])
    assert sample(logits.clone(), [row(p, output=[1])]).token_ids == [2]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,))
    assert sample(logits.clone(), [row(p, output=[1])]).token_ids == [1]
    assert sample(logits.clone(), [row(p, output=[1, 1])]).token_ids == [0]


def test_top_k_top_p_min_p_only_leave_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for params, allowed in (
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.8), {0, 1}),
        (SamplingParams(top_p=0.81), {0, 1, 2}),
        (SamplingParams(min_p=0.5), {0, 1}),
    ):
        seen = {sample(logits.clone(), [row(params, seed=s)]).token_ids[0] for s in range(300)}
        assert seen == allowed, params


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().unsqueeze(0)
    counts = torch.zeros(3)
    n = 3000
    for s in range(n):
        counts[sample(logits.clone(), [row(SamplingParams(), seed=s)]).token_ids[0]] += 1
    assert torch.allclose(counts / n, probs, atol=0.03)


def test_seeded_noise_depends_on_seed_and_position_only():
    logits = torch.randn(3, 1000)
    p = SamplingParams(temperature=1.0)
    a = sample(logits.clone(), [row(p, seed=7, position=3)] * 3).token_ids
    solo = sample(logits.clone()[1:2], [row(p, seed=7, position=3)]).token_ids[0]
    assert a[1] == solo  # same row, same (seed, position): same token whatever the batch
    draws = {sample(logits.clone()[:1], [row(p, seed=7, position=k)]).token_ids[0] for k in range(20)}
    assert len(draws) > 1


def test_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    res = sample(logits.clone(), [row(SamplingParams(temperature=0, logprobs=2))])
    lp, top = res.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert lp == pytest.approx(float(ref[1]))
    assert [t for t, _ in top] == [1, 0]
    assert top[1][1] == pytest.approx(float(ref[0]))
