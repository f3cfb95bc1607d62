"""The config fields that place services on hosts of their own (containers, pods, Ray actors)."""

from __future__ import annotations

import pytest

from common.cluster_config import ConfigError, load_cluster_config


def test_without_them_everything_is_on_host_as_tokenmill_up_runs_it():
    c = load_cluster_config(env={})
    assert c.addresses("tokenizer") == ["127.0.0.1:20100", "127.0.0.1:20101"]
    svc = c.service("decode")
    assert (svc.host, svc.address, svc.name) == ("127.0.0.1", "127.0.0.1:20300", "decode-0")


def test_hosts_from_env_yaml_and_flags_with_or_without_ports(tmp_path):
    env = {"TOKENMILL_ROUTER__HOSTS": "router", "TOKENMILL_TOKENIZER__HOSTS": "tokenizer-0:20100, tokenizer-1:20101",
           "TOKENMILL_HOST": "0.0.0.0", "TOKENMILL_ADVERTISE_HOST": "decode",
           "TOKENMILL_INSTANCE_NAME": "decode-7f9c"}
    c = load_cluster_config(env=env)
    assert c.addresses("router") == ["router:20000"]  # a bare host: the pool's first port
    assert c.addresses("tokenizer") == ["tokenizer-0:20100", "tokenizer-1:20101"]
    svc = c.service("decode")
    assert svc.host == "0.0.0.0" and svc.address == "decode:20300" and svc.name == "decode-7f9c"
    f = tmp_path / "c.yaml"
    f.write_text("router:\n  port: 24000\n  hosts: [r1, 'r2:9000', '[::1]:9001']\n")
    assert load_cluster_config(f, env={}).addresses("router") == ["r1:24000", "r2:9000", "[::1]:9001"]
    c = load_cluster_config(overrides={"tokenizer.hosts": "a,b"}, env={})
    assert c.addresses("tokenizer") == ["a:20100", "b:20100"]
    # a config written out (what `tokenmill ray up` hands each actor) loads back the same
    f.write_text(__import__("yaml").safe_dump(load_cluster_config(env=env).to_dict()))
    assert load_cluster_config(f, env={}) == load_cluster_config(env=env)


def test_a_bad_hosts_value_names_the_key():
    with pytest.raises(ConfigError, match=r"router\.hosts"):
        load_cluster_config(overrides={"router.hosts": 5}, env={})
