"""A decode worker's KV pull under faults, on the CPU (pools in host memory): the checks of tests/services/kv_pulls.py
against the single-process engine. tests/gpu/test_two_gpus.py runs the same checks with prefill and decode on two
GPUs."""

from __future__ import annotations

import pytest

from common.sampling import SamplingParams
from tests.services import kv_pulls
from tests.services.harness import running_cluster


@pytest.fixture(scope="module")
def ids_and_refs(engine) -> tuple[list[list[int]], list[list[int]]]:
    ids = kv_pulls.prompts(engine.tokenizer)
    outs = engine.generate(ids, SamplingParams(max_tokens=kv_pulls.MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return ids, [list(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def late(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("late"), *kv_pulls.LATE["args"], env=kv_pulls.LATE["env"]) as c:
        yield c


@pytest.fixture(scope="module")
def held(late, tmp_path_factory):  # after ``late``: one cluster at a time on two cores
    with running_cluster(tmp_path_factory.mktemp("held"), *kv_pulls.HELD["args"], env=kv_pulls.HELD["env"]) as c:
        yield c


def test_claim_after_expiry_is_refused_and_recomputed(late, ids_and_refs):
    ids, refs = ids_and_refs
    kv_pulls.check_claim_refused_recomputes(late, ids[0], refs[0])


def test_pull_outliving_its_hold_is_given_up_and_recomputed(late, ids_and_refs):
    ids, refs = ids_and_refs
    kv_pulls.check_pull_outliving_its_hold_recomputes(late, ids[1], refs[1])


def test_disaggregated_equals_one_engine_and_counts_transfers(held, ids_and_refs):
    kv_pulls.check_pd_equals_engine(held, *ids_and_refs)


def test_a_handle_naming_missing_blocks_is_recomputed(held, ids_and_refs):
    ids, refs = ids_and_refs
    kv_pulls.check_bad_block_ids_recompute(held, ids[kv_pulls.FORGED], refs[kv_pulls.FORGED])


def test_cancel_during_the_pull_frees_both_sides(held, ids_and_refs):
    kv_pulls.check_cancel_during_pull(held, ids_and_refs[0][kv_pulls.CANCEL])


def test_killed_prefill_worker_during_the_pull_is_recomputed(held, ids_and_refs):
    ids, refs = ids_and_refs
    kv_pulls.check_killed_prefill_recomputes(held, ids[kv_pulls.KILL], refs[kv_pulls.KILL])
