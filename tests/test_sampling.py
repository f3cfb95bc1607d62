"""The sampler on synthetic logits: exact penalty arithmetic, truncation, seeded noise, the distribution it
draws from (chi-square against the exact one), and the same answers on every device it runs on."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from common import sampler as sampler_mod
from common.sampler import Sampler, SampleRow, row_uniform, sample
from common.sampling import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def row(params: SamplingParams, prompt=(), output=(), seed=0, position=0, key=None) -> SampleRow:
    return SampleRow(params, seed, position, list(prompt), list(output), eos_ids=(0,), key=key)


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
        (SamplingParams(top_p=0.79), {0, 1}),
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


# -- the distribution --------------------------------------------------------------------------------------
_PROBS = [0.05, 0.25, 0.12, 0.35, 0.08, 0.15]  # vocabulary order differs from probability order on purpose


def _expected(params: SamplingParams) -> dict[int, float]:
    """The exact distribution of one row, computed the textbook way: temperature, top-k, top-p, min-p."""
    q = [p ** (1.0 / params.temperature) for p in _PROBS]
    order = sorted(range(len(q)), key=lambda i: -q[i])
    keep = order[: params.top_k] if params.top_k is not None else order
    z = sum(q[i] for i in keep)
    p = {i: q[i] / z for i in keep}
    if params.top_p < 1.0:
        kept, mass = [], 0.0
        for i in sorted(p, key=lambda i: -p[i]):
            if mass >= params.top_p:
                break
            kept.append(i)
            mass += p[i]
        p = {i: p[i] for i in kept}
    if params.min_p > 0:
        m = max(p.values())
        p = {i: v for i, v in p.items() if v >= params.min_p * m}
    z = sum(p.values())
    return {i: v / z for i, v in p.items()}


def _chi2_critical(df: int, z: float = 3.72) -> float:
    """Upper chi-square quantile (Wilson–Hilferty); z = 3.72 is a one-sided p of 1e-4."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.7),
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.7),
    SamplingParams(min_p=0.5),
    SamplingParams(top_k=5, min_p=0.4),
    SamplingParams(temperature=0.8, top_k=4, top_p=0.8, min_p=0.1),
    SamplingParams(temperature=1.3, top_p=0.9, min_p=0.05),
], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_support_and_proportions_are_exact(params, device):
    """20,000 rows in one batch, one seed each: the tokens drawn are exactly the allowed ones, in the right
    proportions (chi-square at p = 1e-4)."""
    n = 20_000
    logits = torch.tensor(_PROBS).log().repeat(n, 1).to(device)
    rows = [row(params, seed=s, position=s % 7) for s in range(n)]
    drawn = Counter(sample(logits, rows).token_ids)
    want = _expected(params)
    assert set(drawn) == set(want), (drawn, want)
    chi2 = sum((drawn[i] - n * p) ** 2 / (n * p) for i, p in want.items())
    df = len(want) - 1
    if df:
        assert chi2 < _chi2_critical(df), (chi2, drawn, want)


