"""The CPU paged decode-attention kernel against the portable PyTorch path, on random data."""

from __future__ import annotations

import pytest
import torch

from common import cpu_kernels
from common.model import AttentionMetadata, cache_rows, paged_attention


def test_the_kernel_compiles_here():
    # the machines we run on have a C++ compiler; the portable path is only a fallback
    assert cpu_kernels.available()


@pytest.mark.parametrize("n_seqs", [2, 5])  # a job per (sequence, kv head) / per sequence
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_the_portable_path(dtype, n_seqs):
    g = torch.Generator().manual_seed(7)
    nb, layers, bs, kvh, d, heads = 40, 3, 16, 2, 32, 6
    ctx = [1, 16, 17, 70, 33][:n_seqs]  # one token, a full block, one past a block, several blocks
    b = len(ctx)
    width = max(-(-c // bs) for c in ctx)
    cache = torch.randn(nb, layers, 2, bs, kvh, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    tables = perm[: b * width].view(b, width)  # scattered blocks, each sequence its own
    q = torch.randn(b, heads, d, generator=g).to(dtype)
    ctx_t = torch.tensor(ctx)
    rows = cache_rows(tables, bs, layers)
    mask = (torch.arange(width * bs)[None] < ctx_t[:, None])[:, None, None, :]
    for layer in range(layers):
        meta = AttentionMetadata(
            slot_rows=torch.zeros(0, dtype=torch.long), prefill_query_lens=[], prefill_context_lens=[],
            prefill_rows=[], num_decode_tokens=b, decode_rows=rows, decode_mask=mask, layer_stride=2 * bs,
            kv_stride=bs,
        )
        empty = torch.zeros(0, kvh, d, dtype=dtype)
        ref = paged_attention(q, empty, empty, cache.view(-1, kvh, d), layer * 2 * bs, meta).float()
        got = cpu_kernels.paged_decode_attention(q, cache, layer, tables, ctx_t, d**-0.5).float()
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel < (1e-5 if dtype == torch.float32 else 2e-2), rel


def test_bad_shapes_are_refused():
    cache = torch.zeros(4, 1, 2, 16, 2, 32)
    with pytest.raises(RuntimeError, match="head shapes disagree"):
        cpu_kernels.paged_decode_attention(torch.zeros(1, 6, 16), cache, 0, torch.zeros(1, 1, dtype=torch.long),
                                           torch.ones(1, dtype=torch.long), 1.0)
    with pytest.raises(RuntimeError, match="context length out of range"):
        cpu_kernels.paged_decode_attention(torch.zeros(1, 4, 32), cache, 0, torch.zeros(1, 1, dtype=torch.long),
                                           torch.tensor([17]), 1.0)
