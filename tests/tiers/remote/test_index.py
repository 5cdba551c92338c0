"""RemoteIndex against a real redis-server: lookups ask the server, the budget deletes only this engine's
values, engines share values within a namespace, answers are remembered for the cache time only, and a cluster is
asked by slot (a server that fails: test_index_faults.py)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from tests.tiers.remote.indexes import (
    NS,
    NS2,
    VALUE,
    Counting,
    SettledRemoteIndex,
    config,
    exists,
    keys,
    make,
    removed,
    stored,
    write,
)

from kvoffload.auth import TierSecret
from kvoffload.blocks import Medium, TierBlocks
from kvoffload.config import ConfigError, OffloadConfig, RemoteTierConfig
from kvoffload.index.base import EventKind, LookupResult
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.lower import probed_index
from kvoffload.tiers.lower.block_format import PLAIN, BlockFormat
from kvoffload.tiers.remote.client import value_name
from kvoffload.tiers.remote.index import RemoteIndex
from kvoffload.tiers.remote.probe import FIRST_WINDOW, ValueNames
from kvoffload.tiers.spec import TierContext

redis = pytest.importorskip("redis")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def url(redis_server: RedisServer, redis_client: Any) -> str:
    return redis_server.url


# ---- lookups ----------------------------------------------------------------------------------------------------


def test_lookup_counts_the_leading_keys_whose_values_exist(url: str, redis_client: Any) -> None:
    m = make(url)
    ks = keys(5)
    write(redis_client, ks[:3] + ks[4:])
    assert m.lookup(ks) == LookupResult(3)
    assert m.lookup(ks[:3]) == LookupResult(3)
    assert m.lookup([]) == LookupResult(0)


def test_a_value_the_server_evicted_is_a_miss_and_leaves_this_engines_index(url: str, redis_client: Any) -> None:
    m = make(url)
    ks = stored(m, redis_client, keys(3))
    m.take_events()
    redis_client.delete(value_name(NS, PLAIN, ks[1]))  # the server's eviction
    assert m.lookup(ks) == LookupResult(1)
    assert removed(m.take_events()) == [ks[1]]
    assert m.usage()[0].used_blocks == 2
    m.check_integrity()


def test_a_key_is_a_hit_only_when_every_ranks_value_exists(url: str, redis_client: Any) -> None:
    m = make(url, ns=NS2)
    ks = keys(3)
    write(redis_client, ks, NS2, ranks=range(1))
    write(redis_client, ks[:2], NS2, ranks=range(1, 2))  # rank 1's third value was evicted
    assert m.lookup(ks) == LookupResult(2)


@pytest.mark.parametrize("cluster", [False, True], ids=["counting", "pipelined"])
@pytest.mark.parametrize("world", [1, 3])
def test_lookup_finds_the_exact_run_whatever_exists(url: str, redis_client: Any, cluster: bool,
                                                    world: int) -> None:
    """Random holes, in random ranks: the counting search (and the cluster's pipelines) agree with a brute count."""
    ns = dataclasses.replace(NS, world_size=world)
    m = make(url, ns=ns, cluster=cluster, client=redis.Redis.from_url(url))
    rng = random.Random(world)
    for trial in range(40):
        redis_client.flushall()
        ks = keys(rng.choice([1, 7, FIRST_WINDOW, 300, 1500]), salt=trial)
        density, prefix = rng.choice([0.5, 0.98, 1.0]), rng.randrange(len(ks) + 1) * world
        present = [i < prefix or rng.random() < density for i in range(len(ks) * world)]
        names = ValueNames(ns, PLAIN).of(ks)
        redis_client.mset({name: b"v" for name, there in zip(names, present, strict=True) if there} or {"x": 1})
        expected = next((i for i in range(len(ks)) if not all(present[i * world:(i + 1) * world])), len(ks))
        assert m.lookup(ks).hits == expected, (trial, len(ks), density)


def test_a_run_that_counting_cannot_pin_down_quickly_is_counted_exactly(url: str, redis_client: Any) -> None:
    client = Counting(redis.Redis.from_url(url))
    m = make(url, client=client)
    ks = keys(2000)
    write(redis_client, ks[:1000] + ks[1001::2])  # a long run, then every other value
    assert m.lookup(ks).hits == 1000
    assert "exists (pipelined)" in client.commands and len(client.commands) < 1000


def test_a_prompt_of_2048_keys_costs_a_few_commands(url: str, redis_client: Any) -> None:
    client = Counting(redis.Redis.from_url(url))
    m = make(url, client=client)
    ks = keys(2048)
    write(redis_client, ks[:1000])
    client.commands.clear()
    assert m.lookup(ks).hits == 1000
    assert client.commands == ["exists"] * len(client.commands) and len(client.commands) <= 4
    client.commands.clear()
    assert m.lookup(keys(2048, salt=9)).hits == 0  # a new prompt: one small command
    assert client.commands == ["exists"]


def test_value_names_are_the_workers_names_of_every_rank() -> None:
    fmt = BlockFormat.of(TierSecret("test", b"s" * 32))
    ks = keys(3)
    assert ValueNames(NS2, fmt).of(ks) == [value_name(NS2, fmt, k, r) for k in ks for r in range(2)]


def test_a_replicated_namespace_has_one_value_name_a_key_that_every_rank_uses() -> None:
    ns = dataclasses.replace(NS2, replicated=True)
    ks = keys(3)
    names = ValueNames(ns, PLAIN).of(ks)
    assert names == [value_name(dataclasses.replace(ns, rank=1), PLAIN, k) for k in ks]
    assert names == [value_name(ns, PLAIN, k, 1) for k in ks]  # an explicit rank still names the one copy
    assert all(":rep:" in name for name in names)


def test_another_namespace_never_sees_the_values(url: str, redis_client: Any) -> None:
    ks = keys(2)
    write(redis_client, ks)
    other_model = make(url, ns=dataclasses.replace(NS, model="other"))
    with_secret = make(url, secret=TierSecret("test", b"s" * 32))
    assert other_model.lookup(ks).hits == 0 and with_secret.lookup(ks).hits == 0
    assert make(url).lookup(ks).hits == 2


# ---- the budget and two engines ------------------------------------------------------------------------------


def test_budget_deletes_this_engines_oldest_values_and_never_another_engines(url: str,
                                                                             redis_client: Any) -> None:
    a, b = make(url, blocks=2), make(url, blocks=2)
    theirs = stored(b, redis_client, keys(2, salt=1))
    first = stored(a, redis_client, keys(2))
    newer = stored(a, redis_client, keys(1, salt=2))
    assert not exists(redis_client, first[1]) and exists(redis_client, first[0])  # a prefix's tail goes first
    assert all(exists(redis_client, k) for k in theirs + newer)
    assert removed(a.take_events()) == [first[1]]
    assert [(u.medium, u.used_blocks, u.capacity_blocks) for u in a.usage()] == [(Medium.REMOTE, 2, 2)]


def test_two_engines_on_one_server_load_each_others_values(url: str, redis_client: Any) -> None:
    a, b = make(url), make(url)
    ks = stored(a, redis_client, keys(3))
    assert b.lookup(ks).hits == 3
    assert b.prepare_load(ks) == TierBlocks(Medium.REMOTE, tuple(ks), (3,))
    b.complete_load(ks)
    assert b.usage()[0].used_blocks == 0  # read, not owned
    b.reset()
    assert all(exists(redis_client, k) for k in ks)


def test_a_failed_load_of_another_engines_value_is_a_miss_and_leaves_it_alone(url: str,
                                                                             redis_client: Any) -> None:
    clock = FakeClock()
    a, b = make(url), make(url, cache_s=1.0, clock=clock)
    ks = stored(a, redis_client, keys(2))
    assert b.lookup(ks).hits == 2
    b.prepare_load(ks)
    b.complete_load(ks, success=False)  # e.g. damaged: the worker deleted it, or it is still there
    assert b.lookup(ks).hits == 0 and all(exists(redis_client, k) for k in ks)
    clock.now += 1.0
    assert b.lookup(ks).hits == 2  # asked anew once the answer is old


def test_a_pinned_value_is_not_deleted_by_the_budget(url: str, redis_client: Any) -> None:
    m = make(url, blocks=2)
    ks = stored(m, redis_client, keys(2))
    m.prepare_load(ks)  # a promotion reads them
    assert m.prepare_store(keys(1, salt=1)) is None
    m.complete_load(ks)
    assert m.prepare_store(keys(1, salt=1)) is not None
    assert exists(redis_client, ks[0]) and not exists(redis_client, ks[1])
    m.check_integrity()


def test_a_failed_load_of_its_own_value_deletes_every_ranks_value(url: str, redis_client: Any) -> None:
    m = make(url, ns=NS2)
    ks = stored(m, redis_client, keys(2), NS2)
    m.prepare_load(ks[:1])
    m.complete_load(ks[:1], success=False)
    assert not exists(redis_client, ks[0], NS2, 0) and not exists(redis_client, ks[0], NS2, 1)
    assert exists(redis_client, ks[1], NS2, 1)


def test_a_failed_store_deletes_the_values_some_ranks_wrote(url: str, redis_client: Any) -> None:
    m = make(url, ns=NS2)
    out = m.prepare_store(keys(1))
    assert out is not None
    write(redis_client, list(out.keys_to_store), NS2, ranks=range(1))  # rank 1 failed
    m.complete_store(out.keys_to_store, success=False)
    assert not exists(redis_client, out.keys_to_store[0], NS2)
    assert m.lookup(out.keys_to_store).hits == 0 and m.usage()[0].used_blocks == 0
    m.check_integrity()


def test_reset_deletes_its_own_values_only(url: str, redis_client: Any) -> None:
    m = make(url)
    ours, theirs = stored(m, redis_client, keys(2)), keys(2, salt=1)
    write(redis_client, theirs)
    m.reset()
    assert not any(exists(redis_client, k) for k in ours) and all(exists(redis_client, k) for k in theirs)
    assert m.usage()[0].used_blocks == 0


def test_events_name_the_remote_medium(url: str, redis_client: Any) -> None:
    m = make(url, blocks=1)
    first = stored(m, redis_client, keys(1))
    second = stored(m, redis_client, keys(1, salt=1))
    assert [(e.kind, e.keys, e.medium) for e in m.take_events()] == [
        (EventKind.STORED, tuple(first), Medium.REMOTE), (EventKind.REMOVED, tuple(first), Medium.REMOTE),
        (EventKind.STORED, tuple(second), Medium.REMOTE)]


# ---- the answer cache -----------------------------------------------------------------------------------------


def test_answers_are_remembered_for_the_cache_time_only(url: str, redis_client: Any) -> None:
    clock = FakeClock()
    client = Counting(redis.Redis.from_url(url))
    m = make(url, client=client, cache_s=1.0, clock=clock)
    ks = keys(3)
    write(redis_client, ks[:2])
    assert m.lookup(ks).hits == 2
    client.commands.clear()
    write(redis_client, ks[2:])
    assert m.lookup(ks).hits == 2 and m.lookup(ks[:1]).hits == 1 and client.commands == []
    clock.now += 1.0
    assert m.lookup(ks).hits == 3 and client.commands == ["exists"]


def test_a_stale_answer_is_a_failed_promotion_then_a_miss(url: str, redis_client: Any) -> None:
    clock = FakeClock()
    m = make(url, cache_s=1.0, clock=clock)
    ks = keys(2)
    write(redis_client, ks)
    assert m.lookup(ks).hits == 2
    redis_client.delete(value_name(NS, PLAIN, ks[0]))
    assert m.lookup(ks).hits == 2  # remembered: the promotion is tried ...
    m.prepare_load(ks)
    m.complete_load(ks, success=False)  # ... and fails, as the worker finds no value
    assert m.lookup(ks).hits == 0


def test_its_own_deletes_and_stores_update_the_answers(url: str, redis_client: Any) -> None:
    m = make(url, blocks=1, cache_s=60.0)
    (first,) = stored(m, redis_client, keys(1))
    assert m.lookup([first]).hits == 1
    stored(m, redis_client, keys(1, salt=1))  # evicts and deletes ``first``
    assert m.lookup([first]).hits == 0


def test_the_answer_cache_is_bounded(url: str, redis_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probed_index, "SEEN_MAX", 100)
    m = make(url, cache_s=60.0)
    ks = keys(300)
    write(redis_client, ks)
    assert m.lookup(ks).hits == 300
    assert len(m._seen) == 100
    m.check_integrity()


def test_remote_bytes_below_one_value_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="remote_bytes"):
        RemoteIndex.create(RemoteTierConfig(urls=("redis://127.0.0.1:1",), capacity_bytes=VALUE - 1), NS,
                                 VALUE)


