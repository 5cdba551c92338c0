"""The skeleton of a handler whose tier is reached over a network (the remote and the object tier): two lanes, a
breaker, a fault log and a budget per job.

Never on the engine step: ``submit`` only queues. Jobs run on two lanes, one daemon thread each (``IoThreads``):
stores and loads, so a backlog of stores never delays a load (a request waits for its loads, never for stores).
Each lane runs its jobs in submission order, which gives the ordering rule of ``TransferHandler``: only loads
write host slots, only stores write the tier.

A job's failure is an outcome: an absent block (``Miss``) is an ordinary one; any other exception is classified
into the tier's fault kinds, logged once per outage (``FaultLog``) and, for a server fault, told to ``breaker``
(jobs then fail at once, without I/O, for the cool-down). An outage ends only with the answer to a job begun
after its latest fault (``_note_answer``). A job that has not finished ``_budget(job)`` seconds after its lane took
it up fails then (``get_finished``, ``wait`` and ``shutdown`` check), and so do the jobs queued behind it; no slot
is read or written for a job after that (``_owning``).

A tier supplies its I/O (``_io``), its fault kinds (``_classify``), each job's budget (``_budget``) and how to
close its connections (``_close``); one with more breakers than ``breaker`` (the remote tier's for stores) also
supplies ``_allows``, ``_count`` and ``_answered``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic

from kvoffload.auth import TierSecret
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.lower.breaker import CircuitBreaker
from kvoffload.tiers.lower.fault_log import FaultLog, FaultT
from kvoffload.tiers.lower.handler import BlockT, JobT, LowerTierHandler
from kvoffload.tiers.lower.io_threads import IoThreads

if TYPE_CHECKING:
    from kvoffload.transfer.host_pool import HostPool

QUEUED_POLL_S = 0.1
"""How often ``wait`` looks at a job still queued behind another (whether its lane got stuck)."""


@dataclass(frozen=True)
class NamedBlock:
    """One block of a job: host slot ``slot`` <-> ``key``'s value or object, at ``name`` in the tier."""

    slot: int
    key: OffloadKey
    name: str
    nbytes: int


class Miss(Exception):
    """A block of the job is not in the tier: an ordinary outcome, not a fault."""


