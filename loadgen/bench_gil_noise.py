"""``python -m loadgen.bench_gil_noise``: how much a second Python thread of the engine's process lengthens its steps.

With its engine on a thread (``worker_engine_process: false``; by default the engine has a process of its own), a
decode worker runs its gRPC loop and detokenizer on other threads of the engine's process; all take the GIL. This
runs the engine alone in a closed loop (``--concurrency`` requests of ``--input-len`` / ``--output-len`` tokens,
sampled: temperature 1, top_p 0.9, top_k 50, repetition_penalty 1.1, as ``tokenmill bench gpu-serving``), then the
same beside one thread that, after every step, runs Python for a set time (as the detokenizer does with a step's
outputs), at several switch intervals, and once with that thread giving the GIL up every 50 µs. It prints the mean
step (the engine's own counters) of each run.

Run: ``python -m loadgen.bench_gil_noise --model dummy:llama-3.2-1b --tokenizer DIR`` (CUDA; ``--device cpu`` runs
it too, where a step's compute dwarfs the effect).
"""

from __future__ import annotations

import argparse
import dataclasses
import queue
import sys
import threading
import time
from typing import Any

import numpy as np


def _noise(q: queue.SimpleQueue, work_s: list[float], yield_s: list[float]) -> None:
    """After each step's outputs: Python for ``work_s[0]`` seconds (giving the GIL up every ``yield_s[0]`` if set)."""
    while True:
        if q.get() is None:
            return
        while not q.empty():  # drain, as the detokenizer does
            if q.get_nowait() is None:
                return
        end = time.perf_counter() + work_s[0]
        last = time.perf_counter()
        x = 0
        while (now := time.perf_counter()) < end:
            x += 1
            if yield_s[0] and now - last > yield_s[0]:
                time.sleep(0)
                last = now


def run(a: argparse.Namespace) -> int:
    from common.cluster_config import ClusterConfig
    from common.engine import LLMEngine
    from common.loader import load_model_source
    from loadgen.bench_gpu_serving import SAMPLINGS, engine_closed_loop, engine_counters
    from loadgen.workloads import PromptBuilder, RequestSpec

    cfg = dataclasses.replace(ClusterConfig().engine, device=a.device, max_num_seqs=a.concurrency,
                              dtype="bfloat16" if a.device == "cuda" else "float32")
    print(f"loading {a.model} ...", flush=True)
    eng = LLMEngine(load_model_source(a.model, a.tokenizer), cfg)
    assert eng.tokenizer is not None
    builder = PromptBuilder(eng.tokenizer)
    rng = np.random.default_rng(0)
    specs = [RequestSpec(index=i, prompt_ids=tuple(builder.ids(a.input_len, rng)), prompt_text="",
                         input_len=a.input_len, output_len=a.output_len) for i in range(a.requests)]
    q: queue.SimpleQueue[Any] = queue.SimpleQueue()
    on = [False]
    work_s, yield_s = [0.0], [0.0]
    real_step = eng.step

    def step() -> Any:
        outs = real_step()
        if on[0]:
            q.put(outs)
        return outs

    eng.step = step  # type: ignore[method-assign]
    th = threading.Thread(target=_noise, args=(q, work_s, yield_s), daemon=True)
    th.start()
    sampled = SAMPLINGS[1]
    engine_closed_loop(eng, specs[: a.concurrency], sampled, a.concurrency, "warm")
    rows = []

    def one(label: str) -> None:
        c0 = engine_counters(eng)
        t = time.perf_counter()
        engine_closed_loop(eng, specs, sampled, a.concurrency, label)
        wall = time.perf_counter() - t
        c = {k: v - c0[k] for k, v in engine_counters(eng).items()}
        n = c["engine_steps"]
        rows.append((label, n, 1000 * c["engine_step_seconds"] / n, c["engine_step_decode_rows"] / n, wall))
        print(f"  {label}: {rows[-1][2]:.2f} ms a step", flush=True)

    default_si = sys.getswitchinterval()
    sys.setswitchinterval(a.switch_interval_ms / 1000)
    one("alone")
    on[0] = True
    for w in a.noise_us:
        work_s[0] = w * 1e-6
        one(f"beside {w:g} µs of Python a step")
    work_s[0] = a.noise_us[len(a.noise_us) // 2] * 1e-6
    for si in a.switch_intervals_ms:
        sys.setswitchinterval(si / 1000)
        one(f"beside {work_s[0] * 1e6:g} µs, switch interval {si:g} ms")
    sys.setswitchinterval(a.switch_interval_ms / 1000)
    yield_s[0] = 50e-6
    one(f"beside {work_s[0] * 1e6:g} µs, giving the GIL up every 50 µs")
    yield_s[0] = 0.0
    on[0] = False
    one("alone again")
    q.put(None)
    sys.setswitchinterval(default_si)
    base = rows[0][2]
    print(f"\n{a.model} on {a.device}, {a.concurrency} in flight, {a.input_len} in / {a.output_len} out, sampled; "
          f"switch interval {a.switch_interval_ms:g} ms unless named\n")
    print("| run | steps | step ms mean | ÷ alone | decode rows / step | wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, n, ms, r, wall in rows:
        print(f"| {label} | {n:,.0f} | {ms:.2f} | {ms / base:.2f}× | {r:.1f} | {wall:.2f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dummy:llama-3.2-1b")
    p.add_argument("--tokenizer", default="smollm2", help="tokenizer spec (a dummy model has none)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=192)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--noise-us", type=float, nargs="+", default=[400, 800, 1600],
                   help="the noise thread's Python time after each step, one run each (µs)")
    p.add_argument("--switch-interval-ms", type=float, default=0.5, help="the workers' (default 0.5)")
    p.add_argument("--switch-intervals-ms", type=float, nargs="*", default=[0.1, 0.02, 5.0],
                   help="other switch intervals, each a run beside the middle noise")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
