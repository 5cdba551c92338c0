"""ObjectHandler against a real Ceph RGW: round trips (plain and sealed), the object names and layout, misses,
the request count, and shutting down with jobs in flight (a server that fails, and bad objects:
test_handler_faults.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from tests.tiers.object.handlers import (
    ENTRY,
    NS,
    SLOT,
    Handler,
    keys,
    load,
    make_pool,
    object_name,
    opened,
    read_object,
    row,
    run,
    store,
)

from kvoffload.auth import TAG_BYTES, TierSecret
from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
from kvoffload.config import ObjectTierConfig
from kvoffload.keys import Namespace
from kvoffload.tiers.lower.block_format import HEADER_BYTES, checksum, decode_header
from kvoffload.tiers.object.handler import ObjectHandler

SECRET = TierSecret("test", b"k" * 32)


@pytest.fixture(params=[None, SECRET], ids=["plain", "sealed"])
def tier(request: pytest.FixtureRequest, config: ObjectTierConfig) -> ObjectTierConfig:
    """The tier's configuration without and with a secret (every data-path test runs both)."""
    return dataclasses.replace(config, secret=request.param)


@pytest.fixture
def handler(tier: ObjectTierConfig) -> Iterator[ObjectHandler]:
    with Handler(tier) as h:
        yield h


# ---- the data path --------------------------------------------------------------------------------------------

def test_store_then_load_round_trips_several_groups_bit_exact(handler: ObjectHandler, tier: ObjectTierConfig,
                                                              s3: Any) -> None:
    ks = keys(5)
    expected = [row(handler, s) for s in range(5)]  # an entry of any group moves the largest group's bytes
    stored = run(handler, store((0, 1, 2, 3, 4), ks, (3, 2)))
    assert stored.success and stored.bytes == 5 * ENTRY[0]
    assert stored.transfer_type == (Medium.HOST, Medium.OBJECT)
    assert [opened(s3, tier, k) for k in ks] == expected  # what the bucket holds, opened by the codec
    handler._slots[8:13] = 0
    loaded = run(handler, load(ks, (8, 9, 10, 11, 12), (3, 2)))
    assert loaded.success and loaded.bytes == 5 * ENTRY[0]
    assert loaded.transfer_type == (Medium.OBJECT, Medium.HOST)
    assert [row(handler, s) for s in range(8, 13)] == expected
    assert row(handler, 8) != row(handler, 9)  # the control: the pool's random rows tell blocks apart


def test_a_job_of_more_blocks_than_request_threads_round_trips(tier: ObjectTierConfig) -> None:
    with Handler(dataclasses.replace(tier, io_threads=2)) as h:
        ks = keys(12, salt=1)
        expected = [row(h, s) for s in range(12)]
        assert run(h, store(tuple(range(12)), ks, (7, 5))).success
        h._slots[:12] = 0
        assert run(h, load(ks, tuple(range(12)), (7, 5))).success
        assert [row(h, s) for s in range(12)] == expected


def test_a_second_store_of_a_key_replaces_its_object(handler: ObjectHandler, tier: ObjectTierConfig,
                                                     s3: Any) -> None:
    (key,) = keys(1)
    assert run(handler, store((0,), (key,))).success
    assert run(handler, store((1,), (key,))).success  # a PUT replaces the object whole
    assert opened(s3, tier, key) == row(handler, 1) != row(handler, 0)


def test_a_missing_object_fails_its_load_without_counting_as_a_fault(handler: ObjectHandler) -> None:
    *present, absent = keys(3)
    assert run(handler, store((0, 1), tuple(present))).success
    for _ in range(5):  # more than the breaker's errors: a miss never opens it
        result = run(handler, load((*present, absent), (3, 4, 5)))
        assert not result.success and result.bytes == 0
    assert not handler.breaker.is_open and not any(handler.faults.counts.values())
    assert run(handler, load(tuple(present), (3, 4))).success  # the present ones still load
    assert [row(handler, s) for s in (3, 4)] == [row(handler, s) for s in (0, 1)]


