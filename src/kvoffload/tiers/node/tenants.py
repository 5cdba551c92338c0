"""Tenants' shares in the node pool: one engine's side of the shared index's tenant table (``_nodeindex.c``).

The pool has one table for every engine sharing it: up to 16 named tenants and "other", each with its share of
the whole pool, and the shared index evicts by index/tenants.py's rule over every engine's blocks. Who sets it
(docs/node.md, "Tenants"): the first engine with tenants on that finds the pool without a table writes its
``tenant_quota``; an engine whose ``tenant_quota`` differs logs a warning and the pool's table counts (a second
engine cannot take a running pool's shares from the first by restarting); ``NodeIndex.set_tenant_shares`` rewrites
it for every engine at once. A table the index found damaged is reset to none, and each engine with tenants on
writes back, at its next look (``RECLAIM_S``), the table it last saw in the pool (else its ``tenant_quota``).

Each engine's ``NodeTenants`` is the node pool's tier on the scheduler's ``TenantBook`` (``TenantTier``): the
scheduler assigns the keys of each store there, a key nobody assigned has the group it has in a tier below (a
promoted block) or is the shared tenant's, and the book's groups map to the table's positions by name: a tenant
the engine names but the pool does not counts as "other" in the pool. An engine with tenants off stores for the
shared tenant. New quotas in the book (``TenantBook.set_quota``: the quota file) are written into the pool
(``regroup``), again at each look until the index's lock lets them in.

Names are kept in 64 bytes (UTF-8): a longer name as its first 48 bytes and a 16-byte BLAKE2b hash of the whole,
so two names collide only when their hashes do; the counts show such a name as its prefix and the hash.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload import _nodeindex
from kvoffload.config import TenantConfig
from kvoffload.index.tenant_book import OTHER, SHARED, TenantBook, TenantCounts
from kvoffload.keys import OffloadKey

logger = logging.getLogger(__name__)

_PREFIX_BYTES = 48
"""Of a name over ``_nodeindex.TENANT_NAME`` bytes, what is kept as it is (the rest of the entry is its hash)."""

Call = Callable[..., Any]
"""``NodeIndex._call``: an operation on the shared index with a default when it cannot run."""


def name_bytes(name: str) -> tuple[bytes, bool]:
    """``name`` as the table keeps it, and whether that is a prefix and hash."""
    raw = name.encode()
    if len(raw) <= _nodeindex.TENANT_NAME:
        return raw, False
    return raw[:_PREFIX_BYTES] + hashlib.blake2b(raw, digest_size=_nodeindex.TENANT_NAME - _PREFIX_BYTES).digest(), True


def share_of(fraction: float) -> int:
    """A fraction of the pool in the table's millionths."""
    return min(max(round(fraction * _nodeindex.SHARE_ONE), 0), _nodeindex.SHARE_ONE)


def shown(name: bytes, hashed: bool, known: Sequence[str] = ()) -> str:
    """A table name as text: a hashed one as the name it was made from when ``known`` has it, else prefix~hash."""
    if not hashed:
        return name.decode(errors="replace")
    for candidate in known:
        if name_bytes(candidate) == (name, True):
            return candidate
    return f"{name[:_PREFIX_BYTES].decode(errors='ignore')}~{name[_PREFIX_BYTES:].hex()[:16]}"


@dataclass(frozen=True)
class Table:
    """A tenant table as the index keeps it: the named tenants' (name bytes, hashed, share) in order, and
    "other"'s share; shares in millionths of the pool."""

    named: tuple[tuple[bytes, bool, int], ...]
    other: int

    @classmethod
    def of(cls, names: Sequence[str], default: float, shares: Sequence[float]) -> Table:
        if len(names) != len(shares):
            raise ValueError(f"set_tenant_shares: {len(names)} names for {len(shares)} shares")
        if any(not name or name == OTHER for name in names):
            raise ValueError(f'set_tenant_shares: a tenant name is empty or "{OTHER}" (give its share as default)')
        return cls(tuple((*name_bytes(name), share_of(share)) for name, share in zip(names, shares, strict=True)),
                   share_of(default))

    @classmethod
    def of_config(cls, config: TenantConfig) -> Table:
        return cls.of([n for n, _ in config.shares], config.default, [s for _, s in config.shares])

    @classmethod
    def of_pool(cls, entries: Sequence[tuple[Any, ...]]) -> Table:
        """The table of ``_nodeindex.tenants``' entries."""
        other = _nodeindex.OTHER
        return cls(tuple((name, hashed, share) for position, name, hashed, share, *_ in entries if position != other),
                   next((e[3] for e in entries if e[0] == other), 0))

    def describe(self, known: Sequence[str] = ()) -> str:
        one = _nodeindex.SHARE_ONE
        parts = [f"{shown(name, hashed, known)}: {share / one:g}" for name, hashed, share in self.named]
        return "{" + ", ".join([*parts, f"default: {self.other / one:g}"]) + "}"