class LanedHandler(LowerTierHandler[BlockT, JobT], Generic[BlockT, JobT, FaultT]):
    """Host pool <-> a tier over a network: lanes, breaker, fault log and budgets; a subclass does the I/O.

    Args:
        pool, namespace, entry_bytes, secret, clock: as ``LowerTierHandler``'s.
        tier: the tier's name in logs and thread names ("remote tier").
        where: the server, as the log names it (never with a password).
        kinds: the tier's fault kinds (a ``TierFault`` enum).
        breaker_errors, breaker_cooldown_s: the breaker's settings.
    """

    def __init__(self, pool: HostPool, namespace: Namespace, entry_bytes: tuple[int, ...],
                 secret: TierSecret | None, clock: Callable[[], float], *, tier: str, where: str,
                 kinds: type[FaultT], breaker_errors: int, breaker_cooldown_s: float) -> None:
        super().__init__(pool, namespace, entry_bytes, secret, clock)
        self.breaker = CircuitBreaker(breaker_errors, breaker_cooldown_s, clock, tier)
        self._kinds = kinds
        """The tier's fault kinds; its ``TIMEOUT`` member names a job past its budget."""
        self.faults: FaultLog[FaultT] = FaultLog(where, kinds, tier)
        self._outcomes = threading.Lock()
        """Held while a job's outcome updates the breakers and the log, so both see outcomes in one order."""
        name = tier.split()[0]
        self._lanes = {True: IoThreads(1, f"kvoffload-{name}-store", clock),
                       False: IoThreads(1, f"kvoffload-{name}-load", clock)}
        self._running: dict[bool, JobT | None] = {True: None, False: None}
        """Each lane's job, from when the lane took it up until the lane takes up the next."""

    # The tier's part.

    @abstractmethod
    def _io(self, state: JobT) -> None:
        """Move the job's blocks (on its lane's thread) and set ``state.copied``.

        Raises:
            Miss: a block is not in the tier.
            Exception: anything else that failed (``_classify`` names it).
        """

    @abstractmethod
    def _classify(self, error: BaseException) -> FaultT:
        """The tier's fault kind of a job's exception."""

    @abstractmethod
    def _budget(self, state: JobT) -> float:
        """Seconds the job may run once its lane took it up."""

    @abstractmethod
    def _close(self) -> None:
        """Close the tier's connections (also breaking a lane out of a socket it is stuck on)."""

    def _allows(self, state: JobT) -> bool:
        """Whether the job may try its I/O now (else it fails at once)."""
        return self.breaker.allow()

    def _count(self, fault: FaultT) -> None:
        """Tell the breakers of a fault (under ``_outcomes``)."""
        if fault.is_server_fault:
            self.breaker.record(False)

    def _answered(self, state: JobT) -> None:
        """Tell the breakers that the tier answered ``state`` (under ``_outcomes``)."""
        self.breaker.record(True)

    # The skeleton.

    def _launch(self, state: JobT) -> None:
        # Even a job that fails at once (tier off) goes through its lane, behind the jobs before it, so that
        # results come in submission order.
        self._lanes[state.is_store].submit(functools.partial(self._run, state))

    def _stop(self) -> None:
        for lane in self._lanes.values():
            lane.stop()
        self._close()

    def _run(self, state: JobT) -> None:
        """One job, on its lane's thread; every data-path problem ends as a failed result."""
        with self._lock:
            if state.finished:
                return  # failed at its deadline while queued behind a stuck job
            state.start = self._clock()
            self._running[state.is_store] = state
        try:
            self._outcome(state)
        finally:
            with self._lock:
                self._running[state.is_store] = None

    def _outcome(self, state: JobT) -> None:
        if not state.blocks:
            self._end(state, failed=False)
            return
        if not self._allows(state):
            self._end(state, failed=True)
            return
        began = self.faults.noted
        try:
            self._io(state)
        except Miss:  # the tier answered: a miss is no fault
            self._end(state, failed=True, then=functools.partial(self._note_answer, began, None))
            return
        except Exception as e:
            self._end(state, failed=True, then=functools.partial(self._note, self._classify(e), e))
            return
        self._end(state, failed=False, then=functools.partial(self._note_answer, began, state))

    @contextlib.contextmanager
    def _owning(self, state: JobT) -> Iterator[None]:
        """Holds off ``_end`` while the body touches the job's slots; refuses once the job has ended or is late.

        Raises:
            TimeoutError: the job has its result already, or is past its budget: its slots may be reused now.
        """
        with self._holding_slots(state) as held:
            if not held:
                raise TimeoutError(f"job {state.job.job_id} answered after its {self._budget(state):.2f} s budget")
            yield

    def _note_answer(self, began: int, state: JobT | None) -> None:
        """The tier answered a job (``state``: it succeeded; None: a miss) begun when ``began`` faults had been
        noted.

        The two lanes report in the order their jobs end, not the order their I/O happened: a job answered just
        before the server died may end after the other lane noted the outage. Its answer says nothing of the
        server now, so unless it began after the latest fault it neither resets the breakers' count of errors nor
        ends the outage in the log (which would then log the same outage twice).
        """
        with self._outcomes:
            if self.faults.noted != began:
                return
            if state is None:
                self.breaker.record(True)
            else:
                self._answered(state)
            self.faults.recovered()

    def _note(self, fault: FaultT, error: BaseException | str) -> None:
        with self._outcomes:
            self._count(fault)
            self.faults.note(fault, error)

    def _overdue(self, state: JobT, now: float, stuck: dict[bool, bool] | None = None) -> bool:
        """Started longer than its budget ago, or queued behind a job that is (``stuck[lane]``)."""
        if state.start is not None:
            return now - state.start > self._budget(state)
        return stuck is not None and stuck[state.is_store]

    def _is_late(self, state: JobT) -> bool:
        return self._overdue(state, self._clock())

    def _wait_slice(self, state: JobT) -> float:
        """How long to wait for ``state`` before checking the deadlines again."""
        if state.start is None:
            return min(self._budget(state), QUEUED_POLL_S)
        return max(0.01, self._budget(state) - (self._clock() - state.start))

    def _expire(self) -> None:
        """Fail the jobs past their deadline, even while their lane's thread is stuck in a socket."""
        now = self._clock()
        with self._lock:
            stuck = {lane: job is not None and self._overdue(job, now) for lane, job in self._running.items()}
            late = [s for s in self._jobs.values() if not s.finished and self._overdue(s, now, stuck)]
        for state in late:
            timeout = f"job {state.job.job_id} unanswered after {self._budget(state):.2f} s"
            self._end(state, failed=True, then=functools.partial(self._note, self._kinds["TIMEOUT"], timeout)
                      if state.start is not None else None)
