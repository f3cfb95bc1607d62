"""Tensor-parallel decode on GPUs: the all-reduce alone, then engine decode steps of a dummy Llama in bfloat16, at
batch 1 and batch 64, at TP=1 and at TP=2 with each all-reduce, against the byte limit of a card.

- ``allreduce``: two ranks in two processes; a CUDA graph of 64 sums of one size, replayed; µs per sum, NCCL against
  the one-shot peer-to-peer kernel (common/p2p_all_reduce.py), at the sizes a decode step sums; then each with the
  residual add and RMSNorm that follow it in the model (NCCL + ``add_rms_norm`` against the fused kernel).
- ``steps``: one engine decode step (schedule + CUDA-graph replay + sample), two ways on rank 0 (which waits on the
  other rank through the all-reduces): the median of ``--steps`` steps each timed alone with CUDA events around
  ``LLMEngine.step`` and waited for (launch to the end of its GPU work: nothing overlaps), and pipelined, ``--steps``
  steps back to back over the wall clock, as a running stream sees them (with async scheduling, `--async-scheduling on`, the
  host's work on a step runs while the GPU computes the one before). The
  limit is the bytes of weights one card reads a step (its share of every layer matrix, plus the replicated LM head
  and norms; not the embedding table, of which a step reads a few rows) over the card's copy bandwidth (a
  device-to-device copy, bytes read + written).

Run on a machine with two GPUs: ``python -m loadgen.bench_tp [--steps 200] [--model dummy:llama-3.1-70b --tp 2]
[--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

# (label, rows, hidden, dtype, split-K parts): what a decode step of the 8B (hidden 4,096) and the 70B (8,192) sums
ALLREDUCE_SIZES = [("8B batch 1", 1, 4096, torch.bfloat16, 0), ("8B batch 1, 8 split-K parts", 1, 4096,
                   torch.float32, 8), ("8B batch 64", 64, 4096, torch.bfloat16, 0),
                   ("70B batch 1", 1, 8192, torch.bfloat16, 0), ("70B batch 64", 64, 8192, torch.bfloat16, 0),
                   ("8B 512 prompt rows", 512, 4096, torch.bfloat16, 0)]
GRAPH_CALLS = 64
REPLAYS = 50


def weight_bytes_per_card(eng) -> int:
    """Bytes of the weights rank 0 reads in a decode step (every rank reads as many)."""
    model = eng.runner.model
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name != "embed_tokens")


def decode_step_ms(eng, batch: int, context: int, steps: int, warmup: int = 10) -> tuple[float, float]:
    """Ms of an engine step while ``batch`` sequences of about ``context`` tokens decode: the median of steps each
    waited for, and the mean of as many run back to back."""
    from common.sampling import SamplingParams

    vocab = eng.model_cfg.vocab_size
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=warmup + 2 * steps + 4, temperature=0.0, ignore_eos=True)
    rids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in rids:
        eng.add_request(rid, torch.randint(0, vocab, (context,), generator=g).tolist(), params)
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()
    for _ in range(warmup):
        eng.step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(steps):
        start.record()
        eng.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    pipelined = (time.perf_counter() - t0) * 1e3 / steps
    for rid in rids:
        eng.abort(rid)
    return statistics.median(times), pipelined


# ---- the all-reduce alone -----------------------------------------------------------------------------------
def _graph_us(fn: Any, x: torch.Tensor) -> float:
    """µs per call of ``fn(x)``: a graph of GRAPH_CALLS calls, replayed REPLAYS times after a warm-up."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn(x)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * GRAPH_CALLS)


