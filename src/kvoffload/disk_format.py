"""The disk tier's on-disk format: where a block's file lives, its fixed binary header, and the start-up scan.

Shared by both halves: the worker's ``DiskHandler`` writes and reads files in this format, the scheduler's
``DiskTierManager`` rebuilds its index from file names (``disk_tree.scan``: no payload is read). This module
imports no torch and does no block I/O; docs/disk-format.md is its prose twin: change them together.

A file is ``HEADER`` (64 bytes, little-endian) followed by the raw payload bytes, and, for an authenticated tier
(``tier_secret_*``), by a 32-byte keyed BLAKE2b MAC of header and payload (``kvoffload.auth``)::

    offset size field
         0    8 magic              b"KVOFFBLK"
         8    2 format version     1
        10    2 header size        64
        12    4 checksum algorithm 2 = CRC32C (Castagnoli) of the payload; 3 = CRC32C and the MAC trailer
        16   16 namespace fingerprint (Namespace.fingerprint(): model, layout, rank, world size unless replicated)
        32   16 key                (OffloadKey, the same on every rank)
        48    8 payload length
        56    4 payload checksum
        60    4 header checksum    (crc32 of bytes 0..59)

Paths: ``<disk_path>/<world>/rank<r>/<name hex[:2]>/<name hex>.kvb``, where ``world`` is the chain root's hex[:16]
and ``name`` the key, or, for an authenticated tier, both are keyed by the secret (``BlockFormat``). A replicated
namespace (every rank holds the same bytes: ``Namespace.replicated``) has one directory, ``<world>/replicated``,
that rank 0 writes and every rank reads. A file is
written under a temporary name in the same directory (``<name hex>.<pid>-<n>.tmp``) and renamed into place, so a
final name never points at a half-written block. ``disk_tree`` creates, checks and scans the directories.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import crc32c

from kvoffload.auth import MAC_BYTES, BlockAuth, TierSecret
from kvoffload.keys import Namespace, OffloadKey

logger = logging.getLogger(__name__)

MAGIC = b"KVOFFBLK"
DISK_FORMAT_VERSION = 1
CHECKSUM_CRC32C = 2  # 1 (zlib crc32) was used by unreleased builds; such files fail to load
CHECKSUM_CRC32C_MAC = 3
_HEADER = struct.Struct("<8sHHI16s16sQI")
HEADER_BYTES = _HEADER.size + 4
BLOCK_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
DIR_MODE = 0o700
FILE_MODE = 0o600
STALE_TMP_S = 600.0
"""A temporary file this old is left over from a crash even if its writer's pid is alive again (pid reuse)."""


class CorruptBlockError(ValueError):
    """A block file's bytes do not match its header (checksum, length, namespace or key)."""


class UnauthenticBlockError(CorruptBlockError):
    """A block file's MAC is not this tier's secret's: someone without the secret wrote or changed it."""


@dataclass(frozen=True)
class BlockFormat:
    """How a tier names and seals its files: plain (names are keys, CRC32C only) or authenticated by a secret
    (names and the world directory keyed by it, a MAC trailer after the payload)."""

    auth: BlockAuth | None = None

    @classmethod
    def of(cls, secret: TierSecret | None) -> BlockFormat:
        return cls(None if secret is None else BlockAuth(secret))

    @property
    def algorithm(self) -> int:
        return CHECKSUM_CRC32C if self.auth is None else CHECKSUM_CRC32C_MAC

    @property
    def trailer_bytes(self) -> int:
        return 0 if self.auth is None else MAC_BYTES

    def file_bytes(self, payload_bytes: int) -> int:
        """Size on disk of a block with ``payload_bytes`` of payload."""
        return HEADER_BYTES + payload_bytes + self.trailer_bytes

    def name(self, key: OffloadKey) -> str:
        """The hex name ``key``'s file has."""
        return (key if self.auth is None else self.auth.name(key)).hex()

    def key_of(self, name: bytes) -> OffloadKey:
        """The key a file name (its 16 bytes) stands for."""
        return OffloadKey(name if self.auth is None else self.auth.key_of(name))

    def world_name(self, chain_root: bytes) -> str:
        return (chain_root if self.auth is None else self.auth.directory(chain_root)).hex()[:16]


PLAIN = BlockFormat()


class GroupedLayout(Protocol):
    """What the disk tier needs of a KV-cache layout (``layout.KVCacheLayout`` is one; no torch here)."""

    @property
    def groups(self) -> Sequence[Any]: ...

    def group_block_bytes(self, group: int) -> int: ...


