"""The block format every tier under host stores: a fixed binary header, then the payload, plain or sealed.

The worker's handlers write and read blocks in this format (``block_codec`` encodes and checks them); its names
(``BlockFormat``: the world's and each key's) also name the disk tier's files and the stores' keys. This module
imports no torch and does no block I/O; docs/disk-format.md is its prose twin: change them together.

A plain file (no tier secret: format version 1) is ``HEADER`` (64 bytes, little-endian) followed by the raw payload
bytes::

    offset size field
         0    8 magic              b"KVOFFBLK"
         8    2 format version     1
        10    2 header size        64
        12    4 checksum algorithm 2 = CRC32C (Castagnoli) of the payload
        16   16 namespace fingerprint (Namespace.fingerprint(): model, layout, rank, world size unless replicated)
        32   16 key                (OffloadKey, the same on every rank)
        48    8 payload length
        56    4 payload checksum
        60    4 header checksum    (crc32 of bytes 0..59)

A sealed file (a tier secret: format version 2) hides what it holds: a 64-byte clear header that names neither
namespace nor key, the payload encrypted with AES-256-GCM, and its 16-byte tag (``kvoffload.auth``)::

    offset size field
         0    8 magic              b"KVOFFBLK"
         8    2 format version     2
        10    2 header size        64
        12    4 algorithm          4 = AES-256-GCM
        16   12 nonce              random
        28    8 payload length
        36   24 zero
        60    4 header checksum    (crc32 of bytes 0..59)

The disk tier keeps one block per file in this format (``tiers/disk/paths.py`` says where); the remote and object
tiers keep one block per value or object in it.
"""

from __future__ import annotations

import logging
import struct
import zlib
from dataclasses import dataclass

import crc32c

from kvoffload.auth import NONCE_BYTES, SEAL_VERSION, TAG_BYTES, BlockAuth, TierSecret
from kvoffload.keys import OffloadKey

logger = logging.getLogger(__name__)

MAGIC = b"KVOFFBLK"
DISK_FORMAT_VERSION = 1
CHECKSUM_CRC32C = 2  # 1 (zlib crc32) was used by unreleased builds; such files fail to load
AES_256_GCM = 4  # 3 (CRC32C and a keyed BLAKE2b MAC, version 1) was the sealed format before encryption
SEALED_FORMAT_VERSION = SEAL_VERSION
_HEADER = struct.Struct("<8sHHI16s16sQI")
_SEALED_HEADER = struct.Struct(f"<8sHHI{NONCE_BYTES}sQ24x")
HEADER_BYTES = _HEADER.size + 4
"""A temporary file this old is left over from a crash even if its writer's pid is alive again (pid reuse)."""


class CorruptBlockError(ValueError):
    """A block file's bytes do not match its header (checksum, length, namespace or key)."""


class UnauthenticBlockError(CorruptBlockError):
    """A sealed block's tag does not verify, or a plain block stands in a sealed tier: someone without the secret
    wrote or changed it (or it was damaged: authenticated encryption cannot tell the two apart)."""


@dataclass(frozen=True)
class BlockFormat:
    """How a tier names and seals its files: plain (names are keys, CRC32C only) or sealed by a secret (names and
    the world directory keyed by it, the payload encrypted and authenticated, a tag trailer after it)."""

    auth: BlockAuth | None = None

    @classmethod
    def of(cls, secret: TierSecret | None) -> BlockFormat:
        return cls(None if secret is None else BlockAuth(secret))

    @property
    def trailer_bytes(self) -> int:
        return 0 if self.auth is None else TAG_BYTES

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


def file_bytes(payload_bytes: int) -> int:
    """Size on disk of a plain block with ``payload_bytes`` of payload (``BlockFormat.file_bytes`` in general)."""
    return PLAIN.file_bytes(payload_bytes)


