"""The disk tier's directory tree: created private, trusted only when no one else can write it, scanned at start.

Both halves call ``open_tree`` at start-up (the scheduler's ``DiskIndex`` for rank 0's directory, each
worker's ``DiskHandler`` for its own). It creates what is missing with its modes set explicitly (the umask would
cut them), refuses with a ``ConfigError`` naming it any directory of the tree another user could write, and any
directory above it whose writers could swap the tree (only a warning when a tier secret authenticates blocks), and
lists the fan-out directories that are not real directories (symbolic links): those are skipped, never followed.
``scan`` then lists the blocks from their names. Only what nobody else could have planted is trusted: a regular
file (never followed) with its exact canonical name in its own fan-out directory; only our own temporary names
are removed. docs/security.md says what this protects against. No torch, no block I/O.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvoffload.config import ConfigError
from kvoffload.keys import KEY_BYTES, OffloadKey
from kvoffload.tiers.disk.paths import BLOCK_SUFFIX, STALE_TMP_S, TMP_SUFFIX
from kvoffload.tiers.lower.block_format import PLAIN, BlockFormat
from kvoffload.tiers.lower.trust import (
    Access,
    ancestor_problems,
    untrusted,
)

logger = logging.getLogger(__name__)

FAN_OUTS = tuple(f"{i:02x}" for i in range(256))
_KEY_HEX = KEY_BYTES * 2
_OUR_TMP = re.compile(rf"([0-9a-f]{{{_KEY_HEX}}})\.(\d+)-\d+{re.escape(TMP_SUFFIX)}")
"""``<key hex>.<pid>-<n>.tmp``, the only temporary name ``tiers.disk.file_io.write_block`` makes."""


@dataclass(frozen=True)
class Tree:
    """A rank directory checked at start-up; ``skipped`` names its fan-out entries that must not be used; ``fmt``
    how its files are named (and sealed)."""

    rank_dir: Path
    skipped: frozenset[str] = frozenset()
    fmt: BlockFormat = PLAIN

    def usable(self, key: OffloadKey) -> bool:
        """Whether ``key``'s fan-out directory is a real one (blocks behind a symbolic link are never used)."""
        return not self.skipped or self.fmt.name(key)[:2] not in self.skipped


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
        skipped = _fan_outs(rank_dir, access, disk_path)
    except OSError as e:
        raise ConfigError(f"disk_path={str(disk_path)!r} cannot hold the disk tier: {e}") from e
    return Tree(rank_dir, frozenset(skipped), fmt)


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


def _fan_outs(rank_dir: Path, access: Access, disk_path: Path) -> list[str]:
    """Create the 256 fan-out directories; return those that are not real directories (logged once)."""
    skipped = []
    for name in FAN_OUTS:
        path = rank_dir / name
        _make(path, access)
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode):  # a symbolic link's mode says link, whatever it points at
            skipped.append(name)
            continue
        problem = untrusted(info, access)
        if problem:
            raise ConfigError(f"disk_path={str(disk_path)!r}: {path} is {problem}")
    if skipped:
        logger.warning("disk tier: skipping %d fan-out entries of %s that are symbolic links or not directories "
                       "(never followed, never written): %s", len(skipped), rank_dir, ", ".join(skipped))
    return skipped


@dataclass(frozen=True)
class ScanResult:
    """What a start-up scan found: final block keys (in directory order) and temporary files it removed."""

    keys: tuple[OffloadKey, ...]
    removed_tmp: int
    seconds: float


def scan(tree: Tree) -> ScanResult:
    """List the blocks of ``tree`` from their names, and remove the temporary files of dead writers.

    A block counts only as a regular file (not followed) named ``<name hex>.kvb`` in fan-out ``<name hex>[:2]``,
    hex in lower case; anything else is left alone. Payloads are checked on load.
    """
    start = time.perf_counter()
    keys: list[OffloadKey] = []
    removed = 0
    for fan_out, entry in _entries(tree):
        name = entry.name
        if name.endswith(BLOCK_SUFFIX):
            key = _block_key(name, fan_out, tree.fmt)
            if key is not None and entry.is_file(follow_symlinks=False):
                keys.append(key)
        elif name.endswith(TMP_SUFFIX) and _is_our_stale_tmp(entry, fan_out):
            removed += _remove(entry.path)
    if removed:
        logger.info("disk tier: removed %d temporary files left by a crash in %s", removed, tree.rank_dir)
    return ScanResult(tuple(keys), removed, time.perf_counter() - start)


def _entries(tree: Tree) -> Iterator[tuple[str, os.DirEntry[str]]]:
    for fan_out in FAN_OUTS:
        if fan_out in tree.skipped:
            continue
        try:
            with os.scandir(tree.rank_dir / fan_out) as it:
                for entry in it:
                    yield fan_out, entry
        except FileNotFoundError:
            continue


def _block_key(name: str, fan_out: str, fmt: BlockFormat) -> OffloadKey | None:
    """The key a block file's name gives, when it is exactly the name ``block_path`` would give it here."""
    digits = name[:-len(BLOCK_SUFFIX)]
    if len(digits) != _KEY_HEX or not digits.startswith(fan_out):
        return None
    try:
        raw = bytes.fromhex(digits)
    except ValueError:
        return None
    return fmt.key_of(raw) if raw.hex() == digits else None  # fromhex also takes upper case and spaces


def _is_our_stale_tmp(entry: os.DirEntry[str], fan_out: str) -> bool:
    """One of our temporary files whose writer (pid in its name, on this machine) is dead, or that is old.

    Another live engine sharing the directory may be writing the others: leave those alone.
    """
    match = _OUR_TMP.fullmatch(entry.name)
    if match is None or not match.group(1).startswith(fan_out) or not entry.is_file(follow_symlinks=False):
        return False
    pid = int(match.group(2))
    if pid != os.getpid() and not _pid_alive(pid):
        return True
    try:
        return time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S
    except FileNotFoundError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _remove(path: str) -> int:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return 0
    except OSError as e:  # a read-only file system: the file is only a leftover, not worth stopping for
        logger.debug("disk tier: cannot remove temporary file %s: %s", path, e)
        return 0
    return 1


LOCK_NAME = "engines.lock"


class WorldLock:
    """A lock on a world directory that every engine's scheduler holds, shared, for as long as it runs there.

    ``alone`` is True when this engine took it exclusively at start-up: no other engine ran on the directory
    then, so files beyond this engine's budget are leftovers that it may trim. Call ``share`` once the trim is
    done (engines starting meanwhile wait for it). Released when the process ends, or when this object is
    collected. On a file system without ``flock`` an engine is never alone: it never trims.
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
