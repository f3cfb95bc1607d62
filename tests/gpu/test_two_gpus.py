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


def test_claim_after_expiry_is_refused_and_recomputed(late, ids_and_refs):
    ids, refs = ids_and_refs
    kv_pulls.check_claim_refused_recomputes(late, ids[0], refs[0])


def test_pull_outliving_its_hold_is_given_up_and_recomputed(late, ids_and_refs):
    ids, refs = ids_and_refs
    kv_pulls.check_pull_outliving_its_hold_recomputes(late, ids[1], refs[1])


def test_greedy_through_1p1d_equals_one_engine(held, ids_and_refs):
    kv_pulls.check_pd_equals_engine(held, *ids_and_refs)


def test_a_handle_naming_missing_blocks_is_recomputed(held, ids_and_refs):
    ids, refs = ids_and_refs
    kv_pulls.check_bad_block_ids_recompute(held, ids[kv_pulls.FORGED], refs[kv_pulls.FORGED])


def test_cancel_during_the_pull_frees_both_cards(held, ids_and_refs):
    kv_pulls.check_cancel_during_pull(held, ids_and_refs[0][kv_pulls.CANCEL])


def test_killed_prefill_worker_during_the_pull_is_recomputed(held, ids_and_refs):
    ids, refs = ids_and_refs
    kv_pulls.check_killed_prefill_recomputes(held, ids[kv_pulls.KILL], refs[kv_pulls.KILL], read_may_complete=True)
