"""The one-shot peer-to-peer all-reduce (common/p2p_all_reduce.py) on the CPU, through Triton's interpreter.

The kernel maps no memory itself: it takes every rank's buffer address. Here the "ranks" are buffers in one process
and their kernels run one after another, so a rank's wait must already be satisfied when it runs: the ranks after
it have pushed their values and raised their flags (written here as their kernels would), the ranks before it did
so by running. Every rank's result must be bit-identical and equal the sum in rank order (the fused kernel's:
``triton_ops.add_rms_norm`` of the summed delta, its residual updated alike); the call counts, the halves and the
flags must advance call after call. The same kernel across two GPUs (IPC-mapped buffers, CUDA
graphs, against NCCL): tests/gpu/test_tensor_parallel_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.config import EngineConfig

SIMULATION = r"""
import torch
from common import p2p_all_reduce as p

def own_sum(x, parts):
    if not parts:
        return x.float()
    acc = torch.zeros(x.shape[1:])
    for s in range(parts):
        acc = acc + x[s].float()
    return acc

def simulate(world, dtype, shape, parts, calls=4):
    slot, total = p.buffer_bytes(world, 1 << 18)
    bufs = [torch.zeros(total, dtype=torch.uint8) for _ in range(world)]
    counts = [torch.zeros(p.NUM_PROGRAMS, dtype=torch.int64) for _ in range(world)]
    addrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    g = torch.Generator().manual_seed(world * 100 + parts)
    for call in range(1, calls + 1):
        xs = [torch.randn(((parts,) if parts else ()) + shape, generator=g).to(dtype) for _ in range(world)]
        own = [own_sum(x, parts).to(dtype) for x in xs]
        want = torch.zeros(shape)
        for o in own:
            want = want + o.float()
        want = want.to(dtype)
        half = call % 2 * world * slot
        outs = []
        for r in range(world):
            flags = bufs[r][2 * world * slot:].view(torch.int64).view(p.NUM_PROGRAMS, world)
            for q in range(r + 1, world):  # what rank q's kernel, not yet run, pushes into rank r's buffer
                v = own[q].contiguous().view(-1).view(torch.uint8)
                bufs[r][half + q * slot : half + q * slot + v.numel()] = v
                flags[:, q] = call
            x = xs[r].clone()
            out = torch.empty(shape, dtype=dtype) if parts else x
            p.launch(x, out, addrs, counts[r], r, world, slot, parts)
            outs.append(out)
            assert (counts[r] == call).all(), counts[r]
        for r in range(world):
            assert torch.equal(outs[r], want), (world, dtype, parts, call, r, (outs[r].float() - want.float()).abs().max())
            flags = bufs[r][2 * world * slot:].view(torch.int64).view(p.NUM_PROGRAMS, world)
            assert all((flags[:, q] == call).all() for q in range(world) if q != r)
            for q in range(world):  # every other rank's buffer holds rank r's values in this call's half
                if q != r:
                    got = bufs[q][half + r * slot : half + r * slot + own[r].numel() * own[r].element_size()]
                    assert torch.equal(got, own[r].contiguous().view(-1).view(torch.uint8))

def simulate_add_norm(world, shape, parts, calls=3, eps=1e-5):
    # the fused kernel: x += the rows' sum, then RMSNorm; equal to triton_ops.add_rms_norm of the summed delta
    from common import triton_ops as tk
    slot, total = p.buffer_bytes(world, 1 << 18)
    bufs = [torch.zeros(total, dtype=torch.uint8) for _ in range(world)]
    counts = [torch.zeros(p.NUM_PROGRAMS, dtype=torch.int64) for _ in range(world)]
    addrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    g = torch.Generator().manual_seed(7 + parts)
    w = torch.rand(shape[1], generator=g) + 0.5
    for call in range(1, calls + 1):
        ds = [torch.randn(((parts,) if parts else ()) + shape, generator=g) for _ in range(world)]
        own = [own_sum(d, parts) for d in ds]
        delta = torch.zeros(shape)
        for o in own:
            delta = delta + o
        x0 = torch.randn(shape, generator=g)  # the residual: the same on every rank
        want_x = x0.clone()
        want_h = tk.add_rms_norm(want_x, delta, w, eps)
        half = call % 2 * world * slot
        hs = []
        for r in range(world):
            flags = bufs[r][2 * world * slot:].view(torch.int64).view(p.NUM_PROGRAMS, world)
            for q in range(r + 1, world):
                v = own[q].contiguous().view(-1).view(torch.uint8)
                bufs[r][half + q * slot : half + q * slot + v.numel()] = v
                flags[:, q] = call
            x, h = x0.clone(), torch.empty(shape)
            p.launch_add_norm(ds[r].clone(), x, w, h, eps, addrs, counts[r], r, world, slot, parts)
            assert torch.equal(x, want_x), (r, call, (x - want_x).abs().max())
            hs.append(h)
            assert (counts[r] == call).all()
        for h in hs:
            assert torch.equal(h, want_h), (world, parts, call, (h - want_h).abs().max())

simulate_add_norm(2, (3, 576), 0)              # SmolLM2's hidden size: a row smaller than its power-of-two block
simulate_add_norm(2, (40, 256), 0)             # more rows than programs: a program owns several
simulate_add_norm(2, (2, 512), 4)              # split-K parts
simulate_add_norm(3, (5, 384), 0)

simulate(2, torch.float32, (3, 1000), 0)       # in place, chunks past one block and a ragged tail
simulate(2, torch.float32, (1, 4096 * 9), 0)   # more chunks than programs: a program owns several
simulate(2, torch.float32, (2, 700), 4)        # split-K parts: summed on their rank, then across ranks
simulate(3, torch.float32, (1, 5000), 0)       # three ranks
simulate(2, torch.float16, (2, 1536), 0)       # a 16-bit activation travels as itself
print("ok")
"""


def test_one_shot_all_reduce_and_its_fused_norm_sum_in_rank_order_in_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SIMULATION], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_the_all_reduce_setting_is_checked():
    assert EngineConfig().tp_all_reduce == "auto"
    assert EngineConfig(tp_all_reduce="nccl").tp_all_reduce == "nccl"
    with pytest.raises(ValueError, match="tp_all_reduce must be 'auto' or 'nccl', got 'p2p'"):
        EngineConfig(tp_all_reduce="p2p")
