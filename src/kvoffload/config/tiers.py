"""The typed sections of the configuration tree, one per tier (``offload.OffloadConfig`` holds them).

Made only by offload.py's parser from validated values; every field is typed, and secrets are ``TierSecret`` values
that never show in a ``repr``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.auth import TierSecret
from kvoffload.config.choices import EvictionPolicy, HostScope, TenantBy, WritePolicy
from kvoffload.config.values import GIB

DEFAULT_NODE_PATH = Path("/dev/shm")


@dataclass(frozen=True)
class NodeTierConfig:
    """Where the node pool lives and who may share it (``host_scope`` node)."""

    path: Path = DEFAULT_NODE_PATH
    """A directory on a tmpfs; the pool's files go in ``kvoffload-node-<owner>/<namespace>/`` under it."""
    shared_group: int | None = None
    """gid of the group whose members' engines share the pool; None: this user's engines only."""


@dataclass(frozen=True)
class HostTierConfig:
    capacity_bytes: int = 4 * GIB
    """Private scope: per rank of this engine. Node scope: the whole node pool, per rank (every engine sharing it
    must give the same size)."""
    policy: EvictionPolicy = EvictionPolicy.LRU
    copy_threads: int = 2
    scope: HostScope = HostScope.PRIVATE
    node: NodeTierConfig | None = None
    """Set exactly when ``scope`` is node."""


@dataclass(frozen=True)
class DiskTierConfig:
    path: Path
    capacity_bytes: int = 64 * GIB
    policy: EvictionPolicy = EvictionPolicy.LRU
    io_threads: int = 4
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    read_deadline_s: float = 2.0
    breaker_errors: int = 8
    breaker_cooldown_s: float = 30.0
    shared_group: int | None = None
    """gid of the group whose members share the directory (group-writable tree); None: private to the user."""
    secret: TierSecret | None = None
    """With a secret every block carries a keyed MAC and is named by it (kvoffload.auth); None: CRC only."""


@dataclass(frozen=True)
class RemoteTierConfig:
    """A Redis-protocol store (Redis 7+, Valkey, Redis Cluster) below the host tier, shared by many engines."""

    urls: tuple[str, ...]
    """``redis://host:port``, ``rediss://`` (TLS) or ``unix:///path``; several are a cluster's start-up nodes."""
    cluster: bool = False
    username: str | None = None
    password: TierSecret | None = None
    """The ACL password (hidden from ``repr``, never logged)."""
    connect_timeout_s: float = 0.5
    timeout_s: float = 1.0
    """A command's wall-clock deadline (plus ``connect_timeout_s`` when it must connect), however the server
    trickles: tiers/remote/connection.py; a slower answer is a failed job (a miss, or a skipped store)."""
    ttl_s: int | None = None
    capacity_bytes: int = 16 * GIB
    """What this engine may have written there at once; the server's own ``maxmemory`` bounds the whole store."""
    policy: EvictionPolicy = EvictionPolicy.LRU
    breaker_errors: int = 8
    breaker_cooldown_s: float = 30.0
    secret: TierSecret | None = None
    """As the disk tier's: a keyed MAC on every value, names derived from it."""


@dataclass(frozen=True)
class ObjectTierConfig:
    """An S3-API object store (AWS S3, Ceph RGW, MinIO, GCS interop) below the host tier, shared by many engines and
    clusters. Credentials are never here: the client library's chain finds them (environment, shared files,
    instance roles)."""

    bucket: str
    prefix: str = ""
    """Object names start with ``<prefix>/`` (nothing when empty)."""
    endpoint: str | None = None
    """``http(s)://host:port`` of a server other than AWS; None: AWS S3 of ``region``."""
    region: str | None = None
    """None: the client chain's region (``AWS_REGION``, shared config), else us-east-1."""
    path_style: bool | None = None
    """Path-style addressing (``endpoint/bucket/name``); None: path-style with an ``endpoint``, virtual-host on AWS."""
    connect_timeout_s: float = 1.0
    timeout_s: float = 2.0
    """A request's wall-clock deadline past its connect (a load's or store's also grows with its bytes:
    tiers/lower/deadline.py), however the server trickles; a slower answer is a failed job (a miss, or a skipped
    store)."""
    capacity_bytes: int = 64 * GIB
    """What this engine may have written there at once; lifecycle rules bound the whole bucket."""
    policy: EvictionPolicy = EvictionPolicy.LRU
    io_threads: int = 8
    """Requests in flight at once per direction (stores, loads) in each worker."""
    lookup_fanout: int = 4
    """Existence requests in flight at once in a round of the scheduler's prefix search (``ObjectProbe``)."""
    breaker_errors: int = 8
    breaker_cooldown_s: float = 30.0
    secret: TierSecret | None = None
    """As the disk tier's: every object sealed (AES-256-GCM) and named by keyed hashes."""


@dataclass(frozen=True)
class PluginTierConfig:
    """A tier from another package, under the built-in ones: its entry point's name in the ``kvoffload.tiers``
    group, and its options as given (its spec parses them: ``kvoffload.tiers.registry``)."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    def option_map(self) -> dict[str, Any]:
        return dict(self.options)


@dataclass(frozen=True)
class TenantConfig:
    """Tenants' shares of the private host tier (keys ``tenant_by`` and ``tenant_quota``; docs/tenants.md).

    ``shares``: the named tenants' fractions of the tier, in the order given; ``default``: the fraction that every
    tenant not named shares with the others not named (counted together as "other"). Validated by the parser:
    at most ``MAX_TENANTS`` names, each fraction in (0, 1], all of them together at most 1.
    """

    by: TenantBy
    default: float
    shares: tuple[tuple[str, float], ...] = ()
    quota_file: Path | None = None
    """``tenant_quota_file``: where the shares were read, re-read by a running engine when it changes."""


@dataclass(frozen=True)
class RetentionConfig:
    """Retention hints (keys ``max_retain_s`` and ``retain_share``; docs/sessions.md): a request's
    ``kv_transfer_params`` may ask that its blocks stay for up to ``max_retain_s`` seconds (longer asks are capped
    to it), and retained blocks may hold up to ``share`` of each tier (of each tenant's share, with tenants on)."""

    max_retain_s: float = 3600.0
    share: float = 0.5
