"""The remote tier's values: one block each, in exactly the disk tier's self-describing encoding.

``RemoteHandler`` seals a host slot's bytes into a value before its ``SET`` and verifies every value a ``GET``
returns before a byte of it reaches a host slot. A value is what a block file holds (``disk_format``): the 64-byte
header (namespace fingerprint, key, payload length, CRC32C), the payload, and, for a tier with a secret, the keyed
MAC. One encoding for both shared tiers means one set of checks, one document (docs/disk-format.md) and no pickle.
Pure functions over bytes; no redis here.
"""

from __future__ import annotations

from kvoffload.disk_format import (
    HEADER_BYTES,
    BlockFormat,
    CorruptBlockError,
    UnauthenticBlockError,
    checksum,
    decode_header,
    encode_header,
)
from kvoffload.keys import OffloadKey


def encode_value(fmt: BlockFormat, fingerprint: bytes, key: OffloadKey, payload: memoryview) -> bytes:
    """Header, payload and (with a secret) MAC as one new ``bytes`` (``seal_into`` a fresh buffer)."""
    value = bytearray(fmt.file_bytes(len(payload)))
    seal_into(fmt, fingerprint, key, payload, memoryview(value))
    return bytes(value)


def seal_into(fmt: BlockFormat, fingerprint: bytes, key: OffloadKey, payload: memoryview, out: memoryview) -> int:
    """Write the value of ``payload`` at the start of ``out``: the payload is copied behind the header, its CRC is
    taken of that copy (so the checksum always matches the bytes written), and the MAC follows. Returns its length.
    """
    raw = payload if payload.format == "B" else payload.cast("B")  # e.g. an int8 slot: its bytes as they are
    n = len(raw)
    staged = out[HEADER_BYTES:HEADER_BYTES + n]
    staged[:] = raw
    header = encode_header(fingerprint, key, n, checksum(staged), fmt.algorithm)
    out[:HEADER_BYTES] = header
    end = HEADER_BYTES + n
    if fmt.auth is not None:
        mac = fmt.auth.mac(header, staged)
        out[end:end + len(mac)] = mac
        end += len(mac)
    return end


def verified_payload(fmt: BlockFormat, fingerprint: bytes, key: OffloadKey, value: bytes,
                     payload_bytes: int) -> memoryview:
    """The payload of ``value`` (a view into it: no copy) once header, length, CRC and MAC all check out.

    The checks run in ``disk_io.read_block``'s order: the header says what the value claims to be (a plain value
    in an authenticated tier is unauthentic, whatever its size), then its length, then the CRC, and only a
    well-formed value is judged on its MAC, so damage is reported as damage and only forgery as forgery.

    Raises:
        CorruptBlockError: the value is damaged, truncated, too long, or another namespace's or key's.
        UnauthenticBlockError: it carries no MAC, or not this secret's.
    """
    view = memoryview(value)
    header = view[:HEADER_BYTES]
    expected_crc = decode_header(header, fingerprint, key, payload_bytes, fmt.algorithm)
    if len(view) != fmt.file_bytes(payload_bytes):
        raise CorruptBlockError(f"value of key {key.hex()} is {len(view)} bytes, expected "
                                f"{fmt.file_bytes(payload_bytes)}")
    payload = view[HEADER_BYTES:HEADER_BYTES + payload_bytes]
    if checksum(payload) != expected_crc:
        raise CorruptBlockError(f"value of key {key.hex()}: payload checksum mismatch")
    if fmt.auth is not None and not fmt.auth.verify(header, payload, view[HEADER_BYTES + payload_bytes:]):
        raise UnauthenticBlockError(f"value of key {key.hex()}: MAC mismatch (not written with this tier's secret)")
    return payload
