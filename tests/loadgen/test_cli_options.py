"""`tokenmill bench serve` takes the options `vllm bench serve` takes for the same things, so the two can be driven
with the same numbers."""

from __future__ import annotations

import math

import pytest

from loadgen.bench_serve import _loads, _workload, parse_tenant
from services.cli import build_parser

VLLM_LIKE = ["bench", "serve", "--backend", "openai-chat", "--base-url", "http://127.0.0.1:8000", "--endpoint",
             "/v1/chat/completions", "--model", "smollm2", "--dataset-name", "random", "--random-input-len", "256",
             "--random-output-len", "128", "--num-prompts", "64", "--max-concurrency", "8", "--request-rate", "inf",
             "--ignore-eos", "--seed", "3", "--goodput", "ttft:500", "tpot:50", "--save-result", "--result-dir", "r",
             "--result-filename", "x.json", "--burstiness", "0.5", "--num-warmups", "2", "--disable-tqdm",
             "--random-range-ratio", "0.25"]


def test_vllm_options_parse_to_the_same_load_and_workload():
    a = build_parser().parse_args(VLLM_LIKE)
    (load,) = _loads(a, [])
    assert (load.request_rate, load.max_concurrency, load.num_requests, load.burstiness, load.num_warmups) == (
        math.inf, 8, 64, 0.5, 2)
    w = _workload(a, load.seed)
    assert (w.dataset, w.input_len, w.output_len, w.chat, w.seed) == ("random", (192, 320), (96, 160), True, 3)
    assert a.result_file == "x.json" and a.goodput == ["ttft:500", "tpot:50"] and a.endpoint == "/v1/chat/completions"
    sweep = _loads(build_parser().parse_args(["bench", "serve", "--request-rate", "1", "2", "4"]), [])
    assert [x.request_rate for x in sweep] == [1, 2, 4] and [x.seed for x in sweep] == [0, 1000, 2000]
    with pytest.raises(ValueError, match="not both"):
        _loads(build_parser().parse_args(["bench", "serve", "--request-rate", "1", "2", "--max-concurrency", "1",
                                          "2"]), [])


def test_tenants_parse_and_set_the_rate():
    t = parse_tenant("alice:rate=2.5,priority=10,key=sk-a")
    assert (t.name, t.rate, t.priority, t.api_key) == ("alice", 2.5, 10, "sk-a")
    a = build_parser().parse_args(["bench", "serve", "--tenant", "a:rate=1", "--tenant", "b:rate=3"])
    assert _loads(a, a.tenant)[0].request_rate == 4.0
    for bad in ("", "x:rate=0", "x:speed=3", "x:priority=-1"):
        with pytest.raises(Exception, match="--tenant"):
            parse_tenant(bad)