def test_the_request_count_has_one_put_per_stored_and_one_get_per_loaded_block(handler: ObjectHandler) -> None:
    ks = keys(3)
    assert handler.requests == 0  # the start-up HeadBucket is no object request
    assert run(handler, store((0, 1, 2), ks)).success
    assert handler.requests == 3
    assert run(handler, load(ks, (4, 5, 6))).success
    assert handler.requests == 6
    assert not run(handler, load(keys(1, salt=9), (7,))).success  # a miss costs its GET
    assert handler.requests == 7
    assert run(handler, store((), (), (0,))).success  # a job of no blocks sends nothing
    assert handler.requests == 7


# ---- names and layout -----------------------------------------------------------------------------------------

def test_a_plain_object_is_named_by_world_rank_and_key_and_holds_the_block_encoding(
        config: ObjectTierConfig, s3: Any) -> None:
    (key,) = keys(1)
    with Handler(config) as h:
        assert run(h, store((0,), (key,))).success
        name = f"kvoffload/{NS.chain_root().hex()[:16]}/r0/{key.hex()}"
        assert object_name(config, key) == name
        value = s3.get_object(Bucket=config.bucket, Key=name)["Body"].read()
        assert len(value) == HEADER_BYTES + ENTRY[0]
        assert decode_header(value[:HEADER_BYTES], NS.fingerprint(), key, ENTRY[0]) == checksum(value[HEADER_BYTES:])
        assert value[HEADER_BYTES:] == row(h, 0) != row(h, 1)
    listed = s3.list_objects_v2(Bucket=config.bucket)["Contents"]
    assert [o["Key"] for o in listed] == [name]  # one object per block, nothing else


def test_a_configured_prefix_comes_first_in_every_name(config: ObjectTierConfig, s3: Any) -> None:
    prefixed = dataclasses.replace(config, prefix="team-a/run1")
    (key,) = keys(1)
    with Handler(prefixed) as h:
        assert run(h, store((0,), (key,))).success
        name = f"team-a/run1/kvoffload/{NS.chain_root().hex()[:16]}/r0/{key.hex()}"
        assert [o["Key"] for o in s3.list_objects_v2(Bucket=config.bucket)["Contents"]] == [name]
        h._slots[3] = 0
        assert run(h, load((key,), (3,))).success and row(h, 3) == row(h, 0)


def test_each_rank_stores_under_its_own_name_and_loads_only_its_own(config: ObjectTierConfig, s3: Any) -> None:
    ranks = [dataclasses.replace(NS, rank=r, world_size=2) for r in (0, 1)]
    (key,) = keys(1)
    with Handler(config, ranks[0]) as zero, Handler(config, ranks[1]) as one:
        assert run(one, store((0,), (key,))).success
        name = object_name(config, key, ranks[1])
        assert name.split("/")[-2:] == ["r1", key.hex()]
        assert opened(s3, config, key, ranks[1]) == row(one, 0)
        assert read_object(s3, config, key, ranks[0]) is None
        assert not run(zero, load((key,), (3,))).success  # rank 0's name: a miss, not rank 1's bytes
        assert not any(zero.faults.counts.values())
        one._slots[3] = 0
        assert run(one, load((key,), (3,))).success and row(one, 3) == row(one, 0)


def test_a_replicated_namespace_keeps_one_copy_that_every_rank_loads(config: ObjectTierConfig, s3: Any) -> None:
    ranks = [dataclasses.replace(NS, rank=r, world_size=2, replicated=True) for r in (0, 1)]
    (key,) = keys(1)
    with Handler(config, ranks[0]) as zero, Handler(config, ranks[1]) as one:
        assert run(zero, store((0,), (key,))).success
        assert [o["Key"] for o in s3.list_objects_v2(Bucket=config.bucket)["Contents"]] == [
            f"kvoffload/{ranks[0].chain_root().hex()[:16]}/rep/{key.hex()}"]
        one._slots[3] = 0
        assert run(one, load((key,), (3,))).success
        assert row(one, 3) == row(zero, 0) != row(one, 0)  # rank 0's bytes, not the slot's own


def test_an_object_of_another_namespace_is_never_loaded(handler: ObjectHandler, tier: ObjectTierConfig,
                                                        s3: Any) -> None:
    other = Namespace(model="other", dtype="bf16", layout="pages=64")
    (key,) = keys(1)
    with Handler(tier, other) as foreign:
        assert run(foreign, store((0,), (key,))).success
    copied = read_object(s3, tier, key, other)
    assert copied is not None
    s3.put_object(Bucket=tier.bucket, Key=object_name(tier, key), Body=copied)  # planted where NS looks
    handler._slots[1] = 0
    assert not run(handler, load((key,), (1,))).success
    if tier.secret is None:  # a plain block is checked before a byte reaches the slot (a sealed one is not)
        assert not handler._slots[1].any()
    assert read_object(s3, tier, key) is None  # deleted as damaged


