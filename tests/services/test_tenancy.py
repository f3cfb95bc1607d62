"""The gateway's tenancy without a cluster: token buckets on an injected clock, identity by key hash, the quota
refusals' messages and headers, settlement, priority classes and cache scopes."""

from __future__ import annotations

import math

import pytest
from tokenmill.v1 import common_pb2

from common.cluster_config import ConfigError, load_cluster_config
from common.rpc import Unauthenticated
from services.gateway.tenancy import (
    QuotaExceeded,
    RequestTooLarge,
    Tenancy,
    TokenBucket,
    go_duration,
    hash_key,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_bucket_refills_at_its_rate_up_to_its_burst():
    clock = Clock()
    b = TokenBucket(per_minute=60, capacity=5, clock=clock)  # 1 a second
    assert [b.take(1) for _ in range(5)] == [0, 0, 0, 0, 0]
    assert b.take(1) == pytest.approx(1.0)  # refused: one token in 1 s
    assert b.take(3) == pytest.approx(3.0)  # refused, and nothing taken
    clock.t += 2.5
    assert b.level() == pytest.approx(2.5)
    assert b.take(3) == pytest.approx(0.5)
    clock.t += 100
    assert b.level() == 5  # never above the burst
    assert b.take(6) == math.inf  # over the capacity: never
    assert b.level() == 5


def test_bucket_settles_refunds_and_debts():
    clock = Clock()
    b = TokenBucket(per_minute=600, capacity=100, clock=clock)  # 10 a second
    assert b.take(80) == 0
    b.give(50)
    assert b.level() == 70
    b.give(1000)
    assert b.level() == 100  # a refund never lifts it past the capacity
    b.charge(130)
    assert b.level() == -30  # a debt: the next request waits for it
    assert b.take(10) == pytest.approx(4.0)
    assert b.reset_s() == pytest.approx(13.0)


def test_go_durations():
    assert [go_duration(s) for s in (0, 0.2501, 1, 59.2, 90, 3725)] == ["0ms", "251ms", "1s", "1m0s", "1m30s",
                                                                        "1h2m5s"]


def _tenancy(clock, **overrides):
    cfg = load_cluster_config(overrides={
        "tenants.acme.keys_sha256": hash_key("sk-acme"), "tenants.acme.rpm": 2, "tenants.acme.tpm": 600,
        "tenants.acme.tpm_burst": 100, "tenants.acme.max_class": "standard", "tenants.acme.default_class": "batch",
        "tenants.acme.weight": 3, "tenants.acme.max_running": 2,
        "tenants.open.keys_sha256": hash_key("sk-open"), "tenants.open.share_prefix_cache": True,
        "gateway.api_keys": "legacy:sk-old", **overrides}, env={})
    return Tenancy.from_config(cfg, clock)


def test_identity_by_key_hash():
    ten = _tenancy(Clock())
    assert ten.identify("Bearer sk-acme").name == "acme"
    assert ten.identify("bearer  sk-open ").name == "open"
    assert ten.identify("Bearer sk-old", claimed="acme").name == "legacy"  # a plain-text gateway.api_keys key
    for bad, says in ((None, "missing API key"), ("", "missing API key"), ("Bearer sk-nope", "invalid API key"),
                      ("Basic sk-acme", "Bearer")):
        with pytest.raises(Unauthenticated, match=says):
            ten.identify(bad, claimed="acme")  # a claimed tenant counts for nothing once keys are configured
    unkeyed = Tenancy.from_config(load_cluster_config(overrides={"tenants.acme.rpm": 1}, env={}))
    assert unkeyed.identify(None, claimed="acme").requests is not None  # no keys: x-tenant-id names the tenant
    assert unkeyed.identify(None, claimed="someone").label == "other"


def test_quota_refusals_name_the_quota_and_take_nothing():
    clock = Clock()
    ten = _tenancy(clock)
    acme = ten.get("acme")
    ten.admit_request(acme)
    ten.admit_request(acme)
    with pytest.raises(QuotaExceeded, match=r"tenant acme is over its quota of 2 requests per minute \(rpm") as e:
        ten.admit_request(acme)
    h = e.value.headers
    assert h["Retry-After"] == "30" and h["x-ratelimit-limit-requests"] == "2"
    assert h["x-ratelimit-remaining-requests"] == "0" and h["x-ratelimit-reset-requests"] == "1m0s"
    assert h["x-ratelimit-limit-tokens"] == "100" and h["x-ratelimit-remaining-tokens"] == "100"
    ten.refund_request(acme)  # refused later: its request token comes back
    ten.admit_request(acme)
    c = ten.charge(acme, 30, 50)
    assert acme.tokens.level() == 20
    with pytest.raises(QuotaExceeded, match=r"600 tokens per minute \(tpm\): this request needs 30 .* 20 are left"):
        ten.charge(acme, 10, 20)
    assert acme.tokens.level() == 20  # the refusal took nothing
    with pytest.raises(RequestTooLarge, match=r"needs 101 tokens .* holds at most 100; lower max_tokens"):
        ten.charge(acme, 1, 100)
    ten.settle(c, 30 + 12)  # 38 of the 50 max_tokens unused
    assert acme.tokens.level() == 58
    ten.settle(c, 0)
    assert acme.tokens.level() == 58  # once only
    c = ten.charge(acme, 40, 0)  # no max_tokens: the output is billed when known
    ten.settle(c, 40 + 60)
    assert acme.tokens.level() == -42
    clock.t += 6
    assert acme.tokens.level() == pytest.approx(18)
    free = ten.get("open")
    assert not free.has_quotas and free.ratelimit_headers() == {}
    ten.admit_request(free)
    ten.settle(ten.charge(free, 10**6, 10**6), 5)


def test_gateways_that_split_a_quota_each_hold_their_share():
    """With ``gateway.quota_shares`` N each gateway refills at 1/N of a quota's rate and holds 1/N of its burst, so
    N gateways behind one load balancer admit the quota once; a request the whole quota could take is still
    admitted (at a full share, leaving a debt), one over it is still too large, and the headers and messages speak
    of the whole quota."""
    clock = Clock()
    ten = _tenancy(clock, **{"tenants.acme.rpm": 8, "tenants.acme.rpm_burst": 8, "gateway.quota_shares": 4})
    acme = ten.get("acme")
    assert acme.shares == 4 and (acme.requests.capacity, acme.requests.rate * 60) == (2, 2)
    assert (acme.tokens.capacity, acme.tokens.rate * 60, acme.tokens.most) == (25, 150, 100)
    ten.admit_request(acme)
    ten.admit_request(acme)  # this gateway's 2 of the burst of 8
    with pytest.raises(QuotaExceeded, match=r"quota of 8 requests per minute \(rpm, burst 8\); each of the 4 "
                                            r"gateways that split it holds 1/4 \(gateway.quota_shares\)") as e:
        ten.admit_request(acme)
    h = e.value.headers
    assert h["Retry-After"] == "30"  # 2 a minute here: the next request token in 30 s
    assert h["x-ratelimit-limit-requests"] == "8" and h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-limit-tokens"] == "100" and h["x-ratelimit-remaining-tokens"] == "100"
    c = ten.charge(acme, 20, 40)  # 60 > this gateway's 25, within the quota's 100: taken from a full share
    assert acme.tokens.level() == -35
    with pytest.raises(QuotaExceeded, match=r"this request needs 1 .* 0 are left; each of the 4 gateways"):
        ten.charge(acme, 1, 0)
    clock.t += 24  # 150 a minute: the debt of 35 and 25 more
    assert acme.tokens.level() == pytest.approx(25)
    assert acme.ratelimit_headers()["x-ratelimit-remaining-tokens"] == "100"
    with pytest.raises(RequestTooLarge, match=r"needs 101 tokens .* holds at most 100"):
        ten.charge(acme, 1, 100)
    ten.settle(c, 20 + 5)  # 35 of the 40 max_tokens unused
    assert acme.tokens.level() == 25  # a refund never lifts a share past its burst
    with pytest.raises(ConfigError, match=r"gateway\.quota_shares must be >= 1"):
        load_cluster_config(overrides={"gateway.quota_shares": 0}, env={})


def test_classes_and_what_the_workers_are_told():
    ten = _tenancy(Clock())
    acme, other = ten.get("acme"), ten.get("open")
    c = common_pb2
    assert ten.priority_class(acme, c.PRIORITY_CLASS_UNSPECIFIED) == c.PRIORITY_CLASS_BATCH  # its default
    assert ten.priority_class(acme, c.PRIORITY_CLASS_INTERACTIVE) == c.PRIORITY_CLASS_STANDARD  # capped
    assert ten.priority_class(acme, c.PRIORITY_CLASS_BATCH) == c.PRIORITY_CLASS_BATCH
    assert ten.priority_class(other, c.PRIORITY_CLASS_INTERACTIVE) == c.PRIORITY_CLASS_INTERACTIVE
    meta = c.RequestMeta(request_id="r", cache_salt="s1")
    ten.fill_meta(acme, meta, c.PRIORITY_CLASS_INTERACTIVE)
    assert (meta.tenant_id, meta.priority_class, meta.tenant_weight, meta.tenant_max_running) == (
        "acme", c.PRIORITY_CLASS_STANDARD, 3.0, 2)
    # cache scopes: private per tenant, one common scope for tenants that share; a salt cannot name another scope
    salts = {ten.cache_salt(ten.get(n), s) for n in ("acme", "legacy") for s in ("", "x")}
    salts |= {ten.cache_salt(other, s) for s in ("", "x", "tenant\x00acme\x00")}
    assert len(salts) == 7
    assert ten.cache_salt(other, "") == ""  # sharing tenants share with requests of no tenant


def test_keys_hash_command(capsys, monkeypatch):
    import argparse
    import io

    from services.cluster.cli import cmd_keys_hash

    assert cmd_keys_hash(argparse.Namespace(key=["sk-acme"])) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-acme\n\nsk-open\n"))
    assert cmd_keys_hash(argparse.Namespace(key=[])) == 0
    assert capsys.readouterr().out.split() == [hash_key("sk-acme"), hash_key("sk-acme"), hash_key("sk-open")]
    assert hash_key("sk-acme") == "5f8eee912cd7c0ccb238560e8a22e7f78909e6dac18288188f7f4ea35112700d"
