"""Retention hints (docs/sessions.md): a request may ask that its blocks stay for a while, and every tier keeps
them after its other blocks until then.

``RetentionBook`` holds the deadlines the scheduler was given: a key's deadline is when the latest hint that named
it runs out (``hold``: a hinted request's prompt keys at its first lookup, its keys again when it finishes:
connector/retention.py). Every tier that honours hints wraps its policy in a ``RetainPolicy`` on the book
(index/tier_policies.py; with tenants on, one per tenant, inside the tenant's share) or, like the node pool, keeps
deadlines of its own, and registers with the book as a ``RetainTier``.

``RetainPolicy``'s rule: a resident key whose deadline has not passed is *retained*: the inner policy does not see
it, so every unretained key of the tier (of the tenant, with tenants on) goes first, in the inner policy's order;
retained keys then go oldest deadline first. A tier's retained keys are capped (``share`` of what the policy is
sized for): one over the cap makes the key with the longest hint ordinary (of equal hints, the oldest deadline's:
``_demote`` says why). A key whose deadline passes joins the inner policy as if stored then (its use before the
pause is not remembered: the hint stood for it). With no deadline given, every call goes straight to the inner
policy: the order is the inner policy's, key for key.

Deadlines are seconds on ``time.monotonic`` (CLOCK_MONOTONIC, the same for every process of a machine: the node
pool keeps them in its shared index); replay passes the trace's clock.

Costs: with nothing retained, one attribute test per call on top of the inner policy's. With keys retained, a dict
lookup per key in C for a batch of keys none of which is held (``insert_all``, ``touch_all``: the rest go to the
inner policy in one call), two heap pushes per retained key (deadline order, demotion order); ``victims`` asks
the inner policy as if nothing were retained, and takes from retained keys only when it cannot give the run (then
O(retained keys)). Bounds: the book's deadlines are capped at ``MAX_DEADLINES`` (the oldest go first), each
tier's retained keys by its cap.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import filterfalse
from typing import Protocol

from kvoffload.index.base import IntegrityError
from kvoffload.index.policies.base import CanEvict, Policy, counting
from kvoffload.keys import OffloadKey

MAX_DEADLINES = 4_000_000
"""The most keys the book keeps deadlines for (about 0.5 GB at worst); beyond it the oldest deadlines are dropped
(their keys stay retained where they are until their tiers' own deadlines pass)."""

Clock = Callable[[], float]


@dataclass
class RetainCounts:
    """One tier's retention figures so far: ``hits`` uses of retained keys, ``demoted`` retained keys made ordinary
    because the tier's retained share was full, ``evicted`` retained keys evicted (every unretained key had gone)."""

    hits: int = 0
    demoted: int = 0
    evicted: int = 0

    def add(self, other: RetainCounts) -> None:
        self.hits += other.hits
        self.demoted += other.demoted
        self.evicted += other.evicted


class RetainTier(Protocol):
    """A tier keeping retained keys on a ``RetentionBook``."""

    tier: str
    """The tier's name in figures ("host", "disk", ...)."""

    def retain(self, keys: Sequence[OffloadKey]) -> None:
        """The book has new deadlines for ``keys``: those resident here become (or stay) retained."""
        ...

    def retained(self) -> int:
        """Retained keys now (expired ones not counted)."""
        ...

    def counts(self) -> RetainCounts:
        """The tier's figures so far."""
        ...


class RetentionBook:
    """The deadlines of held keys, shared by every tier honouring hints.

    Args:
        share: the fraction of each tier (of each tenant's share, with tenants on) that retained keys may hold.
        clock: seconds; ``time.monotonic`` in engines, the trace's clock in replay.
    """

    __slots__ = ("_heap", "clock", "deadlines", "share", "spans", "tiers")

    def __init__(self, share: float, clock: Clock = time.monotonic) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"RetentionBook: share {share} is not within [0, 1]")
        self.share = share
        self.clock = clock
        self.deadlines: dict[OffloadKey, float] = {}
        """Held keys' deadlines (some may have passed: ``deadline`` checks)."""
        self.spans: dict[OffloadKey, float] = {}
        """How long the hint behind each deadline was (the client's expected pause): which retained key a full
        share gives up first."""
        self._heap: list[tuple[float, OffloadKey]] = []
        self.tiers: list[RetainTier] = []
        """Every tier on this book, in the order built (host first)."""

    def hold(self, keys: Sequence[OffloadKey], deadline: float) -> None:
        """Keep ``keys`` until ``deadline`` (a later deadline a key has stays); tell every tier."""
        self._expire()
        # Whole seconds: equal hints given a moment apart (or with the float error of ``now + hint - now``) tie,
        # and then the oldest deadline goes first.
        deadlines, spans, heap, span = self.deadlines, self.spans, self._heap, float(round(deadline - self.clock()))
        for key in keys:
            if deadlines.get(key, -math.inf) < deadline:
                deadlines[key] = deadline
                spans[key] = span
                heapq.heappush(heap, (deadline, key))
        while len(deadlines) > MAX_DEADLINES:
            self._pop()
        for tier in self.tiers:
            tier.retain(keys)

    def deadline(self, key: OffloadKey) -> float | None:
        """``key``'s deadline if one was given and has not passed."""
        deadline = self.deadlines.get(key)
        return deadline if deadline is not None and deadline > self.clock() else None

    @property
    def active(self) -> bool:
        """Whether any key was given a deadline (that may not have passed)."""
        return bool(self.deadlines)

    def _expire(self) -> None:
        heap, now = self._heap, self.clock()
        while heap and heap[0][0] <= now:
            self._pop()
        if len(heap) > 2 * len(self.deadlines) + 64:  # extended deadlines leave stale entries: compact
            self._heap = [(d, k) for d, k in heap if self.deadlines.get(k) == d]
            heapq.heapify(self._heap)

    def _pop(self) -> None:
        deadline, key = heapq.heappop(self._heap)
        if self.deadlines.get(key) == deadline:
            del self.deadlines[key]
            self.spans.pop(key, None)


