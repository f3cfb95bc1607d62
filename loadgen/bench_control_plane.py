"""Control-plane cost: the whole local cluster with the model replaced by a no-op (``engine.noop_model``), so
what is measured is the scheduler, detokenizer, gRPC hops and the gateway: output tokens/s streamed by ONE gateway
across N concurrent streams, against the target of 20,000 tokens/s at 256 streams.

Run: ``tokenmill bench control-plane [--streams 256] [--tokens 200]``. Starts its own cluster on free ports.
Talks to it only through the public gRPC ``Generate`` API.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_TOK_S = 20_000


def _free_base() -> int:
    for base in range(21000, 31000, 700):
        ok = True
        for off in (0, 100, 200, 300, 400, 450, 451, 1000, 1100, 1200, 1300, 1400):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", base + off))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range below 32768")


async def _drive(address: str, streams: int, tokens: int) -> dict:
    import grpc
    from tokenmill.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

    got = [0] * streams
    msgs = [0] * streams

    async def one(i: int, stub) -> None:
        req = frontend_pb2.GenerateRequest(
            prompt_token_ids=frontend_pb2.TokenIds(ids=[1 + i % 100, 2, 3, 4]),
            params=common_pb2.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
        )
        async for r in stub.Generate(req):
            got[i] += len(r.token_ids)
            msgs[i] += 1

    async with grpc.aio.insecure_channel(address) as ch:
        stub = frontend_pb2_grpc.FrontendStub(ch)
        await asyncio.gather(*(one(i, stub) for i in range(min(8, streams))))  # warm-up
        got[:] = [0] * streams
        msgs[:] = [0] * streams
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, stub) for i in range(streams)))
        dt = time.perf_counter() - t0
    return {"streams": streams, "tokens": sum(got), "messages": sum(msgs), "seconds": dt,
            "tok_s": sum(got) / dt, "tokens_per_message": sum(got) / max(1, sum(msgs)),
            "complete": all(g == tokens for g in got)}


def run(a: argparse.Namespace) -> int:
    base = _free_base()
    gw = f"127.0.0.1:{base + 450}"
    tmp = Path(tempfile.mkdtemp(prefix="tm-cp-"))
    cmd = [sys.executable, "-m", "services.cli", "up", "--base-port", str(base), "--gateway-port", str(base + 450),
           "--http-port", str(base + 451), "--tokenizers", "1", "--prefills", "1", "--decodes", "1",
           "--state-file", str(tmp / "state.json"), "--set", "engine.noop_model=true",
           "--set", f"engine.max_num_seqs={max(a.streams_list)}", "--grace", "2"]
    for item in a.set_items or ():
        cmd += ["--set", item]
    print(f"starting a no-op cluster (base port {base}) ...", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        state = tmp / "state.json"
        while not (state.exists() and json.loads(state.read_text()).get("ready")):
            if proc.poll() is not None or time.monotonic() > deadline:
                print(proc.communicate(timeout=5)[1][-3000:], file=sys.stderr)
                return 1
            time.sleep(0.3)
        rows = []
        for streams in a.streams_list:
            print(f"  {streams} streams × {a.tokens} tokens ...", flush=True)
            rows.append(asyncio.run(_drive(gw, streams, a.tokens)))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print()
    print("| streams | tokens | seconds | output tok/s | tokens/message | target | all complete |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['streams']} | {r['tokens']} | {r['seconds']:.2f} | {r['tok_s']:,.0f} | "
              f"{r['tokens_per_message']:.1f} | {TARGET_TOK_S:,} | {r['complete']} |")
    if a.output:
        Path(a.output).write_text(json.dumps({"cores": os.cpu_count(), "rows": rows}, indent=1))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("control-plane", help="gateway streaming throughput with a no-op model (control-plane cost)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", dest="streams_list", type=int, nargs="+", default=[64, 256],
                   help="concurrent streams per run (default 64 256)")
    p.add_argument("--tokens", type=int, default=200, help="output tokens per stream (default 200)")
    p.add_argument("--output", help="write the results as JSON here")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", dest="set_items",
                   help="a config key for the cluster, e.g. gateway.decode_stream=false (repeatable)")
    p.set_defaults(func=run)
