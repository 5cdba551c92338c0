"""The ram tier end to end on the simulated engine, turned on by ``extra_tiers`` and found through its entry point:
a host tier too small to keep a prefix, so the repeated prefix is promoted from the ram tier into host and loaded
bit-exact. Two controls make the checks mean something: without the tier the same prefix is recomputed (no
hits to count), and a ram tier that corrupts its loads is caught by the engine's bit-for-bit check.

The simulated model's tokens depend on the prompt only, so "same outputs as without offloading" is checked where
it can fail: every loaded device block, on every worker, is compared with the bytes a computation produces
(``SimEngine.corrupt_blocks``, ``verified_blocks``), and the generated tokens with a run that has no lower tier.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from kvoffload.connector.stats import TransferStats
from kvoffload.testing import sim_workload
from kvoffload.testing.sim import SimEngine, SimRequest, Status
from kvoffload.testing.sim_workload import tokens

BLOCK = 4
PROMPT_BLOCKS = 4


def make_engine(workers: int = 1, **tiers: dict[str, Any]) -> SimEngine:
    extra: dict[str, Any] = {"extra_tiers": tiers} if tiers else {}
    return sim_workload.make_engine(block_size=BLOCK, host_blocks=PROMPT_BLOCKS, workers=workers, **extra)


def run_checked(engine: SimEngine) -> None:
    sim_workload.run_checked(engine, ship_write_through=True)


def repeated_prefix(engine: SimEngine) -> SimRequest:
    """Run a prompt, push it out of the host tier (4 blocks) and the device cache, then run it again."""
    prompt = tokens(PROMPT_BLOCKS * BLOCK, seed=1)
    engine.add_request("a", prompt)
    run_checked(engine)
    for i in range(3):
        engine.add_request(f"filler{i}", tokens(PROMPT_BLOCKS * BLOCK, seed=100 + i))
        run_checked(engine)
    engine.pool.drop_cache()
    again = engine.add_request("b", [*prompt, 7], max_new_tokens=4)
    run_checked(engine)
    assert again.status is Status.FINISHED
    return again


def promoted_jobs(engine: SimEngine) -> int:
    stats = functools.reduce(TransferStats.aggregate, engine.transfer_stats, TransferStats())
    counters = stats.by_type.get("ramtier_to_host")
    assert counters is None or counters.failed_jobs == 0
    return counters.jobs if counters else 0


@pytest.mark.parametrize("workers", [1, 2])
def test_a_prefix_evicted_from_host_comes_back_from_the_ram_tier_bit_exact(workers: int,
                                                                          ramtier_installed: Path) -> None:
    plain = repeated_prefix(make_engine(workers))
    assert plain.loaded_tokens == 0  # the control: the host tier alone cannot keep it

    engine = make_engine(workers, ramtier={"capacity_blocks": 64})
    b = repeated_prefix(engine)
    assert b.loaded_tokens == PROMPT_BLOCKS * BLOCK and b.device_hit_tokens == 0
    assert promoted_jobs(engine) > 0
    assert engine.corrupt_blocks == [] and engine.verified_blocks >= PROMPT_BLOCKS
    assert b.all_token_ids == plain.all_token_ids
    usage = {u.medium.value: u.used_blocks for u in engine.scheduler.index.usage()}
    assert usage["ramtier"] > PROMPT_BLOCKS  # the fillers were written through too
    engine.scheduler.index.check_integrity()


def test_a_ram_tier_that_corrupts_its_loads_is_caught(ramtier_installed: Path) -> None:
    engine = make_engine(ramtier={"capacity_blocks": 64, "corrupt_loads": True})
    with pytest.raises(AssertionError, match="request b: wrong device bytes"):
        repeated_prefix(engine)  # the step's check of the running request's device blocks
    assert promoted_jobs(engine) > 0
    assert [i for _, i in engine.corrupt_blocks] == list(range(PROMPT_BLOCKS))  # every loaded block seen wrong


def test_a_ram_tier_smaller_than_the_prefix_still_serves_only_right_bytes(ramtier_installed: Path) -> None:
    engine = make_engine(ramtier={"capacity_blocks": 2})  # the fillers' blocks push the prefix out of it
    b = repeated_prefix(engine)
    assert b.loaded_tokens < PROMPT_BLOCKS * BLOCK
    assert engine.corrupt_blocks == []
    engine.scheduler.index.check_integrity()


def test_with_tenants_on_the_plugin_tier_keeps_shares_through_its_context(ramtier_installed: Path) -> None:
    from kvoffload.index.tenants import TenantPolicy

    engine = sim_workload.make_engine(block_size=BLOCK, host_blocks=PROMPT_BLOCKS, tenant_by="cache_salt",
                                      tenant_quota={"default": 0.5, "acme": 0.5},
                                      extra_tiers={"ramtier": {"capacity_blocks": 16}})
    tenants = engine.scheduler.tenants
    assert tenants is not None
    assert [policy.tier for policy in tenants.book.policies] == ["host", "ramtier"]
    below = engine.scheduler.index.lower_indexes[0]  # type: ignore[attr-defined]
    assert isinstance(below.host_policy, TenantPolicy)


@pytest.mark.parametrize("hinted", [True, False])
def test_retention_hints_reach_the_plugin_tier_through_its_context(ramtier_installed: Path, hinted: bool) -> None:
    # The host holds 4 blocks, the ram tier 8: a hinted prompt's blocks stay in the ram tier through 6 fillers' 24
    # blocks and its repeat loads them all; without the hint the fillers push them out (the control).
    engine = sim_workload.make_engine(block_size=BLOCK, host_blocks=PROMPT_BLOCKS,
                                      extra_tiers={"ramtier": {"capacity_blocks": 8}})
    retention = engine.scheduler.retention
    assert retention is not None
    assert [tier.tier for tier in retention.book.tiers] == ["host", "ramtier"]
    prompt = tokens(PROMPT_BLOCKS * BLOCK, seed=3)
    first = engine.add_request("a", prompt)
    first.kv_transfer_params = {"kvoffload": {"retain_s": 600}} if hinted else None
    run_checked(engine)
    for i in range(6):
        engine.add_request(f"filler-{i}", tokens(PROMPT_BLOCKS * BLOCK, seed=50 + i))
        run_checked(engine)
    engine.pool.drop_cache()
    again = engine.add_request("b", [*prompt, 1])
    run_checked(engine)
    assert (again.loaded_tokens == PROMPT_BLOCKS * BLOCK) == hinted
    assert engine.corrupt_blocks == []
