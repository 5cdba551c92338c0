"""The disk tier with a secret (``tier_secret_*``): blocks carry a MAC and secret-derived names; a planted or
rewritten block with a valid CRC but no valid MAC is never loaded, is counted, and is logged once."""

from __future__ import annotations

import dataclasses
import logging
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.transfer.test_disk_handler import ENTRY, NS, keys, load, make_pool, run, store

from kvoffload.auth import MAC_BYTES, TierSecret
from kvoffload.config import DiskTierConfig
from kvoffload.disk_format import (
    CHECKSUM_CRC32C,
    HEADER_BYTES,
    BlockFormat,
    block_path,
    checksum,
    encode_header,
    rank_directory,
)
from kvoffload.keys import OffloadKey
from kvoffload.manager.disk import DiskTierManager
from kvoffload.transfer.disk import DiskHandler

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


def forge(path: Path, key: OffloadKey, payload: bytes, algorithm: int, tag: bytes = b"") -> None:
    """What a writer without the secret can make: a well-formed file with a valid CRC, and any MAC it likes."""
    header = encode_header(NS.fingerprint(), key, len(payload), checksum(payload), algorithm)
    path.write_bytes(header + payload + tag)


def test_authenticated_blocks_round_trip_under_names_that_are_not_their_keys(
        handler: DiskHandler, config: DiskTierConfig) -> None:
    ks = keys(2)
    pool = handler._slots
    expected = [bytes(pool[s, :ENTRY[0]]) for s in (0, 1)]
    assert run(handler, store((0, 1), ks)).success
    for key in ks:
        path = path_of(config, key)
        assert path.exists() and key.hex() not in str(path)  # not findable from the prompt's key
        assert path.stat().st_size == HEADER_BYTES + ENTRY[0] + MAC_BYTES
    assert not (config.path / NS.chain_root().hex()[:16]).exists()  # nor is the directory
    pool[5:7] = 0
    assert run(handler, load(ks, (5, 6))).success
    assert [bytes(pool[s, :ENTRY[0]]) for s in (5, 6)] == expected


@pytest.mark.parametrize("forgery", ["plain_file", "zero_mac", "other_secret_mac", "rewritten_payload"])
def test_a_planted_or_rewritten_block_with_a_valid_crc_is_never_loaded(
        handler: DiskHandler, config: DiskTierConfig, forgery: str, caplog: pytest.LogCaptureFixture) -> None:
    (key,) = keys(1)
    assert run(handler, store((0,), (key,))).success
    path = path_of(config, key)
    planted = bytes(range(ENTRY[0]))
    if forgery == "plain_file":  # what an engine without a secret would write
        forge(path, key, planted, CHECKSUM_CRC32C)
    elif forgery == "zero_mac":
        forge(path, key, planted, FMT.algorithm, bytes(MAC_BYTES))
    elif forgery == "other_secret_mac":
        other = BlockFormat.of(TierSecret("other", b"o" * 32))
        assert other.auth is not None
        header = encode_header(NS.fingerprint(), key, len(planted), checksum(planted), FMT.algorithm)
        forge(path, key, planted, FMT.algorithm, other.auth.mac(header, planted))
    else:  # a genuine file whose payload is replaced, with its CRC and header checksum fixed up
        raw = bytearray(path.read_bytes())
        raw[HEADER_BYTES:HEADER_BYTES + ENTRY[0]] = planted
        struct.pack_into("<I", raw, 56, checksum(planted))
        struct.pack_into("<I", raw, 60, zlib.crc32(bytes(raw[:60])))
        path.write_bytes(bytes(raw))
    handler._slots[3] = 0

    with caplog.at_level(logging.WARNING, logger="kvoffload.transfer.disk"):
        result = run(handler, load((key,), (3,)))

    assert not result.success
    assert bytes(handler._slots[3, :ENTRY[0]]) != planted
    assert not path.exists()  # removed, so it is not read again
    assert handler.unauthentic_blocks == 1
    assert [r.message for r in caplog.records if "authentication" in r.message] != []


def test_unauthentic_blocks_are_logged_once_and_counted_each_time(
        handler: DiskHandler, config: DiskTierConfig, caplog: pytest.LogCaptureFixture) -> None:
    ks = keys(3)
    assert run(handler, store((0, 1, 2), ks)).success
    for key in ks:
        forge(path_of(config, key), key, bytes(ENTRY[0]), FMT.algorithm, bytes(MAC_BYTES))
    with caplog.at_level(logging.WARNING, logger="kvoffload.transfer.disk"):
        for i, key in enumerate(ks):
            assert not run(handler, load((key,), (4 + i,))).success
    assert handler.unauthentic_blocks == 3
    assert len([r for r in caplog.records if "authentication" in r.message]) == 1


def test_the_index_is_rebuilt_from_secret_names_and_a_plain_engine_sees_none_of_them(
        handler: DiskHandler, config: DiskTierConfig) -> None:
    ks = keys(4)
    assert run(handler, store((0, 1, 2, 3), ks)).success
    size = FMT.file_bytes(ENTRY[0])
    index = DiskTierManager.create(config, NS, size)
    assert index.lookup(list(ks)).hits == 4  # names map back to their keys under the secret
    plain = DiskTierManager.create(dataclasses.replace(config, secret=None), NS, size)
    assert plain.lookup(list(ks)).hits == 0  # another world directory: never mixed
    other = DiskTierManager.create(dataclasses.replace(config, secret=TierSecret("o", b"o" * 32)), NS, size)
    assert other.lookup(list(ks)).hits == 0
