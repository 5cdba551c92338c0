"""Replay with tenants: a multi-tenant trace through the host tier's ``TenantPolicy`` (index/tenants.py), counted
per tenant, beside the same tier without quotas and each tenant alone on a pool of its share.

Three replays of one trace at one capacity C, one eviction policy kind:

- **with quotas**: one tier of C blocks whose policy is ``TenantPolicy`` (the kind inside each tenant's group);
  before each store the request's missed keys are assigned to its tenant (``TenantBook.assign``), as the scheduler
  does, and forgotten after (``clear``);
- **without quotas**: one tier of C blocks and one policy of that kind for every tenant;
- **alone**: each tenant's requests only, on a tier of ``share * C`` blocks (its quota; a tenant not named in the
  quotas: the default share, which it would share with the other tenants not named).

Each tenant's figures are a ``ReplayResult`` of its own requests: hits, stores, evictions of its blocks (whoever's
store evicted them), blocks wasted. A key belongs to the tenant whose request stored it first, as in the book.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from kvoffload.config import EvictionPolicy
from kvoffload.config.values import MAX_TENANTS, tenant_quota
from kvoffload.index.base import EventKind
from kvoffload.index.slot_index import SlotIndex
from kvoffload.index.tenants import SHARED, TenantBook, TenantPolicy, inner_policies
from kvoffload.keys import OffloadKey
from kvoffload.tools.replay.engines import merge
from kvoffload.tools.replay.loop import Counts, load_hits, store_leading
from kvoffload.tools.replay.result import ReplayResult
from kvoffload.tools.replay.trace import Trace

EQUAL = "equal"
"""The ``--tenants`` shorthand: every tenant of the trace named, with an equal share."""


@dataclass(frozen=True)
class Quotas:
    """Tenants' shares of the tier, as ``tenant_quota`` gives them: named tenants in order, and the default share
    that every tenant not named shares with the others not named."""

    names: tuple[str, ...]
    shares: tuple[float, ...]
    default: float

    def share_of(self, tenant: str) -> float:
        """``tenant``'s share: its own if named, else the default."""
        return dict(zip(self.names, self.shares, strict=True)).get(tenant, self.default)

    def policy(self, capacity_blocks: int, kind: EvictionPolicy,
               policy: type[TenantPolicy] = TenantPolicy) -> TenantPolicy:
        """A ``TenantPolicy`` of these shares for a tier of ``capacity_blocks``, ``kind`` inside each group."""
        return policy(capacity_blocks, [*self.shares, self.default], inner_policies(kind, capacity_blocks),
                      TenantBook(self.names))

    def spec(self) -> dict[str, float]:
        """As ``tenant_quota`` takes it (JSON)."""
        return {"default": self.default, **dict(zip(self.names, self.shares, strict=True))}


def tenant_name(tenant: str | None) -> str:
    """The name of a request's tenant (None: the shared tenant, as the book counts it)."""
    return SHARED if tenant is None else tenant


def parse_quotas(text: str, trace: Trace) -> Quotas:
    """The ``--tenants`` value: a JSON mapping as ``tenant_quota`` takes it (``{"default": 0.2, "t0": 0.2}``), or
    ``equal``: every tenant of ``trace`` named with an equal share (the default share then 0: nobody else).

    Raises:
        ValueError: not JSON, a mapping ``tenant_quota`` refuses (the message says why), or ``equal`` on a trace of
            more tenants than ``tenant_quota`` allows.
    """
    if text.strip() == EQUAL:
        names = tuple(tenant_name(t) for t in trace.tenants())
        if len(names) > MAX_TENANTS:
            raise ValueError(f"--tenants {EQUAL}: the trace has {len(names)} tenants; at most {MAX_TENANTS} can be "
                             f"named (give a mapping with a default share for the others)")
        return Quotas(names, tuple(1 / len(names) for _ in names), 0.0)
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--tenants {text!r}: neither {EQUAL!r} nor a JSON mapping ({e.msg})") from None
    try:
        default, named = tenant_quota(mapping)
    except ValueError as e:
        raise ValueError(f"--tenants {text!r}: {e}") from None
    return Quotas(tuple(n for n, _ in named), tuple(s for _, s in named), default)


