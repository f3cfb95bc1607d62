"""The CUDA fast path of ``LlamaModel``: the forward with fused Triton stages (common/triton_ops.py).

Imports Triton: the runner (common/model_runner.py) imports this module only where ``engine.cuda_fast_path`` is on
and the device is CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import triton_ops as tk
from common.model import AttentionMetadata, Backend, LlamaModel
from common.tensor_parallel import Shard

# Prefill SDPA backends of the CUDA path: not cuDNN, which builds a new execution plan for every new sequence length
# (its CPU cost per step: docs/performance-notes.md).
_PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class CudaFast(Backend):
    """The CUDA fast path: the portable forward's function with fused Triton stages (RMSNorm + residual, RoPE + KV
    write, SiLU·mul) and decode attention read in place from the pool. Free of host syncs and of data-dependent
    shapes for a decode-only batch, so a CUDA graph can hold it (common/cuda_graphs.py); with a tensor-parallel
    shard the graph holds each layer's two all-reduces too, each fused with the residual add and RMSNorm after it
    where the peer-to-peer all-reduce runs."""

    name = "cuda"

    def forward(self, model: LlamaModel, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        cfg = model.cfg
        eps = cfg.rms_norm_eps
        nh, nkv, d = model.num_heads, model.num_kv_heads, cfg.head_dim
        q_sz = model.q_size
        x = model.embed(input_ids)
        t = x.shape[0]
        layers = model.layers
        shard = model.shard
        h = tk.add_rms_norm(x, None, layers[0].input_norm, eps)
        for li, layer in enumerate(layers):
            qkv = tk.linear(h, layer.qkv, layer.qkv_bias)
            tk.rope_kv_write(qkv, positions, meta.slot_rows, model.rope_cos, model.rope_sin, kv_cache, li, nh, nkv, d)
            attn = attention(qkv, kv_cache, li, meta, nh, nkv, d)
            # an o_proj / down output may be split-K partials (fp32, summed by add_rms_norm): all-reduced all the same
            h = reduce_add_rms_norm(shard, x, tk.residual_linear(attn.view(t, q_sz), layer.o_proj), layer.post_norm,
                                    eps)
            down = tk.down_proj(tk.linear(h, layer.gate_up), layer.down)
            nxt = layers[li + 1].input_norm if li + 1 < len(layers) else model.norm
            h = reduce_add_rms_norm(shard, x, down, nxt, eps)
        return h

    def logits(self, model: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
        return tk.linear(hidden, model.lm_head)


def reduce_add_rms_norm(shard: Shard, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """``x += delta`` summed over the tensor-parallel ranks, then RMSNorm(x) · weight: one kernel with the
    peer-to-peer all-reduce where it takes ``delta`` (common/p2p_all_reduce.py), else the group's all-reduce and
    then :func:`triton_ops.add_rms_norm`."""
    if shard.p2p is not None and shard.p2p.fits(delta):
        return shard.p2p.add_rms_norm(x, delta, weight, eps)
    return tk.add_rms_norm(x, shard.all_reduce(delta), weight, eps)


def attention(
    qkv: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata, nh: int, nkv: int, d: int
) -> torch.Tensor:
    """Attention of the CUDA fast path; K/V of this step are already in the pool and Q/K rotated in ``qkv``.

    Prefill sequences: SDPA (flash) over the chunk's own K/V, or over the gathered context when a prefix is cached;
    decodes: the Triton paged kernel; in a CUDA graph, prompt tokens staged as rows: the paged prompt kernel over
    their tiles (after the decode kernel, which writes zeros for them). Returns [T, heads, d]."""
    t = qkv.shape[0]
    q_sz, kv_sz = nh * d, nkv * d
    q = qkv[:, :q_sz].view(t, nh, d)
    out = torch.empty((t, nh, d), dtype=qkv.dtype, device=qkv.device)
    start = 0
    if meta.prefill_query_lens:
        k = qkv[:, q_sz : q_sz + kv_sz].view(t, nkv, d)
        v = qkv[:, q_sz + kv_sz :].view(t, nkv, d)
        kv_rows = kv_cache.view(-1, nkv, d)
        k_off = layer * meta.layer_stride
        v_off = k_off + meta.kv_stride
        rep = nh // nkv
        with sdpa_kernel(_PREFILL_SDPA):
            for qlen, ctx, rows in zip(meta.prefill_query_lens, meta.prefill_context_lens, meta.prefill_rows):
                qs = q[start : start + qlen].transpose(0, 1).unsqueeze(0)
                if rows is None:
                    ks, vs, causal, mask = k[start : start + qlen], v[start : start + qlen], True, None
                else:
                    ks, vs = kv_rows.index_select(0, rows + k_off), kv_rows.index_select(0, rows + v_off)
                    qpos = torch.arange(ctx - qlen, ctx, device=q.device).unsqueeze(1)
                    causal, mask = False, torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos
                # expanded K/V heads keep SDPA on its flash kernel
                ks = ks.repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)
                vs = vs.repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal)
                out[start : start + qlen] = o.squeeze(0).transpose(0, 1)
                start += qlen
    if meta.num_decode_tokens:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        tk.paged_decode_attention(q[start:], kv_cache, layer, meta.decode_block_tables, meta.decode_context_lens,
                                  d**-0.5, out[start:], meta.decode_num_splits, table_rows=meta.decode_table_rows)
    if meta.prompt_tiles is not None:
        assert meta.decode_block_tables is not None and meta.decode_table_rows is not None
        assert meta.positions is not None and start == 0
        tk.paged_prompt_attention(q, kv_cache, layer, meta.decode_block_tables, meta.decode_table_rows,
                                  meta.positions, meta.prompt_tiles, d**-0.5, out)
    return out


CUDA_FAST = CudaFast()
