from pathlib import Path

import pytest

from kvoffload.config import (
    GIB,
    ConfigError,
    EvictionPolicy,
    HostScope,
    NodeTierConfig,
    OffloadConfig,
    StoreAdmission,
    WritePolicy,
)


def test_defaults():
    config = OffloadConfig.from_dict({})
    assert config.host.capacity_bytes == 4 * GIB
    assert config.host.policy is EvictionPolicy.LRU
    assert config.disk is None
    assert config.offload_block_tokens is None
    assert config.store_admission is StoreAdmission.ALL


@pytest.mark.parametrize("policy", list(EvictionPolicy), ids=lambda p: p.value)
def test_every_eviction_policy_is_accepted_for_every_tier(policy: EvictionPolicy) -> None:
    config = OffloadConfig.from_dict({"eviction_policy": policy.value.upper(), "disk_path": "/tmp/kv"})
    assert config.host.policy is policy
    assert config.disk is not None and config.disk.policy is policy


def test_store_admission_is_parsed_and_a_bad_one_is_named() -> None:
    config = OffloadConfig.from_dict({"store_admission": "second-sighting"})
    assert config.store_admission is StoreAdmission.SECOND_SIGHTING
    with pytest.raises(ConfigError, match=r"store_admission='first-sighting': must be one of \['all', "):
        OffloadConfig.from_dict({"store_admission": "first-sighting"})


def test_full_configuration_is_typed():
    config = OffloadConfig.from_dict({
        "host_gib": 0.5, "offload_block_tokens": 64, "eviction_policy": "ARC", "disk_path": "/tmp/kv",
        "disk_bytes": 1 << 30, "disk_write_policy": "on_evict", "disk_read_deadline_ms": 250,
    })
    assert config.host.capacity_bytes == GIB // 2
    assert config.host.policy is EvictionPolicy.ARC
    assert config.disk is not None
    assert config.disk.path == Path("/tmp/kv")
    assert config.disk.write_policy is WritePolicy.ON_EVICT
    assert config.disk.read_deadline_s == 0.25
    assert config.disk.policy is EvictionPolicy.ARC


def test_one_error_names_every_bad_key_and_lists_accepted_keys():
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_dict({"host_bytes": -1, "eviction_policy": "fifo", "colour": "red"})
    message = str(err.value)
    for culprit in ("host_bytes=-1", "eviction_policy='fifo'", "unknown key 'colour'", "Accepted keys:",
                    "offload_block_tokens"):
        assert culprit in message


def test_exclusive_and_dependent_keys():
    with pytest.raises(ConfigError, match="host_bytes or host_gib"):
        OffloadConfig.from_dict({"host_bytes": 1, "host_gib": 1})
    with pytest.raises(ConfigError, match="without disk_path"):
        OffloadConfig.from_dict({"disk_gib": 1})


def test_booleans_are_not_integers():
    with pytest.raises(ConfigError, match="offload_block_tokens"):
        OffloadConfig.from_dict({"offload_block_tokens": True})


@pytest.mark.parametrize("key", ["host_gib", "disk_gib", "disk_read_deadline_ms", "disk_breaker_cooldown_s"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -float("inf")])
def test_non_finite_numbers_are_a_config_error_naming_the_key(key, value):
    raw = {key: value} if key == "host_gib" else {"disk_path": "/tmp/kv", key: value}
    with pytest.raises(ConfigError, match=key):
        OffloadConfig.from_dict(raw)


def test_a_size_too_large_to_count_in_bytes_is_a_config_error():
    with pytest.raises(ConfigError, match="host_gib"):
        OffloadConfig.from_dict({"host_gib": 1e300})


@pytest.mark.parametrize("raw", [["host_gib", 1], "host_gib=1", 7])
def test_a_config_that_is_not_a_mapping_is_a_config_error(raw):
    with pytest.raises(ConfigError, match="must be a mapping"):
        OffloadConfig.from_dict(raw)


def test_a_remote_tier_is_typed_and_its_password_never_shows():
    config = OffloadConfig.from_dict({"remote_url": ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"],
                                      "remote_cluster": True, "remote_username": "kv",
                                      "remote_password": "pw-hunter2", "remote_timeout_ms": 250, "remote_gib": 2})
    remote = config.remote
    assert remote is not None
    assert remote.urls == ("redis://10.0.0.1:7000", "redis://10.0.0.2:7000") and remote.cluster
    assert remote.timeout_s == 0.25 and remote.capacity_bytes == 2 * GIB
    assert remote.password is not None and remote.password.value == b"pw-hunter2"
    assert "hunter2" not in repr(config)


@pytest.mark.parametrize(("raw", "culprit"), [
    ({"remote_url": "http://cache:80"}, "not a redis://"),
    ({"remote_url": "redis://:pw-hunter2@cache:6379"}, "must not carry credentials"),
    ({"remote_timeout_ms": 5}, "given without remote_url"),
    ({"remote_url": "redis://c:1", "remote_password": "a", "remote_password_env": "B"}, "not both"),
    ({"tier_secret_env": "X"}, "without a shared tier"),
])  # fmt: skip
def test_bad_remote_settings_are_config_errors_that_show_no_password(raw, culprit):
    with pytest.raises(ConfigError, match=culprit) as err:
        OffloadConfig.from_dict(raw)
    assert "hunter2" not in str(err.value)


REMOTE = {"remote_url": "redis://cache:6379"}


