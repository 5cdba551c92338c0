"""Whom a tier's files on this machine may trust: the directories and files only this user (or a shared group)
could have written. The disk tier's tree (``tiers.disk.tree``) and the node pool's files (``tiers.node``) follow
the same rules; docs/security.md says what they protect against."""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
SHARED_DIR_MODE = 0o2770
"""Group-shared directories: setgid, so files and directories made in them belong to the shared group."""
SHARED_FILE_MODE = 0o660


@dataclass(frozen=True)
class Access:
    """Who may write the tree: this user alone (``gid`` None), or this user and the members of group ``gid``."""

    gid: int | None = None
    tier: str = "disk"
    """Whose settings an error names: ``<tier>_path``, ``<tier>_shared_group`` (the node tier's files follow the
    same rules)."""

    @property
    def dir_mode(self) -> int:
        return DIR_MODE if self.gid is None else SHARED_DIR_MODE

    @property
    def file_mode(self) -> int:
        return FILE_MODE if self.gid is None else SHARED_FILE_MODE


def untrusted(info: os.stat_result, access: Access) -> str | None:
    """Why a directory with this status could hold blocks someone else planted; None when it cannot."""
    uid = os.geteuid()
    shared = access.gid is not None and info.st_gid == access.gid
    if info.st_uid != uid and not shared:
        return f"owned by uid {info.st_uid}, not by this user (uid {uid}); another user could plant blocks in it"
    if info.st_mode & stat.S_IWOTH:
        return (f"writable by others; another user could plant blocks in it (chmod o-w, or use another "
                f"{access.tier}_path)")
    if info.st_mode & stat.S_IWGRP and not shared:
        return (f"writable by group {info.st_gid}; set {access.tier}_shared_group to share it with that group, or "
                f"chmod g-w")
    return None


_MAX_LINKS = 40
"""Symbolic links followed in resolving one path before giving up (as Linux does)."""


def ancestor_problems(disk_path: Path, access: Access) -> list[str]:
    """Why the directories that resolving ``disk_path`` goes through could let someone swap what it names.

    As OpenSSH's ``StrictModes``: each such directory (symbolic links followed, ``/`` included) must be owned by
    root, by this user or (as the tree's own) by the shared group, and not be writable by anyone else, unless it
    is sticky (``/tmp``) and the entry on our path in it is owned by such an owner: others then cannot rename or
    remove it. An empty list: none could.
    """
    problems = []
    for directory, entry in _lookups(disk_path):
        info = os.lstat(directory)
        writer = _other_writer(info, access)
        if not _trusted_owner(info, access):
            problems.append(f"{directory} is owned by uid {info.st_uid} (not root, nor this user)")
        elif writer and not (info.st_mode & stat.S_ISVTX):
            problems.append(f"{directory} is writable by {writer} (and not sticky)")
        elif writer and not _trusted_owner(owner := os.lstat(entry), access):
            problems.append(f"{directory} is writable by {writer}, sticky, but {entry} in it is owned by uid "
                            f"{owner.st_uid}")
    return problems


def _trusted_owner(info: os.stat_result, access: Access) -> bool:
    return info.st_uid in (0, os.geteuid()) or (access.gid is not None and info.st_gid == access.gid)


def _other_writer(info: os.stat_result, access: Access) -> str | None:
    if info.st_mode & stat.S_IWOTH:
        return "others"
    if info.st_mode & stat.S_IWGRP and info.st_gid != access.gid:
        return f"group {info.st_gid}"
    return None


def _lookups(path: Path) -> list[tuple[Path, Path]]:
    """Each (real directory, entry in it) that resolving ``path`` looks up, symbolic links followed, top first."""
    steps: list[tuple[Path, Path]] = []
    pending = list(reversed(path.absolute().parts[1:]))
    current, links = Path("/"), 0
    while pending:
        name = pending.pop()
        if name == "..":
            current = current.parent  # ``current`` is never a link: its lexical parent is its real one
            continue
        entry = current / name
        steps.append((current, entry))
        if not entry.is_symlink():
            current = entry
            continue
        links += 1
        if links > _MAX_LINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
        target = Path(os.readlink(entry))
        if target.is_absolute():
            current, names = Path("/"), target.parts[1:]
        else:
            names = target.parts
        pending.extend(reversed(names))
    return steps