class TenantReplay(NamedTuple):
    """One replay's figures per tenant (in order of first arrival), and their total."""

    tenants: dict[str, ReplayResult]
    total: ReplayResult


def resident_blocks(result: ReplayResult) -> int:
    """The blocks resident at the end of a replay, or of a tenant's in it (a key is stored again only after it
    left, so every stored block not evicted is still there)."""
    return result.stored_blocks - result.evicted_blocks


def replay_tenants(trace: Trace, capacity_blocks: int, kind: EvictionPolicy = EvictionPolicy.LRU,
                   quotas: Quotas | None = None, policy: type[TenantPolicy] = TenantPolicy) -> TenantReplay:
    """Replay ``trace`` through one tier of ``capacity_blocks``, with ``quotas`` (a ``TenantPolicy`` of ``kind``
    groups) or without (one ``kind`` policy), counting each tenant's requests and blocks apart.

    Args:
        policy: the tenant policy class (tests put a wrong one here to show the comparisons catch it).
    Raises:
        ValueError: ``capacity_blocks`` is not positive.
    """
    if capacity_blocks <= 0:
        raise ValueError(f"replay: capacity {capacity_blocks} blocks must be positive")
    tenant_policy = quotas.policy(capacity_blocks, kind, policy) if quotas is not None else None
    # Not ``tenant_policy or kind``: an empty policy has length 0, and is falsy.
    tier = SlotIndex(capacity_blocks, kind if tenant_policy is None else tenant_policy)
    book = tenant_policy.book if tenant_policy is not None else None
    counts: dict[str, Counts] = {tenant_name(t): Counts() for t in trace.tenants()}
    owner: dict[OffloadKey, str] = {}
    for request in trace.requests:
        tenant = tenant_name(request.tenant)
        mine = counts[tenant]
        hits = load_hits(tier, request, trace.block_tokens, mine)
        missed = request.keys[hits:]
        if missed:
            stored = _store(tier, book, missed, request.tenant, mine)
            owner.update(dict.fromkeys(stored, tenant))
        _count_evictions(tier, owner, counts)
    tier.check_integrity()
    return _results(trace, counts, kind.value if quotas is None else f"{kind.value}+quotas", capacity_blocks)


def _store(tier: SlotIndex, book: TenantBook | None, missed: Sequence[OffloadKey], tenant: str | None,
           counts: Counts) -> tuple[OffloadKey, ...]:
    """Store a request's missed keys as ``tenant``'s (as the scheduler does); count them. Returns the keys stored."""
    if book is not None:
        book.assign(missed, tenant)
    try:
        offered, stored = store_leading(tier, missed)
    finally:
        if book is not None:
            book.clear()
    counts.declined += len(missed) - offered
    counts.stored += len(stored)
    counts.unread.update(stored)
    return stored


def _count_evictions(tier: SlotIndex, owner: dict[OffloadKey, str], counts: dict[str, Counts]) -> None:
    """Count each evicted key against its owner's figures (whoever's store evicted it)."""
    for event in tier.take_events():
        if event.kind is not EventKind.REMOVED:
            continue
        for key in event.keys:
            mine = counts[owner.pop(key)]
            mine.evicted += 1
            if key in mine.unread:
                mine.unread.discard(key)
                mine.wasted += 1


def _results(trace: Trace, counts: dict[str, Counts], strategy: str, capacity_blocks: int) -> TenantReplay:
    parts = {tenant_name(t): trace.of_tenant(t) for t in trace.tenants()}
    # seconds: 0, a tenant's share of one replay's time means nothing; the total's is the replay's own.
    tenants = {name: counts[name].result(part, strategy, "all", capacity_blocks, 0.0)
               for name, part in parts.items()}
    return TenantReplay(tenants, _total(list(tenants.values()), capacity_blocks))


