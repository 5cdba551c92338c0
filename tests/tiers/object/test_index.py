"""ObjectIndex against a real Ceph RGW: every rule of a tier's index (the conformance suite), lookups that find what
other engines wrote, answers remembered for the cache time only, a budget that deletes only this engine's objects,
and a store that is not there at start-up (the prefix search itself: test_probe.py)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import pytest
from tests.tiers.object.indexes import (
    NS,
    NS2,
    OBJECT,
    Counting,
    FakeClock,
    delete,
    exists,
    keys,
    listed,
    make,
    name,
    removed,
    stored,
    tier,
    write,
)

from kvoffload.auth import TierSecret
from kvoffload.blocks import Medium, TierBlocks
from kvoffload.config import ConfigError, ObjectTierConfig, OffloadConfig
from kvoffload.index.base import EventKind, LookupResult
from kvoffload.keys import OffloadKey
from kvoffload.testing.ceph_rgw import CephRGW
from kvoffload.testing.tier_conformance import ALL_INDEX_CHECKS, IndexCheck, IndexHarness
from kvoffload.tiers.lower.block_format import PLAIN
from kvoffload.tiers.object.client import ObjectNames, connect
from kvoffload.tiers.object.index import ObjectIndex
from kvoffload.tiers.spec import TierContext

# ---- the conformance suite --------------------------------------------------------------------------------------


class ObjectHarness(IndexHarness):
    """Indexes made by ``ObjectIndex.create`` (the production answer cache included) on one bucket; ``written``
    plants the objects a store's workers would write."""

    def __init__(self, s3: Any, config: ObjectTierConfig) -> None:
        self._s3 = s3
        self._config = tier(config, blocks=self.capacity)
        self._salts = itertools.count(1)

    @property
    def capacity(self) -> int:
        return 4

    def new_index(self) -> ObjectIndex:
        return ObjectIndex.create(self._config, NS, OBJECT)

    def keys(self, n: int) -> list[OffloadKey]:
        return keys(n, salt=next(self._salts))

    def written(self, ks: Sequence[OffloadKey]) -> None:
        write(self._s3, self._config, ks)


@pytest.mark.parametrize("check", ALL_INDEX_CHECKS, ids=lambda c: c.__name__)
def test_the_object_index_keeps_every_rule_of_a_tier_index(check: IndexCheck, s3: Any,
                                                            config: ObjectTierConfig) -> None:
    check(ObjectHarness(s3, config))


# ---- lookups ----------------------------------------------------------------------------------------------------


def test_lookup_finds_the_objects_another_engine_wrote(s3: Any, config: ObjectTierConfig) -> None:
    m = make(config)
    ks = keys(5)
    write(s3, config, ks[:3])
    assert m.lookup(ks) == LookupResult(3)
    assert m.lookup(ks[:2]) == LookupResult(2) and m.lookup([]) == LookupResult(0)
    assert m.prepare_load(ks[:3]) == TierBlocks(Medium.OBJECT, tuple(ks[:3]), (3,))
    m.complete_load(ks[:3])
    assert m.usage()[0].used_blocks == 0 and m.take_events() == []  # read, not owned
    m.reset()
    assert all(exists(s3, config, k) for k in ks[:3])


def test_two_engines_on_one_bucket_load_each_others_objects(s3: Any, config: ObjectTierConfig) -> None:
    a, b = make(config), make(config)
    ks = stored(a, s3, config, keys(3))
    assert b.lookup(ks) == LookupResult(3)
    b.prepare_load(ks)
    b.complete_load(ks)
    assert b.usage()[0].used_blocks == 0 and a.usage()[0].used_blocks == 3


def test_a_key_is_a_hit_only_when_every_ranks_object_exists(s3: Any, config: ObjectTierConfig) -> None:
    m = make(config, ns=NS2)
    ks = keys(3)
    write(s3, config, ks, NS2, ranks=[0])
    write(s3, config, ks[:2], NS2, ranks=[1])  # rank 1's third object is gone
    assert m.lookup(ks) == LookupResult(2)


def test_another_namespace_prefix_or_secret_never_sees_the_objects(s3: Any, config: ObjectTierConfig) -> None:
    ks = keys(2)
    write(s3, config, ks)
    others = [make(config, ns=dataclasses.replace(NS, model="other")), make(config, prefix="elsewhere"),
              make(config, secret=TierSecret("test", b"s" * 32))]
    assert [o.lookup(ks).hits for o in others] == [0, 0, 0]
    assert make(config).lookup(ks).hits == 2


