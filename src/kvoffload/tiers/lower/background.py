"""A shared store's questions off the engine step: prefix searches answered later, deletes never waited for.

``ProbedIndex`` (the scheduler half of the remote and object tiers) asks its store on lookups and deletes what
leaves its own budget. Both cross a network, and an engine step is shared by every running request: a step held
for a 2 s timeout is 2 s without a token for all of them, and a hostile server can stretch one request for as long
as it trickles. So nothing here runs on the caller's thread:

- ``Searches``: a lookup starts its search (``StoreProbe.leading_run``) on one of ``SEARCH_THREADS`` threads,
  waits for it a moment (``INLINE_WAIT_S``, from a budget that refills at ``INLINE_SHARE`` of wall time, so that
  no burst of lookups or faulty store costs a step more than that moment) and otherwise answers "pending"; vLLM
  skips the request and asks again at a later step (``get_num_new_matched_tokens`` answers None), and that ask
  takes the answer. A search past its deadline is a miss, whatever its thread is still doing, and so is a lookup
  while ``MAX_SEARCHES`` searches are open (a stuck store cannot pile up work or memory). The moment's wait is
  what a healthy store needs (redis on loopback answers in 0.1-0.3 ms, an RGW in 2-3 ms): its hits are answered
  on the step that asks, and the search thread runs while the scheduler waits instead of fighting an engine loop
  that spins on the GIL (without it a cross-engine hit's TTFT grew 24 ms in ``kvoffload bench faults``).
- ``Deletes``: each delete (``StoreProbe.delete``) is queued for one thread; at most ``MAX_DELETE_KEYS`` keys wait,
  and a delete that finds the queue full is dropped and counted (the store's own expiry or lifecycle rules remove
  what an engine failed to delete; the blocks left are never indexed, so never read as this engine's).

Both are driven by the scheduler thread alone (``start``, ``answer``, ``submit``); their threads only call the
probe, which is thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from kvoffload.keys import OffloadKey
from kvoffload.tiers.lower.io_threads import IoThreads

logger = logging.getLogger(__name__)

SEARCH_THREADS = 4
"""Searches run at once: a burst of new prompts waits for one store round trip, not for each other's."""
MAX_SEARCHES = 256
"""Searches open (running, queued or answered and not yet taken) at most; past it a lookup is a miss."""
INLINE_WAIT_S = 0.003
"""The most a lookup's search is waited for on the step (and the budget's size)."""
INLINE_SHARE = 0.05
"""The budget refills at this share of wall time: inline waits take at most 5% of the scheduler's time."""
KEEP_ANSWER_S = 10.0
"""How long an answer waits for the lookup that asked (a request aborted meanwhile never takes it)."""
MAX_DELETE_KEYS = 1 << 16
"""Keys waiting to be deleted at most; a delete past it is dropped and counted."""


class SearchProbe(Protocol):
    """What ``Searches`` and ``Deletes`` ask of a store (``StoreProbe``); both methods are thread-safe."""

    def leading_run(self, keys: Sequence[OffloadKey]) -> int | None: ...

    def delete(self, keys: Sequence[OffloadKey]) -> bool: ...


SearchId = tuple[OffloadKey, OffloadKey, int]
"""A search's keys, named by their first and last key and their count: keys are chained content hashes, so the
last one names the whole run before it."""


def search_id(keys: Sequence[OffloadKey]) -> SearchId:
    return keys[0], keys[-1], len(keys)


@dataclass(frozen=True)
class SearchAnswer:
    """What a search found: ``run`` leading keys held (None: the store did not answer, or not by the deadline)."""

    run: int | None
    late: bool = False


@dataclass
class _Search:
    future: Future[int | None]
    deadline: float


