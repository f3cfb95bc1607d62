"""A GPU per worker: the launcher's plan (services/cluster/placement_gpu.py), the CUDA dtype default, the KV budget of
a worker's own share, and the real launcher giving its children their GPUs (read from /proc, on a CPU machine)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from common.cluster_config import ConfigError, load_cluster_config, load_cluster_config_given
from services.cluster.launcher import Launcher, child_specs, read_state
from services.cluster.placement_gpu import GpuPlanError, Placement, plan_gpus, split_utilization, visible_ids
from tests.services.harness import free_base_port

ENV = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")} | {"OMP_NUM_THREADS": "1"}


def plan(visible: list[str], **overrides: object):
    cluster, given = load_cluster_config_given(overrides={"engine.device": "cuda", **overrides}, env={})
    return plan_gpus(cluster, visible, given)


def layout(p) -> dict[str, tuple[tuple[str, ...], float]]:
    return {name: (pl.devices, pl.gpu_memory_utilization) for name, pl in p.placements.items()}


# -- the plan -------------------------------------------------------------------------------------------------
def test_by_default_every_gpu_runs_an_aggregated_replica_and_a_prefill_layout_gets_its_own():
    p = plan(["0"])
    assert (p.cluster.prefill.count, p.cluster.decode.count) == (0, 1)
    assert layout(p) == {"decode-0": (("0",), 0.9)}
    p = plan(["0", "1", "2"])
    assert (p.cluster.prefill.count, p.cluster.decode.count) == (0, 3)
    assert layout(p) == {"decode-0": (("0",), 0.9), "decode-1": (("1",), 0.9), "decode-2": (("2",), 0.9)}
    p = plan(["0", "1", "2"], **{"prefill.count": 1})  # 1P + a decode worker on each GPU left
    assert (p.cluster.prefill.count, p.cluster.decode.count) == (1, 2)
    assert layout(p) == {"prefill-0": (("0",), 0.9), "decode-0": (("1",), 0.9), "decode-1": (("2",), 0.9)}
    # the launcher's own CUDA_VISIBLE_DEVICES: its cuda:0 and cuda:1 are GPUs 3 and 5 of the machine
    p = plan(["3", "5"], **{"prefill.count": 1, "decode.count": 1})
    assert layout(p) == {"prefill-0": (("3",), 0.9), "decode-0": (("5",), 0.9)}
    assert p.placements["decode-0"].describe() == "cuda:0 (GPU 5)"


def test_a_count_is_the_gpus_of_each_worker_as_in_helm_and_ray():
    p = plan(["0", "1", "2", "3"], **{"decode.gpus": "1", "decode.count": 3, "prefill.count": 1})
    assert (p.cluster.prefill.count, p.cluster.decode.count) == (1, 3)
    assert layout(p) == {"prefill-0": (("0",), 0.9), "decode-0": (("1",), 0.9), "decode-1": (("2",), 0.9),
                         "decode-2": (("3",), 0.9)}


def test_device_lists_share_on_purpose_and_split_the_utilization():
    p = plan(["0"], **{"prefill.gpus": "cuda:0", "decode.gpus": "cuda:0"})
    assert (p.cluster.prefill.count, p.cluster.decode.count) == (1, 1)  # a prefill layout given: kept on one GPU
    assert layout(p) == {"prefill-0": (("0",), 0.45), "decode-0": (("0",), 0.45)}
    p = plan(["0"], **{"decode.gpus": "0,0"})
    assert (p.cluster.prefill.count, p.cluster.decode.count) == (0, 2)
    assert layout(p) == {"decode-0": (("0",), 0.45), "decode-1": (("0",), 0.45)}
    p = plan(["0", "1"], **{"prefill.gpus": "1,", "decode.gpus": "0,0,1", "engine.gpu_memory_utilization": 0.8})
    assert layout(p) == {"prefill-0": (("1",), 0.4), "decode-0": (("0",), 0.4), "decode-1": (("0",), 0.4),
                         "decode-2": (("1",), 0.4)}
    # a list and an automatic pool: the automatic one takes a GPU no list names
    p = plan(["0", "1", "2"], **{"decode.gpus": "[0, 0]", "prefill.count": 1})
    assert layout(p) == {"prefill-0": (("1",), 0.9), "decode-0": (("0",), 0.45), "decode-1": (("0",), 0.45)}
    assert split_utilization(0.9, 1 / 3) == 0.3 and split_utilization(0.9, 1 / 7) * 7 <= 0.9


@pytest.mark.parametrize(
    ("visible", "overrides", "message"),
    [
        ([], {}, "--device cuda (engine.device=cuda), but torch sees no CUDA device on this machine"),
        (["0"], {"prefill.count": 1}, "1 prefill + 1 decode workers need a GPU each, but 1 is visible; run fewer "
                                      "workers (--prefills, --decodes), or share a GPU on purpose"),
        (["0", "1"], {"prefill.count": 1, "decode.count": 2}, "1 prefill + 2 decode workers need a GPU each, but 2 "
                                                              "are visible"),
        (["0", "1"], {"decode.gpus": "3"}, "decode.gpus=3: a decode worker runs on one GPU (gpus counts a worker's "
                                           "GPUs, as in Helm and Ray); for more GPUs run more workers (--decodes 3)"),
        (["4", "6"], {"decode.gpus": "0,2"}, "decode.gpus=0,2: GPU 2 does not exist; 2 GPUs are visible "
                                            "(cuda:0=GPU 4, cuda:1=GPU 6)"),
        (["0", "1"], {"decode.gpus": "0,1", "decode.count": 3}, "decode.gpus=0,1 is 2 GPUs (the workers take them "
                                                                "in order) but decode.count is 3"),
        (["0", "1"], {"prefill.gpus": "1,", "decode.count": 2}, "2 decode workers need a GPU each, but 2 are "
                                                                "visible, 1 of them named in a device list"),
        (["0"], {"engine.device": "cpu", "decode.gpus": "1"}, "decode.gpus is set (1) but engine.device is cpu; "
                                                              "add --device cuda"),
    ],
)
def test_what_cannot_be_placed_is_refused_with_the_numbers(visible, overrides, message):
    with pytest.raises(GpuPlanError) as e:
        plan(visible, **overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["two", "0", "-1", "1,,2", "cuda:x", "0.5"])
def test_a_gpus_value_that_does_not_parse_names_the_forms(text):
    with pytest.raises(ConfigError, match=r"decode: gpus .* (is not a GPU count \(2\) or a device list|a count must)"):
        load_cluster_config(overrides={"decode.gpus": text}, env={})


def test_visible_ids_honour_the_launchers_own_cuda_visible_devices():
    assert visible_ids(2, None) == ["0", "1"]
    assert visible_ids(2, "3, 5") == ["3", "5"]
    assert visible_ids(1, "GPU-aa,GPU-bb") == ["GPU-aa"]  # torch stops where CUDA does
    assert visible_ids(0, "") == []


def test_on_the_cpu_nothing_is_placed():
    cluster, given = load_cluster_config_given(env={})
    p = plan_gpus(cluster, [], given)
    assert p.cluster == cluster and not p.placements
    assert {s.svc.name: s.devices for s in child_specs(cluster, Path("c.yaml"))} == {
        "router-0": "", "tokenizer-0": "", "tokenizer-1": "", "prefill-0": "cpu", "decode-0": "cpu",
        "gateway-0": ""}


# -- dtype -----------------------------------------------------------------------------------------------------
def test_bfloat16_is_the_default_on_cuda_unless_a_dtype_is_given(tmp_path):
    assert load_cluster_config(env={}).engine.dtype == "float32"
    assert load_cluster_config(overrides={"engine.device": "cuda"}, env={}).engine.dtype == "bfloat16"
    assert load_cluster_config(env={"TOKENMILL_ENGINE__DEVICE": "cuda"}).engine.dtype == "bfloat16"
    assert load_cluster_config(overrides={"engine.device": "cuda", "engine.dtype": "float32"},
                               env={}).engine.dtype == "float32"
    assert load_cluster_config(overrides={"engine.device": "cuda"},
                               env={"TOKENMILL_ENGINE__DTYPE": "float16"}).engine.dtype == "float16"
    f = tmp_path / "c.yaml"
    f.write_text("engine:\n  device: cuda\n  dtype: float32\n")
    assert load_cluster_config(f, env={}).engine.dtype == "float32"
    f.write_text("engine:\n  device: cuda\n")
    cluster, given = load_cluster_config_given(f, env={})
    assert cluster.engine.dtype == "bfloat16" and given == {"engine.device"}


# -- the KV budget of a worker's own share ---------------------------------------------------------------------
def test_a_worker_budgets_its_own_share_not_what_others_use():
    from common.model_runner import kv_cache_budget

    gib = 2**30
    # 80 GiB card shared on purpose at 0.45: the other worker already holds 36 GiB; it does not shrink this share
    assert kv_cache_budget(80 * gib, 43 * gib, 0.45, 16 * gib, 2 * gib) == int(80 * gib * 0.45) - 18 * gib
    assert kv_cache_budget(80 * gib, 79 * gib, 0.9, 16 * gib, 2 * gib) == int(80 * gib * 0.9) - 18 * gib
    with pytest.raises(RuntimeError, match=r"no memory left for the KV cache: this worker's share of the GPU "
                                           r"\(0.2 × 80.0 GiB = 16.00 GiB\) holds only its weights \(16.00 GiB\)"):
        kv_cache_budget(80 * gib, 60 * gib, 0.2, 16 * gib, 2 * gib)
    with pytest.raises(RuntimeError, match=r"the GPU has 10.00 GiB free, but this worker's share needs 20.00 GiB "
                                           r"of it \(a 18.00 GiB KV cache \+ a 2.00 GiB activation peak"):
        kv_cache_budget(80 * gib, 10 * gib, 0.45, 16 * gib, 2 * gib)


# -- the launcher ----------------------------------------------------------------------------------------------
def test_child_commands_carry_their_gpu_and_share(tmp_path):
    p = plan(["3", "5"], **{"prefill.gpus": "cuda:1", "decode.gpus": "0,1", "tokenizer.count": 1})
    specs = {s.svc.name: s for s in child_specs(p.cluster, tmp_path / "c.yaml", p.placements)}
    assert specs["prefill-0"].env == {"CUDA_VISIBLE_DEVICES": "5"}
    assert specs["prefill-0"].argv[-2:] == ("--set", "engine.gpu_memory_utilization=0.45")
    assert specs["decode-0"].env == {"CUDA_VISIBLE_DEVICES": "3"} and specs["decode-0"].devices == "cuda:0 (GPU 3)"
    assert specs["decode-0"].argv[-1] == "engine.gpu_memory_utilization=0.9"
    for name in ("router-0", "tokenizer-0", "gateway-0"):  # no GPU for the services that run no model
        assert specs[name].env == {"CUDA_VISIBLE_DEVICES": ""} and "--set" not in specs[name].argv
    out = io.StringIO()
    assert Launcher(p.cluster, tmp_path / "state.json", out, p.placements).dry_run() == 0
    lines = out.getvalue().splitlines()
    assert "cuda bfloat16" in lines[0] and "nothing started" in lines[0]
    [line] = [x for x in lines if x.startswith("decode-1")]
    assert "cuda:0 (GPU 5)" in line and "CUDA_VISIBLE_DEVICES=5 " in line
    assert line.endswith(f"serve decode --config {tmp_path}/logs/cluster.yaml --index 1 "
                         f"--set engine.gpu_memory_utilization=0.45")
    assert not (tmp_path / "logs").exists()


def tokenmill(capsys, *args: str) -> tuple[int, str, str]:
    from services.cluster.__main__ import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_up_flags_plan_and_bad_input_is_one_line_exit_2_and_nothing_started(capsys, monkeypatch, tmp_path):
    from services.cluster import placement_gpu

    monkeypatch.setattr(placement_gpu, "visible_gpus", lambda env=None: ["0", "1"])
    state = str(tmp_path / "state" / "cluster.json")
    code, out, err = tokenmill(capsys, "up", "--device", "cuda", "--prefill-gpus", "cuda:1", "--decode-gpus", "1,1",
                               "--tokenizer", "smollm2", "--dry-run", "--state-file", state)
    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "CUDA_VISIBLE_DEVICES=1" in rows["prefill-0"] and "gpu_memory_utilization=0.3" in rows["decode-1"]
    for args, message in [
        (["--decode-gpus", "0,2"], "decode.gpus=0,2: GPU 2 does not exist; 2 GPUs are visible"),
        (["--decode-gpus", "4"], "decode.gpus=4: a decode worker runs on one GPU"),
        (["--prefills", "1", "--decodes", "2"], "1 prefill + 2 decode workers need a GPU each, but 2 are visible"),
        (["--prefill-gpus", "one"], "prefill: gpus 'one' is not a GPU count (2) or a device list"),
    ]:
        code, out, err = tokenmill(capsys, "up", "--device", "cuda", "--state-file", state, *args)
        assert code == 2 and err == f"tokenmill up: {err.split(': ', 1)[1]}" and message in err, err
        assert err.count("\n") == 1 and not out
    monkeypatch.setattr(placement_gpu, "visible_gpus", lambda env=None: [])
    code, _, err = tokenmill(capsys, "up", "--device", "cuda", "--state-file", state)
    assert code == 2 and err == "tokenmill up: --device cuda (engine.device=cuda), but torch sees no CUDA device on " \
                                "this machine\n"
    assert not (tmp_path / "state").exists()  # nothing was started


def test_status_shows_each_processs_devices(capsys, tmp_path):
    state = tmp_path / "cluster.json"
    procs = [{"role": "decode", "index": 0, "name": "decode-0", "pid": os.getpid(), "address": "127.0.0.1:1",
              "grpc_port": 1, "metrics_port": 2, "log": "x", "devices": "cuda:0 (GPU 1)",
              "gpu_memory_utilization": 0.45},
             {"role": "router", "index": 0, "name": "router-0", "pid": os.getpid(), "address": "127.0.0.1:1",
              "grpc_port": 1, "metrics_port": 3, "log": "x", "devices": "", "gpu_memory_utilization": None}]
    state.write_text(json.dumps({"launcher_pid": os.getpid(), "ready": True, "model": "m", "processes": procs}))
    _, out, _ = tokenmill(capsys, "status", "--state-file", str(state))
    [head, dec, router] = out.splitlines()[1:]
    assert "devices" in head and "cuda:0 (GPU 1)" in dec and " - " in router
    _, out, _ = tokenmill(capsys, "status", "--json", "--state-file", str(state))
    assert json.loads(out)["processes"][0]["devices"] == "cuda:0 (GPU 1)"


LAUNCH = """
import sys
from pathlib import Path
from common.cluster_config import load_cluster_config_given
from services.cluster.launcher import Launcher
from services.cluster.placement_gpu import plan_gpus

