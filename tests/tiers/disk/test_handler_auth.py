"""The disk tier with a secret (``tier_secret_*``): blocks are sealed and their table entries name them by the
secret; a planted, copied or rewritten block is never loaded, is counted, is logged once, and its entry is
emptied."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.forgeries import FORGERIES, forge
from tests.tiers.disk.handlers import (
    BUDGET,
    ENTRY,
    NS,
    block_at,
    keys,
    load,
    make_pool,
    names,
    prepare,
    read_block,
    read_entry,
    run,
    store,
    write_at,
)

from kvoffload.auth import TAG_BYTES, TierSecret
from kvoffload.config import DiskTierConfig
from kvoffload.keys import OffloadKey
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.lower.block_format import HEADER_BYTES, BlockFormat

SECRET = TierSecret("test", b"k" * 32)
FMT = BlockFormat.of(SECRET)


@pytest.fixture
def config(tmp_path: Path) -> DiskTierConfig:
    return DiskTierConfig(path=tmp_path / "disk", io_threads=2, read_deadline_s=1.0, secret=SECRET,
                          capacity_bytes=BUDGET)


@pytest.fixture
def handler(config: DiskTierConfig) -> Iterator[DiskHandler]:
    prepare(config)
    h = DiskHandler(config, make_pool(), NS, ENTRY)
    yield h
    h.shutdown()


def plant(config: DiskTierConfig, key: OffloadKey, kind: str) -> bytes:
    """Overwrite ``key``'s genuine block in its slot with forgery ``kind``; return the genuine block's bytes."""
    at = block_at(config, key)
    genuine = read_block(config, key)
    write_at(at.path, at.offset, forge(kind, FMT, NS.fingerprint(), key, genuine))
    return genuine


def test_sealed_blocks_round_trip_under_names_that_are_not_their_keys_and_hide_their_contents(
        handler: DiskHandler, config: DiskTierConfig) -> None:
    ks = keys(2)
    pool = handler._slots
    expected = [bytes(pool[s, :ENTRY[0]]) for s in (0, 1)]
    assert run(handler, store((0, 1), ks)).success
    for key in ks:
        at = block_at(config, key)
        assert at.nbytes == HEADER_BYTES + ENTRY[0] + TAG_BYTES
        assert names(config, key) and key not in read_entry(config, key)  # named, but not by the prompt's key
        assert key.hex() not in str(at.path)
    raw = block_at(config, ks[0]).path.read_bytes()  # the whole slot file
    for secret in (*ks, NS.fingerprint(), expected[0][:32], expected[1][:32]):
        assert secret not in raw
    assert not (config.path / NS.chain_root().hex()[:16]).exists()  # nor is the directory
    pool[5:7] = 0
    assert run(handler, load(ks, (5, 6))).success
    assert [bytes(pool[s, :ENTRY[0]]) for s in (5, 6)] == expected


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_planted_copied_or_rewritten_block_is_never_loaded(
        handler: DiskHandler, config: DiskTierConfig, forgery: str, caplog: pytest.LogCaptureFixture) -> None:
    (key,) = keys(1)
    assert run(handler, store((0,), (key,))).success
    plant(config, key, forgery)
    handler._slots[3] = 0

    with caplog.at_level(logging.WARNING, logger="kvoffload.tiers.disk.handler"):
        result = run(handler, load((key,), (3,)))

    assert not result.success
    assert not names(config, key)  # emptied, so no engine indexes it again
    assert handler.unauthentic_blocks == 1 and handler.breaker.errors == 0  # not the disk's fault
    assert [r.message for r in caplog.records if "authentication" in r.message] != []


def test_the_genuine_block_put_back_loads(handler: DiskHandler, config: DiskTierConfig) -> None:
    """The control for the forgeries: the same slot and read, with the genuine bytes, loads bit-exact."""
    (key,) = keys(1)
    assert run(handler, store((0,), (key,))).success
    genuine = plant(config, key, "flipped_ciphertext")
    assert not run(handler, load((key,), (3,))).success
    at = block_at(config, key)
    write_at(at.path, at.offset, genuine)
    handler._slots[3] = 0
    assert run(handler, load((key,), (3,))).success
    assert bytes(handler._slots[3, :ENTRY[0]]) == bytes(handler._slots[0, :ENTRY[0]])


def test_unauthentic_blocks_are_logged_once_and_counted_each_time(
        handler: DiskHandler, config: DiskTierConfig, caplog: pytest.LogCaptureFixture) -> None:
    ks = keys(3)
    assert run(handler, store((0, 1, 2), ks)).success
    for key in ks:
        plant(config, key, "zero_tag")
    with caplog.at_level(logging.WARNING, logger="kvoffload.tiers.disk.handler"):
        for i, key in enumerate(ks):
            assert not run(handler, load((key,), (4 + i,))).success
    assert handler.unauthentic_blocks == 3
    assert len([r for r in caplog.records if "authentication" in r.message]) == 1


def test_the_index_is_rebuilt_from_secret_names_and_a_plain_engine_sees_none_of_them(
        handler: DiskHandler, config: DiskTierConfig) -> None:
    ks = keys(4)
    assert run(handler, store((0, 1, 2, 3), ks)).success
    for other, hits in ((config, 4),  # names map back to their keys under the secret
                        (dataclasses.replace(config, secret=None), 0),  # another world directory: never mixed
                        (dataclasses.replace(config, secret=TierSecret("o", b"o" * 32)), 0)):
        index = DiskIndex.create(other, NS, BlockFormat.of(other.secret).file_bytes(ENTRY[0]))
        try:
            assert index.lookup(list(ks)).hits == hits
        finally:
            index.close()
