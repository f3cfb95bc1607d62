"""``python -m loadgen.bench_step_rows``: what each decoding row adds to an engine step's host time.

A step's host work (scheduling, staging the inputs, queueing the pick, handing the tokens out) is Python that grows
with the rows; on a GPU whose step for a small model takes about a millisecond it is the step. Every row a
neighbour adds (a batch tenant's flood, docs/benchmarks.md "Noisy neighbour") lengthens every other row's step by
that much. This runs the engine alone with ``R`` requests decoding (nothing else: no prompts in the steps), for
each ``R`` of ``--rows``, greedy and sampled (temperature 1, top_p 0.9, top_k 50, repetition_penalty 1.1, as
``tokenmill bench gpu-serving``), and times ``--steps`` steps: the median step and its phases (the engine's own
counters, ``LLMEngine.step_phases``), each window with requests of its own, started afresh (a step's attention
grows with the contexts, so windows of longer-lived requests would drift). The scheduler's two ways of scheduling a plain decode, inline (the default)
and through its general path (``Scheduler.fast_decodes = False``), alternate in ``--rounds`` rounds in the same
run; the table gives each one's median round, the host's part of a step (every phase but the wait for the device:
with async scheduling a step takes the longer of it and the device's time), and the cost of a row: the slopes of
the step and of the host's part against the rows (where the device bounds the step, only the host's slope is the
host's cost).

Run: ``python -m loadgen.bench_step_rows`` (the embedded SmolLM2 on CUDA where there is one, else the no-op model on
the CPU: the host's work alone); ``--model dummy:llama-3.2-1b --tokenizer smollm2`` for a 1B's shape. ``--samplings``
also takes ``default`` (temperature 1: an OpenAI client's defaults) and ``nucleus`` (top_p 0.9, no top_k): what an
OpenAI client sends, which takes the sampler's whole-vocabulary path rather than its top-k candidates, and ``mixed``
(every other row the served benchmark's sampling, with top_k 50, the others top_p 0.9 alone: both kinds of client in
one batch, which also takes the whole-vocabulary path). ``--kernels N``
then runs ``--steps`` steps at the most rows under torch.profiler and prints the wall time a step and the N kernels
with the most device time a step: where the device's part of a step goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Literal

from loadgen.bench_gpu_serving import SAMPLINGS, Sampling
from loadgen.bench_offline import _machine, _say, _source_state

PATHS = ("inline", "general")


@dataclasses.dataclass(frozen=True)
class MixedSampling:
    """Rows taking ``parts`` in turn (row i the ``i % len(parts)``-th): one batch of several clients' requests."""

    name: str
    parts: tuple[Sampling, ...]

    def params(self, max_tokens: int) -> tuple[Any, ...]:
        return tuple(s.params(max_tokens) for s in self.parts)


# beside the served benchmark's two: what an OpenAI client sends (it has no top_k): its defaults (temperature 1),
# and nucleus sampling (top_p 0.9); and a batch of both kinds of client, every other row the served benchmark's
# sampling (top_k 50) and the other top_p 0.9 alone
STEP_SAMPLINGS: tuple[Sampling | MixedSampling, ...] = (
    *SAMPLINGS, Sampling("default", 1.0), Sampling("nucleus", 1.0, top_p=0.9),
    MixedSampling("mixed", (SAMPLINGS[1], Sampling("nucleus", 1.0, top_p=0.9))))


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ``ys`` against ``xs``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def _window(eng: Any, ids: list[str], params: Any, input_len: int, steps: int) -> tuple[float, dict[str, float]]:
    """``ids`` added as new requests, every prompt computed and 10 steps decoded, then ``steps`` decode-only steps
    timed; the median step and each phase's mean per step (µs). The requests are aborted at the end (their blocks
    freed). Every window starts its requests afresh, so their contexts are as long in every window (a step's
    attention grows with them)."""
    _start(eng, ids, params, input_len)
    eng.reset_step_counters()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    n = max(1, eng.num_steps)
    phases = {k: v / n * 1e6 for k, v in eng.step_phases().items()}
    _end(eng, ids)
    return statistics.median(times) * 1e6, phases


