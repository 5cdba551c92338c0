"""The scheduler half's tenants (docs/tenants.md): whose each stored block is, each tenant's prompt and hit
tokens, the quota file a running engine re-reads, and the per-tenant figures shipped with the step's stats.

Built only with tenants on (``tenant_by`` not none). The tiers' ``TenantPolicy``s share one ``TenantBook``
(index/tenants.py); this feeds it and reads it, at most a few dict operations per request and per stored block.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvoffload.config import TenantConfig
from kvoffload.config.values import read_tenant_quota
from kvoffload.connector.stats import TenantFigures
from kvoffload.index.tenants import TenantBook

if TYPE_CHECKING:
    from kvoffload.connector.requests import EngineRequest, RequestState
    from kvoffload.keys import OffloadKey

logger = logging.getLogger(__name__)

QUOTA_POLL_S = 1.0
"""How often a running engine looks at its quota file's modification time (one ``stat``)."""


class SchedulerTenants:
    """Who a request's tenant is (``by``), the tiers' shared book, and the figures and quota file around it.

    Args:
        config: the tenants' configuration.
        book: the book every tier's ``TenantPolicy`` was built on.
        block_bytes: bytes of one offload block (a host slot), for resident bytes.
        clock: monotonic seconds (tests drive a fake one).
    """

    def __init__(self, config: TenantConfig, book: TenantBook, block_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.by = config.by
        self.book = book
        self._block_bytes = block_bytes
        self._tokens: dict[str, list[int]] = {}
        self._reported: dict[tuple[str, str], tuple[int, int, int, int]] = {}
        self._quota_file = config.quota_file
        self._clock = clock
        self._next_poll = clock() + QUOTA_POLL_S
        self._mtime = _mtime(config.quota_file) if config.quota_file is not None else None
        self.quota_errors = 0
        """Quota file contents refused since start-up (each logged once, the old quotas kept)."""

    def group_name(self, request: EngineRequest) -> str:
        """The name of the request's group: its tenant if named in the quotas, else "other"."""
        book = self.book
        return book.names[book.group(request.tenant(self.by))]

    def assign(self, keys_by_group: Sequence[Sequence[OffloadKey]],
               owners_by_group: Sequence[Sequence[RequestState]]) -> None:
        """Assign each key of a store about to be prepared to its owner's tenant (per KV-cache group: the keys, and
        the request state each came from)."""
        groups: dict[int, int] = {}
        pending, group = self.book.pending, self.book.group
        for keys, owners in zip(keys_by_group, owners_by_group, strict=True):
            for key, owner in zip(keys, owners, strict=True):
                g = groups.get(id(owner))
                if g is None:
                    g = groups[id(owner)] = group(owner.request.tenant(self.by))
                pending[key] = g

    def count_tokens(self, request: EngineRequest, query_tokens: int, hit_tokens: int) -> None:
        """A lookup of ``query_tokens`` prompt tokens of ``request``, of which ``hit_tokens`` load from here."""
        counts = self._tokens.setdefault(self.group_name(request), [0, 0])
        counts[0] += query_tokens
        counts[1] += hit_tokens

    def poll(self) -> bool:
        """Re-read the quota file if it changed (looked at once a ``QUOTA_POLL_S``); answers whether the quotas
        changed. A file that cannot be read or holds a refused mapping is logged and the old quotas stay."""
        if self._quota_file is None:
            return False
        now = self._clock()
        if now < self._next_poll:
            return False
        self._next_poll = now + QUOTA_POLL_S
        mtime = _mtime(self._quota_file)
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        try:
            default, shares = read_tenant_quota(self._quota_file)
        except ValueError as e:
            self.quota_errors += 1
            logger.error("kvoffload: tenant_quota_file refused, the quotas stay as they were: %s", e)
            return False
        if (default, shares) == self.quotas():
            return False
        self.book.set_quota(default, shares)
        logger.info("kvoffload: tenants' quotas now %s (from %s)", self.describe(), self._quota_file)
        return True

    def quotas(self) -> tuple[float, tuple[tuple[str, float], ...]]:
        """The quotas in force: (default, ((name, fraction), ...))."""
        book = self.book
        return book.shares[-1], tuple(zip(book.names[:-1], book.shares[:-1], strict=True))

    def describe(self) -> str:
        return ", ".join(f"{name} {share:g}" for name, share in zip(self.book.names, self.book.shares, strict=True))

    def take_figures(self) -> TenantFigures | None:
        """What the tenants did since the last call, and each tier's resident bytes per tenant now; None when
        nothing changed (most decode steps)."""
        tokens, self._tokens = self._tokens, {}
        tiers: dict[str, dict[str, list[int]]] = {}
        changed = bool(tokens)
        for tier, by_name in self.book.figures().items():
            out = tiers[tier] = {}
            for name, (resident, counts) in by_name.items():
                now = (resident, counts.stored, counts.evicted, counts.hits)
                before = self._reported.get((tier, name), (-1, 0, 0, 0))
                if now == before:
                    out[name] = [resident * self._block_bytes, 0, 0, 0]
                    continue
                changed = True
                self._reported[(tier, name)] = now
                # A regroup (new quotas) merges or restarts counts: a total below the last report starts afresh.
                out[name] = [resident * self._block_bytes,
                             *(n - b if n >= b else n for n, b in zip(now[1:], before[1:], strict=True))]
        return TenantFigures(tokens, tiers) if changed else None


def _mtime(file: Path) -> int | None:
    try:
        return os.stat(file).st_mtime_ns
    except OSError:
        return None


def make_tenants(config: TenantConfig | None, book: TenantBook | None, block_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> SchedulerTenants | None:
    """The scheduler's tenants, None with tenants off (or an index built without a book)."""
    if config is None or book is None:
        return None
    return SchedulerTenants(config, book, block_bytes, clock)


