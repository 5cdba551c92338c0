"""Which engines attached to a node pool still run, as the kernel knows it.

Each attachment of the shared index (``_nodeindex.MAX_ATTACH`` of them) owns one byte of the namespace's ``engines``
file (the byte after them is the index's own lock, taken by ``_nodeindex`` to write). The engine holding an
attachment keeps a write lock on its byte for as long as it is attached: an open file description lock
(``F_OFD_SETLK``), which the kernel drops when the engine's process ends, however it ends. An attachment whose byte
nobody locks belongs to a dead engine. Unlike reading another process's identity from /proc, this holds across users
(Linux refuses ``/proc/<pid>/ns/pid`` of another user's process without ptrace access, which made live engines of a
shared group look dead) and across pid namespaces (containers sharing the tmpfs), and a reused pid is no question.

Attaching and locking are two steps; an engine does both under an exclusive ``flock`` of the same file, and the
engines looking for dead ones look under a shared one, so none ever sees an attachment between the two steps.
(``flock`` and OFD locks are separate kinds of lock on Linux: they never block each other.) A forked child that
keeps the descriptor keeps the lock, so an engine counts as alive while such a child runs: never the reverse.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
from collections.abc import Iterator
from pathlib import Path

from kvoffload import _nodeindex
from kvoffload.config import ConfigError
from kvoffload.tiers.lower.trust import Access
from kvoffload.tiers.node.segment import open_checked

ENGINES_NAME = "engines"

_FLOCK = struct.Struct("hhxxxxqqixxxx")
"""Linux's ``struct flock`` on 64-bit platforms: l_type, l_whence, l_start, l_len, l_pid."""


class EngineLocks:
    """This engine's handle on the ``engines`` file of a node pool's namespace directory.

    Raises:
        ConfigError: the file cannot be opened, is not a regular file, or others may write it.
    """

    def __init__(self, directory: Path, access: Access) -> None:
        self._fd = open_checked(directory / ENGINES_NAME, access, "node_path")
        self.inode: int = os.fstat(self._fd).st_ino
        """Which ``engines`` file this is: the index records the one that goes with it."""

    @property
    def fd(self) -> int:
        """The file's descriptor: the shared index locks a byte of it to write (``_nodeindex``'s ``lock_fd``)."""
        return self._fd

    @contextlib.contextmanager
    def attaching(self) -> Iterator[None]:
        """Hold off every engine's look for dead ones while this engine attaches and locks its byte."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def looking(self) -> Iterator[bool]:
        """Yields whether this engine may judge attachments now: False while another engine is attaching (one
        frozen there must not stall this one's step; it looks again later)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def hold(self, attachment: int) -> None:
        """Lock ``attachment``'s byte for as long as this process runs (or until ``close``).

        Raises:
            ConfigError: another live engine holds it (the shared index says it is free: the index was damaged).
        """
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, attachment, 1, 0))
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise ConfigError(f"host_scope node: attachment {attachment} of the node pool is free in its index but "
                              "locked by a live engine; the index was damaged: stop the engines and remove the "
                              "pool's directory") from e

    def held(self, attachment: int) -> bool:
        """Whether a live engine (another open file description than this one's) locks ``attachment``'s byte."""
        return _held(self._fd, attachment)

    def close(self) -> None:
        """Closing the file drops every lock this handle holds."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _alive(fd: int) -> set[int]:
    # One query a byte: F_OFD_GETLK answers with one conflicting lock, not the lowest, so ranges would skip some.
    return {attachment for attachment in range(_nodeindex.MAX_ATTACH) if _held(fd, attachment)}


def _held(fd: int, attachment: int) -> bool:
    query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, attachment, 1, 0)
    return _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, query))[0] != fcntl.F_UNLCK


def alive_attachments(path: Path) -> set[int]:
    """The attachments whose byte a live engine locks in the ``engines`` file at ``path`` (read by a process
    attached to none: an operator's tool, or an engine deciding whether a pool is in use)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return set()
    try:
        return _alive(fd)
    finally:
        os.close(fd)
