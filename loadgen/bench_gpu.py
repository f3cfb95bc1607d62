"""GPU benchmark: the CUDA fast path's speed against the card's limits, timings only.

Correctness lives in the GPU test suite (``tests/gpu``, ``make test-gpu``): every Triton kernel against float64 /
portable references, CUDA-graph decode against eager, SmolLM2 greedy against transformers, the served cluster.

1. The card's ceilings: copy bandwidth (device-to-device copy, bytes read + written) and bf16 matmul rate
   (8192³ on random data).
2. The paged decode-attention kernel alone (section ``kernels``): its time and KV bandwidth, Llama-3.1-8B heads at
   batch 1; the 8B's, the 1B's and SmolLM2's heads at batch 32 and 64 with context splits 1–8 and the default.
3. A dummy Llama-3.1-8B (random bfloat16 weights): engine decode steps at batch 1 (128-token context) and 64
   (1,024-token contexts) against the physical limit: (every weight matrix a step multiplies by, not the embedding
   table, + the KV it reads) ÷ the measured copy bandwidth; each with CUDA graphs, eager fast path, and the
   portable path, same engine. A step that carries a whole 1,024-token prompt beside 63 decodes (section
   ``mixed``), CUDA graph against eager, against its FLOPs ÷ the matmul rate. And one 4,096-token prefill against its
   FLOPs ÷ the measured matmul rate.
4. W1 (256 prompts, lengths uniform in [100, 1024], seed 0, 256 output tokens, EOS ignored) on the 8B dummy:
   output tokens/s against transformers' ``generate_batch`` on the same card (section ``w1``; ``w1-ours`` skips
   the peer, which takes ~4 minutes).

Extra sections: ``pick`` (the sampler's pick over the whole vocabulary, ``triton_ops.pick_full``, alone at 64 rows:
temperature 1, and top_p 0.9, against PyTorch's ops, with a sort for top-p, and one read of the logits), ``tune``
(GEMV / split-K / decode-kernel launch-parameter sweeps against cuBLAS),
``decode-params`` (the decode kernel's tile, warps and stages for each shape of ``DECODE_HEADS``), ``projections``
(a decode step's projections at 32 and 64 rows for SmolLM2, the 1B and the 8B, cuBLAS against split-K),
``profile`` (torch.profiler over mixed prefill + decode steps of W1).

Run: ``python -m loadgen.bench_gpu [--json OUT] [--sections kernels,decode,prefill,w1]``.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import sys
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from common.engine import LLMEngine


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / times[len(times) // 2]


def matmul_rate(n: int = 8192, iters: int = 10) -> float:
    """bf16 matmul FLOP/s (cuBLAS through torch), random operands, median."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


# (name, query heads, KV heads, head dim) of the decode kernel's timings
DECODE_HEADS = (("llama-3.1-8b", 32, 8, 128), ("llama-3.2-1b", 32, 8, 64), ("smollm2-135m", 9, 3, 64))


