"""``tokenmill bench tenants``'s bookkeeping of the flood: how many client processes send it, and how its requests
ended (the runs that sent a flood its client never got out read as 'cancelled', not as refused)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import yaml

from common.cluster_config import load_cluster_config
from common.config import EngineConfig
from loadgen.bench_tenants import _late, _outcomes, _was_sent, flood_processes, tenants_config, up_command
from loadgen.metrics import RequestRecord, stats
from services.cli import build_parser


def test_the_flood_is_split_over_processes_of_250_requests_a_second_unless_told():
    assert [flood_processes(argparse.Namespace(flood_processes=0), r) for r in (10, 250, 251, 812, 4448)] == [
        1, 1, 2, 4, 18]
    assert flood_processes(argparse.Namespace(flood_processes=3), 812) == 3


def test_the_floods_outcomes_are_counted_by_how_each_request_ended():
    recs = [RequestRecord(index=i, input_len=8, output_len=4) for i in range(7)]
    recs[0].chunk_times, recs[0].chunk_tokens = [0.01], [4]  # answered
    recs[1].outcome = recs[2].outcome = "cancelled"  # still waiting at the end of the run
    for r in recs[3:6]:
        r.outcome, r.error_kind, r.error = "error", "RESOURCE_EXHAUSTED", "tenant flood is over its quota"
    recs[6].outcome, recs[6].error_kind, recs[6].error = "error", "UNAVAILABLE", "x" * 300
    out = _outcomes(recs)
    assert out["counts"] == {"RESOURCE_EXHAUSTED": 3, "cancelled": 2, "ok": 1, "UNAVAILABLE": 1}
    assert out["error_samples"] == {"RESOURCE_EXHAUSTED": "tenant flood is over its quota", "UNAVAILABLE": "x" * 200}
    assert _late(stats([0.001, 0.002, 0.1], 1e3)).startswith("p50 / p99 / max 2.0 / 98.0 / 100 ms")
    assert _late(stats([], 1e3)) == "none"
    recs[0].start_wall_ns = 1  # the client stamps a request as it sends it
    assert [_was_sent(r) for r in recs[:2]] == [True, False]  # cancelled while due: never sent, not "0 ms late"


def test_defaults_are_sampled_and_the_model_reaches_tokenmill_up(tmp_path: Path):
    a = build_parser().parse_args(["bench", "tenants"])
    assert (a.temperature, a.interactive_rate, a.model, a.tokenizer) == (1.0, 5.0, None, None)
    # the flood is held by its requests in flight, not a quota, and the p99s pool 10 rounds
    assert (a.flood_max_inflight, a.flood_rpm, a.flood_max_running, a.rounds) == (16, 0, 0, 10)
    written = tmp_path / "tenants.yaml"  # what the bench gives `tokenmill up --config`
    written.write_text(yaml.safe_dump(tenants_config(a, {"interactive": "i", "flood": "f", "probe": "p"})))
    flood = load_cluster_config(written, env={}).tenants["flood"]
    assert (flood.max_inflight, flood.rpm, flood.rpm_burst, flood.max_running) == (16, 0, 0, 0)
    assert flood.max_class == flood.default_class == "batch"
    cmd = up_command(a, Path("/w/c.yaml"), 20000, Path("/w"))
    assert "--model" not in cmd and "--tokenizer" not in cmd
    assert cmd[cmd.index("--gateway-port") + 1] == "20450" and cmd[cmd.index("--http-port") + 1] == "20451"
    a = build_parser().parse_args(["bench", "tenants", "--model", "dummy:llama-3.1-8b", "--tokenizer", "/tmp/tok",
                                   "--temperature", "0", "--set", "engine.device=cuda", "--batch-prefill-tokens", "none"])
    cmd = up_command(a, Path("/w/c.yaml"), 20000, Path("/w"))
    assert cmd[cmd.index("--model") + 1] == "dummy:llama-3.1-8b" and cmd[cmd.index("--tokenizer") + 1] == "/tmp/tok"
    assert cmd[-2:] == ["--set", "engine.device=cuda"] and a.temperature == 0.0
    assert "engine.batch_prefill_tokens_beside_urgent=null" in cmd  # none: no limit
    for n in ("8", "0"):  # 0: the flood's prompts pause beside the interactive tenant's steps
        a = build_parser().parse_args(["bench", "tenants", "--batch-prefill-tokens", n])
        assert f"engine.batch_prefill_tokens_beside_urgent={n}" in up_command(a, Path("/w/c.yaml"), 20000, Path("/w"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "tenants", "--batch-prefill-tokens", "-1"])
    assert EngineConfig().batch_prefill_tokens_beside_urgent == 0  # what the bench measures when not told
    off = load_cluster_config(None, {"engine.batch_prefill_tokens_beside_urgent": "null"}, env={})
    assert off.engine.batch_prefill_tokens_beside_urgent is None


def test_a_result_names_its_commit_and_the_code_files_that_differ_from_it(tmp_path):
    """Every benchmark's ``source``: the commit, and where the code differs from it, which files (a tree copied to a
    GPU machine with an older .git); changes outside the code (docs) are not counted."""
    import subprocess

    from loadgen.bench_offline import _source_state

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    for f in ("services/a.py", "docs/b.md", "common/c.py"):
        (tmp_path / f).parent.mkdir(exist_ok=True)
        (tmp_path / f).write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = git("rev-parse", "--short", "HEAD")
    assert _source_state(tmp_path) == {"commit": head}
    (tmp_path / "docs/b.md").write_text("changed\n")
    assert _source_state(tmp_path) == {"commit": head}  # not code
    (tmp_path / "services/a.py").write_text("x = 2\n")
    (tmp_path / "common/c.py").write_text("x = 3\n")
    got = _source_state(tmp_path)
    assert got["commit"] == head and got["uncommitted_files"] == ["common/c.py", "services/a.py"]
    assert len(got["uncommitted_sha1"]) == 12
    (tmp_path / "common/c.py").write_text("x = 4\n")
    assert _source_state(tmp_path)["uncommitted_sha1"] != got["uncommitted_sha1"]
    assert _source_state(tmp_path / "nowhere") == {"commit": "unknown"}


def test_a_target_inside_the_sampling_interval_is_said_to_be_not_resolved():
    from loadgen.bench_tenants import _verdict

    assert _verdict(1.05, 1.10, (0.98, 1.12)).startswith("met, not resolved: 90% interval from sampling -2% … +12%")
    assert _verdict(1.05, 1.10, (0.98, 1.08)).startswith("met; ")
    assert _verdict(1.32, 1.20, (1.23, 1.38)).startswith("MISSED; ")
    assert _verdict(1.32, 1.20, (1.10, 1.38)).startswith("MISSED, not resolved")
    assert _verdict(1.32, 1.20, None) == "MISSED"
    assert _verdict(1.0, 1.20, (math.nan, math.nan)) == "met"
    assert _verdict(1.0, 1.20, [None, None]) == "met"  # NaN as the result file writes it


def test_the_targets_line_carries_each_ratios_sampling_interval():
    """A stored result of a GPU run (docs/results), with the intervals this run would have computed."""
    import json

    from loadgen.bench_tenants import format_result

    root = Path(__file__).resolve().parents[2]
    r = json.loads((root / "docs/results/tenants-noisy-neighbour-h200-cap16.json").read_text())
    r["ratio_interval_90"] = {"ttft_p99": [1.23, 1.38], "tpot_p99": [0.9, 1.12]}
    assert format_result(r).splitlines()[-1] == (
        "targets: TTFT p99 moved +32% (< +20%: MISSED; 90% interval from sampling +23% … +38%), TPOT p99 moved -2% "
        "(< +10%: met, not resolved: 90% interval from sampling -10% … +12%)")
    del r["ratio_interval_90"]  # a result from before the intervals
    assert format_result(r).splitlines()[-1].endswith("(< +10%: met)")
