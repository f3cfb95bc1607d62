"""Triton kernels of the CUDA fast path: paged decode attention straight from the block-major KV pool, fused
RoPE + KV write, fused residual add + RMSNorm, fused SiLU·mul, the grammar masks' two kernels (the argmax over a
row's allowed tokens, and the disallowed tokens set to -inf), which read the packed token bitmask as it is, and the
sampler's three (penalties over each row's kept tokens, the fold of picked tokens into them, the pick among top-k
candidates).

Imported only on CUDA, through ``common.model_cuda``; the portable PyTorch path in ``common.model`` stays the
reference for CPU and tests. ``tests/gpu/test_kernels.py`` (``make test-gpu``) checks every kernel here against
float64 / portable references on random data; ``loadgen/bench_gpu.py`` times them.

The pool is ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``. A token's K of layer ``l`` lies at element
``(row + l * 2 * block_size) * kv_heads * head_dim`` where ``row`` is its layer-0 K row (``common.model.cache_rows``);
its V ``block_size * kv_heads * head_dim`` further. All such offsets are computed in int64 (an 8B pool holds
more than 2^31 elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.cuda_graphs import decode_num_splits, prompt_tile_rows

_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


# ---- paged attention ----------------------------------------------------------------------------------------
@triton.jit
def _attend_block(q, cache_ptr, base, v_off, offs_d, nmask, visible, scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """One block of keys of the online softmax: K at ``base`` (rows masked by ``nmask``), scores where ``visible``,
    then V; returns the running max, sum and accumulator."""
    k = tl.load(cache_ptr + base[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
    if IEEE:
        sc = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(k))
    sc = tl.where(visible, sc * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(cache_ptr + v_off + base[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


# ---- paged decode attention ---------------------------------------------------------------------------------
# Arguments that change from step to step are not specialized on (Triton would otherwise compile a variant for
# each value class: == 1, divisible by 16, other), so a serving run compiles each kernel once or twice, not per shape.
@triton.jit(do_not_specialize=["q_stride_b", "table_stride", "out_stride_b", "num_splits"])
def _paged_decode_kernel(
    q_ptr, q_stride_b,
    cache_ptr, blk_stride, v_off,
    table_ptr, table_stride, trow_ptr, ctx_ptr,
    out_ptr, out_stride_b,
    part_ptr, lse_ptr,
    scale, num_splits, num_heads,
    KVH: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr, ROW_MAP: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    if ROW_MAP:
        trow = tl.load(trow_ptr + b).to(tl.int64)
    else:
        trow = b.to(tl.int64)
    ctx = tl.load(ctx_ptr + b)
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    lo = s * chunk
    hi = tl.minimum(lo + chunk, ctx)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    hmask = offs_h < G
    heads = kh * G + offs_h
    q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * D + offs_d[None, :], mask=hmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        nmask = tok < hi
        blk = tl.load(table_ptr + trow * table_stride + tok // BS, mask=nmask, other=0).to(tl.int64)
        base = blk * blk_stride + ((tok % BS) * KVH + kh) * D
        m_i, l_i, acc = _attend_block(q, cache_ptr, base, v_off, offs_d, nmask, nmask[None, :], scale, m_i, l_i,
                                      acc, IEEE)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if DIRECT:
        tl.store(out_ptr + b * out_stride_b + heads[:, None] * D + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        row = (b * num_heads + heads) * num_splits + s
        tl.store(part_ptr + row[:, None] * D + offs_d[None, :], o, mask=hmask[:, None])
        tl.store(lse_ptr + row, m_i + tl.log(l_i), mask=hmask)


@triton.jit(do_not_specialize=["out_stride_b", "num_splits"])
def _merge_splits_kernel(part_ptr, lse_ptr, out_ptr, out_stride_b, num_heads, num_splits,
                         D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    smask = offs_s < num_splits
    row = (b * num_heads + h) * num_splits + offs_s
    lse = tl.load(lse_ptr + row, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    denom = tl.sum(w, 0)
    parts = tl.load(part_ptr + row[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b * out_stride_b + h * D + offs_d, o.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor, context_lens: torch.Tensor,
    scale: float, out: torch.Tensor, num_splits: int = 0, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
    table_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per row against its paged context, read in place from the pool.

    q: [B, H, D] (rows may be strided, heads contiguous); block_tables: [B, W] int32, or [N, W] with
    ``table_rows`` ([B] int32: row b reads table ``table_rows[b]``; the prompt tokens of one sequence, each a row,
    share its table); context_lens: [B] int32 (0: the row is padding, its output is zeros); out: [B, H, D] with
    contiguous heads. ``num_splits`` 0 picks :func:`decode_num_splits`. Launch shapes depend only on B and the
    splits, so a CUDA graph can hold it."""
    bsz, heads, d = q.shape
    _, _, _, bs, kvh, _ = kv_cache.shape
    g = heads // kvh
    assert q.stride(2) == 1 and q.stride(1) == d and out.stride(2) == 1 and out.stride(1) == d
    if num_splits <= 0:
        num_splits = decode_num_splits(bsz, kvh, num_sms(q.device), d)
    cache_l = kv_cache.select(1, layer)
    block_h = max(16, triton.next_power_of_2(g))
    ieee = q.dtype == torch.float32
    common = dict(KVH=kvh, G=g, BLOCK_H=block_h, D=d, BS=bs, BLOCK_N=block_n, IEEE=ieee, num_warps=num_warps,
                  num_stages=num_stages, ROW_MAP=table_rows is not None)
    trows = table_rows if table_rows is not None else context_lens  # not read without ROW_MAP
    if num_splits == 1:
        _paged_decode_kernel[(bsz, kvh, 1)](
            q, q.stride(0), cache_l, kv_cache.stride(0), kv_cache.stride(2), block_tables, block_tables.stride(0),
            trows, context_lens, out, out.stride(0), out, out, scale, 1, heads, DIRECT=True, **common,
        )
        return out
    part = torch.empty((bsz, heads, num_splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((bsz, heads, num_splits), dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(bsz, kvh, num_splits)](
        q, q.stride(0), cache_l, kv_cache.stride(0), kv_cache.stride(2), block_tables, block_tables.stride(0),
        trows, context_lens, out, out.stride(0), part, lse, scale, num_splits, heads, DIRECT=False, **common,
    )
    _merge_splits_kernel[(bsz, heads)](
        part, lse, out, out.stride(0), heads, num_splits, D=d, BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4,
    )
    return out


# ---- paged prompt attention (prompt tiles of a CUDA graph) ------------------------------------------------------
@triton.jit(do_not_specialize=["q_stride_b", "table_stride", "tile_stride", "out_stride_b"])
def _paged_prompt_kernel(
    q_ptr, q_stride_b,
    cache_ptr, blk_stride, v_off,
    table_ptr, table_stride, trow_ptr, pos_ptr, tile_ptr, tile_stride,
    out_ptr, out_stride_b, scale,
    KVH: tl.constexpr, G: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    t = tl.program_id(0)
    kh = tl.program_id(1)
    r0 = tl.load(tile_ptr + t)  # the tile's first row
    n = tl.load(tile_ptr + tile_stride + t)  # its rows (consecutive positions of one sequence); 0: an unused tile
    trow = tl.load(trow_ptr + r0).to(tl.int64)
    pos0 = tl.load(pos_ptr + r0)
    offs_m = tl.arange(0, BLOCK_M)
    qi = offs_m // G  # M packs (query token, head of this KV head's group)
    heads = kh * G + offs_m % G
    mmask = (qi < n) & (qi < TQ)
    rows = (r0 + qi).to(tl.int64)
    qpos = pos0 + qi
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + rows[:, None] * q_stride_b + heads[:, None] * D + offs_d[None, :], mask=mmask[:, None],
                other=0.0)
    hi = tl.where(n > 0, pos0 + n, 0)  # keys 0 .. the tile's last position
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        tok = start + offs_n
        nmask = tok < hi
        blk = tl.load(table_ptr + trow * table_stride + tok // BS, mask=nmask, other=0).to(tl.int64)
        base = blk * blk_stride + ((tok % BS) * KVH + kh) * D
        # causal: key 0 is visible to every row, so each row's maximum is finite from the first block on
        m_i, l_i, acc = _attend_block(q, cache_ptr, base, v_off, offs_d, nmask,
                                      nmask[None, :] & (tok[None, :] <= qpos[:, None]), scale, m_i, l_i, acc, IEEE)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * out_stride_b + heads[:, None] * D + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


def paged_prompt_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor, table_rows: torch.Tensor,
    positions: torch.Tensor, tiles: torch.Tensor, scale: float, out: torch.Tensor, block_n: int = 64,
    num_warps: int = 4, num_stages: int = 2,
) -> torch.Tensor:
    """Causal attention of prompt tokens against their paged context (their own K/V already written to the pool),
    in tiles: ``tiles`` ([2, N] int32, rows contiguous) holds each tile's first row and its row count (0: unused), a tile being up
    to :func:`common.cuda_graphs.prompt_tile_rows` rows of consecutive positions of one sequence. Row ``r`` is at
    ``positions[r]`` and reads table ``table_rows[r]``. Writes only the tiles' rows of ``out`` ([T, H, D], heads
    contiguous). One program per (tile, KV head), the query heads of a KV head packed with the tile's tokens into
    one ``dot``; the launch depends only on N, so a CUDA graph can hold it."""
    _, heads, d = q.shape
    _, _, _, bs, kvh, _ = kv_cache.shape
    g = heads // kvh
    tq = prompt_tile_rows(g)
    assert q.stride(2) == 1 and q.stride(1) == d and out.stride(2) == 1 and out.stride(1) == d
    assert tiles.dim() == 2 and tiles.shape[0] == 2 and tiles.stride(1) == 1
    n_tiles = tiles.shape[1]
    cache_l = kv_cache.select(1, layer)
    _paged_prompt_kernel[(n_tiles, kvh)](
        q, q.stride(0), cache_l, kv_cache.stride(0), kv_cache.stride(2), block_tables, block_tables.stride(0),
        table_rows, positions, tiles, tiles.stride(0), out, out.stride(0), scale,
        KVH=kvh, G=g, TQ=tq, BLOCK_M=max(16, triton.next_power_of_2(tq * g)), D=d, BS=bs, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )
    return out


# ---- RoPE + KV write ----------------------------------------------------------------------------------------
@triton.jit
def _rope_kv_write_kernel(
    qkv_ptr, qkv_stride, pos_ptr, slot_ptr, cos_ptr, sin_ptr, cos_stride,
    cache_ptr, layer_off, v_off,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
):
    t = tl.program_id(0)
    j = tl.program_id(1)  # 0..H-1: query heads; H..H+KVH-1: KV heads
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, HALF)
    c = tl.load(cos_ptr + pos * cos_stride + offs)
    sn = tl.load(sin_ptr + pos * cos_stride + offs)
    base = qkv_ptr + t.to(tl.int64) * qkv_stride + j * D
    x1 = tl.load(base + offs).to(tl.float32)
    x2 = tl.load(base + HALF + offs).to(tl.float32)
    o1 = (x1 * c - x2 * sn).to(qkv_ptr.dtype.element_ty)
    o2 = (x2 * c + x1 * sn).to(qkv_ptr.dtype.element_ty)
    tl.store(base + offs, o1)
    tl.store(base + HALF + offs, o2)
    if j >= H:
        kh = j - H
        slot = tl.load(slot_ptr + t).to(tl.int64)
        ok = offs < tl.where(slot >= 0, HALF, 0)  # padding rows (slot < 0) store nothing
        dst = cache_ptr + layer_off + slot * (KVH * D) + kh * D
        tl.store(dst + offs, o1, mask=ok)
        tl.store(dst + HALF + offs, o2, mask=ok)
        vsrc = base + KVH * D
        tl.store(dst + v_off + offs, tl.load(vsrc + offs), mask=ok)
        tl.store(dst + v_off + HALF + offs, tl.load(vsrc + HALF + offs), mask=ok)


def rope_kv_write(
    qkv: torch.Tensor, positions: torch.Tensor, slot_rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    kv_cache: torch.Tensor, layer: int, num_heads: int, num_kv_heads: int, head_dim: int,
) -> None:
    """Rotate Q and K of ``qkv`` ([T, (H + 2·KVH)·D], rows contiguous) in place with rotate-half RoPE at
    ``positions``, and write K and V into the pool at ``slot_rows`` (layer-0 K rows; negative: padding, skipped).
    cos/sin: float32 ``[max_pos, D]`` tables (first half == second half)."""
    t = qkv.shape[0]
    if t == 0:
        return
    bs = kv_cache.shape[3]
    row = num_kv_heads * head_dim
    _rope_kv_write_kernel[(t, num_heads + num_kv_heads)](
        qkv, qkv.stride(0), positions, slot_rows, cos, sin, cos.stride(0),
        kv_cache, layer * 2 * bs * row, bs * row,
        H=num_heads, KVH=num_kv_heads, D=head_dim, HALF=head_dim // 2, num_warps=1,
    )


# ---- residual add + RMSNorm, SiLU·mul ---------------------------------------------------------------------------
@triton.jit(do_not_specialize=["t"])
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, n, t, eps, HAS_DELTA: tl.constexpr, NUM_PARTS: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=m, other=0.0)
    if HAS_DELTA:
        if NUM_PARTS == 0:
            d = tl.load(d_ptr + row * n + offs, mask=m, other=0.0).to(tl.float32)
        else:  # fp32 split-K partials [NUM_PARTS, t, n]: their sum, rounded as a matmul output would be
            d = tl.zeros([BLOCK], tl.float32)
            for p in tl.static_range(NUM_PARTS):
                d += tl.load(d_ptr + (p * t + row) * n + offs, mask=m, other=0.0)
            d = d.to(x.dtype).to(tl.float32)
        x = (x.to(tl.float32) + d).to(x.dtype)
        tl.store(x_ptr + row * n + offs, x, mask=m)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    normed = (xf * r).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (when given), then return RMSNorm(x) with the reference's rounding (norm in float32,
    cast, times the weight in the activation dtype). x: contiguous [T, N]; delta: contiguous [T, N], or fp32
    split-K partials [S, T, N] (:func:`splitk_mm`) that are summed here."""
    t, n = x.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    block = triton.next_power_of_2(n)
    parts = delta.shape[0] if delta is not None and delta.dim() == 3 else 0
    _add_rms_norm_kernel[(t,)](
        x, delta if delta is not None else x, weight, out, n, t, eps, HAS_DELTA=delta is not None, NUM_PARTS=parts,
        BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < inter
    g = tl.load(gu_ptr + row * 2 * inter + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inter + inter + col, mask=m, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + col, (s * u.to(tl.float32)).to(u.dtype), mask=m)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused [T, 2·I] gate/up output, in one pass."""
    t, two_i = gu.shape
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gu.dtype, device=gu.device)
    if t == 0:
        return out
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](gu, out, inter, BLOCK=block, num_warps=4)
    return out


