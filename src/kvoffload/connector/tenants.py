"""The scheduler half's tenants (docs/tenants.md): whose each stored block is, each tenant's prompt and hit
tokens, the quota file a running engine re-reads (on a thread of its own: no file I/O in the engine step), and the
per-tenant figures shipped with the step's stats.

Built only with tenants on (``tenant_by`` not none). The tiers' ``TenantPolicy``s share one ``TenantBook``
(index/tenants.py); this feeds it and reads it, at most a few dict operations per request and per stored block.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
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
"""How often the quota file's watcher looks at its modification time (one ``stat``, on its own thread)."""


class SchedulerTenants:
    """Who a request's tenant is (``by``), the tiers' shared book, and the figures and quota file around it.

    Args:
        config: the tenants' configuration.
        book: the book every tier's ``TenantPolicy`` was built on.
        block_bytes: bytes of one offload block (a host slot), for resident bytes.
    """

    def __init__(self, config: TenantConfig, book: TenantBook, block_bytes: int) -> None:
        self.by = config.by
        self.book = book
        self._block_bytes = block_bytes
        self._tokens: dict[str, list[int]] = {}
        self._reported: dict[tuple[str, str], tuple[int, int, int, int]] = {}
        self.quota_file = None if config.quota_file is None else QuotaFile(config.quota_file)
        """The quota file's watcher (``tenant_quota_file``; None: quotas fixed at start-up)."""

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
        """Apply quotas the quota file's watcher read since the last call (no I/O here: the watcher's thread stats
        and reads the file); answers whether the quotas changed."""
        if self.quota_file is None:
            return False
        quota = self.quota_file.take()
        if quota is None or quota == self.quotas():
            return False
        default, shares = quota
        self.book.set_quota(default, shares)
        logger.info("kvoffload: tenants' quotas now %s (from %s)", self.describe(), self.quota_file.path)
        return True

    def close(self) -> None:
        if self.quota_file is not None:
            self.quota_file.close()

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


class QuotaFile:
    """Watches ``tenant_quota_file`` off the engine step: a daemon thread looks at its modification time once a
    ``QUOTA_POLL_S`` and reads it when it changed; the step takes what it read (``take``). A file that cannot be
    read or holds a refused mapping is logged and counted (``errors``), and nothing is taken: the quotas stay.

    Args:
        path: the file (read valid at start-up by the configuration's parser).
        start: run the thread (tests call ``check`` themselves instead).
    """

    def __init__(self, path: Path, start: bool = True) -> None:
        self.path = path
        self.errors = 0
        self._mtime = _mtime(path)
        self._lock = threading.Lock()  # guards _read, between the thread and the step
        self._looking = threading.Lock()
        self._read: tuple[float, tuple[tuple[str, float], ...]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._watch, name="kvoffload-quota-file", daemon=True)
            self._thread.start()

    def check(self) -> None:
        """Read the file if its modification time changed since the last look (the thread's step; one look at a
        time, so a change is read and counted once)."""
        with self._looking:
            mtime = _mtime(self.path)
            if mtime == self._mtime:
                return
            self._mtime = mtime
            try:
                quota = read_tenant_quota(self.path)
            except ValueError as e:
                self.errors += 1
                logger.error("kvoffload: tenant_quota_file refused, the quotas stay as they were: %s", e)
                return
        with self._lock:
            self._read = quota

    def take(self) -> tuple[float, tuple[tuple[str, float], ...]] | None:
        """The latest quotas read since the last call, else None."""
        with self._lock:
            quota, self._read = self._read, None
        return quota

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(QUOTA_POLL_S):
            self.check()


def _mtime(file: Path) -> int | None:
    try:
        return os.stat(file).st_mtime_ns
    except OSError:
        return None


def make_tenants(config: TenantConfig | None, book: TenantBook | None, block_bytes: int
                 ) -> SchedulerTenants | None:
    """The scheduler's tenants, None with tenants off (or an index built without a book)."""
    if config is None or book is None:
        return None
    return SchedulerTenants(config, book, block_bytes)
