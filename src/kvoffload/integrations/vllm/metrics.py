"""kvoffload's figures in vLLM's connector stats and Prometheus hooks.

Data flow: each worker's ``TransferStats`` (bytes, seconds, jobs per direction) and the scheduler half's
``SchedulerStats`` (hit and miss tokens) plus the host tier's bytes in use become one ``KVOffloadStats``
payload. vLLM sums worker payloads (``aggregate``), adds the scheduler's, ships the plain dict to its stat
loggers, logs ``reduce()`` periodically and hands the dict to ``KVOffloadPromMetrics.observe``, which feeds
the counters that a vLLM server shows on ``/metrics``:

    vllm:kvoffload_transfer_bytes_total{direction}     bytes copied (device_to_host, host_to_device,
                                                       host_to_disk, disk_to_host, host_to_remote,
                                                       remote_to_host: one per handler route, none fixed)
    vllm:kvoffload_transfer_seconds_total{direction}   time spent copying
    vllm:kvoffload_transfer_jobs_total{direction}      copy jobs finished (failed_jobs_total: those that
    failed) vllm:kvoffload_hit_tokens_total                    prompt tokens loaded from kvoffload
    vllm:kvoffload_miss_tokens_total                   prompt tokens looked up but not found
    vllm:kvoffload_failed_load_tokens_total            tokens whose load failed (recomputed)
    vllm:kvoffload_skipped_slow_hit_tokens_total       lower-tier hits recomputed as faster than loading them
    vllm:kvoffload_store_admitted_blocks_total         computed blocks store admission let through
    vllm:kvoffload_store_declined_blocks_total         computed blocks store admission declined (not stored)
    vllm:kvoffload_unanswered_lookups_total            lookups of a shared store (remote, object) that were
                                                       misses as it did not answer (failed, timed out)
    vllm:kvoffload_undeleted_blocks_total              blocks a shared store was asked to delete and did not
                                                       (the delete failed, or was dropped: too many waited)
    vllm:kvoffload_host_used_bytes                     host tier bytes in use, all ranks (gauge)
    vllm:kvoffload_node_pool{counter}                  host_scope node: the shared pool's counters, the same in
                                                       every engine sharing it (gauges: capacity, used (blocks),
                                                       stores, evictions, cross_hits (hits on blocks another
                                                       engine stored), repairs, reclaimed (dead engines),
                                                       attached (engines), busy (lock waits given up)),
                                                       read from the pool when scraped; and served: this
                                                       engine's blocks other engines hit, at its last step
    vllm:kvoffload_tenant_query_tokens_total{tenant}   tenants on (docs/tenants.md): each tenant's prompt tokens
    vllm:kvoffload_tenant_hit_tokens_total{tenant}     looked up, and those loaded from kvoffload
    vllm:kvoffload_tenant_used_bytes{tenant,tier}      each tenant's resident bytes in each tier (gauge)
    vllm:kvoffload_tenant_stored_blocks_total{tenant,tier}   blocks that entered the tier as the tenant's
    vllm:kvoffload_tenant_evicted_blocks_total{tenant,tier}  the tenant's blocks the tier evicted
    vllm:kvoffload_tenant_hit_blocks_total{tenant,tier}      loads of the tenant's blocks the tier held
                                                       (tenant: each tenant named in the quotas, and "other")
    vllm:kvoffload_retention_hints_total{outcome} and vllm:kvoffload_retained_*{tier}: retention hints
                                                       (integrations/vllm/retention_metrics.py)

Names start with ``vllm:`` so that vLLM's own metric clean-up (between engines in one process) covers them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvoffload.blocks import Medium, transfer_name
from kvoffload.config import OffloadConfig
from kvoffload.connector.stats import RetentionFigures, SchedulerStats, TenantFigures, TransferStats
from kvoffload.integrations.vllm.retention_metrics import RetentionMetrics
from kvoffload.tiers.node.index import POOL_COUNTERS
from kvoffload.tiers.node.status import gauges, read_status
from kvoffload.tiers.stack import host_spec, tier_specs, transfer_routes

logger = logging.getLogger(__name__)

TRANSFERS = "transfers"
LOOKUPS = "lookups"
HOST_USED_BYTES = "host_used_bytes"
TENANTS = "tenants"
RETENTION = "retention"
NODE_POOL = "node_pool"
NODE_POOL_PATH = "node_pool_path"
SCRAPE_CACHE_S = 1.0
"""A scrape reads the pool once for all its gauges."""
_LOOKUP_FIELDS = ("requests", "query_tokens", "hit_tokens", "failed_load_tokens", "skipped_slow_tokens",
                  "admitted_blocks", "declined_blocks", "unanswered_lookups", "undeleted_blocks")


@dataclass
class KVOffloadStats(KVConnectorStats):
    """``data`` = {"transfers": {direction: counters}, "lookups": {field: int}, "host_used_bytes": int,
    "node_pool": {counter: int}, "node_pool_path": str}.

    Counters add up across workers and steps; ``host_used_bytes`` and ``node_pool`` are gauges, the latest wins.
    """

    @classmethod
    def of(cls, transfers: TransferStats | None = None, lookups: SchedulerStats | None = None,
           host_used_bytes: int | None = None, node_pool: dict[str, int] | None = None,
           node_pool_path: str | None = None) -> KVOffloadStats:
        data: dict[str, Any] = {}
        if transfers is not None and not transfers.is_empty():
            data[TRANSFERS] = transfers.as_dict()
        if lookups is not None and not lookups.is_empty():
            data[LOOKUPS] = {name: getattr(lookups, name) for name in _LOOKUP_FIELDS}
            if lookups.tenants is not None:
                data[TENANTS] = lookups.tenants.as_dict()
            if lookups.retention is not None:
                data[RETENTION] = lookups.retention.as_dict()
        if host_used_bytes is not None:
            data[HOST_USED_BYTES] = host_used_bytes
        if node_pool:
            data[NODE_POOL] = dict(node_pool)
        if node_pool_path:
            data[NODE_POOL_PATH] = node_pool_path
        return cls(data=data)

    @property
    def transfers(self) -> TransferStats:
        return TransferStats.from_dict(self.data.get(TRANSFERS, {}))

    @property
    def lookups(self) -> SchedulerStats:
        raw = self.data.get(LOOKUPS, {})
        tenants, retention = self.data.get(TENANTS), self.data.get(RETENTION)
        return SchedulerStats(**{name: int(raw.get(name, 0)) for name in _LOOKUP_FIELDS},
                              tenants=None if tenants is None else TenantFigures.from_dict(tenants),
                              retention=None if retention is None else RetentionFigures.from_dict(retention))

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVOffloadStats:
        theirs = other if isinstance(other, KVOffloadStats) else KVOffloadStats(data=dict(other.data))
        gauge = theirs.data.get(HOST_USED_BYTES, self.data.get(HOST_USED_BYTES))
        pool = theirs.data.get(NODE_POOL, self.data.get(NODE_POOL))
        path = theirs.data.get(NODE_POOL_PATH, self.data.get(NODE_POOL_PATH))
        return KVOffloadStats.of(self.transfers.aggregate(theirs.transfers),
                                 self.lookups.aggregate(theirs.lookups), gauge, pool, path)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, c in self.transfers.by_type.items():
            out[f"{name}_bytes"] = c.bytes
            out[f"{name}_GBps"] = round(c.bytes / c.seconds / 1e9, 3) if c.seconds > 0 else 0.0
            out[f"{name}_failed_jobs"] = c.failed_jobs
        lookups = self.lookups
        if lookups.requests:
            out["hit_tokens"] = lookups.hit_tokens
            out["miss_tokens"] = lookups.miss_tokens
            rate = lookups.hit_tokens / lookups.query_tokens if lookups.query_tokens else 0.0
            out["hit_rate"] = round(rate, 3)
        if lookups.declined_blocks:
            out["declined_blocks"] = lookups.declined_blocks
            out["admitted_blocks"] = lookups.admitted_blocks
        for name in ("unanswered_lookups", "undeleted_blocks"):
            if getattr(lookups, name):
                out[name] = getattr(lookups, name)
        if HOST_USED_BYTES in self.data:
            out[HOST_USED_BYTES] = self.data[HOST_USED_BYTES]
        for name, value in self.data.get(NODE_POOL, {}).items():
            out[f"node_pool_{name}"] = value
        return out

    def is_empty(self) -> bool:
        return not self.data


_TRANSFER_COUNTERS = {
    "bytes": ("vllm:kvoffload_transfer_bytes", "Bytes copied by kvoffload, per direction."),
    "seconds": ("vllm:kvoffload_transfer_seconds", "Seconds kvoffload spent copying, per direction."),
    "jobs": ("vllm:kvoffload_transfer_jobs", "kvoffload copy jobs finished, per direction."),
    "failed_jobs": ("vllm:kvoffload_transfer_failed_jobs", "kvoffload copy jobs that failed, per direction."),
}
_TOKEN_COUNTERS = {
    "hit_tokens": ("vllm:kvoffload_hit_tokens", "Prompt tokens loaded from kvoffload instead of computed."),
    "miss_tokens": ("vllm:kvoffload_miss_tokens", "Prompt tokens looked up in kvoffload and not found."),
    "failed_load_tokens": ("vllm:kvoffload_failed_load_tokens", "Tokens whose kvoffload load failed."),
    "skipped_slow_tokens": ("vllm:kvoffload_skipped_slow_hit_tokens",
                            "Tokens a tier below host held but that were recomputed: loading them was slower."),
    "admitted_blocks": ("vllm:kvoffload_store_admitted_blocks",
                        "Computed offload blocks that kvoffload's store admission let through."),
    "declined_blocks": ("vllm:kvoffload_store_declined_blocks",
                        "Computed offload blocks that kvoffload's store admission declined (not stored)."),
    "unanswered_lookups": ("vllm:kvoffload_unanswered_lookups",
                           "Lookups of a shared store that were misses because it did not answer."),
    "undeleted_blocks": ("vllm:kvoffload_undeleted_blocks",
                         "Blocks a shared store was asked to delete and did not (failed, or dropped)."),
}


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    """Registers kvoffload's Prometheus metrics and records each stats payload into them."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._transfer: dict[str, Any] = {
            field: self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, "direction"])
            for field, (name, doc) in _TRANSFER_COUNTERS.items()}
        self._tokens: dict[str, Any] = {
            field: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for field, (name, doc) in _TOKEN_COUNTERS.items()}
        self._host_used: Any = self._gauge_cls(  # type: ignore[call-arg]
            name="vllm:kvoffload_host_used_bytes",
            documentation="Bytes of the kvoffload host tier in use, every rank's pool together.",
            multiprocess_mode="mostrecent", labelnames=labelnames)
        config = _offload_config(vllm_config)
        self._node_pool: Any = None  # registered with the node scope only
        if host_spec(config).shared_by_engines:
            self._node_pool = self._gauge_cls(  # type: ignore[call-arg]
                name="vllm:kvoffload_node_pool",
                documentation="The kvoffload node pool's counters, the same in every engine sharing it.",
                multiprocess_mode="mostrecent", labelnames=[*labelnames, "counter"])
        self._live: dict[int, _PoolReader] = {}  # engines whose pool-wide gauges read the pool at scrape time
        self._tenants = _TenantMetrics(self, labelnames) if config.tenants is not None else None
        self._start_at_zero(transfer_routes(config))
        if self._tenants is not None and config.tenants is not None:
            self._tenants.start_at_zero(self.per_engine_labelvalues.values(), config)
        self._retention = None if config.retention is None else RetentionMetrics(
            self._counter_cls, self._gauge_cls, labelnames)
        if self._retention is not None:
            self._retention.start_at_zero(self.per_engine_labelvalues.values(), config)

    def _start_at_zero(self, routes: Sequence[tuple[Medium, Medium]]) -> None:
        """Create every series that can occur, at 0, so that /metrics lists them before the first event: a
        dashboard must tell "no failed loads" from "not wired"."""
        for labels in self.per_engine_labelvalues.values():
            for metric in self._transfer.values():
                for route in routes:
                    metric.labels(*labels, transfer_name(route))
            for metric in self._tokens.values():
                metric.labels(*labels)
            self._host_used.labels(*labels).set(0)
            for counter in POOL_COUNTERS if self._node_pool is not None else ():
                self._node_pool.labels(*labels, counter).set(0)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        stats = KVOffloadStats(data=transfer_stats_data)
        for direction, counters in stats.transfers.by_type.items():
            for field, metric in self._transfer.items():
                value = getattr(counters, field)
                if value:
                    metric.labels(*labels, direction).inc(value)
        lookups = stats.lookups
        for field, metric in self._tokens.items():
            value = getattr(lookups, field)
            if value > 0:
                metric.labels(*labels).inc(value)
        if HOST_USED_BYTES in stats.data:
            self._host_used.labels(*labels).set(stats.data[HOST_USED_BYTES])
        if self._tenants is not None and lookups.tenants is not None:
            self._tenants.observe(labels, lookups.tenants)
        if self._retention is not None and lookups.retention is not None:
            self._retention.observe(labels, lookups.retention)
        if self._node_pool is not None:
            path = stats.data.get(NODE_POOL_PATH)
            if path and engine_idx not in self._live:
                self._read_at_scrape(engine_idx, labels, path)
            live = engine_idx in self._live
            for counter, value in stats.data.get(NODE_POOL, {}).items():
                if not live or counter == "served":  # served is this engine's own: its latest step says it
                    self._node_pool.labels(*labels, counter).set(value)

    def _read_at_scrape(self, engine_idx: int, labels: list[object], path: str) -> None:
        """Make the pool-wide gauges read the pool itself when /metrics is scraped, so every engine sharing it
        shows the same figures at once. Where the gauges cannot (Prometheus multiprocess mode, Ray), they stay
        the engine's reading at its latest step."""
        reader = _PoolReader(Path(path))
        try:
            for counter in POOL_COUNTERS:
                if counter != "served":
                    self._node_pool.labels(*labels, counter).set_function(functools.partial(reader.read, counter))
        except (AttributeError, ValueError, TypeError) as e:
            logger.info("kvoffload: the node pool gauges show each step's reading (%s)", e)
            return
        self._live[engine_idx] = reader


