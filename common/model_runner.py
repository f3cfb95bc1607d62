"""Turns a scheduler step into tensors, runs the model, and returns the logits of the rows that sample.

Owns the model weights and the KV pool: one preallocated tensor
``[num_blocks, num_layers, 2 (k/v), block_size, kv_heads, head_dim]``. The layout is block-major so one block of
every layer is one contiguous region: a KV transfer moves a block with a single descriptor.

A step goes scheduler output → ``StepPlan`` (host integers) → ``StepInputs`` (tensors) → forward. In a
tensor-parallel group (``common/tensor_parallel.py``) each rank has a runner over its shard, whose pool holds its
``kv_heads / N`` heads: rank 0's sends every plan (or its CUDA graph's staged rows) to the others before its own
forward, and theirs run it in ``follow``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from common import cpu_kernels
from common.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, ModelConfig
from common.cuda_graphs import CudaGraphDecoder
from common.loader import ModelSource
from common.model import PORTABLE, AttentionMetadata, LlamaModel, cache_rows
from common.model_cpu import FusedCpu, prefill_kernel_fits, prepack
from common.scheduler import SchedulerOutput
from common.sequence import FED
from common.tensor_parallel import SINGLE, Op, Shard, rank_device, send_step

log = logging.getLogger(__name__)

KV_LAYOUT = "block-major:[blocks,layers,kv,block_size,kv_heads,head_dim]"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(slots=True)
class StepPlan:
    """A step's model inputs as host integers, before any tensor is made: what rank 0 of a tensor-parallel group
    sends the other ranks (``pack`` / ``unpack``), so that every rank builds the same inputs."""

    ids: list[int]
    positions: list[int]
    slots: list[int]  # layer-0 K row of each token's KV
    prefill_lens: list[int]
    prefill_context_lens: list[int]  # tokens in the cache after this step (prefix + chunk)
    prefill_tables: list[list[int] | None]  # the blocks of a context with a cached prefix; None: no prefix
    decode_context_lens: list[int]
    decode_tables: list[list[int]]  # block ids, padded with block 0 to the longest
    sample_indices: list[int]  # row of each sampling sequence in the flat batch

    def pack(self) -> list[int]:
        """``[T, P, B, W, S]``, then ids, positions, slots, prefill lengths, context lengths, each prefill table's
        length (-1: None), their blocks, decode context lengths, decode tables (B × W), sample rows."""
        out = [len(self.ids), len(self.prefill_lens), len(self.decode_context_lens),
               len(self.decode_tables[0]) if self.decode_tables else 0, len(self.sample_indices)]
        out += self.ids + self.positions + self.slots + self.prefill_lens + self.prefill_context_lens
        out += [-1 if t is None else len(t) for t in self.prefill_tables]
        for t in self.prefill_tables:
            out += t or []
        out += self.decode_context_lens
        for t in self.decode_tables:
            out += t
        return out + self.sample_indices

    @classmethod
    def unpack(cls, words: list[int]) -> StepPlan:
        """The plan ``pack`` gave."""
        t, p, b, w, s = words[:5]
        at = 5

        def take(n: int) -> list[int]:
            nonlocal at
            at += n
            return words[at - n : at]

        ids, positions, slots, q_lens, ctx_lens, table_lens = take(t), take(t), take(t), take(p), take(p), take(p)
        tables = [None if n < 0 else take(n) for n in table_lens]
        dec_ctx = take(b)
        dec_tables = [take(w) for _ in range(b)]
        return cls(ids, positions, slots, q_lens, ctx_lens, tables, dec_ctx, dec_tables, take(s))


@dataclass(slots=True)
class TokenFeed:
    """Input ids that are still on the device (async scheduling): a decode whose token the previous step sampled
    reads it from that step's picks. ``index`` [2, k] int64 on the device: decode row i (counted among the step's
    decodes) takes ``tokens[j]``. In a tensor-parallel group (``shard``, rank 0's) the fed ids also go to the
    other ranks (``ReceivedIds``), which find the same rows by their ``FED`` placeholder in the step they were sent."""

    tokens: torch.Tensor
    index: torch.Tensor
    shard: Shard = SINGLE

    def apply(self, ids: torch.Tensor, first_decode: int) -> None:
        """Write the fed ids into ``ids`` (the step's flat input ids, its decodes from row ``first_decode``)."""
        rows = self.index[0] + first_decode if first_decode else self.index[0]
        fed = self.tokens.index_select(0, self.index[1])
        self.shard.broadcast_from_0(fed)
        ids.index_copy_(0, rows, fed.to(ids.dtype))


@dataclass(slots=True)
class ReceivedIds:
    """A tensor-parallel rank other than 0, with async scheduling: the rows of a step whose input id is on rank 0's
    device (``rows`` [k] int64 on this rank's device, in order); ``apply`` receives those ids from rank 0's
    ``TokenFeed.apply`` and writes them, as rank 0 does."""

    shard: Shard
    rows: torch.Tensor

    def apply(self, ids: torch.Tensor, first_decode: int = 0) -> None:
        got = torch.empty(self.rows.numel(), dtype=torch.int64, device=ids.device)
        self.shard.broadcast_from_0(got)
        ids.index_copy_(0, self.rows, got.to(ids.dtype))


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_indices: list[int]  # row of each sampling sequence in the flat batch


def use_fast_path(device: torch.device, cfg: EngineConfig) -> bool:
    """The CUDA fast path (Triton kernels, CUDA graphs) runs on CUDA only, unless ``engine.cuda_fast_path`` is off."""
    return device.type == "cuda" and not cfg.noop_model and cfg.cuda_fast_path


def use_cpu_kernels(device: torch.device, dtype: torch.dtype, cfg: EngineConfig) -> bool:
    """``engine.cpu_kernels`` resolved: the C++ kernels (common/csrc) read K/V in place, faster than gather + SDPA
    where they compiled with AVX-512 (docs/performance-notes.md); the scalar build is slower, so unset (None) means
    on only there, True on wherever they compiled, False off. CPU only, bfloat16 and float32."""
    if device.type != "cpu" or cfg.noop_model or dtype == torch.float16 or cfg.cpu_kernels is False:
        return False
    return cpu_kernels.available() if cfg.cpu_kernels else cpu_kernels.vectorized()


def kv_cache_budget(total: int, free: int, utilization: float, own: int, peak: int, min_bytes: int = 1) -> int:
    """Bytes for the KV cache of a worker on a GPU of ``total`` bytes (``free`` now): its share
    ``total × utilization`` less its own ``own`` (weights) and activation ``peak``. Raises RuntimeError, with the
    numbers, when the share holds less than ``min_bytes`` of KV or the card has not that much free now."""
    gib = 2**30
    share = int(total * utilization)
    budget = share - own - peak
    if budget < min_bytes:
        raise RuntimeError(
            f"no memory left for the KV cache: this worker's share of the GPU ({utilization:g} × "
            f"{total / gib:.1f} GiB = {share / gib:.2f} GiB) holds only its weights ({own / gib:.2f} GiB) and a "
            f"{peak / gib:.2f} GiB activation peak; raise engine.gpu_memory_utilization or give the worker a GPU of "
            f"its own")
    if free < budget + peak:
        raise RuntimeError(
            f"the GPU has {free / gib:.2f} GiB free, but this worker's share needs {(budget + peak) / gib:.2f} GiB "
            f"of it (a {budget / gib:.2f} GiB KV cache + a {peak / gib:.2f} GiB activation peak; share "
            f"{utilization:g} × {total / gib:.1f} GiB, weights {own / gib:.2f} GiB): another process holds the "
            f"rest; lower engine.gpu_memory_utilization or free the card")
    return budget


class ModelRunner:
    """Loads weights onto the device, sizes and allocates the KV pool, and executes steps."""

    def __init__(self, source: ModelSource, cfg: EngineConfig, model: LlamaModel | None = None,
                 shard: Shard = SINGLE) -> None:
        """``shard``: this process's rank of a tensor-parallel group (every rank builds its runner at the same
        time: loading, the KV pool's size and the CUDA graphs' capture are agreed or run in step)."""
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch sees no CUDA device; use --device cpu")
        self.cfg = cfg
        self.model_cfg: ModelConfig = source.config
        self.shard = shard
        self._uploads: Any = None  # a rank other than 0: PinnedUploads for the rows rank 0 feeds (``_received``)
        self.device = torch.device(cfg.device) if shard.size == 1 else rank_device(cfg.device, shard.rank)
        self.dtype = torch_dtype(cfg.dtype)
        t0 = time.perf_counter()
        if model is not None:
            if model.dtype != self.dtype or model.device != self.device or model.cfg != self.model_cfg:
                raise ValueError("a shared model must have this engine's config, dtype and device")
            if model.shard.size != shard.size or model.vocab_parallel != (cfg.tp_vocab_parallel and shard.size > 1):
                raise ValueError("a shared model must be of this engine's tensor-parallel size and vocabulary split")
            self.model = model
        else:
            self.model = LlamaModel(self.model_cfg, self.dtype, self.device if not cfg.noop_model else "meta", shard,
                                    vocab_parallel=cfg.tp_vocab_parallel)
            if cfg.noop_model:
                log.warning("noop_model: no weights loaded, outputs are meaningless (control-plane benchmarks only)")
            elif source.weights is None:
                self.model.init_random(cfg.seed)
            else:
                self.model.load_weights(source.weights())
        shard.barrier()  # every rank has its weights
        # The backend, decided here once (engine.cpu_kernels, engine.cuda_fast_path, engine.cuda_graphs)
        self.use_cpu_kernel = use_cpu_kernels(self.device, self.dtype, cfg)
        self.fast_cuda = use_fast_path(self.device, cfg)
        if model is None:  # a model handed in is used as it is
            prepack(self.model, small_batch=self.use_cpu_kernel)
        if self.fast_cuda:
            # Triton: imported only where the CUDA path runs, so a CPU-only install never needs it
            from common.model_cuda import CUDA_FAST

            self.model.backend = CUDA_FAST
        elif self.use_cpu_kernel:  # the forward's fused C++ stages (add + RMSNorm, RoPE + KV write, SiLU·mul)
            self.model.backend = FusedCpu(prefill_kernel_fits(self.model))
        else:
            self.model.backend = PORTABLE
        self.load_seconds = time.perf_counter() - t0
        self.block_size = cfg.block_size
        self.num_blocks = shard.min_over_ranks(self._num_blocks())  # one block table serves every rank's pool
        m = self.model_cfg
        shape_layers = 1 if cfg.noop_model else m.num_layers
        self.kv_cache = torch.zeros(
            (self.num_blocks, shape_layers, 2, cfg.block_size, self.model.num_kv_heads,
             1 if cfg.noop_model else m.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.graphs: CudaGraphDecoder | None = None
        if self.fast_cuda and cfg.cuda_graphs:
            # the other ranks' graphs stop at the hidden states (only rank 0 needs logits), unless the vocabulary
            # is split: then each rank computes its columns and the graph gathers them
            self.graphs = CudaGraphDecoder(self.model, self.kv_cache, cfg.block_size, cfg.max_num_seqs,
                                           cfg.max_model_len or m.max_position_embeddings,
                                           logits=shard.rank == 0 or self.model.vocab_parallel,
                                           prefill_tokens=cfg.cuda_graph_prefill_tokens,
                                           max_rows=cfg.max_num_batched_tokens)
            self.graphs.capture()

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of this rank's pool (its KV heads)."""
        m = self.model_cfg
        return 2 * m.num_layers * self.block_size * self.model.num_kv_heads * m.head_dim * self.dtype.itemsize

    def _num_blocks(self) -> int:
        if self.cfg.num_gpu_blocks_override:
            return self.cfg.num_gpu_blocks_override
        if self.cfg.noop_model:
            return 4096  # bookkeeping only: the pool is a placeholder
        if self.cfg.kv_cache_memory is not None:
            return max(1, self.cfg.kv_cache_memory // self.bytes_per_block)
        if self.device.type == "cpu":
            return max(1, DEFAULT_CPU_KV_CACHE_BYTES // self.bytes_per_block)
        # CUDA: this worker's share of its GPU less its own weights and activation peak; other processes on the
        # card (a worker sharing it on purpose) budget their own shares
        peak = self._profile_activation_peak()
        if self.fast_cuda and self.cfg.cuda_graphs and self.cfg.cuda_graph_prefill_tokens:
            peak *= 2  # the graphs' private pool holds a forward of up to the step budget's rows as well
        free, total = torch.cuda.mem_get_info(self.device)
        budget = kv_cache_budget(total, free, self.cfg.gpu_memory_utilization,
                                 torch.cuda.memory_allocated(self.device), peak, self.bytes_per_block)
        return budget // self.bytes_per_block

    def _profile_activation_peak(self) -> int:
        """Run one forward of ``max_num_batched_tokens`` tokens on a scratch cache and return its peak."""
        m = self.model_cfg
        n = min(self.cfg.max_num_batched_tokens, m.max_position_embeddings)
        blocks = -(-n // self.block_size)
        scratch = torch.zeros((blocks, m.num_layers, 2, self.block_size, self.model.num_kv_heads, m.head_dim),
                              dtype=self.dtype, device=self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        rows = cache_rows(torch.arange(blocks, device=self.device), self.block_size, m.num_layers)[:n]
        meta = AttentionMetadata(
            slot_rows=rows, prefill_query_lens=[n], prefill_context_lens=[n], prefill_rows=[None],
            num_decode_tokens=0, decode_rows=None, decode_mask=None,
            layer_stride=2 * self.block_size, kv_stride=self.block_size,
        )
        with torch.inference_mode():
            h = self.model(ids, pos, meta, scratch)
            self.model.compute_logits(h[-self.cfg.max_num_seqs :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del scratch, h
        torch.cuda.empty_cache()
        return peak

    # -- a step ----------------------------------------------------------------------------------------
    def plan(self, out: SchedulerOutput) -> StepPlan:
        """The step's inputs as host integers: prefill chunks first, then one token per decode."""
        bs = self.block_size
        per_block = self.model_cfg.num_layers * 2 * bs
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        tables: list[list[int] | None] = []
        sample_idx: list[int] = []
        for item in out.prefills:
            s, n = item.seq, item.num_tokens
            c = s.num_computed_tokens
            ids.extend(s.tokens_range(c, c + n))
            rng = range(c, c + n)
            pos.extend(rng)
            slots.extend(s.block_ids[p // bs] * per_block + p % bs for p in rng)
            q_lens.append(n)
            ctx_lens.append(c + n)
            tables.append(None if c == 0 else s.block_ids[: -(-(c + n) // bs)])
            if item.samples:
                sample_idx.append(len(ids) - 1)
        dec_ctx: list[int] = []
        dec_tables: list[list[int]] = []
        if out.decodes:
            width = max(len(d.seq.block_ids) for d in out.decodes)
            for d in out.decodes:
                s = d.seq
                c = s.num_computed_tokens
                ids.append(s.input_token(c))
                pos.append(c)
                slots.append(s.block_ids[c // bs] * per_block + c % bs)
                dec_tables.append(s.block_ids + [0] * (width - len(s.block_ids)))
                dec_ctx.append(c + 1)
                sample_idx.append(len(ids) - 1)
        return StepPlan(ids, pos, slots, q_lens, ctx_lens, tables, dec_ctx, dec_tables, sample_idx)

    def inputs(self, plan: StepPlan) -> StepInputs:
        """The plan's tensors on this runner's device, in the form its attention path reads."""
        bs = self.block_size
        dev = self.device
        layers = self.model_cfg.num_layers
        rows: list[torch.Tensor | None] = [
            None if t is None else cache_rows(torch.tensor(t, dtype=torch.long, device=dev), bs, layers)[:ctx]
            for t, ctx in zip(plan.prefill_tables, plan.prefill_context_lens)
        ]
        dec_rows = dec_mask = dec_tables = dec_ctx = None
        if plan.decode_tables:
            tables, ctx = plan.decode_tables, plan.decode_context_lens
            if self.fast_cuda:  # the Triton decode kernel reads the pool through the block tables
                dec_tables = torch.tensor(tables, dtype=torch.int32).to(dev, non_blocking=True)
                dec_ctx = torch.tensor(ctx, dtype=torch.int32).to(dev, non_blocking=True)
            else:
                table_t = torch.tensor(tables, dtype=torch.long, device=dev)
                ctx_t = torch.tensor(ctx, dtype=torch.long, device=dev)
                if self.use_cpu_kernel:
                    dec_tables, dec_ctx = table_t, ctx_t
                else:
                    width = table_t.shape[1]
                    dec_rows = cache_rows(table_t, bs, layers)
                    dec_mask = (torch.arange(width * bs, device=dev).unsqueeze(0) < ctx_t.unsqueeze(1))[:, None, None, :]
        meta = AttentionMetadata(
            slot_rows=torch.tensor(plan.slots, dtype=torch.long, device=dev),
            prefill_query_lens=plan.prefill_lens,
            prefill_context_lens=plan.prefill_context_lens,
            prefill_rows=rows,
            num_decode_tokens=len(plan.decode_context_lens),
            decode_rows=dec_rows,
            decode_mask=dec_mask,
            layer_stride=2 * bs,
            kv_stride=bs,
            decode_block_tables=dec_tables,
            decode_context_lens=dec_ctx,
        )
        return StepInputs(
            torch.tensor(plan.ids, dtype=torch.long, device=dev),
            torch.tensor(plan.positions, dtype=torch.long, device=dev),
            meta,
            plan.sample_indices,
        )

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        return self.inputs(self.plan(out))

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Float32 logits at every position of each prompt (one flat prefill on a scratch cache).

        Leaves the KV pool untouched; for prompt scoring and for checks against a reference."""
        if self.shard.size > 1:
            send_step(self.shard, Op.SCORE, [len(prompts), *map(len, prompts), *(t for p in prompts for t in p)])
        hidden = self._score_hidden(prompts)
        return list(self.model.compute_logits(hidden).cpu().split([len(p) for p in prompts]))

    def _score_hidden(self, prompts: list[list[int]]) -> torch.Tensor:
        m, bs = self.model_cfg, self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[torch.Tensor] = []
        next_block = 0
        for p in prompts:
            nb = -(-len(p) // bs)
            slots.append(cache_rows(torch.arange(next_block, next_block + nb), bs, m.num_layers)[: len(p)])
            next_block += nb
            ids += p
            pos += range(len(p))
        cache = torch.zeros((next_block, m.num_layers, 2, bs, self.model.num_kv_heads, m.head_dim), dtype=self.dtype,
                            device=self.device)
        meta = AttentionMetadata(
            slot_rows=torch.cat(slots).to(self.device),
            prefill_query_lens=[len(p) for p in prompts],
            prefill_context_lens=[len(p) for p in prompts],
            prefill_rows=[None] * len(prompts),
            num_decode_tokens=0, decode_rows=None, decode_mask=None,
            layer_stride=2 * bs, kv_stride=bs,
        )
        return self.model(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device), meta, cache)

    @torch.inference_mode()
    def stage(self, out: SchedulerOutput) -> tuple[int, int, bool] | None:
        """The host's part of a step that replays a CUDA graph (its rows staged), for :meth:`execute` to launch
        later: the engine stages a step before it waits for a deferred pick's masks. None where the step does not
        replay a graph (``execute`` then does everything)."""
        if self.cfg.noop_model or self.graphs is None or not self.graphs.can_run(out.decodes, out.prefills):
            return None
        return self.graphs.stage(out.decodes, self._send_graph_rows if self.shard.size > 1 else None, out.prefills)

    def execute(self, out: SchedulerOutput, feed: TokenFeed | None = None,
                staged: tuple[int, int, bool] | None = None) -> torch.Tensor | None:
        """Run the step; return logits ``[num_sampling_rows, vocab]`` (or None): float32 on the device with the CUDA
        fast path (the sampler then runs there); on the CPU, in the model's dtype (the sampler converts as needed).
        A decode step, or one whose prompt chunks are short (``engine.cuda_graph_prefill_tokens``), replays a CUDA
        graph. In a tensor-parallel group, rank 0 calls this; the others follow. ``feed``: decodes whose input id
        is on the device (in a group, rank 0's feed sends them to the others). ``staged``: what :meth:`stage`
        returned for ``out``."""
        if staged is not None:
            assert self.graphs is not None
            return self.graphs.replay_staged(staged, feed)
        if self.cfg.noop_model:
            # a one-entry vocabulary: every sampled token is id 0, and sampling costs nothing per vocab entry
            n = sum(1 for it in (*out.prefills, *out.decodes) if it.samples)
            return torch.zeros(n, 1) if n else None
        if self.graphs is not None and self.graphs.can_run(out.decodes, out.prefills):
            return self.graphs.run(out.decodes, self._send_graph_rows if self.shard.size > 1 else None, out.prefills,
                                   feed)
        plan = self.plan(out)
        if self.shard.size > 1:
            send_step(self.shard, Op.STEP, plan.pack())
        inp = self.inputs(plan)
        if feed is not None:
            feed.apply(inp.input_ids, len(plan.ids) - len(out.decodes))
        hidden = self.model(inp.input_ids, inp.positions, inp.meta, self.kv_cache)
        if not inp.sample_indices:
            return None
        idx = torch.tensor(inp.sample_indices, dtype=torch.long, device=self.device)
        # the sampler converts to float32 only when it needs to (a greedy batch does not): on a CPU, that copy and
        # torch's argmax were 2.5 ms of a 50 ms batch-32 step
        logits = self.model.compute_logits(hidden[idx], float32=self.device.type != "cpu")
        return logits if self.fast_cuda else logits.cpu()

    def _received(self, rows: Iterable[int]) -> ReceivedIds:
        """The ids rank 0 feeds into these rows of this step (a rank other than 0): their rows, uploaded without
        waiting for the stream (a pageable copy would hold this rank's next launch until its last forward ends)."""
        if self._uploads is None:
            from common.sampler import PinnedUploads

            self._uploads = PinnedUploads(self.device)
        return ReceivedIds(self.shard, self._uploads.tensor("fed_rows", list(rows), torch.long))

    def _send_graph_rows(self, rows: object) -> None:
        send_step(self.shard, Op.GRAPH, rows)

    @torch.inference_mode()
    def follow(self, op: Op, payload: torch.Tensor) -> None:
        """A rank other than 0: run the step rank 0 sent, on this rank's shard and pool. Samples nothing, and
        computes logits only with the vocabulary split (its columns, gathered into rank 0's)."""
        if op is Op.GRAPH:
            assert self.graphs is not None, "rank 0 replays CUDA graphs but this rank captured none"
            self.graphs.follow(payload.numpy(), self._received)
        elif op is Op.SCORE:
            words = payload.tolist()
            lens, at = words[1 : 1 + words[0]], 1 + words[0]
            prompts = []
            for n in lens:
                prompts.append(words[at : at + n])
                at += n
            hidden = self._score_hidden(prompts)
            if self.model.vocab_parallel:
                self.model.compute_logits(hidden)
        elif op is Op.STEP:
            plan = StepPlan.unpack(payload.tolist())
            inp = self.inputs(plan)
            fed = [i for i, t in enumerate(plan.ids) if t == FED]
            if fed:
                self._received(fed).apply(inp.input_ids)
            hidden = self.model(inp.input_ids, inp.positions, inp.meta, self.kv_cache)
            if self.model.vocab_parallel and inp.sample_indices:  # its columns of rank 0's logits
                idx = torch.tensor(inp.sample_indices, dtype=torch.long, device=self.device)
                self.model.compute_logits(hidden[idx], float32=self.device.type != "cpu")
        else:
            raise ValueError(f"a rank cannot follow {op!r}")
