"""Writing and reading one block file, through a small file-operations seam.

The ``DiskHandler`` calls ``write_block`` / ``read_for_slot`` from its I/O threads. Every system call goes
through a ``FileOps`` object so tests can inject the operating system's failures (EIO, ENOSPC, slow or stuck
reads) without mocking any kvoffload logic. Both functions raise ``OSError`` or ``CorruptBlockError``; the
handler turns them into failed results.

Only regular files are ever read, and no symbolic link is followed: a FIFO, a device or a directory at a block
path (planted, or left by an accident) is ``NotABlockFileError``, found without blocking on it.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
import threading
from collections.abc import Callable, Iterator

from kvoffload.keys import OffloadKey
from kvoffload.tiers.disk.paths import BLOCK_SUFFIX, TMP_SUFFIX
from kvoffload.tiers.lower.block_codec import check_length, open_into, seal_into
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

_tmp_counter = itertools.count()
# O_NONBLOCK: opening a FIFO for reading would wait for a writer forever; on a regular file it changes nothing.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class NotABlockFileError(CorruptBlockError):
    """A block path names a symbolic link, directory, FIFO or device: never read, removed like a corrupt file."""


class FileOps:
    """The system calls of the disk tier. Subclass to inject failures; the default calls the OS.

    Thread-safety: called from several I/O threads at once; implementations must be thread-safe.
    """

    file_mode = FILE_MODE
    """Mode of new files, exactly (the ``DiskHandler`` sets 0660 for a tier shared with a group)."""

    def write_new(self, path: str, buffers: list[memoryview | bytes]) -> None:
        """Create ``path`` (which must not exist, not even as a link) with ``file_mode``; write ``buffers``."""
        fd = os.open(path, _WRITE_FLAGS, self.file_mode)
        try:
            if self.file_mode != FILE_MODE:
                os.fchmod(fd, self.file_mode)  # the umask cut the group's bits
            total = sum(len(b) for b in buffers)
            written = os.writev(fd, buffers)
            if written != total:  # Rare short write: finish it with plain writes.
                _write_rest(fd, buffers, written)
        finally:
            os.close(fd)

    def read_into(self, path: str, buffers: list[memoryview]) -> int:
        """Fill ``buffers`` from the start of ``path``; return the bytes read (fewer at end of file).

        Raises:
            NotABlockFileError: ``path`` is not a regular file.
        """
        fd = open_regular(path)
        try:
            total = os.readv(fd, buffers)
            want = sum(len(b) for b in buffers)
            while total < want:
                more = os.preadv(fd, _tail(buffers, total), total)
                if more == 0:
                    break
                total += more
            return total
        finally:
            os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def open_regular(path: str) -> int:
    """A read-only descriptor of ``path`` if it is a regular file; never blocks on it, never follows a link.

    Raises:
        NotABlockFileError: ``path`` is a symbolic link, or not a regular file.
        OSError: it cannot be opened.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotABlockFileError(f"{path}: a symbolic link, not a block file") from None
        raise
    try:
        mode = os.fstat(fd).st_mode  # of what was opened: nothing can be swapped in between
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotABlockFileError(f"{path}: not a regular file (mode {mode:o})")
    return fd


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


def _write_rest(fd: int, buffers: list[memoryview | bytes], written: int) -> None:
    for part in _tail([memoryview(b) for b in buffers], written):
        view = part
        while len(view):
            view = view[os.write(fd, view):]


