"""Content keys for offloaded KV blocks.

A block's key is a chained content hash: the hash of its parent block, its token ids and any extra keys (LoRA
adapter, multimodal input hashes), rooted in a namespace fingerprint that covers everything that changes the bytes
of a KV page (model and what decides its weights, dtype, page layout, tensor-parallel rank and world size, format
version). The key of a block in
KV-cache group ``g`` is derived from the block hash and ``g``.

Keys use BLAKE2b with fixed parameters: no Python ``hash()``, no seeds, no process state. The same tokens in the same
namespace give the same key in every process and on every machine, so a shared tier is really shared, and a block
written under another namespace can never be looked up by this one.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import NewType

FORMAT_VERSION = 1
KEY_BYTES = 16

BlockHash = NewType("BlockHash", bytes)
"""Chained content hash of one offload block's tokens (group independent)."""

OffloadKey = NewType("OffloadKey", bytes)
"""What a tier indexes: one block of one KV-cache group, in one namespace."""


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two engines' KV pages for the same tokens differ."""

    model: str
    dtype: str
    layout: str
    """A stable description of the page layout (e.g. ``canonical_kv.describe()``)."""
    rank: int = 0
    world_size: int = 1
    format_version: int = FORMAT_VERSION
    weights: str = ""
    """What else decides the weights: the model config's KV-relevant fields, quantization, revision and the
    user's model version (an engine adapter builds it; two checkpoints it cannot tell apart need a version)."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("Namespace.model must be a non-empty model identifier")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Namespace.rank {self.rank} is outside world_size {self.world_size}")

    def fingerprint(self) -> bytes:
        """A 16-byte digest of the namespace; the root of every hash chain in it."""
        fields = (self.model, self.dtype, self.layout, str(self.rank), str(self.world_size),
                  str(self.format_version), self.weights)
        return _digest(b"kvoffload-namespace", *(f.encode() for f in fields))

    def chain_root(self) -> bytes:
        """Root of every key chain: the same on every rank, since one scheduler keys the blocks of all ranks.

        Per-rank bytes (a rank's files on a shared disk) are told apart by ``fingerprint()``, which covers the rank.
        """
        return replace(self, rank=0).fingerprint()


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        # Length-prefix each part so that no two different part lists hash the same bytes.
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.digest()


def _encode_tokens(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def hash_block(parent: bytes, tokens: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    """Hash one block's tokens chained to its parent (the namespace fingerprint for the first block)."""
    return BlockHash(_digest(parent, _encode_tokens(tokens), *(k.encode() for k in extra_keys)))


def hash_blocks(
    root: bytes, tokens: Sequence[int], block_tokens: int, extra_keys: Sequence[str] = ()
) -> list[BlockHash]:
    """Hashes of every full ``block_tokens``-sized block of ``tokens``, chained from ``root``."""
    hashes: list[BlockHash] = []
    parent = root
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = hash_block(parent, tokens[start:start + block_tokens], extra_keys)
        hashes.append(BlockHash(parent))
    return hashes


def offload_key(block_hash: BlockHash, group: int) -> OffloadKey:
    """The key of ``block_hash``'s page in KV-cache group ``group``."""
    return OffloadKey(_digest(block_hash, struct.pack("<I", group)))


def offload_keys(block_hashes: Iterable[BlockHash], group: int) -> list[OffloadKey]:
    return [offload_key(h, group) for h in block_hashes]