# ---- bandwidth-bound matrix products for decode (batch 1: GEMV; small batches: split-K GEMM) ---------------------
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, n, k, stride_w, HAS_BIAS: tl.constexpr, SILU_INPUT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n
    offs_k = tl.arange(0, BLOCK_K)
    wp = w_ptr + rows.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kmask = (k0 + offs_k) < k
        w = tl.load(wp + k0, mask=rmask[:, None] & kmask[None, :], other=0.0)
        if SILU_INPUT:  # x is a fused [gate | up] row: the input is silu(gate) * up, rounded as silu_mul does
            g = tl.load(x_ptr + k0 + offs_k, mask=kmask, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + k + k0 + offs_k, mask=kmask, other=0.0)
            sg = (g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32)
            x = (sg * u.to(tl.float32)).to(u.dtype).to(tl.float32)
        else:
            x = tl.load(x_ptr + k0 + offs_k, mask=kmask, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


def gemv_config(n: int) -> tuple[int, int, int, int]:
    """BLOCK_N, BLOCK_K, num_warps, num_stages by output size, from the sweep in ``bench_gpu --sections tune`` on an
    H200 with the Llama-3.1-8B matrices (docs/performance-notes.md): lm_head-sized, gate_up-sized, and the rest."""
    if n >= 65536:
        return (16, 256, 4, 3)
    if n >= 16384:
        return (8, 256, 4, 4)
    return (16, 512, 8, 3)


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None, silu_input: bool = False) -> torch.Tensor:
    """``F.linear`` for one row (x: [1, K] contiguous, or [1, 2K] with ``silu_input``; w: [N, K] rows contiguous),
    streaming W once."""
    n, k = w.shape
    bn, bk, warps, stages = config or gemv_config(n)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, b if b is not None else w, y, n, k, w.stride(0),
                                        HAS_BIAS=b is not None, SILU_INPUT=silu_input, BLOCK_N=bn, BLOCK_K=bk,
                                        num_warps=warps, num_stages=stages)
    return y


