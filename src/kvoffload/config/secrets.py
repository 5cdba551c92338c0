"""Reading the shared tiers' secret and the remote tier's password, for offload.py's ``KEYS`` table.

A secret file is read once, at start-up, the way deployments mount it: a Kubernetes secret is a symbolic link
(``key -> ..data/key``, ``..data -> ..2024_01_01_00_00_00.1/``), so links are followed and the file they end at is
checked, through the open descriptor (the file checked is the file read). It must be a regular file (opened
without blocking, so a FIFO is refused at once instead of hanging start-up), owned by this process's user or by
root (anyone else who owns it knows the secret and can replace it), readable by its owner only, and at most
``MAX_SECRET_FILE_BYTES``. Refusals are ``ValueError`` saying what is wrong, never the secret; offload.py's parser
names the key. docs/security.md ("how the secret file is read") gives the threat.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from kvoffload.auth import MIN_SECRET_BYTES, TierSecret
from kvoffload.config.values import env_name, path, text

MAX_SECRET_FILE_BYTES = 1 << 16
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_private_file(file: Path, what: str, limit: int = MAX_SECRET_FILE_BYTES) -> bytes:
    """The bytes of ``file`` (links followed), refused unless only this process's user or root controls it.

    Raises:
        ValueError: the file cannot be opened or read, is not a regular file, is owned by another user, is
            accessible to its group or others, or holds more than ``limit`` bytes. ``what`` names the file's use.
    """
    try:
        fd = os.open(file, _OPEN_FLAGS)
    except OSError as e:
        raise ValueError(f"cannot open the {what} file: {e.strerror}") from None
    try:
        check_private(os.fstat(fd), what)
        return _read_at_most(fd, limit, what)
    finally:
        os.close(fd)


def check_private(info: os.stat_result, what: str) -> None:
    """Refuse a file that is not regular, not owned by this process's user or root, or not private to its owner."""
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
        raise ValueError(f"the {what} file must be a regular file, it is {kind}")
    euid = os.geteuid()
    if info.st_uid not in (euid, 0):
        raise ValueError(f"the {what} file is owned by uid {info.st_uid}, who can read and replace it: it must be "
                         f"owned by this process's user (uid {euid}) or root")
    if info.st_mode & 0o077:
        raise ValueError(f"the {what} file must be readable by its owner only (chmod 600), its mode is "
                         f"{stat.S_IMODE(info.st_mode):04o}")


def _read_at_most(fd: int, limit: int, what: str) -> bytes:
    """Read up to ``limit + 1`` bytes, so that a longer file is refused rather than cut short."""
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise ValueError(f"cannot read the {what} file: {e.strerror}") from None
    if size > limit:
        raise ValueError(f"the {what} file is larger than {limit} bytes")
    return b"".join(chunks)


def secret_file(v: Any) -> TierSecret:
    file = path(v)
    return _secret(f"file {file}", read_private_file(file, "secret"))


def secret_env(v: Any) -> TierSecret:
    name = env_name(v)
    if name not in os.environ:
        raise ValueError("no such environment variable")
    return _secret(f"environment variable {name}", os.fsencode(os.environ[name]))


def _secret(source: str, value: bytes) -> TierSecret:
    value = value.removesuffix(b"\n")
    if len(value) < MIN_SECRET_BYTES:
        raise ValueError(f"the secret must be at least {MIN_SECRET_BYTES} bytes")
    return TierSecret(source, value)


def password_text(v: Any) -> TierSecret:
    try:
        value = text(v).encode()
    except UnicodeEncodeError:  # its message would show a character of the password
        raise ValueError("must be UTF-8 text") from None
    return TierSecret("configuration", value)


def password_env(v: Any) -> TierSecret:
    name = env_name(v)
    if not os.environ.get(name):
        raise ValueError("no such environment variable, or it is empty")
    return TierSecret(f"environment variable {name}", os.fsencode(os.environ[name]))


def password_file(v: Any) -> TierSecret:
    file = path(v)
    value = read_private_file(file, "password").removesuffix(b"\n")
    if not value:
        raise ValueError("the password file is empty")
    return TierSecret(f"file {file}", value)