@pytest.mark.parametrize("device", DEVICES)
def test_the_pick_does_not_depend_on_the_batch_path(device):
    """Rows whose top-k keeps the batch on the candidate path pick the same tokens when another row in the batch
    forces the full-vocabulary path, and alone."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(24, 5000, generator=g) * 3).to(device)
    ps = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02),
          SamplingParams(temperature=1.2, top_k=7),
          SamplingParams(temperature=1.0, top_k=1000, top_p=0.95)]
    rows = [row(ps[i % 3], seed=1000 + i, position=i) for i in range(24)]
    candidate = sample(logits.clone(), rows).token_ids
    full_row = row(SamplingParams(temperature=1.0), seed=5)
    full = sample(torch.cat([logits, logits[:1]]), [*rows, full_row]).token_ids[:24]
    big_k = row(SamplingParams(temperature=1.0, top_k=2000), seed=6)  # over the candidate cap: full path too
    full_k = sample(torch.cat([logits, logits[:1]]), [*rows, big_k]).token_ids[:24]
    alone = [sample(logits[i : i + 1].clone(), [rows[i]]).token_ids[0] for i in range(24)]
    assert candidate == full == full_k == alone


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampled", [SamplingParams(top_k=50, top_p=0.9, repetition_penalty=1.1),
                                     SamplingParams(top_p=0.9), SamplingParams(temperature=0.8)],
                         ids=["top_k", "top_p", "temperature"])
def test_greedy_and_sampled_rows_share_a_batch(device, sampled):
    """Greedy rows beside sampled ones (either path): greedy rows pick the argmax, sampled rows what they pick
    alone."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, 3000, generator=g) * 3).to(device)
    greedy = SamplingParams(temperature=0)
    rows = [row(greedy if i % 2 else sampled, prompt=[5, 6], seed=40 + i, position=i) for i in range(6)]
    got = sample(logits.clone(), rows).token_ids
    for i in range(6):
        want = int(logits[i].argmax()) if i % 2 else sample(logits[i : i + 1].clone(), [rows[i]]).token_ids[0]
        assert got[i] == want, (i, got)


def test_row_uniform_is_a_pure_function_in_0_1():
    us = [row_uniform(s, p) for s in range(200) for p in range(50)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert row_uniform(7, 3) == row_uniform(7, 3) != row_uniform(7, 4) != row_uniform(8, 3)
    assert abs(sum(us) / len(us) - 0.5) < 0.01
    assert len(set(us)) > 0.99 * len(us)


def test_a_steps_uniforms_in_one_pass_equal_each_rows_own():
    rng = random.Random(5)
    seeds = [0, 1, (1 << 64) - 1, *(rng.getrandbits(64) for _ in range(200))]
    positions = [0, 1, 4095, *(rng.randrange(1 << 20) for _ in range(200))]
    hashes = [sampler_mod._mix64(s) for s in seeds]
    got = sampler_mod._uniforms(hashes, positions).tolist()
    assert got == [row_uniform(s, p) for s, p in zip(seeds, positions)]


def test_the_step_table_follows_each_rows_parameters_when_they_outgrow_the_kept_ones(monkeypatch):
    """A sampler keeps each distinct row of parameters once; past its bound it starts over. Rows that join as
    it does (and rows kept from before) still get their own temperature, top-k/p, penalties and noise."""
    monkeypatch.setattr(sampler_mod._Statics, "MAX_HEADS", 3)
    rng = random.Random(6)
    vocab = 100
    sampler = Sampler(vocab, "cpu", max_rows=8)
    live: list[SampleRow] = []
    for step in range(12):
        for _ in range(2):
            p = SamplingParams(temperature=rng.choice([0.0, 0.5, 0.7, 1.0, 1.3]), top_k=rng.choice([None, 5, 20]),
                               top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.1]),
                               frequency_penalty=rng.choice([0.0, 0.4]), presence_penalty=rng.choice([0.0, 0.2]))
            live.append(SampleRow(p, rng.randrange(1 << 30), 0, [3, 4], [], eos_ids=(0,), key=f"r{step}-{len(live)}"))
        table = sampler._spec(torch.zeros(len(live), vocab), live).filled()
        for r, t in zip(live, table.tolist()):
            p = r.params
            want = [1.0, 1.0] if p.greedy else [p.temperature, float(p.top_k or 0)]
            want += [p.top_p, p.min_p, 1.0, p.presence_penalty, p.frequency_penalty]
            assert t[:7] == pytest.approx(want), (step, r.key)
            assert t[7] == pytest.approx(row_uniform(r.seed, r.position), abs=1e-7)
            assert t[9] == float(p.greedy)
        for r in live:
            r.output_ids.append(1)
            r.position += 1
        sampler._slots.folded([], False)


