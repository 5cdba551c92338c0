"""Parsers of single configuration values, for offload.py's ``KEYS`` table.

Each parser takes what the user wrote and returns the typed value, or raises ``ValueError`` saying what it accepts;
offload.py's parser puts the key in front and gathers every problem into one ``ConfigError``. Numeric keys have a
range that is a value (``IntRange``, ``FloatRange``, ``GibSize``), so that docs/configuration.md's table and the
tests read the very bounds the parser applies. Nothing here touches the file system or the network: a path or URL
is checked for what would make start-up fail, and is used later by the tiers.
"""

from __future__ import annotations

import enum
import grp
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

GIB = 1 << 30
MAX_BYTES = 1 << 60
"""1 EiB: the largest tier size accepted (the host tier is further bounded by this machine's memory)."""
MAX_PATH_BYTES = 4096
"""Linux's PATH_MAX: a longer path fails every system call."""
MAX_GID = (1 << 32) - 2
"""The largest gid (``(gid_t) -1`` means "no change" to chown)."""
REMOTE_SCHEMES = ("redis", "rediss", "unix")
_DATABASE = re.compile(r"/?|/\d{1,4}")
_DATABASE_QUERY = re.compile(r"db=\d{1,4}")


def _shown(x: float) -> str:
    return str(int(x)) if x == int(x) and abs(x) < 1e16 else repr(x)


