"""Tenants in the simulated engine: a flooding tenant's long, never-repeated prompts leave another tenant's prefix
in the host tier, and it hits bit-exact; the same flood without quotas evicts it (the control)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from tests.testing.test_sim import tokens

from kvoffload.testing.sim import SimEngine
from kvoffload.testing.sim_workload import make_engine, run_checked

QUOTAS = {"tenant_by": "cache_salt", "tenant_quota": {"default": 0.1, "acme": 0.5, "flood": 0.4}}


def flooded_prefix_hit(**config: Any) -> int:
    """acme runs a 24-token prompt (6 host blocks, within its share of 8), the flood tenant then 12 prompts of 40
    new tokens (120 blocks, 7 host tiers' worth), then acme's prompt returns after the device cache is dropped: the
    tokens it loads from the host tier."""
    engine: SimEngine = make_engine(host_blocks=16, **config)
    prefix = tokens(24, seed=1)
    engine.add_request("acme-0", prefix, extra_keys=("salt:acme",))
    run_checked(engine)
    for i in range(12):
        engine.add_request(f"flood-{i}", tokens(40, seed=100 + i), extra_keys=("salt:flood",))
        run_checked(engine)
    engine.pool.drop_cache()
    again = engine.add_request("acme-1", [*prefix, 7], extra_keys=("salt:acme",))
    run_checked(engine)
    return again.loaded_tokens


def test_a_flooding_tenant_leaves_another_tenants_prefix_resident_and_it_hits() -> None:
    assert flooded_prefix_hit(**QUOTAS) == 24


def test_control_the_same_flood_without_quotas_evicts_the_prefix() -> None:
    assert flooded_prefix_hit() == 0


def test_sim_requests_give_their_salt_or_lora_as_their_tenant() -> None:
    from kvoffload.config import TenantBy
    from kvoffload.testing.sim_values import SimRequest

    request = SimRequest("r", [1, 2], 1, ("lora:ad", "salt:acme"))
    assert request.tenant(TenantBy.CACHE_SALT) == "acme" and request.tenant(TenantBy.LORA) == "ad"
    assert request.tenant(TenantBy.NONE) is None and SimRequest("r", [1], 1).tenant(TenantBy.CACHE_SALT) is None


# ---- quotas changed on a running engine, and per-tenant figures ----------------------------------------------------



def look_at_quota_file(engine: SimEngine) -> None:
    """What the quota file's watcher thread does once a second, now (the engine applies it at its next step)."""
    tenants = engine.scheduler.tenants
    assert tenants is not None and tenants.quota_file is not None
    tenants.quota_file.check()


def flood_and_return(engine: SimEngine, prefix: list[int], tag: str) -> int:
    engine.add_request(f"acme-{tag}-0", prefix, extra_keys=("salt:acme",))
    run_checked(engine)
    for i in range(12):
        engine.add_request(f"flood-{tag}-{i}", tokens(40, seed=1000 * len(tag) + i), extra_keys=("salt:flood",))
        run_checked(engine)
    engine.pool.drop_cache()
    again = engine.add_request(f"acme-{tag}-1", [*prefix, 7], extra_keys=("salt:acme",))
    run_checked(engine)
    return again.loaded_tokens


def test_quotas_written_to_the_quota_file_take_effect_without_a_restart(tmp_path: Path) -> None:
    quota = tmp_path / "quota.json"
    quota.write_text(json.dumps({"default": 1.0}))  # nobody named: acme and the flood share "other"
    engine = make_engine(host_blocks=16, tenant_by="cache_salt", tenant_quota_file=str(quota))
    assert flood_and_return(engine, tokens(24, seed=1), "a") == 0  # the control: the flood evicts acme's prefix
    quota.write_text(json.dumps({"default": 0.1, "acme": 0.5, "flood": 0.4}))
    os.utime(quota, ns=(1, 1))  # a new modification time, whatever the file system's resolution
    look_at_quota_file(engine)
    assert flood_and_return(engine, tokens(24, seed=2), "bb") == 24
    tenants = engine.scheduler.tenants
    assert tenants is not None and tenants.quotas() == (0.1, (("acme", 0.5), ("flood", 0.4)))


def test_a_bad_quota_file_is_refused_and_the_quotas_stay(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    quota = tmp_path / "quota.json"
    quota.write_text(json.dumps({"default": 0.5, "acme": 0.5}))
    engine = make_engine(host_blocks=16, tenant_by="cache_salt", tenant_quota_file=str(quota))
    tenants = engine.scheduler.tenants
    assert tenants is not None
    for bad in ('{"default": 0.5, "acme": 0.9}', "not json", '{"acme": 0.5}'):
        quota.write_text(bad)
        os.utime(quota, ns=(len(bad), len(bad)))
        look_at_quota_file(engine)
        engine.add_request(f"r-{len(bad)}", tokens(8, seed=len(bad)), extra_keys=("salt:acme",))
        run_checked(engine)
        assert tenants.quotas() == (0.5, (("acme", 0.5),))
    assert tenants.quota_file is not None and tenants.quota_file.errors == 3
    assert "add up to 1.4" in caplog.text and "is not JSON" in caplog.text and 'with a "default"' in caplog.text


def test_each_tenants_tokens_and_blocks_are_counted() -> None:
    engine = make_engine(host_blocks=16, **QUOTAS)
    prefix = tokens(24, seed=1)
    engine.add_request("acme-0", prefix, extra_keys=("salt:acme",))
    engine.add_request("zed-0", tokens(8, seed=5), extra_keys=("salt:zed",))
    run_checked(engine)
    engine.pool.drop_cache()
    engine.add_request("acme-1", [*prefix, 7], extra_keys=("salt:acme",))
    run_checked(engine)
    figures = engine.scheduler.take_stats().tenants
    assert figures is not None
    assert figures.tokens == {"acme": [24 + 25, 24], "other": [8, 0]}  # zed is not named: "other"
    host = figures.tiers["host"]
    assert host["acme"][1:] == [6, 0, 6] and host["other"][1:] == [2, 0, 0] and host["flood"] == [0, 0, 0, 0]
    assert host["acme"][0] == 3 * host["other"][0] > 0
    again = engine.scheduler.take_stats().tenants
    assert again is None  # nothing changed since
