"""One block's bytes as a shared tier holds them: sealed from a payload, opened back into a host slot.

Both shared tiers use this one codec: the disk tier's ``tiers.disk.file_io`` for block files and the remote tier's
``RemoteHandler`` for values (a value is exactly a block file's bytes). Plain (no tier secret): the 64-byte header
(namespace fingerprint, key, payload length, CRC32C) and the payload. Sealed (a tier secret): a clear header that
names neither, the payload encrypted with AES-256-GCM, and its tag (``kvoffload.auth``). docs/disk-format.md
documents both; no pickle, no torch, no I/O here.
"""

from __future__ import annotations

from kvoffload.keys import OffloadKey
from kvoffload.tiers.lower.block_format import (
    HEADER_BYTES,
    BlockFormat,
    CorruptBlockError,
    UnauthenticBlockError,
    checksum,
    decode_header,
    decode_sealed_header,
    encode_header,
    encode_sealed_header,
)


def seal_into(fmt: BlockFormat, fingerprint: bytes, key: OffloadKey, payload: memoryview, out: memoryview) -> int:
    """Write the block of ``payload`` at the start of ``out`` and return its length (``fmt.file_bytes``).

    Plain: the payload is copied behind the header and its CRC taken of that copy, so the checksum always matches
    the bytes written. Sealed: the payload is encrypted straight into ``out`` (the encryption is the copy).
    """
    raw = _bytes_of(payload)
    n = len(raw)
    body = out[HEADER_BYTES:HEADER_BYTES + n + fmt.trailer_bytes]
    if fmt.auth is None:
        body[:] = raw
        header = encode_header(fingerprint, key, n, checksum(body))
    else:
        nonce = fmt.auth.new_nonce()
        header = encode_sealed_header(nonce, n)
        fmt.auth.seal_into(fingerprint + key, nonce, header, raw, body)
    out[:HEADER_BYTES] = header
    return HEADER_BYTES + len(body)


def encode_value(fmt: BlockFormat, fingerprint: bytes, key: OffloadKey, payload: memoryview) -> bytes:
    """The block of ``payload`` as one new ``bytes`` (``seal_into`` a fresh buffer)."""
    value = bytearray(fmt.file_bytes(len(_bytes_of(payload))))
    seal_into(fmt, fingerprint, key, payload, memoryview(value))
    return bytes(value)


def open_into(fmt: BlockFormat, fingerprint: bytes, key: OffloadKey, block: bytes | memoryview,
              out: memoryview) -> None:
    """Check ``block`` (all its bytes) and put its payload into ``out`` (exactly the expected payload length).

    The header first: it says what the block claims to be (a plain block in a sealed tier is unauthentic, whatever
    its size), then its length. A plain block's CRC is checked before a byte reaches ``out``; a sealed block is
    decrypted into ``out`` and then judged on its tag, so ``out`` holds garbage when this raises, and must not be
    used (a failed load's slots are dropped).

    Raises:
        CorruptBlockError: the block is damaged, truncated, too long, or (plain) another namespace's or key's.
        UnauthenticBlockError: a plain block in a sealed tier, or a tag that does not verify (forged, copied from
            another name, rank or namespace, or damaged).
    """
    view = memoryview(block)
    target = _bytes_of(out)
    header, body = view[:HEADER_BYTES], view[HEADER_BYTES:]
    if fmt.auth is None:
        expected_crc = decode_header(header, fingerprint, key, len(target))
        check_length(fmt, key, len(view), len(target))
        if checksum(body) != expected_crc:
            raise CorruptBlockError(f"block of key {key.hex()}: payload checksum mismatch")
        target[:] = body
        return
    nonce = decode_sealed_header(header, len(target))
    check_length(fmt, key, len(view), len(target))
    if not fmt.auth.open_into(fingerprint + key, nonce, header, body, target):
        raise UnauthenticBlockError(f"block of key {key.hex()}: tag mismatch (damaged, or not sealed with this "
                                    f"tier's secret for this name)")


def check_length(fmt: BlockFormat, key: OffloadKey, got: int, payload_bytes: int) -> None:
    """Raise ``CorruptBlockError`` unless a block of ``got`` bytes is the size of a ``payload_bytes`` one."""
    expected = fmt.file_bytes(payload_bytes)
    if got != expected:
        raise CorruptBlockError(f"block of key {key.hex()} is {got} bytes, expected {expected}")


def _bytes_of(view: memoryview) -> memoryview:
    return view if view.format == "B" else view.cast("B")  # e.g. an int8 slot: its bytes as they are
