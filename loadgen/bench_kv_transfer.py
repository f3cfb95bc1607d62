"""KV transfer benchmark: two processes, decode READs a prompt's KV blocks from prefill over NIXL.

The KV of a 512- and a 4,096-token prompt (``--sizes``) of SmolLM2-135M in float32 (30 layers, 3 KV heads, head
dim 64, block 16: 720 KiB a block, 22.5 MiB and 180 MiB a prompt), or of Llama-3.1-8B in bfloat16 (``--shape
llama-3.1-8b``: 32 layers, 8 KV heads, head dim 128: 2 MiB a block). Block ids are ``scattered`` on both sides (no
two neighbours, so every block is its own descriptor) or ``contiguous`` (one run on each side, handed over in
descending order as a freed sequence's blocks come back: the agent sorts them into one descriptor). Each READ is
timed from ``start_read`` to the ``poll`` that sees DONE (polled in a tight loop); the median of several repetitions
after a warm-up, and GB/s = bytes / median. Every configuration runs in a fresh pair of processes, because UCX reads
UCX_TLS once per process. With two GPUs, torch's peer copy (``copy_`` from one card to the other, bytes counted
once) of the largest size is timed in the same run, as the ceiling.

    python -m loadgen.bench_kv_transfer                           # the defaults common/kv_transfer.py picks
    python -m loadgen.bench_kv_transfer --compare                 # UCX_TLS / error handling / progress thread
    python -m loadgen.bench_kv_transfer --device cuda:0,cuda:1    # GPU pools (prefill's, decode's)
    python -m loadgen.bench_kv_transfer --device cuda:0,cuda:1 --busy none,decode,both  # and beside HBM copies
    UCX_PROTO_INFO=y python -m loadgen.bench_kv_transfer ...      # UCX prints the transport of each protocol
    python -m loadgen.bench_kv_transfer --device cuda:0,cuda:1 --busy serving --engine-step-ms 8 --engine-python-ms 1.5
    python -m loadgen.bench_kv_transfer --device cuda:0,cuda:1 --profile   # each READ's copy timed on the GPU too

``--busy``: ``decode`` / ``prefill`` / ``both`` copy a 1 GiB buffer on that GPU the whole time (its memory busy
through the copy engines); ``decode-gemv`` reads a 1 GiB matrix on the decode GPU from its SMs, over and over, as a
decode step reads its weights; ``prefill-gemm`` runs bfloat16 matmuls on the prefill GPU (its SMs busy, as its
prompts keep them); ``serving`` = decode copies + prefill matmuls, ``serving-gemv`` = decode reads + prefill
matmuls, as in a 1P+1D cluster. Beside a busy decode GPU, torch's peer copy of the first size is timed too, under
the same load: the ceiling a READ has there.
``--engine-step-ms``: the decode process behaves like a decode worker's engine process instead of polling in a tight
loop: its main thread runs ``--engine-python-ms`` of Python a step (holding the GIL, at the workers' 0.5 ms switch
interval, ``--engine-switch-ms``), posts a READ at a step's start and polls it once a step, and the agent's own
poller thread sees the READ end, as in the cluster.

The numbers behind the defaults are in docs/performance-notes.md.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import resource
import statistics
import tempfile
import time
from typing import Any

BLOCK = 16
# a block's shape (layers, k/v, block size, kv heads, head dim) and dtype
SHAPES: dict[str, tuple[tuple[int, ...], str]] = {
    "smollm2": ((30, 2, BLOCK, 3, 64), "float32"),
    "llama-3.1-8b": ((32, 2, BLOCK, 8, 128), "bfloat16"),
}
PATTERNS = ("scattered", "contiguous")
DEFAULT_SIZES = (512, 4096)

# name -> KvTransferAgent keyword arguments, added to role="prefill" / role="decode" (which pick the progress
# thread); "ucx_tls": "all" is UCX's own default.
CONFIGS: dict[str, dict[str, Any]] = {
    "defaults (kv_transfer.py)": {},
    "UCX default (all); peer": {"ucx_tls": "all"},
    "tcp; peer": {"ucx_tls": "tcp"},
    "tcp,cma; none": {"ucx_tls": "tcp,cma", "error_handling_mode": "none"},
    "sm; none": {"ucx_tls": "sm", "error_handling_mode": "none"},
    "posix,sysv; none": {"ucx_tls": "posix,sysv", "error_handling_mode": "none"},
    "sm; peer": {"ucx_tls": "sm"},
    "tcp,cma; peer; thread 100us both sides": {"ucx_tls": "tcp,cma", "progress_thread": 100},
    "tcp,cma; peer; no thread either side": {"ucx_tls": "tcp,cma", "progress_thread": "off"},
    "tcp,cma; peer; thread 0us both (NIXL default)": {"ucx_tls": "tcp,cma", "progress_thread": 0},
    "tcp; peer; no thread either side": {"ucx_tls": "tcp", "progress_thread": "off"},
}


def _side(kw: dict[str, Any], role: str) -> dict[str, Any]:
    return {"role": role, **kw}


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _bytes(t) -> bytes:
    """A tensor's bytes (numpy has no bfloat16: viewed as int16)."""
    import torch

    t = t.contiguous().cpu()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def _pool(num_blocks: int, fill: bool, device: str, shape: str):
    import torch

    dims, dtype = SHAPES[shape]
    if not fill:
        return torch.zeros((num_blocks, *dims), dtype=getattr(torch, dtype), device=device)
    g = torch.Generator(device=device).manual_seed(1234)  # on the GPU: a pool of tens of GB fills in ms there
    return torch.randn((num_blocks, *dims), generator=g, device=device, dtype=getattr(torch, dtype))


