"""`tokenmill bench structured` with timers around the parts of the sampler's pick on CUDA: the graph replay, the
masks' index (``Sampler._device_masks``), the event marking the masks' read, the logits' load, the token clone and
the pinned uploads, each for constrained and unconstrained picks (mean µs a call, printed at the end).

    python -m loadgen.pick_profile --device cuda --skip-libraries --fill process --rounds 4 --temperature 1

Where a constrained step's host time goes inside the pick (docs/benchmarks.md, structured outputs). The timers
cost the host about a microsecond a call and are on in every window."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from common import sampler as sm

_acc: dict[str, list[float]] = {}
_masked: list[bool | None] = [None]  # inside _PickGraphs.run: whether its pick is constrained


def _add(name: str, dt: float) -> None:
    v = _acc.setdefault(f"{'constrained' if _masked[0] else 'none'}: {name}", [0.0, 0.0])
    v[0] += dt
    v[1] += 1


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*a: Any, **kw: Any) -> Any:
        if _masked[0] is None:
            return fn(*a, **kw)
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            _add(name, time.perf_counter() - t)
    return run


def _install() -> None:
    real_run = sm._PickGraphs.run

    def run(self: Any, logits: torch.Tensor, spec: Any, constrained: Any = None) -> Any:
        _masked[0] = constrained is not None
        t = time.perf_counter()
        try:
            return real_run(self, logits, spec, constrained)
        finally:
            _add("the whole run", time.perf_counter() - t)
            _masked[0] = None

    parts: list[tuple[Any, str, Any]] = [
        (sm._PickGraphs, "run", run),
        (torch.cuda.CUDAGraph, "replay", _timed("CUDAGraph.replay", torch.cuda.CUDAGraph.replay)),
        (torch.Tensor, "clone", _timed("clone", torch.Tensor.clone)),
        *((cls, name, _timed(name, getattr(cls, name))) for cls, name in (
            (sm._PickGraphs, "_load"), (sm.Sampler, "_masks_read"), (sm.Sampler, "_device_masks"),
            (sm.PinnedUploads, "copy_into"))),
    ]
    for cls, name, fn in parts:
        setattr(cls, name, fn)

def main(argv: list[str]) -> int:
    from services.cli import main as cli

    _install()
    rc = cli(["bench", "structured", *argv])
    for k in sorted(_acc):
        total, n = _acc[k]
        print(f"pick part {k:40s} calls {n:6.0f}  mean µs {total / max(n, 1) * 1e6:8.1f}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
