"""The replay loop: a trace's requests, in arrival order, through the real host tier index and its policies.

Per request: the admission rule sees its keys (``Admission.looked_up``, as when the engine first looks a request up);
``lookup`` of the longest cached prefix run; ``prepare_load``, ``touch`` and ``complete_load`` of the hit keys (so
the policy sees the use, as in the engine); then the store admission rule (``index/admission.py``) on the missed
keys, and ``prepare_store`` plus ``complete_store(success=True)`` of the leading part it admits. When
``prepare_store`` finds no room (a prompt of more blocks than the tier holds), the largest leading part that fits is
stored: as many distinct keys as the tier has slots, since between requests nothing is pinned or in flight and
every resident block may go.

The two bounds run through the same loop: ``Bound.UNBOUNDED`` is LRU with a slot for every key the trace ever
references (nothing is evicted), ``Bound.OPTIMUM`` is Belady's policy (``optimum.py``) with its bypass as the
admission rule. Neither takes a store admission rule: the bounds are the same whichever rule the policies run with.

Token hits count ``hit blocks * block_tokens``, capped at the request's input length: the last block of a prompt is
usually partial, and a hit on it counts only the tokens it holds. Bytes count whole blocks (a tier slot holds a whole
block), so loaded bytes are ``hit blocks * block_tokens * bytes per token``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence

from kvoffload.config import EvictionPolicy, StoreAdmission
from kvoffload.index.admission import make_admission
from kvoffload.index.base import EventKind
from kvoffload.index.slot_index import SlotIndex
from kvoffload.keys import OffloadKey
from kvoffload.tools.replay.optimum import NextUse, OptimumPolicy, next_uses
from kvoffload.tools.replay.result import ReplayResult
from kvoffload.tools.replay.trace import Request, Trace


class Bound(enum.Enum):
    """The two bounds reported beside every policy."""

    OPTIMUM = "optimum"
    """Belady's offline optimum at the same capacity."""
    UNBOUNDED = "unbounded"
    """Every block ever stored stays: the most any policy or capacity can reach."""


Strategy = EvictionPolicy | Bound

Admit = Callable[[Sequence[OffloadKey]], int]
"""How many leading keys of a request's missed blocks to store."""


def replay(trace: Trace, capacity_blocks: int, strategy: Strategy = EvictionPolicy.LRU,
           admission: StoreAdmission = StoreAdmission.ALL, future: NextUse | None = None,
           optimum: type[OptimumPolicy] = OptimumPolicy) -> ReplayResult:
    """Replay ``trace`` through a host tier of ``capacity_blocks`` slots.

    Args:
        trace: the requests, in arrival order.
        capacity_blocks: tier capacity in blocks of ``trace.block_tokens`` (ignored by ``Bound.UNBOUNDED``).
        strategy: an eviction policy, or one of the bounds.
        admission: the store admission rule the policy runs behind (the bounds ignore it).
        future: ``next_uses(trace)`` when the caller has it already (the optimum needs it; built here otherwise,
            and its time counted in the result's).
        optimum: the offline policy ``Bound.OPTIMUM`` runs (tests put a wrong one here to show they catch it).
    Raises:
        ValueError: ``capacity_blocks`` is not positive.
    """
    start = time.perf_counter()
    if isinstance(strategy, Bound):
        admission = StoreAdmission.ALL
    if strategy is Bound.UNBOUNDED:
        capacity_blocks = max(1, trace.distinct_keys())
    if capacity_blocks <= 0:
        raise ValueError(f"replay: capacity {capacity_blocks} blocks must be positive")
    counts = Counts()
    if strategy is Bound.OPTIMUM:
        future = future or next_uses(trace)
        tier: SlotIndex = _replay_optimum(trace, capacity_blocks, optimum(future), future, counts)
    else:
        tier = SlotIndex(capacity_blocks, strategy if isinstance(strategy, EvictionPolicy)
                               else EvictionPolicy.LRU)
        rule = make_admission(admission, capacity_blocks, tier.host_policy)
        for request in trace.requests:
            if rule.watches_lookups:
                rule.looked_up(request.keys)
            _step(tier, request, trace.block_tokens, rule.admit, counts)
    tier.check_integrity()
    return counts.result(trace, strategy.value, admission.value, capacity_blocks, time.perf_counter() - start)


