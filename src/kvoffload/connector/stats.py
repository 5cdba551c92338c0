"""Counters the connector halves keep for users: transfer bytes and time per direction, hit and miss tokens.

Both kinds are reset on read (``take``) and add up across workers and steps (``aggregate``), so an engine can
ship them each step and a metrics exporter can sum them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvoffload.blocks import transfer_name
from kvoffload.transfer.base import TransferResult


@dataclass
class TransferCounters:
    jobs: int = 0
    failed_jobs: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, other: TransferCounters) -> None:
        self.jobs += other.jobs
        self.failed_jobs += other.failed_jobs
        self.bytes += other.bytes
        self.seconds += other.seconds


@dataclass
class TransferStats:
    """Per transfer type (``"device_to_host"``, ``"host_to_device"``, ...)."""

    by_type: dict[str, TransferCounters] = field(default_factory=dict)

    def record(self, result: TransferResult) -> None:
        c = self.by_type.setdefault(transfer_name(result.transfer_type), TransferCounters())
        c.jobs += 1
        c.failed_jobs += not result.success
        c.bytes += result.bytes
        c.seconds += result.seconds

    def aggregate(self, other: TransferStats) -> TransferStats:
        merged = TransferStats()
        for stats in (self, other):
            for name, c in stats.by_type.items():
                merged.by_type.setdefault(name, TransferCounters()).add(c)
        return merged

    def is_empty(self) -> bool:
        return not self.by_type

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {name: vars(c).copy() for name, c in self.by_type.items()}

    @classmethod
    def from_dict(cls, raw: dict[str, dict[str, float]]) -> TransferStats:
        return cls({name: TransferCounters(int(c["jobs"]), int(c["failed_jobs"]), int(c["bytes"]),
                                           float(c["seconds"])) for name, c in raw.items()})


@dataclass
class TenantFigures:
    """What the tenants did since the last ``take``, per group name ("other" for every tenant not named).

    ``tokens``: name -> [prompt tokens looked up, tokens loaded from kvoffload]; ``tiers``: tier -> name ->
    [resident bytes (now), blocks stored, blocks evicted, hits on resident blocks (since the last take)].
    """

    tokens: dict[str, list[int]] = field(default_factory=dict)
    tiers: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, dict[str, object]]:
        return {"tokens": {k: list(v) for k, v in self.tokens.items()},
                "tiers": {t: {k: list(v) for k, v in by.items()} for t, by in self.tiers.items()}}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TenantFigures:
        """What ``as_dict`` made (shipped between processes as plain data)."""
        tokens, tiers = raw.get("tokens", {}), raw.get("tiers", {})
        return cls({str(k): [int(x) for x in v] for k, v in tokens.items()},
                   {str(t): {str(k): [int(x) for x in v] for k, v in by.items()} for t, by in tiers.items()})

    def aggregate(self, other: TenantFigures) -> TenantFigures:
        """Token counts add up; tiers' resident bytes are the latest, their counts add up."""
        tokens = {k: list(v) for k, v in self.tokens.items()}
        for name, (query, hit) in other.tokens.items():
            mine = tokens.setdefault(name, [0, 0])
            mine[0] += query
            mine[1] += hit
        tiers = {t: {k: list(v) for k, v in by.items()} for t, by in self.tiers.items()}
        for tier, by in other.tiers.items():
            for name, (resident, stored, evicted, hits) in by.items():
                mine = tiers.setdefault(tier, {}).setdefault(name, [0, 0, 0, 0])
                mine[:] = [resident, mine[1] + stored, mine[2] + evicted, mine[3] + hits]
        return TenantFigures(tokens, tiers)


