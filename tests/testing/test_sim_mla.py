"""Latent attention (MLA) in the simulated engine with two tensor-parallel workers: every rank holds the same
bytes, so the disk and remote tiers keep one copy (on disk: one ``replicated/engine-<n>.kvs``), written once by
rank 0 and loaded bit-exact by both ranks; a per-rank layout keeps two copies, and a rank whose bytes were not the
same as rank 0's is caught."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from tests.testing.engines import MADE

from kvoffload.testing import layouts, sim_workload
from kvoffload.testing.redis_server import RedisServer
from kvoffload.testing.sim import SimEngine, Status
from kvoffload.testing.sim_workload import tokens
from kvoffload.testing.slot_files import slot_files, stored_blocks
from kvoffload.tiers.disk import handler as disk_handler
from kvoffload.transfer.skip_writes import SkipWrites

BLOCK = 4
PROMPT_BLOCKS = 4  # 16-token prompts


def make_engine(tier: dict[str, Any], layout_name: str = "latent", host_blocks: int = 4) -> SimEngine:
    MADE.append(sim_workload.make_engine(layouts.ALL_LAYOUTS[layout_name], block_size=BLOCK,
                                         host_blocks=host_blocks, workers=2, **tier))
    return MADE[-1]


def disk_tier(path: Path) -> dict[str, Any]:
    return {"disk_path": str(path), "disk_bytes": 1 << 20}


def table_entries(root: Path) -> list[tuple[str, bytes]]:
    """(file, name) of every block the slot files under ``root`` name."""
    return sorted((str(b.path), b.name) for p in slot_files(root) for b in stored_blocks(p))


def run_checked(engine: SimEngine) -> None:
    sim_workload.run_checked(engine, ship_write_through=True)


def offload_then_reload(engine: SimEngine) -> Any:
    """Run a prompt, push it out of the host tier and the device cache, then run a request that extends it."""
    prompt = tokens(16, seed=1)
    engine.add_request("a", prompt)
    run_checked(engine)
    for i in range(3):  # each fills the 4-block host tier
        engine.add_request(f"filler{i}", tokens(16, seed=100 + i))
        run_checked(engine)
    engine.pool.drop_cache()
    b = engine.add_request("b", [*prompt, 7])
    run_checked(engine)
    return b


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, bytes]]:
    """How many times each block was written, by (slot file, key) (the disk handler's one write call, per run)."""
    counts: Counter[tuple[str, bytes]] = Counter()
    real = disk_handler.write_run

    def counting(ops: Any, file: Any, first: int, keys: Any, *args: Any, **kwargs: Any) -> Any:
        counts.update((file.path, bytes(key)) for key in keys)
        return real(ops, file, first, keys, *args, **kwargs)

    monkeypatch.setattr(disk_handler, "write_run", counting)
    return counts


def test_replicated_blocks_are_one_copy_on_disk_written_once_and_both_ranks_load_it(
        tmp_path: Path, writes: Counter[tuple[str, bytes]]) -> None:
    engine = make_engine(disk_tier(tmp_path))
    b = offload_then_reload(engine)
    assert b.status is Status.FINISHED
    assert b.loaded_tokens == 16 and b.device_hit_tokens == 0
    assert engine.corrupt_blocks == [] and engine.verified_blocks >= PROMPT_BLOCKS  # both ranks' bytes checked
    (world,) = tmp_path.iterdir()
    assert [p.name for p in world.iterdir() if p.is_dir()] == ["replicated"]
    assert [p.relative_to(world).parts for p in slot_files(tmp_path)] == [("replicated", "engine-0.kvs")]
    entries = table_entries(tmp_path)
    assert len(entries) == 4 * PROMPT_BLOCKS  # "a" and three fillers, once each
    assert sorted(writes) == entries and set(writes.values()) == {1}
    assert [any(isinstance(h, SkipWrites) for h in w.transfers.handlers) for w in engine.workers] == [False, True]


def test_a_per_rank_layout_keeps_a_copy_per_rank(tmp_path: Path, writes: Counter[tuple[str, bytes]]) -> None:
    engine = make_engine(disk_tier(tmp_path), layout_name="attention")
    b = offload_then_reload(engine)
    assert b.loaded_tokens == 16 and engine.corrupt_blocks == []
    (world,) = tmp_path.iterdir()
    assert sorted(p.name for p in world.iterdir() if p.is_dir()) == ["rank0", "rank1"]
    assert [p.parent.name for p in slot_files(tmp_path)] == ["rank0", "rank1"]
    assert len(table_entries(tmp_path)) == len(writes) == 2 * 4 * PROMPT_BLOCKS


def test_a_rank_whose_bytes_differ_from_rank_0s_loads_wrong_bytes_and_is_caught(tmp_path: Path) -> None:
    engine = make_engine(disk_tier(tmp_path))
    engine.page_ranks = [0, 1]  # rank 1 computes other bytes, as if the latent were not the same on every rank
    b = offload_then_reload(engine)
    assert b.loaded_tokens == 16
    assert engine.corrupt_blocks == [("b", i) for i in range(PROMPT_BLOCKS)]


def test_rank_0s_failed_write_fails_the_store_for_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_handler, "write_run", refuse)
    engine = make_engine(disk_tier(tmp_path))
    b = offload_then_reload(engine)
    assert b.status is Status.FINISHED and b.loaded_tokens == 0  # nothing was indexed: recomputed
    assert engine.corrupt_blocks == [] and table_entries(tmp_path) == []


# ---- the remote tier (a real redis-server) ------------------------------------------------------------------


@pytest.fixture
def server(redis_server: RedisServer, redis_client: Any) -> RedisServer:
    """The session's redis-server, emptied for this test (``redis_client`` empties it)."""
    return redis_server


def value_names(url: str) -> list[str]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return sorted(k.decode() for k in client.keys("*"))
    finally:
        client.close()


@pytest.mark.parametrize(("layout_name", "copies", "prefixes"), [("latent", 1, {"rep"}),
                                                                ("attention", 2, {"r0", "r1"})])
def test_the_remote_tier_keeps_one_copy_of_replicated_blocks_and_one_per_rank_otherwise(
        server: RedisServer, layout_name: str, copies: int, prefixes: set[str]) -> None:
    engine = make_engine({"remote_url": server.url, "remote_bytes": 1 << 24, "remote_timeout_ms": 500},
                         layout_name=layout_name)
    b = offload_then_reload(engine)
    assert b.loaded_tokens == 16 and engine.corrupt_blocks == []
    names = value_names(server.url)
    assert len(names) == copies * 4 * PROMPT_BLOCKS
    assert {name.split(":")[2] for name in names} == prefixes
