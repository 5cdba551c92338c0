"""Replay with retention hints: a trace of agent sessions and one-off prompts (``agentic.py``) through a host tier
whose policy honours hints (``index/retention.py``'s ``RetainPolicy`` on a ``RetentionBook``), counted per kind of
request: session turns (``Request.session`` set) and one-off prompts.

The replay's clock is the trace's: before each request the book's clock is set to its arrival, so deadlines pass
as the trace's time does. A request with a hint holds all its prompt's keys until its arrival plus the hint (capped
at ``max_retain_s``, as the connector caps it) before it is looked up, and holds the keys it stores the same (they
are prompt keys, so they have that deadline already; holding them again is what the scheduler does on a store).
``Hints`` picks the hint a request carries: none, its own ``retain_s`` (``expected``), or a fixed 600 s on every
request that carries one (``fixed-600``, a client that knows nothing of its pauses).

Otherwise the loop is ``loop.py``'s: lookup of the leading run, load and touch of the hits, the store of the missed
keys (the optimum's with its bypass, the adaptive policy's with its admission rule), evictions counted to the kind
of request that stored the key.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.config import EvictionPolicy, StoreAdmission
from kvoffload.index.admission import make_admission
from kvoffload.index.base import EventKind
from kvoffload.index.policies.base import Policy
from kvoffload.index.policies.registry import make_policy
from kvoffload.index.retention import RetainPolicy, RetentionBook
from kvoffload.index.slot_index import SlotIndex
from kvoffload.keys import OffloadKey
from kvoffload.tools.replay.loop import Admit, Bound, Counts, Strategy, load_hits, store_leading
from kvoffload.tools.replay.optimum import NextUse, OptimumPolicy, next_uses
from kvoffload.tools.replay.result import ReplayResult
from kvoffload.tools.replay.trace import Request, Trace

FIXED_S = 600.0
"""The hint of ``Hints.FIXED``: ten minutes."""
MAX_RETAIN_S = 3600.0
"""The cap on a hint, as the connector's ``max_retain_s`` default."""
RETAIN_SHARE = 0.5
"""The share of the tier retained keys may hold, as the connector's ``retain_share`` default."""


class Hints(enum.Enum):
    """Which hint each request carries in the replay."""

    OFF = "off"
    """None: the tier's policy alone."""
    EXPECTED = "expected"
    """The trace's ``retain_s`` (the agentic generator's: the time to the session's next turn)."""
    FIXED = "fixed-600"
    """``FIXED_S`` on every request whose trace line carries a hint."""


class Kind(enum.Enum):
    """The two kinds of request counted apart."""

    SESSION = "session"
    ONEOFF = "oneoff"


def kind_of(request: Request) -> Kind:
    return Kind.SESSION if request.session is not None else Kind.ONEOFF


@dataclass(frozen=True)
class SessionReplay:
    """One replay's figures per kind of request, and the retention figures (zero with hints off)."""

    strategy: str
    hints: Hints
    session: ReplayResult
    oneoff: ReplayResult
    hinted: int
    """Requests that carried a hint."""
    capped: int
    """Hints longer than ``max_retain_s`` (cut to it)."""
    retained_peak: int
    """The most keys the tier held retained after any request."""
    retained_mean: float
    """Retained keys after a request, on average over the requests."""
    retained_hits: int
    """Hit blocks that an earlier hint's deadline still covered when the request arrived."""
    demoted: int
    """Retained keys made ordinary because the retained share was full."""
    retained_evicted: int
    """Retained keys evicted (every unretained key had gone already)."""
    seconds: float

    @property
    def label(self) -> str:
        return self.strategy if self.hints is Hints.OFF else f"{self.strategy}+hints {self.hints.value}"


def hint_of(request: Request, hints: Hints) -> float | None:
    """The hint ``request`` carries in a replay with ``hints`` (None: none)."""
    if hints is Hints.OFF or request.retain_s is None:
        return None
    return FIXED_S if hints is Hints.FIXED else request.retain_s


