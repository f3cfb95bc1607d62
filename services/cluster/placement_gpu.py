"""Which GPUs each model worker of ``tokenmill up --device cuda`` gets, decided before anything starts.

A worker owns its devices: the launcher starts it with ``CUDA_VISIBLE_DEVICES`` set to its own GPU, so inside it
runs on ``cuda:0``, and ``engine.gpu_memory_utilization`` is a fraction of that GPU. The plan, per pool
(``prefill.gpus`` / ``decode.gpus``, ``common/cluster_config.py``):

- unset: every worker gets GPUs of its own, prefill workers first, in the order the launcher sees them;
- a count N: the GPUs of each worker, as Helm's and Ray's ``gpus``; a worker runs on
  ``engine.tensor_parallel_size`` GPUs (1 unless ``--tp`` is set), so N is that;
- a device list: the pool's workers take these GPUs in order, ``engine.tensor_parallel_size`` at a time. A GPU
  named by more than one worker, in one list or in both, is shared on purpose: its workers split
  ``gpu_memory_utilization`` equally.

No prefill layout given (``prefill.count``, ``prefill.gpus``): the aggregated layout, no prefill worker (each
decode worker prefills its own requests). No decode count given: a decode worker on every GPU not taken by prefill.
So N GPUs run N aggregated replicas behind the router by default: on two H200s with the 8B model that layout served
as much goodput as one prefill + one decode GPU, or more, at every rate measured (docs/benchmarks.md, ``tokenmill
bench disagg``); 1P+1D is one flag away (``--prefills 1``) for loads where steady ITL matters more. Tensor-parallel
workers (``--tp N``, N > 1) always run the aggregated layout, a replica on every N GPUs: the KV transfer between the
pools does not carry a worker's shards, so a prefill layout asked for with them is refused. More workers than GPUs
of their own: an error that says how to share.
``plan_gpus`` is pure (the visible GPUs are an argument); ``visible_gpus`` asks torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from common.cluster_config import ClusterConfig, ConfigError, WorkerConfig, parse_gpus

WORKERS = ("prefill", "decode")


class GpuPlanError(ValueError):
    """The GPUs asked for cannot be given; the message names the setting, the numbers and what to change."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one model worker runs: ``devices`` are GPU ids as the launcher's own CUDA names them (what goes in
    the worker's ``CUDA_VISIBLE_DEVICES``; the worker sees them as ``cuda:0``, ``cuda:1``, …), and the fraction
    of them the worker may fill."""

    devices: tuple[str, ...]
    gpu_memory_utilization: float

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(self.devices)

    def describe(self) -> str:
        """``cuda:0 (GPU 1)``: the device inside the worker and the GPU it is on the machine."""
        return ", ".join(f"cuda:{i} (GPU {d})" for i, d in enumerate(self.devices))


@dataclass(frozen=True, slots=True)
class GpuPlan:
    """The cluster as it will run (pool counts settled by the plan) and each model worker's placement, by worker
    name (``prefill-0``, ``decode-1``); no placements on the CPU."""

    cluster: ClusterConfig
    placements: Mapping[str, Placement]


def split_utilization(utilization: float, share: float) -> float:
    """``utilization × share``, rounded down to 4 decimals so the shares of one GPU never add up to more."""
    return max(1e-4, math.floor(utilization * share * 10_000 + 1e-6) / 10_000)


def visible_ids(device_count: int, cuda_visible_devices: str | None) -> list[str]:
    """The GPUs this process's CUDA numbers 0..count-1, as ids for a child's ``CUDA_VISIBLE_DEVICES``: the
    entries of our own ``CUDA_VISIBLE_DEVICES`` when it is set (indices, UUIDs or MIG ids), else 0..count-1."""
    if cuda_visible_devices is None:
        return [str(i) for i in range(device_count)]
    return [d.strip() for d in cuda_visible_devices.split(",") if d.strip()][:device_count]


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs torch sees here (``torch.cuda.device_count()``; no CUDA context is made), as ``visible_ids``."""
    import torch

    env = os.environ if env is None else env
    return visible_ids(torch.cuda.device_count(), env.get("CUDA_VISIBLE_DEVICES"))


