"""Defaults that follow the machine: the dtype a CPU computes fastest in, and whether its cores can feed separate
prefill and decode pools. ``tokenmill up`` (and so ``make up``), ``generate`` and the benchmarks take them when
no flag, config file or environment variable says otherwise; deployments (compose, Helm, Ray) state theirs.

- bfloat16 where the CPU has bf16 arithmetic (AMX or AVX512-BF16), as vLLM's CPU backend picks; float32 otherwise.
  On CUDA: bfloat16.
- On the CPU, separate pools only from ``MIN_CORES_FOR_POOLS`` usable cores: with fewer, a prefill worker and a
  decode worker take cores from each other, so one decode worker prefills its own requests (docs/benchmarks.md
  measures both layouts against vLLM's CPU server).
- On the CPU, a served step's token budget of ``TOKENS_PER_CORE`` per usable core (``MIN_CPU_BUDGET`` to the
  engine's default): a step's prefill then takes about 100 ms, so a wave of prompts gets its first tokens in turn,
  and the decodes riding along are not held up for a whole wave's prefill (docs/benchmarks.md, "make up as
  shipped").
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from common.config import DType, EngineConfig, field_default

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
_huge_pages_set_here = False

BF16_FLAGS = {"amx_bf16": "AMX BF16", "avx512_bf16": "AVX512-BF16"}  # /proc/cpuinfo flags, the faster first
MIN_CORES_FOR_POOLS = 8
TOKENS_PER_CORE = 256  # a 2-core AMX VM prefills about 6,500 tokens/s in bfloat16: 512 tokens a step ≈ 80 ms
MIN_CPU_BUDGET = 512


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's flags (empty where the file is missing or has none: not Linux x86)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def usable_cores() -> int:
    """Cores this process may run on (its affinity, e.g. a container's cpuset), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class CpuDefaults:
    dtype: DType
    aggregated: bool  # no prefill pool: the decode workers prefill
    max_num_batched_tokens: int  # a served step's token budget
    why_dtype: str
    why_layout: str
    why_budget: str


def cpu_defaults(flags: frozenset[str] | None = None, cores: int | None = None) -> CpuDefaults:
    """The CPU's dtype and layout, each with its reason in a few words. Arguments: for tests (default: read here)."""
    flags = cpu_flags() if flags is None else flags
    cores = usable_cores() if cores is None else cores
    bf16 = next((f for f in BF16_FLAGS if f in flags), None)
    why_dtype = f"the CPU has {BF16_FLAGS[bf16]}" if bf16 else "no bf16 arithmetic on this CPU"
    aggregated = cores < MIN_CORES_FOR_POOLS
    why_layout = (f"{cores} core{'s' if cores != 1 else ''}, too few for separate prefill and decode pools"
                  if aggregated else f"{cores} cores")
    default = field_default(EngineConfig, "max_num_batched_tokens")
    budget = min(default, max(MIN_CPU_BUDGET, TOKENS_PER_CORE * cores))
    why_budget = f"{TOKENS_PER_CORE} per core" if budget < default else "the engine's default"
    return CpuDefaults("bfloat16" if bf16 else "float32", aggregated, budget, why_dtype, why_layout, why_budget)


# A CUDA step's prompt tokens stay under this many FLOPs a GPU (2 × parameters ÷ GPUs a token): ~50 ms at the
# ~700 TFLOP/s an H100 or H200 prefill reaches. The engine's 2,048 tokens stay under it up to ~8B parameters a GPU;
# a Llama-3.1-70B at TP=2 gets 512, which served 4× the concurrency within TTFT p50 < 500 ms and ITL p50 < 50 ms
# on two H200s (docs/benchmarks.md).
GPU_STEP_FLOPS = 36e12


def gpu_step_budget(params: int, gpus: int, default: int) -> int:
    """A CUDA step's token budget for a model of ``params`` parameters over ``gpus`` GPUs: the multiple of 256
    nearest to GPU_STEP_FLOPS's tokens, from 256 to ``default``."""
    tokens = GPU_STEP_FLOPS * gpus / (2 * params)
    return max(256, min(default, round(tokens / 256) * 256))


def default_dtype(device: str) -> DType:
    """The dtype a command uses on ``device`` when none is asked for."""
    return "bfloat16" if device == "cuda" else cpu_defaults().dtype


def use_huge_pages() -> None:
    """Back torch's CPU buffers of 2 MiB and more with transparent huge pages, unless the environment already says
    (decoding reads every weight each step; docs/performance-notes.md). c10 reads the variable once, at its first
    allocation: entry points call this before torch allocates, and child processes inherit it."""
    global _huge_pages_set_here
    if HUGE_PAGES_ENV not in os.environ:
        os.environ[HUGE_PAGES_ENV] = "1"
        _huge_pages_set_here = True


def huge_pages_set_here() -> bool:
    """Whether :func:`use_huge_pages` set the variable (so a peer's environment can leave it out, as it ships)."""
    return _huge_pages_set_here and os.environ.get(HUGE_PAGES_ENV) == "1"
