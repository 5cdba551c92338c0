"""Tenants on the node pool through the scheduler: two simulated engines share a pool; one engine's flooding tenant
leaves the other engine's tenant's prefix resident and it hits bit-exact (the control: the same flood without
quotas evicts it); new quotas in a quota file reach the pool's table; and a disk tier under the pool keeps each
block's tenant."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvoffload.testing import sim_workload
from kvoffload.testing.sim import SimEngine
from kvoffload.testing.sim_workload import run_checked, tokens
from kvoffload.tiers.node.index import NodeIndex

QUOTAS = {"tenant_by": "cache_salt", "tenant_quota": {"default": 0.1, "acme": 0.5, "flood": 0.4}}



def make_engine(node_path: Path, **config: Any) -> SimEngine:
    return sim_workload.make_engine(host_blocks=16, host_scope="node", node_path=str(node_path), **config)


def pool_of(engine: SimEngine) -> NodeIndex:
    index = engine.scheduler.index
    index = getattr(index, "host", index)
    assert isinstance(index, NodeIndex)
    return index


def prefix_after_flood(node_path: Path, **config: Any) -> int:
    """Engine a runs acme's 24-token prompt (6 pool blocks), engine b floods 12 prompts of 40 new tokens (120
    blocks, the pool is 16), then acme's prompt returns on a: the tokens it loads from the pool."""
    a, b = make_engine(node_path, **config), make_engine(node_path, **config)
    prefix = tokens(24, seed=1)
    a.add_request("acme-0", prefix, extra_keys=("salt:acme",))
    run_checked(a)
    for i in range(12):
        b.add_request(f"flood-{i}", tokens(40, seed=100 + i), extra_keys=("salt:flood",))
        run_checked(b)
    a.pool.drop_cache()
    again = a.add_request("acme-1", [*prefix, 7], extra_keys=("salt:acme",))
    run_checked(a)
    assert a.corrupt_blocks == [] and b.corrupt_blocks == []
    return again.loaded_tokens


def test_another_engines_flooding_tenant_leaves_the_prefix_in_the_pool_and_it_hits(node_path: Path) -> None:
    assert prefix_after_flood(node_path, **QUOTAS) == 24


def test_control_without_quotas_the_other_engines_flood_evicts_the_prefix(node_path: Path) -> None:
    assert prefix_after_flood(node_path) == 0


def test_new_quotas_in_the_quota_file_reach_the_pools_table(node_path: Path, tmp_path: Path) -> None:
    quota = tmp_path / "quota.json"
    quota.write_text(json.dumps({"default": 0.5, "acme": 0.5}))
    a = make_engine(node_path, tenant_by="cache_salt", tenant_quota_file=str(quota))
    b = make_engine(node_path, tenant_by="cache_salt", tenant_quota={"default": 0.5, "acme": 0.5})
    assert set(pool_of(b).tenant_counts()) == {"acme", "other"}
    quota.write_text(json.dumps({"default": 0.2, "acme": 0.4, "zed": 0.4}))
    os.utime(quota, ns=(1, 1))
    tenants = a.scheduler.tenants
    assert tenants is not None and tenants.quota_file is not None
    tenants.quota_file.check()  # what its watcher thread does once a second, now
    a.add_request("z", tokens(8, seed=3), extra_keys=("salt:zed",))
    run_checked(a)
    assert set(pool_of(b).tenant_counts()) == {"acme", "zed", "other"}  # the other engine sees the pool's table
    assert pool_of(a).tenant_counts()["zed"]["resident"] == 2  # and zed's blocks count for it, from the change on


def test_a_block_written_below_the_pool_keeps_its_tenant(node_path: Path, tmp_path: Path) -> None:
    engine = make_engine(node_path, disk_path=str(tmp_path / "disk"), disk_gib=0.01, **QUOTAS)
    engine.add_request("acme-0", tokens(24, seed=1), extra_keys=("salt:acme",))
    sim_workload.run_checked(engine, ship_write_through=True)
    tenants = engine.scheduler.tenants
    assert tenants is not None
    _, disk = tenants.book.policies
    assert disk.tier == "disk" and disk.figures()["acme"][0] == 6 and disk.figures()["other"][0] == 0
