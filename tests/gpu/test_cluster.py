"""The served cluster on CUDA, as a user starts it (``tokenmill up``: real processes, real gRPC, KV over NIXL),
SmolLM2 in float32.

Aggregated (no prefill worker: the decode worker prefills): greedy output equals transformers' token for token;
sampled requests complete with the asked number of tokens; a seed reproduces its tokens, also inside a concurrent
batch of unseeded requests, and different seeds differ; cancelled streams give back every KV block. Last, with the
aggregated cluster stopped: one prefill and one decode worker sharing GPU 0 (remote prefill, KV pulled over NIXL)
give the aggregated cluster's greedy output.
"""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from tokenmill.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

from tests.gpu.helpers import (
    GPU_ENGINE_ARGS,
    SAMPLED,
    GpuCluster,
    cuda_visible_devices,
    first_diff,
    generate_all,
    ids_request,
    post_json,
)
from tests.prompts import CHAT, PLAIN

pytestmark = pytest.mark.gpu

N = 32  # greedy tokens compared per prompt (hf_reference holds 64; EOS masked for all of them)
PICK = [0, 2, 5, 9, 12, 14, 17, 19]  # of the twenty reference prompts: chat and plain, short and long
STORY = "Once upon a time, in a small village by the sea,"

# one aggregated worker on one GPU, on a machine with any number of them (without decode.count a decode worker
# would start on every GPU: tests/gpu/test_two_gpus.py covers that layout)
AGGREGATED = (*GPU_ENGINE_ARGS, "--set", "prefill.count=0", "--set", "decode.count=1",
              "--set", "engine.kv_cache_memory=2GiB", "--set", "engine.gpu_memory_utilization=0.3")
# 1 prefill + 1 decode, both on GPU 0 (a one-device list: "cuda:0"; a bare "0" would be a GPU count): the launcher
# splits gpu_memory_utilization between them; prompts above the threshold are prefilled remotely and their KV
# pulled over NIXL
UTILIZATION = 0.3
SHARED_GPU = (*GPU_ENGINE_ARGS, "--set", "prefill.count=1", "--set", "decode.count=1", "--set", "prefill.gpus=cuda:0",
              "--set", "decode.gpus=cuda:0", "--set", f"engine.gpu_memory_utilization={UTILIZATION}",
              "--set", "router.prefill_threshold_tokens=128")


@pytest.fixture(scope="module")
def agg(tmp_path_factory):
    c = GpuCluster(tmp_path_factory.mktemp("aggregated"), *AGGREGATED)
    yield c
    c.stop()


def _greedy(ids, n=N, **kw):
    return ids_request(ids, temperature=0, max_tokens=n, min_tokens=n, **kw)


def test_greedy_equals_transformers(agg, gpu_prompts, hf_reference):
    reqs = [_greedy(gpu_prompts[i]) for i in PICK]
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=CHAT[0])],
                                      add_generation_prompt=True)
    # the same first prompt as text through the tokenizer pool's chat template: the same ids, the same output
    reqs.append(frontend_pb2.GenerateRequest(chat=chat, params=common_pb2.SamplingParams(
        temperature=0, max_tokens=N, min_tokens=N)))
    outs = generate_all(agg.gateway, reqs)
    for i, (_text, toks, last) in zip([*PICK, 0], outs):
        ref = hf_reference[i][:N]
        assert toks == ref, (f"prompt {i}: the served greedy tokens diverge from transformers' at token "
                             f"{first_diff(toks, ref)}:\n served {toks}\n ref    {ref}")
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH, last
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(gpu_prompts[i]), N), last.usage
    # the OpenAI HTTP API on the same pools: the same text
    r = post_json(agg.http + "/v1/completions", {"model": "smollm2", "prompt": gpu_prompts[PICK[-1]],
                                                  "temperature": 0, "max_tokens": N, "min_tokens": N})
    assert r["choices"][0]["text"] == outs[len(PICK) - 1][0], r
    assert r["usage"]["completion_tokens"] == N, r
    r = post_json(agg.http + "/v1/chat/completions", {"model": "smollm2", "temperature": 0, "max_tokens": N,
                                                       "min_tokens": N,
                                                       "messages": [{"role": "user", "content": CHAT[0]}]})
    assert r["choices"][0]["message"]["content"] == outs[-1][0], r


