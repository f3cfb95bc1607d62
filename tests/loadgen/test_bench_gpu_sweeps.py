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
