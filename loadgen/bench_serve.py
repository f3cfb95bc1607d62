"""``tokenmill bench serve``: drive a serving endpoint (Tokenmill's gRPC ``Generate``, or any OpenAI-compatible HTTP
server) with a seeded request stream and report the serving metrics people compare, server-side deltas beside them,
a JSON file with every request and PNG plots.

The options follow ``vllm bench serve`` where they mean the same thing (``--backend``, ``--base-url``, ``--model``,
``--dataset-name random``, ``--random-input-len``, ``--num-prompts``, ``--request-rate``, ``--max-concurrency``,
``--ignore-eos``, ``--temperature``, ``--top-p``, ``--top-k``, ``--min-p``, ``--repetition-penalty``, ``--goodput``,
``--save-result``), so the two can be driven with the same numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from loadgen.clients import BACKENDS, GrpcTarget, OpenAITarget, SendOptions, Target
from loadgen.metrics import Slo, summarize
from loadgen.report import format_run, format_sweep
from loadgen.runner import LoadConfig, run_load, run_load_processes, run_warmups
from loadgen.server_metrics import MetricsWatcher, endpoints_from_state, local_cluster_endpoints
from loadgen.workloads import (
    DATASETS,
    PromptBuilder,
    RandomIdsBuilder,
    Tenant,
    WorkloadConfig,
    iter_requests,
    parse_range,
    ratio_range,
)

PRIORITY_CLASSES = ("interactive", "standard", "batch")
WARMUP_SEED_OFFSET = 7_919  # warm-up prompts come from their own stream: they never prime the measured prompts
SWEEP_SEED_STRIDE = 1_000  # each sweep point draws fresh prompts: no point is served from an earlier one's cache


def parse_tenant(s: str) -> Tenant:
    """``NAME[:rate=R][,priority=P][,key=K][,class=C]`` (``:`` or ``,`` between fields; C: interactive,
    standard or batch)."""
    name, _, rest = s.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"--tenant {s!r}: start with the tenant's name")
    fields: dict[str, Any] = {}
    for part in rest.replace(",", ":").split(":"):
        if not part:
            continue
        k, sep, v = part.partition("=")
        try:
            if k == "rate" and sep:
                fields["rate"] = float(v)
            elif k == "priority" and sep:
                fields["priority"] = int(v)
            elif k == "key" and sep:
                fields["api_key"] = v
            elif k == "class" and sep and v in PRIORITY_CLASSES:
                fields["priority_class"] = v
            else:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--tenant {s!r}: field {part!r}; use NAME:rate=R,priority=P,key=K,class=C (C: "
                f"{', '.join(PRIORITY_CLASSES)})") from None
    t = Tenant(name, **fields)
    if not t.rate > 0 or t.priority < 0:
        raise argparse.ArgumentTypeError(f"--tenant {s!r}: rate must be > 0 and priority >= 0")
    return t


def _rate(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {s}")
    return v


def _target_address(a: argparse.Namespace) -> str:
    if a.base_url:
        return a.base_url.split("://", 1)[-1].rstrip("/")
    return f"{a.host}:{a.port or 50051}"


def _target(a: argparse.Namespace, opts: SendOptions, tenants: list[Tenant]) -> tuple[Target, str]:
    if a.backend == "grpc":
        addr = _target_address(a)
        return GrpcTarget(addr, a.model, opts), addr
    base = a.base_url or f"http://{a.host}:{a.port or 8000}"
    t = OpenAITarget(base, "chat" if a.backend == "openai-chat" else "completions", a.model, opts,
                     models_key=next((t.api_key for t in tenants if t.api_key), None))
    if a.endpoint:
        t.url = t.base_url + "/" + a.endpoint.lstrip("/")
    return t, t.url


def _metrics_urls(a: argparse.Namespace) -> list[str]:
    if a.no_server_metrics:
        return []
    urls = list(a.metrics_url or [])
    if a.cluster_state:
        urls += endpoints_from_state(a.cluster_state)
    if not urls and a.backend == "grpc":  # a cluster that `tokenmill up` started here: all of its processes
        urls = local_cluster_endpoints(_target_address(a))
    if not urls and a.backend != "grpc":
        base = (a.base_url or f"http://{a.host}:{a.port or 8000}").rstrip("/").removesuffix("/v1")
        urls.append(base + "/metrics")
    return urls


def _loads(a: argparse.Namespace, tenants: list[Tenant]) -> list[LoadConfig]:
    rates = a.request_rate or ([sum(t.rate for t in tenants)] if tenants else [math.inf])
    concs = a.max_concurrency or [None]
    if len(rates) > 1 and len(concs) > 1:
        raise ValueError("sweep one of --request-rate or --max-concurrency, not both")
    if a.duration is None and a.num_prompts is None:
        a.num_prompts = 1000 if concs[0] is None and math.isinf(rates[0]) else 200
    return [LoadConfig(request_rate=r, burstiness=a.burstiness, max_concurrency=c, num_requests=a.num_prompts
                       if a.duration is None else None, duration_s=a.duration, warmup_s=a.warmup_seconds,
                       num_warmups=a.num_warmups, seed=a.seed + k * SWEEP_SEED_STRIDE)
            for k, (r, c) in enumerate((r, c) for r in rates for c in concs)]


def _workload(a: argparse.Namespace, seed: int) -> WorkloadConfig:
    inp = parse_range(a.random_input_len)
    out = parse_range(a.random_output_len)
    if a.random_range_ratio:
        if inp[0] != inp[1] or out[0] != out[1]:
            raise ValueError("--random-range-ratio needs single lengths, not LO:HI ranges")
        inp, out = ratio_range(inp[0], a.random_range_ratio), ratio_range(out[0], a.random_range_ratio)
    return WorkloadConfig(dataset=a.dataset_name, input_len=inp, output_len=out, prefix_groups=a.prefix_groups,
                          prefix_len=a.prefix_len, long_input_len=parse_range(a.long_input_len),
                          sharegpt_output_len=a.sharegpt_output_len,
                          chat=a.backend == "openai-chat", chat_length=a.chat_length, seed=seed,
                          structured=_constraints(a), structured_ratio=a.structured_ratio)


def _constraints(a: argparse.Namespace) -> tuple[dict[str, Any], ...]:
    """The output constraints ``--structured`` / ``--json-schema`` ask for (RequestSpec.structured)."""
    if not 0.0 <= a.structured_ratio <= 1.0:
        raise ValueError(f"--structured-ratio must be in [0, 1], got {a.structured_ratio}")
    if a.json_schema:
        if a.structured:
            raise ValueError("give --structured or --json-schema, not both")
        try:
            schema = json.loads(Path(a.json_schema).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--json-schema {a.json_schema}: {e}") from e
        if not isinstance(schema, dict):
            raise ValueError(f"--json-schema {a.json_schema}: a JSON Schema is a JSON object")
        return ({"type": "json_schema", "name": Path(a.json_schema).stem, "schema": schema},)
    if a.structured == "json-object":
        return ({"type": "json_object"},)
    if a.structured == "schemas":
        from loadgen.bench_structured import SCHEMAS

        return tuple({"type": "json_schema", "name": name, "schema": schema} for name, schema in SCHEMAS.items())
    return ()


async def _one_run(a: argparse.Namespace, target: Target, builder: PromptBuilder, tenants: list[Tenant],
                   load: LoadConfig, urls: list[str]) -> dict[str, Any]:
    from tqdm import tqdm

    if a.cache_salt == "auto":  # a fresh salt per run: nothing of an earlier run (or tool) is served from cache
        target.opts = dataclasses.replace(target.opts, cache_salt=uuid.uuid4().hex)

    reqs = iter_requests(_workload(a, load.seed), builder, tenants)
    if load.num_requests is not None:
        # built before the clock: a prompt's text takes milliseconds to build (decode, and a re-encode that checks
        # it), time the event loop that sends and times the requests would otherwise lose at every dispatch
        print(f"building {load.num_requests} prompts ...", file=sys.stderr, flush=True)
        reqs = iter([next(reqs) for _ in range(load.num_requests)])
    warm = iter_requests(_workload(a, load.seed + WARMUP_SEED_OFFSET), builder, tenants)
    warm_recs = await run_warmups(target, warm, load) if load.num_warmups else []
    bar = tqdm(total=load.num_requests, disable=a.disable_tqdm, desc=load.label, unit="req", file=sys.stderr,
               dynamic_ncols=True)
    errors = 0

    watcher = MetricsWatcher(urls, interval=a.metrics_interval)  # no API key: /metrics may be anyone's
    started = time.time()
    records = list(warm_recs)
    interrupted = False
    children: list[tuple[float, float]] = []  # each client process's CPU and wall seconds (--client-processes)

    cpu0, wall0, begun = time.process_time(), time.perf_counter(), False

    async def begin() -> None:  # the server's counters and the client's clocks start with the run
        nonlocal started, cpu0, wall0, begun
        await watcher.start()
        started, cpu0, wall0, begun = time.time(), time.process_time(), time.perf_counter(), True

    def ended(ok: bool) -> None:
        nonlocal errors
        bar.update(1)
        if not ok:
            errors += 1
            bar.set_postfix(errors=errors)

    try:
        if a.client_processes > 1:  # the processes start before the run: it begins once they are ready
            recs, children = await run_load_processes(target, list(reqs), load, a.client_processes, ended, begin)
            records += recs
        else:
            await begin()
            await run_load(target, reqs, load, lambda rec: ended(rec.ok), into=records)
    except asyncio.CancelledError:  # Ctrl-C: keep what was measured, say so
        interrupted = True
    finally:
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        bar.close()
        if begun:
            await watcher.stop()
    slo = Slo.parse(a.goodput)
    summary = summarize(records, slo)
    # the client's own CPU over the run: on a machine it shares with the server, this much was not the server's.
    # The share is the busiest client process's (1.0: a whole core, and the client's delays are in its figures)
    summary["client_cpu_s"] = cpu + sum(c for c, _ in children)
    shares = [cpu / wall if wall > 0 else math.nan, *(c / w for c, w in children if w > 0)]
    summary["client_cpu_share"] = max(shares)
    summary["client_processes"] = a.client_processes
    if tenants:
        summary["by_tenant"] = {t.name: summarize([r for r in records if r.tenant == t.name], slo) for t in tenants}
    lz = {"request_rate": None if math.isinf(load.request_rate) else load.request_rate,
          "burstiness": load.burstiness, "max_concurrency": load.max_concurrency,
          "num_requests": load.num_requests, "duration_s": load.duration_s, "warmup_s": load.warmup_s,
          "num_warmups": load.num_warmups, "seed": load.seed}
    return {"label": load.label, "load": lz, "started_unix": started, "interrupted": interrupted, "summary": summary,
            "server": watcher.report(), "records": [r.to_json() for r in records]}


def send_options(a: argparse.Namespace) -> SendOptions:
    """The per-request options of the parsed command line (``a.api_key``: the key already resolved)."""
    return SendOptions(ignore_eos=a.ignore_eos, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                       min_p=a.min_p, repetition_penalty=a.repetition_penalty, timeout=a.request_timeout,
                       api_key=a.api_key, cache_salt=a.cache_salt if a.cache_salt != "auto" else None)


async def _main(a: argparse.Namespace) -> dict[str, Any]:
    tenants = list(a.tenant or [])
    api_key = a.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("TOKENMILL_API_KEY")
    a.api_key = api_key
    opts = send_options(a)
    target, where = _target(a, opts, tenants)
    loads = _loads(a, tenants)
    builder = _builder(a)
    urls = _metrics_urls(a)
    runs = []
    try:
        await target.open()
        for load in loads:
            runs.append(await _one_run(a, target, builder, tenants, load, urls))
            print(format_run(runs[-1], a.backend, where), flush=True)
            if runs[-1]["interrupted"]:
                break
    finally:
        await target.close()
    if len(runs) > 1:
        print(format_sweep(runs), flush=True)
    cfg = {k: v for k, v in vars(a).items() if k not in ("func", "api_key") and not callable(v)}
    cfg["tenant"] = [{"name": t.name, "rate": t.rate, "priority": t.priority, "priority_class": t.priority_class}
                     for t in tenants]
    return {"tool": "tokenmill bench serve", "backend": a.backend, "target": where,
            "interrupted": any(r["interrupted"] for r in runs),
            "model": getattr(target, "model", None) or a.model, "config": cfg, "runs": runs}


def _builder(a: argparse.Namespace) -> PromptBuilder:
    """Prompts from ``--tokenizer`` (default: ``--model`` when it is a local path, else the embedded SmolLM2), or
    random ids for ``--tokenizer ids:VOCAB``."""
    from common.loader import load_tokenizer

    spec = a.tokenizer
    if spec and spec.startswith("ids:"):
        if a.backend != "grpc":
            raise ValueError("--tokenizer ids:N makes token-id prompts without text: use --backend grpc")
        return RandomIdsBuilder(int(spec[4:]))
    if spec is None and a.model and Path(a.model).expanduser().exists():
        spec = a.model
    return PromptBuilder(load_tokenizer(spec))


def _result_path(a: argparse.Namespace) -> Path | None:
    if not (a.save_result or a.result_file):
        return None
    name = a.result_file or f"tokenmill-serve-{a.backend}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    p = Path(name)
    if a.result_dir and not p.is_absolute():
        p = Path(a.result_dir) / p
    return p


def run(a: argparse.Namespace) -> int:
    try:
        result = asyncio.run(_main(a))
    except (ValueError, RuntimeError, OSError) as e:
        print(f"tokenmill bench serve: {e}", file=sys.stderr)
        return 2
    path = _result_path(a)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_finite(result), separators=(",", ":"), allow_nan=False))
        print(f"results: {path}")
        if not a.no_plots:
            from loadgen import plots

            prefix = path.with_suffix("")
            pngs = [plots.latency_cdfs(result["runs"], prefix.with_name(prefix.name + "_cdf.png"))]
            if len(result["runs"]) > 1:
                pngs += plots.sweep_plots(result["runs"], prefix)
            print("plots: " + " ".join(str(p) for p in pngs))
    if result["interrupted"]:
        print("interrupted: the figures cover the requests sent until then", file=sys.stderr)
        return 130
    failed = sum(r["summary"]["failed"] for r in result["runs"])
    return 1 if failed and a.fail_on_error else 0


def _finite(o: Any) -> Any:
    """NaN/inf → null: strict JSON, which jq and browsers read."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite(v) for v in o]
    return o


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load-test a serving endpoint (gRPC Generate or OpenAI HTTP)",
                       description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("target")
    g.add_argument("--backend", choices=BACKENDS, default="grpc",
                   help="grpc (default): tokenmill.v1.Frontend/Generate; openai: /v1/completions; openai-chat: "
                        "/v1/chat/completions")
    g.add_argument("--base-url", help="http://HOST:PORT for HTTP backends, HOST:PORT for grpc (overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    g.add_argument("--port", type=int, help="default 50051 (grpc) or 8000 (HTTP)")
    g.add_argument("--endpoint", help="HTTP path instead of /v1/completions or /v1/chat/completions")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (default $OPENAI_API_KEY, "
                                     "$TOKENMILL_API_KEY)")
    g.add_argument("--model", "--served-model-name", dest="model",
                   help="model name sent with each request (HTTP: default the first of /v1/models)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer the prompts are built from (common.loader spec: a .gguf, an HF directory, "
                        "smollm2; default --model if it is a local path, else the embedded SmolLM2); ids:VOCAB for "
                        "random token ids without a tokenizer (grpc, dummy models)")
    g.add_argument("--request-timeout", type=float, help="cancel a request after this many seconds")
    g.add_argument("--cache-salt", help="sent with every request: the server's prefix cache is shared only within "
                                        "one salt; 'auto' = a fresh salt per run (a rerun of a seed is then not "
                                        "served from the cache of the run before)")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset-name", "--dataset", dest="dataset_name", choices=DATASETS, default="random",
                   help="default random")
    w.add_argument("--random-input-len", default="256", help="input tokens: N or LO:HI (uniform); default 256")
    w.add_argument("--random-output-len", default="128", help="output tokens (max_tokens): N or LO:HI; default 128")
    w.add_argument("--random-range-ratio", type=float, default=0.0, help="as vLLM: lengths uniform in N·[1-r, 1+r]")
    w.add_argument("--prefix-groups", type=int, default=4, help="shared-prefix: G groups (default 4)")
    w.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: P-token prefix per group, default "
                                                                "512 (the suffix is --random-input-len)")
    w.add_argument("--long-input-len", default="2048:4096", help="long-prompt: input tokens, N or LO:HI")
    w.add_argument("--sharegpt-output-len", type=int, help="sharegpt: fixed output length instead of the table's")
    w.add_argument("--chat-length", choices=("content", "total"), default="content",
                   help="openai-chat: input length counts the message (content, the default, as vLLM) or the "
                        "whole prompt after the chat template (total)")
    w.add_argument("--tenant", action="append", type=parse_tenant, metavar="NAME:rate=R,priority=P,key=K,class=C",
                   help="multi-tenant mix (repeat): each tenant's share of requests follows its rate; without "
                        "--request-rate the offered rate is the sum of the tenants' rates")
    w.add_argument("--seed", type=int, default=0, help="same seed, same request stream and arrival times (default 0)")
    w.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    w.add_argument("--structured", choices=("schemas", "json-object"),
                   help="constrain the outputs (response_format on HTTP, SamplingParams.structured on gRPC): "
                        "'schemas' cycles the five JSON schemas of `tokenmill bench structured` (json_schema, "
                        "strict), 'json-object' asks for any JSON object; every such output is checked, and the "
                        "share that is valid is reported (give max tokens enough for a whole object)")
    w.add_argument("--json-schema", metavar="FILE", help="constrain the outputs to this JSON Schema (as --structured)")
    w.add_argument("--structured-ratio", type=float, default=1.0,
                   help="the share of requests constrained (default 1); the prompts are the same either way")
    sp = p.add_argument_group("sampling", "as vllm bench serve's; an option left out is not sent (the server's "
                                          "default); HTTP sends top_k, min_p and repetition_penalty as vLLM's extra "
                                          "fields")
    sp.add_argument("--temperature", type=float, help="0 = greedy")
    sp.add_argument("--top-p", type=float)
    sp.add_argument("--top-k", type=int, help="1 = greedy; 0 or -1: off")
    sp.add_argument("--min-p", type=float)
    sp.add_argument("--repetition-penalty", type=float)
    lo = p.add_argument_group("load")
    lo.add_argument("--num-prompts", type=int, help="requests per run (default 200, or 1000 all at once)")
    lo.add_argument("--duration", type=float, help="seconds per run instead of a count")
    lo.add_argument("--request-rate", type=_rate, nargs="+", help="open loop, req/s; several values = a sweep "
                                                                  "(default inf: as fast as allowed)")
    lo.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson (default), <1 bursty")
    lo.add_argument("--max-concurrency", type=int, nargs="+",
                    help="cap on requests in flight; with an infinite rate, closed loop; several values = a sweep")
    lo.add_argument("--num-warmups", type=int, default=1, help="requests sent (and waited for) before the clock (default 1)")
    lo.add_argument("--warmup-seconds", type=float, default=0.0,
                    help="requests due in the first S seconds are sent but left out of the figures")
    lo.add_argument("--client-processes", type=int, default=1,
                    help="send from N client processes, each 1/N of the rate and the concurrency (one Python "
                         "process reading ~10k token messages a second is itself the bottleneck; default 1)")
    m = p.add_argument_group("metrics and output")
    m.add_argument("--goodput", "--slo", dest="goodput", nargs="+", metavar="KEY:MS",
                   help="SLO for goodput: ttft:MS tpot:MS e2e:MS (any subset)")
    m.add_argument("--metrics-url", action="append", help="a Prometheus /metrics URL to diff (repeat)")
    m.add_argument("--cluster-state", help="read every process's /metrics from a `tokenmill up` state file (grpc: "
                                           "the default state file is read when its gateway is the target)")
    m.add_argument("--metrics-interval", type=float, default=1.0,
                   help="seconds between /metrics samples during a run, for the KV usage peak (default 1)")
    m.add_argument("--no-server-metrics", action="store_true",
                   help="read no /metrics (a cross-check against a client that reads none)")
    m.add_argument("--save-result", action="store_true", help="write the JSON (and plots)")
    m.add_argument("--result-file", "--result-filename", dest="result_file", help="JSON path (implies --save-result)")
    m.add_argument("--result-dir", help="directory for the JSON and plots")
    m.add_argument("--no-plots", action="store_true", help="write the JSON only")
    m.add_argument("--disable-tqdm", action="store_true")
    m.add_argument("--fail-on-error", action="store_true", help="exit 1 when any request failed")
    p.set_defaults(func=run)
