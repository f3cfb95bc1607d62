"""The dtype and layout ``tokenmill up`` and ``generate`` take from the machine when nothing asks for them
(common/machine.py), the one line that says so, and flags that override them."""

from __future__ import annotations

import pytest

from common import machine
from common.cluster_config import load_cluster_config_given
from common.machine import CpuDefaults, cpu_defaults, cpu_flags
from services.cluster import cli as cluster_cli
from tests.services.test_cluster import tokenmill


@pytest.mark.parametrize(("flags", "cores", "dtype", "aggregated", "budget", "why"), [
    ({"avx512f", "avx512_bf16", "amx_bf16"}, 2, "bfloat16", True, 512, ("AMX BF16", "2 cores, too few")),
    ({"avx512f", "avx512_bf16"}, 16, "bfloat16", False, 2048, ("AVX512-BF16", "16 cores")),
    ({"avx2"}, 1, "float32", True, 512, ("no bf16 arithmetic", "1 core, too few")),
    ({"avx2"}, 4, "float32", True, 1024, ("no bf16 arithmetic", "4 cores, too few")),
    ({"avx2"}, machine.MIN_CORES_FOR_POOLS, "float32", False, 2048,
     ("no bf16", f"{machine.MIN_CORES_FOR_POOLS} cores")),
])
def test_cpu_defaults_follow_bf16_arithmetic_and_cores(flags, cores, dtype, aggregated, budget, why):
    """The dtype from the CPU's arithmetic; the layout and a step's token budget (256 a core, from 512 to the
    engine's 2,048) from its cores."""
    d = cpu_defaults(frozenset(flags), cores)
    assert (d.dtype, d.aggregated, d.max_num_batched_tokens) == (dtype, aggregated, budget)
    assert why[0] in d.why_dtype and why[1] in d.why_layout


def test_cpu_flags_read_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512_bf16 amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx512_bf16", "amx_tile"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def _given(**overrides):
    return load_cluster_config_given(overrides=overrides, env={})


TWO_CORES = CpuDefaults("bfloat16", True, 512, "the CPU has AMX BF16", "2 cores, too few for separate pools",
                        "256 per core")
OVERRIDE = "--dtype, --prefills N and --set engine.max_num_batched_tokens=N override"


def test_up_takes_what_nothing_asked_for_and_keeps_what_was(monkeypatch):
    monkeypatch.setattr(cluster_cli, "cpu_defaults", lambda: TWO_CORES)
    c, why = cluster_cli.machine_defaults(*_given())
    assert (c.engine.dtype, c.prefill.count, c.decode.count, c.engine.max_num_batched_tokens) == ("bfloat16", 0, 1,
                                                                                                   512)
    assert why == ["bfloat16: the CPU has AMX BF16", "aggregated: 2 cores, too few for separate pools",
                   "512 tokens a step: 256 per core", OVERRIDE]
    c, why = cluster_cli.machine_defaults(*_given(**{"engine.dtype": "float32", "prefill.count": 1,
                                                     "engine.max_num_batched_tokens": 4096}))
    assert (c.engine.dtype, c.prefill.count, c.engine.max_num_batched_tokens) == ("float32", 1, 4096) and why == []
    c, why = cluster_cli.machine_defaults(*_given(**{"engine.device": "cuda"}))
    assert c.engine.dtype == "bfloat16"  # the config's own CUDA default; the GPU layout is placement_gpu's
    assert why[:2] == ["bfloat16 on cuda", "aggregated replicas: the most goodput measured on two GPUs"]


def test_a_cuda_step_budget_follows_the_model_per_gpu():
    """2,048 tokens a step up to ~8B parameters a GPU; a 70B on 2 GPUs gets 512, on 4 GPUs 1,024; an asked-for
    budget stays."""
    assert [machine.gpu_step_budget(p, g, 2048) for p, g in ((135e6, 1), (8e9, 1), (70.6e9, 2), (70.6e9, 4),
                                                             (70.6e9, 8), (400e9, 1))] == [2048, 2048, 512, 1024,
                                                                                           2048, 256]
    c, why = cluster_cli.machine_defaults(*_given(**{"engine.device": "cuda", "model": "dummy:llama-3.1-70b",
                                                     "engine.tensor_parallel_size": 2}))
    assert c.engine.max_num_batched_tokens == 512 and "512 tokens a step: 70.6B parameters on 2 GPUs" in why
    c, why = cluster_cli.machine_defaults(*_given(**{"engine.device": "cuda", "model": "dummy:llama-3.1-8b"}))
    assert c.engine.max_num_batched_tokens == 2048 and not any("tokens a step" in w for w in why)
    c, why = cluster_cli.machine_defaults(*_given(**{"engine.device": "cuda", "model": "dummy:llama-3.1-70b",
                                                     "engine.tensor_parallel_size": 2,
                                                     "engine.max_num_batched_tokens": 4096}))
    assert c.engine.max_num_batched_tokens == 4096 and not any("tokens a step" in w for w in why)


def test_up_prints_the_choice_in_one_line_and_flags_override(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cluster_cli, "cpu_defaults", lambda: TWO_CORES)
    state = str(tmp_path / "state.json")
    code, out, err = tokenmill(capsys, "up", "--dry-run", "--state-file", state)
    assert code == 0, err
    first = out.splitlines()[0]
    assert first == ("tokenmill up: 1 aggregated decode worker, bfloat16 on cpu (bfloat16: the CPU has AMX BF16; "
                     f"aggregated: 2 cores, too few for separate pools; 512 tokens a step: 256 per core; {OVERRIDE})")
    assert "prefill-0" not in out and "decode-0" in out
    code, out, err = tokenmill(capsys, "up", "--dry-run", "--state-file", state, "--dtype", "float32",
                               "--prefills", "1", "--set", "engine.max_num_batched_tokens=2048")
    assert code == 0, err
    assert not out.startswith("tokenmill up:") and "prefill-0" in out and "float32" in out.splitlines()[0]


def test_generate_takes_the_machines_dtype(monkeypatch):
    import argparse

    from common.cli_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    monkeypatch.setattr(machine, "cpu_defaults", lambda: CpuDefaults("bfloat16", True, 512, "", "", ""))
    assert engine_config_from_args(p.parse_args([])).dtype == "bfloat16"
    assert engine_config_from_args(p.parse_args(["--dtype", "float32"])).dtype == "float32"
    monkeypatch.setattr(machine, "cpu_defaults", lambda: CpuDefaults("float32", True, 512, "", "", ""))
    assert engine_config_from_args(p.parse_args([])).dtype == "float32"
    assert engine_config_from_args(p.parse_args(["--device", "cuda"])).dtype == "bfloat16"
