"""Content keys for offloaded KV blocks.

A block's key is a chained content hash: the hash of its parent block, its token ids and any extra keys (LoRA
adapter, multimodal input hashes), rooted in a namespace fingerprint that covers everything that changes the bytes
of a KV page (model and what decides its weights, dtype, page layout, tensor-parallel rank and world size, format
version). The key of a block in
KV-cache group ``g`` is derived from the block hash and ``g``. A replicated namespace (every rank holds the same
bytes: latent attention, ``KVCacheLayout.replicated``) leaves rank and world size out, so every rank of every
tensor-parallel size shares one copy in the shared tiers.

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
    replicated: bool = False
    """Every rank holds the same bytes (``KVCacheLayout.replicated``): the fingerprint then covers neither rank nor
    world size, and shared tiers keep one copy, written by rank 0 and loaded by every rank (``copy_ranks``)."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("Namespace.model must be a non-empty model identifier")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Namespace.rank {self.rank} is outside world_size {self.world_size}")

    def fingerprint(self) -> bytes:
        """A 16-byte digest of the namespace; the root of every hash chain in it."""
        # "*" is never a number, so a replicated fingerprint differs from every per-rank one; per-rank fields stay
        # as they were before replication existed, so existing keys and files keep their names.
        rank, world = ("*", "*") if self.replicated else (str(self.rank), str(self.world_size))
        fields = (self.model, self.dtype, self.layout, rank, world, str(self.format_version), self.weights)
        return _digest(b"kvoffload-namespace", *(f.encode() for f in fields))

    @property
    def copy_ranks(self) -> range:
        """The ranks whose bytes a shared tier keeps: rank 0 alone when replicated, else every rank."""
        return range(1 if self.replicated else self.world_size)

    @property
    def writes_copy(self) -> bool:
        """Whether this rank writes its blocks to the shared tiers (False: another rank writes the same bytes)."""
        return self.rank in self.copy_ranks

    def chain_root(self) -> bytes:
        """Root of every key chain: the same on every rank, since one scheduler keys the blocks of all ranks.

        Per-rank bytes (a rank's files on a shared disk) are told apart by ``fingerprint()``, which covers the rank
        unless the namespace is replicated.
        """
        return replace(self, rank=0).fingerprint()


def _digest(*parts: bytes) -> bytes:
    # Length-prefix each part so that no two different part lists hash the same bytes.
    return hashlib.blake2b(b"".join(_framed(p) for p in parts), digest_size=KEY_BYTES).digest()


def _framed(part: bytes) -> bytes:
    return struct.pack("<Q", len(part)) + part


def _encode_tokens(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def extra_key(kind: str, *fields: str) -> str:
    """An extra key of ``kind`` over ``fields``: ``kind:<len>:<field>:<len>:<field>...``.

    Each field carries its length, so no two field lists give the same key whatever characters the fields hold
    (``("a:b", "c")`` and ``("a", "b:c")`` differ). ``hash_block`` frames each extra key as a whole; this keeps
    the fields inside one key apart. A key with one free-text field (``salt:<salt>``), or whose only free text
    is followed by fields that are integers (``mm:<id>@<offset>+<length>``: the integers are read from the
    right and hold neither ``@`` nor ``+``), is already unambiguous and needs no lengths.

    Raises:
        ValueError: ``kind`` is empty or holds ``:``.
    """
    if not kind or ":" in kind:
        raise ValueError(f"extra key kind {kind!r} must be non-empty and without ':'")
    return "".join([kind, *(f":{len(field)}:{field}" for field in fields)])


def frame_extra_keys(extra_keys: Sequence[str]) -> bytes:
    """The extra keys as ``hash_block`` frames them (for ``chain_hashes``; the same for every block)."""
    return b"".join(_framed(k.encode()) for k in extra_keys)


def hash_block(parent: bytes, tokens: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    """Hash one block's tokens chained to its parent (the namespace fingerprint for the first block)."""
    return BlockHash(_digest(parent, _encode_tokens(tokens), *(k.encode() for k in extra_keys)))


def chain_hashes(parent: bytes, tokens: Sequence[int], block_tokens: int, framed_extra: bytes = b"") -> list[BlockHash]:
    """``hash_block`` of each full ``block_tokens`` block of ``tokens`` in turn, chained from ``parent``.

    The same hashes, in one pass: the tokens are packed once and each block is one BLAKE2b call over its frames
    (``framed_extra``: ``frame_extra_keys`` of the request's extra keys).
    """
    data = _encode_tokens(tokens)
    size = 8 * block_tokens
    framed_size = struct.pack("<Q", size)
    blake2b, pack = hashlib.blake2b, struct.pack
    hashes: list[BlockHash] = []
    for start in range(0, len(data) - size + 1, size):
        parent = blake2b(b"".join((pack("<Q", len(parent)), parent, framed_size, data[start:start + size],
                                   framed_extra)), digest_size=KEY_BYTES).digest()
        hashes.append(BlockHash(parent))
    return hashes


def hash_blocks(
    root: bytes, tokens: Sequence[int], block_tokens: int, extra_keys: Sequence[str] = ()
) -> list[BlockHash]:
    """Hashes of every full ``block_tokens``-sized block of ``tokens``, chained from ``root``."""
    return chain_hashes(root, tokens, block_tokens, frame_extra_keys(extra_keys))


_GROUP_FRAMES: dict[int, bytes] = {}


def offload_key(block_hash: BlockHash, group: int) -> OffloadKey:
    """The key of ``block_hash``'s page in KV-cache group ``group``."""
    frame = _GROUP_FRAMES.get(group)
    if frame is None:
        frame = _GROUP_FRAMES[group] = _framed(struct.pack("<I", group))
    return OffloadKey(hashlib.blake2b(_framed(block_hash) + frame, digest_size=KEY_BYTES).digest())


def offload_keys(block_hashes: Iterable[BlockHash], group: int) -> list[OffloadKey]:
    return [offload_key(h, group) for h in block_hashes]