def _own_gpu(device: str) -> str:
    """Make ``device`` (cuda:N) the only GPU this process sees, as the launcher places a worker; its name now."""
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = device.partition(":")[2] or "0"
    return "cuda:0"


def _prefill(conn, kw: dict[str, Any], num_blocks: int, device: str, shape: str, busy: str = "",
             own_gpu: bool = False) -> None:
    if own_gpu:
        device = _own_gpu(device)
    import torch

    torch.set_num_threads(1)
    from common.kv_transfer import KvCompat, KvTransferAgent

    kv = _pool(num_blocks, fill=True, device=device, shape=shape)
    agent = KvTransferAgent("bench-prefill", kv, KvCompat.for_pool(kv, "smollm2", "bench"), **kw)
    # as a prefill worker's own steps keep its GPU busy: memory copies, or matmuls as its prompts run
    hbm = _BusyGpu(device, busy) if busy else None
    conn.send(agent.handshake_payload())
    notifs: list[bytes] = []
    idle_cpu = None
    while True:
        notifs.extend(m for _, m in agent.completed_notifications())
        if not conn.poll(0.005):  # an engine loop's cadence
            continue
        cmd, arg = conn.recv()
        if cmd == "sha":
            conn.send(hashlib.sha256(_bytes(kv[arg])).hexdigest())
        elif cmd == "idle":  # CPU this process burns over `arg` seconds with nothing to do but the loop above
            c0, t0 = _cpu_seconds(), time.perf_counter()
            while time.perf_counter() - t0 < arg:
                agent.completed_notifications()
                conn.poll(0.005)
            idle_cpu = (_cpu_seconds() - c0) / (time.perf_counter() - t0)
            conn.send(idle_cpu)
        elif cmd == "notifs":
            deadline = time.perf_counter() + 2.0
            while len(notifs) < arg and time.perf_counter() < deadline:
                notifs.extend(m for _, m in agent.completed_notifications())
                time.sleep(0.001)
            conn.send(len(notifs))
        elif cmd == "stop":
            break
    if hbm is not None:
        hbm.close()
    agent.close()


class _BusyGpu:
    """Keeps a GPU busy from a thread, on a stream of its own, until stopped, as a serving worker's steps keep it:

    - ``copy``: copies of a 1 GiB buffer (memory busy through the copy engines);
    - ``gemv``: a bfloat16 row times a 1 GiB matrix (memory busy from the SMs, as a decode step reads its weights);
    - ``gemm``: bfloat16 matmuls of 8,192 × 8,192 (SMs busy, as a prefill worker's prompts keep them).

    ``close`` returns what the work reached: bytes read and written a second (copy), bytes read (gemv), FLOP/s."""

    def __init__(self, device: str, kind: str) -> None:
        import threading

        import torch

        self.kind = kind
        if kind == "copy":
            self.a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
            self.b = torch.empty_like(self.a)
            self.per_round = 2.0 * self.a.numel()
        elif kind == "gemv":
            self.a = torch.randn(1, 8192, device=device, dtype=torch.bfloat16)
            self.b = torch.randn(8192, 65536, device=device, dtype=torch.bfloat16)
            self.per_round = float(self.b.numel() * self.b.element_size())
        else:
            self.a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
            self.b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
            self.per_round = 2.0 * 8192 ** 3
        self.stream = torch.cuda.Stream(device)
        self.stop = threading.Event()
        self.rounds = 0
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            t0 = time.perf_counter()
            while not self.stop.is_set():
                for _ in range(4):
                    if self.kind == "copy":
                        self.b.copy_(self.a)
                    else:
                        torch.mm(self.a, self.b)
                self.stream.synchronize()  # gives the GIL up while the work runs
                self.rounds += 4
            self.seconds = time.perf_counter() - t0

    def close(self) -> float:
        self.stop.set()
        self.thread.join()
        return self.rounds * self.per_round / self.seconds