# ---- sealed objects -------------------------------------------------------------------------------------------

def test_sealed_objects_hide_their_names_and_payloads_where_plain_ones_show_them(
        config: ObjectTierConfig, s3: Any) -> None:
    sealed = dataclasses.replace(config, secret=SECRET)
    ks = keys(2)
    with Handler(sealed) as h:
        expected = [row(h, s) for s in (0, 1)]
        assert run(h, store((0, 1), ks)).success
        for key, payload in zip(ks, expected, strict=True):
            name = object_name(sealed, key)
            assert key.hex() not in name and NS.chain_root().hex()[:16] not in name
            value = read_object(s3, sealed, key)
            assert value is not None and len(value) == HEADER_BYTES + ENTRY[0] + TAG_BYTES
            assert payload[:16] not in value and key not in value and NS.fingerprint() not in value
        h._slots[5:7] = 0
        assert run(h, load(ks, (5, 6))).success
        assert [row(h, s) for s in (5, 6)] == expected
    with Handler(config) as plain:  # the control: the same checks find a plain object's payload and key
        assert run(plain, store((0,), ks[:1])).success
        value = read_object(s3, config, ks[0])
        assert value is not None and row(plain, 0)[:16] in value and ks[0] in value


def test_a_plain_tier_does_not_load_a_sealed_tiers_object(config: ObjectTierConfig, s3: Any) -> None:
    (key,) = keys(1)
    sealed = dataclasses.replace(config, secret=SECRET)
    with Handler(sealed) as h:
        assert run(h, store((0,), (key,))).success
        value = read_object(s3, sealed, key)
    assert value is not None
    s3.put_object(Bucket=config.bucket, Key=object_name(config, key), Body=value)
    with Handler(config) as plain:
        plain._slots[2] = 0
        assert not run(plain, load((key,), (2,))).success and not plain._slots[2].any()


# ---- jobs and lifecycle ---------------------------------------------------------------------------------------

def test_shutdown_with_jobs_in_flight_reports_each_once_and_refuses_new_ones(config: ObjectTierConfig) -> None:
    h = ObjectHandler(config, make_pool(), NS, ENTRY)
    ks = keys(4)
    assert run(h, store((0, 1, 2, 3), ks)).success
    h._slots[8:12] = 0
    jobs = [load(ks, (8, 9, 10, 11)), store((4, 5), keys(2, salt=1)), load(ks[:2], (12, 13)),
            store((6,), keys(1, salt=2))]
    assert all(h.submit(job) for job in jobs)
    h.shutdown()
    results = h.get_finished() + h.get_finished()
    assert sorted(r.job_id for r in results) == sorted(j.job_id for j in jobs)
    for result in results:
        if result.success and result.transfer_type == (Medium.OBJECT, Medium.HOST):
            slots = (8, 9, 10, 11) if result.job_id == jobs[0].job_id else (12, 13)
            assert [row(h, s) for s in slots] == [row(h, s) for s in range(len(slots))]
    late = store((7,), keys(1, salt=3))
    assert not h.submit(late)
    h.shutdown()  # idempotent
    assert h.get_finished() == []


def test_malformed_jobs_raise_value_error(handler: ObjectHandler, tier: ObjectTierConfig) -> None:
    with pytest.raises(ValueError, match="outside the pool"):
        handler.submit(store((99,), keys(1)))
    with pytest.raises(ValueError, match="does not move"):
        both = TierBlocks(Medium.OBJECT, keys(1), (1,))
        handler.submit(TransferJob(JobId(1), both, both))
    with pytest.raises(ValueError, match="skip_sub_blocks"):
        handler.submit(TransferJob(JobId(2), HostBlocks((0,), (1,), 1), TierBlocks(Medium.OBJECT, keys(1), (1,))))
    with pytest.raises(ValueError, match="entry_bytes"):
        ObjectHandler(tier, make_pool(), NS, (SLOT + 1,))
    assert handler.requests == 0 and handler.get_finished() == []

