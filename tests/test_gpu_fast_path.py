"""The CUDA fast path's CPU-testable parts: dispatch, CUDA-graph batch sizes, decode input staging, split choice.

The kernels and graphs themselves need a GPU: tests/gpu (``make test-gpu``) checks every Triton kernel against
float64 / portable references on random data, and SmolLM2 through the fast path (CUDA graphs) greedy-equal to
transformers. The last test here runs the same kernels on CPU through Triton's interpreter (Triton is a dev
dependency).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

from common.config import EngineConfig
from common.cuda_graphs import (
    DecodeStaging,
    decode_num_splits,
    graph_batch_sizes,
    padded_size,
    prompt_tile_bound,
    prompt_tile_rows,
    sample_rows,
)
from common.model_runner import use_fast_path
from common.scheduler import ScheduledSeq


def test_fast_path_only_on_cuda():
    assert not use_fast_path(torch.device("cpu"), EngineConfig())
    assert use_fast_path(torch.device("cuda"), EngineConfig())
    assert not use_fast_path(torch.device("cuda"), EngineConfig(noop_model=True))
    assert not use_fast_path(torch.device("cuda"), EngineConfig(cuda_fast_path=False))


def test_cpu_runner_keeps_the_portable_path(make_engine):
    eng = make_engine()
    assert not eng.runner.fast_cuda and eng.runner.graphs is None and eng.runner.model.backend.name != "cuda"


def test_graph_batch_sizes_and_padding():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(20)
    assert sizes[-1] == 20
    assert [padded_size(sizes, b) for b in (1, 3, 8, 9, 17, 20)] == [1, 4, 8, 16, 20, 20]
    assert padded_size(sizes, 21) is None
    assert graph_batch_sizes(64, 512)[10:] == [64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448, 480,
                                                512, 576]
    assert graph_batch_sizes(8, 40) == [1, 2, 4, 8, 32, 48]
    # the default: every step of a 2,048-token budget, coarser with size (from 256 rows on, padding ≤ 1/8 of a step)
    sizes = graph_batch_sizes(64, 2048, max_rows=2048)
    assert sizes[-1] == 2048 and len(sizes) == 41
    assert [b for b in sizes if b > 1024] == [1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048]
    assert all((b - a) * 8 <= a for a, b in itertools.pairwise(sizes) if a >= 256)
    assert graph_batch_sizes(64, 0, max_rows=2048)[-1] == 64 and graph_batch_sizes(64, 100, max_rows=32)[-1] == 64


def test_decode_num_splits_keeps_enough_bytes_in_flight():
    # head dim 128 (Llama-3.1-8B): 2 programs per SM
    assert decode_num_splits(64, 8, 132, 128) == 1  # 512 programs already
    assert decode_num_splits(32, 8, 132, 128) == 2
    assert decode_num_splits(4, 8, 132, 128) == 9  # ceil(264 / 32)
    assert decode_num_splits(1, 8, 132, 128) == 16  # capped
    # head dim 64 (SmolLM2, Llama-3.2-1B): 4 per SM
    assert decode_num_splits(128, 8, 132, 64) == 1
    assert decode_num_splits(64, 8, 132, 64) == 2  # ceil(528 / 512)
    assert decode_num_splits(64, 3, 132, 64) == 3  # SmolLM2's 3 KV heads: ceil(528 / 192)
    assert decode_num_splits(32, 3, 132, 64) == 6
    assert decode_num_splits(1, 3, 132, 64, max_splits=1000) == 176
    assert decode_num_splits(1, 3, 132, 512, max_splits=1000) == 44  # at least one program per SM


def _decode(seq_id: int, tokens: list[int], computed: int, blocks: list[int]) -> ScheduledSeq:
    seq = SimpleNamespace(num_computed_tokens=computed, input_token=lambda i: tokens[i], block_ids=blocks, id=seq_id)
    return ScheduledSeq(seq, 1)  # type: ignore[arg-type]


def test_decode_staging_rows_and_padding():
    bs, layers = 4, 3
    st = DecodeStaging(max_batch=4, width=5, block_size=bs, num_layers=layers, pin=False)
    decodes = [_decode(0, list(range(100, 110)), 9, [7, 3, 9]), _decode(1, [5, 6], 1, [2])]
    n = st.fill(decodes, padded=4)
    assert n == 8 * 4 + 2 * 5  # the head, then the two tables in use (padding rows read none)
    ids, pos, slot, ctx, tab, sel, _tile0, tilen = (st.head[i].tolist() for i in range(8))
    assert tilen == [0] * 4 and st.num_tiles == 0
    assert ids == [109, 6, 0, 0] and pos == [9, 1, 0, 0] and ctx == [10, 2, 0, 0] and tab == [0, 1, 0, 0]
    assert sel[:2] == [0, 1] and st.num_sampled == 2
    per_block = layers * 2 * bs
    assert slot[:2] == [9 * per_block + 1, 2 * per_block + 1]  # position 9 → block index 2 (id 9), offset 1
    assert slot[2:] == [-1, -1]  # padding rows write nothing
    assert st.tables[0, :3].tolist() == [7, 3, 9] and st.tables[1, :1].tolist() == [2]
    flat = st.host[:n]
    assert flat[:32].view(8, 4)[3].tolist() == [10, 2, 0, 0] and flat[32:35].tolist() == [7, 3, 9]
    # a smaller step afterwards re-pads the rows it no longer uses
    st.fill(decodes[1:], padded=2)
    assert st.head[3].tolist()[:2] == [2, 0] and st.head[2].tolist()[:2] == [2 * per_block + 1, -1]
    assert st.fits(decodes) and not st.fits([_decode(2, [1], 0, list(range(6)))])


def _chunk(tokens: list[int], computed: int, n: int, blocks: list[int]) -> ScheduledSeq:
    seq = SimpleNamespace(num_computed_tokens=computed, num_tokens=len(tokens), block_ids=blocks, pending=0,
                          tokens_range=lambda a, b: tokens[a:b])
    return ScheduledSeq(seq, n)  # type: ignore[arg-type]


def test_prompt_chunks_stage_as_rows_in_tiles_after_the_decodes():
    """Each prompt token is a row at its own position, with decode context 0 (the decode kernel skips it); the prompt
    kernel reads its chunk's tiles (up to ``tile_rows`` consecutive rows); the logits rows come back in the engine's
    order: the chunks that end their prompt, then the decodes."""
    bs, layers = 4, 1
    per_block = layers * 2 * bs
    st = DecodeStaging(max_batch=8, width=4, block_size=bs, num_layers=layers, pin=False, max_tables=3,
                       tile_rows=2)
    dec = _decode(0, list(range(100, 110)), 9, [7, 3, 9])
    mid = _chunk(list(range(200, 210)), 2, 3, [5, 6])  # tokens 2..4 of 10: the prompt goes on next step
    end = _chunk(list(range(300, 306)), 4, 2, [1, 2])  # tokens 4..5 of 6, a cached prefix before: samples
    assert not mid.samples and end.samples
    assert st.fits([dec], [mid, end])
    assert not st.fits([dec], [mid, end, _chunk(list(range(9)), 0, 3, [1])])  # 9 rows
    assert not st.fits([dec], [mid, end, _chunk(list(range(9)), 0, 1, [1])])  # 4 tables
    n = st.fill([dec], 8, [mid, end])
    assert n == 8 * 8 + 3 * 4
    ids, pos, slot, ctx, tab, sel, tile0, tilen = (st.head[i].tolist() for i in range(8))
    assert sel[:2] == [5, 0] and st.num_sampled == 2  # the graph computes logits of these rows only
    assert ids[:6] == [109, 202, 203, 204, 304, 305] and pos[:6] == [9, 2, 3, 4, 4, 5]
    assert ctx == [10, 0, 0, 0, 0, 0, 0, 0]
    assert slot[1:6] == [5 * per_block + 2, 5 * per_block + 3, 6 * per_block + 0, 2 * per_block + 0,
                         2 * per_block + 1] and slot[6:] == [-1, -1]
    assert tab[:6] == [0, 1, 1, 1, 2, 2]  # a chunk's rows share its sequence's table
    # tiles of at most 2 rows, never across chunks: rows 1-2, 3, 4-5; the rest unused
    assert tile0[:3] == [1, 3, 4] and tilen == [2, 1, 2, 0, 0, 0, 0, 0] and st.num_tiles == 3
    assert st.tables[1, :2].tolist() == [5, 6] and st.tables[2, :2].tolist() == [1, 2]
    assert sample_rows([dec], [mid, end]) == [5, 0]
    assert sample_rows([], [mid]) == [] and sample_rows([dec, dec], []) == [0, 1]
    # another rank stages the same rows, tiles included
    other = DecodeStaging(max_batch=8, width=4, block_size=bs, num_layers=layers, pin=False, max_tables=3,
                          tile_rows=2)
    assert other.load(st.rows(8)) == (8, n) and other.num_tiles == 3
    assert (other.head == st.head).all()
    # the next decode-only step keeps the decode row's table and clears the tiles
    st.fill([dec], 1)
    assert st.head[3].tolist()[:1] == [10] and st._row_lists[0] is dec.seq.block_ids
    assert st.num_tiles == 0 and st.head[7, 0] == 0


def test_prompt_tiles_per_kv_group_and_their_bound():
    assert prompt_tile_rows(4) == 16 and prompt_tile_rows(3) == 21 and prompt_tile_rows(1) == 64
    assert prompt_tile_rows(128) == 1
    # a chunk of n tokens takes ceil(n / 16) tiles: 64 rows in 64 one-token chunks, or 2 + 1 for 17 + 1 ...
    assert prompt_tile_bound(64, 16, 64) == 64 and prompt_tile_bound(2048, 16, 64) == 128 + 64
    assert prompt_tile_bound(8, 16, 64) == 8


def test_decode_staging_rewrites_only_changed_table_rows():
    st = DecodeStaging(max_batch=2, width=6, block_size=2, num_layers=1, pin=False)
    blocks = [4, 5]
    d = _decode(0, list(range(10)), 3, blocks)
    st.fill([d], padded=1)
    assert st.tables[0, :2].tolist() == [4, 5]
    blocks.append(8)  # the block manager grows the list in place
    d = _decode(0, list(range(10)), 4, blocks)
    st.fill([d], padded=1)
    assert st.tables[0, :3].tolist() == [4, 5, 8] and st.head[2, 0] == 8 * 4 + 0
    d = _decode(0, list(range(10)), 4, [1, 2, 3])  # a new list (freed and re-allocated): the whole row again
    st.fill([d], padded=1)
    assert st.tables[0, :3].tolist() == [1, 2, 3]


def test_fast_forward_matches_portable_in_triton_interpreter():
    """Greedy tokens of the fast forward (eager, and through the graph decoder's staging without graphs: decode
    steps, and steps whose prompt chunks run as rows in tiles of the prompt kernel) equal the portable path's, with
    Triton's CPU interpreter; chunked prompts (a 32-token step budget) and cached prefixes included. The prompt
    kernel alone against float64 attention too (float32: the interpreter's bfloat16 is wrong in Triton 3.9)."""
    code = r"""
import dataclasses, os, torch
from types import SimpleNamespace
from unittest import mock
from common import model_runner, cuda_graphs
from common.config import EngineConfig
from common.engine import LLMEngine
from common.sampling import SamplingParams

class NoGraphs(cuda_graphs.CudaGraphDecoder):
    def __init__(self, model, kv, bs, mb, mlen, logits=True, prefill_tokens=0, max_rows=None):
        self.model, self.kv_cache, self.device, self.with_logits = model, kv, kv.device, logits
        self.prefill_tokens, self.max_batch = prefill_tokens, mb
        self.sizes = cuda_graphs.graph_batch_sizes(mb, prefill_tokens, max_rows)
        self.staging = cuda_graphs.DecodeStaging(
            self.sizes[-1], -(-mlen // bs), bs, model.cfg.num_layers, pin=False, max_tables=mb,
            tile_rows=cuda_graphs.prompt_tile_rows(model.num_heads // model.num_kv_heads))
        self.dev = torch.zeros_like(self.staging.host)
        self._copied = SimpleNamespace(synchronize=lambda: None)
        self.replays = self.prompt_replays = 0
    def capture(self):
        pass
    def _replay(self, padded, n, feed=None):
        self.dev[:n].copy_(self.staging.host[:n]); self.replays += 1
        if feed is not None:
            mb = self.staging.max_batch
            feed.apply(self.dev[cuda_graphs._IDS * mb : cuda_graphs._IDS * mb + padded], 0)
        return self._run(padded, self.staging.num_tiles > 0)

from tests.gpu.test_kernels import check_prompt_attention
check_prompt_attention("cpu", "fp32-smollm2", nb=200)

g = torch.Generator().manual_seed(0)
ps = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 37, 20)]
p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
for budget in (2048, 32):
    cfg = EngineConfig(device="cpu", dtype="float32", max_num_seqs=8, kv_cache_memory=64 << 20, max_model_len=256,
                       max_num_batched_tokens=budget)
    ref = [r.token_ids for r in LLMEngine.from_spec("dummy:tiny-llama", cfg).generate(ps, p)]
    ref2 = [r.token_ids for r in LLMEngine.from_spec("dummy:tiny-llama", cfg).generate([q + [7, 8] for q in ps], p)]
    with mock.patch.object(model_runner, "use_fast_path", lambda d, c: True), \
         mock.patch.object(model_runner, "CudaGraphDecoder", NoGraphs):
        # async scheduling: the decodes' input ids are fed into the staged rows from the last step's picks
        eng = LLMEngine.from_spec("dummy:tiny-llama", dataclasses.replace(cfg, async_scheduling=True))
        assert eng.async_scheduling
        out = [r.token_ids for r in eng.generate(ps, p)]
        again = [r.token_ids for r in eng.generate([q + [7, 8] for q in ps], p)]  # cached prefixes
        # every step of these short prompts fits a graph: the prompts' steps too
        g = eng.runner.graphs
        assert g.replays == eng.num_steps and g.prompt_replays >= 2, (g.replays, eng.num_steps, g.prompt_replays)
    assert out == ref and again == ref2, (budget, out, ref, again, ref2)
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_grammar_mask_kernels_in_triton_interpreter():
    """The grammar masks' Triton kernels (masked argmax, -inf fill) against their references, on the CPU through
    Triton's interpreter (float32: the interpreter's bfloat16 is wrong in Triton 3.9)."""
    code = """
