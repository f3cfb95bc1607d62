"""Profiling a running cluster as vLLM users do: ``tokenmill up --set profile_dir=DIR``, then the gateway's
``POST /start_profile`` and ``POST /stop_profile`` (real processes, the real model). Every model worker writes a
trace of its engine's steps; a start or stop in the wrong state is a 400 that says what to do."""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from common.engine_loop import STEP_RANGE
from services.cli import main
from tests.services.harness import running_cluster


def _post(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_start_a_request_stop_writes_a_trace_per_worker(tmp_path, capsys):
    traces = tmp_path / "traces"
    with running_cluster(tmp_path, "--tokenizers", "1", "--grace", "3", "--set", f"profile_dir={traces}") as info:
        root = info["http"]
        status, started = _post(f"{root}/start_profile")
        assert status == 200 and started["profiling"] is True and started["workers"], started
        status, again = _post(f"{root}/start_profile")
        assert status == 400 and "already profiling: stop it first" in again["error"]["message"], again
        c = openai.OpenAI(base_url=root + "/v1", api_key="none", max_retries=0, timeout=120)
        out = c.completions.create(model="smollm2", prompt="Count to five:", max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8
        status, stopped = _post(f"{root}/stop_profile")
        assert status == 200 and stopped["profiling"] is False, stopped
        assert {w["worker_id"] for w in stopped["workers"]} == {w["worker_id"] for w in started["workers"]}
        steps = 0
        for w in stopped["workers"]:
            path = Path(w["trace_path"])
            assert path.parent == traces and path.name.startswith(w["worker_id"]), path
            with gzip.open(path) as f:
                events = json.loads(f.read())["traceEvents"]
            steps += sum(e.get("name") == STEP_RANGE for e in events)
        assert steps >= 8  # the request's prompt step and a step a token, in the worker that ran it
        status, late = _post(f"{root}/stop_profile")
        assert status == 400 and "is not profiling: start it first" in late["error"]["message"], late
        # the same from the command line, the gateway found through the state file
        assert main(["profile", "for", "0.5", "--state-file", info["state"]]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith("profiling ") and len(lines) == 1 + len(started["workers"]), lines
        for line in lines[1:]:
            worker, path = line.split(": ", 1)
            assert Path(path).is_file() and Path(path).name.startswith(worker)
        with pytest.raises(SystemExit, match=r"stop: 400: .*is not profiling: start it first"):
            main(["profile", "stop", "--state-file", info["state"]])
