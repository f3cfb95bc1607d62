"""The CPU fast path of ``LlamaModel``: matrices prepacked for oneDNN, and a forward with its elementwise stages
fused in C++ (common/cpu_kernels.py, common/csrc/paged_attention_cpu.cpp).

The runner (common/model_runner.py) prepacks every CPU model in bfloat16 and float32, and sets ``FusedCpu`` as the
model's backend where ``engine.cpu_kernels`` resolves to on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common import cpu_kernels
from common.model import AttentionMetadata, Backend, LlamaModel, gathered_decode_attention, prefill_attention

# Batches of up to this many rows take linear_small_batch where a matrix has it (see prepack). Above 32 rows oneDNN
# changes how it sums (its results move by an ulp in some elements), so the small path stops here and every batch
# size keeps oneDNN's results bit for bit.
_SMALL_BATCH_ROWS = 32
# Longest prompt that cpu_kernels.prefill_attention takes (it keeps whole score rows: slower than SDPA at 2,000)
_PREFILL_KERNEL_MAX = 1024


@dataclass(slots=True)
class PackedMatrices:
    """A model's matrices in oneDNN's blocked layout (``packed``) and, for batches of up to 32 rows, in
    ``cpu_kernels.linear_small_batch``'s (``small``), keyed by the plain parameter's ``id``."""

    packed: dict[int, torch.Tensor]
    min_rows: int  # fewer rows than this take the plain matmul
    small: dict[int, torch.Tensor] = field(default_factory=dict)  # bf16 layer matrices for decode batches

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] <= _SMALL_BATCH_ROWS and self.small:
            small = self.small.get(id(w))
            if small is not None:
                return cpu_kernels.linear_small_batch(x, small, b)
        packed = self.packed.get(id(w)) if self.packed else None
        if packed is None or x.shape[0] < self.min_rows:
            return F.linear(x, w, b)
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def prepack(model: LlamaModel, small_batch: bool = False) -> bool:
    """On CPU, reorder every matrix of ``model`` once into oneDNN's blocked layout (faster from 4 rows; smaller
    batches keep MKL's plain matmul in float32; docs/performance-notes.md) and set ``model.packed``. float32 results
    differ from the plain matmul's in the last bits (summation order); greedy output still equals transformers'
    (tests/test_reference.py). In bfloat16 the plain matrices are freed (nothing reads them again; a tied head's
    stays, as the embedding table); float32 keeps them for its small batches.

    With ``small_batch`` (the runner's choice: the C++ kernels are on) and AMX, bfloat16 layer matrices are also
    packed for ``cpu_kernels.linear_small_batch``, which takes batches of up to 32 rows: oneDNN's result bit for
    bit without its per-call overhead, at the cost of a second packed copy of the layer matrices. Returns whether
    it packed."""
    if model.device.type != "cpu" or model.dtype not in (torch.bfloat16, torch.float32):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if model.dtype == torch.bfloat16 and not bf16_packing_supported():
        return False  # oneDNN's bf16 path needs AVX-512 (bw, vl, dq) or AVX-NE-CONVERT: the plain matmul runs
    reorder = torch.ops.mkldnn._reorder_linear_weight
    mats = [model.lm_head] + [w for layer in model.layers for w in (layer.qkv, layer.o_proj, layer.gate_up,
                                                                     layer.down)]
    packed = PackedMatrices({id(w): reorder(w.data, 16) for w in mats}, 4 if model.dtype == torch.float32 else 0)
    if small_batch and model.dtype == torch.bfloat16 and cpu_kernels.amx_bf16():
        packed.small = {id(w): cpu_kernels.pack_small_batch(w.data) for w in mats[1:]
                        if w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0}
    model.packed = packed
    if packed.min_rows == 0:
        for w in mats:
            if w is not model.embed_tokens:  # a tied head's weight is also the embedding table
                w.data = torch.empty(0, dtype=model.dtype, device=model.device)
    return True


def bf16_packing_supported() -> bool:
    """Whether oneDNN runs bfloat16 matmuls on this CPU (AVX-512 bw/vl/dq or AVX-NE-CONVERT); without it a
    bfloat16 weight cannot be reordered into its blocked layout."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def prefill_kernel_fits(model: LlamaModel) -> bool:
    """Whether prompts can take ``cpu_kernels.prefill_attention``: bfloat16 with AMX, head_dim a multiple of 16."""
    return model.dtype == torch.bfloat16 and cpu_kernels.amx_bf16() and model.cfg.head_dim % 16 == 0


class FusedCpu(Backend):
    """The CPU fast path (bfloat16, float32): the portable forward with its elementwise stages fused in C++, each
    rounding as the ops it replaces: the residual add with the next RMSNorm (x updated in place), RoPE with this
    step's K/V write into the pool, SiLU with its product; decode attention reads the pool in place. Nine calls a
    layer instead of about sixty. With ``prefill_kernel``, prompts of up to 1,024 tokens without a cached prefix
    take ``cpu_kernels.prefill_attention``."""

    name = "cpu"

    def __init__(self, prefill_kernel: bool) -> None:
        self.prefill_kernel = prefill_kernel

    def forward(self, model: LlamaModel, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        cfg = model.cfg
        eps = cfg.rms_norm_eps
        nh, nkv, d = model.num_heads, model.num_kv_heads, cfg.head_dim
        q_sz, kv_sz = model.q_size, model.kv_size
        x = model.embed(input_ids)
        t = x.shape[0]
        kv_rows = kv_cache.view(-1, nkv, d)
        layers = model.layers
        reduce = model.shard.all_reduce
        linear = model.linear
        h = cpu_kernels.add_rms_norm(x, None, layers[0].input_norm, eps)
        for li, layer in enumerate(layers):
            qkv = linear(h, layer.qkv, layer.qkv_bias)
            k_off = li * meta.layer_stride
            cpu_kernels.rope_write_kv(qkv, positions, model.rope_cos, model.rope_sin, kv_cache, meta.slot_rows, k_off,
                                      k_off + meta.kv_stride, nh, nkv)
            q = qkv[:, :q_sz].view(t, nh, d)
            k = qkv[:, q_sz : q_sz + kv_sz].view(t, nkv, d)
            v = qkv[:, q_sz + kv_sz :].view(t, nkv, d)
            attn = self._attention(q, k, v, kv_rows, k_off, meta, kv_cache, li)
            o = reduce(linear(attn.reshape(t, q_sz), layer.o_proj))
            h = cpu_kernels.add_rms_norm(x, o, layer.post_norm, eps)
            down = reduce(linear(cpu_kernels.silu_mul(linear(h, layer.gate_up)), layer.down))
            nxt = layers[li + 1].input_norm if li + 1 < len(layers) else model.norm
            h = cpu_kernels.add_rms_norm(x, down, nxt, eps)
        return h

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_rows: torch.Tensor, k_off: int,
                   meta: AttentionMetadata, kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
        """Attention after this step's K/V are in the pool: prompts by the prefill kernel or SDPA, decodes by the
        C++ kernel reading the pool in place (common/csrc/paged_attention_cpu.cpp). Returns [T, heads, d]."""
        v_off = k_off + meta.kv_stride
        d = q.shape[2]
        outs: list[torch.Tensor] = []
        start = 0
        for qlen, ctx, rows in zip(meta.prefill_query_lens, meta.prefill_context_lens, meta.prefill_rows):
            if rows is None and self.prefill_kernel and qlen <= _PREFILL_KERNEL_MAX:
                outs.append(cpu_kernels.prefill_attention(q[start : start + qlen], k[start : start + qlen],
                                                          v[start : start + qlen], d**-0.5))
            else:
                outs.append(prefill_attention(q, k, v, kv_rows, k_off, v_off, start, qlen, ctx, rows))
            start += qlen
        if meta.num_decode_tokens and meta.decode_block_tables is not None:
            outs.append(cpu_kernels.paged_decode_attention(
                q[start:], kv_cache, layer, meta.decode_block_tables, meta.decode_context_lens, d**-0.5
            ))
        elif meta.num_decode_tokens:
            outs.append(gathered_decode_attention(q[start:], kv_rows, k_off, v_off, meta))
        return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
