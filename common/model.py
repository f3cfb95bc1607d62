"""A Llama-family decoder over a paged KV cache: the model, its weights, and the portable PyTorch forward.

One forward runs a flat batch of tokens from many sequences (prefill chunks and decodes mixed): the matmuls see
all tokens at once, attention is per sequence over its block table. The portable forward runs on ``cpu`` and
``cuda``; the runner (common/model_runner.py) picks the model's ``backend`` once: this one, the CPU fast path
(common/model_cpu.py: prepacked matmuls, fused C++ stages) or the CUDA fast path (common/model_cuda.py: Triton).

Weights are taken with Hugging Face names (``model.layers.0.self_attn.q_proj.weight``) and fused here
(q/k/v into one projection, gate/up into one), so every loader only has to speak one naming scheme.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol, cast, overload

import torch
import torch.nn.functional as F

from common.config import ModelConfig
from common.tensor_parallel import SINGLE, Shard, check_divisible


@dataclass(slots=True)
class AttentionMetadata:
    """Where the tokens of one step come from and where their K/V go.

    Tokens are laid out prefill sequences first, then decode sequences (one token each). KV positions are
    rows of the cache viewed as ``[-1, kv_heads, head_dim]``; the runner gives them for layer 0's K, and the
    attention adds ``layer * layer_stride`` (and ``kv_stride`` for V).
    """

    slot_rows: torch.Tensor  # [T] row of each new token's K in layer 0
    # prefill (or chunked-prefill) sequences, one entry each
    prefill_query_lens: list[int]
    prefill_context_lens: list[int]  # tokens in the cache after this step (prefix + chunk)
    prefill_rows: list[torch.Tensor | None]  # [context_len] rows of the whole context; None: no cached prefix
    # decode sequences, batched
    num_decode_tokens: int
    decode_rows: torch.Tensor | None  # [B, L] rows of each context, padded to the longest
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] bool: key is visible
    layer_stride: int
    kv_stride: int
    decode_block_tables: torch.Tensor | None = None  # [B, W] block ids (for the CPU kernel)
    decode_context_lens: torch.Tensor | None = None  # [B] tokens each decode attends over
    decode_num_splits: int = 0  # CUDA fast path: context splits of the decode kernel (0: by batch size)
    # CUDA fast path: [B] int32, the block table of each decode row (None: row b reads table b); a CUDA graph's
    # prompt rows share their sequence's table
    decode_table_rows: torch.Tensor | None = None
    # CUDA fast path, in a CUDA graph: the prompt tokens staged as rows (decode context 0) attend in tiles of
    # consecutive positions of one sequence: [2, N] int32 (first row, row count; 0: unused), and every row's position
    prompt_tiles: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_query_lens)


def cache_rows(block_ids: torch.Tensor, block_size: int, num_layers: int) -> torch.Tensor:
    """Layer-0 K rows of every slot of ``block_ids`` (``[..., n]`` → ``[..., n * block_size]``)."""
    per_block = num_layers * 2 * block_size
    rows = block_ids.unsqueeze(-1) * per_block + torch.arange(block_size, device=block_ids.device)
    return rows.flatten(-2)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with the config's theta and scaling, in float32 with transformers' exact operations
    (the precision the models were trained with), so the cos/sin tables match the reference bit for bit."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs.rope_type == "llama3":
        old = rs.original_max_position_embeddings
        low_wl = old / rs.low_freq_factor
        high_wl = old / rs.high_freq_factor
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > low_wl, inv / rs.factor, inv)
        smooth = (old / wl - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wl >= high_wl) & (wl <= low_wl)
        inv = torch.where(medium, smoothed, scaled)
    return inv.to(torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as the reference does, returned in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(torch.nn.Module):
    """One layer's fused parameters (the backend runs its forward): set by ``LlamaModel``, declared here for
    their types."""

    input_norm: torch.nn.Parameter
    qkv: torch.nn.Parameter
    qkv_bias: torch.nn.Parameter | None  # None: the model has no attention bias
    o_proj: torch.nn.Parameter
    post_norm: torch.nn.Parameter
    gate_up: torch.nn.Parameter
    down: torch.nn.Parameter


class DecoderLayers(torch.nn.ModuleList):
    """A ``ModuleList`` of ``DecoderLayer``, typed as one."""

    def __iter__(self) -> Iterator[DecoderLayer]:
        return cast(Iterator[DecoderLayer], super().__iter__())

    @overload
    def __getitem__(self, idx: slice) -> torch.nn.ModuleList: ...

    @overload
    def __getitem__(self, idx: int) -> DecoderLayer: ...

    def __getitem__(self, idx: int | slice) -> DecoderLayer | torch.nn.ModuleList:
        return cast(DecoderLayer | torch.nn.ModuleList, super().__getitem__(idx))


class LlamaModel(torch.nn.Module):
    """The decoder. ``forward`` returns final hidden states; ``compute_logits`` projects the chosen rows.

    With a ``shard`` of a tensor-parallel group (``common/tensor_parallel.py``) it holds that rank's part of every
    layer: its query and KV heads and its slice of the intermediate dimension (q/k/v and gate/up column-parallel,
    o_proj and down row-parallel, each followed by an all-reduce). The embedding and the LM head are replicated, or
    with ``vocab_parallel`` split by vocabulary (``engine.tp_vocab_parallel``): each rank holds ``vocab_rows`` =
    ceil(vocab / N) rows of the table (the last rank's padded with zeros), looks up only the ids in its range (the
    rows summed over the ranks: one all-reduce of the step's hidden rows, exact) and computes the logits of its range
    (all-gathered, so every rank's logits are the same either way). Raises ValueError when the group's size does
    not divide the heads, the KV heads or the intermediate size."""

    # buffers, registered in __init__ (declared for their types)
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 shard: Shard = SINGLE, vocab_parallel: bool = False) -> None:
        super().__init__()
        check_divisible(cfg, shard.size)
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.shard = shard
        # this rank's sizes: all of them with one rank
        self.num_heads = cfg.num_heads // shard.size
        self.num_kv_heads = cfg.num_kv_heads // shard.size
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.intermediate_size = cfg.intermediate_size // shard.size
        # the embedding table's and the LM head's rows on this rank: ids [vocab_start, vocab_start + vocab_rows)
        self.vocab_parallel = vocab_parallel and shard.size > 1
        self.vocab_rows = -(-cfg.vocab_size // shard.size) if self.vocab_parallel else cfg.vocab_size
        self.vocab_start = shard.rank * self.vocab_rows if self.vocab_parallel else 0
        h, q, kv, i = cfg.hidden_size, self.q_size, self.kv_size, self.intermediate_size

        def empty(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=self.device), requires_grad=False)

        self.embed_tokens = empty(self.vocab_rows, h)
        self.layers = DecoderLayers()
        for _ in range(cfg.num_layers):
            layer = DecoderLayer()
            layer.input_norm = empty(h)
            layer.qkv = empty(q + 2 * kv, h)
            layer.qkv_bias = empty(q + 2 * kv) if cfg.attention_bias else None
            layer.o_proj = empty(h, q)
            layer.post_norm = empty(h)
            layer.gate_up = empty(2 * i, h)
            layer.down = empty(h, i)
            self.layers.append(layer)
        self.norm = empty(h)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else empty(self.vocab_rows, h)
        # CPU: the matrices in oneDNN's layout (common/model_cpu.py, prepack); None: the plain matmul
        self.packed: PackedLinear | None = None
        # which forward runs, set once by the runner (common/model_runner.py)
        self.backend: Backend = PORTABLE
        inv = rope_inv_freq(cfg).to(self.device)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32, device=self.device)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        # RoPE is applied in float32 and cast, as the reference computes cos/sin in float32.
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)

    # ---- weights -------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters, each cut to this rank's part first (the
        loaders always give full tensors). Raises on missing or unknown names and on a full shape that disagrees."""
        cfg = self.cfg
        q, kv, i = self.q_size, self.kv_size, self.intermediate_size
        seen: set[str] = set()
        for name, w in weights:
            name = name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq"):
                continue
            seen.add(name)
            if name == "embed_tokens.weight" or (name == "lm_head.weight" and not cfg.tie_word_embeddings):
                table = self.embed_tokens if name == "embed_tokens.weight" else self.lm_head
                if tuple(w.shape) != (cfg.vocab_size, cfg.hidden_size):
                    raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, expected "
                                     f"{(cfg.vocab_size, cfg.hidden_size)}")
                table.data.copy_(self.vocab_part(w).to(dtype=self.dtype))
                continue
            if name == "norm.weight":
                self.norm.data.copy_(w.to(dtype=self.dtype))
                continue
            if name == "lm_head.weight":  # tied: the embedding table is the head
                continue
            parts = name.split(".")
            if parts[0] != "layers":
                raise ValueError(f"unexpected weight {name!r}")
            layer = self.layers[int(parts[1])]
            rest = ".".join(parts[2:])
            # (parameter, its rows that take the weight, the dimension the group splits: 0 columns, 1 rows)
            targets = {
                "input_layernorm.weight": (layer.input_norm, None, None),
                "post_attention_layernorm.weight": (layer.post_norm, None, None),
                "self_attn.q_proj.weight": (layer.qkv, (0, q), 0),
                "self_attn.k_proj.weight": (layer.qkv, (q, q + kv), 0),
                "self_attn.v_proj.weight": (layer.qkv, (q + kv, q + 2 * kv), 0),
                "self_attn.o_proj.weight": (layer.o_proj, None, 1),
                "mlp.gate_proj.weight": (layer.gate_up, (0, i), 0),
                "mlp.up_proj.weight": (layer.gate_up, (i, 2 * i), 0),
                "mlp.down_proj.weight": (layer.down, None, 1),
            }
            if layer.qkv_bias is not None:  # set when cfg.attention_bias
                targets["self_attn.q_proj.bias"] = (layer.qkv_bias, (0, q), 0)
                targets["self_attn.k_proj.bias"] = (layer.qkv_bias, (q, q + kv), 0)
                targets["self_attn.v_proj.bias"] = (layer.qkv_bias, (q + kv, q + 2 * kv), 0)
            if rest not in targets:
                raise ValueError(f"unexpected weight {name!r}")
            param, rows, split = targets[rest]
            dst = param.data if rows is None else param.data[rows[0] : rows[1]]
            full = list(dst.shape)
            if split is not None:
                full[split] *= self.shard.size
            if list(w.shape) != full:
                raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(full)}")
            if split is not None:
                w = self.shard.part(w, split)
            dst.copy_(w.to(dtype=self.dtype))
        missing = self.expected_weight_names() - seen
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")

    def vocab_part(self, table: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full ``[vocab, hidden]`` table, padded with zero rows to ``vocab_rows`` (the
        table itself when the vocabulary is not split)."""
        if not self.vocab_parallel:
            return table
        part = table[self.vocab_start : self.vocab_start + self.vocab_rows]
        if part.shape[0] < self.vocab_rows:
            part = torch.cat([part, part.new_zeros(self.vocab_rows - part.shape[0], table.shape[1])])
        return part

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input ids' embedding rows (every backend's first op). Split by vocabulary, each rank looks up the
        ids in its range (zero rows for the others) and the ranks' rows are summed: exactly the full lookup."""
        if not self.vocab_parallel:
            return F.embedding(input_ids, self.embed_tokens)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_rows)
        x = F.embedding(local.clamp(0, self.vocab_rows - 1), self.embed_tokens) * inside.unsqueeze(1).to(self.dtype)
        return self.shard.all_reduce(x)

    def expected_weight_names(self) -> set[str]:
        names = {"embed_tokens.weight", "norm.weight"}
        if not self.cfg.tie_word_embeddings:
            names.add("lm_head.weight")
        per = [
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
            "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        ]
        if self.cfg.attention_bias:
            per += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        for li in range(self.cfg.num_layers):
            names.update(f"layers.{li}.{p}" for p in per)
        return names

    def init_random(self, seed: int = 0) -> None:
        """Random weights at the real size (for benchmarks): N(0, 0.02) matrices, unit norms.

        Drawn on the weights' own device, so an 8B model fills in seconds on a GPU. A tensor-parallel rank draws
        every matrix at its full size, in the same order, and keeps its part, so the weights are the same at every
        group size."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        size, rank = self.shard.size, self.shard.rank
        q, kv, i = self.q_size, self.kv_size, self.intermediate_size
        # fused matrices the group splits: (dimension, this rank's size of each fused part)
        splits = {"qkv": (0, (q, kv, kv)), "gate_up": (0, (i, i)), "o_proj": (1, (q,)), "down": (1, (i,))}
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.data.fill_(1.0) if "norm" in name else p.data.zero_()
                continue
            if name in ("embed_tokens", "lm_head") and self.vocab_parallel:
                full = torch.empty(self.cfg.vocab_size, p.shape[1], dtype=p.dtype, device=p.device)
                p.data.copy_(self.vocab_part(full.normal_(0.0, 0.02, generator=g)))
                continue
            split = splits.get(name.rsplit(".", 1)[-1])
            if split is None or size == 1:
                p.data.normal_(0.0, 0.02, generator=g)
                continue
            dim, sizes = split
            shape = list(p.shape)
            shape[dim] *= size
            full = torch.empty(shape, dtype=p.dtype, device=p.device).normal_(0.0, 0.02, generator=g)
            starts = [sum(sizes[:k]) * size + rank * n for k, n in enumerate(sizes)]
            p.data.copy_(torch.cat([full.narrow(dim, s, n) for s, n in zip(starts, sizes)], dim))

    # ---- forward -------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Run T tokens. ``kv_cache`` is ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``
        and is written in place at ``meta``'s slots. Returns hidden states ``[T, hidden]`` after the final norm."""
        return self.backend.forward(self, input_ids, positions, meta, kv_cache)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Project hidden rows to vocabulary logits: float32, or the model's dtype if not ``float32``."""
        logits = self.backend.logits(self, hidden)
        if self.vocab_parallel:  # every rank's columns, in rank order, without the padding
            logits = self.shard.all_gather_columns(logits, self.cfg.vocab_size)
        return logits.float() if float32 else logits

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear``, through the prepacked form of ``w`` where ``model_cpu.prepack`` made one."""
        if self.packed is None:
            return F.linear(x, w, b)
        return self.packed.linear(x, w, b)


class PackedLinear(Protocol):
    """Matrices of a model in another layout (``common.model_cpu.PackedMatrices``)."""

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, w, b)``, with ``w``'s packed form where it has one."""
        ...


class Backend:
    """How a ``LlamaModel`` computes, chosen once by the runner: this portable PyTorch forward (any device) and its
    logits matmul. ``common/model_cpu.py`` and ``common/model_cuda.py`` subclass it with their fast paths."""

    name: Literal["portable", "cpu", "cuda"] = "portable"

    def forward(self, model: LlamaModel, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """``LlamaModel.forward``: writes this step's K/V into ``kv_cache``, returns the final hidden states."""
        cfg = model.cfg
        x = model.embed(input_ids)
        # cos/sin in the activation dtype, as the reference applies them
        cos = model.rope_cos[positions].unsqueeze(1).to(x.dtype)
        sin = model.rope_sin[positions].unsqueeze(1).to(x.dtype)
        q_sz, kv_sz = model.q_size, model.kv_size
        nh, nkv, d = model.num_heads, model.num_kv_heads, cfg.head_dim
        t = x.shape[0]
        kv_rows = kv_cache.view(-1, nkv, d)
        eps = cfg.rms_norm_eps
        reduce = model.shard.all_reduce
        linear = model.linear
        for li, layer in enumerate(model.layers):
            h = rms_norm(x, layer.input_norm, eps)
            qkv = linear(h, layer.qkv, layer.qkv_bias)
            qk = apply_rope(qkv[:, : q_sz + kv_sz].view(t, nh + nkv, d), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, q_sz + kv_sz :].view(t, nkv, d)
            attn = paged_attention(q, k, v, kv_rows, li * meta.layer_stride, meta)
            x = x + reduce(linear(attn.reshape(t, q_sz), layer.o_proj))
            h = rms_norm(x, layer.post_norm, eps)
            g, u = linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + reduce(linear(F.silu(g) * u, layer.down))
        return rms_norm(x, model.norm, eps)

    def logits(self, model: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden rows → logits in the model's dtype."""
        return model.linear(hidden, model.lm_head)


PORTABLE = Backend()


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_rows: torch.Tensor, layer_offset: int,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend. Portable PyTorch path.

    q: [T, heads, d]; k, v: [T, kv_heads, d]; kv_rows: the whole cache as [-1, kv_heads, d]. Returns [T, heads, d].
    """
    k_off = layer_offset
    v_off = layer_offset + meta.kv_stride
    kv_rows.index_copy_(0, meta.slot_rows + k_off, k)
    kv_rows.index_copy_(0, meta.slot_rows + v_off, v)
    outs: list[torch.Tensor] = []
    start = 0
    for qlen, ctx, rows in zip(meta.prefill_query_lens, meta.prefill_context_lens, meta.prefill_rows):
        outs.append(prefill_attention(q, k, v, kv_rows, k_off, v_off, start, qlen, ctx, rows))
        start += qlen
    if meta.num_decode_tokens:
        outs.append(gathered_decode_attention(q[start:], kv_rows, k_off, v_off, meta))
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_rows: torch.Tensor, k_off: int, v_off: int, start: int,
    qlen: int, ctx: int, rows: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA of one prefill sequence (rows ``start : start + qlen`` of q/k/v), over its own K/V or, with ``rows``,
    over its whole context read from the cache. Returns [qlen, heads, d]."""
    qs = q[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
    if rows is None:
        # no cached prefix: the chunk's own K/V are the whole context
        ks = k[start : start + qlen].transpose(0, 1).unsqueeze(0)
        vs = v[start : start + qlen].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    else:
        ks = kv_rows.index_select(0, rows + k_off).transpose(0, 1).unsqueeze(0)
        vs = kv_rows.index_select(0, rows + v_off).transpose(0, 1).unsqueeze(0)
        qpos = torch.arange(ctx - qlen, ctx, device=q.device).unsqueeze(1)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def gathered_decode_attention(
    q: torch.Tensor, kv_rows: torch.Tensor, k_off: int, v_off: int, meta: AttentionMetadata
) -> torch.Tensor:
    """Decode attention over each sequence's K/V gathered into a padded copy (``meta.decode_rows``, masked by
    ``meta.decode_mask``). q: [B, heads, d]; returns [B, heads, d]."""
    assert meta.decode_rows is not None and meta.decode_mask is not None
    heads, d = q.shape[1], q.shape[2]
    kvh = kv_rows.shape[1]
    b = meta.num_decode_tokens
    width = meta.decode_rows.shape[1]
    qd = q.reshape(b, kvh, heads // kvh, d)  # a KV head's query heads act as its query rows
    kd = kv_rows.index_select(0, (meta.decode_rows + k_off).view(-1)).view(b, width, kvh, d).transpose(1, 2)
    vd = kv_rows.index_select(0, (meta.decode_rows + v_off).view(-1)).view(b, width, kvh, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
    return o.reshape(b, heads, d)