def _start(eng: Any, ids: list[str], params: Any, input_len: int) -> None:
    """``ids`` added as new requests, every prompt computed and 10 steps decoded."""
    for i, rid in enumerate(ids):
        p = params[i % len(params)] if isinstance(params, tuple) else params  # a MixedSampling's rows in turn
        eng.add_request(rid, [(7 * i + j) % 1000 + 10 for j in range(input_len)], p)
    while any(len(eng._seqs[r].output_ids) < 2 for r in ids):  # every prompt computed and decoding
        eng.step()
    for _ in range(10):
        eng.step()


def _end(eng: Any, ids: list[str]) -> None:
    for rid in ids:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()


def kernel_profile(eng: Any, ids: list[str], params: Any, input_len: int, steps: int,
                   top: int) -> dict[str, Any]:
    """``steps`` decode-only steps of ``ids`` under torch.profiler: the wall time a step, and the ``top`` kernels by
    device time a step (on the CPU, the operators by their own CPU time), with their calls a step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = eng.runner.device.type == "cuda"
    _start(eng, ids, params, input_len)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        wall = time.perf_counter() - t
    _end(eng, ids)
    events = [e for e in prof.key_averages() if (e.device_time_total if cuda else e.self_cpu_time_total) > 0]
    us = (lambda e: e.device_time_total / steps) if cuda else (lambda e: e.self_cpu_time_total / steps)
    events.sort(key=us, reverse=True)
    return {"wall_us": wall / steps * 1e6, "total_us": sum(us(e) for e in events), "what": "device" if cuda else "cpu",
            "top": [{"name": e.key, "us": us(e), "calls": e.count / steps} for e in events[:top]]}


def measure(eng: Any, n_rows: int, params: Any, input_len: int, steps: int, rounds: int,
            paths: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``n_rows`` requests decoding, each path in each round (in turn first): the median over rounds of the median
    step (µs) and of each phase's mean per step (µs)."""
    got: dict[str, list[tuple[float, dict[str, float]]]] = {p: [] for p in paths}
    for r in range(rounds):
        for path in paths if r % 2 == 0 else paths[::-1]:
            eng.scheduler.fast_decodes = path == "inline"
            got[path].append(_window(eng, [f"rows{n_rows}-{r}-{path}-{i}" for i in range(n_rows)], params, input_len,
                                     steps))
    eng.scheduler.fast_decodes = True
    out = {}
    for path, runs in got.items():
        phases = {k: statistics.median(p[k] for _, p in runs) for k in runs[0][1]}
        out[path] = {"step_us": statistics.median(s for s, _ in runs),
                     "rounds_us": [round(s, 1) for s, _ in runs],
                     "host_us": sum(v for k, v in phases.items() if k != "wait"),  # the step but its device wait
                     "phases_us": phases}
    return out


