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

The numbers behind the defaults are in docs/performance-notes.md.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import resource
import statistics
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
    g = torch.Generator().manual_seed(1234)
    return torch.randn((num_blocks, *dims), generator=g).to(device=device, dtype=getattr(torch, dtype))


def _prefill(conn, kw: dict[str, Any], num_blocks: int, device: str, shape: str, busy: bool = False) -> None:
    import torch

    torch.set_num_threads(1)
    from common.kv_transfer import KvCompat, KvTransferAgent

    kv = _pool(num_blocks, fill=True, device=device, shape=shape)
    agent = KvTransferAgent("bench-prefill", kv, KvCompat.for_pool(kv, "smollm2", "bench"), **kw)
    hbm = _BusyHbm(device) if busy else None  # as a prefill worker's own steps keep its GPU busy
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


class _BusyHbm:
    """Keeps a GPU's memory busy, as a decode worker's steps do (each reads the weights): copies of a 1 GiB buffer
    on a stream of their own, from a thread, until stopped; ``Bps`` is what the copies reached (read + write)."""

    def __init__(self, device: str) -> None:
        import threading

        import torch

        self.src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        self.dst = torch.empty_like(self.src)
        self.stream = torch.cuda.Stream(device)
        self.stop = threading.Event()
        self.copies = 0
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            t0 = time.perf_counter()
            while not self.stop.is_set():
                for _ in range(4):
                    self.dst.copy_(self.src)
                self.stream.synchronize()  # gives the GIL up while the copies run
                self.copies += 4
            self.seconds = time.perf_counter() - t0

    def close(self) -> float:
        self.stop.set()
        self.thread.join()
        return 2 * self.copies * self.src.numel() / self.seconds


def _decode(conn, out, kw: dict[str, Any], num_blocks: int, sizes: tuple[int, ...], reps: int,
            poll_sleep: float, device: str, shape: str, pattern: str, busy: bool = False) -> None:
    import random

    import torch

    torch.set_num_threads(1)
    from common.kv_transfer import KvTransferAgent

    hs = conn.recv()
    kv = _pool(num_blocks, fill=False, device=device, shape=shape)
    agent = KvTransferAgent("bench-decode", kv, hs.compat, **kw)
    t0 = time.perf_counter()
    agent.add_peer(*hs)
    add_peer_s = time.perf_counter() - t0
    hbm = _BusyHbm(device) if busy else None
    rng = random.Random(0)
    rows = []
    sent = 0
    for tokens in sizes:
        n = -(-tokens // BLOCK)
        times, posts = [], []
        cpu = 0.0
        for i in range(reps + 1):
            if pattern == "scattered":  # every other block, shuffled: no two neighbours, both sides
                remote = rng.sample(range(0, num_blocks, 2), n)
                local = rng.sample(range(1, num_blocks, 2), n)
            else:  # one run a side, descending
                r0, l0 = rng.randrange(num_blocks - n + 1), rng.randrange(num_blocks - n + 1)
                remote, local = list(range(r0 + n - 1, r0 - 1, -1)), list(range(l0 + n - 1, l0 - 1, -1))
            c0, t0 = _cpu_seconds(), time.perf_counter()
            h = agent.start_read(hs.agent_name, remote, local, notif=f"{tokens}:{i}".encode())
            post = time.perf_counter() - t0
            while agent.poll(h) == "PROC":
                if poll_sleep:
                    time.sleep(poll_sleep)
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
        conn.send(("sha", remote))
        ok = conn.recv() == hashlib.sha256(_bytes(kv[local])).hexdigest()
        med = statistics.median(times)
        rows.append({"tokens": tokens, "blocks": n, "runs": h.runs, "bytes": n * agent.bytes_per_block, "median_s": med,
                     "min_s": min(times), "max_s": max(times), "first_s": first_s, "exact": ok,
                     "post_s": statistics.median(posts), "cpu_per_read_s": cpu / reps})
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
              "busy_Bps": busy_Bps})
    agent.close()