class NodeTenants:
    """One engine's view of the pool's tenant table: what it offers, and each stored key's table position.

    Args:
        config: this engine's ``tenant_quota`` (None: tenants off: it offers no table and stores for the shared
            tenant).
        book: the book the scheduler assigns stores in (made from ``config`` when None and tenants are on).
    """

    tier = "host"

    def __init__(self, config: TenantConfig | None, book: TenantBook | None = None, remember: int = 1 << 20
                 ) -> None:
        self.book = book if book is not None or config is None else TenantBook.of_config(config)
        if self.book is not None:
            self.book.policies.append(self)
        self._of: dict[OffloadKey, int] = {}
        """The groups of the keys this engine stored, the latest ``remember`` of them (the pool keeps no keys'
        groups an engine can read): a block written below from the pool keeps its tenant."""
        self._remember = remember
        self.writer: Callable[[Sequence[str], Table], bool] | None = None
        """Writes a table into the pool (``NodeIndex`` sets it); None: this view is not attached."""
        self._wanted: tuple[tuple[str, ...], Table] | None = None
        """New quotas from the book not yet written (the lock was busy): written at the next look."""
        self._mapped: tuple[str, ...] = ()  # the book's names ``_positions`` was made for
        self._own = Table.of_config(config) if config is not None else None
        """This engine's ``tenant_quota``."""
        self._offer = self._own
        self._names: tuple[str, ...] = ()  # the names of the last set_shares
        """What this engine writes into a pool without a table: the pool's table as last seen, else its own."""
        self._generation = -1
        self._on = False
        self._entries: list[tuple[Any, ...]] = []
        self._positions: bytes = b""  # the book's group -> table position
        self._shared = _nodeindex.OTHER  # the shared tenant's position (an engine without a book stores for it)

    @property
    def on(self) -> bool:
        """Whether the pool had a tenant table when last read."""
        return self._on

    def join(self, call: Call, mine: tuple[Any, ...]) -> None:
        """At attach: write this engine's table into a pool that has none; warn when the pool's differs."""
        self.refresh(call, mine)
        pool = Table.of_pool(self._entries)
        if self._own is not None and self._on and (set(pool.named), pool.other) != (set(self._own.named),
                                                                                    self._own.other):
            logger.warning("node tier: the node pool's tenant shares %s differ from this engine's tenant_quota %s; "
                           "the pool's count (set by the first engine, or by set_tenant_shares)",
                           pool.describe(self._known()), self._own.describe(self._known()))
        elif self._own is None and self._on:
            logger.info("node tier: the node pool has tenant shares %s; this engine (tenants off) stores for the "
                        "tenant %s", pool.describe(), SHARED)

    def refresh(self, call: Call, mine: tuple[Any, ...]) -> None:
        """Read the pool's table (once a ``RECLAIM_S``); write the offered one when the pool has none."""
        segment = mine[0]
        generation, on, entries = call(_nodeindex.tenants, (self._generation, self._on, self._entries), segment)
        if not on and self._offer is not None:
            if call(_nodeindex.set_tenants, False, *mine, list(self._offer.named), self._offer.other, False):
                logger.info("node tier: wrote the tenant shares %s into the node pool (it had none: new, or reset "
                            "after damage)", self._offer.describe(self._known()))
            generation, on, entries = call(_nodeindex.tenants, (generation, on, entries), segment)
        if generation != self._generation or on != self._on:
            self._learn(generation, on, entries)
        if self._wanted is not None:
            self._write_wanted()

    @property
    def of(self) -> dict[OffloadKey, int]:
        return self._of

    @property
    def written(self) -> bool:
        """Whether the book's latest quotas are in the pool (False: waiting for the index's lock)."""
        return self._wanted is None

    def regroup(self, mapping: Sequence[int]) -> None:
        """The book's quotas changed: remap the remembered keys, and write the new table into the pool."""
        of = self._of
        for key, group in of.items():
            of[key] = mapping[group]
        book = self.book
        assert book is not None
        names = book.names[:-1]
        self._wanted = (names, Table.of(names, book.shares[-1], book.shares[:-1]))
        self._write_wanted()

    def _write_wanted(self) -> None:
        wanted, self._wanted = self._wanted, None  # taken first: the write reads the table back (``refresh``)
        if wanted is None or self.writer is None:
            self._wanted = wanted
            return
        if not self.writer(*wanted):
            self._wanted = wanted

    def figures(self) -> dict[str, tuple[int, TenantCounts]]:
        """The pool's counts per tenant as last read (every engine's blocks): resident, stores, evictions."""
        return {name: (c["resident"], TenantCounts(c["stores"], c["evictions"]))
                for name, c in self.counts().items()} if self._on else {}

    def set_shares(self, call: Call, mine: tuple[Any, ...], names: Sequence[str], table: Table) -> bool:
        """Rewrite the pool's table to ``table`` (of ``names``): every engine's shares at once; whether it was
        written (False: this engine left the pool, or another held the index's lock past the wait)."""
        written = bool(call(_nodeindex.set_tenants, False, *mine, list(table.named), table.other, True))
        if written:
            self._offer = table
            self._names = tuple(names)
            self._generation = -1
            self.refresh(call, mine)
        return written

    def positions(self, keys: Sequence[OffloadKey]) -> bytes:
        """Each key's table position for ``reserve`` (empty when the pool has no table: the plain sweep)."""
        if not self._on:
            return b""
        book = self.book
        if book is None:
            return bytes((self._shared,)) * len(keys)
        if self._mapped != book.names:
            self._map(book)  # new quotas in the book, not yet in the pool: their names map to "other" there
        positions, of, group_of = self._positions, self._of, book.new_key_group
        out = bytearray(len(keys))
        for i, key in enumerate(keys):
            group = of.pop(key, None)
            if group is None:
                group = group_of(key, self)
            of[key] = group  # most recent last
            out[i] = positions[group]
        while len(of) > self._remember:
            del of[next(iter(of))]
        return bytes(out)

    def counts(self) -> dict[str, dict[str, int]]:
        """Per tenant of the pool's table (as last read): resident blocks, stores and evictions."""
        known = self._known()
        return {shown(name, hashed, known): {"resident": resident, "stores": stores, "evictions": evictions}
                for _, name, hashed, _, resident, stores, evictions in self._entries}

    def read(self, call: Call, segment: Any) -> None:
        """Re-read the table's counts now (the gauges), without writing anything."""
        generation, on, entries = call(_nodeindex.tenants, (self._generation, self._on, self._entries), segment)
        if generation != self._generation or on != self._on:
            self._learn(generation, on, entries)
        else:
            self._entries = list(entries)

    def _learn(self, generation: int, on: bool, entries: list[tuple[Any, ...]]) -> None:
        self._generation, self._on, self._entries = generation, on, list(entries)
        where = {(name, hashed): position for position, name, hashed, *_ in entries}
        other = _nodeindex.OTHER
        self._shared = where.get(name_bytes(SHARED), other)
        if self.book is not None:
            self._map(self.book)
        if on and self._offer is not None:
            self._offer = Table.of_pool(entries)  # what counts in the pool is what this engine restores

    def _map(self, book: TenantBook) -> None:
        """Each of the book's groups' table position (a name the pool lacks: "other")."""
        other = _nodeindex.OTHER
        where = {(name, hashed): position for position, name, hashed, *_ in self._entries}
        self._positions = bytes([where.get(name_bytes(name), other) if name != OTHER else other
                                 for name in book.names])
        self._mapped = book.names

    def _known(self) -> list[str]:
        """Names this engine knows in full (to show a hashed long name as itself)."""
        return [*self._names, *(self.book.names if self.book is not None else ())]
