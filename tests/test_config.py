from pathlib import Path

import pytest

from kvoffload.config import GIB, ConfigError, EvictionPolicy, OffloadConfig, StoreAdmission, WritePolicy


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
