"""A ``BlockDescription`` as bytes and back (``encode``/``decode``), for the node pool's announcement logs
(``announce``): struct fields, hashes tagged int (u64) or bytes, token ids u32 (i64 when one does not fit), extra
keys as JSON of str, int and tuples. ``decode`` reads bytes another process wrote: it checks every type, range
and length, and gives back exactly what ``encode`` was given (tuples stay tuples) or raises ``DescriptionError``.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from kvoffload.index.base import BlockDescription, EngineHash

MAX_DESCRIPTION_BYTES = 32 << 10
"""A description longer than this (an offload block of over 8,000 tokens) is not shared (``unshareable``)."""


class DescriptionError(ValueError):
    """A description that cannot be encoded, or bytes that are not one."""


_DESC = struct.Struct("<BHIII")  # flags, hashes, tokens, block size, group
_PARENT, _WIDE_TOKENS, _LORA_ID, _LORA_NAME, _EXTRA = 1, 2, 4, 8, 16
_INT_HASH, _BYTES_HASH = 0, 1
_U64, _I64, _U16, _U32 = struct.Struct("<Q"), struct.Struct("<q"), struct.Struct("<H"), struct.Struct("<I")
_EXTRA_DEPTH = 3


def encode(desc: BlockDescription) -> bytes:
    """``desc`` as bytes ``decode`` gives back exactly.

    Raises:
        DescriptionError: a field of a type or size the encoding does not hold (a hash that is not a u64 int or
            bytes of at most 255, a negative token, extra keys that are not str/int/tuple), or lengths that do
            not agree.
    """
    try:
        return _encode(desc)
    except DescriptionError:
        raise
    except (TypeError, ValueError, OverflowError, struct.error, RecursionError) as e:
        raise DescriptionError(f"cannot encode the description: {e}") from e


def _encode(desc: BlockDescription) -> bytes:
    hashes, tokens = tuple(desc.block_hashes), desc.token_ids
    if not isinstance(tokens, tuple | list):
        raise DescriptionError("token_ids is not a tuple")
    _check_shape(len(hashes), len(tokens), desc.block_size, desc.group)
    flags, tail = 0, [_hash(h) for h in hashes]
    if desc.parent_hash is not None:
        flags |= _PARENT
        tail.append(_hash(desc.parent_hash))
    if tokens and min(tokens) < 0:
        raise DescriptionError("a token id is negative")
    try:
        tail.append(struct.pack(f"<{len(tokens)}I", *tokens))
    except struct.error:
        flags |= _WIDE_TOKENS
        tail.append(struct.pack(f"<{len(tokens)}q", *tokens))
    if desc.lora_id is not None:
        flags |= _LORA_ID
        tail.append(_I64.pack(_exact_int(desc.lora_id)))
    if desc.lora_name is not None:
        flags |= _LORA_NAME
        name = desc.lora_name.encode() if type(desc.lora_name) is str else None
        if name is None:
            raise DescriptionError("lora_name is not a str")
        tail += [_U16.pack(len(name)), name]
    if desc.extra_keys is not None:
        flags |= _EXTRA
        extra = desc.extra_keys
        if type(extra) is not tuple or len(extra) != len(hashes) or not all(
                e is None or (type(e) is tuple and _extra_ok(e, tuple, 0)) for e in extra):
            raise DescriptionError("extra_keys is not one tuple (of str/int/tuple) or None per hash")
        text = json.dumps(extra, ensure_ascii=False, separators=(",", ":")).encode()
        tail += [_U32.pack(len(text)), text]
    out = b"".join([_DESC.pack(flags, len(hashes), len(tokens), desc.block_size, desc.group), *tail])
    if len(out) > MAX_DESCRIPTION_BYTES:
        raise DescriptionError(f"the description is {len(out)} bytes, over {MAX_DESCRIPTION_BYTES}")
    return out


def _hash(value: EngineHash) -> bytes:
    if type(value) is bytes and len(value) <= 255:
        return bytes((_BYTES_HASH, len(value))) + value
    if type(value) is int:
        return bytes((_INT_HASH,)) + _U64.pack(value)  # struct refuses what is not a u64
    raise DescriptionError(f"a block hash is a {type(value).__name__} (not a u64 int or bytes of at most 255)")


def _exact_int(value: object) -> int:
    if type(value) is not int:
        raise DescriptionError(f"{value!r} is not an int")
    return value


def _check_shape(hashes: int, tokens: int, block_size: object, group: object) -> None:
    if type(block_size) is not int or type(group) is not int or not (0 < block_size < 1 << 32) \
            or not (0 <= group < 1 << 32):
        raise DescriptionError(f"block size {block_size!r} or group {group!r} out of range")
    if not 0 < hashes < 1 << 16 or tokens not in (0, hashes * block_size):
        raise DescriptionError(f"{tokens} tokens do not fill {hashes} hashes of {block_size} (nor are they none)")


def _extra_ok(value: object, sequence: type, depth: int) -> bool:
    """Whether ``value`` is an extra key the encoding holds exactly: str, int (not bool) of 64 bits, or a
    ``sequence`` (tuple when encoding; list in JSON when decoding) of them, nested at most ``_EXTRA_DEPTH``."""
    if type(value) is str:
        return True
    if type(value) is int:
        return -(1 << 63) <= value < 1 << 63
    return type(value) is sequence and depth < _EXTRA_DEPTH and all(
        _extra_ok(v, sequence, depth + 1) for v in value)  # type: ignore[attr-defined]


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if type(value) is list else value


class _Bytes:
    """A bounded reader of untrusted bytes: every take is checked against what is left."""

    def __init__(self, buf: bytes) -> None:
        self.buf, self.at = buf, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.buf):
            raise DescriptionError(f"truncated: {n} bytes wanted at {self.at} of {len(self.buf)}")
        self.at += n
        return self.buf[self.at - n:self.at]

    def unpack(self, fmt: struct.Struct) -> Any:
        return fmt.unpack(self.take(fmt.size))[0]

    def hash(self) -> EngineHash:
        tag = self.take(1)[0]
        if tag == _INT_HASH:
            return int(self.unpack(_U64))
        if tag == _BYTES_HASH:
            return self.take(self.take(1)[0])
        raise DescriptionError(f"unknown hash tag {tag}")


def decode(buf: bytes) -> BlockDescription:
    """The description ``encode`` made of ``buf``, checked as input: types, ranges and lengths hold.

    Raises:
        DescriptionError: ``buf`` is not an encoded description (truncated, trailing bytes, unknown flags,
            lengths that disagree, extra keys of other types).
    """
    try:
        return _decode(_Bytes(bytes(buf)))
    except DescriptionError:
        raise
    except (ValueError, struct.error, RecursionError, TypeError, IndexError) as e:
        raise DescriptionError(f"not a description: {e}") from e


def _decode(data: _Bytes) -> BlockDescription:
    flags, n_hashes, n_tokens, block_size, group = _DESC.unpack(data.take(_DESC.size))
    if flags & ~(_PARENT | _WIDE_TOKENS | _LORA_ID | _LORA_NAME | _EXTRA):
        raise DescriptionError(f"unknown flags {flags:#x}")
    _check_shape(n_hashes, n_tokens, block_size, group)
    hashes = tuple(data.hash() for _ in range(n_hashes))
    parent = data.hash() if flags & _PARENT else None
    wide = flags & _WIDE_TOKENS
    tokens: tuple[int, ...] = struct.unpack(f"<{n_tokens}{'q' if wide else 'I'}", data.take(n_tokens * (8 if wide
                                                                                                          else 4)))
    if wide and tokens and min(tokens) < 0:
        raise DescriptionError("a token id is negative")
    lora_id = int(data.unpack(_I64)) if flags & _LORA_ID else None
    lora_name = data.take(data.unpack(_U16)).decode() if flags & _LORA_NAME else None
    extra = None
    if flags & _EXTRA:
        loaded = json.loads(data.take(data.unpack(_U32)).decode())
        if type(loaded) is not list or len(loaded) != n_hashes or not all(
                e is None or (type(e) is list and _extra_ok(e, list, 0)) for e in loaded):
            raise DescriptionError("extra keys are not one list (of str/int/list) or null per hash")
        extra = tuple(_tuples(loaded))
    if data.at != len(data.buf):
        raise DescriptionError(f"{len(data.buf) - data.at} bytes after the description")
    return BlockDescription(hashes, parent, tokens, block_size, group, lora_id, lora_name, extra)