def _peer_copy_beside(device: str, src_device: str, nbytes: int, reps: int = 10) -> float:
    """torch's peer copy of ``nbytes`` from ``src_device`` into ``device`` while its load runs: bytes / median s."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times[1:])


def _profiled_reads(prof: Any, nbytes: int) -> dict[str, float]:
    """Stop ``prof`` (a started ``common.profiling.EngineProfiler``) and return the medians of its READs of
    ``nbytes`` but the first (the connection's set-up), as loadgen.profile_summary reads them off the trace."""
    import shutil

    from loadgen import profile_summary

    try:
        rows = profile_summary.reads(profile_summary.load_events(prof.stop()))
    finally:
        shutil.rmtree(prof.out_dir, ignore_errors=True)
    return profile_summary.read_medians([r for r in rows if r["bytes"] == nbytes][1:])


def _python_for(seconds: float) -> None:
    """Pure Python work (the GIL held, as an engine thread's scheduling holds it) for ``seconds``."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        for i in range(50):
            x += i * i


def _decode(conn, out, kw: dict[str, Any], num_blocks: int, sizes: tuple[int, ...], reps: int,
            poll_sleep: float, device: str, shape: str, pattern: str, busy: str = "",
            engine: tuple[float, float, float] | None = None, src_device: str = "", own_gpu: bool = False,
            profile: bool = False, gap: float = 0.0, warm_lead: float | None = None) -> None:
    import random

    if own_gpu:
        device, src_device = _own_gpu(device), ""

    import torch

    torch.set_num_threads(1)
    from common.kv_transfer import KvTransferAgent

    if engine is not None:
        import sys

        sys.setswitchinterval(engine[2])
    hs = conn.recv()
    kv = _pool(num_blocks, fill=False, device=device, shape=shape)
    if warm_lead is not None:  # the workers' own warm-up, on whatever pool (a host pool's default is off)
        kw = {**kw, "warm_links": True}
    agent = KvTransferAgent("bench-decode", kv, hs.compat, **kw)
    t0 = time.perf_counter()
    agent.add_peer(*hs)
    add_peer_s = time.perf_counter() - t0
    hbm = _BusyGpu(device, busy) if busy else None
    rng = random.Random(0)
    rows = []
    sent = 0
    for tokens in sizes:
        n = -(-tokens // BLOCK)
        times, posts = [], []
        cpu = 0.0
        prof = None
        if profile:  # the torch profiler over this size's READs: the workers' own (CPU ranges, CUPTI's copies)
            from common.profiling import EngineProfiler

            prof = EngineProfiler(tempfile.mkdtemp(prefix="kv-bench-"), "bench-decode")
            prof.start()
        for i in range(reps + 1):
            if gap:  # the GPUs idle before each READ, as between the requests of a light load
                time.sleep(gap)
            if pattern == "scattered":  # every other block, shuffled: no two neighbours, both sides
                remote = rng.sample(range(0, num_blocks, 2), n)
                local = rng.sample(range(1, num_blocks, 2), n)
            else:  # one run a side, descending
                r0, l0 = rng.randrange(num_blocks - n + 1), rng.randrange(num_blocks - n + 1)
                remote, local = list(range(r0 + n - 1, r0 - 1, -1)), list(range(l0 + n - 1, l0 - 1, -1))
            if warm_lead is not None:  # KvTransferAgent.warm_link, as a decode worker wakes the link before a pull
                agent.warm_link(hs.agent_name, remote[0])
                end = time.perf_counter() + warm_lead
                while time.perf_counter() < end:
                    pass
            c0, t0 = _cpu_seconds(), time.perf_counter()
            h = agent.start_read(hs.agent_name, remote, local, notif=f"{tokens}:{i}".encode())
            post = time.perf_counter() - t0
            if engine is None:
                while agent.poll(h) == "PROC":
                    if poll_sleep:
                        time.sleep(poll_sleep)
            else:  # a step: Python (GIL held), then the GPU's time (GIL free); the READ polled once a step
                step_s, python_s, _ = engine
                while True:
                    s0 = time.perf_counter()
                    _python_for(python_s)
                    if agent.poll(h) != "PROC":
                        break
                    time.sleep(max(0.0, step_s - (time.perf_counter() - s0)))
            c1 = _cpu_seconds()
            sent += 1
            assert h.state == "DONE", h.error
            agent.release(h)
            if i:  # the first one is a warm-up (connection set-up)
                times.append(h.seconds)
                posts.append(post)
                cpu += c1 - c0
            else:
                first_s = h.seconds
        on_gpu = _profiled_reads(prof, n * agent.bytes_per_block) if prof is not None else None
        conn.send(("sha", remote))
        ok = conn.recv() == hashlib.sha256(_bytes(kv[local])).hexdigest()
        med = statistics.median(times)
        rows.append({"tokens": tokens, "blocks": n, "runs": h.runs, "bytes": n * agent.bytes_per_block, "median_s": med,
                     "min_s": min(times), "max_s": max(times), "first_s": first_s, "exact": ok,
                     "post_s": statistics.median(posts), "cpu_per_read_s": cpu / reps, "profile": on_gpu})
    peer = _peer_copy_beside(device, src_device, rows[0]["bytes"]) if src_device and hbm is not None else None
    busy_Bps = hbm.close() if hbm is not None else None
    conn.send(("notifs", sent))
    notifs = conn.recv()
    conn.send(("idle", 1.0))
    idle = conn.recv()
    c0, t0 = _cpu_seconds(), time.perf_counter()
    time.sleep(1.0)
    decode_idle = (_cpu_seconds() - c0) / (time.perf_counter() - t0)
    conn.send(("stop", None))
    out.send({"rows": rows, "notifs": notifs, "sent": sent, "add_peer_s": add_peer_s, "ucx_tls": agent.ucx_tls,
              "prefill_idle_cpu": idle, "decode_idle_cpu": decode_idle, "counters": agent.counters(),
              "busy_Bps": busy_Bps, "busy_peer_copy_Bps": peer})
    agent.close()


# busy -> (the prefill GPU's load, the decode GPU's)
BUSY = {"none": ("", ""), "decode": ("", "copy"), "prefill": ("copy", ""), "both": ("copy", "copy"),
        "prefill-gemm": ("gemm", ""), "serving": ("gemm", "copy"), "decode-gemv": ("", "gemv"),
        "serving-gemv": ("gemm", "gemv")}


def run_config(kw: dict[str, Any], sizes: tuple[int, ...] = DEFAULT_SIZES, reps: int = 15,
               poll_sleep: float = 0.0, device: str = "cpu", timeout: float = 120.0, shape: str = "smollm2",
               pattern: str = "scattered", busy: str = "none", engine: tuple[float, float, float] | None = None,
               own_gpu: bool = False, pool_blocks: int = 0, profile: bool = False, gap: float = 0.0,
               warm_lead: float | None = None) -> dict[str, Any]:
    """One configuration in a fresh prefill + decode process pair; returns the decode side's measurements.
    ``busy``: what keeps the GPUs busy (a key of BUSY); ``engine``: (step, Python a step, GIL switch interval)
    seconds, the decode side polling as an engine does (None: a tight loop); ``gap``: seconds of sleep before each
    READ; ``warm_lead``: the agent's ``warm_link`` this many seconds before each measured READ (None: none; it posts
    nothing over a link with traffic in the last WARM_IDLE_S)."""
    pre_busy, dec_busy = BUSY[busy]
    ctx = mp.get_context("spawn")
    num_blocks = max(pool_blocks, 2 * -(-max(sizes) // BLOCK) + 8)
    a, b = ctx.Pipe()
    res_r, res_w = ctx.Pipe(duplex=False)
    pre = ctx.Process(name="prefill", target=_prefill, args=(a, _side(kw, "prefill"), num_blocks, device.split(",")[0], shape, pre_busy, own_gpu), daemon=True)
    dec = ctx.Process(name="decode", target=_decode, args=(b, res_w, _side(kw, "decode"), num_blocks, sizes, reps, poll_sleep, device.split(",")[-1], shape, pattern, dec_busy, engine, device.split(",")[0] if "," in device else "", own_gpu, profile, gap, warm_lead), daemon=True)
    pre.start()
    dec.start()
    try:
        deadline = time.monotonic() + timeout
        while not res_r.poll(0.2):
            dead = [p.name for p in (pre, dec) if not p.is_alive()]
            if dead:
                raise RuntimeError(f"{'/'.join(dead)} process exited (exit {pre.exitcode}/{dec.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result in {timeout}s")
        return res_r.recv()
    except EOFError as e:
        raise RuntimeError("the decode process died (see its stderr)") from e
    finally:
        for p in (dec, pre):
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def _table(results: dict[str, dict[str, Any] | str]) -> str:
    lines = ["| config | UCX_TLS | prompt tokens | MiB | descriptors | median ms | min–max ms | in start_read ms | decode CPU ms | "
             "first ms | GB/s | exact | idle CPU prefill / decode |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if isinstance(r, str):
            lines.append(f"| {name} | failed: {r} ||||||||||| ")
            continue
        for row in r["rows"]:
            lines.append(
                f"| {name} | {r['ucx_tls']} | {row['tokens']} | {row['bytes'] / 2**20:.1f} | {row['runs']} | "
                f"{row['median_s'] * 1e3:.2f} | "
                f"{row['min_s'] * 1e3:.2f}–{row['max_s'] * 1e3:.2f} | {row['post_s'] * 1e3:.2f} | "
                f"{row['cpu_per_read_s'] * 1e3:.1f} | "
                f"{row['first_s'] * 1e3:.1f} | "
                f"{row['bytes'] / row['median_s'] / 1e9:.2f} | {'yes' if row['exact'] else 'NO'} | "
                f"{r['prefill_idle_cpu'] * 100:.0f}% / {r['decode_idle_cpu'] * 100:.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", action="store_true", help="run every configuration in CONFIGS")
    ap.add_argument("--config", action="append", choices=list(CONFIGS), help="run these configurations")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--poll-sleep-ms", type=float, default=0.0,
                    help="sleep between polls (0: tight loop; an engine polls once per step)")
    ap.add_argument("--device", default="cpu", help="where the pools live: cpu (local mode), cuda[:N], or prefill's,decode's (cuda:0,cuda:1)")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="prompt lengths in tokens")
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm2", help="the KV block's model shape")
    ap.add_argument("--pattern", choices=[*PATTERNS, "both"], default="both", help="block ids on both sides")
    ap.add_argument("--busy", default="none",
                    help=f"comma-separated, each a run, of {', '.join(BUSY)}: none, decode, prefill, both: READ while "
                         "that GPU's memory is busy with copies of its own; decode-gemv: the decode GPU reads memory "
                         "from its SMs (as its decode steps do); prefill-gemm: the prefill GPU runs matmuls (as its "
                         "prompts do); serving: decode copies and prefill matmuls; serving-gemv: both from the SMs")
    ap.add_argument("--pool-blocks", type=int, default=0,
                    help="blocks in each side's pool (default: twice the largest READ's): a serving worker's pool "
                         "fills its GPU, tens of GB")
    ap.add_argument("--profile", action="store_true",
                    help="time each READ's copy on the GPU with the torch profiler (loadgen.profile_summary): when "
                         "it starts after the post began, how long it runs, at what rate")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="sleep this long before each READ (the GPUs idle between requests, as under a light load)")
    ap.add_argument("--warm-lead-ms", type=float, default=-1.0,
                    help="this long before each measured READ, the agent's warm_link: a one-block READ over a link "
                         "idle for 5 ms or more, as a decode worker does before a pull (<0: none)")
    ap.add_argument("--own-gpu", action="store_true",
                    help="each process sees only its own GPU (CUDA_VISIBLE_DEVICES), as `tokenmill up` places "
                         "workers; without it both see both")
    ap.add_argument("--engine-step-ms", type=float, default=0.0,
                    help="poll as a decode engine does, once a step of this many ms, the agent's poller thread "
                         "seeing the READ end (0: a tight loop)")
    ap.add_argument("--engine-python-ms", type=float, default=1.5,
                    help="with --engine-step-ms: ms of Python (the GIL held) at each step's start (default 1.5)")
    ap.add_argument("--engine-switch-ms", type=float, default=0.5,
                    help="with --engine-step-ms: the decode process's GIL switch interval (default 0.5, the "
                         "workers' cluster.worker_switch_interval_ms)")
    args = ap.parse_args(argv)
    busies = [b.strip() for b in args.busy.split(",") if b.strip()]
    if not busies or set(busies) - set(BUSY):
        ap.error(f"--busy: each of {', '.join(BUSY)}; got {args.busy!r}")
    if busies != ["none"] and not all(d.startswith("cuda") for d in args.device.split(",")):
        ap.error("--busy needs the pools on GPUs")
    if args.own_gpu and not all(d.startswith("cuda") for d in args.device.split(",")):
        ap.error("--own-gpu needs the pools on GPUs")
    names = list(CONFIGS) if args.compare else (args.config or [next(iter(CONFIGS))])
    patterns = PATTERNS if args.pattern == "both" else (args.pattern,)
    results: dict[str, dict[str, Any] | str] = {}
    for name in names:
        for pattern, busy in ((p, b) for p in patterns for b in busies):
            key = f"{name}; {pattern}" + ("" if busy == "none" else f"; busy GPU: {busy}")
            engine = None
            if args.own_gpu:
                key += "; each process sees its own GPU"
            if args.pool_blocks:
                key += f"; pools of {args.pool_blocks} blocks"
            if args.gap_ms:
                key += f"; {args.gap_ms:g} ms idle before each READ"
            if args.warm_lead_ms >= 0:
                key += f"; warm_link {args.warm_lead_ms:g} ms before each"
            if args.engine_step_ms > 0:
                engine = (args.engine_step_ms / 1e3, args.engine_python_ms / 1e3, args.engine_switch_ms / 1e3)
                key += (f"; engine {args.engine_step_ms:g} ms a step, {args.engine_python_ms:g} of Python, "
                        f"switch {args.engine_switch_ms:g} ms")
            try:
                r = run_config(CONFIGS[name], tuple(args.sizes), args.reps, args.poll_sleep_ms / 1e3, args.device,
                               shape=args.shape, pattern=pattern, busy=busy, engine=engine, own_gpu=args.own_gpu,
                               pool_blocks=args.pool_blocks, profile=args.profile, gap=args.gap_ms / 1e3,
                               warm_lead=args.warm_lead_ms / 1e3 if args.warm_lead_ms >= 0 else None)
                if r["notifs"] != r["sent"]:
                    print(f"{key}: prefill saw {r['notifs']} of {r['sent']} notifications")
                results[key] = r
                if r["busy_Bps"]:
                    print(f"{key}: the decode GPU's own work read and wrote {r['busy_Bps'] / 1e12:.2f} TB/s")
                for row in r["rows"]:
                    p = row.get("profile") or {}
                    if p.get("reads"):
                        print(f"{key}: {row['tokens']} tokens: the copy on the GPU {p['copy_ms']:.3f} ms "
                              f"({p['copy_GBps']:.0f} GB/s), starting {p['copy_starts_ms']:.3f} ms after the post "
                              f"began (posting {p['post_ms']:.3f} ms under the profiler), done after "
                              f"{p['done_ms']:.3f} ms; median of {p['reads']} READs")
                if r.get("busy_peer_copy_Bps"):
                    print(f"{key}: torch's peer copy of the first size beside it: "
                          f"{r['busy_peer_copy_Bps'] / 1e9:.1f} GB/s")
            except Exception as e:
                results[key] = f"{type(e).__name__}: {e}"[:120]
            print(f"done: {key}", flush=True)
    print(f"\n{args.reps} READs per row after one warm-up; {args.shape} blocks; poll sleep {args.poll_sleep_ms} ms; "
          f"pools on {args.device}.\n")
    print(_table(results))
    devices = args.device.split(",")
    if len(devices) == 2 and devices[0] != devices[1] and devices[0].startswith("cuda"):
        from loadgen.bench_disagg import copy_bandwidth_between

        idle = f" after {args.gap_ms:g} ms idle each" if args.gap_ms else ""
        for tokens in sorted(set(args.sizes)):  # torch's copy of each READ's bytes, the link as idle as for the READs
            nbytes = -(-tokens // BLOCK) * _block_bytes(args.shape)
            pc = copy_bandwidth_between(devices[0], devices[1], nbytes, idle_s=args.gap_ms / 1e3)
            print(f"\ntorch peer copy {devices[0]} -> {devices[1]}, {nbytes / 2**20:.0f} MiB{idle} (bytes counted "
                  f"once): {pc['seconds_p50'] * 1e3:.3f} ms, {pc['Bps'] / 1e9:.1f} GB/s")


def _block_bytes(shape: str) -> int:
    dims, dtype = SHAPES[shape]
    n = 1
    for d in dims:
        n *= d
    return n * (4 if dtype == "float32" else 2)


if __name__ == "__main__":
    main()
