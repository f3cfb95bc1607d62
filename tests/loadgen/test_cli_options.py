"""`tokenmill bench serve` takes the options `vllm bench serve` takes for the same things, so the two can be driven
with the same numbers."""

from __future__ import annotations

import math

import pytest

from loadgen.bench_serve import _loads, _target, _workload, parse_tenant, send_options
from loadgen.clients import SendOptions
from loadgen.workloads import RequestSpec
from services.cli import build_parser

VLLM_LIKE = ["bench", "serve", "--backend", "openai-chat", "--base-url", "http://127.0.0.1:8000", "--endpoint",
             "/v1/chat/completions", "--model", "smollm2", "--dataset-name", "random", "--random-input-len", "256",
             "--random-output-len", "128", "--num-prompts", "64", "--max-concurrency", "8", "--request-rate", "inf",
             "--ignore-eos", "--seed", "3", "--goodput", "ttft:500", "tpot:50", "--save-result", "--result-dir", "r",
             "--result-filename", "x.json", "--burstiness", "0.5", "--num-warmups", "2", "--disable-tqdm",
             "--random-range-ratio", "0.25", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "50", "--min-p",
             "0.05", "--repetition-penalty", "1.1"]
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.1}


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
    assert parse_tenant("bob:class=batch").priority_class == "batch"
    a = build_parser().parse_args(["bench", "serve", "--tenant", "a:rate=1", "--tenant", "b:rate=3"])
    assert _loads(a, a.tenant)[0].request_rate == 4.0
    for bad in ("", "x:rate=0", "x:speed=3", "x:priority=-1", "x:class=urgent"):
        with pytest.raises(Exception, match="--tenant"):
            parse_tenant(bad)


@pytest.mark.parametrize("backend", ["grpc", "openai", "openai-chat"])
def test_sampling_options_reach_every_backend_and_are_left_out_unset(backend):
    a = build_parser().parse_args([*VLLM_LIKE, "--backend", backend])
    opts = send_options(a)
    assert {k: getattr(opts, k) for k in SAMPLING} == SAMPLING and opts.sampling() == SAMPLING
    assert {k: a.__dict__[k] for k in SAMPLING} == SAMPLING  # the result JSON's config is vars(a)
    spec = RequestSpec(index=0, prompt_ids=(1, 2, 3), prompt_text="a b c", input_len=3, output_len=4)
    unset = build_parser().parse_args(["bench", "serve", "--backend", backend])
    assert send_options(unset) == SendOptions()
    for o, want in ((opts, SAMPLING), (send_options(unset), {})):
        target, _ = _target(a, o, [])
        if backend == "grpc":
            params = target.request(spec).params
            sent = {k: getattr(params, k) for k in SAMPLING if params.HasField(k)}
            assert sent == pytest.approx(want)  # float32 in the proto
            assert isinstance(sent.get("top_k", 0), int)
        else:
            assert {k: v for k, v in target.payload(spec).items() if k in SAMPLING} == want
