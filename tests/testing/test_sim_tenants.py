"""Tenants in the simulated engine: a flooding tenant's long, never-repeated prompts leave another tenant's prefix
in the host tier, and it hits bit-exact; the same flood without quotas evicts it (the control)."""

from __future__ import annotations

from typing import Any

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