import torch
from tests.gpu.test_kernels import check_grammar_mask_kernels
check_grammar_mask_kernels("cpu", torch.float32)
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_sampler_kernels_in_triton_interpreter():
    """The pick's Triton kernels (penalties, the fold of picked tokens, the pick among candidates) against the
    sampler's portable path, and the graphs' uniform numbers against the host's, on the CPU through Triton's
    interpreter."""
    code = """
from tests.gpu.test_kernels import check_row_uniforms, check_sampler_kernels
check_sampler_kernels("cpu")
check_row_uniforms("cpu")
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_whole_vocabulary_pick_in_triton_interpreter():
    """The pick over the whole vocabulary (temperature, top-p by a mass-weighted radix select, min-p, the inverse
    CDF) takes each token in its exact share, on the CPU through Triton's interpreter: temperature alone, top-p with
    min-p, a row whose first blocks are masked; with several blocks a segment, top-p alone and a row whose top-p
    keeps one token (the other blocks skipped); top-p with its candidates past their slots at the first try and
    within them at the second (one digit further), and past them at both (its last digits over the whole rows).
    First, the kernels' z = x / temperature is IEEE division bit for bit. The GPU suite runs every case on 2,048
    rows."""
    code = """
from tests.gpu.test_kernels import check_pick_full, check_scaled_division
check_scaled_division("cpu")
fast = dict(PICK_SUB=256, PICK_UNROLL=2)  # fewer, larger steps: the interpreter's time goes by steps
check_pick_full("cpu", n=64, cases=(0, 4, 5), **fast)
check_pick_full("cpu", n=64, cases=(1, 6), PICK_BLOCK=256, PICK_SEGMENTS=4, PICK_SUB=128, PICK_UNROLL=2)
check_pick_full("cpu", n=64, cases=(1,), PICK_CAP=4, **fast)
check_pick_full("cpu", n=64, cases=(2,), PICK_CAP=2, **fast)
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_pick_segments_cover_the_vocabulary_in_whole_blocks():
    """The whole-vocabulary pick's segments: about 32 a row, whole blocks, covering every token once; by the
    vocabulary alone (a row's sums in the same order in any batch)."""
    from common.triton_ops import PICK_BLOCK, pick_segments

    assert pick_segments(128256) == (32, 4096) and pick_segments(49152) == (24, 2048)
    for vocab in (1, 1000, 3000, 32000, 49152, 128256, 151936, 262144):
        nseg, seg = pick_segments(vocab)
        assert seg % PICK_BLOCK == 0 and (nseg - 1) * seg < vocab <= nseg * seg and nseg <= 32
