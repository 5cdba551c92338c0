"""What a writer without the tier secret can plant at a block's name (file or value), for the shared tiers' tests.

Each forgery starts from what such a writer can see or make: a genuine sealed block of the tier (readable by anyone
who can read the store), blocks of its own in any format, and seals made with another secret. Every one must fail to
open in a sealed tier (``tiers.lower.block_codec.open_into``) with ``UnauthenticBlockError``.
"""

from __future__ import annotations

import os
import struct
import zlib

from kvoffload.auth import TAG_BYTES, TierSecret
from kvoffload.keys import OffloadKey
from kvoffload.tiers.lower.block_codec import encode_value
from kvoffload.tiers.lower.block_format import HEADER_BYTES, MAGIC, PLAIN, BlockFormat, checksum, encode_sealed_header

FORGERIES = ("plain_block", "zero_tag", "other_secret", "flipped_ciphertext", "flipped_nonce", "other_key",
             "other_namespace", "old_mac_format")
OTHER_SECRET = TierSecret("attacker", b"a" * 32)


def forge(kind: str, fmt: BlockFormat, fingerprint: bytes, key: OffloadKey, genuine: bytes) -> bytes:
    """The bytes a writer without ``fmt``'s secret plants at ``key``'s name; ``genuine`` is the tier's own block
    there (its payload length is the one the reader expects)."""
    n = len(genuine) - HEADER_BYTES - TAG_BYTES
    payload = memoryview(os.urandom(n))
    if kind == "plain_block":  # what an engine without the secret writes
        return encode_value(PLAIN, fingerprint, key, payload)
    if kind == "zero_tag":  # a well-formed sealed block with made-up ciphertext and tag
        return encode_sealed_header(os.urandom(12), n) + bytes(payload) + bytes(TAG_BYTES)
    if kind == "other_secret":
        return encode_value(BlockFormat.of(OTHER_SECRET), fingerprint, key, payload)
    if kind == "flipped_ciphertext":
        return _flip(genuine, HEADER_BYTES + n // 2)
    if kind == "flipped_nonce":  # the clear header changed, its checksum fixed up
        return _with_header_crc(_flip(genuine, 20))
    if kind == "other_key":  # a genuine block of another key, copied to this name
        return _genuine_of(fmt, fingerprint, OffloadKey(bytes(16)), payload)
    if kind == "other_namespace":  # a genuine block of another rank or namespace, copied to this name
        return _genuine_of(fmt, bytes(16), key, payload)
    if kind == "old_mac_format":  # the sealed format before encryption: version 1, algorithm 3, a 32-byte MAC
        body = struct.pack("<8sHHI16s16sQI", MAGIC, 1, HEADER_BYTES, 3, fingerprint, key, n, checksum(payload))
        return body + struct.pack("<I", zlib.crc32(body)) + bytes(payload) + bytes(32)
    raise ValueError(f"no forgery {kind!r}")


def _genuine_of(fmt: BlockFormat, fingerprint: bytes, key: OffloadKey, payload: memoryview) -> bytes:
    # Stands for a block the tier itself sealed for another name: the attacker can only copy such blocks.
    return encode_value(fmt, fingerprint, key, payload)


def _flip(block: bytes, at: int) -> bytes:
    raw = bytearray(block)
    raw[at] ^= 1
    return bytes(raw)


def _with_header_crc(block: bytes) -> bytes:
    raw = bytearray(block)
    struct.pack_into("<I", raw, 60, zlib.crc32(bytes(raw[:60])))
    return bytes(raw)
