"""The gateway's response cache as a unit: what is cacheable, the key, the LRU byte bound, the TTL."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from tokenmill.v1 import common_pb2, frontend_pb2

from common.cluster_config import ConfigError, load_cluster_config
from services.gateway.response_cache import CacheMetrics, ResponseCache, cacheable


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def req(prompt: str = "hi", **params) -> frontend_pb2.GenerateRequest:
    return frontend_pb2.GenerateRequest(prompt=prompt, params=common_pb2.SamplingParams(**params))


def answer(text: str) -> list[frontend_pb2.GenerateResponse]:
    return [frontend_pb2.GenerateResponse(request_id="x", text=text, token_ids=[1, 2], seq=1),
            frontend_pb2.GenerateResponse(request_id="x", seq=2, finish_reason=common_pb2.FINISH_REASON_STOP,
                                          usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2))]


def make(max_bytes: int, ttl: float = 10.0) -> tuple[ResponseCache, Clock, CollectorRegistry]:
    reg, clock = CollectorRegistry(), Clock()
    return ResponseCache(max_bytes, ttl, CacheMetrics(reg), clock), clock, reg


def test_only_greedy_or_seeded_requests_are_cacheable():
    assert cacheable(req(temperature=0.0)) and cacheable(req(temperature=0.8, seed=3))
    assert not cacheable(req(temperature=0.8)) and not cacheable(req())  # unset temperature: 1.0, sampled


def test_key_covers_tenant_model_input_and_sampling_but_not_request_identity():
    k = ResponseCache.key
    base = k("a", "m", req(temperature=0.0, max_tokens=5))
    same = req(temperature=0.0, max_tokens=5)
    same.request_id, same.priority, same.cache_salt, same.skip_response_cache = "other", 5, "salt", True
    assert k("a", "m", same) == base
    assert k("b", "m", req(temperature=0.0, max_tokens=5)) != base  # tenants never share
    assert k("a", "m2", req(temperature=0.0, max_tokens=5)) != base
    assert k("a", "m", req("ho", temperature=0.0, max_tokens=5)) != base
    assert k("a", "m", req(temperature=0.0, max_tokens=6)) != base
    assert k("a", "m", req(temperature=0.0, max_tokens=5, logprobs=2)) != base
    structured = req(temperature=0.0, max_tokens=5)
    structured.params.structured.json_object = True
    assert k("a", "m", structured) != base
    biased = [req(temperature=0.0, max_tokens=5) for _ in range(2)]
    for i, t in enumerate((7, 9, 3)):  # map order does not change the key
        biased[0].params.logit_bias[t] = float(i)
    for i, t in reversed(list(enumerate((7, 9, 3)))):
        biased[1].params.logit_bias[t] = float(i)
    assert k("a", "m", biased[0]) == k("a", "m", biased[1]) != base


def test_lru_stays_within_its_byte_bound():
    probe, _, _ = make(1 << 20)
    probe.put(b"k" * 32, answer("aaaa"))
    size = probe.bytes  # one entry's weight (all entries below weigh the same)
    cache, _, reg = make(3 * size)
    keys = [bytes([i]) * 32 for i in range(4)]
    for key in keys[:3]:
        assert cache.put(key, answer("aaaa"))
    assert cache.bytes == 3 * size and len(cache) == 3
    assert cache.get(keys[0]) is not None  # keys[0] is now the most recently used: keys[1] goes next
    cache.put(keys[3], answer("aaaa"))
    assert cache.bytes <= 3 * size and len(cache) == 3
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None and cache.get(keys[3]) is not None
    assert reg.get_sample_value("tokenmill:response_cache_evictions_total") == 1
    assert reg.get_sample_value("tokenmill:response_cache_bytes") == cache.bytes
    assert not cache.put(b"big" * 11, answer("x" * (4 * size)))  # larger than the whole cache: not stored
    assert len(cache) == 3


def test_hit_replays_the_stream_without_request_identity_and_expires_after_the_ttl():
    cache, clock, reg = make(1 << 20, ttl=5.0)
    cache.put(b"k", answer("hello"))
    got = cache.get(b"k")
    assert [(r.text, r.finish_reason, r.request_id, r.seq) for r in got] == [
        ("hello", 0, "", 0), ("", common_pb2.FINISH_REASON_STOP, "", 0)]
    assert got[1].usage.completion_tokens == 2
    clock.t = 5.0
    assert cache.get(b"k") is None and len(cache) == 0 and cache.bytes == 0
    assert reg.get_sample_value("tokenmill:response_cache_hits_total") == 1
    assert reg.get_sample_value("tokenmill:response_cache_misses_total") == 1


def test_config_keys_take_sizes_and_refuse_nonsense():
    cfg = load_cluster_config(overrides={"gateway.response_cache_bytes": "64MiB"}, env={})
    assert cfg.gateway.response_cache_bytes == 64 << 20 and cfg.gateway.response_cache_ttl_s == 300
    assert load_cluster_config(env={}).gateway.response_cache_bytes == 0  # off by default
    with pytest.raises(ConfigError, match="response_cache_ttl_s"):
        load_cluster_config(overrides={"gateway.response_cache_bytes": "1MiB", "gateway.response_cache_ttl_s": 0},
                            env={})
    with pytest.raises(ConfigError, match="response_cache_bytes must be >= 0"):
        load_cluster_config(overrides={"gateway.response_cache_bytes": -1}, env={})
