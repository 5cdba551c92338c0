"""The disk tier's directory tree: created private, trusted only when no one else can write it.

Both halves call ``open_tree`` at start-up (the scheduler's ``DiskIndex`` for rank 0's directory, each
worker's ``DiskHandler`` for its own). It creates what is missing with its modes set explicitly (the umask would
cut them), refuses with a ``ConfigError`` naming it any directory of the tree another user could write, and any
directory above it whose writers could swap the tree (only a warning when a tier secret authenticates blocks).
Slot files in it are opened without following links (``tiers.disk.file_io``); a directory of the old per-block
format is named in a warning and never read. ``WorldLock`` tells an engine whether it starts alone.
docs/security.md says what this protects against. No torch, no block I/O.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from kvoffload.config import ConfigError
from kvoffload.tiers.lower.block_format import PLAIN, BlockFormat
from kvoffload.tiers.lower.trust import (
    Access,
    ancestor_problems,
    untrusted,
)

logger = logging.getLogger(__name__)

_FAN_OUT = re.compile("[0-9a-f]{2}")
"""A fan-out directory of the per-block format (versions 1 and 2)."""


@dataclass(frozen=True)
class Tree:
    """A rank directory checked at start-up; ``fmt`` how its blocks are named (and sealed)."""

    rank_dir: Path
    fmt: BlockFormat = PLAIN


def open_tree(disk_path: Path, rank_dir: Path, access: Access, fmt: BlockFormat = PLAIN) -> Tree:
    """Create ``rank_dir`` (under ``disk_path``) and its fan-out directories, and check who may write them.

    Raises:
        ConfigError: a directory from ``disk_path`` down is owned by another user, writable by others or by a
            group other than the shared one, a symbolic link below ``disk_path``, or cannot be created; or,
            without a tier secret, a directory above it is not safe (``ancestor_problems``).
    """
    chain = [disk_path]
    for part in rank_dir.relative_to(disk_path).parts:
        chain.append(chain[-1] / part)
    try:
        for directory in [*_missing_ancestors(disk_path), disk_path]:
            _make(directory, access)
        _check_ancestors(disk_path, access, fmt)
        for directory in chain:
            _make(directory, access)
            # disk_path itself may be a link an administrator made; nothing below it may be.
            _check(directory, access, follow=directory == disk_path, disk_path=disk_path)
    except OSError as e:
        raise ConfigError(f"disk_path={str(disk_path)!r} cannot hold the disk tier: {e}") from e
    _note_old_format(rank_dir)
    return Tree(rank_dir, fmt)


def _missing_ancestors(path: Path) -> list[Path]:
    """The directories above ``path`` that do not exist yet, top first."""
    missing = []
    for parent in path.absolute().parents:
        if os.path.lexists(parent):
            break
        missing.append(parent)
    return missing[::-1]


def _make(directory: Path, access: Access) -> None:
    """Create ``directory`` with exactly ``access.dir_mode``; leave an existing one as it is (it is checked)."""
    try:
        os.mkdir(directory, access.dir_mode)
    except FileExistsError:
        return
    if access.gid is not None:
        os.chown(directory, -1, access.gid)
    os.chmod(directory, access.dir_mode)  # mkdir's mode went through the umask


def _check(directory: Path, access: Access, follow: bool, disk_path: Path) -> None:
    info = os.stat(directory) if follow else os.lstat(directory)
    if stat.S_ISLNK(info.st_mode):
        problem = "a symbolic link (nothing below disk_path is followed)"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "not a directory"
    else:
        problem = untrusted(info, access) or ""
    if problem:
        raise ConfigError(f"disk_path={str(disk_path)!r}: {directory} is {problem}")


def _check_ancestors(disk_path: Path, access: Access, fmt: BlockFormat) -> None:
    """Refuse (or, with a tier secret, warn about) the directories above ``disk_path`` that are not safe."""
    problems = ancestor_problems(disk_path, access)
    if not problems:
        return
    found = "; ".join(problems)
    if fmt.auth is None:
        raise ConfigError(
            f"disk_path={str(disk_path)!r}: {found}: another user could replace the tier's tree after start-up "
            f"and plant blocks that load; fix that directory, or set tier_secret_file or tier_secret_env")
    logger.warning("disk tier: disk_path=%r: %s: another user could replace the tier's tree; blocks they plant "
                   "fail authentication (tier secret set)", str(disk_path), found)


def _note_old_format(rank_dir: Path) -> None:
    """Warn once about a directory of the per-block format (versions 1 and 2): it is never read, and its files are
    outside ``disk_bytes``."""
    try:
        with os.scandir(rank_dir) as entries:
            old = sum(1 for e in entries if _FAN_OUT.fullmatch(e.name) and e.is_dir(follow_symlinks=False))
    except OSError:
        return
    if old:
        logger.warning("disk tier: %s holds %d fan-out directories of the one-file-per-block format (versions 1-2), "
                       "which this version does not read; their files count against no budget: delete them to "
                       "free the space", rank_dir, old)


LOCK_NAME = "engines.lock"


class WorldLock:
    """A lock on a world directory that every engine's scheduler holds, shared, for as long as it runs there.

    ``alone`` is True when this engine took it exclusively at start-up: no other engine ran on the directory
    then, so files beyond this engine's budget are leftovers that it may trim. Call ``share`` once the trim is
    done (engines starting meanwhile wait for it). Released when the process ends, or when this object is
    collected. On a file system without ``flock`` an engine is never alone (and ``engine_files.EngineNumber``
    refuses to start the tier: two engines could take one number and write one file).
    """

    def __init__(self, world_dir: Path, access: Access) -> None:
        fd = os.open(world_dir / LOCK_NAME, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     access.file_mode)
        self._file = os.fdopen(fd, "rb")
        with contextlib.suppress(OSError):  # not ours to change when another engine of the group made it
            os.fchmod(fd, access.file_mode)
        self.alone = self._lock(fcntl.LOCK_EX | fcntl.LOCK_NB)

    def share(self) -> None:
        self._lock(fcntl.LOCK_SH)

    def close(self) -> None:
        self._file.close()

    def _lock(self, operation: int) -> bool:
        try:
            fcntl.flock(self._file.fileno(), operation)
        except BlockingIOError:
            return False
        except OSError as e:
            logger.info("disk tier: no lock on %s (%s): this engine never trims the directory", self._file.name, e)
            return False
        return True