def _decode_inputs(b: int, h: int, kvh: int, d: int, ctx: int, bs: int) -> tuple[torch.Tensor, ...]:
    """A decode kernel's inputs, bf16 on CUDA: a one-layer KV pool, each of ``b`` rows ``ctx`` tokens in shuffled
    blocks of ``bs``, queries of ``h`` heads (``kvh`` KV heads, head dim ``d``), and the output buffer."""
    width = -(-ctx // bs)
    nb = b * width + 8
    cache = torch.randn(nb, 1, 2, bs, kvh, d, device="cuda").to(torch.bfloat16)
    tables = torch.randperm(nb, device="cuda")[: b * width].view(b, width).int()
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(b, h, d, device="cuda").to(torch.bfloat16)
    return cache, tables, lens, q, torch.empty_like(q)


def time_decode_kernel(bandwidth: float) -> list[dict]:
    """The decode-attention kernel alone, bf16: Llama-3.1-8B heads (32 / 8 KV, d 128) at batch 1, and each shape of
    ``DECODE_HEADS`` at batch 32 and 64 × 1,100 tokens with 1, 2, 3, 4 and 8 context splits and the default
    (``splits`` 0: ``decode_num_splits``, reported as ``default_splits``); KV bytes over its time."""
    import triton

    from common import triton_ops as tk
    from common.cuda_graphs import decode_num_splits

    rows = []
    bs = 16
    cases = [("llama-3.1-8b", 32, 8, 128, 1, 128, 0), ("llama-3.1-8b", 32, 8, 128, 1, 4096, 0)]
    cases += [(name, h, kvh, d, b, 1100, sp) for name, h, kvh, d in DECODE_HEADS for b in (32, 64)
              for sp in (0, 1, 2, 3, 4, 8)]
    for name, h, kvh, d, b, ctx, splits in cases:
        cache, tables, lens, q, out = _decode_inputs(b, h, kvh, d, ctx, bs)
        # in a CUDA graph, as the engine runs it: launched one by one, a split kernel and its merge would time the
        # host's two launches
        ms = triton.testing.do_bench_cudagraph(
            lambda q=q, c=cache, t=tables, n=lens, o=out, sp=splits, sc=d**-0.5: tk.paged_decode_attention(
                q, c, 0, t, n, sc, o, num_splits=sp),
            rep=30, return_mode="median")
        kv = b * ctx * 2 * kvh * d * 2
        rows.append({"heads": name, "batch": b, "context": ctx, "splits": splits,
                     "default_splits": decode_num_splits(b, kvh, tk.num_sms(q.device), d), "us": ms * 1e3,
                     "kv_bytes": kv, "GBps": kv / (ms / 1e3) / 1e9, "vs_copy_bw": kv / (ms / 1e3) / bandwidth})
        del cache
    return rows


def decode_params(bandwidth: float) -> list[dict]:
    """The decode kernel's launch parameters (tile of tokens, warps, pipeline stages) for each shape of
    ``DECODE_HEADS`` at batch 32 and 64 × 1,100 tokens, with the default context splits and twice as many (at most
    16), each timed in a CUDA graph; prints the best per case against the engine's defaults (64 / 4 / 2)."""
    import triton

    from common import triton_ops as tk
    from common.cuda_graphs import decode_num_splits

    rows: list[dict] = []
    bs, ctx = 16, 1100
    for name, h, kvh, d in DECODE_HEADS:
        for b in (32, 64):
            cache, tables, lens, q, out = _decode_inputs(b, h, kvh, d, ctx, bs)
            kv = b * ctx * 2 * kvh * d * 2
            dflt = decode_num_splits(b, kvh, tk.num_sms(q.device), d)
            case: list[dict] = []
            for splits in sorted({dflt, min(16, 2 * dflt)}):
                for bn in (32, 64, 128):
                    for warps in (4, 8):
                        for stages in (2, 3, 4):
                            try:
                                ms = triton.testing.do_bench_cudagraph(
                                    lambda q=q, c=cache, t=tables, n=lens, o=out, sp=splits, bn=bn, w=warps, st=stages,
                                    sc=d**-0.5: tk.paged_decode_attention(q, c, 0, t, n, sc, o, sp, bn, w, st),
                                    rep=20, return_mode="median")
                                r: dict = {"us": ms * 1e3, "vs_copy": kv / (ms / 1e3) / bandwidth}
                            except Exception as e:  # an out-of-resources config is a result too
                                r = {"error": repr(e)[:200]}
                            case.append({"heads": name, "batch": b, "context": ctx, "splits": splits, "block_n": bn,
                                         "warps": warps, "stages": stages, "default_splits": dflt, **r})
            rows += case
            timed = [r for r in case if "us" in r]
            best = min(timed, key=lambda r: r["us"])
            base = next(r for r in timed if (r["splits"], r["block_n"], r["warps"], r["stages"]) == (dflt, 64, 4, 2))
            print(f"  decode {name} heads b{b} ctx {ctx}: defaults ({dflt} splits, 64/4/2) {base['us']:.1f} us "
                  f"({base['vs_copy']:.2f} of copy); best {best['splits']} splits, {best['block_n']}/{best['warps']}/"
                  f"{best['stages']} {best['us']:.1f} us ({best['vs_copy']:.2f})", flush=True)
            del cache
    return rows


def _graph_time(fns, reps: int = 5) -> float:
    """Seconds per call of ``fns`` (a list of closures, run back to back) replayed in one CUDA graph; median."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(fns))
    del g
    return sorted(times)[reps // 2]


def _torch_pick(x: torch.Tensor, temp: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor,
                nucleus: bool) -> torch.Tensor:
    """The peer: PyTorch's ops over the whole vocabulary (the sampler's path before its kernels): with ``nucleus``,
    a sort for top-p; without, the inverse CDF alone."""
    kept = (x / temp).softmax(-1)
    if nucleus:
        sp, si = kept.sort(dim=-1, descending=True)
        sp = sp.masked_fill(sp.cumsum(-1) - sp >= top_p, 0.0)
        kept = torch.zeros_like(kept).scatter_(1, si, sp)
    cdf = kept.cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=x.shape[1] - 1)


def pick_speed(bandwidth: float, rows: int = 64) -> list[dict]:
    """``triton_ops.pick_full`` alone (the sampler's pick for rows with no top_k: what an OpenAI client sends) at
    ``rows`` rows of standard-normal logits, the 1B's and SmolLM2's vocabularies, temperature 1 alone and with
    top_p 0.9, in a CUDA graph; against PyTorch's ops on the same rows (a sort for top-p) and against one read of
    the logits at the copy bandwidth."""
    from common import sampler as sm
    from common import triton_ops

    out = []
    for name, vocab in (("Llama-3.2-1B", 128256), ("SmolLM2", 49152)):
        x = torch.randn(rows, vocab, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
        for top_p in (1.0, 0.9):
            prm = torch.tensor([sm._PAD_ROW] * rows, dtype=torch.float32)
            prm[:, sm._TOPP] = top_p
            prm[:, sm._U] = torch.rand(rows, generator=torch.Generator().manual_seed(1))
            prm = prm.cuda()
            cols = (sm._TEMP, sm._TOPP, sm._MINP, sm._U)
            ours = _graph_time([functools.partial(triton_ops.pick_full, x, prm, cols, top_p < 1, False)] * 10)
            peer = _graph_time([functools.partial(_torch_pick, x, prm[:, sm._TEMP:sm._TEMP + 1],
                                                  prm[:, sm._TOPP:sm._TOPP + 1], prm[:, sm._U:sm._U + 1],
                                                  top_p < 1)] * 3)
            limit = x.numel() * 4 / bandwidth
            r = {"vocab": name, "rows": rows, "top_p": top_p, "us": ours * 1e6, "torch_us": peer * 1e6,
                 "read_limit_us": limit * 1e6}
            print(f"  pick {name} ({vocab}), {rows} rows, top_p {top_p}: {r['us']:.1f} us (PyTorch's ops "
                  f"{r['torch_us']:.0f} us, one read of the logits {r['read_limit_us']:.1f} us)", flush=True)
            out.append(r)
    return out


def tune(bandwidth: float) -> dict:
    """Sweeps for the fast path's launch parameters against cuBLAS on the Llama-3.1-8B matrices (CUDA graphs,
    weights rotated past the L2): the batch-1 GEMV, split-K o_proj/down at 16 and 64 rows; and the
    decode-attention kernel's tile / warps / stages (:func:`decode_params`)."""

    from common import triton_ops as tk

    out: dict = {"gemv": [], "decode": []}
    shapes = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    splitk = [(64, 128, 4, 4, 4), (64, 128, 2, 4, 4), (32, 128, 4, 4, 4), (64, 64, 8, 4, 4), (128, 64, 4, 4, 4),
              (32, 256, 2, 4, 3), (64, 128, 8, 4, 3), (32, 128, 8, 4, 4)]
    for name, (n, k) in shapes.items():
        nbytes = n * k * 2
        copies = max(1, -(-(768 << 20) // nbytes))
        ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        for m in (1, 16, 64):
            if m > 1 and name not in ("o_proj", "down"):
                continue
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = torch.nn.functional.linear(x, ws[0])
            row = {"matrix": name, "n": n, "k": k, "m": m}
            t = _graph_time([lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in ws])
            row["cublas_us"], row["cublas_vs_copy"] = t * 1e6, nbytes / t / bandwidth
            trials: list[tuple[str, float, float]] = []  # (config, relative error, seconds per call)
            if m == 1:
                gcfg = tk.gemv_config(n)
                trials.append((str(gcfg), _rel(tk.gemv(x, ws[0], config=gcfg), ref),
                               _graph_time([lambda w=w, c=gcfg, x=x: tk.gemv(x, w, config=c) for w in ws])))
            else:
                for scfg in splitk:
                    trials.append((str(scfg), _rel(tk.splitk_mm(x, ws[0], scfg).sum(0), ref),
                                   _graph_time([lambda w=w, c=scfg, x=x: tk.splitk_mm(x, w, c) for w in ws])))
            best: tuple[str, float] | None = None
            for cfg, err, t in trials:
                row[cfg] = {"us": t * 1e6, "vs_copy": nbytes / t / bandwidth, "rel_err": err}
                if err < 1e-2 and (best is None or t < best[1]):
                    best = (cfg, t)
            assert best is not None, f"{name} m={m}: no config within 1e-2 of cuBLAS"
            row["best"], row["best_us"] = best[0], best[1] * 1e6
            out["gemv"].append(row)
            print(f"  {name} m={m}: cuBLAS {row['cublas_us']:.1f} us ({row['cublas_vs_copy']:.2f} of copy), best "
                  f"Triton {row['best']} {row['best_us']:.1f} us ({nbytes / best[1] / bandwidth:.2f})", flush=True)
        del ws
    for m in (16, 64):  # the one split-K config that is best summed over o_proj + down
        rows = [r for r in out["gemv"] if r["m"] == m]
        tot = {str(c): sum(r[str(c)]["us"] for r in rows) for c in splitk}
        best_cfg = min(tot, key=tot.__getitem__)
        out[f"splitk_best_m{m}"] = {"config": best_cfg, "us": tot[best_cfg],
                                    "cublas_us": sum(r["cublas_us"] for r in rows)}
        print(f"  split-K m={m}: best config {best_cfg}: {tot[best_cfg]:.1f} us for o_proj + down vs cuBLAS "
              f"{out[f'splitk_best_m{m}']['cublas_us']:.1f} us", flush=True)
    out["decode"] = decode_params(bandwidth)  # the decode kernel's tile / warps / stages
    return out


# the models whose decode-step projections ``projections`` times (dims from common/model_configs)
PROJECTION_MODELS = ("smollm2-135m", "llama-3.2-1b", "llama-3.1-8b")


def _splitk_configs(k: int) -> list[tuple[int, int, int, int, int]]:
    """Split-K launch configs (BLOCK_N, BLOCK_K, splits, warps, stages) whose splits divide ``k``."""
    out = []
    for bn in (32, 64, 128):
        for bk in (64, 128):
            for splits in (1, 2, 3, 4, 6, 8, 12, 16):
                if k % (splits * bk) == 0 and k // splits >= bk:
                    out.append((bn, bk, splits, 4, 4))
    return out


def projections(bandwidth: float, rows: tuple[int, ...] = (32, 64)) -> list[dict]:
    """A decode step's projections at ``rows`` rows for each of ``PROJECTION_MODELS``, cuBLAS against the split-K
    Triton GEMM (best of ``_splitk_configs``), in CUDA graphs with the weights rotated past the L2. o_proj and down
    are timed as the path they sit on (the GEMM then the residual add + RMSNorm that sums split-K partials; down
    after its SiLU·mul); qkv, gate_up and lm_head as the GEMM alone (a split-K output there has no consumer that
    sums it, so their split-K times are what a fused consumer could at best reach)."""
    from common import triton_ops as tk
    from common.loader import load_model_source

    out = []
    for model in PROJECTION_MODELS:
        cfg = load_model_source(f"dummy:{model}").config
        hid, inter = cfg.hidden_size, cfg.intermediate_size
        shapes = {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, hid),
                  "o_proj": (hid, cfg.num_heads * cfg.head_dim), "gate_up": (2 * inter, hid), "down": (hid, inter),
                  "lm_head": (cfg.vocab_size, hid)}
        for name, (n, k) in shapes.items():
            nbytes = n * k * 2
            ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(max(1, -(-(768 << 20) // nbytes)))]
            norm_w = torch.ones(n, device="cuda", dtype=torch.bfloat16)
            for m in rows:
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                gu = torch.randn(m, 2 * k, device="cuda").to(torch.bfloat16) if name == "down" else None
                res = torch.randn(m, n, device="cuda").to(torch.bfloat16)
                ref = torch.nn.functional.linear(x, ws[0])

                def path(gemm, name=name, x=x, gu=gu, res=res, norm_w=norm_w):
                    if name not in ("o_proj", "down"):
                        return lambda wt: gemm(x, wt)

                    def run(wt):
                        a = tk.silu_mul(gu) if gu is not None else x
                        return tk.add_rms_norm(res, gemm(a, wt), norm_w, 1e-5)
                    return run
                cub = path(lambda a, w: torch.nn.functional.linear(a, w))
                t_cub = _graph_time([lambda w=w, f=cub: f(w) for w in ws])
                best: tuple[str, float] | None = None
                for scfg in _splitk_configs(k):
                    if _rel(tk.splitk_mm(x, ws[0], scfg).sum(0), ref) > 1e-2:
                        continue
                    f = path(lambda a, w, c=scfg: tk.splitk_mm(a, w, c))
                    t = _graph_time([lambda w=w, f=f: f(w) for w in ws])
                    if best is None or t < best[1]:
                        best = (str(scfg), t)
                row = {"model": model, "matrix": name, "n": n, "k": k, "m": m, "layers": cfg.num_layers,
                       "timed": "path" if name in ("o_proj", "down") else "gemm",
                       "weight_read_us": nbytes / bandwidth * 1e6, "cublas_us": t_cub * 1e6,
                       "splitk": best[0] if best else None, "splitk_us": best[1] * 1e6 if best else None}
                out.append(row)
                print(f"  {model} {name} {n}x{k} m={m} ({row['timed']}): cuBLAS {row['cublas_us']:.1f} us, "
                      f"split-K {row['splitk_us'] or float('nan'):.1f} us {row['splitk']}, "
                      f"weights at copy {row['weight_read_us']:.1f} us", flush=True)
            del ws
    return out


_MODES = ("graphs", "eager", "portable")


def _set_mode(eng, mode: str, graphs) -> None:
    """CUDA graphs + Triton kernels | Triton kernels without graphs | the portable PyTorch path, same engine."""
    from common.model import PORTABLE
    from common.model_cuda import CUDA_FAST

    r = eng.runner
    r.graphs = graphs if mode == "graphs" else None
    r.fast_cuda = mode != "portable"
    r.model.backend = CUDA_FAST if mode != "portable" else PORTABLE


def engine_8b():
    from common.config import EngineConfig
    from common.engine import LLMEngine

    global _ENGINE_8B
    if _ENGINE_8B is None:
        t0 = time.perf_counter()
        _ENGINE_8B = LLMEngine.from_spec(
            "dummy:llama-3.1-8b",
            EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=64, max_model_len=8192,
                         max_num_batched_tokens=4096, gpu_memory_utilization=0.85),
        )
        torch.cuda.synchronize()
        gr = _ENGINE_8B.runner.graphs
        print(f"  8B engine ready in {time.perf_counter() - t0:.1f} s, {_ENGINE_8B.runner.num_blocks} KV blocks, "
              f"graphs {gr.sizes if gr else None} captured in {gr.capture_seconds if gr else 0:.1f} s", flush=True)
    return _ENGINE_8B


def decode_speed(bandwidth: float, batch: int, ctx: int, steps: int = 32,
                 splitk_config: tuple[int, int, int, int, int] | None = None) -> list[dict]:
    """Engine decode steps (schedule + execute + sample + update) in each mode, same sequences, against the limit."""
    from common.sampling import SamplingParams

    eng = engine_8b()
    graphs = eng.runner.graphs
    m = eng.model_cfg
    g = torch.Generator().manual_seed(batch)
    p = SamplingParams(max_tokens=(len(_MODES) + 1) * (steps + 3) + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"b{batch}-{i}", torch.randint(0, m.vocab_size, (ctx,), generator=g).tolist(), p)
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in [*eng.scheduler.running, *eng.scheduler.waiting]) \
            or eng.scheduler.waiting:
        eng.step()
    weight_bytes = (m.num_params() - m.vocab_size * m.hidden_size) * 2  # every matrix but the embedding table
    rows = []
    from common import triton_ops as tk

    modes = list(_MODES)
    default = (tk.SPLITK_MAX_M, tk.SPLITK_CONFIG)
    if batch > 1 and splitk_config is not None:
        modes.insert(1, "graphs-splitk")
    for mode in modes:
        if mode == "graphs-splitk":  # recapture with split-K o_proj/down in place of the default, then back
            assert splitk_config is not None  # the mode is only listed with a config
            tk.SPLITK_MAX_M, tk.SPLITK_CONFIG = 64, splitk_config
            graphs.capture()
        elif mode == "eager" and "graphs-splitk" in modes:
            tk.SPLITK_MAX_M, tk.SPLITK_CONFIG = default
            graphs.capture()
        _set_mode(eng, mode.split("-")[0], graphs)
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
        ctx0 = sum(s.num_tokens for s in eng.scheduler.running)
        replays0 = graphs.replays if graphs else 0
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        step_s = (time.perf_counter() - t0) / steps
        kv_tokens = ctx0 + batch * steps / 2  # mean context over the window, summed over sequences
        kv_bytes = kv_tokens * 2 * m.num_layers * m.kv_size * 2
        limit_s = (weight_bytes + kv_bytes) / bandwidth
        row = {"mode": mode, "batch": batch, "context": ctx, "step_ms": step_s * 1e3, "limit_ms": limit_s * 1e3,
               "ratio": step_s / limit_s, "tok_s": batch / step_s, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes}
        if mode.startswith("graphs") and graphs is not None:
            row["graph_replays_in_window"] = graphs.replays - replays0
            from common.cuda_graphs import padded_size

            gph = graphs.graphs[(padded_size(graphs.sizes, batch), False)]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                gph.replay()
            end.record()
            end.synchronize()
            row["graph_replay_ms"] = start.elapsed_time(end) / 10
            row["graph_replay_ratio"] = row["graph_replay_ms"] / row["limit_ms"]
        rows.append(row)
        print(f"  {mode:8s} step {row['step_ms']:.2f} ms, limit {row['limit_ms']:.2f} ms, {row['ratio']:.2f}x"
              + (f"; graph replay alone {row['graph_replay_ms']:.2f} ms" if "graph_replay_ms" in row else ""),
              flush=True)
    _set_mode(eng, "graphs", graphs)
    while eng.has_unfinished():
        eng.step()
    return rows


def _matmul_params(m) -> tuple[int, int]:
    """(the LM head's weights, every matmul weight of the layers): the FLOP counts' terms (norms: negligible)."""
    lm_rows = m.vocab_size * m.hidden_size
    return lm_rows, m.num_params() - lm_rows * (1 if m.tie_word_embeddings else 2)


def _timed_prompt_step(eng, rid: str, n: int, g: torch.Generator) -> float:
    """Add a random ``n``-token prompt (one output token) and time the engine step that runs it, in seconds."""
    from common.sampling import SamplingParams

    eng.add_request(rid, torch.randint(0, eng.model_cfg.vocab_size, (n,), generator=g).tolist(),
                    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def prefill_speed(rate: float, n: int = 4096, reps: int = 3) -> list[dict]:
    """One n-token prompt, one engine step (prefill + first token), against FLOPs ÷ the measured matmul rate."""

    eng = engine_8b()
    graphs = eng.runner.graphs
    m = eng.model_cfg
    lm_rows, matmul_params = _matmul_params(m)
    flops = 2 * n * matmul_params + 2 * lm_rows + 2 * n * (n + 1) * m.head_dim * m.num_heads * m.num_layers
    limit_s = flops / rate
    g = torch.Generator().manual_seed(n)
    rows = []
    for mode in ("graphs", "portable"):
        _set_mode(eng, mode, graphs)
        times = []
        for i in range(reps + 1):
            times.append(_timed_prompt_step(eng, f"pf-{mode}-{i}", n, g))
            while eng.has_unfinished():
                eng.step()
        t = sorted(times[1:])[reps // 2]
        rows.append({"mode": "fast" if mode == "graphs" else mode, "tokens": n, "ms": t * 1e3, "flops": flops,
                     "limit_ms": limit_s * 1e3, "ratio": t / limit_s, "tok_s": n / t})
        print(f"  prefill {rows[-1]['mode']:8s} {t * 1e3:.1f} ms, limit {limit_s * 1e3:.1f} ms, {t / limit_s:.2f}x",
              flush=True)
    _set_mode(eng, "graphs", graphs)
    return rows


def mixed_speed(rate: float, bandwidth: float, prompt: int = 1024, batch: int = 63, ctx: int = 1024,
                reps: int = 5) -> list[dict]:
    """A step that carries a whole ``prompt``-token prompt beside ``batch`` decodes at ``ctx`` tokens (what a served
    closed loop runs when a finished request is replaced): a CUDA graph replay (prompt tokens as rows, the prompt
    kernel) against the eager fast path, same engine and sequences. Limit: the step's matmul FLOPs ÷ the measured
    rate, or its weight + KV bytes ÷ the copy bandwidth, whichever is larger."""
    from common.sampling import SamplingParams

    eng = engine_8b()
    graphs = eng.runner.graphs
    m = eng.model_cfg
    g = torch.Generator().manual_seed(prompt + batch)
    p = SamplingParams(max_tokens=4 * (reps + 2) + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"mx-{i}", torch.randint(0, m.vocab_size, (ctx,), generator=g).tolist(), p)
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    lm_rows, matmul_params = _matmul_params(m)
    tokens = prompt + batch
    flops = (2 * tokens * matmul_params + 2 * (batch + 1) * lm_rows
             + 2 * prompt * (prompt + 1) * m.head_dim * m.num_heads * m.num_layers
             + 4 * batch * ctx * m.head_dim * m.num_heads * m.num_layers)
    kv_bytes = batch * ctx * 2 * m.num_layers * m.kv_size * 2
    limit_s = max(flops / rate, (matmul_params * 2 + kv_bytes) / bandwidth)
    rows = []
    for mode in ("graphs", "eager"):
        _set_mode(eng, mode, graphs)
        times = []
        for i in range(reps + 1):
            pr0 = graphs.prompt_replays if graphs else 0
            times.append(_timed_prompt_step(eng, f"mx-{mode}-{i}", prompt, g))
            replayed = graphs is not None and graphs.prompt_replays > pr0
            assert replayed == (mode == "graphs"), f"{mode}: graph replayed {replayed}"
        t = sorted(times[1:])[reps // 2]
        rows.append({"mode": mode, "prompt": prompt, "decodes": batch, "context": ctx, "step_ms": t * 1e3,
                     "limit_ms": limit_s * 1e3, "ratio": t / limit_s, "flops": flops})
        print(f"  mixed step ({prompt}-token prompt + {batch} decodes) {mode:6s} {t * 1e3:.2f} ms, limit "
              f"{limit_s * 1e3:.2f} ms, {t / limit_s:.2f}x", flush=True)
    _set_mode(eng, "graphs", graphs)
    for r in list(eng.scheduler.running):
        eng.abort(r.request_id)
    while eng.has_unfinished():
        eng.step()
    return rows


_ENGINE_8B: LLMEngine | None = None


def _w1_prompts(vocab: int, n: int = 256) -> list[list[int]]:
    """W1: 256 prompts, lengths uniform in [100, 1024] (seed 0), random token ids."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(100, 1025, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


def w1_throughput(spec: str = "dummy:llama-3.1-8b", n_out: int = 256, with_hf: bool = True) -> dict:
    """Workload W1 (256 output tokens each, EOS ignored): our engine (CUDA graphs, up to 256 sequences in flight)
    against transformers' ``generate_batch`` (continuous batching) on the same card, output tokens/s."""
    import gc

    from common.config import EngineConfig
    from common.engine import LLMEngine
    from common.sampling import SamplingParams

    global _ENGINE_8B
    _ENGINE_8B = None
    gc.collect()
    torch.cuda.empty_cache()
    eng = LLMEngine.from_spec(spec, EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=256, max_model_len=2048,
                                                 max_num_batched_tokens=4096, gpu_memory_utilization=0.85))
    m = eng.model_cfg
    prompts = _w1_prompts(m.vocab_size)
    p = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    eng.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    torch.cuda.synchronize()
    graphs = eng.runner.graphs
    t0 = time.perf_counter()
    for i, pr in enumerate(prompts):
        eng.add_request(f"w1-{i}", pr, p)
    steps = []  # (seconds, replayed a graph, tokens out)
    while eng.has_unfinished():
        r0 = graphs.replays if graphs else 0
        ts = time.perf_counter()
        n = len(eng.step())
        steps.append((time.perf_counter() - ts, (graphs.replays if graphs else 0) > r0, n))
    torch.cuda.synchronize()
    ours_s = time.perf_counter() - t0
    ours_tokens = sum(n for _, _, n in steps)
    ours_tok_s = ours_tokens / ours_s
    g_steps = [x for x in steps if x[1]]
    e_steps = [x for x in steps if not x[1]]
    slowest = sorted(((round(x[0], 4), x[1], x[2]) for x in steps), reverse=True)[:10]
    res: dict[str, object] = {  # for the JSON: what is sliced or divided below has a variable of its own
        "prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": ours_tokens,
        "seconds": ours_s, "tok_s": ours_tok_s, "steps": len(steps),
        "graph_steps": len(g_steps), "graph_steps_seconds": sum(x[0] for x in g_steps),
        "eager_steps": len(e_steps), "eager_steps_seconds": sum(x[0] for x in e_steps),
        "slowest_steps": slowest, "step_ms": [round(x[0] * 1e3, 2) for x in steps]}
    print(f"  tokenmill W1: {ours_tokens} output tokens in {ours_s:.1f} s = {ours_tokens / ours_s:.0f} tok/s; "
          f"{len(g_steps)} graph steps {res['graph_steps_seconds']:.1f} s, {len(e_steps)} eager (prefill) steps "
          f"{res['eager_steps_seconds']:.1f} s; slowest {slowest[:5]}", flush=True)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    if not with_hf:
        return res
    try:
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

        hf_cfg = LlamaConfig(
            vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
            num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
            max_position_embeddings=4096, rms_norm_eps=m.rms_norm_eps,
            rope_parameters={"rope_theta": m.rope_theta, "rope_type": "default"},  # transformers 5's keyword for it
            tie_word_embeddings=m.tie_word_embeddings,
        )
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                hf = LlamaForCausalLM(hf_cfg).eval()
        finally:
            torch.set_default_dtype(prev)
        gcfg = GenerationConfig(max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
        hf.generate_batch(inputs=prompts[:8], generation_config=gcfg, max_new_tokens=8)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate_batch(inputs=prompts, generation_config=gcfg)
        torch.cuda.synchronize()
        hf_s = time.perf_counter() - t0
        hf_tokens = sum(len(r.generated_tokens) for r in out.values())
        hf_tok_s = hf_tokens / hf_s
        res["transformers"] = {"output_tokens": hf_tokens, "seconds": hf_s, "tok_s": hf_tok_s}
        res["speedup"] = speedup = ours_tok_s / hf_tok_s
        print(f"  transformers generate_batch W1: {hf_tokens} output tokens in {hf_s:.1f} s = {hf_tokens / hf_s:.0f} "
              f"tok/s; tokenmill {speedup:.1f}x", flush=True)
        del hf
    except Exception as e:  # the peer failing is a result to report, not a crash of the whole run
        res["transformers_error"] = repr(e)[:500]
        print(f"  transformers generate_batch failed: {e!r}", flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    return res


def profile_mixed_steps(n_prompts: int = 96) -> None:
    """Where a mixed (prefill chunk + decodes) step of W1 spends its time: torch.profiler over two such steps."""
    from torch.profiler import ProfilerActivity, profile

    from common.config import EngineConfig
    from common.engine import LLMEngine
    from common.sampling import SamplingParams

    eng = LLMEngine.from_spec("dummy:llama-3.1-8b", EngineConfig(
        device="cuda", dtype="bfloat16", max_num_seqs=256, max_model_len=2048, max_num_batched_tokens=4096,
        gpu_memory_utilization=0.85))
    prompts = _w1_prompts(eng.model_cfg.vocab_size)[:n_prompts]
    for i, pr in enumerate(prompts):
        eng.add_request(f"p-{i}", pr, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        t0 = time.perf_counter()
        eng.step()
        print(f"  mixed step {time.perf_counter() - t0:.3f} s", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            eng.step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60), flush=True)
    print(ka.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60), flush=True)


SECTIONS = ("kernels", "pick", "decode-params", "tune", "projections", "decode", "mixed", "prefill", "profile", "w1", "w1-ours")
_MOVED = {"small": "tests/gpu/test_engine_fast_path.py"}  # correctness sections now in the GPU test suite


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=None, help="unused (the SmolLM2 check moved to tests/gpu); kept so that "
                                                 "older command lines still run")
    ap.add_argument("--json", default=None, help="write the results here (after every section)")
    ap.add_argument("--sections", default="kernels,decode,prefill,w1",
                    help=f"comma-separated, of: {', '.join(SECTIONS)}")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    for name in sorted(sections & _MOVED.keys()):
        print(f"section {name!r} is a test now: {_MOVED[name]} (make test-gpu); skipped", flush=True)
    unknown = sections - set(SECTIONS) - _MOVED.keys()
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    dev = torch.cuda.get_device_name()
    res: dict = {"device": dev, "torch": torch.__version__}

    def save() -> None:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)

    print(f"device: {dev}", flush=True)
    bw = res["copy_bandwidth"] = copy_bandwidth()
    rate = res["matmul_bf16_flops"] = matmul_rate()
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s; bf16 matmul: {rate / 1e12:.0f} TFLOP/s", flush=True)
    save()
    if "kernels" in sections:
        res["decode_kernel"] = time_decode_kernel(bw)
        for r in res["decode_kernel"]:
            splits = f"{r['splits']}" if r["splits"] else f"default ({r['default_splits']})"
            print(f"  decode kernel {r['heads']} heads, b{r['batch']} ctx {r['context']} splits {splits}: "
                  f"{r['us']:.1f} us, {r['GBps']:.0f} GB/s ({r['vs_copy_bw']:.2f} of copy)", flush=True)
        save()
    if "pick" in sections:
        res["pick"] = pick_speed(bw)
        save()
    if "decode-params" in sections:
        res["decode_params"] = decode_params(bw)
        save()
    if "tune" in sections:
        res["tune"] = tune(bw)
        save()
    if "projections" in sections:
        res["projections"] = projections(bw)
        save()
    if "decode" in sections:
        res["decode"] = []
        for batch, ctx in ((1, 128), (64, 1024)):
            print(f"dummy Llama-3.1-8B bf16 decode, batch {batch}, context {ctx} ...", flush=True)
            sk = res.get("tune", {}).get("splitk_best_m64")
            res["decode"] += decode_speed(bw, batch, ctx, splitk_config=ast.literal_eval(sk["config"]) if sk else None)
            save()
    if "mixed" in sections:
        print("dummy Llama-3.1-8B bf16, a 1,024-token prompt beside 63 decodes ...", flush=True)
        res["mixed"] = mixed_speed(rate, bw)
        save()
    if "prefill" in sections:
        print("dummy Llama-3.1-8B bf16 prefill, 4096 tokens ...", flush=True)
        res["prefill"] = prefill_speed(rate)
        save()
    if "profile" in sections:
        profile_mixed_steps()
    if "w1" in sections or "w1-ours" in sections:  # w1-ours: without the transformers peer (~4 min of device)
        print("W1 (256 prompts of 100-1024 tokens, 256 output tokens each, EOS ignored), Llama-3.1-8B dummy ...",
              flush=True)
        res["w1"] = w1_throughput(with_hf="w1" in sections)
        save()
    print()
    print("| card | mode | batch | context | step ms | limit ms | ratio | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res.get("decode", []):
        print(f"| {dev} | {r['mode']} | {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {r['limit_ms']:.2f} | "
              f"{r['ratio']:.2f}x | {r['tok_s']:.0f} |")
    for r in res.get("mixed", []):
        print(f"| {dev} | mixed {r['mode']} | {r['decodes']} + prompt {r['prompt']} | {r['context']} | "
              f"{r['step_ms']:.2f} | {r['limit_ms']:.2f} | {r['ratio']:.2f}x | |")
    for r in res.get("prefill", []):
        print(f"| {dev} | prefill {r['mode']} | 1 | {r['tokens']} | {r['ms']:.1f} | {r['limit_ms']:.1f} | "
              f"{r['ratio']:.2f}x | {r['tok_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
