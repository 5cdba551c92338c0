"""The root of the one typed configuration tree, and the only place that reads untyped configuration.

Engines hand kvoffload a flat ``{key: value}`` dict (vLLM's ``kv_connector_extra_config``). ``OffloadConfig.from_dict``
validates all of it at once and raises one ``ConfigError`` that names every bad or unknown key and lists the
accepted ones; nothing else escapes it, whatever the keys and values. Every other module receives the typed values
below (the tiers' sections are in tiers.py, the choices among named values in choices.py). Each key's parser
(values.py: ranges, paths, URLs; secrets.py: secrets and passwords) is in ``KEYS``; docs/configuration.md lists
every key with its accepted range.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.config.choices import EvictionPolicy, HostScope, LoadPolicy, StoreAdmission, TenantBy, WritePolicy
from kvoffload.config.secrets import password_env, password_file, password_text, secret_env, secret_file
from kvoffload.config.tiers import (
    DEFAULT_NODE_PATH,
    DiskTierConfig,
    HostTierConfig,
    NodeTierConfig,
    ObjectTierConfig,
    PluginTierConfig,
    RemoteTierConfig,
    RetentionConfig,
    TenantConfig,
)
from kvoffload.config.values import (
    MAX_BYTES,
    FloatRange,
    IntRange,
    cluster_url_problem,
    endpoint_url,
    enum_of,
    extra_tiers,
    flag,
    gib_size,
    group,
    object_url,
    path,
    remote_urls,
    tenant_quota,
    tenant_quota_file,
    text,
)

__all__ = ["FAULT_KEYS", "KEYS", "ConfigError", "OffloadConfig"]


class ConfigError(ValueError):
    """Bad configuration: the message names every culprit."""


@dataclass(frozen=True)
class OffloadConfig:
    """Everything kvoffload needs to know from its user."""

    offload_block_tokens: int | None = None
    """Tokens per offload block; a multiple of the engine's block size. None: the engine's block size."""
    host: HostTierConfig = field(default_factory=HostTierConfig)
    disk: DiskTierConfig | None = None
    remote: RemoteTierConfig | None = None
    object: ObjectTierConfig | None = None
    plugin_tiers: tuple[PluginTierConfig, ...] = ()
    """Tiers from other packages, under disk and remote, asked in this order (key ``extra_tiers``)."""
    load_policy: LoadPolicy = LoadPolicy.AUTO
    store_admission: StoreAdmission = StoreAdmission.ALL
    prefill_tokens_per_s: float | None = None
    """The engine's prefill speed, for cost-aware loading; None: measured from its steps."""
    record_trace: Path | None = None
    """Append each finished request's arrival time, lengths and offload keys (no tokens) to this JSONL file,
    the trace format ``kvoffload replay`` reads (``kvoffload.trace_format``)."""
    model_id: str | None = None
    """Overrides the model name used in the key namespace (engines sharing a tier must agree on it)."""
    model_version: str | None = None
    """Names the weights in the key namespace when the model config cannot tell two checkpoints apart."""
    tenants: TenantConfig | None = None
    """Tenants' shares of the private host tier; None (``tenant_by`` none, the default): one pool for all."""
    retention: RetentionConfig | None = field(default_factory=RetentionConfig)
    """Retention hints honoured by every tier; None (``max_retain_s`` 0): hints are ignored."""
    inject_load_failures: int = 0
    """Testing knob: the first N load jobs of each worker fail (exercises the recompute path end to end)."""
    inject_load_corruption: int = 0
    """Testing knob: the first N load jobs of each worker load a zeroed block yet succeed (proves that the
    end-to-end output comparisons catch a wrong load)."""

    def injected_faults(self) -> dict[str, int]:
        """The fault-injection keys (``FAULT_KEYS``) this configuration sets, with their counts; empty in production."""
        return {key: getattr(self, key) for key in FAULT_KEYS if getattr(self, key)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> OffloadConfig:
        """Build and validate the tree from flat keys; raise ``ConfigError`` naming every problem (and nothing
        else, whatever ``raw`` holds: tests/config/test_config_fuzz.py)."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"kvoffload configuration must be a mapping of keys to values, got "
                              f"{type(raw).__name__}. Accepted keys: " + ", ".join(sorted(KEYS)))
        return _Parser(dict(raw)).parse()


_BYTES = IntRange(1, MAX_BYTES, "1 EiB")
_GIB = gib_size(MAX_BYTES, "1 EiB")
_THREADS = IntRange(1, 256)
_BREAKER_ERRORS = IntRange(1, 1_000_000)
_COOLDOWN_S = FloatRange(0.001, 86_400, "1 ms..1 day")
_REMOTE_TIMEOUT_MS = FloatRange(1, 3_600_000, "1 ms..1 hour")
_FAULT_COUNT = IntRange(0, 1_000_000_000)


# key -> (parser, help). The help text is the source of docs/configuration.md's table.
KEYS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "offload_block_tokens": (IntRange(1, 65_536), "tokens per offload block; a multiple of the engine block size"),
    "host_bytes": (_BYTES, "host tier capacity in bytes (default 4 GiB)"),
    "host_gib": (_GIB, "host tier capacity in GiB (a float); alternative to host_bytes"),
    "eviction_policy": (enum_of(EvictionPolicy), "lru, arc, s3fifo, tinylfu or adaptive, for every tier"),
    "store_admission": (enum_of(StoreAdmission), "all (store every full block), second-sighting (store a block "
                                                 "the second time it is seen) or adaptive (whichever of the two "
                                                 "recent traffic rewards)"),
    "record_trace": (path, "append each finished request's arrival, lengths and offload keys (never tokens) "
                           "to this JSONL file, for kvoffload replay and plan"),
    "copy_threads": (_THREADS, "CPU threads copying device<->host when the KV cache is on the CPU"),
    "host_scope": (enum_of(HostScope), "private (each engine its own host pool) or node (one shared-memory pool for "
                                       "every engine of this model on the machine; host_bytes is then its size)"),
    "node_path": (path, "tmpfs directory of the node pool (default /dev/shm); needs host_scope node"),
    "node_shared_group": (group, "group (name or gid) whose members' engines share the node pool; default: this "
                                 "user's engines only; needs host_scope node"),
    "disk_path": (path, "directory of the disk tier; no disk tier when absent"),
    "disk_bytes": (_BYTES, "disk tier capacity in bytes (default 64 GiB)"),
    "disk_gib": (_GIB, "disk tier capacity in GiB; alternative to disk_bytes"),
    "disk_io_threads": (_THREADS, "threads doing disk reads and writes"),
    "disk_write_policy": (enum_of(WritePolicy), "write_through or on_evict"),
    "disk_read_deadline_ms": (FloatRange(1, 1e9, "1 ms..11.6 days"), "a disk read slower than this counts as a miss"),
    "disk_breaker_errors": (_BREAKER_ERRORS, "consecutive disk errors that switch the disk tier off"),
    "disk_breaker_cooldown_s": (_COOLDOWN_S, "how long the disk tier stays off after tripping"),
    "disk_shared_group": (group, "group (name or gid) allowed to share disk_path: its tree is made group-"
                                 "writable for that group only; default: private to the user"),
    "load_policy": (enum_of(LoadPolicy), "auto (load a lower tier's hits only when faster than recomputing), "
                                         "always or never"),
    "prefill_tokens_per_s": (FloatRange(1, 1e9), "the engine's prefill speed for load_policy auto (default: measured)"),
    "model_id": (text, "model name in the key namespace (default: the engine's model)"),
    "model_version": (text, "weights version in the key namespace, for checkpoints whose configs are the same"),
    "remote_url": (remote_urls, "remote tier server: redis://host:port, rediss:// (TLS) or unix:///path; a list "
                                "for a cluster's start-up nodes; no remote tier when absent"),
    "remote_cluster": (flag, "true: the servers are a Redis Cluster (redis-py's cluster client)"),
    "remote_username": (text, "ACL user name for the remote tier"),
    "remote_password": (password_text, "ACL password (prefer remote_password_env or remote_password_file)"),
    "remote_password_env": (password_env, "environment variable holding the ACL password"),
    "remote_password_file": (password_file, "file holding the ACL password"),
    "remote_connect_timeout_ms": (_REMOTE_TIMEOUT_MS, "connecting to a remote server slower than this fails"),
    "remote_timeout_ms": (_REMOTE_TIMEOUT_MS, "a remote command not answered whole within this fails"),
    "remote_ttl_s": (IntRange(1, 315_360_000, "10 years"),
                     "expire remote values this long after they are written (default: never)"),
    "remote_bytes": (_BYTES, "bytes this engine may have stored in the remote tier (default 16 GiB)"),
    "remote_gib": (_GIB, "the same in GiB; alternative to remote_bytes"),
    "remote_breaker_errors": (_BREAKER_ERRORS, "consecutive remote errors that switch the remote tier off"),
    "remote_breaker_cooldown_s": (_COOLDOWN_S, "how long the remote tier stays off after tripping"),
    "object_url": (object_url, "object tier: s3://bucket or s3://bucket/prefix (credentials from the client's "
                               "chain: AWS_ACCESS_KEY_ID/..., shared files, instance roles); no object tier when "
                               "absent"),
    "object_endpoint": (endpoint_url, "http(s)://host:port of an S3 server other than AWS (Ceph RGW, MinIO)"),
    "object_region": (text, "the bucket's region (default: the client chain's, else us-east-1)"),
    "object_path_style": (flag, "path-style addressing (default: true with object_endpoint, false on AWS)"),
    "object_connect_timeout_ms": (_REMOTE_TIMEOUT_MS, "connecting to the object store slower than this fails"),
    "object_timeout_ms": (_REMOTE_TIMEOUT_MS, "an object request not answered whole within this fails"),
    "object_bytes": (_BYTES, "bytes this engine may have stored in the object tier (default 64 GiB)"),
    "object_gib": (_GIB, "the same in GiB; alternative to object_bytes"),
    "object_io_threads": (_THREADS, "object requests in flight at once per direction in each worker"),
    "object_lookup_fanout": (IntRange(1, 64), "existence requests in flight at once in one round of a lookup"),
    "object_breaker_errors": (_BREAKER_ERRORS, "consecutive object-store errors that switch the object tier off"),
    "object_breaker_cooldown_s": (_COOLDOWN_S, "how long the object tier stays off after tripping"),
    "extra_tiers": (extra_tiers, 'tiers from other packages under disk and remote, by their kvoffload.tiers entry '
                                 'point: {"name": {"option": value}}, asked in that order'),
    "tier_secret_file": (secret_file, "file (mode 0600) holding the secret that authenticates disk-tier blocks"),
    "tier_secret_env": (secret_env, "environment variable holding that secret; alternative to tier_secret_file"),
    "tenant_by": (enum_of(TenantBy), "who a request's tenant is, for tenant_quota: none (one pool for all, the "
                                     "default), cache_salt or lora (requests without one: the tenant \"shared\")"),
    "tenant_quota": (tenant_quota, 'each tenant\'s fraction of the private host tier, e.g. {"default": 0.2, '
                                   '"shared": 0.3, "acme": 0.5}: at most 16 named, "default" for all others together, '
                                   'fractions in (0, 1] adding up to at most 1; needs tenant_by cache_salt or lora'),
    "tenant_quota_file": (tenant_quota_file, "JSON file holding the tenant_quota mapping instead, re-read by a "
                                             "running engine when it changes (a bad one is refused, the old "
                                             "quotas kept); needs tenant_by cache_salt or lora"),
    "max_retain_s": (FloatRange(0, 86_400, "1 day"), 'cap on retention hints, kv_transfer_params {"kvoffload": '
                     '{"retain_s": N}} (default 3600; 0: hints ignored)'),
    "retain_share": (FloatRange(0, 1), "fraction of each tier (tenant's share) retained blocks may hold (0.5)"),
    "inject_load_failures": (_FAULT_COUNT, "testing: the first N load jobs fail, forcing recompute"),
    "inject_load_corruption": (_FAULT_COUNT,
                               "testing: the first N load jobs load a zeroed block yet succeed (wrong KV)"),
}

FAULT_KEYS = tuple(key for key in KEYS if key.startswith("inject_"))
"""Testing knobs that make kvoffload fail or serve wrong KV on purpose, each an ``OffloadConfig`` field of that
name; the worker half, which applies them, logs a warning for every one set (connector/worker.py)."""

_EXCLUSIVE = (("host_bytes", "host_gib"), ("disk_bytes", "disk_gib"), ("tier_secret_file", "tier_secret_env"),
              ("remote_bytes", "remote_gib"), ("object_bytes", "object_gib"),
              ("remote_password", "remote_password_env"),
              ("remote_password", "remote_password_file"), ("remote_password_env", "remote_password_file"))


_HIDDEN_VALUES = frozenset({"remote_password", "remote_url", "object_url", "object_endpoint"})
"""Keys whose values may hold a password: errors name the key, never the value."""


_SHOWN_CHARS = 80
"""A value longer than this is cut short in error messages."""


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # an int of more than 4300 digits, or a broken __repr__: the error must still be a ConfigError
        return f"<{type(value).__name__}>"
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 3] + "..."


def _unknown(key: object) -> str:
    if not isinstance(key, str):
        return f"key {_shown(key)} is not a string"
    near = difflib.get_close_matches(key, KEYS, n=1)
    return f"unknown key {_shown(key)}" + (f" (did you mean {near[0]!r}?)" if near else "")


class _Parser:
    def __init__(self, raw: dict[Any, Any]) -> None:
        self.raw = raw
        self.keys = {k for k in raw if k in KEYS}  # an unknown key is reported once, as unknown
        self.errors: list[str] = []
        self.values: dict[str, Any] = {}

    def parse(self) -> OffloadConfig:
        for key, value in self.raw.items():
            if key in KEYS:
                self._parse_value(key, value)
            else:
                self.errors.append(_unknown(key))
        self._check_combinations()
        if self.errors:
            raise ConfigError(
                "invalid kvoffload configuration: " + "; ".join(self.errors)
                + ". Accepted keys: " + ", ".join(sorted(KEYS))
            )
        return self._build()

    def _parse_value(self, key: str, value: Any) -> None:
        try:
            self.values[key] = KEYS[key][0](value)
        except ValueError as e:
            shown = "" if key in _HIDDEN_VALUES else f"={_shown(value)}"
            self.errors.append(f"{key}{shown}: {e}")

    def _check_combinations(self) -> None:
        keys = self.keys
        for a, b in _EXCLUSIVE:
            if a in keys and b in keys:
                self.errors.append(f"give {a} or {b}, not both")
        for prefix, owner in (("disk_", "disk_path"), ("remote_", "remote_url"), ("object_", "object_url")):
            dependent = sorted(k for k in keys if k.startswith(prefix) and k != owner)
            if dependent and owner not in keys:
                self.errors.append(f"{', '.join(dependent)} given without {owner}")
        node_keys = sorted(k for k in keys if k.startswith("node_"))
        node = self.values.get("host_scope") is HostScope.NODE
        if node_keys and not node:
            self.errors.append(f"{', '.join(node_keys)} given without host_scope node")
        if node and self.values.get("disk_write_policy") is WritePolicy.ON_EVICT:
            # On evict, blocks wait unwritten in host slots, which other engines may evict from a shared pool.
            self.errors.append("disk_write_policy on_evict cannot be used with host_scope node (use write_through)")
        secret_keys = sorted(k for k in keys if k.startswith("tier_secret_"))
        if secret_keys and not keys & {"disk_path", "remote_url", "object_url"}:
            self.errors.append(f"{', '.join(secret_keys)} given without a shared tier (disk_path, remote_url or "
                               f"object_url)")
        self._check_tenants()
        if self.values.get("remote_cluster") and "remote_url" in self.values:
            problem = cluster_url_problem(self.values["remote_url"])
            if problem:
                self.errors.append(f"remote_url with remote_cluster: {problem}")

    def _check_tenants(self) -> None:
        by = self.values.get("tenant_by", TenantBy.NONE)
        given = sorted(self.keys & {"tenant_quota", "tenant_quota_file"})
        if given and by is TenantBy.NONE:
            self.errors.append(f"{' and '.join(given)} given without tenant_by cache_salt or lora")
        if len(given) == 2:
            self.errors.append("tenant_quota and tenant_quota_file both given: give the shares once")
        if by is not TenantBy.NONE and "tenant_by" in self.values and not given:
            self.errors.append(f"tenant_by {by.value} given without tenant_quota or tenant_quota_file (the "
                               f"tenants' shares)")

    def _tenants(self) -> TenantConfig | None:
        v = self.values
        by = v.get("tenant_by", TenantBy.NONE)
        if by is TenantBy.NONE:
            return None
        if "tenant_quota_file" in v:
            file, (default, shares) = v["tenant_quota_file"]
            return TenantConfig(by, default, shares, file)
        default, shares = v["tenant_quota"]
        return TenantConfig(by, default, shares)

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

    def _object(self, policy: EvictionPolicy) -> ObjectTierConfig | None:
        v = self.values
        if "object_url" not in v:
            return None
        connect_ms, timeout_ms = v.get("object_connect_timeout_ms"), v.get("object_timeout_ms")
        bucket, prefix = v["object_url"]
        return ObjectTierConfig(
            bucket=bucket,
            prefix=prefix,
            endpoint=v.get("object_endpoint"),
            region=v.get("object_region"),
            path_style=v.get("object_path_style"),
            connect_timeout_s=connect_ms / 1000 if connect_ms else ObjectTierConfig.connect_timeout_s,
            timeout_s=timeout_ms / 1000 if timeout_ms else ObjectTierConfig.timeout_s,
            capacity_bytes=v.get("object_bytes", v.get("object_gib", ObjectTierConfig.capacity_bytes)),
            policy=policy,
            io_threads=v.get("object_io_threads", ObjectTierConfig.io_threads),
            lookup_fanout=v.get("object_lookup_fanout", ObjectTierConfig.lookup_fanout),
            breaker_errors=v.get("object_breaker_errors", ObjectTierConfig.breaker_errors),
            breaker_cooldown_s=v.get("object_breaker_cooldown_s", ObjectTierConfig.breaker_cooldown_s),
            secret=v.get("tier_secret_file", v.get("tier_secret_env")),
        )

    def _build(self) -> OffloadConfig:
        v = self.values
        scope = v.get("host_scope", HostScope.PRIVATE)
        node = None
        if scope is HostScope.NODE:
            node = NodeTierConfig(v.get("node_path", DEFAULT_NODE_PATH), v.get("node_shared_group"))
        host = HostTierConfig(
            capacity_bytes=v.get("host_bytes", v.get("host_gib", HostTierConfig.capacity_bytes)),
            policy=v.get("eviction_policy", EvictionPolicy.LRU),
            copy_threads=v.get("copy_threads", HostTierConfig.copy_threads),
            scope=scope,
            node=node,
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
            object=self._object(host.policy),
            plugin_tiers=tuple(PluginTierConfig(name, options) for name, options in v.get("extra_tiers", ())),
            load_policy=v.get("load_policy", LoadPolicy.AUTO),
            store_admission=v.get("store_admission", StoreAdmission.ALL),
            prefill_tokens_per_s=v.get("prefill_tokens_per_s"),
            record_trace=v.get("record_trace"),
            model_id=v.get("model_id"),
            model_version=v.get("model_version"),
            tenants=self._tenants(),
            retention=_retention(v),
            inject_load_failures=v.get("inject_load_failures", 0),
            inject_load_corruption=v.get("inject_load_corruption", 0),
        )


def _retention(v: dict[str, Any]) -> RetentionConfig | None:
    config = RetentionConfig(v.get("max_retain_s", RetentionConfig.max_retain_s), v.get("retain_share", 0.5))
    return config if config.max_retain_s > 0 else None
