"""``tokenmill bench gpu-serving`` end to end on the CPU: the real engine in the test's process, the real cluster
(``tokenmill up``), the same load through gRPC; the JSON holds every row with positive figures."""

from __future__ import annotations

import json
import re

import pytest

from common.config import ModelConfig
from common.loader import load_model_source
from loadgen.bench_gpu_serving import SAMPLINGS, limit_at_rows, parse_sampled, served_target, step_limit
from loadgen.clients import SAMPLING_FIELDS
from loadgen.server_metrics import ENGINE_STEP_PHASES
from loadgen.workloads import RequestSpec
from services.cli import main


def test_step_limit_counts_the_lm_head_not_the_embedding_table():
    m: ModelConfig = load_model_source("dummy:llama-3.1-8b").config
    lim = step_limit(m, "bfloat16", batch=64, input_len=1024, output_len=128, bandwidth=4e12, matmul_rate=7e14)
    embedding = m.vocab_size * m.hidden_size * 2
    # every matrix of the 8B (8.03 B parameters) but the embedding table and the norms, in bf16: 15.01 GB
    assert lim["weight_bytes"] == pytest.approx(m.num_params() * 2 - embedding, rel=1e-4)
    assert lim["weight_bytes"] == pytest.approx(15.01e9, rel=2e-3)
    assert lim["kv_bytes"] == 64 * 1088 * 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    assert lim["limit_ms"] == pytest.approx((lim["weight_bytes"] + lim["kv_bytes"]) / 4e12 * 1e3)
    tied = load_model_source("dummy:llama-3.2-1b").config  # its LM head is its embedding table: read once
    assert tied.tie_word_embeddings
    assert step_limit(tied, "bfloat16", 1, 0, 1, 1.0, 1.0)["weight_bytes"] == pytest.approx(tied.num_params() * 2,
                                                                                          rel=1e-4)


def test_the_mixed_limit_adds_the_prompt_tokens_that_share_a_step():
    """A closed loop of 1,024 in / 128 out at 64 in flight carries 512 prompt tokens a decode step; each costs 2
    FLOPs per layer weight (about 2 × 6.98 B for the 8B: its parameters less the embedding table and LM head) plus
    attention over half its prompt on average."""
    m: ModelConfig = load_model_source("dummy:llama-3.1-8b").config
    lim = step_limit(m, "bfloat16", batch=64, input_len=1024, output_len=128, bandwidth=4e12, matmul_rate=7e14)
    assert lim["prompt_tokens_per_step"] == 512
    layers = m.num_params() - 2 * m.vocab_size * m.hidden_size  # untied: the embedding table and the LM head
    attention = m.num_layers * 4 * m.q_size * 512
    assert lim["prompt_flops_per_token"] == pytest.approx(2 * layers + attention, rel=1e-3)
    assert lim["mixed_limit_ms"] == pytest.approx(lim["limit_ms"] + 512 * lim["prompt_flops_per_token"] / 7e14 * 1e3)
    assert lim["mixed_limit_ms"] > 2 * lim["limit_ms"]  # the prompts' work outweighs the decode's reads here


def test_every_client_sends_the_samplings_fields_and_completions_the_token_ids():
    spec = RequestSpec(index=0, prompt_ids=(5, 6, 7), prompt_text="a b c", input_len=3, output_len=4)
    cluster = {"grpc": "127.0.0.1:1", "http": "http://127.0.0.1:2"}
    for s in SAMPLINGS:
        want = s.fields()  # greedy: temperature 0 alone; sampled: every field that differs from the default
        params = served_target("grpc", cluster, s, None).request(spec).params
        assert {k: getattr(params, k) for k in SAMPLING_FIELDS if params.HasField(k)} == pytest.approx(want)
        assert params.ignore_eos
        for backend, prompt in (("openai", [5, 6, 7]), ("openai-chat", None)):
            p = served_target(backend, cluster, s, None).payload(spec)
            assert {k: p[k] for k in SAMPLING_FIELDS if k in p} == want and p["ignore_eos"] and p.get("prompt") == prompt
    assert SAMPLINGS[1].fields() == {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}


