"""Writing and reading one block at its slot of a slot file (``tiers.disk.slot_file``), through a system-call seam.

The ``DiskHandler`` calls ``write_block`` / ``read_for_slot`` from its I/O threads. Every system call goes
through a ``FileOps`` object so tests can inject the operating system's failures (EIO, ENOSPC, slow or stuck
reads) without mocking any kvoffload logic. Both functions raise ``OSError`` or ``CorruptBlockError``; the
handler turns them into failed results.

Only regular files are ever opened, and no symbolic link is followed: anything else at a slot file's path (planted,
or left by an accident) is ``NotABlockFileError``, found without blocking on it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvoffload.keys import OffloadKey
from kvoffload.tiers.disk.slot_file import (
    EMPTY_ENTRY,
    ENTRY_BYTES,
    PAGE,
    Layout,
    NotABlockFileError,
    decode_file_header,
    encode_entry,
    open_regular,
)
from kvoffload.tiers.lower.block_codec import open_into, seal_into
from kvoffload.tiers.lower.block_format import (
    HEADER_BYTES,
    PLAIN,
    BlockFormat,
    CorruptBlockError,
    checksum,
    decode_header,
    encode_header,
)
from kvoffload.tiers.lower.trust import FILE_MODE

__all__ = ["FileOps", "NotABlockFileError", "SlotFile", "SlotReusedError", "clear_entry", "open_slot_file", "read_run",
           "write_run"]

class SlotReusedError(CorruptBlockError):
    """The slot holds a whole block of another key: its engine gave the slot to another block since its entry was
    read (a miss, not damage)."""


class FileOps:
    """The system calls of the disk tier. Subclass to inject failures; the default calls the OS.

    Thread-safety: called from several I/O threads at once; implementations must be thread-safe.
    """

    file_mode = FILE_MODE
    """Mode of new files, exactly (the ``DiskHandler`` sets 0660 for a tier shared with a group)."""

    def open(self, path: str, create: bool = False) -> int:
        """A read-write descriptor of the regular file ``path`` (read-only where writing is refused), created
        with ``file_mode`` when ``create``; never blocks on it, never follows a link.

        Raises:
            NotABlockFileError: ``path`` is a symbolic link, or not a regular file.
            OSError: it cannot be opened.
        """
        return open_regular(path, create, self.file_mode)

    def pwrite(self, fd: int, buffers: list[memoryview | bytes], offset: int) -> None:
        """Write all of ``buffers`` at ``offset``."""
        total = sum(len(b) for b in buffers)
        written = os.pwritev(fd, buffers, offset)
        while written < total:  # Rare short write: finish it.
            written += os.pwritev(fd, _tail([memoryview(b) for b in buffers], written), offset + written)

    def pread_into(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        """Fill ``buffers`` from ``offset``; return the bytes read (fewer at end of file)."""
        total = os.preadv(fd, buffers, offset)
        want = sum(len(b) for b in buffers)
        while 0 < total < want:
            more = os.preadv(fd, _tail(buffers, total), offset + total)
            if more == 0:
                break
            total += more
        return total

    def close(self, fd: int) -> None:
        os.close(fd)


@dataclass(frozen=True)
class SlotFile:
    """An open slot file: its descriptor and the layout its header states."""

    path: str
    fd: int
    layout: Layout


def open_slot_file(ops: FileOps, path: str) -> SlotFile:
    """Open a slot file another half (the scheduler) prepared, and read its layout.

    Raises:
        NotABlockFileError, SlotFileError: not a slot file; OSError: cannot be opened or read.
    """
    fd = ops.open(path)
    try:
        header = memoryview(bytearray(PAGE))
        got = ops.pread_into(fd, [header], 0)
        with _naming(path):
            layout = decode_file_header(header[:got])
    except BaseException:
        ops.close(fd)
        raise
    return SlotFile(path, fd, layout)


def _tail(buffers: list[memoryview], skip: int) -> list[memoryview]:
    """The parts of ``buffers`` after the first ``skip`` bytes."""
    out: list[memoryview] = []
    for b in buffers:
        if skip >= len(b):
            skip -= len(b)
            continue
        out.append(b[skip:])
        skip = 0
    return out


def write_run(ops: FileOps, file: SlotFile, first: int, keys: Sequence[OffloadKey], payloads: Sequence[memoryview],
              fingerprint: bytes, fmt: BlockFormat = PLAIN) -> None:
    """Write blocks at the consecutive slots from ``first`` (``tiers.lower.block_codec``'s bytes; one positioned
    write), then the table entries naming them (one more).

    The entries go last: a crash between the two leaves entries naming what was there before (whose reads then
    fail their header check) or none, never one naming a block that is not whole.

    Raises:
        OSError: a write failed.
    """
    nbytes = fmt.file_bytes(len(payloads[0]))
    _check_run(file, first, len(keys), nbytes)
    parts: list[memoryview | bytes] = []
    if fmt.auth is None:
        for key, payload in zip(keys, payloads, strict=True):
            parts += (encode_header(fingerprint, key, len(payload), checksum(payload)), payload)
    else:
        out = _scratch(nbytes * len(keys))
        for i, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
            seal_into(fmt, fingerprint, key, payload, out[i * nbytes:(i + 1) * nbytes])
        parts.append(out)
    ops.pwrite(file.fd, parts, file.layout.slot_offset(first))
    entries = b"".join(encode_entry(bytes.fromhex(fmt.name(key)), first + i) for i, key in enumerate(keys))
    ops.pwrite(file.fd, [entries], file.layout.entry_offset(first))


def clear_entry(ops: FileOps, file: SlotFile, slot: int, key: OffloadKey, fmt: BlockFormat = PLAIN) -> None:
    """Empty ``slot``'s table entry if it still names ``key`` (a failed store's, or a damaged block's), so that no
    engine indexes it again; an entry since written for another key is left alone.

    Raises:
        OSError: the entry could not be read or written.
    """
    if not 0 <= slot < file.layout.capacity:
        return
    at = file.layout.entry_offset(slot)
    raw = memoryview(bytearray(ENTRY_BYTES))
    if ops.pread_into(file.fd, [raw], at) == ENTRY_BYTES and raw == encode_entry(bytes.fromhex(fmt.name(key)), slot):
        ops.pwrite(file.fd, [EMPTY_ENTRY], at)


Put = Callable[[memoryview], None]
"""Puts a block read by ``read_run`` into a host slot (raises ``CorruptBlockError`` for a sealed block that does
not open)."""


def read_run(ops: FileOps, file: SlotFile, first: int, keys: Sequence[OffloadKey], payload_bytes: int,
             fingerprint: bytes, fmt: BlockFormat = PLAIN) -> list[Put | CorruptBlockError]:
    """Read the blocks at the consecutive slots from ``first`` into this thread's buffers (one positioned read)
    and return, per block, what puts its payload into a host slot, so the I/O runs before the caller takes hold of
    the host slots and only the copies run while it does.

    A plain block is verified here (header: fingerprint, key, length; then the payload's CRC32C) and its ``put``
    copies it. A sealed one is only read here: its ``put`` decrypts it into the slot (the decryption is the copy)
    and raises ``UnauthenticBlockError`` when its tag fails, leaving garbage in the slot, which a failed load
    drops. The buffers stay valid until this thread's next read.

    A block that is not there comes back as its ``CorruptBlockError`` in its place: ``SlotReusedError`` for a
    whole block of another key, else a torn or damaged block or a file cut short.

    Raises:
        OSError: the read failed.
    """
    nbytes = fmt.file_bytes(payload_bytes)
    _check_run(file, first, len(keys), nbytes)
    scratch = _scratch(nbytes * len(keys))
    got = ops.pread_into(file.fd, [scratch], file.layout.slot_offset(first))
    puts: list[Put | CorruptBlockError] = []
    for i, key in enumerate(keys):
        block = scratch[i * nbytes:min(got, (i + 1) * nbytes)] if got > i * nbytes else scratch[:0]
        try:
            with _naming(file.path, first + i):
                puts.append(_plain(block, key, payload_bytes, fingerprint) if fmt.auth is None
                            else _sealed(block, key, fingerprint, fmt, file.path, first + i))
        except CorruptBlockError as e:
            puts.append(e)
    return puts


def _plain(block: memoryview, key: OffloadKey, payload_bytes: int, fingerprint: bytes) -> Put:
    header, payload = block[:HEADER_BYTES], block[HEADER_BYTES:]
    if len(header) == HEADER_BYTES and _other_key(header, key):
        raise SlotReusedError("the slot holds another block now")
    expected = decode_header(header, fingerprint, key, payload_bytes)  # a short read fails its checksum
    if len(payload) != payload_bytes:
        raise CorruptBlockError(f"cut short at {len(block)} bytes")
    if checksum(payload) != expected:
        raise CorruptBlockError("payload checksum mismatch")
    return lambda out: _put(out, payload)


def _sealed(block: memoryview, key: OffloadKey, fingerprint: bytes, fmt: BlockFormat, path: str, slot: int) -> Put:
    def put(out: memoryview) -> None:
        with _naming(path, slot):
            open_into(fmt, fingerprint, key, block, out)

    return put


def _other_key(header: memoryview, key: OffloadKey) -> bool:
    """A whole plain header (its checksum holds) naming another key."""
    return bytes(header[32:48]) != key and zlib.crc32(header[:60]) == int.from_bytes(header[60:64], "little")


def _check_run(file: SlotFile, first: int, n: int, nbytes: int) -> None:
    """Slots the file's layout does not have, or a stride not the blocks' size, mean a damaged or foreign file (or
    another engine's budget): never I/O outside its slots."""
    if not 0 <= first <= first + n <= file.layout.capacity or n < 1 or nbytes != file.layout.stride:
        raise CorruptBlockError(f"{file.path}: no {n} slots of {nbytes} bytes from {first} (layout {file.layout})")


def _put(out: memoryview, payload: memoryview) -> None:
    (out if out.format == "B" else out.cast("B"))[:] = payload


@contextlib.contextmanager
def _naming(path: str, slot: int | None = None) -> Iterator[None]:
    """Prefix a ``CorruptBlockError``'s message with the file's path and slot (keeping its class)."""
    try:
        yield
    except CorruptBlockError as e:
        where = path if slot is None else f"{path} slot {slot}"
        raise type(e)(f"{where}: {e}") from None


_scratch_of_thread = threading.local()


def _scratch(nbytes: int) -> memoryview:
    """This thread's reusable buffer of at least ``nbytes`` (kept, so its memory stays mapped across blocks)."""
    buffer: bytearray | None = getattr(_scratch_of_thread, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _scratch_of_thread.buffer = bytearray(nbytes)
    return memoryview(buffer)[:nbytes]