def run(a: argparse.Namespace) -> int:
    import torch

    from common.cluster_config import ClusterConfig
    from common.engine import LLMEngine
    from common.loader import load_model_source
    from common.machine import default_dtype

    device: Literal["cpu", "cuda"] = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    noop = a.noop if a.noop is not None else device == "cpu"
    cfg = dataclasses.replace(ClusterConfig().engine, device=device, noop_model=noop, dtype=default_dtype(device),
                              max_num_seqs=max(a.rows), max_num_batched_tokens=max(2048, max(a.rows)))
    _say(f"loading {a.model} on {device}{' (no-op model: the host work alone)' if noop else ''} ...")
    eng = LLMEngine(load_model_source(a.model, a.tokenizer), cfg)
    max_tokens = min(eng.max_model_len - a.input_len - 1, a.steps + 64)  # a window's steps, and its prompts'

    results: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
    for s in STEP_SAMPLINGS:
        if s.name not in a.samplings:
            continue
        results[s.name] = {}
        for n in a.rows:
            _say(f"{s.name}, {n} rows: {a.rounds} rounds × {len(PATHS)} paths × {a.steps} steps")
            results[s.name][n] = measure(eng, n, s.params(max_tokens), a.input_len, a.steps, a.rounds, PATHS)
    kernels: dict[str, Any] = {}
    if a.kernels:
        n = max(a.rows)
        for s in STEP_SAMPLINGS:
            if s.name in a.samplings:
                _say(f"{s.name}, {n} rows: {a.steps} steps under torch.profiler")
                kernels[s.name] = kernel_profile(eng, [f"prof{n}-{s.name}-{i}" for i in range(n)],
                                                 s.params(max_tokens), a.input_len, a.steps, a.kernels)
    eng.close()
    device_name = torch.cuda.get_device_name() if device == "cuda" else _machine().get("cpu", "cpu")
    print(f"\n{a.model}{' (no-op model)' if noop else ''} on {device_name}, {cfg.dtype}, decode-only steps, "
          f"median of {a.rounds} rounds of {a.steps} steps\n")
    phases = list(next(iter(next(iter(results.values())).values()))["inline"]["phases_us"])
    print(f"| sampling | rows | scheduling | step µs | host µs | {' | '.join(phases)} | inline ÷ general |")
    print("|---|---:|---|---:|---:|" + "---:|" * len(phases) + "---:|")
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for name, by_rows in results.items():
        for n, r in by_rows.items():
            for path in PATHS:
                x = r[path]
                ratio = f"{r['inline']['step_us'] / r['general']['step_us']:.2f}×" if path == "inline" else ""
                print(f"| {name} | {n} | {path} | {x['step_us']:.0f} | {x['host_us']:.0f} | "
                      + " | ".join(f"{x['phases_us'][k]:.0f}" for k in phases) + f" | {ratio} |")
        rows = list(by_rows)
        summary[name] = {what: {path: slope([float(n) for n in rows], [by_rows[n][path][what] for n in rows])
                                for path in PATHS} for what in ("step_us", "host_us")}
    print("\n| sampling | step µs a row, inline / general | host µs a row, inline / general |")
    print("|---|---|---|")
    for name, sl in summary.items():
        print(f"| {name} | {sl['step_us']['inline']:.2f} / {sl['step_us']['general']:.2f} | "
              f"{sl['host_us']['inline']:.2f} / {sl['host_us']['general']:.2f} |")
    for name, k in kernels.items():
        print(f"\n{name}, {max(a.rows)} rows under torch.profiler: {k['wall_us']:.0f} µs a step (wall), "
              f"{k['total_us']:.0f} µs of {k['what']} time a step; the top {len(k['top'])}:\n")
        print("| µs a step | calls a step | kernel |" if k["what"] == "device" else "| µs a step | calls a step | operator |")
        print("|---:|---:|---|")
        for e in k["top"]:
            print(f"| {e['us']:.1f} | {e['calls']:.0f} | {e['name'][:100]} |")
    if a.result_file:
        doc = {"tool": "python -m loadgen.bench_step_rows", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "machine": _machine(), "source": _source_state(), "device": device_name, "model": a.model,
               "noop_model": noop, "dtype": cfg.dtype, "config": vars(a),
               "results": {k: {str(n): v for n, v in by.items()} for k, by in results.items()},
               "us_per_row": summary, "kernels": kernels}
        Path(a.result_file).write_text(json.dumps(doc, indent=1))
        _say(f"wrote {a.result_file}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec (a dummy model has none: smollm2)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda where there is one")
    p.add_argument("--noop", action=argparse.BooleanOptionalAction, default=None,
                   help="the no-op model (engine.noop_model): default on the CPU, where a real forward dwarfs the host")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--samplings", nargs="+", default=[s.name for s in SAMPLINGS],
                   choices=[s.name for s in STEP_SAMPLINGS])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="then profile --steps steps at the most rows: the N kernels with the most device time a step "
                        "(on the CPU, operators by CPU time)")
    p.add_argument("--result-file", default=None)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
