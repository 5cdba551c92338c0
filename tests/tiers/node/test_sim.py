"""Two simulated engines (their own schedulers and workers) on one node pool: a prefix one engine computed is a
bit-exact load for the other, with or without a disk tier below, and the other engine's own cache is not used."""

from __future__ import annotations

from pathlib import Path

from kvoffload.testing import sim_workload
from kvoffload.testing.sim import SimEngine, Status
from kvoffload.testing.sim_workload import run_checked, tokens
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.node.index import NodeIndex


def make_engine(node_path: Path, host_blocks: int = 16, workers: int = 1, **config: object) -> SimEngine:
    return sim_workload.make_engine(host_blocks=host_blocks, workers=workers, host_scope="node",
                                    node_path=str(node_path), **config)


def test_a_prefix_engine_a_computed_loads_bit_exact_in_engine_b(node_path: Path) -> None:
    a, b = make_engine(node_path), make_engine(node_path)
    prompt = tokens(16, seed=1)
    a.add_request("a", prompt)
    run_checked(a)
    second = b.add_request("b", [*prompt, 7])
    run_checked(b)
    assert second.status is Status.FINISHED
    assert second.loaded_tokens == 16 and second.device_hit_tokens == 0
    assert b.corrupt_blocks == [] and b.verified_blocks >= 4
    assert b.scheduler.pool_counters()["cross_hits"] == 4


def test_the_check_is_shown_to_catch_a_corrupt_pool(node_path: Path) -> None:
    """The bit-exact comparison above fails when the shared bytes are wrong (here, overwritten behind its back)."""
    a, b = make_engine(node_path), make_engine(node_path)
    prompt = tokens(16, seed=2)
    a.add_request("a", prompt)
    run_checked(a)
    a.workers[0].pool.buffer.fill_(3)  # B maps the same pages
    b.add_request("b", [*prompt, 7])
    b.run()
    assert len(b.corrupt_blocks) == 4


def test_with_a_disk_tier_below_a_block_evicted_from_the_pool_comes_back(node_path: Path, tmp_path: Path) -> None:
    a = make_engine(node_path, host_blocks=4, disk_path=str(tmp_path), disk_bytes=1 << 24)
    b = make_engine(node_path, host_blocks=4, disk_path=str(tmp_path), disk_bytes=1 << 24)
    prompt = tokens(16, seed=5)
    a.add_request("a", prompt)
    run_checked(a)
    for i in range(3):  # other prompts push the prefix out of the 4-slot pool
        a.add_request(f"filler{i}", tokens(16, seed=10 + i))
        run_checked(a)
    (disk,) = [i for i in b.scheduler.index.lower_indexes if isinstance(i, DiskIndex)]
    assert disk._foreign is not None
    disk._foreign.refresh()  # what b's table thread does within a quarter of a second of a's stores
    second = b.add_request("b", [*prompt, 7])
    run_checked(b)
    assert second.loaded_tokens == 16 and b.corrupt_blocks == []


def test_two_tensor_parallel_engines_share_one_pool_file_per_rank(node_path: Path) -> None:
    a, b = make_engine(node_path, workers=2), make_engine(node_path, workers=2)
    prompt = tokens(16, seed=6)
    a.add_request("a", prompt)
    run_checked(a)
    second = b.add_request("b", [*prompt, 7])
    run_checked(b)
    assert second.loaded_tokens == 16 and b.corrupt_blocks == []  # each rank's bytes from its own file
    (directory,) = (d for d in node_path.glob("kvoffload-node-*/*") if d.is_dir())
    assert sorted(p.name for p in directory.iterdir()) == ["engines", "index", "pool.0", "pool.1"]


def test_engines_with_tenants_share_one_pool_with_the_first_engines_table(node_path: Path) -> None:
    """tenant_by with host_scope node: the engines run bit-exact, the pool holds the table, and each engine's
    index offers the book a scheduler assigns stores in (``tenant_book``)."""
    quota = {"tenant_by": "cache_salt", "tenant_quota": {"default": 0.5, "acme": 0.5}}
    a, b = make_engine(node_path, **quota), make_engine(node_path, **quota)
    prompt = tokens(16, seed=7)
    a.add_request("a", prompt)
    run_checked(a)
    second = b.add_request("b", [*prompt, 7])
    run_checked(b)
    assert second.loaded_tokens == 16 and b.corrupt_blocks == []
    index = b.scheduler.index
    assert isinstance(index, NodeIndex) and index.tenant_book is not None
    assert index.tenant_book.names == ("acme", "other")
    counts = index.tenant_counts()
    assert set(counts) == {"acme", "other"} and sum(c["resident"] for c in counts.values()) >= 4
