"""The simulated engine with a small host tier over the remote tier (a real redis-server): prefixes evicted from the
host come back from the server bit-exact, across two workers and between two engines sharing the server, and a
server that dies mid-run costs recomputes, never a wrong token or a crash."""

from __future__ import annotations

from typing import Any

import pytest

from kvoffload.index.tiered import TieredIndex
from kvoffload.testing import sim_workload
from kvoffload.testing.redis_server import RedisServer
from kvoffload.testing.sim import SimEngine, Status
from kvoffload.testing.sim_workload import tokens
from kvoffload.tiers.remote.index import RemoteIndex

redis = pytest.importorskip("redis")


def make_engine(url: str, host_blocks: int = 4, workers: int = 1, **config: object) -> SimEngine:
    return sim_workload.make_engine(host_blocks=host_blocks, workers=workers, remote_url=url, remote_bytes=1 << 24,
                                    remote_timeout_ms=500, **config)


def remote_index(engine: SimEngine) -> RemoteIndex:
    manager = engine.scheduler.index
    assert isinstance(manager, TieredIndex) and isinstance(manager.lower_indexes[0], RemoteIndex)
    return manager.lower_indexes[0]


def run_checked(engine: SimEngine) -> None:
    sim_workload.run_checked(engine, ship_write_through=True)


def push_out_of_host(engine: SimEngine) -> None:
    """Other prompts fill the small host tier (4 blocks) and the device cache: the first prompt is remote only."""
    for i in range(3):
        engine.add_request(f"filler{i}", tokens(16, seed=100 + i))
        run_checked(engine)
    engine.pool.drop_cache()


def values(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.dbsize())
    finally:
        client.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_prefix_evicted_from_host_comes_back_from_the_server_bit_exact(server: RedisServer, workers: int) -> None:
    engine = make_engine(server.url, workers=workers)
    prompt = tokens(16, seed=1)
    engine.add_request("a", prompt)
    run_checked(engine)
    push_out_of_host(engine)
    b = engine.add_request("b", [*prompt, 7])
    run_checked(engine)
    assert b.status is Status.FINISHED
    assert b.loaded_tokens == 16 and b.device_hit_tokens == 0
    assert engine.corrupt_blocks == [] and engine.verified_blocks >= 4
    assert values(server.url) == 16 * workers  # every rank's value of the four prompts' blocks
    assert {"host_to_remote", "remote_to_host"} <= set(engine.transfer_stats[0].by_type)
    engine.scheduler.index.check_integrity()


def test_two_engines_sharing_a_server_hit_each_others_prefixes_bit_exact(server: RedisServer) -> None:
    first, second = make_engine(server.url), make_engine(server.url)
    prompt = tokens(16, seed=2)
    first.add_request("a", prompt)
    run_checked(first)
    b = second.add_request("b", [*prompt, 7])  # a fresh host tier and device cache: only the server has it
    run_checked(second)
    assert b.loaded_tokens == 16 and second.corrupt_blocks == []
    assert remote_index(second).usage()[0].used_blocks == 0  # read, not written: not in its budget


def test_a_server_killed_mid_run_costs_recomputes_not_wrong_tokens(own_server: RedisServer,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(own_server.url)
    prompt = tokens(16, seed=3)
    engine.add_request("a", prompt)
    run_checked(engine)
    push_out_of_host(engine)
    own_server.kill()
    b = engine.add_request("b", [*prompt, 7])
    others = [engine.add_request(f"c{i}", tokens(24, seed=200 + i), max_new_tokens=3) for i in range(3)]
    run_checked(engine)
    assert all(r.status is Status.FINISHED for r in [b, *others])
    assert b.loaded_tokens == 0 and engine.corrupt_blocks == []
    engine.scheduler.index.check_integrity()


@pytest.mark.parametrize("how", ["evicted", "restarted"])
def test_values_gone_between_lookup_and_promotion_cost_a_recompute(own_server: RedisServer, how: str) -> None:
    engine = make_engine(own_server.url)
    prompt = tokens(16, seed=4)
    engine.add_request("a", prompt)
    run_checked(engine)
    push_out_of_host(engine)
    b = engine.add_request("b", [*prompt, 7])
    assert engine.scheduler.get_num_new_matched_tokens(b, 0) == (None, False)  # a promotion is queued ...
    if how == "evicted":
        redis.Redis.from_url(own_server.url).flushall()  # ... and the server drops every value before it runs
    else:
        own_server.restart()  # ... or comes back empty
    run_checked(engine)
    assert b.status is Status.FINISHED and b.loaded_tokens == 0
    assert engine.corrupt_blocks == []
    engine.scheduler.index.check_integrity()


def test_the_worker_registers_the_remote_handler_both_ways(server: RedisServer) -> None:
    from kvoffload.blocks import Medium
    from kvoffload.tiers.remote.handler import RemoteHandler

    engine = make_engine(server.url)
    routes: dict[Any, Any] = engine.workers[0].transfers._routes
    assert isinstance(routes[(Medium.HOST, Medium.REMOTE)], RemoteHandler)
    assert routes[(Medium.REMOTE, Medium.HOST)] is routes[(Medium.HOST, Medium.REMOTE)]


def test_two_engines_with_own_disks_over_one_server_hit_remote_then_local_bit_exact(
        own_server: RedisServer, tmp_path: Any) -> None:
    """Host over disk and remote: engine B's first hit on A's prefix comes from the server and is written to B's
    disk, so after the server dies B still hits it, from its own disk."""
    disk = {"disk_bytes": 1 << 24}
    first = make_engine(own_server.url, disk_path=str(tmp_path / "a"), **disk)
    second = make_engine(own_server.url, disk_path=str(tmp_path / "b"), **disk)
    prompt = tokens(16, seed=5)
    first.add_request("a", prompt)
    run_checked(first)
    b = second.add_request("b", [*prompt, 7])
    run_checked(second)
    assert b.loaded_tokens == 16 and second.corrupt_blocks == []
    assert {"remote_to_host", "host_to_disk"} <= set(second.transfer_stats[0].by_type)
    push_out_of_host(second)
    own_server.kill()
    c = second.add_request("c", [*prompt, 8])
    run_checked(second)
    assert c.status is Status.FINISHED and c.loaded_tokens == 16  # from B's disk: the server is gone
    assert second.corrupt_blocks == [] and second.verified_blocks >= 8
    second.scheduler.index.check_integrity()
