"""``tokenmill bench soak`` and ``tokenmill bench chaos`` against a real cluster of ``tokenmill up``: short runs, the
same code as the long ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import main
from tests.services.harness import running_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # two tokenizers, so the chaos run's kill leaves one serving; aggregated (one decode worker)
    with running_cluster(tmp_path_factory.mktemp("resilience"), "--prefills", "0", "--tokenizers", "2") as c:
        yield c


def test_a_short_soak_reports_every_process_and_no_leak(cluster, tmp_path, capsys):
    out = tmp_path / "soak.json"
    rc = main(["bench", "soak", "--state-file", cluster["state"], "--duration", "4", "--probe-s", "2",
               "--probe-concurrency", "2", "--interval", "1", "--input-len", "16", "--output-len", "4",
               "--output", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0, capsys.readouterr().out
    assert r["capacity_rps"] > 0 and r["failed"] == 0 and r["leaks"] == []
    assert {p["name"] for p in r["processes"]} == {p["name"] for p in cluster["processes"]}
    assert all(p["rss_start"] and p["rss_end"] for p in r["processes"])
    assert len(r["samples"]) >= 2
    assert "| decode-0 |" in capsys.readouterr().out


def test_chaos_kills_a_tokenizer_under_load_and_it_comes_back(cluster, tmp_path, capsys):
    out = tmp_path / "chaos.json"
    rc = main(["bench", "chaos", "--state-file", cluster["state"], "--roles", "tokenizer,prefill", "--rate", "2",
               "--before-s", "1", "--after-s", "2", "--probe-concurrency", "1", "--input-len", "16",
               "--output-len", "4", "--output", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0, capsys.readouterr().out
    tok, pre = r["roles"]
    assert tok["killed"] == "tokenizer-1" and tok["recover_s"] is not None and tok["requests"] > 0
    assert pre == {"role": "prefill", "skipped": "no prefill process in this cluster"}
    assert r["leaks"] == []
    state = json.loads(Path(cluster["state"]).read_text())
    assert next(p for p in state["processes"] if p["name"] == "tokenizer-1")["restarts"] == 1