def plan_gpus(cluster: ClusterConfig, visible: Sequence[str], given: Collection[str] = ()) -> GpuPlan:
    """Place every prefill and decode worker on ``visible`` (ids as from ``visible_ids``). ``given``: the dotted
    config keys that were set (``load_cluster_config_given``); a layout not given is the plan's to choose.

    Raises GpuPlanError: gpus set without engine.device=cuda, no GPU visible, a device that does not exist,
    a count other than a worker's GPUs, more workers than GPUs of their own, a list that disagrees with the
    pool's count, a tensor-parallel size above the GPUs visible or with a prefill layout."""
    specs = {role: parse_gpus(_pool(cluster, role).gpus) for role in WORKERS}
    tp = cluster.engine.tensor_parallel_size
    if tp > 1:
        cluster = _aggregated(cluster, specs, given, tp)
    if cluster.engine.device != "cuda":
        for role, spec in specs.items():
            if spec is not None:
                raise GpuPlanError(f"{role}.gpus is set ({_pool(cluster, role).gpus}) but engine.device is "
                                   f"{cluster.engine.device}; add --device cuda")
        return GpuPlan(cluster, {})
    n = len(visible)
    if n == 0:
        raise GpuPlanError("--device cuda (engine.device=cuda), but torch sees no CUDA device on this machine")
    if tp > n:
        raise GpuPlanError(f"engine.tensor_parallel_size={tp}: a worker runs on {tp} GPUs, but {_seen(visible)}; "
                           f"lower --tp to at most {n}")
    counts = _counts(cluster, specs, given, tp)
    if specs["prefill"] is None and "prefill.count" not in given:
        counts["prefill"] = 0  # no prefill layout asked for: aggregated replicas (the measured default, see above)
    if "decode.count" not in given and not isinstance(specs["decode"], tuple):
        taken = len(set(specs["prefill"])) if isinstance(specs["prefill"], tuple) else counts["prefill"]
        counts["decode"] = max(1, (n - taken) // tp)  # a replica on every GPU (every tp GPUs) left

    named: set[int] = set()
    for role, spec in specs.items():
        if isinstance(spec, tuple):
            for i in spec:
                if i >= n:
                    raise GpuPlanError(f"{role}.gpus={_show(spec)}: GPU {i} does not exist; {_seen(visible)}")
            for k in range(0, len(spec), tp):
                if len(set(spec[k : k + tp])) < tp:
                    raise GpuPlanError(f"{role}.gpus={_show(spec)}: a tensor-parallel worker takes {tp} different "
                                       f"GPUs, got {_show(spec[k : k + tp])}")
            named.update(spec)
        elif isinstance(spec, int) and spec != tp:
            if tp == 1:
                raise GpuPlanError(f"{role}.gpus={spec}: a {role} worker runs on one GPU (gpus counts a worker's GPUs, "
                                   f"as in Helm and Ray); for more GPUs run more workers (--{role}s {spec}), name "
                                   f"devices (--{role}-gpus 0,1), or split the model over them (--tp {spec})")
            raise GpuPlanError(f"{role}.gpus={spec}: a {role} worker runs on engine.tensor_parallel_size={tp} GPUs; "
                               f"set {role}.gpus to {tp} or leave it out")
    own = {role: counts[role] for role in WORKERS if not isinstance(specs[role], tuple)}
    free = [i for i in range(n) if i not in named]
    if sum(own.values()) * tp > len(free):
        need = " + ".join(f"{c} {r}" for r, c in own.items() if c)
        each = "a GPU each" if tp == 1 else f"{tp} GPUs each (engine.tensor_parallel_size)"
        busy = f", {len(named)} of them named in a device list" if named else ""
        raise GpuPlanError(
            f"{need} workers need {each}, but {n} {'is' if n == 1 else 'are'} visible{busy}; run fewer workers "
            f"(--prefills, --decodes), or share a GPU on purpose with device lists "
            f"(e.g. --prefill-gpus cuda:0 --decode-gpus cuda:0)")

    gpus_of: dict[str, tuple[int, ...]] = {}
    for role in WORKERS:
        spec = specs[role]
        for k in range(counts[role]):
            if isinstance(spec, tuple):
                gpus_of[f"{role}-{k}"] = spec[k * tp : (k + 1) * tp]
            else:
                gpus_of[f"{role}-{k}"], free = tuple(free[:tp]), free[tp:]
    sharing = Counter(i for gpus in gpus_of.values() for i in gpus)
    u = cluster.engine.gpu_memory_utilization
    placements = {name: Placement(tuple(visible[i] for i in gpus),
                                  split_utilization(u, 1 / max(sharing[i] for i in gpus)))
                  for name, gpus in gpus_of.items()}
    try:
        planned = dataclasses.replace(cluster, prefill=dataclasses.replace(cluster.prefill, count=counts["prefill"]),
                                      decode=dataclasses.replace(cluster.decode, count=counts["decode"]))
    except ConfigError as e:
        raise GpuPlanError(str(e)) from e
    return GpuPlan(planned, placements)


def _aggregated(cluster: ClusterConfig, specs: dict[str, int | tuple[int, ...] | None], given: Collection[str],
                tp: int) -> ClusterConfig:
    """Tensor-parallel workers: no prefill pool (the KV transfer between the pools moves rank 0's shard alone)."""
    if specs["prefill"] is not None or ("prefill.count" in given and cluster.prefill.count > 0):
        what = (f"prefill.gpus={cluster.prefill.gpus}" if specs["prefill"] is not None
                else f"prefill.count={cluster.prefill.count}")
        raise GpuPlanError(f"{what} with engine.tensor_parallel_size={tp}: the KV transfer between the prefill and "
                           f"decode pools does not carry a tensor-parallel worker's shards; run the aggregated "
                           f"layout (no --prefills)")
    return dataclasses.replace(cluster, prefill=dataclasses.replace(cluster.prefill, count=0))


def _counts(cluster: ClusterConfig, specs: dict[str, int | tuple[int, ...] | None],
            given: Collection[str], tp: int) -> dict[str, int]:
    counts = {}
    for role, spec in specs.items():
        count = _pool(cluster, role).count
        if isinstance(spec, tuple):
            if len(spec) % tp:
                raise GpuPlanError(f"{role}.gpus={_show(spec)} is {len(spec)} GPUs, not a multiple of "
                                   f"engine.tensor_parallel_size={tp} (each worker takes {tp} of them in order)")
            if f"{role}.count" in given and count != len(spec) // tp:
                raise GpuPlanError(f"{role}.gpus={_show(spec)} is {len(spec)} GPUs (the workers take them in order"
                                   f"{'' if tp == 1 else f', {tp} each'}) but {role}.count is {count}; give as "
                                   f"many, or leave the count out")
            count = len(spec) // tp
        counts[role] = count
    return counts


def _pool(cluster: ClusterConfig, role: str) -> WorkerConfig:
    return cluster.prefill if role == "prefill" else cluster.decode


def _show(spec: int | tuple[int, ...]) -> str:
    return str(spec) if isinstance(spec, int) else ",".join(map(str, spec))


def _seen(visible: Sequence[str]) -> str:
    n = len(visible)
    ids = ", ".join(f"cuda:{i}" + (f"=GPU {d}" if d != str(i) else "") for i, d in enumerate(visible))
    return f"{n} GPU{'s are' if n != 1 else ' is'} visible ({ids})"
