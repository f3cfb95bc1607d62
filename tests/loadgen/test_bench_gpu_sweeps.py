"""``python -m loadgen.bench_gpu``'s sweeps are CUDA-only; what they choose to time is checked here."""

from __future__ import annotations

from loadgen.bench_gpu import DECODE_HEADS, PROJECTION_MODELS, SECTIONS, _splitk_configs


def test_splitk_configs_divide_k_into_whole_blocks() -> None:
    for k in (576, 1536, 2048, 4096, 8192, 14336):
        configs = _splitk_configs(k)
        assert configs, k
        for bn, bk, splits, warps, stages in configs:
            assert k % (splits * bk) == 0 and k // splits >= bk and bn in (32, 64, 128) and (warps, stages) == (4, 4)
    assert (64, 128, 4, 4, 4) in _splitk_configs(4096)  # the engine's SPLITK_CONFIG is among them


def test_sweep_sections_and_shapes() -> None:
    assert {"decode-params", "projections"} <= set(SECTIONS)
    assert set(PROJECTION_MODELS) == {name for name, *_ in DECODE_HEADS}


def test_the_pick_sections_peer_keeps_the_nucleus_and_picks_by_share() -> None:
    """The ``pick`` section's peer (PyTorch's ops, a sort for top-p) picks what the sampler's pick does: with the rows'
    uniform numbers on a grid of n points, each token in its exact share (±2/n), none outside the nucleus."""
    import torch

    from loadgen.bench_gpu import _torch_pick
    from tests.gpu.test_kernels import exact_pick_shares

    n, vocab = 4096, 500
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    for temp, top_p in ((1.0, 1.0), (0.8, 0.9)):
        u = ((torch.arange(n, dtype=torch.float64) + 0.5) / n).float()[:, None]
        got = _torch_pick(logits.expand(n, vocab), torch.full((n, 1), temp), torch.full((n, 1), top_p), u, top_p < 1)
        share = torch.bincount(got[:, 0], minlength=vocab).double() / n
        want = exact_pick_shares(logits, temp, top_p, 0.0)
        assert share[want == 0].sum() == 0 and float((share - want).abs().max()) <= 2.0 / n