@triton.jit(do_not_specialize=["m"])
def _splitk_mm_kernel(x_ptr, w_ptr, p_ptr, m, n, k_per_split, stride_x, stride_w,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """partials[s, m, n] = x[m, ks] · w[n, ks] over split s's K range (fp32)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    sp = tl.program_id(1)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < m
    nmask = rn < n
    k0 = sp * k_per_split
    xp = x_ptr + rm[:, None] * stride_x + k0 + rk[None, :]
    wp = w_ptr + rn.to(tl.int64)[None, :] * stride_w + k0 + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        a = tl.load(xp + kk, mask=mmask[:, None], other=0.0)
        bt = tl.load(wp + kk, mask=nmask[None, :], other=0.0)
        acc = tl.dot(a, bt, acc)
    tl.store(p_ptr + (sp * m + rm[:, None]) * n + rn[None, :], acc, mask=mmask[:, None] & nmask[None, :])


def splitk_mm(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int, int]) -> torch.Tensor:
    """``x @ w.T`` for a few rows as fp32 partial sums ``[splits, M, N]`` (their sum is the product): W streamed
    once by (N / BLOCK_N) × splits programs. K must divide into splits × BLOCK_K. The partials are summed by the
    consumer (:func:`add_rms_norm` takes them as its delta)."""
    m, k = x.shape
    n = w.shape[0]
    bn, bk, splits, warps, stages = config
    assert k % (splits * bk) == 0
    bm = max(16, triton.next_power_of_2(m))
    parts = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    _splitk_mm_kernel[(triton.cdiv(n, bn), splits, triton.cdiv(m, bm))](
        x, w, parts, m, n, k // splits, x.stride(0), w.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages)
    return parts


SPLITK_MAX_M = 0  # decode rows up to which the residual projections (o_proj, down) use splitk_mm (0: never)
SPLITK_CONFIG = (64, 128, 4, 4, 4)  # BLOCK_N, BLOCK_K, splits, num_warps, num_stages


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The fast path's ``F.linear``: the Triton GEMV for one row of bf16/fp16, cuBLAS otherwise (float32 keeps
    cuBLAS: its numerics are the reference's)."""
    if x.shape[0] == 1 and x.dtype != torch.float32 and w.stride(-1) == 1:
        return gemv(x.contiguous(), w, b)
    return torch.nn.functional.linear(x, w, b)


def residual_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A projection whose output only feeds :func:`add_rms_norm` (o_proj, down): split-K partials for small
    batches where configured (the norm kernel sums them), :func:`linear` otherwise."""
    m, k = x.shape
    if 1 < m <= SPLITK_MAX_M and x.dtype != torch.float32 and k % (SPLITK_CONFIG[1] * SPLITK_CONFIG[2]) == 0:
        return splitk_mm(x.contiguous(), w, SPLITK_CONFIG)
    return linear(x, w)


def down_proj(gu: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``residual_linear(silu_mul(gu), w)``; at one row the SiLU·mul is fused into the GEMV's input loads."""
    if gu.shape[0] == 1 and gu.dtype != torch.float32 and gu.is_contiguous() and w.stride(-1) == 1:
        return gemv(gu, w, silu_input=True)
    return residual_linear(silu_mul(gu), w)


# ---- grammar masks (structured outputs) --------------------------------------------------------------------------
# A mask row is int32 words, bit ``t % 32`` of word ``t // 32`` set when token t is allowed (common/structured.py).
MASK_BLOCK = 4096


@triton.jit(do_not_specialize=["stride_x", "vocab"])
def _masked_argmax_kernel(x_ptr, stride_x, mask_ptr, stride_m, mrow_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    mrow = tl.load(mrow_ptr + row)  # the row's mask row; -1: unconstrained
    best_v = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < vocab
        v = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=inb, other=float("-inf")).to(tl.float32)
        w = tl.load(mask_ptr + tl.maximum(mrow, 0).to(tl.int64) * stride_m + (offs >> 5), mask=inb, other=0)
        v = tl.where((((w >> (offs & 31)) & 1) != 0) | (mrow < 0), v, float("-inf"))
        bv = tl.max(v, 0)
        bi = tl.argmax(v, 0)  # the first of equal maxima
        better = bv > best_v  # strictly: an earlier block keeps a tie
        best_i = tl.where(better, start + bi, best_i)
        best_v = tl.where(better, bv, best_v)
    tl.store(out_ptr + row, best_i.to(tl.int64))


def masked_argmax(logits: torch.Tensor, masks: torch.Tensor, mask_rows: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of ``logits`` [N, V] (rows may be strided, any float dtype) over the tokens row ``i``'s mask
    ``masks[mask_rows[i]]`` allows (``masks`` int32 [M, ceil(V / 32)], M ≥ 1; ``mask_rows`` int32 [N], -1 for
    a row without a mask): int64 [N], the first index among equal maxima. One pass, the bits read packed."""
    n, vocab = logits.shape
    assert logits.stride(1) == 1 and masks.is_contiguous() and masks.dtype == torch.int32
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    _masked_argmax_kernel[(n,)](logits, logits.stride(0), masks, masks.stride(0), mask_rows, out, vocab,
                                BLOCK=MASK_BLOCK, num_warps=8)
    return out


@triton.jit(do_not_specialize=["stride_x", "vocab"])
def _apply_token_bitmask_kernel(x_ptr, stride_x, mask_ptr, stride_m, mrow_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    mrow = tl.load(mrow_ptr + row)  # the row's mask row; -1: unconstrained
    if mrow >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inb = offs < vocab
        w = tl.load(mask_ptr + mrow.to(tl.int64) * stride_m + (offs >> 5), mask=inb, other=0)
        tl.store(x_ptr + row.to(tl.int64) * stride_x + offs, float("-inf"),
                 mask=inb & (((w >> (offs & 31)) & 1) == 0))


def apply_token_bitmask_(x: torch.Tensor, masks: torch.Tensor, mask_rows: torch.Tensor) -> None:
    """In place: row ``i`` of ``x`` [N, V] to -inf wherever its mask ``masks[mask_rows[i]]`` (int32 words)
    disallows a token; ``mask_rows`` int32 [N], -1 for a row without a mask (left as it is)."""
    n, vocab = x.shape
    assert x.stride(1) == 1 and masks.is_contiguous() and masks.dtype == torch.int32 and mask_rows.shape[0] == n
    if n:
        _apply_token_bitmask_kernel[(n, triton.cdiv(vocab, MASK_BLOCK))](x, x.stride(0), masks, masks.stride(0),
                                                                          mask_rows, vocab, BLOCK=MASK_BLOCK,
                                                                          num_warps=8)


# The device's wait for the grammar mask process (common/grammar_proc.py): the child writes the number of the last
# batch of tokens it has filled masks for into a word of the mask table's shared memory, which the device reads in
# place; a step's pick waits on the device, not the host, until that number reaches the batch its rows need. Each
# read crosses PCIe (about a µs), so a wait gives up after this many reads (seconds), and says so in ``flag``.
MASK_WAIT_SPINS = 4_000_000


@triton.jit(do_not_specialize=["spins"])
def _wait_masks_kernel(ready_ptr, want_ptr, flag_ptr, spins):
    want = tl.load(want_ptr, volatile=True)
    got = tl.load(ready_ptr, volatile=True)
    n = 0
    while (got < want) & (n < spins):
        got = tl.load(ready_ptr, volatile=True)
        n += 1
    if got < want:
        tl.store(flag_ptr, want)


def wait_masks(ready: torch.Tensor, want: torch.Tensor, flag: torch.Tensor, spins: int = MASK_WAIT_SPINS) -> None:
    """Queue a wait until ``ready[0]`` (int64, written by another process) is at least ``want[0]`` (int64,
    written by the host before this is queued); the kernels queued after it start once it holds. Past ``spins``
    reads it gives up and writes ``want[0]`` to ``flag[0]``."""
    _wait_masks_kernel[(1,)](ready, want, flag, spins, num_warps=1)


# ---- the sampler's pick (common/sampler.py) ------------------------------------------------------------------
# The kept penalty state: a slot's row of ``ids`` holds its distinct tokens, ``counts`` how often each came out,
# ``nseen`` how many of its columns are its own; the step's parameter table has a row per pick and the column
# numbers the sampler passes (``*_COL``).
SAMPLER_BLOCK = 1024


@triton.jit(do_not_specialize=["stride_p", "stride_s", "n", "advance"])
def _row_uniforms_kernel(prm_ptr, stride_p, seeds_ptr, stride_s, tick_ptr, n, advance, U_COL: tl.constexpr,
                         BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    inb = offs < n
    tick = tl.load(tick_ptr)
    s = seeds_ptr + offs.to(tl.int64) * stride_s
    h = tl.load(s, mask=inb, other=0).to(tl.uint64, bitcast=True)
    pos = (tl.load(s + 1, mask=inb, other=0) + tick).to(tl.uint64, bitcast=True)
    # splitmix64 of (seed hash ^ position), as the sampler's host side computes it (``sampler._uniforms``)
    z = (h ^ pos) + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    u = (z >> 40).to(tl.float32) * (1.0 / 16777216.0)  # 24 bits: exact in float32
    tl.store(prm_ptr + offs.to(tl.int64) * stride_p + U_COL, tl.minimum(u, 1.0 - 1.0 / 8388608.0), mask=inb)
    tl.store(tick_ptr, tick + advance)  # one program: every load of the tick above came first


def row_uniforms_(prm: torch.Tensor, seeds: torch.Tensor, tick: torch.Tensor, u_col: int, advance: int) -> None:
    """Each row's uniform number into column ``u_col`` of ``prm`` [N, C] float32, in place: the 24-bit splitmix64
    draw of (its seed hash, its position), ``seeds`` [N, 2] int64 holding the hash (its 64 bits) and the position
    less ``tick[0]`` (int64 on the device), which is then advanced by ``advance``. So a steady batch's table stays
    the same step after step while its rows' positions move on with the tick, and a CUDA graph that replays this
    draws each step's numbers with no upload. The same numbers as ``sampler._uniforms``, capped at ``_U_MAX``
    (1 - 2^-23)."""
    n = prm.shape[0]
    assert prm.dtype == torch.float32 and prm.stride(1) == 1 and seeds.dtype == torch.int64 and seeds.stride(1) == 1
    assert n <= 1024 and seeds.shape[0] >= n
    _row_uniforms_kernel[(1,)](prm, prm.stride(0), seeds, seeds.stride(0), tick, n, advance, u_col,
                               BLOCK=max(16, triton.next_power_of_2(n)), num_warps=4)


@triton.jit(do_not_specialize=["stride_x", "stride_p", "stride_t"])
def _penalize_kernel(x_ptr, stride_x, prm_ptr, stride_p, ids_ptr, counts_ptr, stride_t, nseen_ptr,
                     REP_COL: tl.constexpr, PRES_COL: tl.constexpr, FREQ_COL: tl.constexpr, SLOT_COL: tl.constexpr,
                     REP: tl.constexpr, FREQ_PRES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    p = prm_ptr + row * stride_p
    slot = tl.load(p + SLOT_COL).to(tl.int64)
    n = tl.where(slot > 0, tl.load(nseen_ptr + slot), 0)  # slot 0: no penalties
    rp, pres, freq = tl.load(p + REP_COL), tl.load(p + PRES_COL), tl.load(p + FREQ_COL)
    xrow = x_ptr + row.to(tl.int64) * stride_x
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < n
        t = tl.load(ids_ptr + slot * stride_t + cols, mask=inb, other=0)
        v = tl.load(xrow + t, mask=inb, other=0.0)
        if REP:  # x / rp where x > 0, x · rp elsewhere
            v = tl.where(v > 0, tl.math.div_rn(v, rp), v * rp)
        if FREQ_PRES:  # x − frequency · count − presence · (count > 0)
            c = tl.load(counts_ptr + slot * stride_t + cols, mask=inb, other=0.0)
            v = v + c * -freq
            v = v + tl.where(c > 0, 1.0, 0.0) * -pres
        tl.store(xrow + t, v, mask=inb)


def penalize_(x: torch.Tensor, prm: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, nseen: torch.Tensor,
              cols: tuple[int, int, int, int], rep: bool, freq_pres: bool) -> None:
    """In place: each row of ``x`` [N, V] (float32) penalized over its slot's distinct tokens (``cols``: the
    table's repetition, presence, frequency and slot columns). One pass over the columns each row owns."""
    n = x.shape[0]
    assert x.stride(1) == 1 and x.dtype == torch.float32 and ids.stride(1) == 1 and counts.stride() == ids.stride()
    assert prm.stride(1) == 1 and prm.dtype == torch.float32
    if n:
        _penalize_kernel[(n,)](x, x.stride(0), prm, prm.stride(0), ids, counts, ids.stride(0), nseen, *cols,
                               REP=rep, FREQ_PRES=freq_pres, BLOCK=SAMPLER_BLOCK, num_warps=4)


@triton.jit(do_not_specialize=["stride_p", "stride_t"])
def _fold_kernel(tok_ptr, prm_ptr, stride_p, ids_ptr, counts_ptr, stride_t, nseen_ptr, SLOT_COL: tl.constexpr,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(prm_ptr + row * stride_p + SLOT_COL).to(tl.int64)
    live = slot > 0
    n = tl.where(live, tl.load(nseen_ptr + slot), 0)
    t = tl.load(tok_ptr + row)
    first = n  # the token's column; n: a new one
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(ids_ptr + slot * stride_t + cols, mask=cols < n, other=-1)
        first = tl.minimum(first, tl.min(tl.where(v == t, cols.to(tl.int64), n), 0))
    at = slot * stride_t + first
    c = tl.load(counts_ptr + at, mask=live, other=0.0)  # a new column's is 0 (padding)
    tl.store(counts_ptr + at, c + 1.0, mask=live)
    new = live & (first == n)
    tl.store(ids_ptr + at, t, mask=new)
    tl.store(nseen_ptr + slot, n + 1, mask=new)


def fold_(tok: torch.Tensor, prm: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, nseen: torch.Tensor,
          slot_col: int) -> None:
    """Each row's picked token ``tok`` [N] into its slot (table column ``slot_col``; slot 0: none): one more count
    of the column holding it, or a new column. The caller leaves room for one more column in every slot."""
    n = tok.shape[0]
    assert tok.is_contiguous() and ids.stride(1) == 1 and counts.stride() == ids.stride() and prm.stride(1) == 1
    if n:
        _fold_kernel[(n,)](tok, prm, prm.stride(0), ids, counts, ids.stride(0), nseen, slot_col,
                           BLOCK=SAMPLER_BLOCK, num_warps=4)


@triton.jit(do_not_specialize=["k", "stride_p"])
def _pick_candidates_kernel(vals_ptr, cand_ptr, k, prm_ptr, stride_p, out_ptr, TEMP_COL: tl.constexpr,
                            TOPK_COL: tl.constexpr, TOPP_COL: tl.constexpr, MINP_COL: tl.constexpr,
                            U_COL: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr, KP: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, KP)
    inb = offs < k
    p = prm_ptr + row * stride_p
    v = tl.load(vals_ptr + row * k + offs, mask=inb, other=float("-inf"))
    ids = tl.load(cand_ptr + row * k + offs, mask=inb, other=0)
    v = tl.math.div_rn(v, tl.load(p + TEMP_COL))
    v = tl.where(offs.to(tl.float32) >= tl.load(p + TOPK_COL), float("-inf"), v)  # the row's own top-k
    e = tl.exp(v - tl.max(v, 0))
    pr = tl.math.div_rn(e, tl.sum(e, 0))
    if TOP_P:  # the smallest set whose mass reaches top_p (candidates come largest first)
        pr = tl.where(tl.cumsum(pr, 0) - pr >= tl.load(p + TOPP_COL), 0.0, pr)
    if MIN_P:
        pr = tl.where(pr < tl.load(p + MINP_COL) * tl.max(pr, 0), 0.0, pr)
    # back to vocabulary order (the full-vocabulary path's order): sort (id, rank) keys, padding last
    key = tl.sort(tl.where(inb, ids * KP + offs, tl.full([KP], 1 << 60, tl.int64) + offs), 0)
    ps = tl.gather(pr, (key % KP).to(tl.int32), 0)
    cdf = tl.cumsum(ps, 0)
    target = tl.load(p + U_COL) * tl.max(cdf, 0)  # u < 1: below the total
    j = tl.minimum(tl.sum((cdf <= target).to(tl.int32), 0), k - 1)  # the first entry whose running mass passes it
    tl.store(out_ptr + row, tl.sum(tl.where(offs == j, key // KP, 0), 0))


@triton.jit
def _order_key(z):
    """float32 → uint32 in the same order (larger z, larger key)."""
    b = z.to(tl.uint32, bitcast=True)
    return tl.where((b >> 31) != 0, ~b, b | 0x80000000)


@triton.jit
def _scaled(x, temp, rtemp):
    """x / temp as IEEE division rounds it (the same z as ``tl.math.div_rn``, and as PyTorch's division) from the
    reciprocal ``rtemp`` = 1 / temp (rounded): a product and one correction by fused multiply-adds, with no branch
    (div_rn's slow-path branch per element kept the pick's launches from having several loads in flight). Infinite
    and NaN x take the product."""
    q = x * rtemp
    z = tl.fma(tl.fma(-q, temp, x), rtemp, q)
    return tl.where(z == z, z, q)


@triton.jit(do_not_specialize=["temp", "n"])
def _scaled_kernel(x_ptr, out_ptr, temp, n, BLOCK: tl.constexpr):
    """out = :func:`_scaled` (x, temp): the pick's z alone, for the test that holds it to IEEE division."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, _scaled(x, temp, tl.math.div_rn(1.0, temp)), mask=offs < n)


@triton.jit
def _row_totals(m_ptr, s_ptr, row, nseg, SP: tl.constexpr):
    """A row's max z and its total mass sum(exp(z - max)), from its segments' own maxima and masses."""
    offs = tl.arange(0, SP)
    ms = tl.load(m_ptr + row * nseg + offs, mask=offs < nseg, other=-float("inf"))
    ss = tl.load(s_ptr + row * nseg + offs, mask=offs < nseg, other=0.0)
    m = tl.max(ms, 0)
    return m, tl.sum(ss * tl.exp(ms - tl.where(m == -float("inf"), 0.0, m)), 0)


@triton.jit
def _segment_program(prm_ptr, stride_p, m_ptr, s_ptr, TEMP_COL: tl.constexpr, SP: tl.constexpr):
    """A whole-vocabulary pick program's row, segment, the row's segments, parameter row, temperature, max z and
    total mass (its segments' from the first launch)."""
    row = tl.program_id(0)
    sg = tl.program_id(1)
    nseg = tl.num_programs(1)
    p = prm_ptr + row.to(tl.int64) * stride_p
    m, total = _row_totals(m_ptr, s_ptr, row, nseg, SP)
    return row, sg, nseg, p, tl.load(p + TEMP_COL), m, total


@triton.jit
def _topp_digit(hist, tau, above, cut, K: tl.constexpr):
    """Digit K of the top-p threshold from the row's mass by digit ``hist`` [16] over the tokens matching the
    prefix ``tau``: the largest digit whose mass, with the mass ``above`` the prefix, still reaches the cut. The
    prefix and the mass above it after that digit."""
    bins = tl.arange(0, 16)
    at_least = above + tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    pick = tl.maximum(tl.max(tl.where(at_least >= cut, bins, -1), 0), 0)
    above = tl.sum(tl.where(bins == pick, at_least - hist, 0.0), 0)
    return tau | (pick.to(tl.uint32) << (28 - 4 * K)), above


@triton.jit
def _topp_state(h_ptr, t_ptr, a_ptr, n, row, nseg, cut, K: tl.constexpr, SP: tl.constexpr):
    """The top-p threshold's order-key prefix of digits 0..K and the row's mass above that prefix: digits 0..K-1's
    (stored by the launch before) advanced by digit K, from digit K's histograms summed over the row's segments."""
    if K == 0:
        tau = tl.zeros([], tl.uint32)
        above = 0.0
    else:
        tau = tl.load(t_ptr + (K - 1) * n + row).to(tl.uint32, bitcast=True)
        above = tl.load(a_ptr + (K - 1) * n + row)
    bins = tl.arange(0, 16)
    segs = tl.arange(0, SP)
    h = tl.load(h_ptr + ((K * n + row) * nseg + segs[:, None]) * 16 + bins[None, :], mask=(segs < nseg)[:, None],
                other=0.0)
    return _topp_digit(tl.sum(h, 0), tau, above, cut, K)


@triton.jit
def _digit_tile(key, w, K: tl.constexpr):
    """Masses ``w`` [S] spread by their order keys' K-th 4-bit digit: [16, S], each in its digit's row. A launch
    adds these tiles up and sums the rows once at its end (a sum across threads for every sub-block costs more
    than the adding). Tokens along the last dimension: each thread's tokens are where its loads put them, and it
    holds their 16 digits itself (as [S, 16], the tile's layout differed from the loads', and every sub-block
    went through shared memory, with barriers, to convert it)."""
    d = ((key >> (28 - 4 * K)) & 15).to(tl.int32)
    return tl.where(tl.arange(0, 16)[:, None] == d[None, :], w[None, :], 0.0)


@triton.jit(do_not_specialize=["stride_x", "stride_p", "vocab", "seg"])
def _pick_stats_kernel(x_ptr, stride_x, prm_ptr, stride_p, m_ptr, s_ptr, bm_ptr, vocab, seg, nblk,
                       TEMP_COL: tl.constexpr, BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """A segment's max z (z = x / temperature) and its mass sum(exp(z - that max)), in one pass; with ``BLOCKS``,
    each block's max z too (the later launches skip blocks that can hold no token they count)."""
    row = tl.program_id(0)
    sg = tl.program_id(1)
    nseg = tl.num_programs(1)
    temp = tl.load(prm_ptr + row.to(tl.int64) * stride_p + TEMP_COL)
    rtemp = tl.math.div_rn(1.0, temp)
    xr = x_ptr + row.to(tl.int64) * stride_x
    offs = tl.arange(0, BLOCK)
    lo = sg * seg
    hi = tl.minimum(lo + seg, vocab)
    m = -float("inf")
    s = 0.0
    for start in range(lo, hi, BLOCK):
        z = _scaled(tl.load(xr + start + offs, mask=start + offs < hi, other=-float("inf")), temp, rtemp)
        bm = tl.max(z, 0)
        if BLOCKS:
            tl.store(bm_ptr + row * nblk + start // BLOCK, bm)
        m_new = tl.maximum(m, bm)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # every token so far masked (a grammar's)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe), 0)
        m = m_new
    tl.store(m_ptr + row * nseg + sg, m)
    tl.store(s_ptr + row * nseg + sg, s)


@triton.jit
def _prefix_block(bm_ptr, row, nblk, start, prefix, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Whether the block at ``start`` can hold a token whose order key's top BITS bits are ``prefix``: its largest
    z's are not under it."""
    return (_order_key(tl.load(bm_ptr + row * nblk + start // BLOCK)) >> (32 - BITS)) >= prefix


@triton.jit
def _prefix_match(xr, sub, offs, hi, temp, rtemp, prefix, BITS: tl.constexpr):
    """A sub-block's tokens (which are in the segment), their z and order keys, and which keys' top BITS bits are
    ``prefix``."""
    inb = sub + offs < hi
    z = _scaled(tl.load(xr + sub + offs, mask=inb, other=-float("inf")), temp, rtemp)
    key = _order_key(z)
    return inb, z, key, ((key >> (32 - BITS)) == prefix) & inb


@triton.jit(do_not_specialize=["stride_x", "stride_p", "vocab", "seg", "n", "nblk"])
def _pick_topp_digit_kernel(x_ptr, stride_x, prm_ptr, stride_p, m_ptr, s_ptr, bm_ptr, h_ptr, t_ptr, a_ptr, rf_ptr,
                            vocab, seg, n, nblk, TEMP_COL: tl.constexpr, TOPP_COL: tl.constexpr, DIGIT: tl.constexpr,
                            RESOLVE: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
                            UNROLL: tl.constexpr):
    """A segment's mass by the top-p threshold's DIGIT-th 4-bit digit of the order key, over its tokens whose
    key matches the digits chosen before (a radix select weighted by mass, from the top). Blocks whose largest key
    is under that prefix are not read. UNROLL sub-blocks are read at once (their loads in flight together: a launch
    that waits on one load at a time is bound by the memory's latency). The segment 0 program keeps the prefix for
    the next launch. From digit RESOLVE on, only rows whose candidates did not fit their slots
    (:func:`_pick_topp_resolve_kernel`) are left, and the others return at once."""
    row = tl.program_id(0)
    go = True
    if DIGIT >= RESOLVE:  # rows the candidates resolved return before reading anything else
        go = tl.load(rf_ptr + row) == 0
    if go:
        row, sg, nseg, p, temp, m, total = _segment_program(prm_ptr, stride_p, m_ptr, s_ptr, TEMP_COL, SP)
        rtemp = tl.math.div_rn(1.0, temp)
        cut = tl.load(p + TOPP_COL) * total
        if cut < total:
            xr = x_ptr + row.to(tl.int64) * stride_x
            offs = tl.arange(0, SUB)
            lo = sg * seg
            hi = tl.minimum(lo + seg, vocab)
            acc = tl.zeros([16, SUB], tl.float32)
            if DIGIT == 0:
                for start in range(lo, hi, SUB * UNROLL):
                    for u in tl.static_range(UNROLL):
                        inb = start + u * SUB + offs < hi
                        z = _scaled(tl.load(xr + start + u * SUB + offs, mask=inb, other=-float("inf")), temp, rtemp)
                        acc += _digit_tile(_order_key(z), tl.where(inb, tl.exp(z - m), 0.0), 0)
            else:
                tau, above = _topp_state(h_ptr, t_ptr, a_ptr, n, row, nseg, cut, DIGIT - 1, SP)
                if sg == 0:
                    tl.store(t_ptr + (DIGIT - 1) * n + row, tau.to(tl.int32, bitcast=True))
                    tl.store(a_ptr + (DIGIT - 1) * n + row, above)
                prefix = tau >> (32 - 4 * DIGIT)
                for start in range(lo, hi, BLOCK):
                    if _prefix_block(bm_ptr, row, nblk, start, prefix, 4 * DIGIT, BLOCK):
                        for sub in range(start, start + BLOCK, SUB * UNROLL):
                            for u in tl.static_range(UNROLL):
                                z, key, match = _prefix_match(xr, sub + u * SUB, offs, hi, temp, rtemp, prefix,
                                                               4 * DIGIT)[1:]
                                acc += _digit_tile(key, tl.where(match, tl.exp(z - m), 0.0), DIGIT)
            tl.store(h_ptr + ((DIGIT * n + row) * nseg + sg) * 16 + tl.arange(0, 16), tl.sum(acc, 1))


@triton.jit(do_not_specialize=["stride_x", "stride_p", "vocab", "seg", "n", "nblk"])
def _pick_topp_compact_kernel(x_ptr, stride_x, prm_ptr, stride_p, m_ptr, s_ptr, bm_ptr, h_ptr, t_ptr, a_ptr, ck_ptr,
                              cw_ptr, cn_ptr, rf_ptr, vocab, seg, n, nblk, TEMP_COL: tl.constexpr, TOPP_COL: tl.constexpr,
                              RESOLVE: tl.constexpr, CAP: tl.constexpr, AGAIN: tl.constexpr, SP: tl.constexpr,
                              BLOCK: tl.constexpr, SUB: tl.constexpr):
    """A segment's candidates for the top-p threshold's last digits: its tokens whose order key matches the first
    RESOLVE digits, key and mass, in vocabulary order into the segment's CAP slots, and their count (past CAP, only
    the first CAP are written). Sub-blocks with no such token write nothing. ``AGAIN``: the second try, for the
    rows whose first candidates overflowed (the others return at once)."""
    row, sg, nseg, p, temp, m, total = _segment_program(prm_ptr, stride_p, m_ptr, s_ptr, TEMP_COL, SP)
    rtemp = tl.math.div_rn(1.0, temp)
    cut = tl.load(p + TOPP_COL) * total
    cnt = tl.zeros([], tl.int32)
    go = cut < total
    if AGAIN:
        go = go & (tl.load(rf_ptr + row) == 0)
    if go:
        prefix = _topp_state(h_ptr, t_ptr, a_ptr, n, row, nseg, cut, RESOLVE - 1, SP)[0] >> (32 - 4 * RESOLVE)
        xr = x_ptr + row.to(tl.int64) * stride_x
        offs = tl.arange(0, SUB)
        lo = sg * seg
        hi = tl.minimum(lo + seg, vocab)
        base = (row * nseg + sg) * CAP
        for start in range(lo, hi, BLOCK):
            if _prefix_block(bm_ptr, row, nblk, start, prefix, 4 * RESOLVE, BLOCK):
                for sub in range(start, start + BLOCK, SUB):
                    z, key, match = _prefix_match(xr, sub, offs, hi, temp, rtemp, prefix, 4 * RESOLVE)[1:]
                    found = tl.sum(match.to(tl.int32), 0)
                    if found > 0:
                        pos = cnt + tl.cumsum(match.to(tl.int32), 0) - 1
                        keep = match & (pos < CAP)
                        tl.store(ck_ptr + base + pos, key.to(tl.int32, bitcast=True), mask=keep)
                        tl.store(cw_ptr + base + pos, tl.exp(z - m), mask=keep)
                        cnt += found
        tl.store(cn_ptr + row * nseg + sg, cnt)
    elif not AGAIN:
        tl.store(cn_ptr + row * nseg + sg, cnt)


@triton.jit
def _segments_above(h_ptr, n, row, nseg, tau, RESOLVE: tl.constexpr, SP: tl.constexpr):
    """Each segment's mass above the threshold's first RESOLVE digits ``tau`` [SP], from the digit launches' own
    histograms: at each digit, the mass of its digits above the one chosen (over the tokens that matched the digits
    before)."""
    segs = tl.arange(0, SP)
    bins = tl.arange(0, 16)
    over = tl.zeros([SP], tl.float32)
    for k in tl.static_range(RESOLVE):
        h = tl.load(h_ptr + ((k * n + row) * nseg + segs[:, None]) * 16 + bins[None, :], mask=(segs < nseg)[:, None],
                    other=0.0)
        d = ((tau >> (28 - 4 * k)) & 15).to(tl.int32)
        over += tl.sum(tl.where(bins[None, :] > d, h, 0.0), 1)
    return over


@triton.jit(do_not_specialize=["stride_p", "n", "nseg"])
def _pick_topp_resolve_kernel(prm_ptr, stride_p, m_ptr, s_ptr, h_ptr, t_ptr, a_ptr, ck_ptr, cw_ptr, cn_ptr, rf_ptr,
                              rt_ptr, k_ptr, n, nseg, TOPP_COL: tl.constexpr, RESOLVE: tl.constexpr, CAP: tl.constexpr,
                              KEPT: tl.constexpr, AGAIN: tl.constexpr, SP: tl.constexpr):
    """A row's top-p threshold past its first RESOLVE digits, where every segment's candidates fit their slots: all
    of them held at once by one program, the threshold's other bits set one at a time from the top (each kept
    where the mass of the keys at or above it still reaches the cut). The threshold and 1 (resolved), else 0 (the
    digit launches go on over the row). With ``KEPT`` (no min-p to apply), each segment's kept mass too: its mass
    above the candidates and its candidates' at or above the threshold. ``AGAIN``: the second try, one digit
    further, for the rows the first left; the rows it resolved return at once."""
    row = tl.program_id(0)
    go = True
    if AGAIN:
        go = tl.load(rf_ptr + row) == 0
    if go:
        total = _row_totals(m_ptr, s_ptr, row, nseg, SP)[1]
        cut = tl.load(prm_ptr + row.to(tl.int64) * stride_p + TOPP_COL) * total
        segs = tl.arange(0, SP)
        counts = tl.load(cn_ptr + row * nseg + segs, mask=segs < nseg, other=0)
        done = (cut < total) & (tl.max(counts, 0) <= CAP)
        if done:
            tau, above = _topp_state(h_ptr, t_ptr, a_ptr, n, row, nseg, cut, RESOLVE - 1, SP)
            # the row's slots as one flat vector: each of the threshold's bits is one reduction over it
            slots = tl.arange(0, SP * CAP)
            seg_of = slots // CAP
            ok = (slots % CAP) < tl.load(cn_ptr + row * nseg + seg_of, mask=seg_of < nseg, other=0)
            keys = tl.load(ck_ptr + row * nseg * CAP + slots, mask=ok, other=0).to(tl.uint32, bitcast=True)
            w = tl.load(cw_ptr + row * nseg * CAP + slots, mask=ok, other=0.0)
            for b in tl.static_range(31 - 4 * RESOLVE, -1, -1):
                t = tau | (1 << b)
                if above + tl.sum(tl.where(keys >= t, w, 0.0), 0) >= cut:
                    tau = t
            tl.store(rt_ptr + row, tau.to(tl.int32, bitcast=True))
            if KEPT:
                over = _segments_above(h_ptr, n, row, nseg, tau, RESOLVE, SP)
                mine = tl.sum(tl.reshape(tl.where(keys >= tau, w, 0.0), [SP, CAP]), 1)
                tl.store(k_ptr + row * nseg + segs, over + mine, mask=segs < nseg)
        tl.store(rf_ptr + row, done.to(tl.int32))


@triton.jit
def _row_filter(p, h_ptr, t_ptr, a_ptr, rf_ptr, rt_ptr, n, row, nseg, total, TOPP_COL: tl.constexpr,
                MINP_COL: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr, SP: tl.constexpr):
    """A row's top-p threshold (its order key; 0 without top-p, or where its top_p keeps the whole mass) and its
    min-p (0.0 without)."""
    tau = tl.zeros([], tl.uint32)
    if TOP_P:
        cut = tl.load(p + TOPP_COL) * total
        if cut < total:
            if tl.load(rf_ptr + row) != 0:  # found over the row's candidates
                tau = tl.load(rt_ptr + row).to(tl.uint32, bitcast=True)
            else:
                tau = _topp_state(h_ptr, t_ptr, a_ptr, n, row, nseg, cut, 7, SP)[0]
    min_p = 0.0
    if MIN_P:
        min_p = tl.load(p + MINP_COL)
    return tau, min_p


@triton.jit
def _may_keep(bm_ptr, row, nblk, start, m, tau, min_p, BLOCK: tl.constexpr):
    """Whether the block at ``start`` can hold a token that top-p and min-p keep: its largest z's."""
    bm = tl.load(bm_ptr + row * nblk + start // BLOCK)
    return (_order_key(bm) >= tau) & (tl.exp(bm - m) >= min_p)


@triton.jit
def _kept(z, m, tau, min_p, inb):
    """A token's mass exp(z - max) where top-p (order key >= tau) and min-p keep it, else 0."""
    w = tl.exp(z - m)
    return tl.where((_order_key(z) >= tau) & (w >= min_p) & inb, w, 0.0)


@triton.jit(do_not_specialize=["stride_x", "stride_p", "vocab", "seg", "n", "nblk"])
def _pick_kept_kernel(x_ptr, stride_x, prm_ptr, stride_p, m_ptr, s_ptr, bm_ptr, h_ptr, t_ptr, a_ptr, rf_ptr, rt_ptr,
                      k_ptr, vocab, seg, n, nblk, TEMP_COL: tl.constexpr, TOPP_COL: tl.constexpr,
                      MINP_COL: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr, SP: tl.constexpr,
                      BLOCK: tl.constexpr):
    """A segment's mass that top-p and min-p keep (blocks that can keep none are not read). Rows whose top-p the
    resolve launch found with no min-p have theirs already."""
    row, sg, nseg, p, temp, m, total = _segment_program(prm_ptr, stride_p, m_ptr, s_ptr, TEMP_COL, SP)
    rtemp = tl.math.div_rn(1.0, temp)
    go = True
    if TOP_P and not MIN_P:
        go = tl.load(rf_ptr + row) == 0
    if go:
        tau, min_p = _row_filter(p, h_ptr, t_ptr, a_ptr, rf_ptr, rt_ptr, n, row, nseg, total, TOPP_COL, MINP_COL,
                                 TOP_P, MIN_P, SP)
        xr = x_ptr + row.to(tl.int64) * stride_x
        offs = tl.arange(0, BLOCK)
        lo = sg * seg
        hi = tl.minimum(lo + seg, vocab)
        kept = 0.0
        for start in range(lo, hi, BLOCK):
            if _may_keep(bm_ptr, row, nblk, start, m, tau, min_p, BLOCK):
                inb = start + offs < hi
                z = _scaled(tl.load(xr + start + offs, mask=inb, other=-float("inf")), temp, rtemp)
                kept += tl.sum(_kept(z, m, tau, min_p, inb), 0)
        tl.store(k_ptr + row * nseg + sg, kept)


@triton.jit(do_not_specialize=["stride_x", "stride_p", "vocab", "seg", "n", "nblk"])
def _pick_scan_kernel(x_ptr, stride_x, prm_ptr, stride_p, m_ptr, s_ptr, bm_ptr, h_ptr, t_ptr, a_ptr, rf_ptr, rt_ptr,
                      k_ptr, out_ptr, vocab, seg, n, nblk, TEMP_COL: tl.constexpr, TOPP_COL: tl.constexpr,
                      MINP_COL: tl.constexpr, U_COL: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr,
                      SP: tl.constexpr, BLOCK: tl.constexpr):
    """The inverse CDF in vocabulary order: the segment where the row's running kept mass passes u × its kept
    mass finds the token in its own tokens; the others return."""
    row, sg, nseg, p, temp, m, total = _segment_program(prm_ptr, stride_p, m_ptr, s_ptr, TEMP_COL, SP)
    rtemp = tl.math.div_rn(1.0, temp)
    segs = tl.arange(0, SP)
    if TOP_P or MIN_P:
        segm = tl.load(k_ptr + row * nseg + segs, mask=segs < nseg, other=0.0)
    else:  # every token kept: the segments' own masses, at the row's max
        ms = tl.load(m_ptr + row * nseg + segs, mask=segs < nseg, other=-float("inf"))
        segm = tl.load(s_ptr + row * nseg + segs, mask=segs < nseg, other=0.0) * tl.exp(
            ms - tl.where(m == -float("inf"), 0.0, m))
    cum = tl.cumsum(segm, 0)
    target = tl.load(p + U_COL) * tl.sum(segm, 0)  # u < 1: below the kept mass
    # the first segment whose running mass passes the target; rounding may leave none: the last one with mass
    first = tl.min(tl.where(cum > target, segs, SP), 0)
    chosen = tl.where(first < SP, first, tl.max(tl.where(segm > 0, segs, 0), 0))
    if sg == chosen:
        tau, min_p = _row_filter(p, h_ptr, t_ptr, a_ptr, rf_ptr, rt_ptr, n, row, nseg, total, TOPP_COL, MINP_COL, TOP_P,
                             MIN_P, SP)
        xr = x_ptr + row.to(tl.int64) * stride_x
        offs = tl.arange(0, BLOCK)
        lo = sg * seg
        hi = tl.minimum(lo + seg, vocab)
        carry = tl.sum(tl.where(segs < sg, segm, 0.0), 0)
        found = hi
        last = lo
        for start in range(lo, hi, BLOCK):
            go = True
            if TOP_P or MIN_P:
                go = _may_keep(bm_ptr, row, nblk, start, m, tau, min_p, BLOCK)
            if go:
                idx = start + offs
                inb = idx < hi
                z = _scaled(tl.load(xr + idx, mask=inb, other=-float("inf")), temp, rtemp)
                w = _kept(z, m, tau, min_p, inb)
                cdf = carry + tl.cumsum(w, 0)
                found = tl.minimum(found, tl.min(tl.where(cdf > target, idx, hi), 0))
                last = tl.maximum(last, tl.max(tl.where(w > 0, idx, lo), 0))
                carry += tl.sum(w, 0)
        # rounding (this running sum is in another order than the segments' masses) can leave the target past the
        # segment's end: its last kept token then
        tl.store(out_ptr + row, tl.where(found < hi, found, last).to(tl.int64))


PICK_BLOCK = 1024  # tokens a block: the unit of the whole-vocabulary pick's segments and of its skipped blocks
PICK_SUB = 128  # tokens the radix select's launches sum by digit at once
PICK_UNROLL = 2  # sub-blocks a digit launch reads at once
PICK_WARPS = 4
PICK_DIGIT_WARPS = 2  # the radix select's and the candidates' launches
PICK_SEGMENTS = 32  # about this many segments a row in the whole-vocabulary pick
PICK_RESOLVE = 3  # top-p digits found over whole rows before the candidates (a second try one digit further)
PICK_CAP = 256  # candidates a segment keeps for the threshold's other digits


def pick_segments(vocab: int) -> tuple[int, int]:
    """(segments a row, tokens a segment) of the whole-vocabulary pick: about ``PICK_SEGMENTS``, each a whole
    number of blocks. By the vocabulary alone, so a row's sums run in the same order in any batch."""
    seg = -(-vocab // (PICK_SEGMENTS * PICK_BLOCK)) * PICK_BLOCK
    return -(-vocab // seg), seg


def pick_full(x: torch.Tensor, prm: torch.Tensor, cols: tuple[int, int, int, int], top_p: bool,
              min_p: bool) -> torch.Tensor:
    """The pick over each row's whole vocabulary (``x`` [N, V] float32 logits): temperature, top-p, min-p, then the
    inverse CDF in vocabulary order at the row's uniform number (``cols``: the table's temperature, top-p, min-p and
    uniform columns), with no sort. Each row is cut into segments (:func:`pick_segments`), a program each:

    1. their max and mass (and each block's max z);
    2. with top-p, the threshold as a radix select weighted by mass, one 4-bit digit of the order key at a time:
       each segment's mass by digit over the tokens that match the digits before, summed over the row by the next
       launch. After ``PICK_RESOLVE`` digits, each segment writes the tokens that still match (at most
       ``PICK_CAP``), and one program a row sets the threshold's other bits over them; rows with more try again
       one digit further, and rows that overflow that too go on digit by digit over the whole row. Tokens tied
       with the threshold are all kept;
    3. the mass each segment keeps (without min-p, the resolve launch's for the rows it resolved);
    4. the segment where the running mass passes u × the kept mass finds the token.

    Past the first digit, a block whose largest z is under what a launch counts is not read: where a model's
    distribution is peaked, most of a row. int64 [N]."""
    n, v = x.shape
    assert x.stride(1) == 1 and prm.stride(1) == 1
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if not n:
        return out
    assert PICK_BLOCK % (PICK_SUB * PICK_UNROLL) == 0
    nseg, seg = pick_segments(v)
    sp = max(2, triton.next_power_of_2(nseg))
    nblk = nseg * seg // PICK_BLOCK
    dev = x.device
    ms, ss, kept = torch.empty((3, n, nseg), dtype=torch.float32, device=dev)
    blocks = top_p or min_p
    bmax = torch.empty((n, nblk) if blocks else (1,), dtype=torch.float32, device=dev)
    hist = torch.empty((8 if top_p else 1, n, nseg, 16), dtype=torch.float32, device=dev)
    taus = torch.empty((7 if top_p else 1, n), dtype=torch.int32, device=dev)  # prefixes of digits 0..k
    aboves = torch.empty((7 if top_p else 1, n), dtype=torch.float32, device=dev)  # the mass above each
    cap = PICK_CAP if top_p else 1
    cand_keys = torch.empty((n, nseg, cap), dtype=torch.int32, device=dev)
    cand_mass = torch.empty((n, nseg, cap), dtype=torch.float32, device=dev)
    counts = torch.empty((n, nseg), dtype=torch.int32, device=dev)
    resolved = torch.empty(n, dtype=torch.int32, device=dev)  # written by the resolve launch, read with top-p
    found = torch.empty(n, dtype=torch.int32, device=dev)
    temp_col, topp_col, minp_col, u_col = cols
    grid = (n, nseg)
    common = dict(BLOCK=PICK_BLOCK, num_warps=PICK_WARPS)
    _pick_stats_kernel[grid](x, x.stride(0), prm, prm.stride(0), ms, ss, bmax, v, seg, nblk, temp_col, BLOCKS=blocks,
                             **common)
    if top_p:
        state = (x, x.stride(0), prm, prm.stride(0), ms, ss, bmax, hist, taus, aboves)
        digit = dict(RESOLVE=PICK_RESOLVE, SP=sp, SUB=PICK_SUB, BLOCK=PICK_BLOCK, num_warps=PICK_DIGIT_WARPS)
        for d in range(PICK_RESOLVE):
            _pick_topp_digit_kernel[grid](*state, resolved, v, seg, n, nblk, temp_col, topp_col, DIGIT=d,
                                          UNROLL=PICK_UNROLL, **digit)
        for again in range(2 if PICK_RESOLVE < 8 else 1):  # a second try one digit further, for rows left over
            if again:
                _pick_topp_digit_kernel[grid](*state, resolved, v, seg, n, nblk, temp_col, topp_col,
                                              DIGIT=PICK_RESOLVE, UNROLL=PICK_UNROLL, **digit)
            stage = dict(digit, RESOLVE=PICK_RESOLVE + again)
            _pick_topp_compact_kernel[grid](*state, cand_keys, cand_mass, counts, resolved, v, seg, n, nblk, temp_col,
                                            topp_col, CAP=cap, AGAIN=bool(again), **stage)
            _pick_topp_resolve_kernel[(n,)](prm, prm.stride(0), ms, ss, hist, taus, aboves, cand_keys, cand_mass,
                                            counts, resolved, found, kept, n, nseg, topp_col, PICK_RESOLVE + again,
                                            cap, not min_p, bool(again), sp, num_warps=8)
        for d in range(PICK_RESOLVE + 1, 8):
            _pick_topp_digit_kernel[grid](*state, resolved, v, seg, n, nblk, temp_col, topp_col, DIGIT=d,
                                          UNROLL=PICK_UNROLL, **digit)
    filters = (bmax, hist, taus, aboves, resolved, found)
    if blocks:
        _pick_kept_kernel[grid](x, x.stride(0), prm, prm.stride(0), ms, ss, *filters, kept, v, seg, n, nblk, temp_col,
                                topp_col, minp_col, TOP_P=top_p, MIN_P=min_p, SP=sp, **common)
    _pick_scan_kernel[grid](x, x.stride(0), prm, prm.stride(0), ms, ss, *filters, kept, out, v, seg, n, nblk, temp_col,
                            topp_col, minp_col, u_col, TOP_P=top_p, MIN_P=min_p, SP=sp, **common)
    return out


def pick_candidates(vals: torch.Tensor, cand: torch.Tensor, prm: torch.Tensor, cols: tuple[int, int, int, int, int],
                    top_p: bool, min_p: bool) -> torch.Tensor:
    """The pick among each row's top-k candidates (``vals`` [N, k] float32, largest first, ``cand`` their int64 token
    ids): temperature, the row's own top-k, top-p, min-p, then the inverse CDF in vocabulary order at the row's
    uniform number (``cols``: the table's temperature, top-k, top-p, min-p and uniform columns). int64 [N]."""
    n, k = vals.shape
    assert vals.is_contiguous() and cand.is_contiguous() and k <= 1024 and prm.stride(1) == 1
    out = torch.empty(n, dtype=torch.int64, device=vals.device)
    if n:
        _pick_candidates_kernel[(n,)](vals, cand, k, prm, prm.stride(0), out, *cols, TOP_P=top_p, MIN_P=min_p,
                                      KP=max(16, triton.next_power_of_2(k)), num_warps=4)
    return out
