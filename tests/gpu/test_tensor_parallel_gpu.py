"""Tensor parallelism on two GPUs.

- The one-shot peer-to-peer all-reduce (common/p2p_all_reduce.py) in two processes: eager and replayed from a CUDA
  graph, bit-equal to NCCL's sum of the same tensors; fused with the residual add and RMSNorm, bit-equal to
  ``triton_ops.add_rms_norm`` of NCCL's sum.
- A dummy Llama-3.1-8B (seeded random weights) in float32, TP=2 (all-reduces inside the captured graphs, the prompts'
  step among them) against TP=1 on one GPU, with the default all-reduce (peer-to-peer) and with NCCL, both with async
  scheduling (the default: rank 0 sends the other rank the input ids still on its device), and synchronously.

Each engine runs in a process of its own, one after another (32 GB of float32 weights on cuda:0)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import triton_ops as tk
from common.config import EngineConfig
from common.engine import LLMEngine
from common.loader import load_model_source
from common.tensor_parallel import _join, _master_store
from tests.test_tensor_parallel import GREEDY, step_logits

pytestmark = [pytest.mark.gpu2, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

# float32 logits (|logit| up to ~6 here) after 32 layers whose row-parallel matmuls sum in another order
LOGIT_TOL = 1e-3
LOGIT_STEPS = 8


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 60, 128, 301)]


def engine(tp: int, all_reduce: str = "auto", async_scheduling: bool | None = None,
           vocab_parallel: bool = False) -> LLMEngine:
    torch.backends.cuda.matmul.allow_tf32 = False  # full float32 matmuls (the other ranks keep torch's default: off)
    cfg = EngineConfig(device="cuda", dtype="float32", tensor_parallel_size=tp, kv_cache_memory=4 << 30,
                       max_num_seqs=8, max_model_len=2048, seed=0, tp_all_reduce=all_reduce,
                       async_scheduling=async_scheduling, tp_vocab_parallel=vocab_parallel)
    return LLMEngine(load_model_source("dummy:llama-3.1-8b"), cfg)


def run(eng: LLMEngine, ps: list[list[int]]) -> dict:
    logits = step_logits(eng, ps, LOGIT_STEPS)
    g = eng.runner.graphs
    replays, prompt_replays = (g.replays, g.prompt_replays) if g is not None else (0, 0)
    return {"logits": [x.cpu() for x in logits], "score": eng.runner.score(ps[:2]),
            "tokens": [r.token_ids for r in eng.generate(ps, GREEDY)], "replays": replays,
            "prompt_replays": prompt_replays, "p2p": eng.runner.shard.p2p is not None}


def _engine_results(tp: int, all_reduce: str, async_scheduling: bool | None, vocab_parallel: bool, out) -> None:
    """One engine's results, in a process of its own (a process holds one tensor-parallel group, and NCCL's
    teardown did not return within 30 s on two H200s): the process leaves without one, its other ranks with it."""
    eng = engine(tp, all_reduce, async_scheduling, vocab_parallel)
    out.put(pickle.dumps(run(eng, prompts(eng.model_cfg.vocab_size))))  # the tensors' bytes, not shared memory
    out.close()
    out.join_thread()
    os._exit(0)


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    ctx = mp.get_context("spawn")
    out = {}
    # the defaults use async scheduling (rank 0 sends the other rank the fed ids); "2-sync": without it; "2-vocab":
    # the embedding and LM head split by vocabulary (each rank's logit columns gathered inside the graphs)
    for key, tp, all_reduce, on, vp in (("1", 1, "auto", None, False), ("2", 2, "auto", None, False),
                                        ("2-nccl", 2, "nccl", None, False), ("2-sync", 2, "auto", False, False),
                                        ("2-vocab", 2, "auto", None, True)):
        q = ctx.Queue()
        proc = ctx.Process(target=_engine_results, args=(tp, all_reduce, on, vp, q))
        proc.start()
        out[key] = pickle.loads(q.get(timeout=600))
        proc.join(30)
        assert proc.exitcode == 0, (key, proc.exitcode)
    return out


@pytest.mark.parametrize("key", ["2", "2-nccl", "2-sync", "2-vocab"])
def test_tp2_logits_equal_tp1_on_two_gpus(results, key):
    one, two = results["1"], results[key]
    assert two["p2p"] == (key != "2-nccl")  # the default maps the peer's memory over NVLink; "nccl" keeps NCCL
    assert len(one["logits"]) == len(two["logits"]) == LOGIT_STEPS
    diffs = [float((a - b).abs().max()) for a, b in zip(one["logits"], two["logits"])]
    diffs += [float((a - b).abs().max()) for a, b in zip(one["score"], two["score"])]
    print(f"max |TP=2 ({key}) - TP=1| per step:", " ".join(f"{d:.2e}" for d in diffs))
    assert max(diffs) < LOGIT_TOL, diffs
    assert two["replays"] > 0  # the decode steps replayed graphs, their all-reduces inside
    assert two["prompt_replays"] > 0  # the prompts' step too: every rank staged the prompt rows rank 0 sent


@pytest.mark.parametrize("key", ["2", "2-nccl", "2-sync", "2-vocab"])
def test_tp2_greedy_tokens_equal_tp1_over_64_steps_on_two_gpus(results, key):
    assert all(len(t) == 64 for t in results[key]["tokens"])
    assert results[key]["tokens"] == results["1"]["tokens"]


# ---- the peer-to-peer all-reduce alone ---------------------------------------------------------------------------
# (shape, dtype, split-K parts): a batch-1 row, a 64-row step, ragged float32, split-K parts, the largest input the
# kernel takes (2 MiB), and one past it (NCCL's, through the same call)
CASES = [((1, 4096), torch.bfloat16, 0), ((64, 4096), torch.bfloat16, 0), ((3, 1000), torch.float32, 0),
         ((1, 4096), torch.float32, 8), ((128, 4096), torch.float32, 0), ((512, 4096), torch.float32, 0)]


def _own(x: torch.Tensor, parts: int) -> torch.Tensor:
    if not parts:
        return x
    acc = torch.zeros(x.shape[1:], dtype=torch.float32, device=x.device)
    for s in range(parts):
        acc = acc + x[s]
    return acc


def _all_reduce_rank(rank: int, port: int, failures) -> None:
    """One rank: every case eagerly (20 calls) and from a CUDA graph (three sums a replay, 30 replays), each result
    against NCCL's sum of the same tensors (each rank's parts summed first)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
        shard = _join(rank, 2, store, "cuda", "auto")
        assert shard.p2p is not None, "the peer-to-peer all-reduce was not built"
        dev = torch.device("cuda", rank)
        g = torch.Generator(device=dev).manual_seed(rank)
        for shape, dtype, parts in CASES:
            full = ((parts,) if parts else ()) + shape

            def draw(full: tuple[int, ...] = full, dtype: torch.dtype = dtype) -> torch.Tensor:
                return torch.randn(full, generator=g, device=dev).to(dtype)

            for _ in range(20):
                x = draw()
                want = _own(x, parts).clone()
                dist.all_reduce(want)
                got = shard.all_reduce(x.clone())
                assert torch.equal(got, want), (shape, dtype, parts, "eager", float((got - want).abs().max()))
            assert shard.p2p.fits(draw()) == (shape != (512, 4096))
            if not shard.p2p.fits(draw()):
                continue
            # fused with the residual add and RMSNorm: as triton_ops.add_rms_norm of NCCL's sum, residual included
            w = torch.rand(shape[1], device=dev).to(torch.bfloat16) + 0.5
            for _ in range(10):
                d, x = draw(), torch.randn(shape, device=dev).to(torch.bfloat16)
                dist.broadcast(x, 0)  # the residual is the same on every rank
                want = _own(d, parts).clone()
                dist.all_reduce(want)
                want_x = x.clone()
                want_h = tk.add_rms_norm(want_x, want, w, 1e-5)
                got_h = shard.p2p.add_rms_norm(x, d, w, 1e-5)
                assert torch.equal(x, want_x) and torch.equal(got_h, want_h), (shape, dtype, parts, "fused")
            static = [draw() for _ in range(3)]
            res = torch.randn(shape, device=dev).to(torch.bfloat16)
            dist.broadcast(res, 0)
            res_start = res.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = [shard.all_reduce(s.clone()) for s in static]
                fused = shard.p2p.add_rms_norm(res, static[0], w, 1e-5)
            for _ in range(30):
                for s in static:
                    s.copy_(draw())
                res.copy_(res_start)
                graph.replay()
                for s, o in zip(static, outs):
                    want = _own(s, parts).clone()
                    dist.all_reduce(want)
                    assert torch.equal(o, want), (shape, dtype, parts, "graph", float((o - want).abs().max()))
                want = _own(static[0], parts).clone()
                dist.all_reduce(want)
                want_x = res_start.clone()
                want_h = tk.add_rms_norm(want_x, want, w, 1e-5)
                assert torch.equal(res, want_x) and torch.equal(fused, want_h), (shape, dtype, parts, "fused graph")
        torch.cuda.synchronize(dev)
        dist.barrier(group=shard.meta_group)
        dist.destroy_process_group()
    except BaseException as e:  # reported by the test in the parent
        failures.put(f"rank {rank}: {e!r}")
        raise


def test_p2p_all_reduce_equals_nccl_eager_and_in_graphs():
    assert not dist.is_initialized()
    store, port = _master_store(3)  # this process keeps the store; the ranks join it
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, port, failures)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    errors = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    assert not errors, errors
    assert [p.exitcode for p in procs] == [0, 0]
    del store