class _TenantMetrics:
    """The per-tenant series: label values are the tenants named in the quotas and "other" (bounded)."""

    def __init__(self, owner: KVOffloadPromMetrics, labelnames: list[str]) -> None:
        counter = owner._counter_cls
        self.query: Any = counter(name="vllm:kvoffload_tenant_query_tokens",
                             documentation="Prompt tokens each tenant looked up in kvoffload.",
                             labelnames=[*labelnames, "tenant"])
        self.hit: Any = counter(name="vllm:kvoffload_tenant_hit_tokens",
                           documentation="Prompt tokens each tenant loaded from kvoffload.",
                           labelnames=[*labelnames, "tenant"])
        self.used: Any = owner._gauge_cls(  # type: ignore[call-arg]
            name="vllm:kvoffload_tenant_used_bytes", documentation="Each tenant's resident bytes, per tier.",
            multiprocess_mode="mostrecent", labelnames=[*labelnames, "tenant", "tier"])
        self.blocks: list[Any] = [counter(name=f"vllm:kvoffload_tenant_{what}_blocks", documentation=doc,
                               labelnames=[*labelnames, "tenant", "tier"])
                       for what, doc in (("stored", "Blocks that entered each tier as each tenant's."),
                                         ("evicted", "Each tenant's blocks each tier evicted."),
                                         ("hit", "Loads of each tenant's blocks each tier held."))]

    def start_at_zero(self, engines: Any, config: OffloadConfig) -> None:
        tenants = config.tenants
        assert tenants is not None
        names = [*(name for name, _ in tenants.shares), "other"]
        tiers = ["host", *(spec.medium.value for spec in tier_specs(config) if spec.medium.value in _TENANT_TIERS)]
        for labels in engines:
            for name in names:
                self.query.labels(*labels, name)
                self.hit.labels(*labels, name)
                for tier in tiers:
                    self.used.labels(*labels, name, tier).set(0)
                    for metric in self.blocks:
                        metric.labels(*labels, name, tier)

    def observe(self, labels: list[object], figures: TenantFigures) -> None:
        for name, (query, hit) in figures.tokens.items():
            if query:
                self.query.labels(*labels, name).inc(query)
            if hit:
                self.hit.labels(*labels, name).inc(hit)
        for tier, by_name in figures.tiers.items():
            for name, (used, *counts) in by_name.items():
                self.used.labels(*labels, name, tier).set(used)
                for metric, value in zip(self.blocks, counts, strict=True):
                    if value:
                        metric.labels(*labels, name, tier).inc(value)


_TENANT_TIERS = ("disk", "remote", "object")
"""Tiers under host whose index keeps tenants' shares (plug-in tiers' series appear when they report)."""


class _PoolReader:
    """The pool-wide counters of a node pool, read from its files at most once a ``SCRAPE_CACHE_S``."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._at = 0.0
        self._values: dict[str, int] = {}

    def read(self, counter: str) -> float:
        now = time.monotonic()
        if now - self._at >= SCRAPE_CACHE_S:
            self._at = now
            try:
                self._values = gauges(read_status(self._directory))
            except OSError:
                self._values = {}  # the pool was removed: its gauges read 0
        return float(self._values.get(counter, 0))


def _offload_config(vllm_config: Any) -> OffloadConfig:
    """kvoffload's configuration, as the connector reads it (the stat loggers are built beside it)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return OffloadConfig.from_dict(getattr(transfer, "kv_connector_extra_config", None) or {})