# -- penalties, bias and masks against a per-row reference ----------------------------------------------------
def _reference(logits: torch.Tensor, r: SampleRow) -> torch.Tensor:
    """Straightforward per-row arithmetic (vLLM's and OpenAI's definitions), one token at a time."""
    x = logits.clone().float()
    p = r.params
    if p.repetition_penalty != 1.0:
        for t in set(r.prompt_ids) | set(r.output_ids):
            v = float(x[t])
            x[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for t, c in Counter(r.output_ids).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    for t, b in p.logit_bias:
        x[t] += b
    if len(r.output_ids) < p.min_tokens:
        for t in (*r.eos_ids, *p.stop_token_ids):
            x[t] = float("-inf")
    return x


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]),
        repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]),
        presence_penalty=rng.choice([0.0, -1.0, 0.5, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.3, -0.4, 1.5]),
        logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(3))},
        min_tokens=rng.choice([0, 0, 5]),
        stop_token_ids=(rng.randrange(vocab),),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_bias_and_masks_equal_a_per_row_reference(device):
    rng = random.Random(1)
    vocab = 300
    for case in range(20):
        n = rng.randrange(1, 9)
        rows = [SampleRow(_random_params(rng, vocab), rng.randrange(1 << 30), 0,
                          [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))],
                          [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))], eos_ids=(2,))
                for _ in range(n)]
        logits = torch.randn(n, vocab) * 4
        got = Sampler(vocab, device, max_rows=4).processed_logits(logits.to(device), rows).cpu()
        want = torch.stack([_reference(logits[i], r) for i, r in enumerate(rows)])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, msg=f"case {case}")


@pytest.mark.parametrize("device", DEVICES)
def test_counts_kept_on_the_device_follow_the_outputs(device):
    """One Sampler over 12 steps of a changing batch (rows join, finish and are evicted from too few slots): each
    step's processed logits equal the reference built from the rows' token ids."""
    rng = random.Random(2)
    vocab = 200
    sampler = Sampler(vocab, device, max_rows=2)
    live: dict[str, SampleRow] = {}
    for step in range(12):
        for _ in range(rng.randrange(0, 3)):
            key = f"r{step}-{len(live)}"
            live[key] = SampleRow(_random_params(rng, vocab), rng.randrange(1 << 30), 0,
                                  [rng.randrange(vocab) for _ in range(20)], [], eos_ids=(2,), key=key)
        if not live:
            continue
        rows = list(live.values())
        logits = torch.randn(len(rows), vocab) * 3
        got = sampler.processed_logits(logits.to(device), rows).cpu()
        want = torch.stack([_reference(logits[i], r) for i, r in enumerate(rows)])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, msg=f"step {step}")
        picked = sampler.sample(logits.to(device), rows).token_ids
        for r, t in zip(rows, picked):
            r.output_ids.append(t)
            r.position += 1
        for key in [k for k in live if rng.random() < 0.2]:
            sampler.release(key)
            del live[key]
    assert sampler.num_tracked <= len(live) + 2


def test_logit_bias_forces_and_forbids():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    assert sample(logits, [row(SamplingParams(temperature=0, logit_bias={2: 100}))]).token_ids == [2]
    assert sample(logits, [row(SamplingParams(temperature=0, logit_bias={"1": -100}))]).token_ids == [3]
    seen = {sample(logits, [row(SamplingParams(logit_bias={1: -100, 3: -100}), seed=s)]).token_ids[0]
            for s in range(200)}
    assert 1 not in seen and 3 not in seen


