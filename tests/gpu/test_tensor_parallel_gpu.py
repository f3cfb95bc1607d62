"""Tensor parallelism on two GPUs: a dummy Llama-3.1-8B (seeded random weights) in float32, TP=2 (NCCL, all-reduces
inside the captured graphs, the prompts' step among them) against TP=1 on one GPU.

The TP=1 run comes first and is freed before the TP=2 engine starts (32 GB of float32 weights on cuda:0)."""

from __future__ import annotations

import gc

import pytest
import torch

from common.config import EngineConfig
from common.engine import LLMEngine
from common.loader import load_model_source
from tests.test_tensor_parallel import GREEDY, step_logits

pytestmark = [pytest.mark.gpu2, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

# float32 logits (|logit| up to ~6 here) after 32 layers whose row-parallel matmuls sum in another order
LOGIT_TOL = 1e-3
LOGIT_STEPS = 8


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 60, 128, 301)]


def engine(tp: int) -> LLMEngine:
    torch.backends.cuda.matmul.allow_tf32 = False  # full float32 matmuls (the other ranks keep torch's default: off)
    cfg = EngineConfig(device="cuda", dtype="float32", tensor_parallel_size=tp, kv_cache_memory=4 << 30,
                       max_num_seqs=8, max_model_len=2048, seed=0)
    return LLMEngine(load_model_source("dummy:llama-3.1-8b"), cfg)


def run(eng: LLMEngine, ps: list[list[int]]) -> dict:
    logits = step_logits(eng, ps, LOGIT_STEPS)
    g = eng.runner.graphs
    replays, prompt_replays = (g.replays, g.prompt_replays) if g is not None else (0, 0)
    return {"logits": [x.cpu() for x in logits], "score": eng.runner.score(ps[:2]),
            "tokens": [r.token_ids for r in eng.generate(ps, GREEDY)], "replays": replays,
            "prompt_replays": prompt_replays}


@pytest.fixture(scope="module")
def results() -> dict[int, dict]:
    out = {}
    for tp in (1, 2):
        eng = engine(tp)
        try:
            out[tp] = run(eng, prompts(eng.model_cfg.vocab_size))
        finally:
            eng.close()
            del eng
            gc.collect()
            torch.cuda.empty_cache()
    return out


def test_tp2_logits_equal_tp1_on_two_gpus(results):
    one, two = results[1], results[2]
    assert len(one["logits"]) == len(two["logits"]) == LOGIT_STEPS
    diffs = [float((a - b).abs().max()) for a, b in zip(one["logits"], two["logits"])]
    diffs += [float((a - b).abs().max()) for a, b in zip(one["score"], two["score"])]
    print("max |TP=2 - TP=1| per step:", " ".join(f"{d:.2e}" for d in diffs))
    assert max(diffs) < LOGIT_TOL, diffs
    assert two["replays"] > 0  # the decode steps replayed graphs, their all-reduces inside
    assert two["prompt_replays"] > 0  # the prompts' step too: every rank staged the prompt rows rank 0 sent


def test_tp2_greedy_tokens_equal_tp1_over_64_steps_on_two_gpus(results):
    assert all(len(t) == 64 for t in results[2]["tokens"])
    assert results[2]["tokens"] == results[1]["tokens"]