def test_object_names_are_the_workers_names_under_the_prefix(config: ObjectTierConfig) -> None:
    (key,) = keys(1)
    world = NS2.chain_root().hex()[:16]
    ranks = [f"kvoffload/{world}/r{r}/{key.hex()}" for r in range(2)]
    assert [name(config, key, NS2, rank=r) for r in range(2)] == ranks
    assert ObjectNames(config, NS2, PLAIN).of(key) == ranks  # what the probe asks for
    assert ObjectNames(dataclasses.replace(config, prefix="team/a"), NS2, PLAIN).of(key)[0] == "team/a/" + ranks[0]
    replicated = dataclasses.replace(NS2, replicated=True, rank=1)
    assert ObjectNames(config, replicated, PLAIN).of(key) == [
        f"kvoffload/{replicated.chain_root().hex()[:16]}/rep/{key.hex()}"]


# ---- the answer cache -------------------------------------------------------------------------------------------


def test_answers_are_remembered_for_the_cache_time_then_asked_again(s3: Any, config: ObjectTierConfig) -> None:
    clock = FakeClock()
    client = Counting(connect(tier(config)))
    m = make(config, client=client, cache_s=1.0, clock=clock)
    ks = keys(3)
    write(s3, config, ks[:2])
    assert m.lookup(ks).hits == 2
    client.clear()
    write(s3, config, ks[2:])  # another engine writes the third: seen a cache time late
    assert m.lookup(ks).hits == 2 and m.lookup(ks[:1]).hits == 1 and client.calls == []
    clock.now += 0.999
    assert m.lookup(ks).hits == 2 and client.calls == []
    clock.now += 0.001
    assert m.lookup(ks).hits == 3 and client.count("get_object") >= 1


def test_a_stale_answer_is_a_failed_promotion_then_a_miss(s3: Any, config: ObjectTierConfig) -> None:
    clock = FakeClock()
    m = make(config, cache_s=1.0, clock=clock)
    ks = keys(2)
    write(s3, config, ks)
    assert m.lookup(ks).hits == 2
    delete(s3, config, ks[:1])
    assert m.lookup(ks).hits == 2  # remembered: the promotion is tried ...
    m.prepare_load(ks)
    m.complete_load(ks, success=False)  # ... and fails, as the worker finds no object
    assert m.lookup(ks).hits == 0
    clock.now += 1.0
    assert m.lookup(ks).hits == 0  # asked anew: still gone
    write(s3, config, ks[:1])
    clock.now += 1.0
    assert m.lookup(ks).hits == 2


# ---- the budget -------------------------------------------------------------------------------------------------


def test_its_own_key_found_gone_leaves_its_budget_and_is_announced_removed(s3: Any,
                                                                          config: ObjectTierConfig) -> None:
    m = make(config, ns=NS2)
    ks = stored(m, s3, config, keys(3), NS2)
    m.take_events()
    delete(s3, config, ks[1:2], NS2, ranks=[1])  # a lifecycle rule expired rank 1's copy
    assert m.lookup(ks) == LookupResult(1)
    assert [(e.kind, e.keys, e.medium) for e in m.take_events()] == [(EventKind.REMOVED, (ks[1],), Medium.OBJECT)]
    assert m.usage()[0].used_blocks == 2
    assert not exists(s3, config, ks[1], NS2, rank=0)  # the copy left behind is deleted with it
    assert exists(s3, config, ks[2], NS2, rank=1)
    m.check_integrity()


def test_evicting_its_own_keys_deletes_their_objects_and_never_anothers(s3: Any, config: ObjectTierConfig) -> None:
    a, b = make(config, blocks=2), make(config, blocks=2)
    theirs = stored(b, s3, config, keys(2, salt=1))
    planted = keys(2, salt=3)
    write(s3, config, planted)  # an engine with no index here at all
    first = stored(a, s3, config, keys(2))
    assert a.lookup(theirs + planted).hits == 4  # read, never owned
    newer = stored(a, s3, config, keys(1, salt=2))
    assert not exists(s3, config, first[1]) and exists(s3, config, first[0])  # a prefix's tail goes first
    assert removed(a.take_events()) == [first[1]]
    a.reset()
    after = listed(s3, config.bucket)
    assert {name(config, k) for k in theirs + planted} <= after
    assert not {name(config, k) for k in first + newer} & after
    assert [(u.medium, u.used_blocks, u.capacity_blocks) for u in b.usage()] == [(Medium.OBJECT, 2, 2)]


