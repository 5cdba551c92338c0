"""The object tier's keys (object_*): the bucket URL and its prefix, the endpoint (never with credentials, which are
never shown), the keys that need object_url or exclude each other, the tier secret, and the typed defaults. No
server is needed: parsing makes no request."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvoffload.config import GIB, ConfigError, EvictionPolicy, ObjectTierConfig, OffloadConfig

URL = {"object_url": "s3://kv-cache"}
PASSWORD = "pw-hunter2-Secret"


def parsed(**raw: object) -> ObjectTierConfig:
    config = OffloadConfig.from_dict({**URL, **raw})
    assert config.object is not None
    return config.object


def refusal(raw: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_dict(raw)
    return str(err.value)


# ---- object_url -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "bucket", "prefix"), [
    ("s3://kv-cache", "kv-cache", ""),
    ("s3://kv-cache/team-a", "kv-cache", "team-a"),
    ("s3://kv.cache-01/team/a", "kv.cache-01", "team/a"),
    ("s3://abc/a.b/c-d_e", "abc", "a.b/c-d_e"),
    ("s3://" + "b" * 63, "b" * 63, ""),
])
def test_an_s3_url_is_its_bucket_and_prefix(url: str, bucket: str, prefix: str) -> None:
    config = OffloadConfig.from_dict({"object_url": url})
    assert config.object is not None and (config.object.bucket, config.object.prefix) == (bucket, prefix)
    assert config.disk is None and config.remote is None


@pytest.mark.parametrize("bucket", ["KV-Cache", "ab", "b" * 64, "-kv", "kv-", "kv..cache", "192.168.1.1", "kv_cache",
                                    "", "kv cache", "kv:cache"])
def test_an_invalid_bucket_name_is_refused_naming_the_key(bucket: str) -> None:
    message = refusal({"object_url": f"s3://{bucket}/p"})
    assert "object_url: " in message and "is not a valid S3 bucket name" in message


@pytest.mark.parametrize("prefix", ["a//b", "a b", "a\tb", "a\nb", "x" * 513])
def test_a_prefix_with_empty_parts_spaces_or_too_long_is_refused_naming_the_key(prefix: str) -> None:
    message = refusal({"object_url": f"s3://kv-cache/{prefix}"})
    assert "object_url: " in message and "the prefix after the bucket" in message


@pytest.mark.parametrize("url", ["s3://kv-cache/", "s3://kv-cache//", "s3://kv-cache/a/", "s3://kv-cache//a",
                                 "s3://kv-cache/a//b", "s3://kv-cache/a/b/", "s3://kv-cache///a"])
def test_a_prefix_with_an_empty_part_is_refused_naming_the_url_and_the_way_without_a_prefix(url: str) -> None:
    """The documented rule: "a printable prefix without spaces or empty parts". A slash at an end or doubled was
    dropped or kept silently; ``s3://kv-cache/`` (an empty prefix) is refused too: ``s3://kv-cache`` says it. The
    URL itself is never shown (object_url's value is hidden in errors)."""
    message = refusal({"object_url": url})
    assert "object_url: " in message and "has an empty part" in message and url not in message
    assert "s3://kv-cache for no prefix" in message


def test_the_longest_prefix_is_accepted() -> None:
    assert parsed(object_url="s3://kv-cache/" + "x" * 512).prefix == "x" * 512


@pytest.mark.parametrize("url", ["http://kv-cache", "gs://kv-cache", "s3a://kv-cache", "S3://kv-cache", "kv-cache",
                                 "s3:/kv-cache", 5, None, ["s3://kv-cache"]])
def test_anything_but_an_s3_url_is_refused_naming_the_key(url: object) -> None:
    assert "object_url: " in refusal({"object_url": url})


# ---- object_endpoint --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("endpoint", "kept"), [
    ("http://127.0.0.1:7480", "http://127.0.0.1:7480"),
    ("https://s3.example.com", "https://s3.example.com"),
    ("https://s3.example.com:8443/", "https://s3.example.com:8443"),
    ("http://[::1]:9000", "http://[::1]:9000"),
])
def test_an_http_or_https_endpoint_is_kept(endpoint: str, kept: str) -> None:
    assert parsed(object_endpoint=endpoint).endpoint == kept