class _Run:
    """The running state of one replay: the tier, the book and its clock, counts per kind."""

    def __init__(self, trace: Trace, tier: SlotIndex, book: RetentionBook | None) -> None:
        self.trace, self.tier, self.book = trace, tier, book
        self.now = 0.0
        self.counts = {kind: Counts() for kind in Kind}
        self.owner: dict[OffloadKey, Kind] = {}
        self.hinted = self.capped = self.retained_hits = self.retained_peak = self.retained_sum = 0

    def clock(self) -> float:
        return self.now

    def step(self, request: Request, hint: float | None, max_retain_s: float, admit: Admit) -> None:
        self.now = request.timestamp_ms / 1000
        kind, book, keys = kind_of(request), self.book, request.keys
        deadline = None
        if book is not None:
            ahead = self.tier.lookup(keys).hits  # the lookup changes nothing: count before this request's hold
            self.retained_hits += sum(1 for key in keys[:ahead] if book.deadline(key) is not None)
            if hint is not None:
                self.hinted += 1
                self.capped += hint > max_retain_s
                deadline = self.now + min(hint, max_retain_s)
                book.hold(keys, deadline)
        counts = self.counts[kind]
        hits = load_hits(self.tier, request, self.trace.block_tokens, counts)
        missed = keys[hits:]
        if missed:
            offered, stored = store_leading(self.tier, missed[:admit(missed)])
            counts.declined += len(missed) - offered
            counts.stored += len(stored)
            counts.unread.update(stored)
            self.owner.update(dict.fromkeys(stored, kind))
            if book is not None and deadline is not None and stored:
                book.hold(stored, deadline)
        self._count_evictions()

    def sample(self, policy: Policy) -> None:
        if isinstance(policy, RetainPolicy):
            retained = policy.retained()
            self.retained_peak = max(self.retained_peak, retained)
            self.retained_sum += retained

    def _count_evictions(self) -> None:
        for event in self.tier.take_events():
            if event.kind is not EventKind.REMOVED:
                continue
            for key in event.keys:
                mine = self.counts[self.owner.pop(key)]
                mine.evicted += 1
                if key in mine.unread:
                    mine.unread.discard(key)
                    mine.wasted += 1


def replay_sessions(trace: Trace, capacity_blocks: int, strategy: Strategy = EvictionPolicy.LRU,
                    hints: Hints = Hints.OFF, max_retain_s: float = MAX_RETAIN_S, share: float = RETAIN_SHARE,
                    future: NextUse | None = None) -> SessionReplay:
    """Replay ``trace`` through a tier of ``capacity_blocks`` slots with ``strategy``'s policy, honouring ``hints``
    (the module docstring); ``Bound.OPTIMUM`` takes no hints (it knows the future already).

    Raises:
        ValueError: ``capacity_blocks`` is not positive; hints with a bound; a bad ``share``.
    """
    if capacity_blocks <= 0:
        raise ValueError(f"replay: capacity {capacity_blocks} blocks must be positive")
    if isinstance(strategy, Bound) and hints is not Hints.OFF:
        raise ValueError(f"replay: {strategy.value} takes no hints")
    start = time.perf_counter()
    if strategy is Bound.OPTIMUM:
        run = _replay_optimum(trace, capacity_blocks, future or next_uses(trace))
        policy: Policy | None = None
    else:
        kind = strategy if isinstance(strategy, EvictionPolicy) else EvictionPolicy.LRU
        capacity = max(1, trace.distinct_keys()) if strategy is Bound.UNBOUNDED else capacity_blocks
        inner = make_policy(kind, capacity)
        run, policy = _replay_policy(trace, capacity, inner, hints, max_retain_s, share)
    run.tier.check_integrity()
    return _result(run, strategy.value, hints, capacity_blocks, policy, time.perf_counter() - start)


def _replay_policy(trace: Trace, capacity: int, inner: Policy, hints: Hints, max_retain_s: float, share: float
                   ) -> tuple[_Run, Policy]:
    book = RetentionBook(share) if hints is not Hints.OFF else None
    policy: Policy = inner if book is None else RetainPolicy(inner, book, capacity, "host")
    tier = SlotIndex(capacity, policy)
    run = _Run(trace, tier, book)
    if book is not None:
        book.clock = run.clock  # the trace's time, not the machine's
    rule = make_admission(StoreAdmission.ALL, capacity, inner)  # the adaptive policy steers by its admission
    for request in trace.requests:
        if rule.watches_lookups:
            rule.looked_up(request.keys)
        run.step(request, hint_of(request, hints), max_retain_s, rule.admit)
        run.sample(policy)
    return run, policy


def _replay_optimum(trace: Trace, capacity: int, future: NextUse) -> _Run:
    oracle = OptimumPolicy(future)
    tier = SlotIndex(capacity, oracle)
    run = _Run(trace, tier, None)

    def admit(keys: Sequence[OffloadKey]) -> int:
        return oracle.bypass(keys, capacity - tier.usage()[0].used_blocks)

    for request, after in zip(trace.requests, future.after, strict=True):
        oracle.advance(request.keys, after)
        run.step(request, None, 0.0, admit)
    return run


def _result(run: _Run, strategy: str, hints: Hints, capacity: int, policy: Policy | None,
            seconds: float) -> SessionReplay:
    trace = run.trace
    parts = {kind: Trace(tuple(r for r in trace.requests if kind_of(r) is kind), trace.block_tokens)
             for kind in Kind}
    results = {kind: run.counts[kind].result(parts[kind], strategy, StoreAdmission.ALL.value, capacity, 0.0)
               for kind in Kind}
    counts = policy.counts() if isinstance(policy, RetainPolicy) else None
    requests = max(1, len(trace.requests))
    return SessionReplay(strategy, hints, results[Kind.SESSION], results[Kind.ONEOFF], run.hinted, run.capped,
                         run.retained_peak, run.retained_sum / requests, run.retained_hits,
                         counts.demoted if counts else 0, counts.evicted if counts else 0, seconds)