def test_sampled_runs_take_the_fields_given_and_refuse_bad_ones():
    """``--sampled``: what an OpenAI client sends (temperature 1 and a top_p, no top_k) in place of the issue's
    setting; a bad item gets a message naming it, as argparse prints it."""
    import argparse

    assert parse_sampled("temperature=1,top_p=0.9").fields() == {"temperature": 1.0, "top_p": 0.9}
    assert parse_sampled("top_p=0.95").fields() == {"temperature": 1.0, "top_p": 0.95}  # temperature 1 by default
    assert parse_sampled("temperature=0.7,top_k=20,repetition_penalty=1.2").fields() == {
        "temperature": 0.7, "top_k": 20, "repetition_penalty": 1.2}
    for bad, says in (("top_p=1.5", "top_p must be in (0, 1]"), ("temperature=0", "temperature above 0"),
                      ("min_p=0.1", "'min_p=0.1': expected KEY=VALUE"), ("top_k=x", "top_k takes a number"),
                      ("top_p=0.9,top_p=0.8", "each key once"), ("temperature", "expected KEY=VALUE")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
            parse_sampled(bad)


def test_the_reported_step_phases_are_the_engines():
    from common.engine import STEP_PHASES

    assert STEP_PHASES == ENGINE_STEP_PHASES


def test_engine_and_served_cluster_under_the_same_load(tmp_path, capsys):
    out = tmp_path / "gs.json"
    code = main(["bench", "gpu-serving", "--device", "cpu", "--models", "smollm2", "--num-prompts", "4",
                 "--input-len", "32", "--output-len", "4", "--max-concurrency", "4", "--backends", "grpc",
                 "--steps", "3", "--step-rounds", "3", "--set", "tokenizer.count=1", "--result-file", str(out),
                 "--profile-dir", str(tmp_path / "prof")])
    text = capsys.readouterr().out
    assert code == 0, text
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["device_name"] and res["copy_bandwidth_Bps"] > 0
    rows = {(r["client"], r["sampling"]): r for r in res["rows"]}
    assert set(rows) == {(c, s.name) for c in ("engine", "grpc") for s in SAMPLINGS}
    for r in rows.values():
        s = r["summary"]
        assert (s["completed"], s["failed"], s["output_len_mismatch"]) == (4, 0, 0), r
        assert s["output_tokens"] == 16 and s["input_tokens"] == 4 * 32
        assert r["output_tok_s"] > 0 and r["tpot_p50_ms"] > 0 and r["ttft_p50_ms"] > 0
        assert r["vs_engine_same_sampling"] > 0 and r["vs_engine_greedy"] > 0 and r["tpot_p50_vs_limit"] > 0
        assert 0 < r["tpot_p50_vs_mixed_limit"] < r["tpot_p50_vs_limit"]
    for sampling in ("greedy", "sampled"):  # each served run has its own cache salt: no prefix-cache hit
        assert rows["grpc", sampling]["server"]["prefix_cache_hits"] == 0
        # aggregated: the one decode worker's steps are all the cluster's
        dec = rows["grpc", sampling]["decode_workers"]
        assert dec["engine_steps"] == rows["grpc", sampling]["server"]["engine_steps"] > 0
        assert 0 < rows["grpc", sampling]["decode_rows_per_step"] <= 4
    assert rows["engine", "greedy"]["vs_engine_greedy"] == 1.0
    for sampling in ("greedy", "sampled"):  # the served decode worker profiled through each load: its steps
        prof = rows["grpc", sampling]["profile"]
        assert set(prof["traces"]) == {"decode-0"}
        assert all(p.startswith(str(tmp_path / "prof" / "smollm2")) for p in prof["traces"].values())
        st = prof["steps"]["decode-0"]
        assert st["steps"] >= 4 and 0 < st["host_ms_p50"] <= st["host_ms_max"] and st["gpu_busy_share"] == 0
    for sampling in ("greedy", "sampled"):  # the engines' own queue time and TTFT, alone and served
        eng, served = rows["engine", sampling]["server"], rows["grpc", sampling]["server"]
        assert eng["engine_queue_count"] == eng["engine_ttft_count"] == 4 and eng["engine_ttft_mean_ms"] > 0
        assert 0 <= served["engine_queue_mean_ms"] <= served["engine_ttft_mean_ms"] <= served["ttft_mean_ms"]
        assert rows["grpc", sampling]["summary"]["client_processes"] == 4  # the default: 4 client processes
    for r in rows.values():  # the steps' host time by phase, alone and served, adds up to the steps' seconds
        e = r["server"]
        phases = [e[f"engine_phase_{p}"] for p in ENGINE_STEP_PHASES]
        assert min(phases) >= 0 and e["engine_phase_launch"] > 0, e
        assert sum(phases) == pytest.approx(e["engine_step_seconds"], rel=1e-3), e
    assert "Where a step's host time went" in text and "| schedule | launch | wait | outputs | sample | other |" in text
    m = res["models"]["smollm2"]
    assert m["served_processes"] == {"decode": 1, "gateway": 1, "router": 1, "tokenizer": 1}  # on the CPU: one gateway
    assert m["limit"]["limit_ms"] > 0 and m["limit"]["batch"] == 4 and m["limit"]["context"] == 34
    assert m["limit"]["mixed_limit_ms"] > m["limit"]["limit_ms"] and res["matmul_flops"] > 0
    assert "mixed limit" in text
    assert m["step"]["batch"] == 4 and m["step"]["greedy_ms"] > 0 and m["step"]["sampled_ms"] > 0
    assert m["step"]["greedy"]["rows_min"] == m["step"]["sampled"]["rows_min"] == 4  # all four decoding
    assert m["step"]["ratio"] == pytest.approx(m["step"]["sampled_ms"] / m["step"]["greedy_ms"])
    ratios = sorted(r["ratio"] for r in m["step"]["rounds"])  # three rounds: the table takes the median's
    assert len(ratios) == 3 and m["step"]["ratio"] == ratios[1]
    assert {"smollm2: engine load", "smollm2: cluster start"} <= set(res["phases_s"])
    assert "| smollm2 | sampled | grpc |" in text and "sampled ÷ greedy" in text


def test_served_with_a_prefill_worker_reports_the_decode_workers_steps(tmp_path, capsys):
    """``--prefills 1``: the served cluster runs one prefill and one decode worker; every prompt is prefilled
    remotely (threshold 1 token), so the decode worker's steps carry no prompt tokens, and the rows' step figures and
    limit at their rows are the decode worker's alone, not diluted by the prefill worker's steps."""
    out = tmp_path / "gs.json"
    code = main(["bench", "gpu-serving", "--device", "cpu", "--models", "smollm2", "--num-prompts", "4",
                 "--input-len", "32", "--output-len", "4", "--max-concurrency", "4", "--backends", "grpc",
                 "--skip-engine", "--prefills", "1", "--set", "tokenizer.count=1",
                 "--sampled", "temperature=1,top_p=0.9",
                 "--set", "router.prefill_threshold_tokens=1", "--result-file", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    res = json.loads(out.read_text())
    assert res["models"]["smollm2"]["served_processes"] == {"decode": 1, "gateway": 1, "prefill": 1, "router": 1,
                                                            "tokenizer": 1}
    lim = res["models"]["smollm2"]["limit"]
    assert len(res["rows"]) == 2
    for r in res["rows"]:
        assert (r["summary"]["completed"], r["summary"]["failed"]) == (4, 0), r
        whole, dec = r["server"], r["decode_workers"]
        assert whole["engine_steps"] > dec["engine_steps"] > 0  # the prefill worker stepped too
        assert dec["engine_step_prompt_tokens"] == 0 and whole["engine_step_prompt_tokens"] >= 4 * 32
        assert r["decode_rows_per_step"] == pytest.approx(dec["engine_step_decode_rows"] / dec["engine_steps"])
        assert 0 < r["decode_rows_per_step"] <= 4
        assert r["limit_at_rows_ms"] == pytest.approx(limit_at_rows(lim, r["decode_rows_per_step"]))
        assert r["tpot_p50_vs_limit_at_rows"] == pytest.approx(r["tpot_p50_ms"] / r["limit_at_rows_ms"])
        # the decode worker's work between steps: its pulls ticked, its outputs and counters sent on
        assert dec["engine_loop_tick"] > 0 and dec["engine_loop_after"] > 0 and dec["engine_loop_outputs"] > 0
    assert "1 prefill worker(s) + 1 decode worker" in text and "÷ limit at its rows" in text
    # ``--sampled``: the sampled runs sent temperature 1 and top_p 0.9 alone
    assert res["samplings"] == {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0, "top_p": 0.9}}
    assert "sampled = {'temperature': 1.0, 'top_p': 0.9}" in text
    assert "The engine thread's work between steps" in text


def test_the_limit_at_fewer_rows_reads_their_kv_only():
    lim = {"weight_bytes": 100.0, "kv_bytes": 64.0, "batch": 64, "bandwidth_Bps": 1e3}
    assert limit_at_rows(lim, 64) == pytest.approx(164.0)
    assert limit_at_rows(lim, 16) == pytest.approx(116.0)


def test_a_served_layout_that_cannot_start_is_refused_before_anything_runs(tmp_path, capsys):
    """The served cluster's layout is checked first, by ``tokenmill up --dry-run`` with the same arguments: one line
    naming the problem, exit 2, nothing measured (no result file; the engine-alone half takes minutes a model)."""
    out = tmp_path / "r.json"
    code = main(["bench", "gpu-serving", "--device", "cpu", "--models", "smollm2", "--backends", "grpc",
                 "--set", "decode.gpus=1", "--result-file", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert "smollm2: the served cluster cannot start" in err and "decode.gpus is set (1)" in err, err
    assert not out.exists()
