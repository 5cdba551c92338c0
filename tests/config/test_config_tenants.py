"""tenant_by and tenant_quota: parsed into ``TenantConfig``, off by default, and every bad value a ConfigError naming
the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvoffload.config import ConfigError, OffloadConfig, TenantBy, TenantConfig


def test_tenants_are_off_by_default() -> None:
    assert OffloadConfig.from_dict({}).tenants is None
    assert OffloadConfig.from_dict({"tenant_by": "none"}).tenants is None


def test_quotas_parse_into_the_default_and_named_shares_in_order() -> None:
    config = OffloadConfig.from_dict({"tenant_by": "cache_salt",
                                      "tenant_quota": {"default": 0.2, "shared": 0.3, "acme": 0.5}})
    assert config.tenants == TenantConfig(TenantBy.CACHE_SALT, 0.2, (("shared", 0.3), ("acme", 0.5)))


@pytest.mark.parametrize(("raw", "message"), [
    ({"tenant_quota": {"default": 1}}, "tenant_quota given without tenant_by"),
    ({"tenant_by": "none", "tenant_quota": {"default": 1}}, "tenant_quota given without tenant_by"),
    ({"tenant_by": "lora"}, "tenant_by lora given without tenant_quota or tenant_quota_file"),
    ({"tenant_by": "salt", "tenant_quota": {"default": 1}}, "tenant_by="),
    ({"tenant_by": "lora", "tenant_quota": {"acme": 0.5}}, 'tenant_quota=.*with a "default"'),
    ({"tenant_by": "lora", "tenant_quota": [0.5]}, "tenant_quota=.*must be a mapping"),
    ({"tenant_by": "lora", "tenant_quota": {"default": 0}}, r"tenant_quota=.*default: fraction 0 must be .*\(0, 1\]"),
    ({"tenant_by": "lora", "tenant_quota": {"default": 0.5, "a": 1.5}}, "tenant_quota=.*a: fraction 1.5"),
    ({"tenant_by": "lora", "tenant_quota": {"default": 0.5, "a": True}}, "tenant_quota=.*a: fraction True"),
    ({"tenant_by": "lora", "tenant_quota": {"default": 0.5, "a": float("nan")}}, "tenant_quota=.*a: fraction nan"),
    ({"tenant_by": "lora", "tenant_quota": {"default": 0.5, "": 0.1}}, "tenant_quota=.*tenant name '' must"),
    ({"tenant_by": "lora", "tenant_quota": {"default": 0.5, 7: 0.1}}, "tenant_quota=.*tenant name 7 must"),
    ({"tenant_by": "lora", "tenant_quota": {"default": 0.5, "other": 0.1}}, 'tenant_quota=.*"other" is the name'),
    ({"tenant_by": "lora", "tenant_quota": {"default": 0.7, "a": 0.5}}, "tenant_quota=.*add up to 1.2"),
    ({"tenant_by": "lora", "tenant_quota": {"default": 0.01, **{f"t{i}": 0.01 for i in range(17)}}},
     "tenant_quota=.*names 17 tenants; at most 16"),
])
def test_bad_tenant_keys_are_config_errors_naming_the_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OffloadConfig.from_dict(raw)


def test_tenants_are_accepted_with_the_node_pool() -> None:
    """The node pool keeps tenants' shares in its shared index (docs/node.md, "Tenants")."""
    config = OffloadConfig.from_dict({"tenant_by": "lora", "tenant_quota": {"default": 1}, "host_scope": "node"})
    assert config.tenants == TenantConfig(TenantBy.LORA, 1.0)


def test_sixteen_named_tenants_and_shares_adding_up_to_one_are_accepted() -> None:
    quota = {"default": 0.2, **{f"t{i}": 0.05 for i in range(16)}}
    config = OffloadConfig.from_dict({"tenant_by": "cache_salt", "tenant_quota": quota})
    assert config.tenants is not None and len(config.tenants.shares) == 16


def test_a_quota_file_is_read_at_start_up_and_kept_for_re_reading(tmp_path: Path) -> None:
    quota = tmp_path / "quota.json"
    quota.write_text(json.dumps({"default": 0.2, "acme": 0.8}))
    config = OffloadConfig.from_dict({"tenant_by": "cache_salt", "tenant_quota_file": str(quota)})
    assert config.tenants == TenantConfig(TenantBy.CACHE_SALT, 0.2, (("acme", 0.8),), quota)


@pytest.mark.parametrize(("content", "message"), [
    (None, "tenant_quota_file=.*cannot read"),
    ("{", "tenant_quota_file=.*is not JSON"),
    ('{"default": 0.5, "a": 0.9}', "tenant_quota_file=.*add up to 1.4"),
    ('{"a": 0.5}', 'tenant_quota_file=.*with a "default"'),
    (" " * (64 * 1024 + 1), "tenant_quota_file=.*larger than 65536 bytes"),
])
def test_a_bad_quota_file_is_a_config_error_naming_the_key(tmp_path: Path, content: str | None, message: str
                                                            ) -> None:
    quota = tmp_path / "quota.json"
    if content is not None:
        quota.write_text(content)
    with pytest.raises(ConfigError, match=message):
        OffloadConfig.from_dict({"tenant_by": "cache_salt", "tenant_quota_file": str(quota)})


def test_quotas_given_twice_or_without_tenant_by_are_refused(tmp_path: Path) -> None:
    quota = tmp_path / "quota.json"
    quota.write_text(json.dumps({"default": 1}))
    with pytest.raises(ConfigError, match="tenant_quota and tenant_quota_file both given"):
        OffloadConfig.from_dict({"tenant_by": "lora", "tenant_quota": {"default": 1},
                                 "tenant_quota_file": str(quota)})
    with pytest.raises(ConfigError, match="tenant_quota_file given without tenant_by"):
        OffloadConfig.from_dict({"tenant_quota_file": str(quota)})