def run_config(kw: dict[str, Any], sizes: tuple[int, ...] = DEFAULT_SIZES, reps: int = 15,
               poll_sleep: float = 0.0, device: str = "cpu", timeout: float = 120.0, shape: str = "smollm2",
               pattern: str = "scattered", busy: str = "none") -> dict[str, Any]:
    """One configuration in a fresh prefill + decode process pair; returns the decode side's measurements.
    ``busy``: which GPUs copy memory the whole time (none, decode, prefill or both)."""
    ctx = mp.get_context("spawn")
    num_blocks = 2 * -(-max(sizes) // BLOCK) + 8
    a, b = ctx.Pipe()
    res_r, res_w = ctx.Pipe(duplex=False)
    pre = ctx.Process(name="prefill", target=_prefill, args=(a, _side(kw, "prefill"), num_blocks, device.split(",")[0], shape, busy in ("prefill", "both")), daemon=True)
    dec = ctx.Process(name="decode", target=_decode, args=(b, res_w, _side(kw, "decode"), num_blocks, sizes, reps, poll_sleep, device.split(",")[-1], shape, pattern, busy in ("decode", "both")), daemon=True)
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
                    help="comma-separated, each a run: none, decode, prefill, both: READ while that GPU's memory is "
                         "busy with copies of its own (as a serving worker's steps keep it)")
    args = ap.parse_args(argv)
    busies = [b.strip() for b in args.busy.split(",") if b.strip()]
    if not busies or set(busies) - {"none", "decode", "prefill", "both"}:
        ap.error(f"--busy: each of none, decode, prefill, both; got {args.busy!r}")
    if busies != ["none"] and not all(d.startswith("cuda") for d in args.device.split(",")):
        ap.error("--busy needs the pools on GPUs")
    names = list(CONFIGS) if args.compare else (args.config or [next(iter(CONFIGS))])
    patterns = PATTERNS if args.pattern == "both" else (args.pattern,)
    results: dict[str, dict[str, Any] | str] = {}
    for name in names:
        for pattern, busy in ((p, b) for p in patterns for b in busies):
            key = f"{name}; {pattern}" + ("" if busy == "none" else f"; busy GPU: {busy}")
            try:
                r = run_config(CONFIGS[name], tuple(args.sizes), args.reps, args.poll_sleep_ms / 1e3, args.device,
                               shape=args.shape, pattern=pattern, busy=busy)
                if r["notifs"] != r["sent"]:
                    print(f"{key}: prefill saw {r['notifs']} of {r['sent']} notifications")
                results[key] = r
                if r["busy_Bps"]:
                    print(f"{key}: the decode GPU's own copies ran at {r['busy_Bps'] / 1e12:.2f} TB/s (read + write)")
            except Exception as e:
                results[key] = f"{type(e).__name__}: {e}"[:120]
            print(f"done: {key}", flush=True)
    print(f"\n{args.reps} READs per row after one warm-up; {args.shape} blocks; poll sleep {args.poll_sleep_ms} ms; "
          f"pools on {args.device}.\n")
    print(_table(results))
    devices = args.device.split(",")
    if len(devices) == 2 and devices[0] != devices[1] and devices[0].startswith("cuda"):
        nbytes = -(-max(args.sizes) // BLOCK) * _block_bytes(args.shape)
        from loadgen.bench_disagg import copy_bandwidth_between

        gbs = copy_bandwidth_between(devices[0], devices[1], nbytes)["Bps"] / 1e9
        print(f"\ntorch peer copy {devices[0]} -> {devices[1]}, {nbytes / 2**20:.0f} MiB (bytes counted once): "
              f"{gbs:.1f} GB/s")


def _block_bytes(shape: str) -> int:
    dims, dtype = SHAPES[shape]
    n = 1
    for d in dims:
        n *= d
    return n * (4 if dtype == "float32" else 2)


if __name__ == "__main__":
    main()