def test_a_failed_store_deletes_the_objects_some_ranks_wrote(s3: Any, config: ObjectTierConfig) -> None:
    m = make(config, ns=NS2)
    out = m.prepare_store(keys(2))
    assert out is not None
    write(s3, config, out.keys_to_store, NS2, ranks=[0])  # rank 1 failed
    m.complete_store(out.keys_to_store, success=False)
    assert listed(s3, config.bucket) == set()
    assert m.lookup(out.keys_to_store).hits == 0 and m.usage()[0].used_blocks == 0
    m.check_integrity()


def test_a_failed_load_of_its_own_key_deletes_every_ranks_object(s3: Any, config: ObjectTierConfig) -> None:
    m = make(config, ns=NS2)
    ks = stored(m, s3, config, keys(2), NS2)
    m.prepare_load(ks[:1])
    m.complete_load(ks[:1], success=False)
    assert listed(s3, config.bucket) == {name(config, ks[1], NS2, r) for r in range(2)}


def test_events_name_the_object_medium(s3: Any, config: ObjectTierConfig) -> None:
    m = make(config, blocks=1)
    first = stored(m, s3, config, keys(1))
    second = stored(m, s3, config, keys(1, salt=1))
    assert [(e.kind, e.keys, e.medium) for e in m.take_events()] == [
        (EventKind.STORED, tuple(first), Medium.OBJECT), (EventKind.REMOVED, tuple(first), Medium.OBJECT),
        (EventKind.STORED, tuple(second), Medium.OBJECT)]


# ---- configuration and start-up ---------------------------------------------------------------------------------


def test_object_bytes_below_one_object_is_a_config_error_naming_it(credentials: None) -> None:
    config = ObjectTierConfig(bucket="kvoffload-t", endpoint="http://127.0.0.1:1", capacity_bytes=OBJECT - 1)
    with pytest.raises(ConfigError, match="object_bytes"):
        ObjectIndex.create(config, NS, OBJECT)
    assert ObjectIndex.create(dataclasses.replace(config, capacity_bytes=OBJECT), NS, OBJECT).capacity == 1


def test_a_store_down_at_start_up_is_misses_not_exceptions(credentials: None,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    config = ObjectTierConfig(bucket="kvoffload-t", endpoint="http://127.0.0.1:1", connect_timeout_s=0.5)
    m = ObjectIndex.create(config, NS, OBJECT)
    assert "does not answer" in caplog.text and m.probe.breaker.is_open
    assert m.lookup(keys(3)) == LookupResult(0)
    assert m.prepare_store(keys(1)) is None  # the workers' stores would fail too: nothing reserved
    assert m.usage()[0].used_blocks == 0
    m.check_integrity()


def test_a_missing_bucket_at_start_up_is_misses(ceph: CephRGW, credentials: None) -> None:
    config = ObjectTierConfig(bucket="kvoffload-never-made", endpoint=ceph.endpoint, region=ceph.region)
    m = ObjectIndex.create(config, NS, OBJECT)
    assert m.probe.breaker.is_open and m.lookup(keys(1)) == LookupResult(0)


def test_the_configured_object_tier_builds_host_over_object(ceph: CephRGW, bucket: str) -> None:
    from kvoffload.index.tiered import TieredIndex
    from kvoffload.testing import layouts
    from kvoffload.tiers.stack import build_index

    layout, _ = layouts.attention_layout(num_blocks=8, block_size=4)
    config = OffloadConfig.from_dict({"object_url": f"s3://{bucket}/team", "object_endpoint": ceph.endpoint,
                                      "host_bytes": 1 << 20, "object_bytes": 1 << 24})
    manager = build_index(config, TierContext(NS, layout, 1))
    assert isinstance(manager, TieredIndex) and isinstance(manager.lower_indexes[0], ObjectIndex)
    assert [u.medium for u in manager.usage()] == [Medium.HOST, Medium.OBJECT]
    assert not manager.lower_indexes[0].probe.breaker.is_open  # HeadBucket answered