@dataclass(frozen=True)
class IntRange:
    """An integer from ``lo`` to ``hi``, both included (``True`` and ``False`` are not integers)."""

    lo: int
    hi: int
    note: str = ""
    """What the bounds mean, for the docs (e.g. "1 EiB")."""

    @property
    def accepted(self) -> str:
        """The range as docs/configuration.md writes it."""
        return f"{self.lo}..{self.hi}" + (f" ({self.note})" if self.note else "")

    def __call__(self, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not self.lo <= v <= self.hi:
            raise ValueError(f"must be an integer in {self.accepted}")
        return int(v)


@dataclass(frozen=True)
class FloatRange:
    """A number (integer or float) from ``lo`` to ``hi``, both included; never NaN or infinite."""

    lo: float
    hi: float
    note: str = ""

    @property
    def accepted(self) -> str:
        return f"{_shown(self.lo)}..{_shown(self.hi)}" + (f" ({self.note})" if self.note else "")

    def __call__(self, v: Any) -> float:
        # NaN fails every comparison and an int too large for a float still compares exactly, so the one chained
        # comparison refuses NaN, the infinities and huge integers before float() could overflow.
        if isinstance(v, bool) or not isinstance(v, int | float) or not self.lo <= v <= self.hi:
            raise ValueError(f"must be a number in {self.accepted}")
        return float(v)


@dataclass(frozen=True)
class GibSize(FloatRange):
    """A size written in GiB (a float), returned in bytes; ``note`` names the largest size in words."""

    @property
    def accepted(self) -> str:
        return f"1 byte ({self.lo:.2g})..{_shown(self.hi)} GiB ({self.note})"

    def __call__(self, v: Any) -> int:
        return int(super().__call__(v) * GIB)


def gib_size(max_bytes: int, max_name: str) -> GibSize:
    """Sizes in GiB from one byte to ``max_bytes`` (``max_name`` in words, for the docs)."""
    return GibSize(1 / GIB, max_bytes / GIB, max_name)


def enum_of(kind: type[enum.Enum]) -> Callable[[Any], Any]:
    """A member of ``kind`` given by its value, in any case."""
    values = [e.value for e in kind]

    def parse(v: Any) -> Any:
        if isinstance(v, kind):
            return v
        if isinstance(v, str) and v.lower() in values:
            return kind(v.lower())
        raise ValueError(f"must be one of {values}")

    return parse


def flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("must be true or false")
    return v


def text(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError("must be a non-empty string")
    if "\0" in v:
        raise ValueError("must not contain a NUL byte")
    return v


def env_name(v: Any) -> str:
    """The name of an environment variable (whether it is set is the caller's question)."""
    name = text(v)
    if "=" in name:
        raise ValueError("an environment variable's name has no '='")
    return name


def path(v: Any) -> Path:
    """A file or directory path, ``~`` expanded; refused if no system call could take it."""
    if not isinstance(v, str | Path) or not str(v):
        raise ValueError("must be a path")
    name = str(v)
    if "\0" in name:
        raise ValueError("must not contain a NUL byte")
    try:
        size = len(os.fsencode(name))
    except UnicodeEncodeError:
        raise ValueError("cannot be encoded as a file name on this machine") from None
    if size > MAX_PATH_BYTES:
        raise ValueError(f"is longer than {MAX_PATH_BYTES} bytes")
    try:
        return Path(name).expanduser()
    except RuntimeError:  # "~nosuchuser/..."
        raise ValueError(f"starts with {name.split('/', 1)[0]}, a home directory this machine does not know") from None


def group(v: Any) -> int:
    """A group name or gid, as a gid (names are resolved here, once)."""
    if isinstance(v, str) and v and not (v.isascii() and v.isdigit()):
        try:
            return grp.getgrnam(text(v)).gr_gid
        except KeyError:
            raise ValueError(f"no group named {v!r} on this machine") from None
    gid = int(v) if isinstance(v, str) and v else v
    if isinstance(gid, bool) or not isinstance(gid, int) or not 0 <= gid <= MAX_GID:
        raise ValueError(f"must be a group name or a gid in 0..{MAX_GID}")
    return gid


def remote_urls(v: Any) -> tuple[str, ...]:
    """One URL or a list of them (a cluster's start-up nodes), each checked by ``check_remote_url``."""
    urls = (v,) if isinstance(v, str) else tuple(v) if isinstance(v, list | tuple) else ()
    if not urls or not all(isinstance(u, str) and u for u in urls):
        raise ValueError("must be a URL or a list of URLs")
    for url in urls:
        check_remote_url(url)
    schemes = sorted({url.partition("://")[0] for url in urls})
    if len(schemes) > 1:
        raise ValueError(f"every URL must have the same scheme, got {', '.join(schemes)}")
    return urls


def check_remote_url(url: str) -> None:
    """Refuse what redis-py would refuse (or misread) at start-up. Messages show the URL's ``scheme://host:port``
    only: the rest (a query) may hold a password."""
    scheme, _, rest = url.partition("://")
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in netloc:  # so that no password sits in the config's repr or in a log line
        raise ValueError("a URL must not carry credentials: give remote_username and remote_password_env "
                         "(or remote_password_file) instead")
    if scheme not in REMOTE_SCHEMES:
        raise ValueError(f"{scheme}://{netloc} is not a {', '.join(s + '://' for s in REMOTE_SCHEMES)} URL")
    where = f"{scheme}://{netloc}"
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError(f"{where}...: a URL has no spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:  # a port out of 0..65535 or not a number, an unclosed [IPv6 address
        raise ValueError(f"{where} is not a valid URL: {e}") from None
    if parts.fragment or (parts.query and not _DATABASE_QUERY.fullmatch(parts.query)):
        raise ValueError(f"{where}: a URL takes no query but db=N (kvoffload sets the connection's options)")
    if scheme == "unix":
        if parts.netloc or not parts.path:
            raise ValueError(f"{where}: a socket URL is unix:///path/to/socket")
        return
    if not parts.hostname:
        raise ValueError(f"{where} has no host")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{where}: the port must be in 1..65535")
    if not _DATABASE.fullmatch(parts.path):
        raise ValueError(f"{where}: the path after the host must be a database number (/0)")


def cluster_url_problem(urls: tuple[str, ...]) -> str | None:
    """Why ``urls`` cannot be a Redis Cluster's start-up nodes, or None."""
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            return "a Redis Cluster's nodes are redis:// or rediss:// URLs, not unix://"
        if parts.path.strip("/") not in ("", "0") or parts.query not in ("", "db=0"):
            return "a Redis Cluster has database 0 only"
    return None


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
"""S3's bucket naming rules (3-63 characters: lower-case letters, digits, dots and hyphens; alphanumeric ends)."""
MAX_OBJECT_PREFIX = 512
"""Object names are at most 1,024 bytes on S3; kvoffload's own part of a name is under 100."""


def object_url(v: Any) -> tuple[str, str]:
    """``s3://bucket`` or ``s3://bucket/prefix``: returns ``(bucket, prefix)`` ("" for none). The prefix's parts
    between slashes are never empty (no slash at its ends, none doubled), so that it names one place only."""
    if not isinstance(v, str) or not v.startswith("s3://"):
        raise ValueError("must be an s3://bucket or s3://bucket/prefix URL")
    bucket, slash, prefix = v[len("s3://"):].partition("/")
    if "@" in bucket:
        raise ValueError("an object URL must not carry credentials (they come from the client's chain: "
                         "AWS_ACCESS_KEY_ID, shared files, instance roles)")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket or re.fullmatch(r"[\d.]+", bucket):
        raise ValueError(f"bucket {bucket!r} is not a valid S3 bucket name (3-63 lower-case letters, digits, '.' "
                         f"and '-', starting and ending with a letter or digit)")
    if slash and "" in prefix.split("/"):
        raise ValueError(f"the prefix after the bucket has an empty part: no slash at its ends or doubled "
                         f"(s3://{bucket} for no prefix)")
    if len(prefix.encode()) > MAX_OBJECT_PREFIX or any(c.isspace() or not c.isprintable() for c in prefix):
        raise ValueError(f"the prefix after the bucket must be printable, without spaces or empty parts, and at "
                         f"most {MAX_OBJECT_PREFIX} bytes")
    return bucket, prefix


def endpoint_url(v: Any) -> str:
    """An ``http://host[:port]`` or ``https://host[:port]`` URL of an S3 server (no credentials, path or query)."""
    if not isinstance(v, str) or any(c.isspace() or not c.isprintable() for c in v):
        raise ValueError("must be an http:// or https:// URL without spaces")
    try:
        parts = urlsplit(v)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"is not a valid URL: {e}") from None
    where = f"{parts.scheme}://{parts.hostname}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http://host[:port] or https://host[:port] URL")
    if "@" in parts.netloc:
        raise ValueError(f"{where}: an endpoint must not carry credentials (they come from the client's chain: "
                         f"AWS_ACCESS_KEY_ID, shared files, instance roles)")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(f"{where}: an endpoint has no path or query (the bucket goes in object_url)")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{where}: the port must be in 1..65535")
    return v.rstrip("/")


TIER_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
"""A tier from another package is named like a Python identifier, in lower case (it also names its medium)."""
_OPTION_VALUE = (str, int, float, bool, type(None))


def extra_tiers(v: Any) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    """``{"name": {"option": value, ...}, ...}``: tiers from other packages, in the order given, each with options
    of JSON scalars (the tier's spec checks them when the stack is built: kvoffload.tiers.registry)."""
    if not isinstance(v, Mapping) or not v:
        raise ValueError('must be a non-empty mapping of tier names to their options, e.g. {"mytier": {}}')
    tiers = []
    for name, options in v.items():
        if not isinstance(name, str) or not TIER_NAME.fullmatch(name):
            raise ValueError(f"tier name {name!r} must be lower-case letters, digits and '_', starting with a letter")
        if name in ("device", "host", "disk", "remote", "object"):
            raise ValueError(f"tier name {name!r} is kvoffload's own tier; its keys configure it")
        if not isinstance(options, Mapping):
            raise ValueError(f"{name}: options must be a mapping of names to values")
        for key, value in options.items():
            if not isinstance(key, str) or not isinstance(value, _OPTION_VALUE):
                raise ValueError(f"{name}: option {key!r} must be a string naming a string, number, bool or null")
        tiers.append((name, tuple(options.items())))
    return tuple(tiers)


MAX_TENANTS = 16
"""Named tenants in ``tenant_quota``. Every named tenant is one eviction policy in the host tier's index, looked at
once per run of victims (``index/tenants.py``), and later one label value of each per-tenant figure: a bound keeps
both small. Tenants not named share the default fraction, counted together as "other"."""

_SHARE_SLACK = 1e-9
"""Fractions given as decimals may add up to a hair over 1 (0.1 + 0.2 + 0.7)."""


def tenant_quota(v: Any) -> tuple[float, tuple[tuple[str, float], ...]]:
    """``{"default": 0.2, "shared": 0.3, "acme": 0.5}``: each tenant's fraction of the host tier, the default for
    tenants not named (together), named ones in the order given; answers (default, ((name, fraction), ...))."""
    if not isinstance(v, Mapping) or "default" not in v:
        raise ValueError('must be a mapping of tenant names to fractions of the tier with a "default", '
                         'e.g. {"default": 0.5, "acme": 0.5}')
    named = [name for name in v if name != "default"]
    if len(named) > MAX_TENANTS:
        raise ValueError(f"names {len(named)} tenants; at most {MAX_TENANTS} (the others share the default)")
    fractions = {}
    for name, share in v.items():
        if not isinstance(name, str) or not name or "\0" in name or len(name) > 256:
            raise ValueError(f"tenant name {repr(name)[:60]} must be a non-empty string of at most 256 characters")
        if name == "other":
            raise ValueError('"other" is the name of the tenants not named; give their share as "default"')
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"{name}: fraction {repr(share)[:60]} must be a number in (0, 1]")
        fractions[name] = float(share)
    total = sum(fractions.values())
    if total > 1 + _SHARE_SLACK:
        raise ValueError(f"fractions add up to {total:g}, more than the whole tier (1)")
    return fractions["default"], tuple((name, fractions[name]) for name in named)


