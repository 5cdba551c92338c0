"""The disk tier with a secret (``tier_secret_*``): blocks are sealed and named by the secret; a planted, copied or
rewritten block is never loaded, is counted, and is logged once."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.forgeries import FORGERIES, forge
from tests.tiers.disk.handlers import ENTRY, NS, keys, load, make_pool, run, store

from kvoffload.auth import TAG_BYTES, TierSecret
from kvoffload.config import DiskTierConfig
from kvoffload.keys import OffloadKey
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.disk.paths import block_path, rank_directory
from kvoffload.tiers.lower.block_format import HEADER_BYTES, BlockFormat

SECRET = TierSecret("test", b"k" * 32)
FMT = BlockFormat.of(SECRET)


@pytest.fixture
def config(tmp_path: Path) -> DiskTierConfig:
    return DiskTierConfig(path=tmp_path / "disk", io_threads=2, read_deadline_s=1.0, secret=SECRET)


@pytest.fixture
def handler(config: DiskTierConfig) -> Iterator[DiskHandler]:
    h = DiskHandler(config, make_pool(), NS, ENTRY)
    yield h
    h.shutdown()


def path_of(config: DiskTierConfig, key: OffloadKey) -> Path:
    return Path(block_path(rank_directory(config.path, NS, FMT), key, FMT))


def plant(config: DiskTierConfig, key: OffloadKey, kind: str) -> bytes:
    """Replace ``key``'s genuine file with forgery ``kind``; return the genuine file's bytes."""
    path = path_of(config, key)
    genuine = path.read_bytes()
    path.write_bytes(forge(kind, FMT, NS.fingerprint(), key, genuine))
    return genuine


def test_sealed_blocks_round_trip_under_names_that_are_not_their_keys_and_hide_their_contents(
        handler: DiskHandler, config: DiskTierConfig) -> None:
    ks = keys(2)
    pool = handler._slots
    expected = [bytes(pool[s, :ENTRY[0]]) for s in (0, 1)]
    assert run(handler, store((0, 1), ks)).success
    for key in ks:
        path = path_of(config, key)
        assert path.exists() and key.hex() not in str(path)  # not findable from the prompt's key
        assert path.stat().st_size == HEADER_BYTES + ENTRY[0] + TAG_BYTES
        raw = path.read_bytes()
        assert key not in raw and NS.fingerprint() not in raw and expected[0][:32] not in raw
    assert not (config.path / NS.chain_root().hex()[:16]).exists()  # nor is the directory
    pool[5:7] = 0
    assert run(handler, load(ks, (5, 6))).success
    assert [bytes(pool[s, :ENTRY[0]]) for s in (5, 6)] == expected


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_planted_copied_or_rewritten_block_is_never_loaded(
        handler: DiskHandler, config: DiskTierConfig, forgery: str, caplog: pytest.LogCaptureFixture) -> None:
    (key,) = keys(1)
    assert run(handler, store((0,), (key,))).success
    path = path_of(config, key)
    plant(config, key, forgery)
    handler._slots[3] = 0

    with caplog.at_level(logging.WARNING, logger="kvoffload.tiers.disk.handler"):
        result = run(handler, load((key,), (3,)))

    assert not result.success
    assert not path.exists()  # removed, so it is not read again
    assert handler.unauthentic_blocks == 1
    assert [r.message for r in caplog.records if "authentication" in r.message] != []


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
    size = FMT.file_bytes(ENTRY[0])
    index = DiskIndex.create(config, NS, size)
    assert index.lookup(list(ks)).hits == 4  # names map back to their keys under the secret
    plain = DiskIndex.create(dataclasses.replace(config, secret=None), NS, size)
    assert plain.lookup(list(ks)).hits == 0  # another world directory: never mixed
    other = DiskIndex.create(dataclasses.replace(config, secret=TierSecret("o", b"o" * 32)), NS, size)
    assert other.lookup(list(ks)).hits == 0
