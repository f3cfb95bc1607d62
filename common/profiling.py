"""The torch profiler around a model worker's engine, started and stopped by an operator.

``tokenmill up --set profile_dir=DIR`` turns it on; then ``POST /start_profile`` and ``POST /stop_profile`` on the
gateway's HTTP API (the names vLLM serves under ``VLLM_TORCH_PROFILER_DIR``) start and stop it in every model worker,
through each worker's ``WorkerAdmin.Profile``. The profiler runs on the engine thread, between two steps, so each
step is one ``tokenmill.engine_step`` range (``engine_loop.STEP_RANGE``) with its torch ops under it; on a GPU, CUPTI records every kernel, graph
replay and copy of the engine's process, including the ones NIXL's UCX posts for a KV READ (each READ's posting is
a ``tokenmill.kv_read_post`` range; ``python -m loadgen.profile_summary TRACE`` lines them up). A stop writes one
gzipped Chrome trace per worker (chrome://tracing, ui.perfetto.dev):
``DIR/<worker>-<pid>-<UTC time>.trace.json.gz``. A tensor-parallel engine is profiled in rank 0's process (its
scheduler, sampler and kernels), not in the other ranks'.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from common.rpc import FailedPrecondition


class ProfileStateError(FailedPrecondition):
    """A profile asked for in the wrong state: profiling off, a start while one runs, a stop with none running."""


class EngineProfiler:
    """One worker's profiler: ``start`` and ``stop`` on the engine thread (the thread whose ops it records)."""

    def __init__(self, out_dir: str | None, name: str) -> None:
        self.out_dir = out_dir
        self.name = name
        self._prof: Any = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        if not self.out_dir:
            raise ProfileStateError("profiling is off on this cluster: start it with --set profile_dir=DIR (the "
                                    "directory the workers write their traces to)")
        if self._prof is not None:
            raise ProfileStateError(f"{self.name} is already profiling: stop it first (POST /stop_profile)")
        import torch
        from torch.profiler import ProfilerActivity, profile

        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities, record_shapes=False, with_stack=False)
        prof.__enter__()
        self._prof = prof

    def stop(self) -> str:
        """End the profile; returns the trace's path."""
        if self._prof is None:
            raise ProfileStateError(f"{self.name} is not profiling: start it first (POST /start_profile)")
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        assert self.out_dir
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        path = Path(self.out_dir) / f"{self.name}-{os.getpid()}-{stamp}.trace.json.gz"
        with tempfile.TemporaryDirectory(dir=self.out_dir) as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(path, "wb", compresslevel=3) as dst:
                shutil.copyfileobj(src, dst)
        return str(path)

    def close(self) -> None:
        """A profile still running when the engine stops is ended without a trace."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