def _replay_optimum(trace: Trace, capacity_blocks: int, oracle: OptimumPolicy, future: NextUse,
                    counts: Counts) -> SlotIndex:
    tier = SlotIndex(capacity_blocks, oracle)

    def admit(keys: Sequence[OffloadKey]) -> int:
        return oracle.bypass(keys, capacity_blocks - tier.usage()[0].used_blocks)

    for request, after in zip(trace.requests, future.after, strict=True):
        oracle.advance(request.keys, after)
        _step(tier, request, trace.block_tokens, admit, counts)
    return tier


class Counts:
    """Running totals of one replay (or of one tenant's requests in it); ``unread`` holds the stored keys no lookup
    has hit yet."""

    __slots__ = ("declined", "evicted", "hit_blocks", "hit_tokens", "stored", "unread", "wasted")

    def __init__(self) -> None:
        self.hit_tokens = self.hit_blocks = self.stored = self.declined = self.evicted = self.wasted = 0
        self.unread: set[OffloadKey] = set()

    def result(self, trace: Trace, strategy: str, admission: str, capacity_blocks: int,
               seconds: float) -> ReplayResult:
        return ReplayResult(
            strategy=strategy, admission=admission, capacity_blocks=capacity_blocks,
            block_tokens=trace.block_tokens, requests=len(trace.requests), input_tokens=trace.input_tokens,
            hit_tokens=self.hit_tokens, blocks=trace.block_refs, hit_blocks=self.hit_blocks,
            stored_blocks=self.stored, declined_blocks=self.declined, evicted_blocks=self.evicted,
            wasted_blocks=self.wasted, unread_blocks=len(self.unread), seconds=seconds)


def _step(tier: SlotIndex, request: Request, block_tokens: int, admit: Admit, counts: Counts) -> None:
    hits = load_hits(tier, request, block_tokens, counts)
    missed = request.keys[hits:]
    if missed:
        offered, stored = store_leading(tier, missed[:admit(missed)])
        counts.declined += len(missed) - offered
        counts.stored += len(stored)
        counts.unread.update(stored)
    unread = counts.unread
    for event in tier.take_events():
        if event.kind is EventKind.REMOVED:
            counts.evicted += len(event.keys)
            before = len(unread)
            unread.difference_update(event.keys)
            counts.wasted += before - len(unread)


def load_hits(tier: SlotIndex, request: Request, block_tokens: int, counts: Counts) -> int:
    """Look ``request`` up and load its leading run of hits, as the engine does; count them. Returns the hits."""
    keys = request.keys
    hits = tier.lookup(keys).hits
    if hits:
        loaded = keys[:hits]
        tier.prepare_load(loaded)
        tier.touch(loaded)
        tier.complete_load(loaded)
        counts.unread.difference_update(loaded)
        counts.hit_blocks += hits
        counts.hit_tokens += min(hits * block_tokens, request.input_length)
    return hits


def store_leading(tier: SlotIndex, keys: Sequence[OffloadKey]) -> tuple[int, tuple[OffloadKey, ...]]:
    """Store ``keys``, or the largest leading part that fits. Returns how many leading keys were offered to the
    tier and the keys it stored (those it held already are left out)."""
    if not keys:
        return 0, ()
    offered = len(keys)
    out = tier.prepare_store(keys)
    if out is None:
        offered = _leading_distinct(keys, tier.capacity)
        out = tier.prepare_store(keys[:offered])
        if out is None:
            return 0, ()
    tier.complete_store(out.keys_to_store, success=True)
    return offered, out.keys_to_store


def _leading_distinct(keys: Sequence[OffloadKey], limit: int) -> int:
    """The length of the longest leading part of ``keys`` with at most ``limit`` distinct keys."""
    seen: set[OffloadKey] = set()
    for count, key in enumerate(keys):
        seen.add(key)
        if len(seen) > limit:
            return count
    return len(keys)