def write_block(ops: FileOps, path: str, fingerprint: bytes, key: OffloadKey, payload: memoryview,
                fmt: BlockFormat = PLAIN) -> None:
    """Write one block (``tiers.lower.block_codec``'s bytes) to a temporary name, then rename into place (atomic on
    POSIX).

    A plain block goes out as header and payload straight from the slot; a sealed one is encrypted into this
    thread's scratch buffer first.

    Raises:
        OSError: the write or rename failed; the temporary file is removed.
    """
    tmp = f"{path[:-len(BLOCK_SUFFIX)]}.{os.getpid()}-{next(_tmp_counter)}{TMP_SUFFIX}"
    parts: list[memoryview | bytes]
    if fmt.auth is None:
        parts = [encode_header(fingerprint, key, len(payload), checksum(payload)), payload]
    else:
        out = _scratch(fmt.file_bytes(len(payload)))
        parts = [out[:seal_into(fmt, fingerprint, key, payload, out)]]
    try:
        ops.write_new(tmp, parts)
        ops.rename(tmp, path)  # replaces a link at ``path``; never writes through it
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            ops.unlink(tmp)
        raise


def read_block(ops: FileOps, path: str, fingerprint: bytes, key: OffloadKey, out: memoryview,
               fmt: BlockFormat = PLAIN) -> None:
    """Read one block's payload into ``out`` (exactly its length) and verify it (``tiers.lower.block_codec``).

    A plain block is read straight into ``out`` and checked there; a sealed one is read into this thread's
    scratch buffer and decrypted into ``out``. ``out`` may hold garbage afterwards when this raises.

    Raises:
        FileNotFoundError: no such block.
        OSError: the read failed.
        CorruptBlockError: the file is truncated, too long, damaged, or belongs to another namespace or key;
            ``NotABlockFileError`` when it is not a regular file; ``UnauthenticBlockError`` when it is not sealed
            by this secret for this name.
    """
    if fmt.auth is not None:
        read_for_slot(ops, path, fingerprint, key, len(out), fmt)(out)
        return
    header = memoryview(bytearray(HEADER_BYTES))
    extra = memoryview(bytearray(1))
    got = ops.read_into(path, [header, out, extra])
    with _naming(path):
        # The header first: it says what the file claims to be; a short file fails its header checksum.
        expected = decode_header(header, fingerprint, key, len(out))
        check_length(fmt, key, got, len(out))
        if checksum(out) != expected:
            raise CorruptBlockError("payload checksum mismatch")


def read_for_slot(ops: FileOps, path: str, fingerprint: bytes, key: OffloadKey, payload_bytes: int,
                  fmt: BlockFormat = PLAIN) -> Callable[[memoryview], None]:
    """Read one block into this thread's buffers and return what puts its payload into a slot, so the I/O runs
    before the caller takes hold of the slot and only the copy runs while it does.

    A plain block is verified here and ``put`` copies it. A sealed one is only read here: ``put`` decrypts it
    into the slot (the decryption is the copy) and raises ``UnauthenticBlockError`` when its tag fails, leaving
    garbage in the slot, which a failed load drops. The buffers stay valid until this thread's next read.

    Raises:
        The errors of ``read_block``.
    """
    if fmt.auth is None:
        buffer = _scratch(payload_bytes)
        read_block(ops, path, fingerprint, key, buffer, fmt)
        return lambda out: _put(out, buffer)
    scratch = _scratch(fmt.file_bytes(payload_bytes) + 1)  # a byte past the block proves the file is too long
    block = scratch[:ops.read_into(path, [scratch])]

    def put(out: memoryview) -> None:
        with _naming(path):
            open_into(fmt, fingerprint, key, block, out)

    return put


def _put(out: memoryview, payload: memoryview) -> None:
    (out if out.format == "B" else out.cast("B"))[:] = payload


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    """Prefix a ``CorruptBlockError``'s message with the file's path (keeping its class)."""
    try:
        yield
    except CorruptBlockError as e:
        raise type(e)(f"{path}: {e}") from None


_scratch_of_thread = threading.local()


def _scratch(nbytes: int) -> memoryview:
    """This thread's reusable buffer of at least ``nbytes`` (kept, so its memory stays mapped across blocks)."""
    buffer: bytearray | None = getattr(_scratch_of_thread, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _scratch_of_thread.buffer = bytearray(nbytes)
    return memoryview(buffer)[:nbytes]