cluster, given = load_cluster_config_given(overrides={
    "engine.device": "cuda", "base_port": int(sys.argv[2]), "grace_s": 1, "tokenizer.count": 0, "gateway.count": 0,
    "prefill.gpus": "cuda:1", "decode.gpus": "0,1"}, env={})
plan = plan_gpus(cluster, ["3", "5"], given)  # as if this machine's GPUs 3 and 5 were visible
sys.exit(Launcher(plan.cluster, Path(sys.argv[1]), placements=plan.placements).run())
"""


def _proc_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads the children's environment from /proc")
def test_the_launcher_starts_each_worker_on_its_own_gpu_with_its_share(tmp_path):
    """The real launcher with an injected GPU list: read each child's environment and command line before the
    workers fail to find CUDA on this machine (they take seconds to import torch)."""
    state = tmp_path / "state" / "cluster.json"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(state), str(free_base_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    seen: dict[str, tuple[dict[str, str], list[str]]] = {}
    try:
        deadline = time.monotonic() + 60
        while not (st := read_state(state)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no state file in 60 s"
            time.sleep(0.02)
        for p in st["processes"]:
            # a child read between its fork and its exec still has the launcher's environment and command line:
            # wait for the exec (every child's environment names CUDA_VISIBLE_DEVICES, the router's empty)
            until = time.monotonic() + 10
            while "CUDA_VISIBLE_DEVICES" not in (env := _proc_env(p["pid"])) and time.monotonic() < until:
                time.sleep(0.01)
            cmdline = Path(f"/proc/{p['pid']}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")
            seen[p["name"]] = (env, cmdline)
        records = {p["name"]: p for p in st["processes"]}
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert sorted(seen) == ["decode-0", "decode-1", "prefill-0", "router-0"]
    expect = {"prefill-0": ("5", "0.45"), "decode-0": ("3", "0.9"), "decode-1": ("5", "0.45")}
    for name, (gpu, share) in expect.items():
        env, cmdline = seen[name]
        assert env["CUDA_VISIBLE_DEVICES"] == gpu, name
        assert cmdline[-2:] == ["--set", f"engine.gpu_memory_utilization={share}"], cmdline
        assert records[name]["devices"] == f"cuda:0 (GPU {gpu})" and records[name]["gpu_memory_utilization"] == float(share)
    assert seen["router-0"][0]["CUDA_VISIBLE_DEVICES"] == ""
    written = yaml.safe_load((state.parent / "logs" / "cluster.yaml").read_text())
    assert written["engine"]["device"] == "cuda" and written["engine"]["dtype"] == "bfloat16"
    assert written["prefill"]["count"] == 1 and written["decode"]["count"] == 2
    # no CUDA here: a worker fails, is named, and the launcher stops the rest
    assert proc.returncode == 1 and "exited with code" in err, err
    assert not state.exists()


def test_ray_workers_on_a_fraction_of_a_gpu_budget_that_fraction():
    from services.cluster.ray_pools import member_configs

    cluster = load_cluster_config(overrides={"engine.device": "cuda", "prefill.count": 1, "tokenizer.count": 0},
                                  env={})
    members = [("router", 0, "10.0.0.1"), ("prefill", 0, "10.0.0.2"), ("decode", 0, "10.0.0.2")]
    configs = member_configs(cluster, members, "0.0.0.0", gpus={"prefill": 0.5, "decode": 1.0})
    engine = {role: yaml.safe_load(configs[(role, 0)][0])["engine"] for role in ("router", "prefill", "decode")}
    assert engine["prefill"]["gpu_memory_utilization"] == 0.45
    assert engine["decode"]["gpu_memory_utilization"] == 0.9 and engine["router"]["gpu_memory_utilization"] == 0.9
    assert engine["decode"]["dtype"] == "bfloat16"


def test_a_placement_names_the_device_inside_and_on_the_machine():
    assert Placement(("2", "3"), 0.9).describe() == "cuda:0 (GPU 2), cuda:1 (GPU 3)"
    assert Placement(("2", "3"), 0.9).cuda_visible_devices == "2,3"


# -- tensor parallelism: a worker on tensor_parallel_size GPUs ---------------------------------------------------
def test_a_tensor_parallel_worker_gets_tp_gpus_and_the_layout_is_aggregated():
    tp2 = {"engine.tensor_parallel_size": 2}
    p = plan(["0", "1", "2", "3"], **tp2)
    assert (p.cluster.prefill.count, p.cluster.decode.count) == (0, 2)
    assert layout(p) == {"decode-0": (("0", "1"), 0.9), "decode-1": (("2", "3"), 0.9)}
    assert layout(plan(["0", "1", "2", "3"], **tp2, **{"decode.gpus": "2"})) == layout(p)  # a count of tp GPUs
    assert layout(plan(["0", "1", "2", "3"], **tp2, **{"decode.count": 1})) == {"decode-0": (("0", "1"), 0.9)}
    assert layout(plan(["0", "1", "2"], **tp2)) == {"decode-0": (("0", "1"), 0.9)}  # a replica on every 2 GPUs
    # a device list: tp GPUs a worker, in order; a GPU of two workers is shared and splits the utilization
    p = plan(["0", "1", "2", "3"], **tp2, **{"decode.gpus": "3,2,0,1"})
    assert layout(p) == {"decode-0": (("3", "2"), 0.9), "decode-1": (("0", "1"), 0.9)}
    p = plan(["0", "1", "2"], **tp2, **{"decode.gpus": "0,1,1,2"})
    assert layout(p) == {"decode-0": (("0", "1"), 0.45), "decode-1": (("1", "2"), 0.45)}
    # the launcher's own CUDA_VISIBLE_DEVICES: the worker's cuda:0 and cuda:1 (its ranks) are GPUs 3 and 5
    p = plan(["3", "5"], **tp2)
    assert p.placements["decode-0"].cuda_visible_devices == "3,5"
    assert p.placements["decode-0"].describe() == "cuda:0 (GPU 3), cuda:1 (GPU 5)"
    # on the CPU: no placements, and no prefill pool either
    cluster, given = load_cluster_config_given(overrides=tp2, env={})
    p = plan_gpus(cluster, [], given)
    assert not p.placements and (p.cluster.prefill.count, p.cluster.engine.tensor_parallel_size) == (0, 2)


@pytest.mark.parametrize(
    ("visible", "overrides", "message"),
    [
        (["0"], {}, "engine.tensor_parallel_size=2: a worker runs on 2 GPUs, but 1 GPU is visible (cuda:0); "
                    "lower --tp to at most 1"),
        (["0", "1"], {"decode.gpus": "1"}, "decode.gpus=1: a decode worker runs on engine.tensor_parallel_size=2 "
                                           "GPUs; set decode.gpus to 2 or leave it out"),
        (["0", "1", "2"], {"decode.gpus": "0,1,2"}, "decode.gpus=0,1,2 is 3 GPUs, not a multiple of "
                                                    "engine.tensor_parallel_size=2"),
        (["0", "1"], {"decode.gpus": "0,0"}, "decode.gpus=0,0: a tensor-parallel worker takes 2 different GPUs, "
                                             "got 0,0"),
        (["0", "1", "2", "3"], {"decode.gpus": "0,1", "decode.count": 2}, "decode.gpus=0,1 is 2 GPUs (the workers "
                                                                          "take them in order, 2 each) but "
                                                                          "decode.count is 2"),
        (["0", "1", "2"], {"decode.count": 2}, "2 decode workers need 2 GPUs each (engine.tensor_parallel_size), "
                                               "but 3 are visible"),
        (["0", "1", "2", "3"], {"prefill.count": 1}, "prefill.count=1 with engine.tensor_parallel_size=2: the KV "
                                                     "transfer between the prefill and decode pools does not carry "
                                                     "a tensor-parallel worker's shards"),
        (["0", "1", "2", "3"], {"prefill.gpus": "0,1"}, "prefill.gpus=0,1 with engine.tensor_parallel_size=2"),
    ],
)
def test_a_tensor_parallel_size_that_cannot_be_placed_is_refused_in_one_line(visible, overrides, message):
    with pytest.raises(GpuPlanError) as e:
        plan(visible, **{"engine.tensor_parallel_size": 2, **overrides})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_up_tp_flag_gives_each_worker_its_gpus_and_refuses_what_does_not_fit(capsys, monkeypatch, tmp_path):
    from services.cluster import placement_gpu

    monkeypatch.setattr(placement_gpu, "visible_gpus", lambda env=None: ["0", "1"])
    state = str(tmp_path / "state" / "cluster.json")
    code, out, err = tokenmill(capsys, "up", "--device", "cuda", "--tp", "2", "--dry-run", "--state-file", state)
    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "prefill-0" not in rows and "CUDA_VISIBLE_DEVICES=0,1 " in rows["decode-0"]
    assert "cuda:0 (GPU 0), cuda:1 (GPU 1)" in rows["decode-0"]
    for args, message in [
        (["--tp", "3"], "engine.tensor_parallel_size=3: a worker runs on 3 GPUs, but 2 GPUs are visible"),
        (["--tp", "2", "--prefills", "1"], "prefill.count=1 with engine.tensor_parallel_size=2"),
        (["--tp", "0"], "engine: tensor_parallel_size must be >= 1, got 0"),
    ]:
        code, out, err = tokenmill(capsys, "up", "--device", "cuda", "--state-file", state, *args)
        assert code == 2 and message in err and err.count("\n") == 1 and not out, err
    assert not (tmp_path / "state").exists()
    cluster, _ = load_cluster_config_given(overrides={"engine.tensor_parallel_size": "2"}, env={})
    assert cluster.engine.tensor_parallel_size == 2  # --tp on serve sets the same key (services/cluster/cli.py)
