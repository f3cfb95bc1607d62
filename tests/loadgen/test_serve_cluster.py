"""``tokenmill bench serve`` against a running cluster (``tokenmill up``: real processes, gRPC and HTTP): the JSON
with every record, the PNGs, exact lengths, server-side deltas, errors at the top, and ``bench compare``."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.cli import main
from tests.services.harness import running_cluster

MAX_LEN = 1024
PNG = b"\x89PNG\r\n\x1a\n"
KEYS = "alice:sk-alice,bob:sk-bob,sk-default"  # both front doors want a key; a key names its tenant
KEY = ("--api-key", "sk-default")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("cluster"), "--tokenizers", "1", "--prefills", "1", "--decodes",
                         "1", "--set", f"engine.max_model_len={MAX_LEN}", "--set", "engine.kv_cache_memory=64MiB",
                         "--set", f"gateway.api_keys={KEYS}", "--grace", "2", timeout=180) as info:
        yield {"grpc": info["gateway"], "http": info["http"], "state": info["state"]}


def bench(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["bench", *args])
    return code, capsys.readouterr().out


def _in_flight_max(recs: list[dict]) -> int:
    ev = sorted([(r["start"], 1) for r in recs] + [(r["start"] + r["end"], -1) for r in recs])
    n = top = 0
    for _, d in ev:
        n += d
        top = max(top, n)
    return top


def test_grpc_sweep_writes_json_and_plots_with_exact_lengths(cluster, capsys, tmp_path):
    out = tmp_path / "a.json"
    code, text = bench(capsys, "serve", "--backend", "grpc", "--base-url", cluster["grpc"], *KEY,
                       "--num-prompts", "4",
                       "--max-concurrency", "1", "3", "--random-input-len", "300", "--random-output-len", "5",
                       "--ignore-eos", "--goodput", "ttft:60000", "tpot:60000", "--cluster-state", cluster["state"],
                       "--metrics-interval", "0.05",
                       "--result-file", str(out), "--disable-tqdm", "--fail-on-error")
    assert code == 0, text
    res = json.loads(out.read_text())
    assert res["backend"] == "grpc" and len(res["runs"]) == 2
    for run, conc in zip(res["runs"], (1, 3)):
        s, recs = run["summary"], run["records"]
        assert run["load"]["max_concurrency"] == conc and run["label"] == f"concurrency {conc}"
        assert (s["requests"], s["completed"], s["failed"], s["errors"]) == (4, 4, 0, {})
        assert [r["warmup"] for r in recs] == [True] + [False] * 4  # --num-warmups 1, kept in the JSON, flagged
        for r in recs:
            assert r["outcome"] == "ok" and r["prompt_tokens"] == r["input_len"] == 300
            assert r["output_tokens"] == r["output_len"] == 5 and len(r["chunk_times"]) >= 1
            assert 0 < r["ttft"] <= r["e2e"]
        assert _in_flight_max([r for r in recs if not r["warmup"]]) <= conc  # closed loop: the cap holds
        assert s["output_tokens"] == 20 and s["output_throughput"] == pytest.approx(20 / s["duration_s"])
        assert s["slo_attainment"] == 1.0 and s["goodput"] == pytest.approx(s["request_throughput"])
        assert s["client_cpu_s"] > 0 and 0 < s["client_cpu_share"] < 0.5  # the client leaves the CPU to the server
        srv = run["server"]
        assert srv["read"] == srv["endpoints"] == 5
        # 300-token prompts are over router.prefill_threshold_tokens: prefilled remotely, KV pulled over NIXL
        assert srv["nixl_bytes"] > 0 and 0 <= srv["kv_usage_peak"] <= 1 and srv["prefix_cache_queries"] >= 4 * 300
        # the server's own view (gateway histograms): its TTFT is below the client's, by the client's and the
        # network's share (its e2e ends at the end of the stream, the client's at the last token: no order there)
        assert 0 < srv["ttft_mean_ms"] <= s["ttft_ms"]["mean"] and srv["e2e_mean_ms"] > 0
    assert _in_flight_max([r for r in res["runs"][1]["records"] if not r["warmup"]]) >= 2
    # KV usage is a gauge, polled: a sweep point of a few short requests may fall between two polls, the sweep not
    assert max(run["server"]["kv_usage_peak"] for run in res["runs"]) > 0
    # every sweep point (and its warm-up) draws fresh prompts: none is served from an earlier one's cache
    assert [run["server"]["prefix_cache_hits"] for run in res["runs"]] == [0, 0]
    for suffix in ("_cdf", "_latency", "_throughput", "_goodput"):
        png = tmp_path / f"a{suffix}.png"
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000, suffix
    assert "==== sweep ====" in text and "concurrency 3" in text and "FAILED" not in text


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_several_client_processes_share_the_load_on_one_clock(cluster, capsys, tmp_path, backend):
    out = tmp_path / "p.json"
    url = cluster["grpc"] if backend == "grpc" else cluster["http"]
    code, text = bench(capsys, "serve", "--backend", backend, "--base-url", url, *KEY, "--num-prompts", "7",
                       "--max-concurrency", "4", "--client-processes", "3", "--random-input-len", "40",
                       "--random-output-len", "5", "--ignore-eos", "--num-warmups", "0", "--result-file", str(out),
                       "--disable-tqdm", "--fail-on-error")
    assert code == 0, text
    [run] = json.loads(out.read_text())["runs"]
    s, recs = run["summary"], run["records"]
    assert (s["requests"], s["completed"], s["failed"]) == (7, 7, 0) and s["client_processes"] == 3
    assert sorted(r["index"] for r in recs) == list(range(7))  # every request once, from one process or another
    assert [r["start"] for r in recs] == sorted(r["start"] for r in recs) and recs[0]["start"] >= 0
    assert all(r["output_tokens"] == 5 for r in recs)
    assert _in_flight_max(recs) <= 4  # the cap, split 2 + 1 + 1, holds across the processes
    assert s["client_cpu_s"] > 0 and 0 < s["client_cpu_share"] < 1
    assert "busiest of 3 processes" in text


def test_split_load_deals_out_the_rate_and_the_cap():
    from loadgen.runner import LoadConfig, split_load

    parts = split_load(LoadConfig(request_rate=9.0, max_concurrency=10, num_requests=20), [7, 7, 6])
    assert [p.max_concurrency for p in parts] == [4, 3, 3] and [p.num_requests for p in parts] == [7, 7, 6]
    assert all(p.request_rate == 3.0 for p in parts) and len({p.seed for p in parts}) == 3
    with pytest.raises(ValueError, match="at least 3"):
        split_load(LoadConfig(max_concurrency=2, num_requests=4), [2, 1, 1])


def test_http_chat_open_loop_tenants_and_shared_prefix(cluster, capsys, tmp_path):
    out = tmp_path / "b.json"
    code, text = bench(capsys, "serve", "--backend", "openai-chat", "--base-url", cluster["http"] + "/v1",
                       "--dataset", "shared-prefix", "--prefix-groups", "1", "--prefix-len", "96",
                       "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos", "--chat-length",
                       "total", "--tenant", "alice:rate=2,priority=0,key=sk-alice",
                       "--tenant", "bob:rate=2,priority=10,key=sk-bob",
                       "--num-prompts", "8", "--seed", "3", "--cluster-state", cluster["state"],
                       "--result-file", str(out), "--disable-tqdm")
    assert code == 0, text
    res = json.loads(out.read_text())
    run = res["runs"][0]
    s, recs = run["summary"], [r for r in run["records"] if not r["warmup"]]
    assert res["model"] == "smollm2" and run["load"]["request_rate"] == 4.0  # the sum of the tenants' rates
    assert s["completed"] == 8 and s["failed"] == 0
    for r in recs:  # the whole chat prompt, template included, is exactly the asked length
        assert r["prompt_tokens"] == r["input_len"] == 96 + 8 + 30 and r["output_tokens"] == 4
        assert r["start"] >= r["scheduled"] - 0.01  # open loop: nothing is sent before it is due
    assert {r["tenant"] for r in recs} == {"alice", "bob"} and set(s["by_tenant"]) == {"alice", "bob"}
    assert {r["priority"] for r in recs if r["tenant"] == "bob"} == {10}
    assert run["server"]["prefix_cache_hit_rate"] > 0.3  # one group: the 96-token prefix is reused
    assert "tenant alice:" in text and "prefix-cache hit rate" in text
    # each worker's engine a step: rows, host phases, the work between steps
    engine = [line for line in text.splitlines() if ": engine " in line and "ms a step" in line]
    assert engine and all("schedule" in line and "between steps: commands" in line and "on a CPU" in line
                          for line in engine)

    # compare the gRPC sweep's first point with this run: a table of ratios
    a = tmp_path / "one.json"
    code, _ = bench(capsys, "serve", "--backend", "openai", "--base-url", cluster["http"], "--num-prompts", "2",
                    "--api-key", "sk-default",
                    "--random-input-len", "20", "--random-output-len", "3", "--ignore-eos", "--num-warmups", "0",
                    "--result-file", str(a), "--disable-tqdm", "--no-plots")
    assert code == 0
    ra = json.loads(a.read_text())["runs"][0]
    assert [r["prompt_tokens"] for r in ra["records"]] == [20, 20] and ra["summary"]["output_tokens"] == 6
    code, cmp = bench(capsys, "compare", str(a), str(out))
    assert code == 0 and "B/A" in cmp and "request throughput req/s" in cmp


@pytest.mark.parametrize("backend", ["grpc", "openai", "openai-no-key"])
def test_errors_are_counted_by_kind_and_shown_first(cluster, capsys, tmp_path, backend):
    url = cluster["grpc"] if backend == "grpc" else cluster["http"]
    key = [] if backend == "openai-no-key" else ["--api-key", "sk-default"]
    out = tmp_path / "e.json"
    code, text = bench(capsys, "serve", "--backend", backend.removesuffix("-no-key"), "--base-url", url, *key,
                       "--model", "smollm2", "--num-prompts", "3", "--random-input-len", str(MAX_LEN + 10),
                       "--random-output-len", "4", "--num-warmups", "0", "--result-file", str(out), "--no-plots",
                       "--disable-tqdm", "--fail-on-error")
    kind, why = {"grpc": ("INVALID_ARGUMENT", str(MAX_LEN)), "openai": ("HTTP 400", str(MAX_LEN)),
                 "openai-no-key": ("HTTP 401", "missing API key")}[backend]
    s = json.loads(out.read_text())["runs"][0]["summary"]
    assert code == 1 and s["errors"] == {kind: 3} and s["completed"] == 0
    lines = text.splitlines()
    assert lines[1] == f"!! 3 of 3 requests FAILED: {kind} ×3" and why in lines[2]


def _running_requests(metrics_url: str) -> float:
    import urllib.request

    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:  # a slow scrape on a loaded machine: ask again
        return 0.0
    return sum(float(ln.split()[1]) for ln in text.splitlines()
               if ln.startswith("tokenmill:num_requests_running "))


def test_ctrl_c_keeps_what_was_measured(cluster, tmp_path):
    """Ctrl-C on the command, as a user presses it in a terminal: the command in a process of its own gets SIGINT
    once requests run, and must exit 130 with what it measured saved.

    The child starts with SIGINT at its default, as a terminal's foreground job does. A child inherits an ignored
    SIGINT, and then neither Python nor asyncio installs a handler: in the full CI run the command once ran all its
    200 requests through the signal and exited 0 (so did the in-process version of this test before, twice, never
    alone), which fits the pytest process ignoring SIGINT by then; the message below says what it had."""
    import subprocess
    import sys

    parent_sigint = signal.getsignal(signal.SIGINT)
    deadline = time.monotonic() + 60
    while _running_requests(cluster["http"] + "/metrics") > 0:  # an earlier test's would pass for the command's
        assert time.monotonic() < deadline, "requests of an earlier test are still running"
        time.sleep(0.1)
    out = tmp_path / "i.json"
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "bench", "serve", "--base-url", cluster["grpc"], *KEY,
                             "--num-prompts", "200", "--request-rate", "20", "--random-input-len", "16",
                             "--random-output-len", "64", "--ignore-eos", "--num-warmups", "0", "--result-file",
                             str(out), "--no-plots", "--disable-tqdm"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while _running_requests(cluster["http"] + "/metrics") <= 0:
        assert proc.poll() is None and time.monotonic() < deadline, "no request was seen running"
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    text, err = proc.communicate(timeout=120)
    res = json.loads(out.read_text())
    run = res["runs"][0]
    s = run["summary"]
    assert proc.returncode == 130 and res["interrupted"] and run["interrupted"], (parent_sigint, err[-2000:])
    assert 5 < s["requests"] < 200 and s["errors"].get("cancelled", 0) >= 1
    assert {r["outcome"] for r in run["records"]} <= {"ok", "cancelled"}
    assert "!! INTERRUPTED" in text.splitlines()[1]


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_duration_runs_stop_sending_in_time_and_warmup_seconds_are_left_out(cluster, capsys, tmp_path, mode):
    out = tmp_path / "d.json"
    load = ["--max-concurrency", "2"] if mode == "closed" else ["--request-rate", "6", "--warmup-seconds", "0.5"]
    code, text = bench(capsys, "serve", "--base-url", cluster["grpc"], *KEY,
                       "--duration", "1.5", *load,
                       "--random-input-len", "8", "--random-output-len", "3", "--ignore-eos", "--num-warmups", "0",
                       "--result-file", str(out), "--no-plots", "--disable-tqdm")
    assert code == 0, text
    run = json.loads(out.read_text())["runs"][0]
    recs, s = run["records"], run["summary"]
    assert run["load"]["duration_s"] == 1.5 and all(r["outcome"] == "ok" for r in recs)
    assert max(r["scheduled"] for r in recs) < 1.5 and max(r["start"] for r in recs) < 2.0
    if mode == "closed":
        assert _in_flight_max(recs) <= 2 and len(recs) >= 2 and not any(r["warmup"] for r in recs)
    else:
        warm = [r for r in recs if r["warmup"]]
        assert all(r["scheduled"] < 0.5 for r in warm) and all(r["scheduled"] >= 0.5 for r in recs if not r["warmup"])
        assert warm and s["requests"] == len(recs) - len(warm)


def test_token_id_prompts_for_models_without_a_tokenizer(cluster, capsys, tmp_path):
    out = tmp_path / "ids.json"
    code, text = bench(capsys, "serve", "--base-url", cluster["grpc"], *KEY,
                       "--tokenizer", "ids:49152", "--num-prompts",
                       "2", "--random-input-len", "30", "--random-output-len", "2", "--ignore-eos", "--num-warmups",
                       "0", "--result-file", str(out), "--no-plots", "--disable-tqdm", "--fail-on-error")
    assert code == 0, text
    recs = json.loads(out.read_text())["runs"][0]["records"]
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in recs] == [(30, 2), (30, 2)]
    code = main(["bench", "serve", "--backend", "openai", "--base-url", cluster["http"], "--tokenizer", "ids:100"])
    assert code == 2 and "use --backend grpc" in capsys.readouterr().err


def test_a_rerun_of_one_seed_hits_the_prefix_cache_unless_salted(cluster, capsys, tmp_path):
    hits = []
    for i, salt in enumerate(([], [], ["--cache-salt", "auto"])):
        out = tmp_path / f"s{i}.json"
        code, text = bench(capsys, "serve", "--base-url", cluster["grpc"], *KEY,
                           "--num-prompts", "2", "--seed", "77",
                           "--random-input-len", "64", "--random-output-len", "2", "--ignore-eos", "--num-warmups",
                           "0", "--cluster-state", cluster["state"], "--result-file", str(out), "--no-plots",
                           "--disable-tqdm", *salt)
        assert code == 0, text
        hits.append(json.loads(out.read_text())["runs"][0]["server"]["prefix_cache_hits"])
    assert hits[0] == 0 and hits[1] >= 48 and hits[2] == 0  # 3 full blocks of a 64-token prompt, or more


@pytest.fixture
def generated(monkeypatch):
    """What each request of a ``bench serve`` run in this process generated, filled as the streams arrive: gRPC
    token ids keyed by the prompt's ids, HTTP text keyed by the request's index (the records keep neither)."""
    from tokenmill.v1 import frontend_pb2_grpc

    from loadgen.clients import OpenAITarget

    out: dict[Any, Any] = {}
    stub_cls, on_data = frontend_pb2_grpc.FrontendStub, OpenAITarget.on_data

    class Call:
        def __init__(self, call: Any, ids: list[int]) -> None:
            self.call, self.ids = call, ids

        async def _each(self) -> AsyncIterator[Any]:
            async for r in self.call:
                self.ids.extend(r.token_ids)
                yield r

        def __aiter__(self) -> AsyncIterator[Any]:
            return self._each()

        def cancel(self) -> bool:
            return self.call.cancel()

    class Stub:
        def __init__(self, channel: Any) -> None:
            self.stub = stub_cls(channel)

        def Generate(self, req: Any, **kw: Any) -> Call:
            return Call(self.stub.Generate(req, **kw), out.setdefault(tuple(req.prompt_token_ids.ids), []))

    def record_text(self: OpenAITarget, data: str, rec: Any, now: float) -> bool:
        if data.strip() != "[DONE]":
            for c in json.loads(data).get("choices") or []:
                out[rec.index] = out.get(rec.index, "") + ((c.get("delta") or {}).get("content") or c.get("text")
                                                           or "")
        return on_data(self, data, rec, now)

    monkeypatch.setattr(frontend_pb2_grpc, "FrontendStub", Stub)
    monkeypatch.setattr(OpenAITarget, "on_data", record_text)
    return out


@pytest.mark.parametrize("backend", ["grpc", "openai", "openai-chat"])
def test_sampling_options_reach_the_server(cluster, capsys, tmp_path, generated, backend):
    """``--top-k 1 --temperature 1`` generates what greedy generates (top-k 1 is greedy), where ``--temperature 1``
    alone does not: top_k travels on every backend. One request at a time and a fresh cache salt per run, so the
    three runs compute alike; the same seed, so they send the same prompts."""
    url = cluster["grpc"] if backend == "grpc" else cluster["http"]
    runs = {}
    for name, sampling in (("greedy", ["--temperature", "0"]), ("top-k 1", ["--temperature", "1", "--top-k", "1"]),
                           ("sampled", ["--temperature", "1"])):
        out = tmp_path / f"{name}.json"
        generated.clear()
        code, text = bench(capsys, "serve", "--backend", backend, "--base-url", url, "--api-key", "sk-default",
                           "--num-prompts", "3", "--max-concurrency", "1", "--seed", "5", "--random-input-len", "16",
                           "--random-output-len", "12", "--ignore-eos", "--num-warmups", "0", "--cache-salt", "auto",
                           *sampling, "--no-server-metrics", "--result-file", str(out), "--no-plots",
                           "--disable-tqdm", "--fail-on-error")
        assert code == 0, text
        runs[name] = dict(generated)
        assert len(runs[name]) == 3 and all(runs[name].values()), runs[name]
        cfg = json.loads(out.read_text())["config"]
        assert (cfg["temperature"], cfg["top_k"], cfg["top_p"]) == (float(sampling[1]), 1 if "--top-k" in sampling
                                                                    else None, None)
    assert runs["top-k 1"] == runs["greedy"]
    assert runs["sampled"] != runs["greedy"]


@pytest.mark.parametrize("backend", ["grpc", "openai-chat"])
def test_structured_outputs_are_sent_and_every_output_checked(cluster, capsys, tmp_path, backend):
    """``--structured schemas`` sends each constrained request one of the five schemas (response_format on HTTP,
    SamplingParams.structured on gRPC), keeps its text and checks it: every output validates. With
    ``--structured-ratio`` some requests go unconstrained and are not checked; the prompts are the same."""
    url = cluster["grpc"] if backend == "grpc" else cluster["http"]
    runs = {}
    for ratio in ("1", "0.5"):
        out = tmp_path / f"r{ratio}.json"
        code, text = bench(capsys, "serve", "--backend", backend, "--base-url", url, *KEY, "--num-prompts", "5",
                           "--max-concurrency", "5", "--seed", "3", "--random-input-len", "16",
                           "--random-output-len", "400", "--temperature", "0", "--structured", "schemas",
                           "--structured-ratio", ratio, "--num-warmups", "0", "--no-server-metrics",
                           "--result-file", str(out), "--no-plots", "--disable-tqdm", "--fail-on-error")
        assert code == 0, text
        run = json.loads(out.read_text())["runs"][0]
        runs[ratio] = run
        checked = [r for r in run["records"] if r["structured_valid"] is not None]
        st = run["summary"]["structured"]
        assert st["requests"] == len(checked) and st["valid"] == st["requests"], [r["text"] for r in checked]
        assert all(json.loads(r["text"]) for r in checked)
        assert f"{st['valid']} of {st['requests']} valid (100.0 %)" in text
    assert runs["1"]["summary"]["structured"]["requests"] == 5
    free = [r for r in runs["0.5"]["records"] if r["structured_valid"] is None]
    assert 0 < len(free) < 5 and all(r["text"] is None for r in free)


def test_a_json_schema_file_constrains_every_request(cluster, capsys, tmp_path):
    schema = tmp_path / "point.json"
    coord = {"type": "integer", "minimum": -999, "maximum": 999}  # bounded: sampled digits cannot run past max tokens
    schema.write_text(json.dumps({"type": "object", "properties": {"x": coord, "y": coord}, "required": ["x", "y"],
                                  "additionalProperties": False}))
    out = tmp_path / "p.json"
    code, text = bench(capsys, "serve", "--backend", "openai", "--base-url", cluster["http"], *KEY, "--num-prompts",
                       "3", "--max-concurrency", "3", "--random-input-len", "16", "--random-output-len", "64",
                       "--temperature", "1", "--json-schema", str(schema), "--num-warmups", "0",
                       "--no-server-metrics", "--result-file", str(out), "--no-plots", "--disable-tqdm",
                       "--fail-on-error")
    assert code == 0, text
    recs = json.loads(out.read_text())["runs"][0]["records"]
    assert len(recs) == 3 and all(r["structured_valid"] for r in recs), [r["text"] for r in recs]
    assert all(set(json.loads(r["text"])) == {"x", "y"} for r in recs)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    capsys.readouterr()
    code = main(["bench", "serve", "--backend", "openai", "--base-url", cluster["http"], *KEY, "--json-schema",
                 str(bad), "--num-prompts", "1", "--disable-tqdm"])
    assert code == 2 and "a JSON Schema is a JSON object" in capsys.readouterr().err