def _total(results: Sequence[ReplayResult], capacity_blocks: int) -> ReplayResult:
    """Every tenant's figures added up, at the tier's capacity (``merge`` adds capacities, meant for split tiers)."""
    return replace(merge(results), capacity_blocks=capacity_blocks)


def alone_capacity(capacity_blocks: int, share: float) -> int:
    """The blocks of a pool of ``share`` of ``capacity_blocks`` (at least one)."""
    return max(1, int(share * capacity_blocks))


def replay_alone(trace: Trace, capacity_blocks: int, quotas: Quotas,
                 kind: EvictionPolicy = EvictionPolicy.LRU) -> dict[str, ReplayResult]:
    """Each tenant's requests only, on a tier of its share of ``capacity_blocks`` with one ``kind`` policy."""
    out = {}
    for tenant in trace.tenants():
        name = tenant_name(tenant)
        capacity = alone_capacity(capacity_blocks, quotas.share_of(name))
        out[name] = replay_tenants(trace.of_tenant(tenant), capacity, kind).tenants[name]
    return out


class TenantRow(NamedTuple):
    """One tenant in the three replays."""

    tenant: str
    share: float
    with_quotas: ReplayResult
    without_quotas: ReplayResult
    alone: ReplayResult

    @property
    def ratio(self) -> float | None:
        """With quotas over alone on its share, in token hit rate (None when alone hits nothing)."""
        alone = self.alone.token_hit_rate
        return self.with_quotas.token_hit_rate / alone if alone else None

    @property
    def ratio_without(self) -> float | None:
        """Without quotas over alone on its share (None when alone hits nothing)."""
        alone = self.alone.token_hit_rate
        return self.without_quotas.token_hit_rate / alone if alone else None


class Comparison(NamedTuple):
    """A multi-tenant trace with quotas, without, and each tenant alone on its share."""

    rows: list[TenantRow]
    with_quotas: ReplayResult
    without_quotas: ReplayResult


def compare_tenants(trace: Trace, capacity_blocks: int, quotas: Quotas, kind: EvictionPolicy = EvictionPolicy.LRU,
                    policy: type[TenantPolicy] = TenantPolicy, use_quotas: bool = True) -> Comparison:
    """The three replays of ``trace`` at ``capacity_blocks``.

    Args:
        policy: the tenant policy class; ``use_quotas``: False replays the "with quotas" side without them (tests
            use both to show the checks catch a wrong or missing rule).
    """
    with_quotas = replay_tenants(trace, capacity_blocks, kind, quotas if use_quotas else None, policy)
    without = replay_tenants(trace, capacity_blocks, kind)
    alone = replay_alone(trace, capacity_blocks, quotas, kind)
    # Named tenants in the quotas' order, then the others as they first arrived.
    order = [n for n in quotas.names if n in alone] + [n for n in alone if n not in quotas.names]
    rows = [TenantRow(name, quotas.share_of(name), with_quotas.tenants[name], without.tenants[name], alone[name])
            for name in order]
    return Comparison(rows, with_quotas.total, without.total)


def isolation_misses(comparison: Comparison, exempt: Sequence[str] = (), floor: float = 0.9) -> list[str]:
    """The tenants (but ``exempt``: the flooding ones) whose hit rate with quotas is below ``floor`` times their
    hit rate alone on a pool of their share: the isolation check. Empty: every tenant kept its share's worth."""
    return [row.tenant for row in comparison.rows
            if row.tenant not in exempt and row.ratio is not None and row.ratio < floor]


def total_gap(comparison: Comparison) -> float:
    """The total token hit rate with quotas minus without: what the quotas cost (negative) when nobody floods."""
    return comparison.with_quotas.token_hit_rate - comparison.without_quotas.token_hit_rate