@pytest.mark.parametrize(("raw", "culprit"), [
    ({1: "x"}, "key 1 is not a string"),
    ({None: "x"}, "key None is not a string"),
    ({"disk_path": "~nosuchuser/kv"}, "disk_path='~nosuchuser/kv': starts with ~nosuchuser"),
    ({"record_trace": "~nosuchuser/t.jsonl"}, "record_trace="),
    ({"disk_path": "/tmp/kv\0"}, "disk_path='/tmp/kv\\\\x00': must not contain a NUL byte"),
    ({"record_trace": "t\0.jsonl"}, "record_trace=.*NUL byte"),
    ({"remote_url": "redis://cache:99999"}, "remote_url: redis://cache:99999 is not a valid URL: Port out of range"),
    ({"remote_url": "redis://cache:notaport"}, "remote_url: redis://cache:notaport is not a valid URL"),
    ({"remote_url": "redis://[::1"}, r"remote_url: redis://\[::1 is not a valid URL: Invalid IPv6 URL"),
    ({"remote_url": "redis://cache:0"}, "remote_url: redis://cache:0: the port must be in 1..65535"),
    ({"remote_url": "redis:///db"}, "has no host"),
    ({"remote_url": "unix://host/sock"}, "unix:///path/to/socket"),
    ({**REMOTE, "remote_timeout_ms": 1e300}, r"remote_timeout_ms=1e\+300: must be a number in 1..3600000"),
    ({**REMOTE, "remote_connect_timeout_ms": 1e300}, "remote_connect_timeout_ms=1e.300: must be a number in 1.."),
    ({"offload_block_tokens": 10**30}, "offload_block_tokens=1000000000000000000000000000000: must be an integer in"),
    ({"offload_block_tokens": 1e30}, "offload_block_tokens=1e.30: must be an integer in 1..65536"),
    ({"disk_path": "/tmp/kv", "disk_io_threads": 10**30}, "disk_io_threads=.*must be an integer in 1..256"),
    ({**REMOTE, "remote_ttl_s": 10**16}, r"remote_ttl_s=10000000000000000: must be an integer in 1..315360000"),
    ({**REMOTE, "remote_gib": 1e-300}, "remote_gib=1e-300: must be a number in 1 byte"),
    ({**REMOTE, "remote_breaker_errors": 10**300}, "remote_breaker_errors=.*1..1000000"),
    ({**REMOTE, "remote_breaker_cooldown_s": 1e300}, "remote_breaker_cooldown_s=1e.300: .*0.001..86400"),
    ({"host_gib": 10**400}, r"host_gib=1000.*\.\.\.: must be a number"),
    ({"disk_pth": "/tmp/kv"}, "unknown key 'disk_pth' \\(did you mean 'disk_path'\\?\\)"),
])  # fmt: skip
def test_each_bad_value_of_issue_21_is_a_config_error_naming_the_key(raw, culprit):
    with pytest.raises(ConfigError, match=culprit):
        OffloadConfig.from_dict(raw)


def test_an_unknown_key_is_reported_once_not_also_as_a_dependent_key():
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_dict({"disk_pth": "/tmp/kv"})
    assert "given without" not in str(err.value)


@pytest.mark.parametrize("url", ["redis://cache", "redis://cache:6379/0", "rediss://cache:6380/", "redis://[::1]:6379",
                                 "unix:///run/redis.sock", "unix:///run/redis.sock?db=2", "redis://10.0.0.1:7000"])
def test_valid_remote_urls_are_kept_as_given(url):
    remote = OffloadConfig.from_dict({"remote_url": url}).remote
    assert remote is not None and remote.urls == (url,)


@pytest.mark.parametrize(("raw", "culprit"), [
    ({"remote_url": "unix:///run/redis.sock", "remote_cluster": True}, "not unix://"),
    ({"remote_url": ["redis://a:1/2", "redis://b:1"], "remote_cluster": True}, "database 0 only"),
    ({"remote_url": ["redis://a:1", "rediss://b:1"]}, "the same scheme, got redis, rediss"),
    ({"remote_url": "redis://cache:1?password=pw-hunter2"}, "takes no query but db=N"),
    ({"remote_url": "redis://cache:99999?password=pw-hunter2"}, "Port out of range"),
])  # fmt: skip
def test_remote_urls_that_redis_py_would_refuse_or_misread_are_config_errors_without_the_query(raw, culprit):
    with pytest.raises(ConfigError, match=culprit) as err:
        OffloadConfig.from_dict(raw)
    assert "hunter2" not in str(err.value)


def test_a_long_value_is_cut_short_in_the_error():
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_dict({"model_id": 7 * 10**500})
    assert "model_id=7000" in str(err.value) and len(str(err.value)) < 2000


def test_the_node_scope_is_typed_with_its_path_and_group():
    private = OffloadConfig.from_dict({})
    assert private.host.scope is HostScope.PRIVATE and private.host.node is None
    node = OffloadConfig.from_dict({"host_scope": "node", "node_path": "/dev/shm/pools", "node_shared_group": 0})
    assert node.host.scope is HostScope.NODE
    assert node.host.node == NodeTierConfig(Path("/dev/shm/pools"), 0)
    assert OffloadConfig.from_dict({"host_scope": "node"}).host.node == NodeTierConfig(Path("/dev/shm"), None)


@pytest.mark.parametrize(("raw", "culprit"), [
    ({"node_path": "/dev/shm"}, "node_path given without host_scope node"),
    ({"host_scope": "private", "node_shared_group": 0}, "node_shared_group given without host_scope node"),
    ({"host_scope": "shared"}, "host_scope"),
    ({"host_scope": "node", "disk_path": "/tmp/d", "disk_write_policy": "on_evict"},
     "disk_write_policy on_evict cannot be used with host_scope node"),
])
def test_bad_node_settings_are_config_errors_naming_the_key(raw, culprit):
    with pytest.raises(ConfigError, match=culprit):
        OffloadConfig.from_dict(raw)
