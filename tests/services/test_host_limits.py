"""The quota state a host's gateways share (services/gateway/host_limits.py): buckets and in-flight counts in one
file, exact under processes taking from it at once, and how ``tokenmill up`` names the file."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest

from common.cluster_config import ClusterConfig, load_cluster_config
from services.cluster.launcher import with_shared_limits
from services.gateway.host_limits import HASH_ROWS, HostLimits, Layout
from services.gateway.tenancy import Tenancy


def _cluster(**overrides: object) -> ClusterConfig:
    return load_cluster_config(overrides={
        "gateway.count": 2, "tenants.flood.rpm": 1, "tenants.flood.rpm_burst": 60000, "tenants.flood.tpm": 6000,
        "tenants.flood.max_inflight": 8, "tenants.calm.weight": 2, **overrides}, env={})


def _take_all(path: str, index: int, tries: int, go: Any, out: Any) -> None:  # one gateway process
    ten = Tenancy.from_config(_cluster(), shared=HostLimits(path, _cluster(), index))
    bucket = ten.tenants["flood"].requests
    assert bucket is not None
    go.wait()
    out.put(sum(bucket.take(1) == 0 for _ in range(tries)))


def test_gateways_in_processes_of_their_own_take_a_bucket_exactly_once(tmp_path):
    path = str(tmp_path / "limits.bin")
    HostLimits.create(path, _cluster())
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_take_all, args=(path, i, 50000, go, out)) for i in range(2)]
    for p in procs:
        p.start()
    taken = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    # 100,000 tries at once against a burst of 60,000 refilled at 1 a minute: 60,000 taken, however the two
    # interleaved (a few seconds of refill add at most one more); a lost update would take more
    assert min(taken) > 0 and 60000 <= sum(taken) <= 60001, taken
    again = HostLimits(path, _cluster(), 0)
    assert again.layout.size == Path(path).stat().st_size
    cell = again.bucket_cell("flood", "requests", 60000)
    with cell as c:
        assert c.level < 1  # what the two processes left, as a third one sees it


def test_buckets_are_shared_and_settled_across_gateways(tmp_path):
    path = tmp_path / "limits.bin"
    cluster = _cluster()
    HostLimits.create(path, cluster)
    clock = lambda: 1000.0  # noqa: E731  # time stands still: no refill
    a = Tenancy.from_config(cluster, clock, HostLimits(path, cluster, 0))
    b = Tenancy.from_config(cluster, clock, HostLimits(path, cluster, 1))
    ta, tb = a.tenants["flood"], b.tenants["flood"]
    assert ta.tokens is not None and tb.tokens is not None
    assert tb.tokens.level() == 6000  # a slot never set is a full bucket
    charge = a.charge(ta, 1000, 500)
    assert tb.tokens.level() == 4500
    b.settle(b.charge(tb, 4000, 0), 4200)  # 200 more than charged: a debt, seen by both
    assert ta.tokens.level() == pytest.approx(300)
    a.settle(charge, 1100)  # the first one used 400 of its 500
    assert tb.tokens.level() == pytest.approx(700)
    assert ta.tokens.take(701) > 0 and tb.tokens.take(700) == 0 and ta.tokens.level() == 0
    assert b.tenants["calm"].requests is None and b.tenants["calm"].tokens is None  # no quota: nothing shared
    assert tb.ratelimit_headers()["x-ratelimit-remaining-tokens"] == "0"


def test_in_flight_counts_sum_every_gateway_and_a_restarted_one_starts_from_zero(tmp_path):
    path = tmp_path / "limits.bin"
    cluster = _cluster()
    HostLimits.create(path, cluster)
    g0, g1 = HostLimits(path, cluster, 0), HostLimits(path, cluster, 1)
    for _ in range(3):
        g0.add_in_flight("flood", 1)
    g1.add_in_flight("flood", 2)
    g1.add_in_flight("someone", 1)  # a name the config does not list: a hashed row
    assert g0.in_flight("flood") == g1.in_flight("flood") == 5
    assert g0.in_flight("someone") == 1 and g0.in_flight("calm") == 0
    g1.add_in_flight("flood", -1)
    assert g0.in_flight("flood") == 4
    assert not g1.add_in_flight("flood", 1, below=4) and g0.in_flight("flood") == 4  # at the cap: nothing added
    assert g1.add_in_flight("flood", 1, below=5) and g0.in_flight("flood") == 5
    g1.add_in_flight("flood", -1)
    HostLimits(path, cluster, 0)  # gateway-0 started again: its requests died with it
    assert g1.in_flight("flood") == 1 and g1.in_flight("someone") == 1
    lay = Layout.of(cluster)
    assert lay.row("calm") == 0 and lay.row("flood") == 1 and 2 <= lay.row("someone") < 2 + HASH_ROWS
    assert lay.size == 2 * 24 + (2 + HASH_ROWS) * 2 * 8  # flood's two buckets; 2 columns of counts


def test_a_file_made_for_another_config_is_refused(tmp_path):
    path = tmp_path / "limits.bin"
    HostLimits.create(path, _cluster())
    with pytest.raises(ValueError, match=r"holds \d+ bytes; this config's tenants and gateways need \d+"):
        HostLimits(path, _cluster(**{"tenants.extra.rpm": 5}), 0)
    with pytest.raises(ValueError, match="gateway index 2 is outside the 2 gateways"):
        HostLimits(path, _cluster(), 2)


def test_up_shares_the_limits_of_the_gateways_it_starts_on_its_host(tmp_path):
    two = with_shared_limits(_cluster(), tmp_path)
    assert two.gateway.shared_limits_file == str(tmp_path / "gateway-limits.bin")
    free = load_cluster_config(overrides={"gateway.count": 2, "tenants.calm.weight": 2}, env={})
    assert with_shared_limits(free, tmp_path).gateway.shared_limits_file is None  # no quota, no cap: nothing to share
    capped = load_cluster_config(overrides={"gateway.count": 2, "gateway.tenant_max_inflight": 4}, env={})
    assert with_shared_limits(capped, tmp_path).gateway.shared_limits_file is not None
    assert with_shared_limits(_cluster(**{"gateway.count": 1}), tmp_path).gateway.shared_limits_file is None
    hosts = _cluster(**{"gateway.hosts": "a,b"})  # containers: no file they could share
    assert with_shared_limits(hosts, tmp_path).gateway.shared_limits_file is None
    apart = _cluster(**{"gateway.share_ports": "false"})  # ports of their own, one host: shared all the same
    assert with_shared_limits(apart, tmp_path).gateway.shared_limits_file == str(tmp_path / "gateway-limits.bin")


def test_two_gateways_hold_a_tenant_to_one_in_flight_cap(tmp_path):
    """Two gateways of one host (their services built on one shared file): a tenant at its cap through one is
    refused by the other, and admitted again once a request ends. Without a cap nothing is counted in the file."""
    from services.gateway.server import GatewayService
    from services.gateway.tenancy import QuotaExceeded

    cluster = with_shared_limits(_cluster(**{"tenants.flood.max_inflight": 2}), tmp_path)
    HostLimits.create(cluster.gateway.shared_limits_file, cluster)
    g0, g1 = (GatewayService(cluster.service("gateway", i)) for i in range(2))
    flood, flood1 = g0.tenancy.tenants["flood"], g1.tenancy.tenants["flood"]
    g0.admit_in_flight(flood, "r1", "")
    with g0.in_flight(flood, admitted=True):
        g1.admit_in_flight(flood1, "r2", "")
        with g1.in_flight(flood1, admitted=True), pytest.raises(QuotaExceeded,
                                                                match=r"over its quota of 2 requests in flight"):
            g0.admit_in_flight(flood, "r3", "")
        g0.admit_in_flight(flood, "r4", "")  # one ended: room again
        with g0.in_flight(flood, admitted=True):
            assert g1.tenant_in_flight("flood") == 2 and g0.inflight == 2 and g1.inflight == 0
    assert g0.tenant_in_flight("flood") == g1.tenant_in_flight("flood") == 0 and g0.inflight == 0
    assert not g0.tenant_inflight and not g1.tenant_inflight  # counted in the file, not per gateway

    # admission counts the request at once: requests that arrive together (the handlers await between admission
    # and their work) cannot all pass a cap, on one gateway or across two
    for _ in range(2):
        (g0 if _ else g1).admit_in_flight(flood, "together", "")
    for g, t in ((g0, flood), (g1, flood1)):
        with pytest.raises(QuotaExceeded, match="over its quota of 2 requests in flight"):
            g.admit_in_flight(t, "third", "")
    assert g0.tenant_in_flight("flood") == 2 and g0.inflight == g1.inflight == 1
    with g0.in_flight(flood, admitted=True), g1.in_flight(flood1, admitted=True):
        pass
    assert g0.tenant_in_flight("flood") == 0

    quota_only = with_shared_limits(_cluster(**{"tenants.flood.max_inflight": 0}), tmp_path / "q")
    (tmp_path / "q").mkdir()
    HostLimits.create(quota_only.gateway.shared_limits_file, quota_only)
    g = GatewayService(quota_only.service("gateway", 0))
    assert g.limits is not None and g._shared_counts is None  # buckets shared, counts kept at home (no cap reads them)
