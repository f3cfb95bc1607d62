"""``tokenmill bench gpu-serving``: the engine alone against the served cluster, under the same load.

For each model (default: the Llama-3.1-8B dummy and the Llama-3.2-1B shape, random weights, SmolLM2's tokenizer):

1. The engine alone: ``common.engine.LLMEngine`` in this process on ``--device``, configured as the cluster's decode
   worker is (the cluster config's engine defaults and ``--set engine.*`` items, ``--dtype``, ``max_num_seqs`` =
   ``--max-concurrency``). A short warm-up; the decode step timed at a batch of ``--max-concurrency`` decoding
   sequences, greedy and sampled (median of ``--steps``, back to back); then the load as a closed loop (a request is
   added as soon as one ends), greedy then sampled.
2. The served cluster: ``tokenmill up`` as a user starts it, with one decode worker and ``--prefills`` prefill
   workers (default 0: the aggregated layout, one device; ``--prefills 1`` on two GPUs: prompts on GPU 0, KV pulled
   over NIXL, decoding on GPU 1), on free ports below 32768, ready when the gateway's ``/health`` answers 200. The
   same load through each client of ``--backends`` (gRPC ``Generate``; OpenAI ``/v1/completions`` with the same
   prompt token ids), greedy then sampled, each run under a fresh cache salt; a short warm-up first; then SIGTERM to
   the launcher.

The load: ``--num-prompts`` random word-token prompts of exactly ``--input-len`` tokens (loadgen/workloads.py; the
same prompts for the engine and every client), ``--output-len`` tokens each, EOS ignored, ``--max-concurrency`` in
flight. Sampled: temperature 1, top_p 0.9, top_k 50, repetition_penalty 1.1, or ``--sampled`` (e.g. what an
OpenAI client sends: ``temperature=1,top_p=0.9``, no top_k). Output tok/s, TTFT and TPOT
(per request (e2e − TTFT)/(tokens − 1), p50) are computed by loadgen/metrics.py for the engine as for the clients.

The step's limit: the bytes a decode step reads (every weight matrix it multiplies by — the LM head, not the
embedding table — plus the KV of ``--max-concurrency`` sequences at the run's mean context, input + output/2 tokens)
÷ the copy bandwidth measured at the start of the same run. In this closed loop every finished request is replaced
by a new prompt, so a decode step shares the device with ``--input-len ÷ --output-len`` prompt tokens per decoding
row; the mixed limit adds their matmul and attention FLOPs ÷ the bf16 matmul rate measured in the same run (the
floor of a step that computes both on one device). With prefill workers the decode worker's steps carry no prompts
(unless the router falls back to a local prefill), so there the step limit is the floor. Each row's TPOT is also set
against the limit at the decode rows its steps really ran (the engine's step counters: a decode worker whose prompts
come slower than its streams end runs fewer than ``--max-concurrency``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import DType
from common.machine import default_dtype
from loadgen import bench_serve, profile_summary
from loadgen.bench_offline import _machine, _say, _source_state
from loadgen.clients import BACKENDS, GrpcTarget, OpenAITarget, SamplingFields, SendOptions
from loadgen.metrics import RequestRecord, summarize
from loadgen.runner import LoadConfig, run_warmups
from loadgen.server_metrics import (
    ENGINE_LOOP_PARTS,
    ENGINE_STEP_PHASES,
    fold_means,
    named_endpoints_from_state,
)
from loadgen.workloads import PromptBuilder, RequestSpec, build_requests

DEFAULT_MODELS = ("dummy:llama-3.1-8b", "dummy:llama-3.2-1b")
REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
WARMUP_REQUESTS = 8  # per sampling and client, full-length prompts, a few tokens: compiles before the clock


@dataclass(frozen=True, slots=True)
class Sampling:
    """One sampling setting of the benchmark, sent as the same fields to the engine and to every client."""

    name: str
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0

    def fields(self) -> SamplingFields:
        """The request fields that differ from the defaults (the same names in SamplingParams, the proto, OpenAI)."""
        out: SamplingFields = {"temperature": self.temperature}
        if self.top_p != 1.0:
            out["top_p"] = self.top_p
        if self.top_k:
            out["top_k"] = self.top_k
        if self.repetition_penalty != 1.0:
            out["repetition_penalty"] = self.repetition_penalty
        return out

    def params(self, max_tokens: int) -> Any:
        from common.sampling import SamplingParams

        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **self.fields())


SAMPLINGS = (Sampling("greedy", 0.0), Sampling("sampled", 1.0, top_p=0.9, top_k=50, repetition_penalty=1.1))
SAMPLED_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")


def parse_sampled(text: str) -> Sampling:
    """``--sampled``: the sampled runs' fields as ``KEY=VALUE,...`` (keys of :data:`SAMPLED_FIELDS`; the others at
    their defaults), e.g. ``temperature=1,top_p=0.9``: what an OpenAI client that sets top_p sends (the API has no
    top_k). A sampled run needs a temperature above 0."""
    given: dict[str, Any] = {}
    for item in (x.strip() for x in text.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in SAMPLED_FIELDS or key in given:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected KEY=VALUE items, each key once, of {', '.join(SAMPLED_FIELDS)}")
        try:
            given[key] = int(value) if key == "top_k" else float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: {key} takes a number") from None
    sampled = Sampling("sampled", **{"temperature": 1.0, **given})
    from common.sampling import SamplingParams

    try:
        SamplingParams(max_tokens=1, **sampled.fields()).validate(vocab_size=1)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if sampled.temperature <= 0:
        raise argparse.ArgumentTypeError("the sampled runs need a temperature above 0 (greedy runs beside them)")
    return sampled


def samplings(a: argparse.Namespace) -> tuple[Sampling, Sampling]:
    """The run's two settings: greedy, and ``--sampled`` (default: temperature 1, top_p 0.9, top_k 50,
    repetition_penalty 1.1)."""
    return SAMPLINGS[0], getattr(a, "sampled", None) or SAMPLINGS[1]


# -- the step's limit --------------------------------------------------------------------------------------------
def step_limit(m: Any, dtype: str, batch: int, input_len: int, output_len: int, bandwidth: float,
               matmul_rate: float) -> dict[str, float]:
    """The bytes one decode step reads and the time the copy bandwidth needs for them; and the mixed limit: that,
    plus the FLOPs of the prompt tokens a step of this closed loop carries (``batch × input_len ÷ output_len``) ÷
    ``matmul_rate``. ``m``: a ModelConfig; a sequence's mean context: input + output/2 tokens. Weights: every matrix
    a step multiplies by (q/k/v, o, gate/up, down per layer, and the LM head, tied or not), not the embedding table
    (one row per token is gathered) nor the norms. A prompt token's FLOPs: 2 per weight of its layers (not the LM
    head: a prompt's logits are computed for its last token only) and 4 × q_size per layer per earlier token of its
    prompt (scores and values; input/2 on average)."""
    h, b = m.hidden_size, DTYPE_BYTES[dtype]
    per_layer = h * (m.q_size + 2 * m.kv_size) + m.q_size * h + 3 * h * m.intermediate_size
    weight_bytes = (m.num_layers * per_layer + m.vocab_size * h) * b
    context = input_len + output_len / 2
    kv_bytes = batch * context * 2 * m.num_layers * m.kv_size * b
    limit_ms = (weight_bytes + kv_bytes) / bandwidth * 1e3
    prompt_flops = m.num_layers * (2 * per_layer + 4 * m.q_size * input_len / 2)
    prompt_tokens = batch * input_len / output_len
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "batch": batch, "context": context,
            "bandwidth_Bps": bandwidth, "limit_ms": limit_ms, "matmul_flops": matmul_rate,
            "prompt_tokens_per_step": prompt_tokens, "prompt_flops_per_token": prompt_flops,
            "mixed_limit_ms": limit_ms + prompt_tokens * prompt_flops / matmul_rate * 1e3}


def cpu_matmul_rate(n: int = 1024, iters: int = 5) -> float:
    """bf16 matmul FLOP/s on the host (torch), median: the CPU run's counterpart of ``bench_gpu.matmul_rate``."""
    import torch

    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def cpu_copy_bandwidth(nbytes: int = 256 << 20, iters: int = 10) -> float:
    """Bytes/s (read + written) of one large memcpy in host memory, median: the CPU run's counterpart of
    ``bench_gpu.copy_bandwidth``."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


# -- the engine alone --------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def engine_closed_loop(eng: Any, specs: list[RequestSpec], sampling: Sampling, concurrency: int,
                       tag: str) -> list[RequestRecord]:
    """Run ``specs`` through ``eng`` with ``concurrency`` in flight: each request is added when one ends (before the
    next step), as a closed-loop client would send it. One record per request, timed as the clients time theirs:
    a step's tokens arrive when ``step()`` returns them. The requests share a fresh cache salt: nothing is served
    from an earlier run's prefix cache."""
    salt = uuid.uuid4().hex
    queue = list(reversed(specs))
    live: dict[str, RequestRecord] = {}
    records: list[RequestRecord] = []
    t0 = time.perf_counter()

    def admit() -> None:
        spec = queue.pop()
        rid = f"{tag}-{salt[:8]}-{spec.index}"
        rec = RequestRecord(index=spec.index, input_len=spec.input_len, output_len=spec.output_len,
                            start=time.perf_counter() - t0)
        eng.add_request(rid, spec.prompt_ids, sampling.params(spec.output_len), cache_salt=salt)
        live[rid] = rec
        records.append(rec)

    while queue and len(live) < concurrency:
        admit()
    while live:
        if not eng.has_unfinished():
            raise RuntimeError(f"the engine has no work left but {len(live)} requests never finished")
        outs = eng.step()
        now = time.perf_counter() - t0
        for o in outs:
            rec = live.get(o.request_id)
            if rec is None:
                continue
            rec.chunk_times.append(now - rec.start)
            rec.chunk_tokens.append(len(o.new_token_ids))
            if o.finished:
                rec.end = now - rec.start
                rec.prompt_tokens, rec.completion_tokens = o.num_prompt_tokens, o.num_output_tokens
                rec.cached_tokens = o.num_cached_tokens
                del live[o.request_id]
                if queue:
                    admit()
    return records


