"""The CPU sampler's pick over whole rows (``cpu_kernels.pick_rows``): each token picked in its exact share of a grid
of uniform numbers (temperature, top-p as the largest order-key threshold whose mass reaches the cut, min-p), the
sampler's route to it, and rows with no finite logit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common import cpu_kernels
from common import sampler as sampler_mod
from common.sampler import Sampler, SampleRow, row_uniform
from common.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels did not compile")

_COLS = (0, 1, 2, 3)  # temperature, top_p, min_p, u in the tests' own tables


def _order_key(z: np.ndarray) -> np.ndarray:
    """A float32's bits ordered as the float: all bits flipped where the sign is set, else the sign bit set."""
    b = z.astype(np.float32).view(np.uint32).astype(np.uint64)
    return np.where(b & 0x80000000, b ^ 0xFFFFFFFF, b | 0x80000000)


def _shares(x: np.ndarray, t: float, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The row's distribution in float64 from the definition: z = x / t (float32), w = exp(z - max); top-p keeps the
    tokens whose key is at least the largest threshold whose tokens' mass reaches top_p × the total; min-p those
    with w >= min_p."""
    z = x.astype(np.float32) / np.float32(t)
    finite = np.isfinite(z)
    w = np.where(finite, np.exp(z.astype(np.float64) - z[finite].max()), 0.0)
    keep = w > 0
    if top_p < 1.0:
        k = _order_key(z)
        cut = float(np.float32(top_p)) * w.sum()
        mass = 0.0
        for key in np.unique(k[keep])[::-1]:  # by key, largest first: a key's tokens (ties) all at once
            mass += w[k == key].sum()
            if mass >= cut:
                keep &= k >= key
                break
    if min_p > 0.0:
        keep &= w >= np.float32(min_p)
    q = np.where(keep, w, 0.0)
    return q / q.sum()


def _picked_shares(x: np.ndarray, t: float, top_p: float, min_p: float, flags: tuple[bool, bool],
                   n: int) -> np.ndarray:
    """The kernel's picks of the row at u = (j + 0.5) / n, j < n, as shares of the grid."""
    prm = torch.zeros(n, 4)
    prm[:, 0], prm[:, 1], prm[:, 2] = t, top_p, min_p
    prm[:, 3] = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    got = cpu_kernels.pick_rows(torch.from_numpy(x).float().expand(n, -1), prm, *_COLS, *flags)
    return np.bincount(got.numpy(), minlength=len(x)) / n


def _logits(v: int, seed: int, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(v) * scale).astype(np.float32)


def _masked_prefix() -> np.ndarray:
    x = _logits(1000, 4)
    x[:300] = -np.inf
    return x


def _one_far_above() -> np.ndarray:
    x = _logits(37, 5, 1.0)
    x[17] = 30.0
    return x


def _crowded(step: float = 0.0) -> np.ndarray:
    """Logits from 16 to 24, where one bin of the top-p search (1/8 of an octave of z) holds thousands of tokens;
    rounded to multiples of ``step``, ties at the threshold."""
    x = _logits(5000, 9, 1.0)
    return (np.round(x / step) * step if step else x) + np.float32(20.0)


_TIED = [3, 11, 20, 36]


def _tied() -> np.ndarray:
    """One token at 5, four tied at 3, the rest below 0.5."""
    x = (_logits(37, 6, 0.3) - 1.0).clip(max=0.5)
    x[5] = 5.0
    x[_TIED] = 3.0
    return x


def _tied_top_p() -> float:
    """A top_p whose cut falls inside the tied tokens' mass: the largest and one and a half of the tied ones."""
    w = np.exp(_tied().astype(np.float64) - 5.0)
    return float((1.0 + 1.5 * np.exp(-2.0)) / w.sum())


# (logits, temperature, top_p, min_p, the kernel's top_p / min_p flags)
CASES = {
    # the flags off: the table's top_p and min_p columns are not read
    "temperature": (_logits(5000, 1), 1.3, 0.5, 0.5, (False, False)),
    "temperature_top_p": (_logits(1000, 2), 0.7, 0.9, 0.0, (True, False)),
    "top_p_min_p": (_logits(5000, 3), 1.0, 0.5, 0.05, (True, True)),  # min-p keeps fewer
    "min_p_top_p": (_logits(5000, 3), 1.0, 0.5, 0.002, (True, True)),  # top-p keeps fewer
    "masked_prefix": (_masked_prefix(), 0.8, 0.95, 0.0, (True, False)),
    "one_far_above": (_one_far_above(), 1.0, 0.9, 0.0, (True, False)),
    "tied_at_the_threshold": (_tied(), 1.0, _tied_top_p(), 0.0, (True, False)),
    "top_p_one": (_logits(37, 7), 1.0, 1.0, 0.0, (True, True)),
    "crowded_bin": (_crowded(), 1.0, 0.6, 0.0, (True, False)),
    "crowded_bin_tied": (_crowded(1 / 64), 1.0, 0.6, 0.0, (True, False)),
}


@pytest.mark.parametrize("case", CASES)
def test_each_token_is_picked_in_its_exact_share(case):
    """u = (j + 0.5) / n for j < n: each token picked for its exact share of the grid, within 2 / n."""
    x, t, top_p, min_p, flags = CASES[case]
    n = 4096
    want = _shares(x, t, top_p if flags[0] else 1.0, min_p if flags[1] else 0.0)
    got = _picked_shares(x, t, top_p, min_p, flags, n)
    assert not got[want == 0].any(), np.flatnonzero((want == 0) & (got > 0))  # nothing top-p or min-p drops
    assert np.abs(got - want).max() <= 2.0 / n, np.abs(got - want).max() * n
    # the grid's picks are the inverse CDF: the running shares agree too, within one grid point and rounding
    assert np.abs(np.cumsum(got) - np.cumsum(want)).max() <= 2.0 / n


@pytest.mark.parametrize("case", CASES)
def test_the_ends_of_the_unit_interval_pick_the_first_and_last_kept_tokens(case):
    """u = 0 picks the first token kept, in vocabulary order (never one masked or dropped before it); the largest u
    the sampler draws, the last one where that token's share is not within rounding of nothing."""
    x, t, top_p, min_p, flags = CASES[case]
    q = _shares(x, t, top_p if flags[0] else 1.0, min_p if flags[1] else 0.0)
    kept = np.flatnonzero(q)
    prm = torch.tensor([[t, top_p, min_p, 0.0], [t, top_p, min_p, sampler_mod._U_MAX]])
    first, last = cpu_kernels.pick_rows(torch.from_numpy(x).expand(2, -1), prm, *_COLS, *flags).tolist()
    assert first == kept[0]
    if q[kept[-1]] > 1e-4:
        assert last == kept[-1]


def test_the_cases_test_what_they_name():
    """Each filter drops tokens where a case says it does, and keeps all of the tied ones."""
    kept = {}
    for case in ("top_p_min_p", "min_p_top_p"):
        x, t, top_p, min_p, _ = CASES[case]
        kept[case] = [int((q > 0).sum()) for q in (_shares(x, t, top_p, min_p), _shares(x, t, top_p),
                                                   _shares(x, t, 1.0, min_p))]
    both, p_only, m_only = kept["top_p_min_p"]
    assert both == m_only < p_only
    both, p_only, m_only = kept["min_p_top_p"]
    assert both == p_only < m_only
    x, t, top_p, _, _ = CASES["temperature_top_p"]
    assert 1 < (_shares(x, t, top_p) > 0).sum() < len(x)
    assert np.flatnonzero(_shares(*CASES["one_far_above"][:3])).tolist() == [17]
    kept = _shares(*CASES["tied_at_the_threshold"][:3]) > 0
    assert np.flatnonzero(kept).tolist() == sorted([5, *_TIED])
    assert (_shares(*CASES["masked_prefix"][:2])[:300] == 0).all()
    x, t, top_p, _, _ = CASES["crowded_bin_tied"]
    z = x / np.float32(t)
    threshold = z[_shares(x, t, top_p) > 0].min()
    assert (z == threshold).sum() > 10 and (_order_key(z) >> 20 == _order_key(threshold) >> 20).sum() > 1000


def test_rows_are_independent_and_the_logits_untouched():
    """Rows of different parameters in one call pick what each picks alone; strided rows read in place."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(12, 3001, generator=g) * 3
    prm = torch.tensor([[0.6 + 0.1 * i, [1.0, 0.9, 0.5][i % 3], [0.0, 0.02][i % 2], (i + 0.3) / 12]
                        for i in range(12)])
    before = x.clone()
    got = cpu_kernels.pick_rows(x, prm, *_COLS, True, True)
    assert torch.equal(x, before)
    alone = [int(cpu_kernels.pick_rows(x[i : i + 1], prm[i : i + 1], *_COLS, True, True)) for i in range(12)]
    assert got.tolist() == alone
    wide = torch.zeros(12, 2, 3001)
    wide[:, 1] = x
    assert torch.equal(cpu_kernels.pick_rows(wide[:, 1], prm, *_COLS, True, True), got)  # rows 2 × 3001 apart
    assert torch.equal(cpu_kernels.pick_rows(x.t().contiguous().t(), prm, *_COLS, True, True), got)


def test_rows_with_no_finite_logit_pick_in_range():
    v = 1000
    x = torch.randn(5, v)
    x[0] = float("-inf")  # a grammar that allows nothing
    x[1] = float("nan")
    x[2, ::2] = float("nan")  # NaN beside finite logits: never picked
    x[3, :] = float("-inf")
    x[3, 999] = float("nan")
    x[4, 1:] = float("-inf")
    for flags in [(False, False), (True, False), (True, True)]:
        prm = torch.tensor([[1.0, 0.9, 0.05, u] for u in (0.0, 0.5, 0.999, 0.3, 0.7)])
        got = cpu_kernels.pick_rows(x, prm, *_COLS, *flags).tolist()
        assert all(0 <= t < v for t in got), got
        assert got[2] % 2 == 1 and got[4] == 0, got


# -- the sampler's route -------------------------------------------------------------------------------------------
_PEAKS = {40: 0.45, 7: 0.3, 2500: 0.15, 901: 0.07, 1777: 0.03}  # vocabulary order differs from probability order


def _peaked(n: int, v: int) -> torch.Tensor:
    x = torch.full((n, v), -30.0)  # the rest: a mass of about 1e-9 all together
    for tok, p in _PEAKS.items():
        x[:, tok] = float(np.log(p))
    return x


def _far_from_boundaries(x: np.ndarray, p: SamplingParams, u: float, margin: float) -> bool:
    q = _shares(x, p.temperature, p.top_p, p.min_p)
    return bool(np.abs(np.cumsum(q) - u).min() > margin)


def test_the_sampler_picks_rows_with_no_top_k_through_the_kernel(monkeypatch):
    """A CPU step with no top_k goes through pick_rows and picks what PyTorch's ops pick (every row's uniform number
    is far from the boundaries between tokens, where the two may round differently), which is the token the row's
    exact distribution gives. A step that mixes in rows with a top_k (one within the candidates' cap, one past it)
    goes through it too, each top-k row's logits under its k-th largest dropped first: the other rows pick the same
    tokens, and the top-2 row one of its two largest."""
    v = 3000
    params = [SamplingParams(temperature=1.0), SamplingParams(top_p=0.9), SamplingParams(temperature=0.8, min_p=0.2),
              SamplingParams(temperature=1.3, top_p=0.7, min_p=0.1), SamplingParams(temperature=0)]
    x0 = _peaked(1, v)[0].numpy()
    rows: list[SampleRow] = []
    for seed in range(10_000):
        p = params[len(rows) % len(params)]
        if p.greedy or _far_from_boundaries(x0, p, row_uniform(seed, 3), 1e-3):
            rows.append(SampleRow(p, seed, 3, [1, 2], [5, 6, 7], eos_ids=(0,)))
        if len(rows) == 40:
            break
    want = []
    for r in rows:
        if r.params.greedy:
            want.append(40)
        else:
            cdf = np.cumsum(_shares(x0, r.params.temperature, r.params.top_p, r.params.min_p))
            want.append(int(np.searchsorted(cdf, row_uniform(r.seed, r.position), side="right")))
    assert len(set(want)) >= 4  # the rows pick several tokens

    calls = []
    real = cpu_kernels.pick_rows

    def spy(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(sampler_mod.cpu_kernels, "pick_rows", spy)
    logits = _peaked(len(rows), v)
    kernel = Sampler(v, "cpu").sample(logits, rows).token_ids
    assert calls == [(len(rows), v)]
    with monkeypatch.context() as m:
        m.setattr(sampler_mod.cpu_kernels, "available", lambda: False)
        portable = Sampler(v, "cpu").sample(logits, rows).token_ids
    assert calls == [(len(rows), v)]
    assert kernel == portable == want
    # seed 10: u = 0.81, past the two largest peaks' running share in vocabulary order (0.75): unmasked, the top-2
    # row would pick token 901
    top2, top2000 = (SampleRow(SamplingParams(top_k=k), 10, 3, [1], [2], eos_ids=(0,)) for k in (2, 2000))
    assert 0.8 < row_uniform(10, 3) < 0.82
    mixed = Sampler(v, "cpu").sample(_peaked(len(rows) + 2, v), [*rows, top2, top2000]).token_ids
    assert calls == [(len(rows), v), (len(rows) + 2, v)]
    assert mixed[: len(rows)] == want
    assert mixed[-2] == 40  # of the two largest (7: 0.4 of their mass, then 40), in vocabulary order
    assert mixed[-1] == 901  # top_k 2000 keeps every peak (the other tokens tie at the 2000th): unmasked
