"""The ``tokenmill`` command as a user runs it: a real process, real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common.sampling import SamplingParams

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def tokenmill(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], input=stdin, capture_output=True, text=True, timeout=300,
        env=ENV,
    )


def test_help_lists_subcommands_and_each_has_help():
    top = tokenmill("--help")
    assert top.returncode == 0
    for sub in ("generate", "bench"):
        assert sub in top.stdout
        assert tokenmill(sub, "--help").returncode == 0


def test_generate_writes_one_line_per_prompt_in_order(tmp_path, engine):
    lines = [
        {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
         "max_tokens": 16},
        {"prompt": "The three laws of thermodynamics are", "temperature": 0, "max_tokens": 8},
        {"prompt": "1, 1, 2, 3, 5, 8,", "temperature": 0, "max_tokens": 12, "stop": [","], "logprobs": 2},
        {"messages": [{"role": "user", "content": "Name a color."}], "temperature": 0.8, "seed": 5,
         "max_tokens": 6},
    ]
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    r = tokenmill("generate", "--prompts", str(src), "--output", str(out), "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["index"] for x in recs] == [0, 1, 2, 3]
    assert recs[0]["text"] == "The capital of France is Paris." and recs[0]["finish_reason"] == "stop"
    assert len(recs[1]["token_ids"]) == 8 and recs[1]["finish_reason"] == "length"
    assert recs[2]["text"] == " 13" and recs[2]["finish_reason"] == "stop"
    assert len(recs[2]["logprobs"]) == len(recs[2]["token_ids"]) and len(recs[2]["logprobs"][0]["top"]) == 2
    # the same requests through the engine in this process give the same tokens
    tk = engine.tokenizer
    ids = tk.encode("The three laws of thermodynamics are")
    [same] = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0))
    assert recs[1]["token_ids"] == same.token_ids
    chat = tk.encode(tk.apply_chat_template(lines[3]["messages"]), add_special_tokens=False)
    [seeded] = engine.generate([chat], SamplingParams(max_tokens=6, temperature=0.8, seed=5))
    assert recs[3]["token_ids"] == seeded.token_ids


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not valid JSON"),
        ('{"prompt": "hi", "top_p": 2}', "line 2: top_p must be in (0, 1], got 2"),
        ('{"prompt": "hi", "max_tokens": 0}', "line 2: max_tokens must be at least 1, got 0"),
        ('{"prompt": ""}', "line 2: the prompt is empty"),
        ('{"text": "hi"}', "line 2: needs 'prompt'"),
        ('{"prompt": "hi", "temprature": 1}', "line 2: unknown field 'temprature'"),
    ],
)
def test_bad_lines_are_named(tmp_path, line, message):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "fine"}\n' + line + "\n")
    r = tokenmill("generate", "--prompts", str(src))
    assert r.returncode == 2
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_model_is_a_clear_error(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    r = tokenmill("generate", "--prompts", str(src), "--model", str(tmp_path / "missing.gguf"))
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
