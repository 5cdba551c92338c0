"""The shared tiers' block codec: plain blocks checked by CRC, sealed blocks that hide what they hold and open
only for this secret, name, rank and namespace."""

from __future__ import annotations

import os

import numpy as np
import pytest
from tests.forgeries import FORGERIES, forge

from kvoffload.auth import TierSecret
from kvoffload.keys import OffloadKey
from kvoffload.tiers.lower.block_codec import encode_value, open_into
from kvoffload.tiers.lower.block_format import (
    HEADER_BYTES,
    PLAIN,
    BlockFormat,
    CorruptBlockError,
    UnauthenticBlockError,
)

SEALED = BlockFormat.of(TierSecret("test", b"k" * 32))
FP = bytes(range(16))
KEY = OffloadKey(bytes(range(16, 32)))
N = 4096


def payload() -> memoryview:
    return memoryview(np.frombuffer(os.urandom(N), dtype=np.int8).copy().data)  # an int8 slot, as the tiers hold


def opened(fmt: BlockFormat, block: bytes, fingerprint: bytes = FP, key: OffloadKey = KEY) -> bytes:
    out = np.zeros(N, dtype=np.int8)
    open_into(fmt, fingerprint, key, block, out.data)
    return out.tobytes()


@pytest.mark.parametrize("fmt", [PLAIN, SEALED], ids=["plain", "sealed"])
def test_a_block_opens_to_its_payload(fmt: BlockFormat) -> None:
    data = payload()
    block = encode_value(fmt, FP, KEY, data)
    assert len(block) == fmt.file_bytes(N)
    assert opened(fmt, block) == data.tobytes()


def test_a_sealed_block_names_neither_namespace_nor_key_and_hides_its_payload() -> None:
    data = payload()
    plain, sealed = encode_value(PLAIN, FP, KEY, data), encode_value(SEALED, FP, KEY, data)
    assert FP in plain and KEY in plain and data.tobytes()[:32] in plain  # the check would see a plain block
    assert FP not in sealed and KEY not in sealed and data.tobytes()[:32] not in sealed
    assert sealed[HEADER_BYTES:] != encode_value(SEALED, FP, KEY, data)[HEADER_BYTES:]  # fresh nonce, new bytes


@pytest.mark.parametrize("kind", FORGERIES)
def test_no_forgery_opens_in_a_sealed_tier(kind: str) -> None:
    genuine = encode_value(SEALED, FP, KEY, payload())
    assert opened(SEALED, genuine)  # the genuine block opens, so a refusal below is the forgery's
    with pytest.raises(UnauthenticBlockError):
        opened(SEALED, forge(kind, SEALED, FP, KEY, genuine))


@pytest.mark.parametrize("fmt", [PLAIN, SEALED], ids=["plain", "sealed"])
@pytest.mark.parametrize("cut", [-1, 1, -HEADER_BYTES - 1])
def test_a_truncated_or_too_long_block_is_corrupt(fmt: BlockFormat, cut: int) -> None:
    block = encode_value(fmt, FP, KEY, payload())
    damaged = block[:cut] if cut < 0 else block + bytes(cut)
    with pytest.raises(CorruptBlockError):
        opened(fmt, damaged)


@pytest.mark.parametrize(("fingerprint", "key"), [(bytes(16), KEY), (FP, OffloadKey(bytes(16)))])
def test_a_plain_block_of_another_namespace_or_key_is_corrupt(fingerprint: bytes, key: OffloadKey) -> None:
    with pytest.raises(CorruptBlockError, match=r"namespace|key"):
        opened(PLAIN, encode_value(PLAIN, FP, KEY, payload()), fingerprint, key)


def test_a_sealed_block_in_a_plain_tier_is_corrupt() -> None:
    with pytest.raises(CorruptBlockError, match="unknown format"):
        opened(PLAIN, encode_value(SEALED, FP, KEY, payload()))