@pytest.mark.parametrize(("endpoint", "culprit"), [
    ("ftp://s3.example.com", "http://host"),
    ("s3.example.com:9000", "http://host"),
    ("http://", "http://host"),
    ("http://s3.example.com/kv-cache", "no path or query"),
    ("http://s3.example.com?region=x", "no path or query"),
    ("http://s3.example.com:0", "the port must be in 1..65535"),
    ("http://s3.example.com:99999", "not a valid URL"),
    ("http://s3.example.com:port", "not a valid URL"),
    ("http://s3 example.com", "without spaces"),
    (7480, "http:// or https://"),
])
def test_an_endpoint_that_is_not_http_host_port_is_refused_naming_the_key(endpoint: object, culprit: str) -> None:
    message = refusal({**URL, "object_endpoint": endpoint})
    assert "object_endpoint" in message and culprit in message
    assert "object_endpoint=" not in message  # its value is never shown: it might hold a password


@pytest.mark.parametrize("endpoint", [
    f"http://AKIAEXAMPLE:{PASSWORD}@s3.example.com:9000",
    f"https://AKIAEXAMPLE:{PASSWORD}@s3.example.com",
    f"http://{PASSWORD}@s3.example.com",
    f"http://AKIAEXAMPLE:{PASSWORD}@s3.example.com:99999",
    f"http://AKIAEXAMPLE:{PASSWORD}@s3.example.com/kv-cache",
    f"http://AKIAEXAMPLE:{PASSWORD}@s3.example.com:0",
    f"ftp://AKIAEXAMPLE:{PASSWORD}@s3.example.com",
    f"http://AKIAEXAMPLE:{PASSWORD} @s3.example.com",
    f"http://AKIAEXAMPLE:[{PASSWORD}@s3.example.com",
])
def test_credentials_in_the_endpoint_are_refused_and_never_shown(endpoint: str) -> None:
    message = refusal({**URL, "object_endpoint": endpoint})
    assert "object_endpoint" in message
    assert PASSWORD not in message and "AKIAEXAMPLE" not in message


def test_an_endpoint_with_credentials_is_refused_for_carrying_them() -> None:
    message = refusal({**URL, "object_endpoint": f"http://key:{PASSWORD}@s3.example.com:9000"})
    assert "object_endpoint: http://s3.example.com: an endpoint must not carry credentials" in message


@pytest.mark.parametrize("url", [f"s3://AKIAEXAMPLE:{PASSWORD}@kv-cache/p", f"s3://{PASSWORD}@kv-cache",
                                 f"s3://AKIAEXAMPLE:{PASSWORD}@KV/p"])
def test_credentials_in_the_object_url_are_refused_and_never_shown(url: str) -> None:
    message = refusal({"object_url": url})
    assert "object_url: an object URL must not carry credentials" in message
    assert PASSWORD not in message and "AKIAEXAMPLE" not in message


# ---- combinations -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, value", [
    ("object_endpoint", "http://127.0.0.1:7480"), ("object_region", "eu-west-1"), ("object_path_style", True),
    ("object_timeout_ms", 500), ("object_connect_timeout_ms", 500), ("object_bytes", 1 << 30), ("object_gib", 1),
    ("object_io_threads", 4), ("object_breaker_errors", 2), ("object_breaker_cooldown_s", 5),
])
def test_an_object_key_without_object_url_is_refused(key: str, value: object) -> None:
    assert f"{key} given without object_url" in refusal({key: value})


def test_every_object_key_without_object_url_is_named_in_one_error() -> None:
    message = refusal({"object_region": "eu-west-1", "object_io_threads": 4})
    assert "object_io_threads, object_region given without object_url" in message