def checksum(payload: memoryview | bytes) -> int:
    # Hardware CRC32C (SSE4.2 / ARMv8 CRC): ~12 GB/s on one core here, 5x zlib.crc32, which capped reads at
    # half the disk's rate on 2 cores. It releases the GIL on large buffers, so I/O threads run in parallel.
    return int(crc32c.crc32c(payload))


def encode_header(fingerprint: bytes, key: OffloadKey, payload_bytes: int, payload_checksum: int) -> bytes:
    """The 64 header bytes of a plain block."""
    body = _HEADER.pack(MAGIC, DISK_FORMAT_VERSION, HEADER_BYTES, CHECKSUM_CRC32C, fingerprint, key,
                        payload_bytes, payload_checksum)
    return body + struct.pack("<I", zlib.crc32(body))


def encode_sealed_header(nonce: bytes, payload_bytes: int) -> bytes:
    """The 64 clear header bytes of a sealed block (they name neither namespace nor key)."""
    body = _SEALED_HEADER.pack(MAGIC, SEALED_FORMAT_VERSION, HEADER_BYTES, AES_256_GCM, nonce, payload_bytes)
    return body + struct.pack("<I", zlib.crc32(body))


def decode_header(raw: bytes | memoryview, fingerprint: bytes, key: OffloadKey, payload_bytes: int) -> int:
    """Check a plain block's header against what the reader expects and return the payload checksum it records.

    Raises:
        CorruptBlockError: the header is damaged, of another format (a sealed block in a plain tier, too), from
            another namespace, for another key, or records another payload length.
    """
    body = _checked_body(raw)
    magic, version, size, algorithm, file_fp, file_key, length, payload_crc = _HEADER.unpack(body)
    if (magic, version, size, algorithm) != (MAGIC, DISK_FORMAT_VERSION, HEADER_BYTES, CHECKSUM_CRC32C):
        raise CorruptBlockError(f"unknown format (magic {magic!r}, version {version}, algorithm {algorithm})")
    if file_fp != fingerprint:
        raise CorruptBlockError("block belongs to another namespace")
    if file_key != key:
        raise CorruptBlockError(f"file holds key {file_key.hex()}, expected {key.hex()}")
    if length != payload_bytes:
        raise CorruptBlockError(f"payload is {length} bytes, expected {payload_bytes}")
    payload_checksum: int = payload_crc
    return payload_checksum


def decode_sealed_header(raw: bytes | memoryview, payload_bytes: int) -> bytes:
    """Check a sealed block's clear header and return its nonce (what it claims is proven only by its tag).

    Raises:
        UnauthenticBlockError: the block is of version 1 (plain, or the keyed-MAC format before encryption):
            it was not written with this tier's secret by this version.
        CorruptBlockError: the header is damaged, of another format or version (an older sealed format's blocks
            live under other names and are never asked for), or records another payload length.
    """
    body = _checked_body(raw)
    magic, version, size, algorithm, nonce, length = _SEALED_HEADER.unpack(body)
    if (magic, version, size) == (MAGIC, DISK_FORMAT_VERSION, HEADER_BYTES):
        raise UnauthenticBlockError("block is not sealed (written without this tier's secret, or by an older version)")
    if (magic, version, size, algorithm) != (MAGIC, SEALED_FORMAT_VERSION, HEADER_BYTES, AES_256_GCM):
        raise CorruptBlockError(f"unknown format (magic {magic!r}, version {version}, algorithm {algorithm})")
    if length != payload_bytes:
        raise CorruptBlockError(f"payload is {length} bytes, expected {payload_bytes}")
    sealed_nonce: bytes = nonce
    return sealed_nonce


def _checked_body(raw: bytes | memoryview) -> bytes:
    if len(raw) != HEADER_BYTES:
        raise CorruptBlockError(f"header is {len(raw)} bytes, expected {HEADER_BYTES}")
    body = bytes(raw[:_HEADER.size])
    if struct.unpack("<I", raw[_HEADER.size:])[0] != zlib.crc32(body):
        raise CorruptBlockError("header checksum mismatch")
    return body
