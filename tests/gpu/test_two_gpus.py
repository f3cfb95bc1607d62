"""Prefill on GPU 0, decode on GPU 1: the KV moves VRAM to VRAM over NIXL, and the pull checks of
tests/services/kv_pulls.py hold across cards (marker ``gpu2``: skipped with fewer than two GPUs).

The model is SmolLM2-135M's shape with random weights (``dummy:smollm2-135m``) in float32, so a GPU machine needs no
GGUF: its tokenizer is ``GPU_TEST_TOKENIZER`` (an HF directory with tokenizer.json) or the embedded SmolLM2 one.
The reference is one engine in this process on GPU 0, the same seeded weights."""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.helpers import cuda_visible_devices, release_cuda
from tests.services import kv_pulls
from tests.services.harness import running_cluster

pytestmark = [pytest.mark.gpu2,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

MODEL = "dummy:smollm2-135m"
TOKENIZER = os.environ.get("GPU_TEST_TOKENIZER", "smollm2")
# 0.4 of each GPU: the module's two clusters are up together for a while (``held`` starts before ``late`` stops)
ENGINE = ("--model", MODEL, "--tokenizer", TOKENIZER, "--device", "cuda", "--set", "engine.dtype=float32",
          "--set", "engine.gpu_memory_utilization=0.4")


@pytest.fixture(scope="module")
def ids_and_refs() -> tuple[list[list[int]], list[list[int]]]:
    from common.config import EngineConfig
    from common.engine import LLMEngine
    from common.loader import load_model_source
    from common.sampling import SamplingParams

    engine = LLMEngine(load_model_source(MODEL, TOKENIZER),
                       EngineConfig(device="cuda", dtype="float32", kv_cache_memory=1 << 30))
    try:
        ids = kv_pulls.prompts(engine.tokenizer)
        outs = engine.generate(ids, SamplingParams(max_tokens=kv_pulls.MAX_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
        return ids, [list(o.token_ids) for o in outs]
    finally:
        del engine
        release_cuda()


@pytest.fixture(scope="module")
def late(ids_and_refs, tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("late"), *ENGINE, *kv_pulls.LATE["args"], "--prefill-gpus", "cuda:0",
                         "--decode-gpus", "cuda:1", env=kv_pulls.LATE["env"], timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def held(late, tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("held"), *ENGINE, *kv_pulls.HELD["args"], "--prefill-gpus", "cuda:0,cuda:0",
                         "--decode-gpus", "cuda:1", env=kv_pulls.HELD["env"], timeout=300) as c:
        yield c


def test_workers_are_on_their_own_gpus(late):
    [pre] = kv_pulls.procs(late, "prefill")
    [dec] = kv_pulls.procs(late, "decode")
    devices = (cuda_visible_devices(pre["pid"]), cuda_visible_devices(dec["pid"]))
    assert None not in devices and devices[0] != devices[1], f"prefill and decode CUDA_VISIBLE_DEVICES: {devices}"


class TestKvPullsAcrossCards(kv_pulls.KvPullTests):
    read_may_complete = True  # VRAM: the decode worker's cuda_ipc mapping keeps a dead peer's pool alive
    warm_links = True