@dataclass
class RetentionFigures:
    """Retention hints since the last ``take`` (docs/sessions.md).

    ``hints``: [received, capped to ``max_retain_s``, ignored as bad]; ``tiers``: tier -> [retained bytes (now),
    hits on retained blocks, retained blocks made ordinary as the tier's retained share was full, retained blocks
    evicted (since the last take)].
    """

    hints: list[int] = field(default_factory=lambda: [0, 0, 0])
    tiers: dict[str, list[int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {"hints": list(self.hints), "tiers": {t: list(v) for t, v in self.tiers.items()}}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RetentionFigures:
        """What ``as_dict`` made (shipped between processes as plain data)."""
        return cls([int(x) for x in raw.get("hints", [0, 0, 0])][:3],
                   {str(t): [int(x) for x in v][:4] for t, v in raw.get("tiers", {}).items()})

    def aggregate(self, other: RetentionFigures) -> RetentionFigures:
        """Hints and counts add up; retained bytes are the latest."""
        tiers = {t: list(v) for t, v in self.tiers.items()}
        for tier, (retained, *counts) in other.tiers.items():
            mine = tiers.setdefault(tier, [0, 0, 0, 0])
            mine[:] = [retained, *(a + b for a, b in zip(mine[1:], counts, strict=True))]
        return RetentionFigures([a + b for a, b in zip(self.hints, other.hints, strict=True)], tiers)


@dataclass
class SchedulerStats:
    """Prefix tokens asked for beyond the engine's own cache (``query_tokens``) and served by kvoffload; offload
    blocks that store admission let through or declined."""

    requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    failed_load_tokens: int = 0
    skipped_slow_tokens: int = 0
    """Tokens a lower tier held but that were recomputed, as loading them was expected to be slower."""
    admitted_blocks: int = 0
    """Offload blocks a request computed that store admission let through (the index still skips those it
    holds); every one with ``store_admission: all``. Counted per block of tokens, not per KV-cache group."""
    declined_blocks: int = 0
    """Offload blocks a request computed that store admission declined: not stored."""
    unanswered_lookups: int = 0
    """Lookups of a shared store (remote, object) that were misses because it did not answer: it failed or timed
    out, the search passed its deadline or was refused while too many were open, or the tier was switched off
    after failures (its breaker)."""
    undeleted_blocks: int = 0
    """Blocks of this engine's a shared store was asked to delete but did not (the delete failed, or was dropped
    while too many waited): the store's own expiry removes them."""
    tenants: TenantFigures | None = None
    """With tenants on, what each tenant did (``connector.tenants``); None: tenants off, or nothing changed."""
    retention: RetentionFigures | None = None
    """With hints on, hints and retained blocks (``connector.retention``); None: hints off, or nothing changed."""

    @property
    def miss_tokens(self) -> int:
        return self.query_tokens - self.hit_tokens

    def is_empty(self) -> bool:
        """Nothing counted: a step without lookups may still count failed loads, skipped slow hits or stores."""
        # Spelled out: every decode step asks, and a loop over dataclasses.fields() costs microseconds.
        return not (self.requests or self.query_tokens or self.hit_tokens or self.failed_load_tokens
                    or self.skipped_slow_tokens or self.admitted_blocks or self.declined_blocks
                    or self.unanswered_lookups or self.undeleted_blocks or self.tenants is not None
                    or self.retention is not None)

    def take(self) -> SchedulerStats:
        """What was counted, moved into a new object (the caller owns it); this one starts again from zero and
        stays the one that the scheduler half's parts count into."""
        taken = SchedulerStats(self.requests, self.query_tokens, self.hit_tokens, self.failed_load_tokens,
                               self.skipped_slow_tokens, self.admitted_blocks, self.declined_blocks,
                               self.unanswered_lookups, self.undeleted_blocks, self.tenants, self.retention)
        self.tenants = self.retention = None
        self.requests = self.query_tokens = self.hit_tokens = self.failed_load_tokens = 0
        self.skipped_slow_tokens = self.admitted_blocks = self.declined_blocks = 0
        self.unanswered_lookups = self.undeleted_blocks = 0
        return taken

    def aggregate(self, other: SchedulerStats) -> SchedulerStats:
        return SchedulerStats(self.requests + other.requests, self.query_tokens + other.query_tokens,
                              self.hit_tokens + other.hit_tokens,
                              self.failed_load_tokens + other.failed_load_tokens,
                              self.skipped_slow_tokens + other.skipped_slow_tokens,
                              self.admitted_blocks + other.admitted_blocks,
                              self.declined_blocks + other.declined_blocks,
                              self.unanswered_lookups + other.unanswered_lookups,
                              self.undeleted_blocks + other.undeleted_blocks,
                              _merged(self.tenants, other.tenants), _merged(self.retention, other.retention))


Figures = TypeVar("Figures", TenantFigures, RetentionFigures)


def _merged(a: Figures | None, b: Figures | None) -> Figures | None:
    if a is None or b is None:
        return a or b
    return a.aggregate(b)

