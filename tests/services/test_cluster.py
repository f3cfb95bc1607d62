"""The cluster config (file → env → flags) and the launcher: ``tokenmill up`` / ``status`` as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.cluster_config import ConfigError, load_cluster_config, parse_set_option, with_backend_env
from common.rpc import health_status
from services.cli import build_parser
from services.cluster.launcher import read_state
from tests.services.harness import HOST, free_base_port

ENV = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")} | {"OMP_NUM_THREADS": "1"}


def test_defaults_follow_the_design():
    c = load_cluster_config(env={})
    assert (c.host, c.gateway.port, c.gateway.http_port) == ("127.0.0.1", 50051, 8000)
    assert [c.pool(r).count for r in ("gateway", "router", "tokenizer", "prefill", "decode")] == [1, 1, 2, 1, 1]
    assert c.addresses("tokenizer") == ["127.0.0.1:20100", "127.0.0.1:20101"]
    svc = c.service("decode", 0)
    assert (svc.name, svc.address, svc.metrics_port) == ("decode-0", "127.0.0.1:20300", 21300)
    assert c.service("gateway").metrics_port == 21400
    assert all(p < 32768 for r in ("router", "tokenizer", "prefill", "decode") for p in c.ports(r))


def test_file_then_env_then_flags(tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_text("base_port: 21000\ntokenizer:\n  count: 3\n  batch_wait_ms: 4\nrouter:\n  prefill_weight: 2\n"
                 "engine:\n  max_num_seqs: 8\n  kv_cache_memory: 256MiB\n")
    c = load_cluster_config(f, env={})
    assert (c.base_port, c.tokenizer.count, c.tokenizer.batch_wait_ms, c.router.prefill_weight) == (21000, 3, 4.0, 2.0)
    assert c.engine.max_num_seqs == 8 and c.engine.kv_cache_memory == 256 << 20
    env = {"TOKENMILL_TOKENIZER__COUNT": "4", "TOKENMILL_BASE_PORT": "22000", "TOKENMILL_UNRELATED": "x"}
    c = load_cluster_config(f, env=env)
    assert (c.tokenizer.count, c.base_port, c.tokenizer.batch_wait_ms) == (4, 22000, 4.0)
    c = load_cluster_config(f, overrides={"tokenizer.count": 5, "base_port": None, **parse_set_option(
        ["decode.count=0", "engine.enable_prefix_caching=false"])}, env=env)
    assert (c.tokenizer.count, c.base_port, c.decode.count, c.engine.enable_prefix_caching) == (5, 22000, 0, False)


def test_backend_keys_from_env_short_names_and_flags():
    from common.config import EngineConfig

    c = load_cluster_config(env={})
    assert (c.engine.cpu_kernels, c.engine.cuda_fast_path, c.engine.cuda_graphs) == (None, True, True)
    c = load_cluster_config(env={"TOKENMILL_ENGINE__CPU_KERNELS": "0", "TOKENMILL_CUDA_GRAPHS": "off"})
    assert (c.engine.cpu_kernels, c.engine.cuda_fast_path, c.engine.cuda_graphs) == (False, True, False)
    # the short name gives way to the engine key, and a flag to neither
    env = {"TOKENMILL_CPU_KERNELS": "0", "TOKENMILL_ENGINE__CPU_KERNELS": "1", "TOKENMILL_CUDA_FAST": "0"}
    c = load_cluster_config(overrides=parse_set_option(["engine.cuda_fast_path=true"]), env=env)
    assert (c.engine.cpu_kernels, c.engine.cuda_fast_path) == (True, True)
    # commands that build an EngineConfig from their own flags read the same variables
    cfg = EngineConfig(dtype="bfloat16", max_num_seqs=8)
    assert with_backend_env(cfg, env={}) == cfg
    got = with_backend_env(cfg, env={"TOKENMILL_CPU_KERNELS": "0", "TOKENMILL_ENGINE__MAX_NUM_SEQS": "2"})
    assert (got.cpu_kernels, got.max_num_seqs, got.dtype) == (False, 8, "bfloat16")
    with pytest.raises(ConfigError, match=r"engine\.cuda_graphs: 'maybe' is not valid"):
        with_backend_env(cfg, env={"TOKENMILL_CUDA_GRAPHS": "maybe"})


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        ("tokenizers: 3\n", {}, "unknown config key tokenizers"),
        ("router:\n  weight: 2\n", {}, "unknown config key router.weight"),
        ("", {"tokenizer.count": "many"}, "tokenizer.count: 'many' is not valid"),
        ("", {"engine.dtype": "int4"}, "engine.dtype: 'int4' is not valid (expected one of"),
        ("", {"decode.port": 20000}, "decode-0 port 20000 collides with router-0 port 20000"),
        ("", {"base_port": 65000}, "outside 1..65535"),
        ("- a\n", {}, "must hold a mapping"),
        ("", {"engine.block_size": 12}, "engine: block_size must be a positive power of two"),
    ],
)
def test_config_errors_name_the_key(tmp_path, text, overrides, message):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_cluster_config(f, overrides=overrides, env={})
    assert message in str(e.value)


def test_flags_reach_the_config():
    from services.cluster.cli import _overrides

    a = build_parser().parse_args(["up", "--tokenizers", "3", "--decodes", "2", "--gateway-port", "25051",
                                   "--base-port", "23000", "--set", "router.prefill_threshold_tokens=64"])
    c = load_cluster_config(None, _overrides(a), env={})
    assert (c.tokenizer.count, c.decode.count, c.gateway.port, c.base_port) == (3, 2, 25051, 23000)
    assert c.router.prefill_threshold_tokens == 64 and c.prefill.count == 1


def tokenmill(capsys, *args: str) -> tuple[int, str, str]:
    """The cluster commands in this process (a real ``tokenmill`` process costs seconds of imports)."""
    from services.cluster.__main__ import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # --help, argparse errors
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_up_help_and_bad_config_exit_cleanly(capsys):
    code, out, _ = tokenmill(capsys, "up", "--help")
    assert code == 0 and "--tokenizers" in out and "--config" in out and "--set" in out
    parser = build_parser()  # the `tokenmill` command registers the same subcommands
    assert {"up", "serve", "status"} <= set(parser._subparsers._group_actions[0].choices)
    for sub in ("serve", "status"):
        assert tokenmill(capsys, sub, "--help")[0] == 0
    code, _, err = tokenmill(capsys, "up", "--set", "tokenizer.count=x")
    assert code == 2 and "tokenizer.count: 'x' is not valid" in err
    code, _, err = tokenmill(capsys, "serve", "router", "--index", "3")
    assert code == 2 and "--index 3 is outside the 1 router instances" in err


def test_default_model_matches_the_loader():
    from common import cluster_config, loader

    assert cluster_config.DEFAULT_MODEL == loader.DEFAULT_MODEL


def _up(tmp_path, *extra: str) -> tuple[subprocess.Popen, int, str]:
    base = free_base_port()
    gw = base + 450
    state = tmp_path / "state" / "cluster.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--base-port", str(base), "--gateway-port", str(gw),
         "--http-port", str(base + 460), "--tokenizers", "1", "--prefills", "0", "--decodes", "0",
         "--grace", "2", "--state-file", str(state), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    return proc, base, str(state)


def test_up_status_and_stop(tmp_path, capsys):
    proc, base, state = _up(tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (read_state(Path(state)) or {}).get("ready"):  # rewritten once every child is SERVING
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "cluster not ready in 60 s"
            time.sleep(0.2)
        code, out, _ = tokenmill(capsys, "status", "--json", "--state-file", state)
        st = json.loads(out)
        assert code == 0 and st["running"] and st["ready"] and st["healthy"], out
        roles = sorted(p["name"] for p in st["processes"])
        assert roles == ["gateway-0", "router-0", "tokenizer-0"]
        by = {p["name"]: p for p in st["processes"]}
        assert by["tokenizer-0"]["address"] == f"{HOST}:{base + 100}" and by["router-0"]["grpc_port"] == base
        assert all(p["health"] == "SERVING" and p["alive"] for p in st["processes"])
        code, human, _ = tokenmill(capsys, "status", "--state-file", state)
        assert code == 0 and "cluster ready" in human and "tokenizer-0" in human and "SERVING" in human
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "tokenmill cluster ready: 3 processes" in out and f"grpc {HOST}:{base + 450}" in out
    assert "stopping 3 processes" in out
    for p in st["processes"]:  # every child is gone, the state file too
        with pytest.raises(ProcessLookupError):
            os.kill(p["pid"], 0)
        assert health_status(p["address"], timeout=0.3) == "UNREACHABLE"
    assert not os.path.exists(state)
    code, out, _ = tokenmill(capsys, "status", "--state-file", state)
    assert code == 3 and "no cluster is running" in out


def test_a_child_that_dies_is_named_and_stops_the_rest(tmp_path):
    proc, _, state = _up(tmp_path, "--model", str(tmp_path / "missing.gguf"))
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1
    assert "tokenizer-0 (pid" in err and "exited with code 1" in err
    assert "missing.gguf" in err  # the child's last log lines say why
    assert "stopping 2 processes" in out
    assert not os.path.exists(state)


def test_port_check_refuses_a_listener_but_not_time_wait():
    """Restarting right after a stop must work: the last connections of the old cluster sit in TIME_WAIT."""
    import socket

    from services.cluster.launcher import LaunchError, check_ports_free

    base = free_base_port()
    cfg = load_cluster_config(overrides={"base_port": base, "tokenizer.count": 1}, env={})
    router = cfg.service("router", 0).grpc_port
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((HOST, router))
    srv.listen()
    cli = socket.create_connection((HOST, router))
    conn, _ = srv.accept()
    with pytest.raises(LaunchError, match=f"router-0 gRPC port {HOST}:{router} is taken"):
        check_ports_free(cfg)
    conn.close()  # the server side closes first: its end of the connection goes to TIME_WAIT
    srv.close()
    cli.close()
    check_ports_free(cfg)
