"""The ``tenants:`` section of the cluster config: parsing, round trip through ``tokenmill up``'s file, errors."""

from __future__ import annotations

import hashlib

import pytest
import yaml

from common.cluster_config import ConfigError, TenantConfig, load_cluster_config

KEY_HASH = hashlib.sha256(b"sk-acme").hexdigest()


def test_tenants_from_file_env_and_flags_round_trip(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"tenants": {"acme": {
        "keys_sha256": [KEY_HASH.upper()], "rpm": 600, "tpm": 200000, "tpm_burst": 5000, "default_class": "batch",
        "max_class": "standard", "weight": 2.5, "max_running": 4, "max_inflight": 8, "share_prefix_cache": True,
        "price_input_per_mtok": 0.5, "price_output_per_mtok": 1.5}, "free": None}}))
    c = load_cluster_config(f, overrides={"tenants.acme.rpm_burst": "10"}, env={})
    acme = c.tenants["acme"]
    assert acme.keys_sha256 == (KEY_HASH,)  # normalised to lower case
    assert (acme.rpm, acme.rpm_capacity, acme.tpm, acme.tpm_capacity) == (600, 10, 200000, 5000)
    assert (acme.default_class, acme.max_class, acme.weight, acme.max_running) == ("batch", "standard", 2.5, 4)
    assert acme.share_prefix_cache and acme.price_output_per_mtok == 1.5 and acme.max_inflight == 8
    assert c.tenants["free"] == TenantConfig()
    again = tmp_path / "again.yaml"  # what `tokenmill up` hands its children
    again.write_text(yaml.safe_dump(c.to_dict()))
    assert load_cluster_config(again, env={}).tenants == c.tenants
    from_env = load_cluster_config(env={"TOKENMILL_TENANTS": "{acme: {rpm: 60, max_class: batch, "
                                                             "default_class: batch}}"})
    assert from_env.tenants["acme"].rpm == 60 and from_env.tenants["acme"].max_class == "batch"
    assert load_cluster_config(env={}).tenants == {}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tenants.a.keys_sha256": "abc"}, "not a SHA-256 in hex"),
    ({"tenants.a.default_class": "interactive", "tenants.a.max_class": "batch"}, "more urgent than max_class"),
    ({"tenants.a.max_class": "urgent"}, "tenants.a.max_class"),
    ({"tenants.other.rpm": 1}, "'other'"),
    ({"tenants.a.b": 1}, "unknown config key tenants.a.b"),
    ({"tenants.a.weight": 0}, "weight must be > 0"),
    ({"tenants.a.tpm": -1}, "tpm must be >= 0"),
    ({"tenants.a.max_inflight": -2}, "max_inflight must be >= 0"),
    ({"tenants.a.keys_sha256": KEY_HASH, "tenants.b.keys_sha256": KEY_HASH}, "a key belongs to one tenant"),
    ({"tenants.a.keys_sha256": KEY_HASH, "gateway.api_keys": "b:sk-acme"}, r"api_keys\[0\] is also a key of tenants.a"),
])
def test_tenant_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_cluster_config(overrides=overrides, env={})