class RetainPolicy(Policy):
    """``inner``'s order for unretained keys, then retained keys oldest deadline first (the module docstring).

    Args:
        inner: the configured policy, which orders the unretained keys.
        book: the deadlines; this policy joins its ``tiers`` when ``tier`` is given (a tenant's policy is
            reached through its tier's ``TenantPolicy`` instead).
        size: what the policy is sized for, in keys (the tier's capacity, or the tenant's quota): its cap is the
            book's share of it.
        tier: the tier's name in figures.
    """

    __slots__ = ("_cap", "_counts", "_demote_heap", "_heap", "_held", "_inner", "book", "tier")

    def __init__(self, inner: Policy, book: RetentionBook, size: int, tier: str | None = None) -> None:
        self._inner = inner
        self.book = book
        self._cap = math.floor(book.share * size)
        self._held: dict[OffloadKey, float] = {}
        self._heap: list[tuple[float, OffloadKey]] = []
        """Retained keys by deadline, oldest first (stale entries skipped): expiry and eviction order."""
        self._demote_heap: list[tuple[float, float, OffloadKey]] = []
        """Retained keys by (longest hint, oldest deadline) first (stale entries skipped): what a full share gives
        up first."""
        self._counts = RetainCounts()
        self.tier = tier or "host"
        if tier is not None:
            book.tiers.append(self)

    @property
    def inner(self) -> Policy:
        """The policy that orders the unretained keys (an adaptive one is steered through it: index/admission.py)."""
        return self._inner

    # ---- the Policy interface ------------------------------------------------------------------------------------

    def insert(self, key: OffloadKey) -> None:
        if key in self._held or (self.book.deadlines and self._hold(key)):
            return  # (inserting a resident key is a use: a retained key's place is its deadline's)
        self._inner.insert(key)

    def insert_all(self, keys: Iterable[OffloadKey]) -> None:
        deadlines, held = self.book.deadlines, self._held
        if deadlines or held:
            keys = list(keys)
            # A batch none of whose keys is retained or has a deadline (a request without a hint) goes to the inner
            # policy whole, as with nothing retained: key by key, ``insert`` would hand each on alone.
            if any(map(held.__contains__, keys)) or any(map(deadlines.__contains__, keys)):
                for key in keys:
                    self.insert(key)
                return
        self._inner.insert_all(keys)

    def touch(self, key: OffloadKey) -> None:
        if key in self._held:
            self._counts.hits += 1
        else:
            self._inner.touch(key)

    def touch_all(self, keys: Iterable[OffloadKey]) -> None:
        held = self._held
        if not held:
            self._inner.touch_all(keys)
            return
        # The retained keys are counted and left out in C; the others go to the inner policy in one call, in order.
        keys = list(keys)
        rest = list(filterfalse(held.__contains__, keys))
        self._counts.hits += len(keys) - len(rest)
        if rest:
            self._inner.touch_all(rest)

    def remove(self, key: OffloadKey) -> None:
        if self._held.pop(key, None) is None:
            self._inner.remove(key)

    def entering(self, keys: Sequence[OffloadKey]) -> None:
        self._inner.entering(keys)

    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        if self._held:
            self._expire()
        got = self._inner.victims(n, can_evict)
        if got is not None or not self._held:
            return got
        # The inner policy cannot give the run (it changed nothing): asked again, it names every key it may give.
        allowed: set[OffloadKey] = set()
        got = self._inner.victims(n, counting(can_evict, allowed))
        if got is not None:
            return got
        # Every unretained key the inner policy may give goes first; the rest are retained, oldest deadline first.
        need = n - len(allowed)
        taken = [key for _, key in sorted((d, k) for k, d in self._held.items()) if can_evict(key)][:need]
        if len(taken) < need:
            return None
        first = self._inner.victims(len(allowed), can_evict) if allowed else []
        if first is None:  # the inner policy offered fewer than it allowed: it changed nothing
            return None
        for key in taken:
            del self._held[key]
        self._counts.evicted += len(taken)
        return first + taken

    def __contains__(self, key: object) -> bool:
        return key in self._held or key in self._inner

    def __len__(self) -> int:
        return len(self._held) + len(self._inner)

    def check_integrity(self) -> None:
        both = [key for key in self._held if key in self._inner]
        if both:
            raise IntegrityError(f"RetainPolicy: {len(both)} keys both retained and in the inner policy")
        if len(self._held) > self._cap:
            raise IntegrityError(f"RetainPolicy: {len(self._held)} retained keys over the cap {self._cap}")
        self._inner.check_integrity()

    # ---- retention -----------------------------------------------------------------------------------------------

    def retain(self, keys: Sequence[OffloadKey]) -> None:
        """The book has new deadlines for ``keys``: those resident here become (or stay) retained."""
        if self._cap == 0:
            return  # nothing is ever retained
        inner, held, deadlines, now = self._inner, self._held, self.book.deadlines, self.book.clock()
        for key in keys:
            was = held.get(key)
            if was is None and key not in inner:
                continue  # not resident here
            deadline = deadlines.get(key)
            if deadline is not None and deadline != was and deadline > now:
                self._place(key, deadline, was is None)

    def retained(self) -> int:
        self._expire()
        return len(self._held)

    def counts(self) -> RetainCounts:
        return self._counts

    def _hold(self, key: OffloadKey) -> bool:
        """Retain ``key`` if the book has a deadline for it that has not passed (from the inner policy, if it was
        there); answers whether it did."""
        book = self.book
        deadline = book.deadlines.get(key)  # book.deadline inlined: it runs for every hinted key stored
        if deadline is None or deadline <= book.clock() or self._cap == 0:
            return False
        was = self._held.get(key)
        if was != deadline:
            self._place(key, deadline, was is None)
        return key in self._held

    def _place(self, key: OffloadKey, deadline: float, from_inner: bool) -> None:
        """``key`` is retained until ``deadline`` (taken from the inner policy if ``from_inner``); past the cap, a
        retained key becomes ordinary."""
        if from_inner:
            self._inner.remove(key)
        held = self._held
        held[key] = deadline
        heapq.heappush(self._heap, (deadline, key))
        heapq.heappush(self._demote_heap, (-self.book.spans.get(key, 0.0), deadline, key))
        if len(held) > self._cap:
            self._demote()

    def _demote(self) -> None:
        """The cap is passed: the key with the longest hint (of those, the oldest deadline) becomes ordinary.

        Longest hint first, as replay measured it (docs/planning.md, "Sessions and retention hints"): with hints
        that are each session's expected pause, the session away longest gives up its room to those coming back
        sooner (as Belady's optimum would); with one fixed hint for all, it is the oldest deadline, the session
        idle longest. Oldest deadline first gave the room of sessions about to return to those away for twenty
        minutes: 0.49 of the optimum's session hit rate against 0.83 at 800 blocks."""
        heap, held = self._demote_heap, self._held
        while heap:
            _, deadline, key = heapq.heappop(heap)
            if held.get(key) == deadline:
                del held[key]
                self._inner.insert(key)
                self._counts.demoted += 1
                return

    def _expire(self) -> None:
        """Keys whose deadline passed join the inner policy."""
        heap, held, now = self._heap, self._held, self.book.clock()
        while heap and heap[0][0] <= now:
            deadline, key = heapq.heappop(heap)
            if held.get(key) == deadline:
                del held[key]
                self._inner.insert(key)
        if len(heap) > 2 * len(held) + 64:  # extended deadlines and evicted keys leave stale entries: compact
            self._heap = [(d, k) for d, k in heap if held.get(k) == d]
            heapq.heapify(self._heap)
            self._demote_heap = [(s, d, k) for s, d, k in self._demote_heap if held.get(k) == d]
            heapq.heapify(self._demote_heap)


__all__ = ["MAX_DEADLINES", "RetainCounts", "RetainPolicy", "RetainTier", "RetentionBook"]