def engine_counters(eng: Any) -> dict[str, float]:
    """The engine's step counters under the names the workers' /metrics deltas get (loadgen/server_metrics.py)."""
    return {**{f"engine_phase_{k}": v for k, v in eng.step_phases().items()}, "engine_steps": eng.num_steps, "engine_step_seconds": eng.step_seconds,
            "engine_step_decode_rows": eng.step_decode_rows, "engine_step_prompt_tokens": eng.step_prompt_tokens,
            "engine_queue_sum": eng.queue_seconds, "engine_queue_count": eng.num_queued,
            "engine_ttft_sum": eng.first_token_seconds, "engine_ttft_count": eng.num_first_tokens}


def _mean_ms(e: dict[str, Any], key: str) -> str:
    """A histogram's mean over a run, ms (``KEY_mean_ms``, ``server_metrics.fold_means``)."""
    v = e.get(f"{key}_mean_ms")
    return "—" if v is None else f"{v:.1f}"


def time_decode_steps(eng: Any, specs: list[RequestSpec], sampling: Sampling, steps: int, device: str) -> dict:
    """``eng.step()`` with ``len(specs)`` sequences all decoding: the median of ``steps`` steps after 3 warm-up
    steps, each from the return of the one before (no device sync between them: an async engine's host work on a
    step overlaps the device's next one, as it does serving). The sequences are aborted afterwards."""
    salt = uuid.uuid4().hex
    batch = len(specs)
    # every prompt is prefilled before the clock; the first ones decode meanwhile: room for that, then the steps
    prefill_steps = -(-sum(s.input_len for s in specs) // eng.cfg.max_num_batched_tokens) + batch
    params = sampling.params(prefill_steps + steps + 8)
    rids = [f"step-{sampling.name}-{salt[:8]}-{i}" for i in range(batch)]
    for rid, spec in zip(rids, specs):
        eng.add_request(rid, spec.prompt_ids, params, cache_salt=salt)
    started: set[str] = set()
    while len(started) < batch:
        if not eng.has_unfinished():
            raise RuntimeError("the step-timing sequences ended before they all decoded")
        started.update(o.request_id for o in eng.step())
    for _ in range(3):
        eng.step()
    times, rows = [], []
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        rows.append(len(eng.step()))
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    for rid in rids:
        eng.abort(rid)
    return {"sampling": sampling.name, "batch": batch, "steps": steps, "step_ms_p50": statistics.median(times) * 1e3,
            "step_ms": [round(t * 1e3, 3) for t in times], "rows_min": min(rows)}


# -- the served cluster ------------------------------------------------------------------------------------------
def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base_port() -> int:
    """A base port below 32768 whose derived cluster ports (roles at +0..+400, metrics at +1000..+1400) and the
    gateways' gRPC (+450...) and HTTP (+460...) ports all bind now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, 30000, 100)
        ports = [base + off + i for off in (0, 100, 200, 300, 400, 1000, 1100, 1200, 1300, 1400) for i in range(4)]
        if all(_port_free(p) for p in [*ports, *range(base + 450, base + 470)]):
            return base
    raise RuntimeError("no free port range below 32768")


def _tail(path: Path, n: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-n:]
    return ""


@contextlib.contextmanager
def start_cluster(name: str, up_args: list[str], log_dir: Path, startup_timeout: float) -> Iterator[dict[str, Any]]:
    """``python -m services.cli up`` with ``up_args`` (layout, model, device, ``--set`` items) as a user starts it,
    on free ports below 32768 (the ports, the state file and the log, named after ``name``, are added here); ready
    when the gateway's ``/health`` answers 200 and the state file says every process is SERVING; SIGTERM to the
    launcher at exit. Yields the gRPC address, the HTTP
    base URL, the state file, the log and the seconds it took to be ready. Raises RuntimeError (with the log's end)
    when it exits or times out first."""
    base = free_base_port()
    slug = name.replace(":", "-").replace("/", "-")
    state, log = log_dir / f"cluster-{slug}.json", log_dir / f"cluster-{slug}.log"
    cmd = [sys.executable, "-m", "services.cli", "up", *up_args, "--base-port", str(base),
           "--gateway-port", str(base + 450), "--http-port", str(base + 460), "--state-file", str(state)]
    _say(f"{name}: starting the cluster: {' '.join(cmd[1:])} (log {log})")
    http = f"http://127.0.0.1:{base + 460}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    t0 = time.perf_counter()
    with open(log, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tokenmill up exited with {proc.returncode} before it was ready; its log "
                                   f"({log}) ends:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster was not ready after {startup_timeout:.0f} s; the log "
                                   f"({log}) ends:\n{_tail(log)}")
            with contextlib.suppress(urllib.error.URLError, OSError), \
                    opener.open(f"{http}/health", timeout=2) as r:
                # and every process SERVING (the state file says so): gateways sharing the port bind it as each is
                # ready, and a client's connections, made while only the first listens, would all stay on it
                if r.status == 200 and state.exists() and json.loads(state.read_text()).get("ready"):
                    break
            time.sleep(0.5)
        ready_s = round(time.perf_counter() - t0, 1)
        roles = [p["role"] for p in json.loads(state.read_text())["processes"]]
        _say(f"{name}: cluster ready in {ready_s:.1f} s ({roles.count('gateway')} gateways, "
              f"{roles.count('decode')} decode and {roles.count('prefill')} prefill workers)")
        yield {"grpc": f"127.0.0.1:{base + 450}", "http": http, "state": str(state), "log": str(log),
               "ready_s": ready_s, "processes": {r: roles.count(r) for r in sorted(set(roles))}}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _say(f"{name}: cluster stopped (exit {proc.returncode})")


def served_args(model: str, a: argparse.Namespace, dtype: str) -> list[str]:
    """``tokenmill up``'s arguments for the served cluster of ``model``: one decode worker and ``--prefills``
    prefill workers (0: aggregated, one device)."""
    args = ["--model", spec_arg(model), "--prefills", str(a.prefills), "--decodes", "1",
            "--set", f"engine.max_num_seqs={a.max_concurrency}",
            "--set", f"engine.dtype={dtype}", "--device", a.device, "--tokenizer", spec_arg(a.tokenizer)]
    for item in a.set_items or []:
        args += ["--set", item]
    if getattr(a, "profile_dir", None):
        slug = model.replace(":", "-").replace("/", "-")
        args += ["--set", f"profile_dir={Path(a.profile_dir).resolve() / slug}"]
    return args


def served_cluster(model: str, a: argparse.Namespace, dtype: str,
                   log_dir: Path) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """The served cluster of ``model`` (``served_args``), as ``start_cluster`` runs it."""
    return start_cluster(model, served_args(model, a, dtype), log_dir, a.startup_timeout)


def served_layout_error(models: list[str], a: argparse.Namespace, dtype: str, log_dir: Path) -> str | None:
    """Each served cluster's layout, checked before anything runs: ``tokenmill up --dry-run`` with the same
    arguments (its GPU plan: more workers than GPUs, no CUDA device, a device that does not exist). The launcher's
    error line, or None when every cluster can start."""
    for model in models:
        cmd = [sys.executable, "-m", "services.cli", "up", *served_args(model, a, dtype), "--dry-run",
               "--state-file", str(log_dir / "dry-run.json")]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
        if p.returncode != 0:
            said = (p.stderr.strip() or p.stdout.strip()).splitlines()
            return f"{model}: the served cluster cannot start: {said[-1] if said else f'exit {p.returncode}'}"
    return None


def spec_arg(spec: str) -> str:
    """A model/tokenizer spec for a child started in the repository root: a local path made absolute."""
    p = Path(spec).expanduser()
    return str(p.resolve()) if p.exists() else spec


def _serve_args(a: argparse.Namespace, backend: str, state: str | None) -> argparse.Namespace:
    """``tokenmill bench serve``'s options for one client."""
    argv = ["--backend", backend, "--random-input-len", str(a.input_len), "--random-output-len",
            str(a.output_len), "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.max_concurrency),
            "--ignore-eos", "--seed", str(a.seed), "--cache-salt", "auto", "--num-warmups", "0", "--disable-tqdm",
            "--no-plots", "--client-processes", str(a.client_processes)]
    if a.tokenizer:
        argv += ["--tokenizer", a.tokenizer]
    if state:
        argv += ["--cluster-state", state]
    return parse_serve_args(argv)


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """``tokenmill bench serve ARGV`` parsed by its own parser (so every default is its): the options
    ``bench_serve._one_run`` takes."""
    p = argparse.ArgumentParser()
    bench_serve.add_parser(p.add_subparsers())
    return p.parse_args(["serve", *argv])


def _load(a: argparse.Namespace) -> LoadConfig:
    return LoadConfig(max_concurrency=a.max_concurrency, num_requests=a.num_prompts, num_warmups=0, seed=a.seed)


def _warm_specs(a: argparse.Namespace, builder: PromptBuilder, chat: bool = False) -> list[RequestSpec]:
    cfg = dataclasses.replace(bench_serve._workload(_serve_args(a, "grpc", None), a.seed), output_len=(4, 4),
                              seed=a.seed + bench_serve.WARMUP_SEED_OFFSET, chat=chat)
    return build_requests(cfg, builder, min(a.max_concurrency, WARMUP_REQUESTS))


def served_target(backend: str, cluster: dict[str, Any], sampling: Sampling,
                  timeout: float | None) -> GrpcTarget | OpenAITarget:
    """The client of ``backend`` for the cluster, sending ``sampling``'s fields; ``/v1/completions`` gets the prompt
    as token ids, the same ids the engine and gRPC get."""
    opts = SendOptions(ignore_eos=True, timeout=timeout, **sampling.fields())
    if backend == "grpc":
        return GrpcTarget(cluster["grpc"], None, opts)
    return OpenAITarget(cluster["http"], "chat" if backend == "openai-chat" else "completions", None, opts,
                        prompt_ids=True)


async def served_runs(a: argparse.Namespace, cluster: dict[str, Any], builder: PromptBuilder,
                      backends: list[str], model: str, res: BenchResult) -> None:
    """Every client × sampling against the running cluster: a warm-up, then the measured load of each, a row each."""
    for backend in backends:
        sa = _serve_args(a, backend, cluster["state"])
        urls = bench_serve._metrics_urls(sa)
        for sampling in samplings(a):
            target = served_target(backend, cluster, sampling, a.request_timeout)
            await target.open()
            try:
                t0 = time.perf_counter()
                warm = _warm_specs(a, builder, chat=backend == "openai-chat")
                target.opts = dataclasses.replace(target.opts, cache_salt=uuid.uuid4().hex)
                await run_warmups(target, iter(warm), LoadConfig(max_concurrency=a.max_concurrency,
                                                                 num_warmups=len(warm)))
                async with profile_summary.profiled(cluster["http"] if a.profile_dir else None) as traces:
                    run = await bench_serve._one_run(sa, target, builder, [], _load(a), urls)
            finally:
                await target.close()
            s = run["summary"]
            _say(f"{model}: served {backend} {sampling.name}: {s['completed']}/{s['requests']} requests, "
                 f"{s['output_throughput']:.1f} output tok/s, TPOT p50 {s['tpot_ms']['p50'] or 0:.2f} ms, "
                 f"TTFT p50 {s['ttft_ms']['p50'] or 0:.1f} ms ({time.perf_counter() - t0:.1f} s)")
            row = _row(model, sampling.name, backend, s, run["server"])
            row["decode_workers"] = decode_workers(run["server"], cluster["state"])
            if traces:  # each worker's trace of the measured load, and its engine's steps as the trace shows them
                row["profile"] = {"traces": traces, "steps": {
                    wid: profile_summary.steps(profile_summary.load_events(path)) for wid, path in traces.items()}}
                for wid, st in row["profile"]["steps"].items():
                    if st["steps"]:
                        _say(f"{model}: served {backend} {sampling.name}: {wid}'s profile: {st['steps']} steps, host "
                             f"ms p50 {st['host_ms_p50']:.2f} / p90 {st['host_ms_p90']:.2f}, the GPU busy "
                             f"{100 * st['gpu_busy_share']:.0f}% of their span")
            res.doc["rows"].append(row)
            res.save()


def decode_workers(server: dict[str, Any] | None, state: str) -> dict[str, float] | None:
    """The engine counters of the cluster's decode workers alone, summed (a prefill worker's steps carry prompts
    and no decode rows: in the cluster's sum they would dilute the decode steps)."""
    names = named_endpoints_from_state(state)
    dec = [d for u, d in (server or {}).get("by_endpoint", {}).items() if names.get(u, "").startswith("decode")]
    return {k: sum(d.get(k, 0.0) for d in dec) for k in set().union(*dec)} if dec else None


def _steps(r: dict[str, Any]) -> dict[str, Any]:
    """A row's engine step counters: the decode workers' for a served run, the engine's own for the engine alone."""
    return r.get("decode_workers") or r.get("server") or {}


# -- the run -----------------------------------------------------------------------------------------------------
def _row(model: str, sampling: str, client: str, s: dict[str, Any], server: dict | None = None) -> dict[str, Any]:
    return {"model": model, "sampling": sampling, "client": client, "output_tok_s": s["output_throughput"],
            "tpot_p50_ms": s["tpot_ms"]["p50"], "ttft_p50_ms": s["ttft_ms"]["p50"], "completed": s["completed"],
            "failed": s["failed"], "errors": s["errors"], "output_len_mismatch": s["output_len_mismatch"],
            "summary": s, "server": server}


def _ratios(result: dict[str, Any]) -> None:
    """Each row against the engine (same model: same sampling, and greedy) and its TPOT p50 against the limit."""
    eng = {(r["model"], r["sampling"]): r["output_tok_s"] for r in result["rows"] if r["client"] == "engine"}
    for r in result["rows"]:
        same, greedy = eng.get((r["model"], r["sampling"])), eng.get((r["model"], "greedy"))
        r["vs_engine_same_sampling"] = r["output_tok_s"] / same if same else None
        r["vs_engine_greedy"] = r["output_tok_s"] / greedy if greedy else None
        lim = result["models"].get(r["model"], {}).get("limit", {})
        for key, name in (("limit_ms", "tpot_p50_vs_limit"), ("mixed_limit_ms", "tpot_p50_vs_mixed_limit")):
            r[name] = r["tpot_p50_ms"] / lim[key] if lim.get(key) and r["tpot_p50_ms"] else None
        rows = decode_rows_per_step(_steps(r))
        r["decode_rows_per_step"] = rows
        r["limit_at_rows_ms"] = limit_at_rows(lim, rows) if lim and rows else None
        r["tpot_p50_vs_limit_at_rows"] = (r["tpot_p50_ms"] / r["limit_at_rows_ms"]
                                          if r["limit_at_rows_ms"] and r["tpot_p50_ms"] else None)


def decode_rows_per_step(server: dict[str, Any] | None) -> float | None:
    """The mean decode rows of a run's steps, from the engine's step counters (None without them)."""
    steps = (server or {}).get("engine_steps")
    return (server or {}).get("engine_step_decode_rows", 0.0) / steps if steps else None


def limit_at_rows(lim: dict[str, Any], rows: float) -> float:
    """The step limit (``step_limit``'s) with ``rows`` decoding sequences in place of its batch: the same weights,
    the KV of ``rows`` sequences at the same mean context."""
    return (lim["weight_bytes"] + lim["kv_bytes"] * rows / lim["batch"]) / lim["bandwidth_Bps"] * 1e3


def _x(v: float | None, fmt: str = ".2f", suffix: str = "×") -> str:
    return "—" if v is None else f"{v:{fmt}}{suffix}"


def _at_rows(r: dict[str, Any]) -> str:
    v = r.get("tpot_p50_vs_limit_at_rows")
    return "—" if v is None else f"{v:.2f}× ({r['decode_rows_per_step']:.0f} rows: {r['limit_at_rows_ms']:.2f} ms)"


def build_table(result: dict[str, Any]) -> str:
    lines = ["| model | sampling | client | output tok/s | TPOT p50 ms | TTFT p50 ms | ÷ engine, same sampling "
             "| ÷ engine greedy | TPOT p50 ÷ limit | ÷ mixed limit | ÷ limit at its rows | client CPU |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        failed = f" ({r['failed']} FAILED)" if r["failed"] else ""
        share = r["summary"].get("client_cpu_share")
        cpu = "" if share is None else f"{share:.0%} × {r['summary'].get('client_processes', 1)}"
        lines.append(f"| {r['model']} | {r['sampling']} | {r['client']}{failed} | {r['output_tok_s']:,.1f} | "
                     f"{_x(r['tpot_p50_ms'], '.2f', '')} | {_x(r['ttft_p50_ms'], '.1f', '')} | "
                     f"{_x(r['vs_engine_same_sampling'])} | {_x(r['vs_engine_greedy'])} | "
                     f"{_x(r['tpot_p50_vs_limit'])} | {_x(r.get('tpot_p50_vs_mixed_limit'))} | "
                     f"{_at_rows(r)} | {cpu} |")
    for model, m in result["models"].items():
        lim, st = m.get("limit"), m.get("step")
        if lim:
            lines.append(f"\n{model}: step limit {lim['limit_ms']:.2f} ms = (weights {lim['weight_bytes'] / 1e9:.2f} "
                         f"GB + KV {lim['kv_bytes'] / 1e9:.2f} GB at {lim['batch']} × {lim['context']:.0f} tokens) ÷ "
                         f"copy {lim['bandwidth_Bps'] / 1e9:.1f} GB/s (target: TPOT p50 ≤ 1.5×)")
            if lim.get("mixed_limit_ms"):
                lines.append(f"{model}: mixed limit {lim['mixed_limit_ms']:.2f} ms = step limit + "
                             f"{lim['prompt_tokens_per_step']:.0f} prompt tokens a step × "
                             f"{lim['prompt_flops_per_token'] / 1e9:.2f} GFLOP ÷ matmul "
                             f"{lim['matmul_flops'] / 1e12:.1f} TFLOP/s (this closed loop's prompts share the steps)")
        if st:
            lines.append(f"{model}: engine step at batch {st['batch']}: greedy {st['greedy_ms']:.2f} ms, sampled "
                         f"{st['sampled_ms']:.2f} ms, sampled ÷ greedy {st['ratio']:.2f}× (target ≤ 1.1×)")
    lines += ["", "Client CPU: the busiest client process's CPU seconds ÷ the run's duration, × the processes; near "
              "100%, the client's own delays count in its figures.", "", "Engine steps over each run (the decode workers' /metrics for the served runs): busy = seconds in "
              "steps ÷ the run's duration, idle = seconds the engine waited with nothing to run ÷ the duration.", "",
              "Queue and TTFT are the engine's (a request's arrival in the engine to its first prompt step, and to "
              "its first token), as means; the gateway's TTFT mean beside them.", "",
              "| model | sampling | client | steps | step ms mean | decode rows / step | prompt tokens / step | "
              "busy | idle | engine queue ms | engine TTFT ms | gateway TTFT ms |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        e, srv, dur = _steps(r), r.get("server") or {}, r["summary"].get("duration_s") or 0.0
        n = e.get("engine_steps")
        if not n or not dur:
            continue
        lines.append(f"| {r['model']} | {r['sampling']} | {r['client']} | {n:,.0f} | "
                     f"{1000 * e['engine_step_seconds'] / n:.2f} | {e['engine_step_decode_rows'] / n:.1f} | "
                     f"{e['engine_step_prompt_tokens'] / n:.0f} | {e['engine_step_seconds'] / dur:.0%} | "
                     f"{e.get('engine_idle_seconds', 0.0) / dur:.0%} | {_mean_ms(srv, 'engine_queue')} | "
                     f"{_mean_ms(srv, 'engine_ttft')} | {_mean_ms(srv, 'ttft')} |")
    phase_rows = [r for r in result["rows"] if _steps(r).get("engine_steps")
                  and any(f"engine_phase_{p}" in _steps(r) for p in ENGINE_STEP_PHASES)]
    if phase_rows:
        lines += ["", "Where a step's host time went, ms a step (common/engine.py, STEP_PHASES; wait = the engine thread "
                  "blocked on the device for picked tokens: with async scheduling the GPU's time it did not hide):",
                  "", "| model | sampling | client | " + " | ".join(ENGINE_STEP_PHASES) + " |",
                  "|---|---|---|" + "---:|" * len(ENGINE_STEP_PHASES)]
        for r in phase_rows:
            e = _steps(r)
            lines.append(f"| {r['model']} | {r['sampling']} | {r['client']} | " + " | ".join(
                f"{1000 * e.get(f'engine_phase_{p}', 0.0) / e['engine_steps']:.2f}" for p in ENGINE_STEP_PHASES) + " |")
    loop_rows = [r for r in result["rows"] if _steps(r).get("engine_steps")
                 and any(f"engine_loop_{p}" in _steps(r) for p in ENGINE_LOOP_PARTS)]
    if loop_rows:
        lines += ["", "The engine thread's work between steps, ms a step (common/engine_loop.py, LOOP_PARTS; tick: the "
                  "KV pulls' posting and polling; after: the iteration's outputs and counters sent on), and the wall "
                  "time a step (the run's duration ÷ its steps, idle time included):", "",
                  "| model | sampling | client | " + " | ".join(ENGINE_LOOP_PARTS) + " | wall a step |",
                  "|---|---|---|" + "---:|" * (len(ENGINE_LOOP_PARTS) + 1)]
        for r in loop_rows:
            e, dur = _steps(r), r["summary"].get("duration_s") or 0.0
            lines.append(f"| {r['model']} | {r['sampling']} | {r['client']} | " + " | ".join(
                f"{1000 * e.get(f'engine_loop_{p}', 0.0) / e['engine_steps']:.2f}" for p in ENGINE_LOOP_PARTS)
                + f" | {1000 * dur / e['engine_steps']:.2f} |")
    heads = [f"{r['model']} {r['client']} {r['vs_engine_greedy']:.2f}×" for r in result["rows"]
             if r["client"] != "engine" and r["sampling"] == "sampled" and r["vs_engine_greedy"]]
    if heads:
        lines.append("served sampled ÷ engine greedy (target ≥ 0.9×): " + ", ".join(heads))
    return "\n".join(lines)


def _parse(a: argparse.Namespace) -> tuple[list[str], list[str]]:
    from common.loader import available_dummy_configs

    models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in models:
        if m.startswith("dummy:") and m[6:] not in available_dummy_configs():
            raise SystemExit(f"--models: {m}: no config {m[6:]}.json in common/model_configs/ (there are: "
                             f"{', '.join(available_dummy_configs())})")
    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    if not models or not backends or any(b not in BACKENDS for b in backends):
        raise SystemExit(f"--models and --backends need at least one each; backends: {', '.join(BACKENDS)}")
    if a.prefills < 0:
        raise SystemExit("--prefills must be >= 0")
    if min(a.num_prompts, a.input_len, a.output_len, a.max_concurrency, a.steps) < 1 or a.output_len < 2:
        raise SystemExit("--num-prompts, --input-len, --max-concurrency and --steps must be >= 1, --output-len >= 2")
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device here; use --device cpu")
    return models, backends


def make_log_dir(log_dir: str | None, result_file: Path | None, tool: str) -> Path:
    """Where the clusters' logs and state files go, created: ``log_dir``, else beside the result file
    (``NAME-logs``), else a fresh temporary directory."""
    out = Path(log_dir) if log_dir else (result_file.with_name(result_file.stem + "-logs") if result_file
                                         else Path(tempfile.mkdtemp(prefix=f"tokenmill-{tool}-")))
    out.mkdir(parents=True, exist_ok=True)
    return out


class BenchResult:
    """The result document, rewritten to ``path`` after every phase: a run cut short keeps what it measured."""

    def __init__(self, path: Path | None, doc: dict[str, Any]) -> None:
        self.path, self.doc, self.t0 = path, doc, time.perf_counter()

    def save(self) -> None:
        self.doc["wall_s"] = round(time.perf_counter() - self.t0, 1)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(bench_serve._finite(self.doc), indent=1, allow_nan=False))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A progress line at the start and the end of a phase, its seconds in ``phases_s``, then a save."""
        _say(f"{name} ...")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.doc["phases_s"][name] = round(time.perf_counter() - t0, 1)
            _say(f"{name}: {self.doc['phases_s'][name]:.1f} s")
            self.save()


def engine_phase(a: argparse.Namespace, model: str, dtype: DType, specs: list[RequestSpec], builder: PromptBuilder,
                 res: BenchResult) -> None:
    """The engine alone: load, warm-up, the decode step timed greedy and sampled, the load with each sampling."""
    from common.cluster_config import load_cluster_config, parse_set_option
    from common.engine import LLMEngine
    from common.loader import load_model_source

    mres = res.doc["models"][model]
    eng = None
    try:
        with res.phase(f"{model}: engine load"):
            # as the cluster's decode worker runs: the defaults and the run's `--set engine.*` items
            given = {k: v for k, v in parse_set_option(a.set_items).items() if k.startswith("engine.")}
            cfg = dataclasses.replace(load_cluster_config(overrides=given, env={}).engine, device=a.device,
                                      dtype=dtype, max_num_seqs=a.max_concurrency)
            eng = LLMEngine(load_model_source(model, a.tokenizer), cfg)
            _sync(a.device)
            mres["engine_config"], mres["kv_blocks"] = dataclasses.asdict(cfg), eng.runner.num_blocks
        with res.phase(f"{model}: engine warm-up and step timing"):
            for s in samplings(a):
                engine_closed_loop(eng, _warm_specs(a, builder), s, a.max_concurrency, f"warm-{s.name}")
            batch = [dataclasses.replace(sp, index=i) for i, sp in
                     enumerate((specs * -(-a.max_concurrency // len(specs)))[: a.max_concurrency])]
            # greedy then sampled, ``--step-rounds`` times: a host whose speed drifts (a shared VM) moves both
            # halves of a round alike, so the median of the rounds' ratios holds where one pair would not
            rounds = []
            for r in range(a.step_rounds):
                g, smp = (time_decode_steps(eng, batch, s, a.steps, a.device) for s in samplings(a))
                rounds.append({"greedy_ms": g["step_ms_p50"], "sampled_ms": smp["step_ms_p50"],
                               "ratio": smp["step_ms_p50"] / g["step_ms_p50"], "greedy": g, "sampled": smp})
                if a.step_rounds > 1:
                    _say(f"{model}: step round {r + 1}: greedy {g['step_ms_p50']:.2f} ms, sampled "
                         f"{smp['step_ms_p50']:.2f} ms ({rounds[-1]['ratio']:.2f}×)")
            mid = sorted(rounds, key=lambda x: x["ratio"])[len(rounds) // 2]  # the round of the median ratio
            mres["step"] = {"batch": a.max_concurrency, **mid,
                            "rounds": [{k: x[k] for k in ("greedy_ms", "sampled_ms", "ratio")} for x in rounds]}
            _say(f"{model}: engine step at batch {a.max_concurrency}: greedy {mid['greedy_ms']:.2f} ms, sampled "
                 f"{mid['sampled_ms']:.2f} ms ({mid['ratio']:.2f}×" + (f", the median of {len(rounds)} rounds)"
                                                                       if len(rounds) > 1 else ")"))
        for s in samplings(a):
            with res.phase(f"{model}: engine {s.name} load"):
                c0 = engine_counters(eng)
                summary = summarize(engine_closed_loop(eng, specs, s, a.max_concurrency, f"run-{s.name}"))
                steps = fold_means({k: v - c0[k] for k, v in engine_counters(eng).items()})
                res.doc["rows"].append(_row(model, s.name, "engine", summary, steps))
                _say(f"{model}: engine {s.name}: {summary['output_throughput']:.1f} output tok/s, TPOT p50 "
                     f"{summary['tpot_ms']['p50'] or 0:.2f} ms, TTFT p50 {summary['ttft_ms']['p50'] or 0:.1f} ms")
    finally:
        del eng


def _free_device(device: str, model: str) -> None:
    """Collect what a phase left; on CUDA give the cached memory back, so the cluster's worker can take its share of
    the card."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        _say(f"{model}: this process holds {torch.cuda.memory_reserved() / 2**30:.2f} GiB of the card; "
             f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free")


def run(a: argparse.Namespace) -> int:
    import torch

    from common.loader import load_model_source, load_tokenizer

    models, backends = _parse(a)
    dtype = a.dtype or default_dtype(a.device)
    path = Path(a.result_file) if a.result_file else None
    log_dir = make_log_dir(a.log_dir, path, "gpu-serving")
    if not a.skip_served:  # before the engine-alone half, which takes minutes a model
        error = served_layout_error(models, a, dtype, log_dir)
        if error is not None:
            print(f"tokenmill bench gpu-serving: {error}", file=sys.stderr)
            return 2
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else _machine().get("cpu", "cpu")
    res = BenchResult(path, {
        "tool": "tokenmill bench gpu-serving", "device": a.device, "device_name": device_name, "dtype": dtype,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": _machine(), "source": _source_state(),
        "torch": torch.__version__, "config": {k: v.fields() if isinstance(v, Sampling) else v for k, v in vars(a).items() if not callable(v)},
        "samplings": {s.name: s.fields() for s in samplings(a)}, "models": {}, "rows": [], "errors": [],
        "phases_s": {},
    })
    _say(f"device {a.device} ({device_name}), {dtype}; models {models}; {a.num_prompts} prompts of {a.input_len} "
         f"in / {a.output_len} out at {a.max_concurrency} in flight; clients engine, {', '.join(backends)}; "
         f"logs in {log_dir}")
    with res.phase("copy bandwidth"):
        if a.device == "cuda":
            from loadgen.bench_gpu import copy_bandwidth, matmul_rate

            bandwidth, flops = copy_bandwidth(), matmul_rate()
        else:
            bandwidth, flops = cpu_copy_bandwidth(), cpu_matmul_rate()
        res.doc["copy_bandwidth_Bps"] = bandwidth
        res.doc["matmul_flops"] = flops
    _say(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    builder = PromptBuilder(load_tokenizer(a.tokenizer))
    specs = build_requests(bench_serve._workload(_serve_args(a, "grpc", None), a.seed), builder, a.num_prompts)

    for model in models:
        res.doc["models"][model] = {"limit": step_limit(load_model_source(model).config, dtype, a.max_concurrency,
                                                        a.input_len, a.output_len, bandwidth, flops)}
        halves: list[tuple[str, Callable[[], None]]] = []
        if not a.skip_engine:
            halves.append(("engine", functools.partial(engine_phase, a, model, dtype, specs, builder, res)))
        if not a.skip_served:
            halves.append(("served", functools.partial(served_phase, a, model, dtype, builder, backends, log_dir,
                                                       res)))
        for half, fn in halves:
            try:
                fn()
            except Exception as e:  # one failing half must not lose the others: the error is a result too
                traceback.print_exc()
                res.doc["errors"].append(f"{model} {half}: {type(e).__name__}: {e}")
                _say(f"FAILED: {res.doc['errors'][-1]}")
            _free_device(a.device, model)  # after the except clause: its traceback no longer holds an engine
        _ratios(res.doc)
        res.save()

    res.doc["table"] = table = build_table(res.doc)
    res.save()
    print(f"\nGPU serving benchmark on {device_name} ({a.device}, {dtype}): {a.num_prompts} prompts of "
          f"{a.input_len} random tokens, {a.output_len} out (EOS ignored), {a.max_concurrency} in flight; sampled = "
          f"{samplings(a)[1].fields()}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; served: "
          + (f"{a.prefills} prefill worker(s) + 1 decode worker" if a.prefills else "aggregated, one decode worker"))
    return report_end(res, table, path, res.doc["rows"])


def report_end(res: BenchResult, table: str, path: Path | None, runs: list[dict[str, Any]]) -> int:
    """Print the table, the errors, the wall time by phase and where the JSON went; the exit code: 1 when anything
    failed or a run completed no request."""
    print(table)
    for msg in res.doc["errors"]:
        print(f"FAILED: {msg}")
    print(f"\nwall {res.doc['wall_s']:.0f} s; phases: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in res.doc["phases_s"].items()))
    if path is not None:
        print(f"results written to {path}")
    return 1 if res.doc["errors"] or any(r["failed"] or not r["completed"] for r in runs) else 0


def served_phase(a: argparse.Namespace, model: str, dtype: str, builder: PromptBuilder, backends: list[str],
                 log_dir: Path, res: BenchResult) -> None:
    """The served cluster: started, every client × sampling run against it, stopped."""
    with res.phase(f"{model}: served (cluster start, loads, stop)"), \
            served_cluster(model, a, dtype, log_dir) as cluster:
        res.doc["phases_s"][f"{model}: cluster start"] = cluster["ready_s"]
        res.doc["models"][model]["served_processes"] = cluster["processes"]  # by role: e.g. how many gateways
        asyncio.run(served_runs(a, cluster, builder, backends, model, res))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gpu-serving", help="the engine alone against the served cluster, same load",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma-separated model specs (default {','.join(DEFAULT_MODELS)})")
    p.add_argument("--tokenizer", default="smollm2", help="tokenizer spec for the prompts, the engine and the "
                                                          "cluster (default smollm2)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="default cuda")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="default: what `tokenmill up` picks (bfloat16 on cuda; on a CPU the machine's, "
                   "common/machine.py)")
    p.add_argument("--num-prompts", type=int, default=256, help="requests per run (default 256)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens, EOS ignored (default 128)")
    p.add_argument("--max-concurrency", type=int, default=64,
                   help="requests in flight, closed loop; also the engine's max_num_seqs (default 64)")
    p.add_argument("--prefills", type=int, default=0,
                   help="prefill workers of the served cluster, a GPU each, beside its one decode worker (default 0: "
                        "the aggregated layout, one device; 1 on two GPUs: prompts on one, decoding on the other)")
    p.add_argument("--backends", default="grpc,openai", help=f"served clients, of {','.join(BACKENDS)} "
                                                             "(default grpc,openai)")
    p.add_argument("--sampled", type=parse_sampled, metavar="KEY=VALUE,...",
                   help="the sampled runs' fields, of " + ", ".join(SAMPLED_FIELDS) + " (default temperature=1,"
                        "top_p=0.9,top_k=50,repetition_penalty=1.1; an OpenAI client sends temperature=1 and at most "
                        "a top_p)")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per sampling (default 20)")
    p.add_argument("--step-rounds", type=int, default=1,
                   help="rounds of the step timing, greedy then sampled each (default 1); with more, the step "
                        "table takes the round of the median sampled ÷ greedy ratio (for a host whose speed drifts)")
    p.add_argument("--client-processes", type=int, default=4,
                   help="client processes for the served runs (default 4: one reading every token message of 64 "
                        "streams spends a whole core, and its delays would count as the server's)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", dest="set_items",
                   help="passed to `tokenmill up --set` (repeatable), e.g. tokenizer.count=1; the engine.* items "
                        "apply to the engine alone too")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for the cluster to be ready (600)")
    p.add_argument("--request-timeout", type=float, help="cancel a served request after this many seconds")
    p.add_argument("--profile-dir", metavar="DIR",
                   help="profile the served cluster's workers through each measured load (the gateway's "
                        "/start_profile and /stop_profile): traces under DIR/MODEL, each worker's steps as its "
                        "trace shows them (loadgen.profile_summary: host time, the GPU's busy share) in the result")
    p.add_argument("--result-file", help="write every number here as JSON (rewritten after each phase)")
    p.add_argument("--log-dir", help="the clusters' logs and state files (default beside --result-file, else a "
                                     "temporary directory)")
    p.add_argument("--skip-engine", action="store_true", help="no engine-alone runs (debugging)")
    p.add_argument("--skip-served", action="store_true", help="no served runs (debugging)")
    p.set_defaults(func=run)