def test_sampled_requests_complete(agg, gpu_prompts, source):
    story = source.tokenizer.encode(STORY)
    reqs = [ids_request(gpu_prompts[i % len(gpu_prompts)], max_tokens=24, ignore_eos=True, **SAMPLED)
            for i in range(24)]
    reqs += [ids_request(story, max_tokens=24, ignore_eos=True, **SAMPLED) for _ in range(6)]
    outs = generate_all(agg.gateway, reqs)
    for i, (_text, toks, last) in enumerate(outs):
        assert len(toks) == 24, f"request {i}: {len(toks)} tokens, asked for 24"
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH, f"request {i}: {last}"
        assert last.usage.completion_tokens == 24, f"request {i}: {last.usage}"
    repeats = {tuple(toks) for _t, toks, _l in outs[24:]}
    assert len(repeats) > 1, "six unseeded sampled requests of one prompt gave the same tokens: no fresh noise"


def test_seeds_reproduce(agg, source):
    story = source.tokenizer.encode(STORY)

    def seeded(seed):
        return ids_request(story, max_tokens=32, ignore_eos=True, seed=seed, **SAMPLED)

    [(text, first, _)] = generate_all(agg.gateway, [seeded(7)])
    [(_, again, _)] = generate_all(agg.gateway, [seeded(7)])
    assert again == first, f"seed 7 twice, alone: differs at token {first_diff(again, first)}"
    # inside a concurrent batch of unseeded requests (some of the same prompt), twice in one batch
    batch = [ids_request(story if i % 2 else source.tokenizer.encode(PLAIN[i % len(PLAIN)]), max_tokens=40,
                         ignore_eos=True, **SAMPLED) for i in range(16)]
    batch[5] = batch[12] = seeded(7)
    outs = generate_all(agg.gateway, batch)
    for i in (5, 12):
        assert outs[i][1] == first, f"seed 7 in a batch (row {i}): differs at token {first_diff(outs[i][1], first)}"
    others = generate_all(agg.gateway, [seeded(s) for s in (8, 9, 10)])
    outputs = [tuple(first)] + [tuple(toks) for _t, toks, _l in others]
    assert len(set(outputs)) == 4, f"seeds 7, 8, 9, 10 should give four different outputs: {outputs}"
    # the OpenAI API's seed is the same seed
    r = post_json(agg.http + "/v1/completions", {"model": "smollm2", "prompt": story, "max_tokens": 32,
                                                  "ignore_eos": True, "seed": 7, "temperature": 1.0, "top_p": 0.9,
                                                  "top_k": 50, "repetition_penalty": 1.1})
    assert r["choices"][0]["text"] == text, r


def test_cancel_returns_kv_blocks(agg, gpu_prompts):
    agg.wait_all_blocks_free(timeout=20)  # the baseline: nothing held
    [(free0, total)] = agg.kv_blocks("decode")
    gen0 = agg.role_metric("decode", "tokenmill:generation_tokens_total")
    max_tokens = 7000  # ~20 s of decoding: the blocks must come back long before the streams could have ended
    reqs = [ids_request(gpu_prompts[i], max_tokens=max_tokens, ignore_eos=True,
                        **({"temperature": 0} if i % 2 else SAMPLED)) for i in (3, 8, 13, 19)]

    async def start_then_cancel():
        async with grpc.aio.insecure_channel(agg.gateway) as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            calls = [stub.Generate(r) for r in reqs]
            for c in calls:  # every stream is decoding
                for _ in range(3):
                    msg = await c.read()
                    assert msg is not grpc.aio.EOF, "a stream ended after fewer than 3 messages"
            in_use = await asyncio.to_thread(agg.kv_blocks, "decode")
            for c in calls:
                c.cancel()
            return in_use

    [(free_mid, _)] = asyncio.run(start_then_cancel())
    assert free_mid < free0, f"4 streams running but the decode worker reports {free_mid}/{total} blocks free"
    agg.wait_all_blocks_free(timeout=10)
    generated = agg.role_metric("decode", "tokenmill:generation_tokens_total") - gen0
    assert generated < 2 * max_tokens, (f"{generated:.0f} tokens generated after cancelling 4 streams of "
                                        f"{max_tokens}: the cancelled sequences kept decoding")
    assert agg.role_metric("decode", "tokenmill:num_requests_running") == 0
    # the worker serves on
    [(_t, toks, _l)] = generate_all(agg.gateway, [_greedy(gpu_prompts[0], n=8)])
    assert len(toks) == 8


