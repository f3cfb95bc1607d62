"""CUDA graphs for decode steps, and for steps that carry prompt chunks beside them.

A step of B rows runs as the replay of a graph captured for the smallest captured size ≥ B; the rows past B are
padding (context length 0, KV slot −1: the kernels skip them). A row is one token: each decode, and each token of a
prompt chunk when the step's chunks total at most ``engine.cuda_graph_prefill_tokens`` (by default the whole step
budget, so every step the scheduler forms replays a graph). The decodes' attention is the paged decode kernel; the
prompt tokens' is the paged prompt kernel, over tiles of up to :func:`prompt_tile_rows` consecutive positions of
one sequence (their K/V are written to the pool before attention in the same layer, so the tiles attend causally
over the pool). Decode-only steps replay graphs without the prompt kernel.

Inputs go through persistent buffers: the step's token ids, positions, KV slots, context lengths, block tables and
prompt tiles are written into one pinned host buffer (:class:`DecodeStaging`, plain CPU code, tested on CPU) and
copied to the device buffer the graphs read with one asynchronous copy; the step's only host synchronization is
the sampler reading the tokens.

The graphs replay ``LlamaModel.forward`` on its CUDA fast path (``common/triton_ops.py``) plus the logits matmul.
In a tensor-parallel group every rank captures the same sizes (their NCCL all-reduces inside the graphs); rank 0
sends the others its staged rows (``DecodeStaging.rows``) and each replays the same graph (``follow``); only rank
0's graphs compute logits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.model import AttentionMetadata, LlamaModel
from common.sampler import record
from common.scheduler import ScheduledSeq
from common.sequence import FED

if TYPE_CHECKING:
    from common.model_runner import ReceivedIds, TokenFeed

log = logging.getLogger(__name__)

_IDS, _POS, _SLOT, _CTX, _TAB, _SEL, _TILE0, _TILEN = range(8)
_FIELDS = 8

# Rows of the prompt kernel's dot per (tile, KV head): a tile's tokens × the query heads of one KV head
PROMPT_TILE_M = 64


def prompt_tile_rows(group: int) -> int:
    """Prompt tokens per tile of the paged prompt kernel, for ``group`` query heads per KV head."""
    return max(1, PROMPT_TILE_M // group)


def prompt_tile_bound(rows: int, tile_rows: int, max_chunks: int) -> int:
    """The most tiles a step of ``rows`` rows can have: a chunk of n tokens takes ⌈n / tile_rows⌉ tiles."""
    return min(rows, -(-rows // tile_rows) + max_chunks)


def decode_num_splits(batch: int, kv_heads: int, sms: int, head_dim: int = 128, max_splits: int = 16) -> int:
    """Splits of each sequence's context (flash-decoding): one program per (sequence, KV head, split), at least
    ``256 // head_dim`` programs per multiprocessor (2 at head dim 128, 4 at 64), at most ``max_splits``. A
    program's walk over its context waits on the memory at every block (its block-table entries, then K and V), so
    the chip reads at its bandwidth only with enough bytes in flight, and a program reads ``head_dim`` elements a
    token. On an H200, 64 rows × 1,100 tokens, one launch in a CUDA graph: SmolLM2's heads (3 KV, d 64) 33.7 µs
    unsplit, 21.4 µs in 3 splits; the 1B shape's (8 KV, d 64) 43.8 and 42.9 µs in 2; Llama-3.1-8B's (8 KV, d 128)
    72.5 µs unsplit and 81.0 µs in 2 (``python -m loadgen.bench_gpu --sections kernels``, docs/benchmarks.md). The
    splits are fixed per captured batch size, whatever the contexts."""
    per_sm = max(1, 256 // head_dim)
    return max(1, min(max_splits, -(-per_sm * sms // (batch * kv_heads))))


def graph_batch_sizes(max_num_seqs: int, prompt_rows: int = 0, max_rows: int | None = None) -> list[int]:
    """Captured row counts: 1, 2, 4, 8, then every 8 up to ``max_num_seqs`` (always included); with
    ``prompt_rows``, beyond it every 32 up to 512 rows, every 64 up to 1,024, then every 128, up to
    ``max_num_seqs + prompt_rows`` capped at ``max_rows`` (a step's token budget; the top is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 8)) + [max_num_seqs]
    top = max_num_seqs + prompt_rows
    if max_rows is not None:
        top = max(max_num_seqs, min(top, max_rows))
    b = max_num_seqs
    while b < top:
        b = (b // (step := 32 if b < 512 else 64 if b < 1024 else 128) + 1) * step
        sizes.append(min(b, top))
    return sorted(set(sizes))


def sample_rows(decodes: Sequence[ScheduledSeq], prefills: Sequence[ScheduledSeq]) -> list[int]:
    """The staged rows whose logits a step samples, in the engine's order: the last token of each prompt chunk that
    ends its prompt (staged after the decodes), then the decodes."""
    out, end = [], len(decodes)
    for item in prefills:
        end += item.num_tokens
        if item.samples:
            out.append(end - 1)
    return out + list(range(len(decodes)))


def padded_size(sizes: Sequence[int], batch: int) -> int | None:
    """The smallest captured size that holds ``batch`` rows, or None."""
    for s in sizes:
        if s >= batch:
            return s
    return None


class DecodeStaging:
    """Host side of the persistent step inputs: one int32 buffer ``[8 · max_batch + max_tables · width]``: per row
    its token id, position, layer-0 K row of the new token, decode context length (0 for prompt rows and padding)
    and block-table index; the rows whose logits the step samples (in the engine's order); the prompt tiles (first
    row, row count: up to ``tile_rows`` consecutive rows of one chunk); then the block-table rows, one per sequence
    (a prompt chunk's rows share their sequence's table)."""

    def __init__(self, max_batch: int, width: int, block_size: int, num_layers: int, pin: bool,
                 max_tables: int | None = None, tile_rows: int = 16) -> None:
        self.max_batch, self.width, self.block_size = max_batch, width, block_size
        self.tile_rows = tile_rows
        self.max_tables = max_tables or max_batch
        self.per_block = num_layers * 2 * block_size
        self.head_len = _FIELDS * max_batch
        self.host = torch.zeros(self.head_len + self.max_tables * width, dtype=torch.int32, pin_memory=pin)
        self._np = self.host.numpy()
        self.head = self._np[: self.head_len].reshape(_FIELDS, max_batch)
        self.tables = self._np[self.head_len :].reshape(self.max_tables, width)
        self._row_lists: list[list[int] | None] = [None] * self.max_tables  # the block_ids list each table holds
        self._row_lens = [0] * self.max_tables
        self.num_tables = 0  # tables the last step used
        self.num_sampled = 0  # rows whose logits the last step samples
        self.num_tiles = 0  # prompt tiles of the last step

    def fits(self, decodes: Sequence[ScheduledSeq], prefills: Sequence[ScheduledSeq] = ()) -> bool:
        rows = len(decodes) + sum(p.num_tokens for p in prefills)
        return (rows <= self.max_batch and len(decodes) + len(prefills) <= self.max_tables
                and all(len(d.seq.block_ids) <= self.width for d in (*decodes, *prefills)))

    def fill(self, decodes: Sequence[ScheduledSeq], padded: int, prefills: Sequence[ScheduledSeq] = ()) -> int:
        """Write the step's rows (the decodes, then each prompt chunk's tokens) and padding up to ``padded`` rows;
        returns how many int32 to copy (the head, then the tables the step uses).

        A block table is rewritten only where it changed: a sequence's ``block_ids`` list only grows by ``append``
        (the block manager replaces the whole list when it frees or re-matches one), so a table that still holds
        the same list object only needs the entries appended since the last step. Decodes take the first tables,
        so theirs stay put while prompts come and go behind them."""
        bs, per_block = self.block_size, self.per_block
        tables, row_lists, row_lens = self.tables, self._row_lists, self._row_lens
        nd = len(decodes)
        ids, pos, slot, ctx = [0] * nd, [0] * nd, [0] * nd, [0] * nd

        def table(i: int, bl: list[int]) -> None:
            n = len(bl)
            if row_lists[i] is bl:
                if n > row_lens[i]:
                    tables[i, row_lens[i] : n] = bl[row_lens[i] : n]
            else:
                tables[i, :n] = bl
                row_lists[i] = bl
            row_lens[i] = n

        for i, d in enumerate(decodes):
            s = d.seq
            c = s.num_computed_tokens
            bl = s.block_ids
            ids[i] = s.input_token(c)
            pos[i] = c
            slot[i] = bl[c // bs] * per_block + c % bs
            ctx[i] = c + 1
            table(i, bl)
        head = self.head
        head[_IDS, :nd] = ids
        head[_POS, :nd] = pos
        head[_SLOT, :nd] = slot
        head[_CTX, :nd] = ctx
        head[_TAB, :nd] = np.arange(nd)
        i = t = nd
        tq = self.tile_rows
        tile0, tilen = [], []
        for item in prefills:  # a chunk's rows as whole slices (a step carries up to thousands of prompt tokens)
            s = item.seq
            c, n = s.num_computed_tokens, item.num_tokens
            bl = s.block_ids
            table(t, bl)
            for a in range(0, n, tq):
                tile0.append(i + a)
                tilen.append(min(tq, n - a))
            p = np.arange(c, c + n)
            first = c // bs
            blocks = np.asarray(bl[first : (c + n - 1) // bs + 1], dtype=np.int64)
            head[_IDS, i : i + n] = s.tokens_range(c, c + n)
            head[_POS, i : i + n] = p
            head[_SLOT, i : i + n] = blocks[p // bs - first] * per_block + p % bs
            head[_CTX, i : i + n] = 0  # the decode kernel skips prompt rows, the prompt kernel reads the tiles
            head[_TAB, i : i + n] = t
            i += n
            t += 1
        head[_IDS, i:padded] = 0  # padding
        head[_POS, i:padded] = 0
        head[_SLOT, i:padded] = -1
        head[_CTX, i:padded] = 0
        head[_TAB, i:padded] = 0
        nt = len(tile0)
        head[_TILE0, :nt] = tile0
        head[_TILEN, :nt] = tilen
        head[_TILE0, nt:padded] = 0
        head[_TILEN, nt:padded] = 0
        sel = sample_rows(decodes, prefills)
        head[_SEL, :padded] = sel + [0] * (padded - len(sel))
        self.num_tables, self.num_sampled, self.num_tiles = t, len(sel), nt
        return self.head_len + t * self.width

    def rows(self, padded: int) -> np.ndarray:
        """The step ``fill`` staged, for another rank's staging: ``[padded, tables, w]``, the head up to ``padded``
        rows, then the first ``w`` entries of each table the step uses (``w``: the longest one's blocks)."""
        t = self.num_tables
        w = max(self._row_lens[:t], default=0)
        return np.concatenate([np.array([padded, t, w], dtype=np.int32), self.head[:, :padded].ravel(),
                               self.tables[:t, :w].ravel()])

    def load(self, rows: np.ndarray) -> tuple[int, int]:
        """Stage what ``rows`` gave; returns the padded batch size and how many int32 to copy (as ``fill``)."""
        padded, t, w = (int(x) for x in rows[:3])
        self.head[:, :padded] = rows[3 : 3 + _FIELDS * padded].reshape(_FIELDS, padded)
        self.tables[:t, :w] = rows[3 + _FIELDS * padded :].reshape(t, w)
        self.num_tiles = int(np.count_nonzero(self.head[_TILEN, :padded]))
        return padded, self.head_len + t * self.width


class CudaGraphDecoder:
    """Captures and replays decode steps (with up to ``prefill_tokens`` prompt tokens beside ``max_batch``
    decodes, and at most ``max_rows`` rows); owns the persistent device inputs and the logits outputs (without
    ``logits``, the graphs end at the hidden states: a tensor-parallel rank other than 0). Two graphs per size up to
    ``max_batch`` (decode-only, and with the prompt kernel), one per larger size (with it)."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, max_batch: int,
                 max_model_len: int, logits: bool = True, prefill_tokens: int = 0,
                 max_rows: int | None = None) -> None:
        self.model = model
        self.prefill_tokens = prefill_tokens
        self.with_logits = logits
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        width = -(-max_model_len // block_size)
        self.max_batch = max_batch
        self.sizes = graph_batch_sizes(max_batch, prefill_tokens, max_rows)
        # one block table per sequence: a step runs at most max_batch of them (the scheduler's max_num_seqs)
        self.staging = DecodeStaging(self.sizes[-1], width, block_size, model.cfg.num_layers, pin=True,
                                     max_tables=max_batch,
                                     tile_rows=prompt_tile_rows(model.num_heads // model.num_kv_heads))
        self.dev = torch.zeros(self.staging.host.numel(), dtype=torch.int32, device=self.device)
        self._copied = torch.cuda.Event()
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (rows, with prompt tiles)
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        self.replays = 0
        self.prompt_replays = 0  # replays of steps that carried prompt tokens
        self.capture_seconds = 0.0

    def _inputs(self, b: int, prompts: bool) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        st = self.staging
        head = self.dev[: st.head_len].view(_FIELDS, st.max_batch)
        tables = self.dev[st.head_len :].view(st.max_tables, st.width)
        bs = st.block_size
        tiles = head[_TILE0 : _TILEN + 1, : prompt_tile_bound(b, st.tile_rows, st.max_tables)] if prompts else None
        meta = AttentionMetadata(
            slot_rows=head[_SLOT, :b], prefill_query_lens=[], prefill_context_lens=[], prefill_rows=[],
            num_decode_tokens=b, decode_rows=None, decode_mask=None, layer_stride=2 * bs, kv_stride=bs,
            decode_block_tables=tables, decode_context_lens=head[_CTX, :b], decode_table_rows=head[_TAB, :b],
            prompt_tiles=tiles, positions=head[_POS, :b],
        )
        return head[_IDS, :b], head[_POS, :b], meta

    def _run(self, b: int, prompts: bool) -> torch.Tensor:
        """The forward of ``b`` rows; with logits, those of the staged sampled rows only (at most one a sequence:
        ``max_tables``), so prompt rows cost no LM head."""
        ids, pos, meta = self._inputs(b, prompts)
        hidden = self.model(ids, pos, meta, self.kv_cache)
        if not self.with_logits:
            return hidden
        st = self.staging
        sel = self.dev[_SEL * st.max_batch : _SEL * st.max_batch + min(b, st.max_tables)]
        return self.model.compute_logits(hidden.index_select(0, sel))

    def keys(self) -> list[tuple[int, bool]]:
        """The graphs to capture, largest first: (rows, with prompt tiles)."""
        out = [(b, True) for b in self.sizes] if self.prefill_tokens else []
        out += [(b, False) for b in self.sizes if b <= self.max_batch]
        return sorted(out, reverse=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph of :meth:`keys` (largest first, sharing one memory pool). Inputs are all padding."""
        t0 = time.perf_counter()
        self.staging.fill([], self.staging.max_batch)
        self.dev.copy_(self.staging.host)
        pool = None
        side = torch.cuda.Stream(self.device)
        keys = self.keys()
        for key in keys:
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile the kernels, create the cuBLAS handles
                    self._run(*key)
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.logits[key] = self._run(*key)
            pool = g.pool()
            self.graphs[key] = g
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d graphs (rows %s) in %.1f s", len(keys), self.sizes, self.capture_seconds)

    def can_run(self, decodes: Sequence[ScheduledSeq], prefills: Sequence[ScheduledSeq] = ()) -> bool:
        """Whether a graph holds this step: its prompt chunks total at most ``prefill_tokens`` tokens, and its rows
        and block lists fit the captured sizes."""
        if prefills and sum(p.num_tokens for p in prefills) > self.prefill_tokens:
            return False
        return (len(decodes) > 0 or len(prefills) > 0) and self.staging.fits(decodes, prefills)

    def run(self, decodes: Sequence[ScheduledSeq], send: Callable[[np.ndarray], None] | None = None,
            prefills: Sequence[ScheduledSeq] = (), feed: TokenFeed | None = None) -> torch.Tensor | None:
        """Replay for these rows; returns float32 logits ``[sampled rows, vocab]`` on the device, in the engine's
        order (the prompts that end this step, then the decodes): a view of the graph's output, valid until the
        next replay; None when no row samples. ``send``: hands the staged rows to the other ranks first. ``feed``:
        decodes whose input id is on the device, written into the staged ids before the replay."""
        return self.replay_staged(self.stage(decodes, send, prefills), feed)

    def stage(self, decodes: Sequence[ScheduledSeq], send: Callable[[np.ndarray], None] | None = None,
              prefills: Sequence[ScheduledSeq] = ()) -> tuple[int, int, bool]:
        """The host's part of :meth:`run`: the rows written into the pinned staging buffer (and sent to the other
        ranks). Returns what :meth:`replay_staged` takes; nothing is queued on the device."""
        b = len(decodes) + sum(p.num_tokens for p in prefills)
        padded = padded_size(self.sizes, b)
        assert padded is not None
        self._copied.synchronize()  # the previous step's copy has read the pinned buffer
        n = self.staging.fill(decodes, padded, prefills)
        if send is not None:
            send(self.staging.rows(padded))
        return padded, n, bool(prefills)

    def replay_staged(self, staged: tuple[int, int, bool], feed: TokenFeed | None = None) -> torch.Tensor | None:
        """The device's part of :meth:`run`, for rows :meth:`stage` wrote: the copy up, the feed, the replay."""
        padded, n, prompts = staged
        logits = self._replay(padded, n, feed)
        if prompts:
            self.prompt_replays += 1
        k = self.staging.num_sampled
        return logits[:k] if k else None

    def follow(self, rows: np.ndarray, received: Callable[[Iterable[int]], ReceivedIds] | None = None) -> None:
        """A rank other than 0: replay the graph rank 0 replays, on the rows it sent (``DecodeStaging.rows``); rows
        whose id rank 0 feeds from its device (``FED``) get it through ``received`` (``ModelRunner._received``)."""
        self._copied.synchronize()
        padded, n = self.staging.load(rows)
        fed = np.flatnonzero(self.staging.head[_IDS, :padded] == FED)
        self._replay(padded, n, received(fed) if received is not None and len(fed) else None)

    def _replay(self, padded: int, n: int, feed: TokenFeed | ReceivedIds | None = None) -> torch.Tensor:
        key = (padded, self.staging.num_tiles > 0)
        self.dev[:n].copy_(self.staging.host[:n], non_blocking=True)
        record(self._copied)
        if feed is not None:  # decodes are the first rows
            mb = self.staging.max_batch
            feed.apply(self.dev[_IDS * mb : _IDS * mb + padded], 0)
        self.graphs[key].replay()
        self.replays += 1
        return self.logits[key]
