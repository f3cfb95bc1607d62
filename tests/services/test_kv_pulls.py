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
    # warm-ups on (a host pool's default is off), so the front-to-agent path of warm_link runs here too
    with running_cluster(tmp_path_factory.mktemp("held"), *kv_pulls.HELD["args"], "--set", "engine.kv_warm_links=true",
                         env=kv_pulls.HELD["env"]) as c:
        yield c


class TestKvPullsInHostMemory(kv_pulls.KvPullTests):
    read_may_complete = False
    warm_links = True