def test_logit_bias_is_validated():
    with pytest.raises(ValueError, match=r"logit_bias has token id 9, outside the vocabulary \[0, 4\)"):
        SamplingParams(logit_bias={9: 1.0}).validate(4)
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\], got 101.0"):
        SamplingParams(logit_bias={1: 101}).validate(4)
    with pytest.raises(ValueError, match="logit_bias must map token ids to numbers"):
        SamplingParams(logit_bias={"x": 1})


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_of_mixed_rows_come_back_per_row(device):
    logits = torch.randn(4, 50).to(device)
    rows = [row(SamplingParams(temperature=0, logprobs=3)), row(SamplingParams(temperature=1.0), seed=3),
            row(SamplingParams(temperature=1.0, logprobs=0), seed=4), row(SamplingParams(top_k=5, logprobs=1))]
    res = sample(logits, rows)
    ref = torch.log_softmax(logits.float().cpu(), -1)
    assert res.logprobs[1] is None
    for i, k in ((0, 3), (2, 0), (3, 1)):
        lp, top = res.logprobs[i]
        assert lp == pytest.approx(float(ref[i, res.token_ids[i]]), abs=1e-5)
        assert [t for t, _ in top] == ref[i].topk(k).indices.tolist() if k else top == []
    assert res.token_ids[0] == int(logits[0].argmax())


@pytest.mark.parametrize("device", DEVICES)
def test_the_pick_folds_its_tokens_into_the_kept_state(device):
    """A request's slot is built once from its token ids; from then on each pick adds its own token on the device
    (no rebuild, no host write), and the penalties still equal the reference, across repeated and new tokens. An
    output the sampler did not pick (appended by hand) makes the counts disagree: the slot is rebuilt."""
    rng = random.Random(4)
    vocab = 64  # small: picks repeat tokens as well as add new ones
    p = SamplingParams(temperature=1.0, repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3)
    r = SampleRow(p, 5, 0, [rng.randrange(vocab) for _ in range(10)], [], eos_ids=(2,), key="r")
    sampler = Sampler(vocab, device)
    g = torch.Generator().manual_seed(4)  # the logits of every step fixed: repeats and new tokens both, every run
    for step in range(30):
        logits = torch.randn(1, vocab, generator=g) * 2
        got = sampler.processed_logits(logits.to(device), [r]).cpu()
        torch.testing.assert_close(got[0], _reference(logits[0], r), rtol=1e-6, atol=1e-5, msg=f"step {step}")
        r.output_ids.append(sampler.sample(logits.to(device), [r]).token_ids[0])
        r.position += 1
    assert sampler._slots.rebuilt == 1
    assert len(set(r.output_ids)) < 30 and set(r.output_ids) - set(r.prompt_ids)  # repeats and new tokens both
    distinct = len(set(r.prompt_ids) | set(r.output_ids))
    assert int(sampler._slots.nseen[1]) == distinct
    if device == "cpu":  # the portable penalties read exactly the columns the slot owns
        assert sampler._slots.seen(1) == distinct
    r.output_ids.append(7)
    logits = torch.randn(1, vocab, generator=g)
    torch.testing.assert_close(sampler.processed_logits(logits.to(device), [r]).cpu()[0], _reference(logits[0], r),
                               rtol=1e-6, atol=1e-5)
    assert sampler._slots.rebuilt == 2


