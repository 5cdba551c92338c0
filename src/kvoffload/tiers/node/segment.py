"""The node tier's files: where they live, who may use them, and opening them safely from any engine's process.

Under ``node_path`` (a tmpfs, ``/dev/shm`` by default) each user (or shared group) has a directory, and in it
each namespace (model, layout, world size: the keys' chain root) has one::

    <node_path>/kvoffload-node-<uid | g<gid>>/<namespace fingerprint hex>/index      the shared index
                                                                         engines     which engines live
                                                                         pool.<rank> each rank's slots

How the files are made, checked and bound to each other is ``files``; this module says where they live and opens
each one safely. Directories and files follow the disk tier's trust rules (``tiers.disk.tree``): owned by this
user (or the shared group), writable by no one else, no symbolic links; anything else is refused with a
``ConfigError`` naming ``node_path``. No torch here: both halves open these files.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from kvoffload import _nodeindex
from kvoffload.config import ConfigError, NodeTierConfig
from kvoffload.keys import Namespace
from kvoffload.tiers.lower.trust import Access, ancestor_problems, untrusted

TMPFS = frozenset({"tmpfs"})
MISSING_EPOCH = 0
"""The epoch of a key that was no longer ready when pinned (every real one is positive): its load fails."""


@dataclass(frozen=True)
class NodeGeometry:
    """What every engine sharing one node pool must agree on."""

    num_slots: int
    slot_bytes: int
    fingerprint: bytes
    """The namespace's chain root (16 bytes): engines of another model or layout never share slots."""

    @property
    def table_size(self) -> int:
        """Hash table entries: a power of two at least twice the slots, so probes stay short."""
        return 1 << max(1, (2 * self.num_slots - 1).bit_length())

    @property
    def index_bytes(self) -> int:
        return int(_nodeindex.size(self.num_slots, self.table_size))

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.slot_bytes


def access_of(node: NodeTierConfig) -> Access:
    return Access(node.shared_group, tier="node")


def namespace_directory(node: NodeTierConfig, namespace: Namespace) -> Path:
    """The directory of ``namespace``'s pool under ``node_path`` (not created here)."""
    owner = f"g{node.shared_group}" if node.shared_group is not None else str(os.geteuid())
    return node.path / f"kvoffload-node-{owner}" / namespace.chain_root().hex()


def open_directory(node: NodeTierConfig, namespace: Namespace) -> Path:
    """Create (or check) the namespace's directory.

    Raises:
        ConfigError: ``node_path`` is missing, not on a tmpfs, or it or a directory on the way could be written
            by another user.
    """
    root = node.path
    if not root.is_dir():
        raise ConfigError(f"node_path={str(root)!r} is not a directory")
    fs = filesystem_type(root)
    if fs not in TMPFS:
        raise ConfigError(f"node_path={str(root)!r} is on a {fs or 'unknown'} file system, not a tmpfs: the node "
                          f"pool must live in memory (use /dev/shm or another tmpfs mount)")
    access = access_of(node)
    directory = namespace_directory(node, namespace)
    try:
        _make_directory(directory.parent, access)
        # node_path itself included (a sticky /dev/shm passes: the entry in it is this user's, checked just above)
        problems = ancestor_problems(directory.parent, access)
        if problems:
            raise ConfigError(f"node_path={str(root)!r}: {'; '.join(problems)}: another user could replace the "
                              f"node pool's files after start-up")
        _make_directory(directory, access)
    except OSError as e:
        raise ConfigError(f"node_path={str(root)!r} cannot hold the node pool: {e}") from e
    return directory


def _make_directory(directory: Path, access: Access) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, access.dir_mode)
        if access.gid is not None:
            os.chown(directory, -1, access.gid)
        os.chmod(directory, access.dir_mode)  # mkdir's mode went through the umask
    info = os.lstat(directory)
    problem = "a symbolic link" if stat.S_ISLNK(info.st_mode) else None
    problem = problem or ("not a directory" if not stat.S_ISDIR(info.st_mode) else untrusted(info, access))
    if problem:
        raise ConfigError(f"node_path: {directory} is {problem}")


def filesystem_type(path: Path) -> str | None:
    """The type of the file system ``path`` is on (from /proc/self/mountinfo); None where it cannot be told."""
    target = os.path.realpath(path)
    best, fs = "", None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if " - " not in line or len(fields) < 5:
                    continue
                point = _unescape(fields[4])
                after = line.split(" - ", 1)[1].split()
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best) and after:
                    best, fs = point, after[0]
    except OSError:
        return None
    return fs


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def open_checked(path: Path, access: Access, setting: str) -> int:
    """``path`` opened read-write (created if missing) and checked: a regular file nobody untrusted may write.

    A file this process creates gets exactly ``access.file_mode``: the mode given to open goes through the umask
    (0640 under the usual 022, which refuses the group's other users). A file that exists keeps its mode, so one
    that others may write is still refused.

    Raises:
        ConfigError: naming ``setting``, when the file cannot be opened or is not to be trusted.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    created = True
    try:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, access.file_mode)
        except FileExistsError:
            created = False
            fd = os.open(path, flags)
    except OSError as e:
        raise ConfigError(f"{setting}: cannot open {path}: {e}") from e
    try:
        if created:
            os.fchmod(fd, access.file_mode)
        info = os.fstat(fd)
        problem = untrusted(info, access) if stat.S_ISREG(info.st_mode) else "not a regular file"
        if problem:
            raise ConfigError(f"{setting}: {path} is {problem}")
    except BaseException:
        os.close(fd)
        raise
    return fd


ProcessIdentity = tuple[int, int]
"""(start time in clock ticks since boot, pid namespace inode): who a pid is, beyond its number."""


def process_identity(pid: int) -> ProcessIdentity | None:
    """``pid``'s start time and pid namespace, None when no such process runs (or it is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X"):
            return None
        start = int(fields[19])
    except (OSError, IndexError, ValueError):
        return None
    try:
        pidns = os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        pidns = 0
    return start, pidns


def own_identity() -> ProcessIdentity:
    identity = process_identity(os.getpid())
    if identity is None:  # /proc is not mounted: no engine could tell this one is dead; still serve
        return 0, 0
    return identity