def entry_bytes_of(layout: GroupedLayout, factor: int) -> tuple[int, ...]:
    """Payload bytes of one offload block (``factor`` engine blocks) of each KV-cache group."""
    if factor <= 0:
        raise ValueError(f"offload factor {factor} must be positive")
    return tuple(factor * layout.group_block_bytes(g) for g in range(len(layout.groups)))


def world_directory(disk_path: Path, namespace: Namespace, fmt: BlockFormat = PLAIN) -> Path:
    """The directory of every rank of this world (named by the chain root, the same on all ranks)."""
    return disk_path / fmt.world_name(namespace.chain_root())


REPLICATED_DIRECTORY = "replicated"


def rank_directory(disk_path: Path, namespace: Namespace, fmt: BlockFormat = PLAIN) -> Path:
    """The directory holding ``namespace.rank``'s files (a replicated namespace's one copy, whatever the rank);
    the scheduler's index covers rank 0's."""
    name = REPLICATED_DIRECTORY if namespace.replicated else f"rank{namespace.rank}"
    return world_directory(disk_path, namespace, fmt) / name


def rank_directories(disk_path: Path, namespace: Namespace, fmt: BlockFormat = PLAIN) -> list[Path]:
    """Every directory of this world, rank 0's first: one per rank, or the one copy of a replicated namespace
    (files of an evicted key are removed from all of them)."""
    return [rank_directory(disk_path, replace(namespace, rank=r), fmt) for r in namespace.copy_ranks]


def block_path(rank_dir: Path, key: OffloadKey, fmt: BlockFormat = PLAIN) -> str:
    """Final file name of ``key`` in ``rank_dir`` (a str: this runs per block)."""
    name = fmt.name(key)
    return os.path.join(rank_dir, name[:2], name + BLOCK_SUFFIX)


def file_bytes(payload_bytes: int) -> int:
    """Size on disk of a plain block with ``payload_bytes`` of payload (``BlockFormat.file_bytes`` in general)."""
    return PLAIN.file_bytes(payload_bytes)


def checksum(payload: memoryview | bytes) -> int:
    # Hardware CRC32C (SSE4.2 / ARMv8 CRC): ~12 GB/s on one core here, 5x zlib.crc32, which capped reads at
    # half the disk's rate on 2 cores. It releases the GIL on large buffers, so I/O threads run in parallel.
    return int(crc32c.crc32c(payload))


def encode_header(fingerprint: bytes, key: OffloadKey, payload_bytes: int, payload_checksum: int,
                  algorithm: int = CHECKSUM_CRC32C) -> bytes:
    """The 64 header bytes of a block file."""
    body = _HEADER.pack(MAGIC, DISK_FORMAT_VERSION, HEADER_BYTES, algorithm, fingerprint, key,
                        payload_bytes, payload_checksum)
    return body + struct.pack("<I", zlib.crc32(body))


def decode_header(raw: bytes | memoryview, fingerprint: bytes, key: OffloadKey, payload_bytes: int,
                  algorithm: int = CHECKSUM_CRC32C) -> int:
    """Check a header against what the reader expects and return the payload checksum it records.

    Raises:
        CorruptBlockError: the header is damaged, from another format version or namespace, for another
            key, records another payload length, or another algorithm than the reader's (a plain file in an
            authenticated tier is refused, whatever its CRC says).
    """
    if len(raw) != HEADER_BYTES:
        raise CorruptBlockError(f"header is {len(raw)} bytes, expected {HEADER_BYTES}")
    body = bytes(raw[:_HEADER.size])
    if struct.unpack("<I", raw[_HEADER.size:])[0] != zlib.crc32(body):
        raise CorruptBlockError("header checksum mismatch")
    magic, version, size, file_algorithm, file_fp, file_key, length, payload_crc = _HEADER.unpack(body)
    if (magic, version, size, file_algorithm) == (MAGIC, DISK_FORMAT_VERSION, HEADER_BYTES, CHECKSUM_CRC32C) \
            and algorithm == CHECKSUM_CRC32C_MAC:
        raise UnauthenticBlockError("block carries no MAC (written without this tier's secret)")
    if (magic, version, size, file_algorithm) != (MAGIC, DISK_FORMAT_VERSION, HEADER_BYTES, algorithm):
        raise CorruptBlockError(f"unknown format (magic {magic!r}, version {version}, algorithm {file_algorithm})")
    if file_fp != fingerprint:
        raise CorruptBlockError("block belongs to another namespace")
    if file_key != key:
        raise CorruptBlockError(f"file holds key {file_key.hex()}, expected {key.hex()}")
    if length != payload_bytes:
        raise CorruptBlockError(f"payload is {length} bytes, expected {payload_bytes}")
    payload_checksum: int = payload_crc
    return payload_checksum
