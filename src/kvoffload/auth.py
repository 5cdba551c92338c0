"""Authenticated blocks for shared tiers: a keyed MAC over every block, and block names only the key holders know.

Place in the data flow: when ``tier_secret_file`` or ``tier_secret_env`` is configured, both halves build one
``BlockAuth`` from the secret. The disk tier (and every later shared tier) then names each block by
``BlockAuth.name(key)`` instead of the key itself, writes ``BlockAuth.mac(header, payload)`` after the payload, and
loads a block only if the MAC it reads equals the one it computes. A CRC proves a block was not damaged; the MAC
proves it was written by someone holding the secret. Without the secret a writer can neither forge a block nor
compute which name a given prompt's block has, so it can neither plant KV for a prompt nor target one.

Keyed BLAKE2b from the standard library, one personalization per use so a MAC can never pass for a name. The
secret is never logged: ``TierSecret`` hides it from ``repr``.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

MAC_BYTES = 32
MIN_SECRET_BYTES = 16
_NAME_ROUNDS = 4  # a 4-round Feistel network with a pseudorandom round function is a strong pseudorandom permutation
_HALF = 8


@dataclass(frozen=True)
class TierSecret:
    """The shared tiers' secret; ``source`` says where it came from (a file or an environment variable)."""

    source: str
    value: bytes = field(repr=False)


class BlockAuth:
    """MACs and names of blocks under one secret. Thread-safe (no state beyond the derived keys)."""

    def __init__(self, secret: TierSecret) -> None:
        # BLAKE2b takes keys of up to 64 bytes; longer secrets are hashed down first.
        master = secret.value if len(secret.value) <= 64 else hashlib.blake2b(secret.value).digest()
        self._mac_key = _derive(master, b"kvoff-mac")
        self._name_key = _derive(master, b"kvoff-name")

    def mac(self, header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
        """The ``MAC_BYTES`` tag of a block: its header (fingerprint, key, length, checksum) and its payload."""
        h = hashlib.blake2b(key=self._mac_key, digest_size=MAC_BYTES, person=b"kvoff-block")
        h.update(header)
        h.update(payload)
        return h.digest()

    def verify(self, header: bytes | memoryview, payload: bytes | memoryview, tag: bytes | memoryview) -> bool:
        """True when ``tag`` is this secret's MAC of the block (constant-time comparison)."""
        return hmac.compare_digest(self.mac(header, payload), bytes(tag))

    def name(self, key: bytes) -> bytes:
        """The 16 bytes a block of ``key`` is stored under: a keyed permutation of the key, so the tier's index
        can be rebuilt from names (``key_of``) while nobody without the secret can tell which name a key has."""
        left, right = key[:_HALF], key[_HALF:]
        for i in range(_NAME_ROUNDS):
            left, right = right, _xor(left, self._round(i, right))
        return left + right

    def key_of(self, name: bytes) -> bytes:
        """The key stored under ``name`` (the inverse of ``name``)."""
        left, right = name[:_HALF], name[_HALF:]
        for i in reversed(range(_NAME_ROUNDS)):
            left, right = _xor(right, self._round(i, left)), left
        return left + right

    def directory(self, chain_root: bytes) -> bytes:
        """The name of a namespace's directory under this secret (16 bytes): tiers with and without a secret,
        or with two secrets, never share a directory."""
        return hashlib.blake2b(chain_root, key=self._name_key, digest_size=16, person=b"kvoff-dir").digest()

    def _round(self, i: int, half: bytes) -> bytes:
        return hashlib.blake2b(half, key=self._name_key, digest_size=_HALF, person=b"kvoff-name",
                               salt=bytes([i])).digest()


def _derive(master: bytes, purpose: bytes) -> bytes:
    return hashlib.blake2b(purpose, key=master, digest_size=32).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))