def test_object_bytes_and_object_gib_together_are_refused() -> None:
    assert "give object_bytes or object_gib, not both" in refusal({**URL, "object_bytes": 1 << 30, "object_gib": 1})


def test_a_tier_secret_from_the_environment_is_accepted_with_object_url_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_TIER_SECRET", "s" * 32)
    config = OffloadConfig.from_dict({**URL, "tier_secret_env": "KV_TIER_SECRET"})
    assert config.object is not None and config.object.secret is not None
    assert config.object.secret.value == b"s" * 32 and "s" * 32 not in repr(config)
    assert config.disk is None and config.remote is None


def test_a_tier_secret_file_is_accepted_with_object_url_alone(tmp_path: Path) -> None:
    secret = tmp_path / "tier.key"
    secret.write_bytes(b"k" * 32 + b"\n")
    os.chmod(secret, 0o600)
    config = OffloadConfig.from_dict({**URL, "tier_secret_file": str(secret)})
    assert config.object is not None and config.object.secret is not None and config.object.secret.value == b"k" * 32


def test_a_tier_secret_without_any_shared_tier_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_TIER_SECRET", "s" * 32)
    assert "given without a shared tier" in refusal({"tier_secret_env": "KV_TIER_SECRET"})


# ---- defaults and conversions -----------------------------------------------------------------------------------


def test_object_url_alone_gives_the_documented_defaults() -> None:
    assert OffloadConfig.from_dict({}).object is None
    assert parsed() == ObjectTierConfig(bucket="kv-cache")
    config = parsed()
    assert (config.prefix, config.endpoint, config.region, config.path_style) == ("", None, None, None)
    assert (config.connect_timeout_s, config.timeout_s) == (1.0, 2.0)
    assert (config.capacity_bytes, config.io_threads, config.lookup_fanout) == (64 * GIB, 8, 4)
    assert (config.breaker_errors, config.breaker_cooldown_s, config.secret) == (8, 30.0, None)
    assert config.policy is EvictionPolicy.LRU


def test_every_object_key_is_typed_and_milliseconds_become_seconds() -> None:
    config = OffloadConfig.from_dict({
        "object_url": "s3://kv-cache/prod", "object_endpoint": "https://s3.example.com:8443",
        "object_region": "eu-west-1", "object_path_style": False, "object_connect_timeout_ms": 250,
        "object_timeout_ms": 1500.5, "object_gib": 0.5, "object_io_threads": 32, "object_lookup_fanout": 16,
        "object_breaker_errors": 2,
        "object_breaker_cooldown_s": 0.5, "eviction_policy": "arc"})
    assert config.object == ObjectTierConfig(
        bucket="kv-cache", prefix="prod", endpoint="https://s3.example.com:8443", region="eu-west-1",
        path_style=False, connect_timeout_s=0.25, timeout_s=1.5005, capacity_bytes=GIB // 2,
        policy=EvictionPolicy.ARC, io_threads=32, lookup_fanout=16, breaker_errors=2, breaker_cooldown_s=0.5)
    assert parsed(object_bytes=12345).capacity_bytes == 12345


@pytest.mark.parametrize(("key", "value", "culprit"), [
    ("object_timeout_ms", 0, "object_timeout_ms=0: must be a number in 1..3600000"),
    ("object_connect_timeout_ms", 3_600_001, "object_connect_timeout_ms=3600001"),
    ("object_io_threads", 0, "object_io_threads=0"),
    ("object_io_threads", 257, "object_io_threads=257"),
    ("object_lookup_fanout", 0, "object_lookup_fanout=0"),
    ("object_lookup_fanout", 65, "object_lookup_fanout=65"),
    ("object_bytes", 0, "object_bytes=0"),
    ("object_path_style", "yes", "object_path_style='yes': must be true or false"),
    ("object_region", "", "object_region='': must be a non-empty string"),
    ("object_breaker_errors", True, "object_breaker_errors=True"),
])
def test_a_bad_object_value_is_refused_naming_the_key(key: str, value: object, culprit: str) -> None:
    assert culprit in refusal({**URL, key: value})
