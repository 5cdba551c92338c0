"""The one typed configuration tree, and the only place that reads untyped configuration.

Engines hand kvoffload a flat ``{key: value}`` dict (vLLM's ``kv_connector_extra_config``). ``OffloadConfig.from_dict``
validates all of it at once and raises one ``ConfigError`` that names every bad or unknown key and lists the
accepted ones. Every other module receives the typed values below. docs/configuration.md lists every key.
"""

from __future__ import annotations

import enum
import grp
import math
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.auth import MIN_SECRET_BYTES, TierSecret

GIB = 1 << 30


class ConfigError(ValueError):
    """Bad configuration: the message names every culprit."""


class EvictionPolicy(enum.Enum):
    """Which resident block a tier gives up first (manager/policies/; docs/configuration.md compares them)."""

    LRU = "lru"
    ARC = "arc"
    S3FIFO = "s3fifo"
    """S3-FIFO: blocks used once leave through a small FIFO; scan- and loop-resistant."""
    TINYLFU = "tinylfu"
    """W-TinyLFU: a block leaving a small LRU window enters the main LRU only if used more often than its victim."""


class StoreAdmission(enum.Enum):
    """Which full blocks the connector stores (manager/admission.py)."""

    ALL = "all"
    """Every full block."""
    SECOND_SIGHTING = "second-sighting"
    """A block the second time its key is offered for storing, within a bounded memory of recent keys."""


class LoadPolicy(enum.Enum):
    """When blocks that only a tier below host holds are loaded (connector/load_cost.py)."""

    AUTO = "auto"
    """When the tier's recent speed says loading beats recomputing their tokens."""
    ALWAYS = "always"
    NEVER = "never"
    """Lower tiers are written, never read back (e.g. to warm a shared tier for other engines)."""


class WritePolicy(enum.Enum):
    WRITE_THROUGH = "write_through"
    """Every block stored to host is also written to disk."""
    ON_EVICT = "on_evict"
    """Only blocks evicted from host are written to disk."""


@dataclass(frozen=True)
class HostTierConfig:
    capacity_bytes: int = 4 * GIB
    policy: EvictionPolicy = EvictionPolicy.LRU
    copy_threads: int = 2


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


REMOTE_SCHEMES = ("redis", "rediss", "unix")


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
    """Per command; a slower answer is a failed job (a miss, or a skipped store)."""
    ttl_s: int | None = None
    capacity_bytes: int = 16 * GIB
    """What this engine may have written there at once; the server's own ``maxmemory`` bounds the whole store."""
    policy: EvictionPolicy = EvictionPolicy.LRU
    breaker_errors: int = 8
    breaker_cooldown_s: float = 30.0
    secret: TierSecret | None = None
    """As the disk tier's: a keyed MAC on every value, names derived from it."""