def _allreduce_rank(rank: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    from common import triton_ops as tk
    from common.tensor_parallel import _join

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    shard = _join(rank, 2, store, "cuda", "auto")
    dev = torch.device("cuda", rank)
    rows = []
    for label, t, hidden, dtype, parts in ALLREDUCE_SIZES:
        x = torch.randn(((parts,) if parts else ()) + (t, hidden), device=dev).to(dtype)
        fits = shard.p2p is not None and shard.p2p.fits(x)
        nccl = _graph_us(lambda v: dist.all_reduce(v), x)
        p2p = _graph_us(shard.p2p, x) if fits else float("nan")
        # with the residual add and RMSNorm that follow it in the model: NCCL then add_rms_norm, or the fused kernel
        res = torch.zeros((t, hidden), dtype=torch.bfloat16, device=dev)
        w = torch.ones(hidden, dtype=torch.bfloat16, device=dev)

        def nccl_norm(v: torch.Tensor, res: torch.Tensor = res, w: torch.Tensor = w) -> torch.Tensor:
            dist.all_reduce(v)
            return tk.add_rms_norm(res, v, w, 1e-5)

        def p2p_norm(v: torch.Tensor, res: torch.Tensor = res, w: torch.Tensor = w) -> torch.Tensor:
            return shard.p2p.add_rms_norm(res, v, w, 1e-5)

        nccl_n = _graph_us(nccl_norm, x)
        p2p_n = _graph_us(p2p_norm, x) if fits else float("nan")
        rows.append({"size": label, "bytes": x.numel() * x.element_size(), "nccl_us": nccl, "p2p_us": p2p,
                     "nccl_add_norm_us": nccl_n, "p2p_add_norm_us": p2p_n})
    dist.barrier(group=shard.meta_group)
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def allreduce_section() -> list[dict]:
    import torch.multiprocessing as mp

    from common.tensor_parallel import _master_store

    store, port = _master_store(3)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    rows = results.get(timeout=600)
    for p in procs:
        p.join(60)
    del store
    print(f"\nall-reduce across cuda:0 and cuda:1, µs per sum ({GRAPH_CALLS} sums a graph, {REPLAYS} replays)")
    print(f"{'size':30s} {'bytes':>9s} {'NCCL':>8s} {'p2p':>8s} {'p2p/NCCL':>9s}   with add + RMSNorm: "
          f"{'NCCL':>8s} {'p2p':>8s} {'p2p/NCCL':>9s}")
    for r in rows:
        print(f"{r['size']:30s} {r['bytes']:9d} {r['nccl_us']:8.1f} {r['p2p_us']:8.1f} "
              f"{r['p2p_us'] / r['nccl_us']:9.2f}   {'':19s}{r['nccl_add_norm_us']:8.1f} {r['p2p_add_norm_us']:8.1f} "
              f"{r['p2p_add_norm_us'] / r['nccl_add_norm_us']:9.2f}", flush=True)
    return rows


# ---- engine steps -------------------------------------------------------------------------------------------
def _engine_rows(model: str, tp: int, all_reduce: str, batches: list[int], context: int, steps: int, kv_gib: float,
                 bandwidth: float, profile: str | None, results: Any, async_scheduling: bool = True,
                 vocab_parallel: bool = False) -> None:
    """One engine's rows, in a process of its own: a process holds one tensor-parallel group, and NCCL's teardown
    did not return within 30 s on two H200s. The process leaves without one (its other ranks exit with it)."""
    from common.config import EngineConfig
    from common.engine import LLMEngine
    from common.loader import load_model_source

    t0 = time.perf_counter()
    cfg = EngineConfig(device="cuda", dtype="bfloat16", tensor_parallel_size=tp, max_num_seqs=64, max_model_len=2048,
                       max_num_batched_tokens=4096, kv_cache_memory=int(kv_gib * 2**30), tp_all_reduce=all_reduce,
                       async_scheduling=async_scheduling, tp_vocab_parallel=vocab_parallel)
    eng = LLMEngine(load_model_source(model), cfg)
    wb = weight_bytes_per_card(eng)
    p2p = eng.runner.shard.p2p is not None
    label = (f"TP={tp}" + ("" if tp == 1 else f" {all_reduce}") + ("" if async_scheduling else " sync")
             + (" vocab-parallel" if eng.runner.model.vocab_parallel else ""))
    print(f"{label}: engine ready in {time.perf_counter() - t0:.1f} s, {wb / 1e9:.2f} GB of weights per card "
          f"(peer-to-peer all-reduce: {'yes' if p2p else 'no'})", flush=True)
    rows = []
    for b in batches:
        ms, piped = decode_step_ms(eng, b, context, steps)
        limit = wb / bandwidth * 1e3
        rows.append({"model": model, "tp": tp, "all_reduce": all_reduce if tp > 1 else "-", "batch": b,
                     "context": context, "step_ms": ms, "pipelined_ms": piped, "limit_ms": limit,
                     "weight_bytes_per_card": wb, "copy_bandwidth": bandwidth, "p2p": p2p,
                     "async_scheduling": eng.async_scheduling, "vocab_parallel": eng.runner.model.vocab_parallel})
        print(f"{label} batch {b:3d}: step {ms:.2f} ms waited for, {piped:.2f} ms pipelined, byte limit {limit:.2f} "
              f"ms ({piped / limit:.2f}x)", flush=True)
        if profile:
            profile_steps(eng, b, context, f"{profile}-tp{tp}-{all_reduce}-b{b}.json", label)
    results.put(rows)
    results.close()
    results.join_thread()  # the rows are out; the other ranks follow this process's exit
    os._exit(0)


def profile_steps(eng, batch: int, context: int, trace: str, label: str) -> None:
    """Rank 0's kernels over 20 decode steps (torch.profiler, graph replays included): the table of the kernels by
    GPU time, and a Chrome trace at ``trace``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode_step_ms(eng, batch, context, 20, warmup=5)
    print(f"\n{label} batch {batch}: rank 0's GPU time over 25 steps and their prefill", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60), flush=True)
    prof.export_chrome_trace(trace)


def steps_section(a: argparse.Namespace) -> list[dict]:
    import torch.multiprocessing as mp

    from loadgen.bench_gpu import copy_bandwidth

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth (cuda:0, read + write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    torch.cuda.empty_cache()
    runs = [(tp, ar, on, vp) for tp in (int(x) for x in a.tp.split(","))
            for ar in (["auto"] if tp == 1 else a.all_reduce.split(","))
            for on in (x.strip() == "on" for x in a.async_scheduling.split(","))
            for vp in ([False] if tp == 1 else [x.strip() == "on" for x in a.vocab_parallel.split(",")])]
    ctx = mp.get_context("spawn")
    rows: list[dict] = []
    for tp, all_reduce, on, vp in runs:
        results = ctx.Queue()
        proc = ctx.Process(target=_engine_rows, args=(a.model, tp, all_reduce, [int(x) for x in a.batches.split(",")],
                                                      a.context, a.steps, a.kv_gib, bandwidth, a.profile, results, on,
                                                      vp))
        proc.start()
        rows += results.get(timeout=900)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    base = {r["batch"]: r for r in rows if r["tp"] == 1 and r["async_scheduling"]}
    print(f"\n{a.model}\n tp  all-reduce  async  vocab  batch  waited ms  pipelined ms  limit ms  ÷ limit  vs TP=1 "
          "(waited, pipelined)")
    for r in rows:
        b = base.get(r["batch"])
        rel = f"{r['step_ms'] / b['step_ms']:.2f}x, {r['pipelined_ms'] / b['pipelined_ms']:.2f}x" if b else "-"
        print(f"{r['tp']:3d}  {r['all_reduce']:10s}  {'on' if r['async_scheduling'] else 'off':5s}  "
              f"{'split' if r['vocab_parallel'] else 'whole':5s}  {r['batch']:5d}  {r['step_ms']:9.2f}  {r['pipelined_ms']:12.2f}  "
              f"{r['limit_ms']:8.2f}  {r['pipelined_ms'] / r['limit_ms']:7.2f}  {rel:>14s}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="allreduce,steps", help="allreduce, steps (default both)")
    ap.add_argument("--model", default="dummy:llama-3.1-8b", help="model spec (default dummy:llama-3.1-8b)")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes (default 1,2)")
    ap.add_argument("--all-reduce", default="nccl,auto", help="all-reduces to run TP>1 with (default nccl,auto)")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes (default 1,64)")
    ap.add_argument("--async-scheduling", default="on", help="on, off or on,off: engines with async scheduling "
                                                             "(the default on CUDA), without, or one of each")
    ap.add_argument("--vocab-parallel", default="off", help="off, on or off,on: TP>1 engines with the embedding and "
                    "LM head whole on every rank or split by vocabulary (engine.tp_vocab_parallel; default off)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of each sequence (default 128)")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per point (default 200)")
    ap.add_argument("--kv-gib", type=float, default=8.0, help="KV pool per rank, GiB (default 8)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--profile", default=None, metavar="PREFIX",
                    help="also profile rank 0 over 20 steps of each point: a kernel table, and PREFIX-*.json traces")
    a = ap.parse_args()
    sections = a.sections.split(",")
    need = 2 if "allreduce" in sections else max(int(x) for x in a.tp.split(","))
    if torch.cuda.device_count() < need:
        print(f"needs {need} CUDA devices, torch sees {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    out: dict[str, list[dict]] = {}
    if "allreduce" in sections:
        out["allreduce"] = allreduce_section()
    if "steps" in sections:
        out["steps"] = steps_section(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
