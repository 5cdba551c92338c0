"""RemoteHandler against a real redis-server: round trips, the value layout, bad values, sealed values, and a
cluster (a server that fails: test_handler_faults.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from tests.forgeries import FORGERIES, forge
from tests.tiers.remote.handlers import (
    ENTRY,
    NS,
    SLOT,
    Handler,
    keys,
    load,
    make_config,
    make_pool,
    row,
    run,
    store,
)

from kvoffload.auth import TAG_BYTES, TierSecret
from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
from kvoffload.config import RemoteTierConfig
from kvoffload.keys import Namespace
from kvoffload.testing.redis_server import RedisCluster, RedisServer
from kvoffload.tiers.lower.block_format import HEADER_BYTES, PLAIN, BlockFormat, checksum, decode_header
from kvoffload.tiers.remote.client import value_name
from kvoffload.tiers.remote.faults import Fault
from kvoffload.tiers.remote.handler import RemoteHandler
from kvoffload.tiers.remote.spec import RemoteTierSpec
from kvoffload.tiers.remote.stage import BATCH_BYTES
from kvoffload.tiers.spec import TierContext

redis = pytest.importorskip("redis")

SECRET = TierSecret("test", b"k" * 32)


@pytest.fixture
def config(server: RedisServer) -> RemoteTierConfig:
    return make_config(server.url)


BATCHES = {"one-pipeline": BATCH_BYTES, "pipelines-of-2": 2 * PLAIN.file_bytes(ENTRY[0])}
"""Every data-path test runs with a job in one pipeline, and cut into pipelines of two values (the helper threads
then seal or verify one batch while the lane sends or receives the next)."""


@pytest.fixture(params=list(BATCHES.values()), ids=list(BATCHES))
def batch_bytes(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def handler(config: RemoteTierConfig, batch_bytes: int) -> Iterator[RemoteHandler]:
    h = RemoteHandler(config, make_pool(), NS, ENTRY, batch_bytes=batch_bytes)
    yield h
    h.shutdown()


# ---- the data path --------------------------------------------------------------------------------------------

def test_store_then_load_round_trips_several_groups_bit_exact(handler: RemoteHandler) -> None:
    ks = keys(5)
    sizes = (48,) * 5  # an entry of any group moves the largest group's bytes (tiers/lower/handler.py)
    expected = [row(handler, s, n) for s, n in zip(range(5), sizes, strict=True)]
    stored = run(handler, store((0, 1, 2, 3, 4), ks, (3, 2)))
    assert stored.success and stored.bytes == sum(sizes) and stored.transfer_type == (Medium.HOST, Medium.REMOTE)
    handler._slots[8:13] = 0
    loaded = run(handler, load(ks, (8, 9, 10, 11, 12), (3, 2)))
    assert loaded.success and loaded.bytes == sum(sizes) and loaded.transfer_type == (Medium.REMOTE, Medium.HOST)
    assert [row(handler, s, n) for s, n in zip(range(8, 13), sizes, strict=True)] == expected


def test_a_value_is_named_by_world_rank_and_key_and_holds_the_disk_block_encoding(
        handler: RemoteHandler, client: Any) -> None:
    (key,) = keys(1)
    assert run(handler, store((0,), (key,))).success
    name = value_name(NS, PLAIN, key)
    assert name == f"kvoffload:{NS.chain_root().hex()[:16]}:r0:{key.hex()}"
    value = client.get(name)
    assert len(value) == HEADER_BYTES + ENTRY[0]
    assert decode_header(value[:HEADER_BYTES], NS.fingerprint(), key, ENTRY[0]) == checksum(value[HEADER_BYTES:])
    assert value[HEADER_BYTES:] == row(handler, 0)
    assert client.ttl(name) == -1  # no TTL unless configured


def test_a_second_store_of_a_key_keeps_the_first_writers_value(handler: RemoteHandler, client: Any) -> None:
    (key,) = keys(1)
    assert run(handler, store((0,), (key,))).success
    assert run(handler, store((1,), (key,))).success  # NX: already there is a success, not a fault
    assert client.get(value_name(NS, PLAIN, key))[HEADER_BYTES:] == row(handler, 0) != row(handler, 1)


def test_values_expire_after_the_configured_ttl(config: RemoteTierConfig, client: Any) -> None:
    (key,) = keys(1)
    with Handler(dataclasses.replace(config, ttl_s=100)) as h:
        assert run(h, store((0,), (key,))).success
    assert 0 < client.ttl(value_name(NS, PLAIN, key)) <= 100


def test_a_missing_value_fails_its_load_without_counting_as_a_fault(handler: RemoteHandler) -> None:
    *present, absent = keys(3)
    assert run(handler, store((0, 1), tuple(present))).success
    for _ in range(5):
        assert not run(handler, load((*present, absent), (3, 4, 5))).success
    assert not handler.breaker.is_open and not any(handler.faults.counts.values())


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "append", "empty"])
def test_a_damaged_value_is_never_loaded_and_is_deleted(handler: RemoteHandler, client: Any, damage: str) -> None:
    ks = keys(3)  # the damaged one last: in the second pipeline when batched
    assert run(handler, store((0, 1, 2), ks)).success
    name = value_name(NS, PLAIN, ks[2])
    value = bytearray(client.get(name))
    if damage == "flip_payload":
        value[-1] ^= 0xFF
    elif damage == "flip_header":
        value[20] ^= 0x01
    elif damage == "truncate":
        value = value[:-5]
    elif damage == "append":
        value += b"x"
    else:
        value = bytearray()
    client.set(name, bytes(value))
    handler._slots[3:6] = 0
    assert not run(handler, load(ks, (3, 4, 5))).success
    assert not handler._slots[5].any()
    assert client.exists(name) == 0  # else SET NX would keep it for good
    assert handler.faults.counts[Fault.CORRUPT] == 1
    assert run(handler, store((0, 1, 2), ks)).success and run(handler, load(ks, (3, 4, 5))).success
    assert [row(handler, s) for s in (3, 4, 5)] == [row(handler, s) for s in (0, 1, 2)]


def test_a_value_of_another_namespace_is_never_loaded(handler: RemoteHandler, client: Any,
                                                      config: RemoteTierConfig) -> None:
    other = Namespace(model="other", dtype="bf16", layout="pages=64")
    (key,) = keys(1)
    with Handler(config, other) as foreign:
        assert run(foreign, store((0,), (key,))).success
    client.set(value_name(NS, PLAIN, key), client.get(value_name(other, PLAIN, key)))  # planted where NS looks
    assert not run(handler, load((key,), (1,))).success


def test_malformed_jobs_raise_value_error(handler: RemoteHandler) -> None:
    with pytest.raises(ValueError, match="outside the pool"):
        handler.submit(store((99,), keys(1)))
    with pytest.raises(ValueError, match="does not move"):
        both = TierBlocks(Medium.REMOTE, keys(1), (1,))
        handler.submit(TransferJob(JobId(1), both, both))
    with pytest.raises(ValueError, match="skip_sub_blocks"):
        handler.submit(TransferJob(JobId(2), HostBlocks((0,), (1,), 1), TierBlocks(Medium.REMOTE, keys(1), (1,))))
    with pytest.raises(ValueError, match="entry_bytes"):
        RemoteHandler(make_config("redis://127.0.0.1:1"), make_pool(), NS, (SLOT + 1,))


def test_the_spec_sizes_the_entries_from_the_layout(config: RemoteTierConfig) -> None:
    class Layout:
        groups = ("attention", "state")

        def group_block_bytes(self, group: int) -> int:
            return (16, 8)[group]

    h = RemoteTierSpec(config).make_handler(TierContext(NS, Layout(), factor=2), make_pool())
    try:
        assert h._entry_bytes == (32, 16)
    finally:
        h.shutdown()


# ---- with a secret --------------------------------------------------------------------------------------------

FMT = BlockFormat.of(SECRET)


@pytest.fixture
def secret_handler(config: RemoteTierConfig, batch_bytes: int) -> Iterator[RemoteHandler]:
    with Handler(dataclasses.replace(config, secret=SECRET), batch_bytes=batch_bytes) as h:
        yield h


def test_sealed_values_round_trip_under_names_that_are_not_their_keys_and_hide_their_contents(
        secret_handler: RemoteHandler, client: Any) -> None:
    ks = keys(2)
    expected = [row(secret_handler, s) for s in (0, 1)]
    assert run(secret_handler, store((0, 1), ks)).success
    for key in ks:
        name = value_name(NS, FMT, key)
        assert key.hex() not in name and NS.chain_root().hex()[:16] not in name
        assert client.strlen(name) == HEADER_BYTES + ENTRY[0] + TAG_BYTES
        value = client.get(name)
        assert key not in value and NS.fingerprint() not in value and expected[0][:32] not in value
    secret_handler._slots[5:7] = 0
    assert run(secret_handler, load(ks, (5, 6))).success
    assert [row(secret_handler, s) for s in (5, 6)] == expected


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_planted_copied_or_rewritten_value_is_never_loaded(
        secret_handler: RemoteHandler, client: Any, forgery: str) -> None:
    (key,) = keys(1)
    assert run(secret_handler, store((0,), (key,))).success
    name = value_name(NS, FMT, key)
    client.set(name, forge(forgery, FMT, NS.fingerprint(), key, client.get(name)))
    secret_handler._slots[3] = 0
    assert not run(secret_handler, load((key,), (3,))).success
    assert secret_handler.faults.counts[Fault.UNAUTHENTIC] == 1
    assert not secret_handler.breaker.is_open and client.exists(name) == 0


# ---- a cluster ------------------------------------------------------------------------------------------------

def test_a_round_trip_through_a_three_node_cluster() -> None:
    with RedisCluster(3) as cluster:
        config = dataclasses.replace(make_config(cluster.urls[0]), urls=cluster.urls, cluster=True)
        for salt, batch_bytes in enumerate(BATCHES.values()):
            with Handler(config, batch_bytes=batch_bytes) as h:
                ks = keys(12, salt)
                sizes = (48,) * 7 + (32,) * 5
                expected = [row(h, s, n) for s, n in enumerate(sizes)]
                assert run(h, store(tuple(range(12)), ks, (7, 5))).success
                h._slots[:12] = 0
                assert run(h, load(ks, tuple(range(12)), (7, 5))).success
                assert [row(h, s, n) for s, n in enumerate(sizes)] == expected
        held = [redis.Redis.from_url(url).dbsize() for url in cluster.urls]
        assert sum(held) == 24 and sum(1 for n in held if n) >= 2  # the values are spread over the nodes