@dataclass(frozen=True)
class OffloadConfig:
    """Everything kvoffload needs to know from its user."""

    offload_block_tokens: int | None = None
    """Tokens per offload block; a multiple of the engine's block size. None: the engine's block size."""
    host: HostTierConfig = field(default_factory=HostTierConfig)
    disk: DiskTierConfig | None = None
    remote: RemoteTierConfig | None = None
    load_policy: LoadPolicy = LoadPolicy.AUTO
    store_admission: StoreAdmission = StoreAdmission.ALL
    prefill_tokens_per_s: float | None = None
    """The engine's prefill speed, for cost-aware loading; None: measured from its steps."""
    record_trace: Path | None = None
    """Append each finished request's arrival time, lengths and offload keys (no tokens) to this JSONL file,
    the trace format ``kvoffload replay`` reads (replay/record.py)."""
    model_id: str | None = None
    """Overrides the model name used in the key namespace (engines sharing a tier must agree on it)."""
    model_version: str | None = None
    """Names the weights in the key namespace when the model config cannot tell two checkpoints apart."""
    inject_load_failures: int = 0
    """Testing knob: the first N load jobs of each worker fail (exercises the recompute path end to end)."""
    inject_load_corruption: int = 0
    """Testing knob: the first N load jobs of each worker load a zeroed block yet succeed (proves that the
    end-to-end output comparisons catch a wrong load)."""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> OffloadConfig:
        """Build and validate the tree from flat keys; raise ``ConfigError`` naming every problem."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"kvoffload configuration must be a mapping of keys to values, got "
                              f"{type(raw).__name__}. Accepted keys: " + ", ".join(sorted(KEYS)))
        return _Parser(dict(raw)).parse()


def _positive_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError("must be a positive integer")
    return v


def _non_negative_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError("must be a non-negative integer")
    return v


def _positive_float(v: Any) -> float:
    # NaN compares false with everything, so "v <= 0" alone would let it through (and disable a deadline).
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise ValueError("must be a finite positive number")
    return float(v)


def _gib(v: Any) -> int:
    size = _positive_float(v) * GIB
    if not math.isfinite(size):
        raise ValueError("is too large")
    return int(size)


def _enum(kind: type[enum.Enum]) -> Callable[[Any], Any]:
    def parse(v: Any) -> Any:
        try:
            return kind(str(v).lower())
        except ValueError:
            raise ValueError(f"must be one of {[e.value for e in kind]}") from None

    return parse


def _path(v: Any) -> Path:
    if not isinstance(v, str | Path) or not str(v):
        raise ValueError("must be a directory path")
    return Path(v).expanduser()


def _group(v: Any) -> int:
    """A group name or gid, as a gid (names are resolved here, once)."""
    if isinstance(v, str) and v and not v.isdigit():
        try:
            return grp.getgrnam(v).gr_gid
        except KeyError:
            raise ValueError(f"no group named {v!r} on this machine") from None
    if isinstance(v, str) and v:
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError("must be a group name or a non-negative gid")
    return v


def _secret_file(v: Any) -> TierSecret:
    path = _path(v)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            value = os.read(fd, 1 << 16)
        finally:
            os.close(fd)
    except OSError as e:
        raise ValueError(f"cannot read the secret file: {e.strerror}") from None
    if not stat.S_ISREG(info.st_mode) or info.st_mode & 0o077:
        raise ValueError("the secret file must be a regular file readable by its owner only (chmod 600)")
    return _secret(f"file {path}", value)


def _secret_env(v: Any) -> TierSecret:
    name = _text(v)
    if name not in os.environ:
        raise ValueError("no such environment variable")
    return _secret(f"environment variable {name}", os.environ[name].encode())


def _secret(source: str, value: bytes) -> TierSecret:
    value = value.removesuffix(b"\n")
    if len(value) < MIN_SECRET_BYTES:
        raise ValueError(f"the secret must be at least {MIN_SECRET_BYTES} bytes")
    return TierSecret(source, value)


def _urls(v: Any) -> tuple[str, ...]:
    urls = (v,) if isinstance(v, str) else tuple(v) if isinstance(v, list | tuple) else ()
    if not urls or not all(isinstance(u, str) and u for u in urls):
        raise ValueError("must be a URL or a list of URLs")
    for url in urls:
        scheme, _, rest = url.partition("://")
        if "@" in rest.split("/", 1)[0]:  # so that no password sits in the config's repr or in a log line
            raise ValueError("a URL must not carry credentials: give remote_username and remote_password_env "
                             "(or remote_password_file) instead")
        if scheme not in REMOTE_SCHEMES:
            raise ValueError(f"{url!r} is not a {', '.join(s + '://' for s in REMOTE_SCHEMES)} URL")
    return urls


def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("must be true or false")
    return v


def _password_text(v: Any) -> TierSecret:
    return TierSecret("configuration", _text(v).encode())


def _password_env(v: Any) -> TierSecret:
    name = _text(v)
    if not os.environ.get(name):
        raise ValueError("no such environment variable, or it is empty")
    return TierSecret(f"environment variable {name}", os.environ[name].encode())


def _password_file(v: Any) -> TierSecret:
    path = _path(v)
    try:
        value = path.read_bytes().removesuffix(b"\n")
    except OSError as e:
        raise ValueError(f"cannot read the password file: {e.strerror}") from None
    if not value:
        raise ValueError("the password file is empty")
    return TierSecret(f"file {path}", value)


def _text(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError("must be a non-empty string")
    return v


# key -> (parser, help). The help text is the source of docs/configuration.md's table.
KEYS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "offload_block_tokens": (_positive_int, "tokens per offload block; a multiple of the engine block size"),
    "host_bytes": (_positive_int, "host tier capacity in bytes (default 4 GiB)"),
    "host_gib": (_gib, "host tier capacity in GiB (a float); alternative to host_bytes"),
    "eviction_policy": (_enum(EvictionPolicy), "lru, arc, s3fifo or tinylfu, for every tier"),
    "store_admission": (_enum(StoreAdmission), "all (store every full block) or second-sighting (store a block "
                                               "the second time it is seen)"),
    "record_trace": (_path, "append each finished request's arrival, lengths and offload keys (never tokens) "
                            "to this JSONL file, for kvoffload replay and plan"),
    "copy_threads": (_positive_int, "CPU threads copying device<->host when the KV cache is on the CPU"),
    "disk_path": (_path, "directory of the disk tier; no disk tier when absent"),
    "disk_bytes": (_positive_int, "disk tier capacity in bytes (default 64 GiB)"),
    "disk_gib": (_gib, "disk tier capacity in GiB; alternative to disk_bytes"),
    "disk_io_threads": (_positive_int, "threads doing disk reads and writes"),
    "disk_write_policy": (_enum(WritePolicy), "write_through or on_evict"),
    "disk_read_deadline_ms": (_positive_float, "a disk read slower than this counts as a miss"),
    "disk_breaker_errors": (_positive_int, "consecutive disk errors that switch the disk tier off"),
    "disk_breaker_cooldown_s": (_positive_float, "how long the disk tier stays off after tripping"),
    "disk_shared_group": (_group, "group (name or gid) allowed to share disk_path: its tree is made group-"
                                  "writable for that group only; default: private to the user"),
    "load_policy": (_enum(LoadPolicy), "auto (load a lower tier's hits only when faster than recomputing), "
                                       "always or never"),
    "prefill_tokens_per_s": (_positive_float, "the engine's prefill speed for load_policy auto (default: measured)"),
    "model_id": (_text, "model name in the key namespace (default: the engine's model)"),
    "model_version": (_text, "weights version in the key namespace, for checkpoints whose configs are the same"),
    "remote_url": (_urls, "remote tier server: redis://host:port, rediss:// (TLS) or unix:///path; a list for a "
                          "cluster's start-up nodes; no remote tier when absent"),
    "remote_cluster": (_flag, "true: the servers are a Redis Cluster (redis-py's cluster client)"),
    "remote_username": (_text, "ACL user name for the remote tier"),
    "remote_password": (_password_text, "ACL password (prefer remote_password_env or remote_password_file)"),
    "remote_password_env": (_password_env, "environment variable holding the ACL password"),
    "remote_password_file": (_password_file, "file holding the ACL password"),
    "remote_connect_timeout_ms": (_positive_float, "connecting to a remote server slower than this fails"),
    "remote_timeout_ms": (_positive_float, "a remote command slower than this fails (a miss or a skipped store)"),
    "remote_ttl_s": (_positive_int, "expire remote values this long after they are written (default: never)"),
    "remote_bytes": (_positive_int, "bytes this engine may have stored in the remote tier (default 16 GiB)"),
    "remote_gib": (_gib, "the same in GiB; alternative to remote_bytes"),
    "remote_breaker_errors": (_positive_int, "consecutive remote errors that switch the remote tier off"),
    "remote_breaker_cooldown_s": (_positive_float, "how long the remote tier stays off after tripping"),
    "tier_secret_file": (_secret_file, "file (mode 0600) holding the secret that authenticates disk-tier blocks"),
    "tier_secret_env": (_secret_env, "environment variable holding that secret; alternative to tier_secret_file"),
    "inject_load_failures": (_non_negative_int, "testing: the first N load jobs fail, forcing recompute"),
    "inject_load_corruption": (_non_negative_int,
                               "testing: the first N load jobs load a zeroed block yet succeed (wrong KV)"),
}

_EXCLUSIVE = (("host_bytes", "host_gib"), ("disk_bytes", "disk_gib"), ("tier_secret_file", "tier_secret_env"),
              ("remote_bytes", "remote_gib"), ("remote_password", "remote_password_env"),
              ("remote_password", "remote_password_file"), ("remote_password_env", "remote_password_file"))


_HIDDEN_VALUES = frozenset({"remote_password", "remote_url"})
"""Keys whose values may hold a password: errors name the key, never the value."""


class _Parser:
    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw
        self.errors: list[str] = []
        self.values: dict[str, Any] = {}

    def parse(self) -> OffloadConfig:
        for key, value in self.raw.items():
            if key not in KEYS:
                self.errors.append(f"unknown key {key!r}")
                continue
            try:
                self.values[key] = KEYS[key][0](value)
            except ValueError as e:
                shown = "" if key in _HIDDEN_VALUES else f"={value!r}"
                self.errors.append(f"{key}{shown}: {e}")
        for a, b in _EXCLUSIVE:
            if a in self.raw and b in self.raw:
                self.errors.append(f"give {a} or {b}, not both")
        for prefix, owner in (("disk_", "disk_path"), ("remote_", "remote_url")):
            dependent = sorted(k for k in self.raw if k.startswith(prefix) and k != owner)
            if dependent and owner not in self.raw:
                self.errors.append(f"{', '.join(dependent)} given without {owner}")
        secret_keys = sorted(k for k in self.raw if k.startswith("tier_secret_"))
        if secret_keys and "disk_path" not in self.raw and "remote_url" not in self.raw:
            self.errors.append(f"{', '.join(secret_keys)} given without a shared tier (disk_path or remote_url)")
        if self.errors:
            raise ConfigError(
                "invalid kvoffload configuration: " + "; ".join(self.errors)
                + ". Accepted keys: " + ", ".join(sorted(KEYS))
            )
        return self._build()

    def _remote(self, policy: EvictionPolicy) -> RemoteTierConfig | None:
        v = self.values
        if "remote_url" not in v:
            return None
        connect_ms, timeout_ms = v.get("remote_connect_timeout_ms"), v.get("remote_timeout_ms")
        return RemoteTierConfig(
            urls=v["remote_url"],
            cluster=v.get("remote_cluster", False),
            username=v.get("remote_username"),
            password=v.get("remote_password", v.get("remote_password_env", v.get("remote_password_file"))),
            connect_timeout_s=connect_ms / 1000 if connect_ms else RemoteTierConfig.connect_timeout_s,
            timeout_s=timeout_ms / 1000 if timeout_ms else RemoteTierConfig.timeout_s,
            ttl_s=v.get("remote_ttl_s"),
            capacity_bytes=v.get("remote_bytes", v.get("remote_gib", RemoteTierConfig.capacity_bytes)),
            policy=policy,
            breaker_errors=v.get("remote_breaker_errors", RemoteTierConfig.breaker_errors),
            breaker_cooldown_s=v.get("remote_breaker_cooldown_s", RemoteTierConfig.breaker_cooldown_s),
            secret=v.get("tier_secret_file", v.get("tier_secret_env")),
        )

    def _build(self) -> OffloadConfig:
        v = self.values
        host = HostTierConfig(
            capacity_bytes=v.get("host_bytes", v.get("host_gib", HostTierConfig.capacity_bytes)),
            policy=v.get("eviction_policy", EvictionPolicy.LRU),
            copy_threads=v.get("copy_threads", HostTierConfig.copy_threads),
        )
        disk = None
        if "disk_path" in v:
            deadline_ms = v.get("disk_read_deadline_ms")
            disk = DiskTierConfig(
                path=v["disk_path"],
                capacity_bytes=v.get("disk_bytes", v.get("disk_gib", DiskTierConfig.capacity_bytes)),
                policy=host.policy,
                io_threads=v.get("disk_io_threads", DiskTierConfig.io_threads),
                write_policy=v.get("disk_write_policy", WritePolicy.WRITE_THROUGH),
                read_deadline_s=deadline_ms / 1000 if deadline_ms else DiskTierConfig.read_deadline_s,
                breaker_errors=v.get("disk_breaker_errors", DiskTierConfig.breaker_errors),
                breaker_cooldown_s=v.get("disk_breaker_cooldown_s", DiskTierConfig.breaker_cooldown_s),
                shared_group=v.get("disk_shared_group"),
                secret=v.get("tier_secret_file", v.get("tier_secret_env")),
            )
        return OffloadConfig(
            offload_block_tokens=v.get("offload_block_tokens"),
            host=host,
            disk=disk,
            remote=self._remote(host.policy),
            load_policy=v.get("load_policy", LoadPolicy.AUTO),
            store_admission=v.get("store_admission", StoreAdmission.ALL),
            prefill_tokens_per_s=v.get("prefill_tokens_per_s"),
            record_trace=v.get("record_trace"),
            model_id=v.get("model_id"),
            model_version=v.get("model_version"),
            inject_load_failures=v.get("inject_load_failures", 0),
            inject_load_corruption=v.get("inject_load_corruption", 0),
        )