class Searches:
    """Prefix searches in the background, each answered at most once.

    Args:
        probe: the store's probe (``leading_run`` runs on this object's threads).
        deadline_s: how long after it starts a search is given up (a miss); at least the probe's own timeout.
        clock: monotonic seconds.
    """

    def __init__(self, probe: SearchProbe, deadline_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._probe = probe
        self._deadline_s = deadline_s
        self._clock = clock
        self._open: dict[SearchId, _Search] = {}
        self._threads: IoThreads | None = None  # made at the first search: most indexes of tests never search
        self._budget = InlineBudget()
        self.started = 0
        """Searches started (for stats and tests)."""
        self.late = 0
        """Searches given up at their deadline: misses."""
        self.refused = 0
        """Lookups answered a miss because ``MAX_SEARCHES`` searches were open."""
        self.unanswered = 0
        """Answers without a run: the store failed or timed out, the search was late or refused (misses)."""

    def answer(self, keys: Sequence[OffloadKey]) -> SearchAnswer | None:
        """The answer of the search of ``keys``, started now if there is none; None while it runs (ask again).

        An answer is given once: the next ``answer`` of the same keys starts a new search.
        """
        sid = search_id(keys)
        now = self._clock()
        search = self._open.get(sid)
        if search is None:
            search = self._start(sid, keys, now)
            if search is None:
                return self._unanswered(SearchAnswer(None))  # refused: too many open
            self._budget.wait(search.future)
        if search.future.done():
            del self._open[sid]
            answer = SearchAnswer(_result(search.future))
            return answer if answer.run is not None else self._unanswered(answer)
        if now < search.deadline:
            return None
        del self._open[sid]  # its thread may still be held by the store: its result is dropped
        self.late += 1
        return self._unanswered(SearchAnswer(None, late=True))

    def _unanswered(self, answer: SearchAnswer) -> SearchAnswer:
        self.unanswered += 1
        return answer

    @property
    def open(self) -> int:
        """Searches open now."""
        return len(self._open)

    def wait(self, timeout_s: float) -> bool:
        """Wait until every open search has its answer (tests, benches); False if ``timeout_s`` passed first."""
        pending = [s.future for s in self._open.values()]
        return not futures.wait(pending, timeout=timeout_s).not_done

    def close(self) -> None:
        """Let the threads exit after the searches queued; never waits (a thread a store holds is a daemon)."""
        if self._threads is not None:
            self._threads.stop()
            self._threads = None
        self._open.clear()

    def _start(self, sid: SearchId, keys: Sequence[OffloadKey], now: float) -> _Search | None:
        """The search of ``keys``, started; None when ``MAX_SEARCHES`` are open."""
        if len(self._open) >= MAX_SEARCHES:
            self._forget_stale(now)
            if len(self._open) >= MAX_SEARCHES:
                self.refused += 1
                return None
        if self._threads is None:
            self._threads = IoThreads(SEARCH_THREADS, "kvoffload-store-search", self._clock)
        future: Future[int | None] = Future()
        self._threads.submit(lambda: _run_search(self._probe, tuple(keys), future))
        search = self._open[sid] = _Search(future, now + self._deadline_s)
        self.started += 1
        return search

    def _forget_stale(self, now: float) -> None:
        """Drop answers nobody took within ``KEEP_ANSWER_S`` of their deadline, and searches long past it."""
        stale = [sid for sid, s in self._open.items() if now >= s.deadline + KEEP_ANSWER_S]
        for sid in stale:
            del self._open[sid]


class InlineBudget:
    """How long the scheduler may still wait on searches now: ``INLINE_WAIT_S`` at most, refilled at
    ``INLINE_SHARE`` of wall time (real time: the wait is real whatever clock the index keeps)."""

    def __init__(self) -> None:
        self._left = INLINE_WAIT_S
        self._at = time.perf_counter()

    def wait(self, future: Future[int | None]) -> None:
        """Wait for ``future`` while the budget lasts, and spend what the wait took."""
        now = time.perf_counter()
        self._left = min(INLINE_WAIT_S, self._left + (now - self._at) * INLINE_SHARE)
        if self._left > 0:
            futures.wait([future], timeout=self._left)
            spent = time.perf_counter() - now
            self._left -= spent
            now += spent
        self._at = now


def _run_search(probe: SearchProbe, keys: tuple[OffloadKey, ...], future: Future[int | None]) -> None:
    try:
        future.set_result(probe.leading_run(keys))
    except Exception as e:
        future.set_exception(e)


def _result(future: Future[int | None]) -> int | None:
    """A finished search's run; a probe that raised (it should not: failures are answers) is a store not
    answering."""
    error = future.exception()
    if error is not None:
        logger.error("store search failed unexpectedly: %s: %s", type(error).__name__, error)
        return None
    return future.result()


class Deletes:
    """Deletes of this engine's own blocks in the background, bounded, never waited for.

    Args:
        probe: the store's probe (``delete`` runs on this object's thread).
        name: the tier, for the thread's name and the log.
    """

    def __init__(self, probe: SearchProbe, name: str) -> None:
        self._probe = probe
        self._name = name
        self._lock = threading.Lock()
        self._waiting = 0  # keys queued or being deleted
        self._idle = threading.Condition(self._lock)
        self._thread: IoThreads | None = None  # one thread, made at the first delete
        self.dropped = 0
        """Keys whose delete was dropped because ``MAX_DELETE_KEYS`` were waiting."""
        self.failed = 0
        """Keys whose delete the store failed (or the probe skipped: its breaker was open)."""

    def submit(self, keys: Sequence[OffloadKey]) -> None:
        """Queue a delete of every rank's copy of ``keys``; returns at once."""
        if not keys:
            return
        with self._lock:
            if self._waiting + len(keys) > MAX_DELETE_KEYS:
                if self.dropped == 0:
                    logger.warning("%s: deletes are not keeping up (%d keys waiting); dropping deletes, which the "
                                   "store's own expiry must then remove", self._name, self._waiting)
                self.dropped += len(keys)
                return
            self._waiting += len(keys)
            if self._thread is None:
                self._thread = IoThreads(1, f"kvoffload-{self._name}-deletes", time.monotonic)
            thread = self._thread
        batch = tuple(keys)
        thread.submit(lambda: self._delete(batch))

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued delete was sent and answered (tests, shutdown); False if ``timeout_s`` passed."""
        with self._idle:
            return self._idle.wait_for(lambda: self._waiting == 0, timeout_s)

    @property
    def waiting(self) -> int:
        """Keys queued and not yet answered."""
        with self._lock:
            return self._waiting

    def close(self) -> None:
        """Let the thread exit after what is queued (never waits for it)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()

    def _delete(self, keys: tuple[OffloadKey, ...]) -> None:
        ok = False
        try:
            ok = self._probe.delete(keys)
        finally:  # a probe's failures are answers; one that raises is a bug, which IoThreads logs
            with self._idle:
                self._waiting -= len(keys)
                if not ok:
                    self.failed += len(keys)
                self._idle.notify_all()