# -- prefill and decode sharing one GPU -------------------------------------------------------------------------
def _long_prompts(tok) -> list[list[int]]:
    """Three distinct prompts of 300+ tokens: above the shared-GPU cluster's prefill threshold."""
    out = []
    for i in range(3):
        text = " ".join(PLAIN[i:] + PLAIN[:i])
        ids = tok.encode(" ".join([text] * 8))
        assert len(ids) > 300, len(ids)
        out.append(ids)
    return out


@pytest.fixture(scope="module")
def aggregated_long(agg, source) -> tuple[list[list[int]], list[list[int]]]:
    """The long prompts and their greedy outputs from the aggregated cluster, one request at a time (so both
    clusters run exactly the same shapes)."""
    prompts = _long_prompts(source.tokenizer)
    outs = [generate_all(agg.gateway, [_greedy(p)])[0][1] for p in prompts]
    assert all(len(o) == N for o in outs), [len(o) for o in outs]
    return prompts, outs


@pytest.fixture(scope="module")
def shared_gpu(agg, aggregated_long, tmp_path_factory):
    agg.stop()  # one cluster on the GPU at a time
    c = GpuCluster(tmp_path_factory.mktemp("shared-gpu"), *SHARED_GPU)
    yield c
    c.stop()


def test_prefill_and_decode_sharing_one_gpu_equal_aggregated(shared_gpu, aggregated_long):
    """Runs last in this module: it stops the aggregated cluster."""
    [pre] = shared_gpu.procs("prefill")
    [dec] = shared_gpu.procs("decode")
    gpu0 = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()  # GPU 0 as this process names it
    for p in (pre, dec):
        assert cuda_visible_devices(p["pid"]) == gpu0, (
            f"{p['name']} was started with CUDA_VISIBLE_DEVICES={cuda_visible_devices(p['pid'])!r}; "
            f"prefill.gpus=cuda:0 and decode.gpus=cuda:0 should give both GPU {gpu0}")
        assert p.get("gpu_memory_utilization") == pytest.approx(UTILIZATION / 2, abs=1e-3), (
            f"{p['name']}: gpu_memory_utilization {p.get('gpu_memory_utilization')} in the state file; two workers "
            f"sharing a GPU should get half of {UTILIZATION} each")
    prompts, expected = aggregated_long
    nixl0 = shared_gpu.metric(dec, "tokenmill:nixl_xfer_bytes")
    prefilled0 = shared_gpu.metric(pre, "tokenmill:prompt_tokens_total")
    for i, (p, exp) in enumerate(zip(prompts, expected)):
        [(_t, toks, last)] = generate_all(shared_gpu.gateway, [_greedy(p)])
        assert toks == exp, (f"long prompt {i} ({len(p)} tokens): the shared-GPU P/D output diverges from the "
                             f"aggregated one at token {first_diff(toks, exp)}:\n P/D {toks}\n agg {exp}")
        assert last.usage.prompt_tokens == len(p)
    prefilled = shared_gpu.metric(pre, "tokenmill:prompt_tokens_total") - prefilled0
    assert prefilled >= sum(map(len, prompts)), (
        f"the prefill worker took {prefilled:.0f} prompt tokens of {sum(map(len, prompts))}: not every long "
        f"prompt went through remote prefill")
    moved = shared_gpu.metric(dec, "tokenmill:nixl_xfer_bytes") - nixl0
    assert moved > 0, "no KV bytes moved over NIXL to the decode worker"
    shared_gpu.wait_all_blocks_free(("decode", "prefill"), timeout=20)
