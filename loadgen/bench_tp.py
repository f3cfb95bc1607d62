"""Tensor-parallel decode on GPUs: one engine decode step (schedule + CUDA-graph replay + sample) of a dummy
Llama-3.1-8B in bfloat16, at batch 1 and batch 64, at TP=1 and TP=2, against the byte limit of a card.

The limit is the bytes of weights one card reads a step (its share of every layer matrix, plus the replicated LM
head and norms; not the embedding table, of which a step reads a few rows) over the card's copy bandwidth (a
device-to-device copy, bytes read + written). A step's time is the median of ``--steps`` steps, timed with CUDA
events around ``LLMEngine.step`` on rank 0 (which waits on the other rank through the all-reduces).

Run on a machine with two GPUs: ``python -m loadgen.bench_tp [--steps 200] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

SPEC = "dummy:llama-3.1-8b"


def weight_bytes_per_card(eng) -> int:
    """Bytes of the weights rank 0 reads in a decode step (every rank reads as many)."""
    model = eng.runner.model
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name != "embed_tokens")


def decode_step_ms(eng, batch: int, context: int, steps: int, warmup: int = 10) -> float:
    """Median ms of an engine step while ``batch`` sequences of about ``context`` tokens decode."""
    from common.sampling import SamplingParams

    vocab = eng.model_cfg.vocab_size
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=warmup + steps + 2, temperature=0.0, ignore_eos=True)
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
    for rid in rids:
        eng.abort(rid)
    return statistics.median(times)


def main() -> int:
    from common.config import EngineConfig
    from common.engine import LLMEngine
    from loadgen.bench_gpu import copy_bandwidth

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes (default 1,2)")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes (default 1,64)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of each sequence (default 128)")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per point (default 200)")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()
    sizes = [int(x) for x in a.tp.split(",")]
    if torch.cuda.device_count() < max(sizes):
        print(f"needs {max(sizes)} CUDA devices, torch sees {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth (cuda:0, read + write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for tp in sizes:
        t0 = time.perf_counter()
        cfg = EngineConfig(device="cuda", dtype="bfloat16", tensor_parallel_size=tp, max_num_seqs=64,
                           max_model_len=2048, max_num_batched_tokens=4096, kv_cache_memory=8 << 30)
        eng = LLMEngine.from_spec(SPEC, cfg)
        wb = weight_bytes_per_card(eng)
        print(f"TP={tp}: engine ready in {time.perf_counter() - t0:.1f} s, {wb / 1e9:.2f} GB of weights per card",
              flush=True)
        try:
            for b in (int(x) for x in a.batches.split(",")):
                ms = decode_step_ms(eng, b, a.context, a.steps)
                limit = wb / bandwidth * 1e3
                rows.append({"tp": tp, "batch": b, "context": a.context, "step_ms": ms, "limit_ms": limit,
                             "weight_bytes_per_card": wb, "copy_bandwidth": bandwidth})
                print(f"TP={tp} batch {b:3d}: step {ms:.2f} ms, byte limit {limit:.2f} ms ({ms / limit:.2f}x)",
                      flush=True)
        finally:
            eng.close()
            del eng
            gc.collect()
            torch.cuda.empty_cache()
    base = {r["batch"]: r["step_ms"] for r in rows if r["tp"] == 1}
    print("\n tp  batch  step ms  limit ms  vs TP=1")
    for r in rows:
        rel = f"{r['step_ms'] / base[r['batch']]:.2f}x" if r["batch"] in base else "-"
        print(f"{r['tp']:3d}  {r['batch']:5d}  {r['step_ms']:7.2f}  {r['limit_ms']:8.2f}  {rel:>7s}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