def test_the_configured_remote_tier_builds_the_host_over_remote(url: str) -> None:
    from kvoffload.index.tiered import TieredIndex
    from kvoffload.testing import layouts
    from kvoffload.tiers.stack import build_index

    layout, _ = layouts.attention_layout(num_blocks=8, block_size=4)
    config = OffloadConfig.from_dict({"remote_url": url, "host_bytes": 1 << 20})
    manager = build_index(config, TierContext(NS, layout, 1))
    assert isinstance(manager, TieredIndex) and isinstance(manager.lower_indexes[0], RemoteIndex)
    assert [u.medium for u in manager.usage()] == [Medium.HOST, Medium.REMOTE]


# ---- a cluster ------------------------------------------------------------------------------------------------


def test_a_cluster_is_asked_and_cleaned_by_slot(caplog: pytest.LogCaptureFixture) -> None:
    from kvoffload.testing.redis_server import RedisCluster, RedisServerUnavailable

    try:
        cluster = RedisCluster()
    except RedisServerUnavailable as e:
        pytest.skip(str(e))
    with cluster:
        made = RemoteIndex.create(dataclasses.replace(config(cluster.urls[0], blocks=4), urls=cluster.urls,
                                                            cluster=True), NS, VALUE)
        made.close()
        m = SettledRemoteIndex(made.probe, made.capacity, cache_s=0.0)
        client = redis.RedisCluster.from_url(cluster.urls[0])
        ks = keys(300)
        write(client, ks[:200])  # spread over the three nodes' slots
        assert m.lookup(ks).hits == 200
        ours = stored(m, client, keys(4, salt=1))
        stored(m, client, keys(4, salt=2))  # the budget of four: ours are deleted, on whichever node they are
        assert not any(exists(client, k) for k in ours) and m.lookup(ks).hits == 200
        cluster.stop()
        assert m.lookup(ks) == LookupResult(0)  # a cluster that is gone: misses
        assert "Traceback" not in caplog.text
