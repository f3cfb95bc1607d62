"""``tokenmill bench fuzz`` without a cluster: its options, the cases it draws, the process check and the table.
The generators against a real cluster: ``tests/services/test_fuzz_inputs.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

from loadgen import fuzz
from loadgen.bench_fuzz import draw_cases, format_table, process_violations
from services.cli import build_parser


def test_options_and_a_reproducible_draw_of_both_doors():
    a = build_parser().parse_args(["bench", "fuzz", "--url", "http://127.0.0.1:8000/v1", "--grpc", "127.0.0.1:1",
                                   "--cases", "10000", "--state-file", "s.json"])
    assert (a.url, a.grpc, a.cases, a.state_file, a.concurrency) == ("http://127.0.0.1:8000/v1", "127.0.0.1:1",
                                                                     10000, "s.json", 4)
    cases = draw_cases(60, seed=3, max_len=1024, max_body_bytes=4096)
    assert len(cases) == 60 and cases == draw_cases(60, seed=3, max_len=1024, max_body_bytes=4096)
    assert {type(c) for c in cases} == {fuzz.HttpCase, fuzz.GrpcCase}
    assert {c.path for c in cases if isinstance(c, fuzz.HttpCase)} <= {"/v1/completions", "/v1/chat/completions"}


def test_a_dead_or_restarted_process_is_a_violation(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    before = [{"name": "decode-0", "pid": os.getpid(), "restarts": 0},
              {"name": "prefill-0", "pid": dead.pid, "restarts": 0},
              {"name": "router-0", "pid": os.getpid(), "restarts": 0}]
    state = tmp_path / "state.json"
    after = [dict(before[0]), dict(before[1]), {**before[2], "pid": os.getpid() + 1, "restarts": 1}]
    state.write_text(json.dumps({"processes": after}))
    assert process_violations(before, str(state)) == [f"prefill-0 (pid {dead.pid}) is dead",
                                                      f"router-0 (pid {os.getpid()}) was restarted"]


def test_the_table_counts_status_codes_and_violations_per_door():
    tally = Counter({("http", "400"): 7, ("http", "200"): 3, ("grpc", "OK"): 4, ("grpc", "INTERNAL"): 1})
    table = format_table(tally, ["gRPC Generate [raw bytes] b'' → INTERNAL: boom"], [], ["decode-0 10/10 free"], [])
    assert "| HTTP (OpenAI API) | 10 | 400 ×7, 200 ×3 | 0 |" in table
    assert "| gRPC Frontend/Generate | 5 | OK ×4, INTERNAL ×1 | 1 |" in table
    assert "| processes (state file) | | all alive, none restarted | 0 |" in table
    assert "| KV blocks after the run | | decode-0 10/10 free | 0 |" in table