QUOTA_FILE_BYTES = 64 * 1024
"""A quota file is a small JSON mapping; anything larger is refused unread."""


def read_tenant_quota(file: Path) -> tuple[float, tuple[tuple[str, float], ...]]:
    """The quota mapping in ``file`` (JSON, as ``tenant_quota``), as ``tenant_quota`` answers it.

    Raises:
        ValueError: the file cannot be read, is too large, is not JSON, or its mapping is refused; the message
            says which.
    """
    try:
        with open(file, "rb") as f:
            raw = f.read(QUOTA_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read {str(file)!r}: {e.strerror or e}") from e
    if len(raw) > QUOTA_FILE_BYTES:
        raise ValueError(f"{str(file)!r} is larger than {QUOTA_FILE_BYTES} bytes")
    try:
        mapping = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(file)!r} is not JSON: {e}") from e
    try:
        return tenant_quota(mapping)
    except ValueError as e:
        raise ValueError(f"{str(file)!r}: {e}") from e


def tenant_quota_file(v: Any) -> tuple[Path, tuple[float, tuple[tuple[str, float], ...]]]:
    """A JSON file holding the ``tenant_quota`` mapping, read now (it must hold a valid one) and re-read by a
    running engine when it changes; answers (the path, its quota)."""
    file = path(v)
    return file, read_tenant_quota(file)