@pytest.mark.parametrize("device", DEVICES)
def test_a_long_history_grows_the_kept_state(device):
    """More distinct tokens than the kept state's first width (1,024), then than its doubled width: penalties still
    equal the reference."""
    rng = random.Random(3)
    vocab = 5000
    prompt = rng.sample(range(vocab), 1800)
    fresh = [t for t in range(vocab) if t not in set(prompt)]
    p = SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.2)
    r = SampleRow(p, 11, 0, prompt, [], eos_ids=(2,), key="long")
    sampler = Sampler(vocab, device)
    for step in range(4):
        logits = torch.randn(1, vocab) * 3
        got = sampler.processed_logits(logits.to(device), [r]).cpu()
        torch.testing.assert_close(got[0], _reference(logits[0], r), rtol=1e-6, atol=1e-5)
        new = fresh[150 * step : 150 * (step + 1)]  # 2,250 distinct tokens by the last step: past 2 × 1,024
        r.output_ids += [*sampler.sample(logits.to(device), [r]).token_ids, prompt[0], *new]
        r.position += 2 + len(new)
    assert sampler._slots.ids.shape[1] == 4096 and int(sampler._slots.nseen[1]) > 2048  # 1,024 → 2,048 → 4,096


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_picks_equal_eager_picks():
    """The processed pick replayed as CUDA graphs (rows padded, the kept tables read at full width) gives the eager
    pick's tokens, step after step of a changing batch with penalties, top-k/p, min-p and greedy rows; steps with
    logit_bias or min_tokens run eagerly and agree too. Then a steady batch: its rows are not uploaded again, each
    replay draws their uniform numbers on the device (seed, position), and the picks still agree."""
    rng = random.Random(5)
    vocab = 4096
    graphs, eager = Sampler(vocab, "cuda", max_rows=8), Sampler(vocab, "cuda", max_rows=8, cuda_graphs=False)
    live: dict[str, tuple[SampleRow, SampleRow]] = {}
    kinds = [dict(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1),
             dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, min_p=0.05),
             dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=1.0, top_k=2000),
             dict(temperature=1.0, top_p=0.95)]
    for step in range(52):
        if step == 40:  # then a steady batch: the rows run eagerly (logit_bias, min_tokens) leave, nobody joins
            for key in [k for k, (g, _) in live.items() if g.params.logit_bias]:
                graphs.release(key)
                eager.release(key)
                del live[key]
            skipped = graphs._graphs.uploads_skipped if graphs._graphs is not None else 0
        for _ in range(rng.randrange(0, 4) if len(live) < 40 and step < 40 else 0):
            key = f"r{step}-{len(live)}"
            p = SamplingParams(**kinds[rng.randrange(len(kinds))], seed=rng.randrange(1 << 30))
            if step % 13 == 5:
                p = SamplingParams(temperature=1.0, logit_bias={7: 5.0}, min_tokens=3)
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(10, 300))]
            live[key] = tuple(SampleRow(p, p.seed or 1, 0, prompt, [], eos_ids=(2,), key=key) for _ in range(2))
        if not live:
            continue
        logits = torch.randn(len(live), vocab, device="cuda") * 3
        a = graphs.sample(logits, [g for g, _ in live.values()]).token_ids
        b = eager.sample(logits, [e for _, e in live.values()]).token_ids
        assert a == b, f"step {step}"
        for (g, e), t in zip(live.values(), a):
            for r in (g, e):
                r.output_ids.append(t)
                r.position += 1
        for key in [k for k in live if rng.random() < 0.1 and step < 40]:
            graphs.release(key)
            eager.release(key)
            del live[key]
    assert graphs._graphs is not None and graphs._graphs.captures > 0 and graphs._graphs.replays > 5
    assert eager._graphs is None
    # the steady steps after the first drew their numbers on the device from the rows sent before
    assert graphs._graphs.uploads_skipped - skipped >= 10, (graphs._graphs.uploads_skipped, skipped)


def test_top_p_from_candidates_keeps_what_sorting_every_row_keeps():
    """On the CPU top-p looks at each row's largest probabilities first and sorts only the rows whose nucleus is
    wider: the kept probabilities equal those of sorting every row (peaked rows, flat rows, and top_p 1)."""
    g = torch.Generator().manual_seed(3)
    v = 5000
    z = torch.randn(12, v, generator=g) * 2
    z[:8, :30] += 10.0  # peaked: the nucleus within the candidates
    probs = (z - z.amax(-1, keepdim=True)).exp()
    top_p = torch.tensor([0.9, 0.5, 0.99, 1.0] * 3).unsqueeze(1)
    cut = top_p * probs.sum(-1, keepdim=True)
    sp, si = probs.sort(dim=-1, descending=True)
    want = probs.clone().scatter_(1, si, sp.masked_fill(sp.cumsum(-1) - sp >= cut, 0.0))
    got = probs.clone()
    sampler_mod._top_p_by_candidates(got, cut)
    assert torch.equal(got, want)
    wide = (probs.topk(sampler_mod._CANDIDATE_CAP, dim=-1).values.sum(-1, keepdim=True) < cut).squeeze(1)
    assert wide[8:].any() and not wide[:8].all()  # both kinds of row were there
