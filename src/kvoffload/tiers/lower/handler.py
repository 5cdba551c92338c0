"""The skeleton every handler of a tier under host shares; a tier supplies its media, its block names and its I/O.

A handler of a lower tier (disk, remote) copies blocks between the host pool and that tier, both ways, on threads of
its own. ``LowerTierHandler`` is what those handlers do alike: it checks the entry sizes against the pool, validates
each job (``_plan``), keeps one ``LowerJob`` per job from ``submit`` to its result, fails the jobs past their deadline
from ``get_finished``, ``wait`` and ``shutdown`` (so that none of them waits on a stuck thread), and gives each job
its result once (``_end``), after every copy into or out of its slots (``_holding_slots``) is over: once the result
is out the scheduler may give the slots to other blocks, and a late block must not touch them.

A tier supplies its medium pair (``store_type``, ``load_type``; its side of a job is a ``TierBlocks``), how to name
one block (``_block``), its job state (``_new_job``), how to run a job (``_launch``), its deadlines (``_is_late``,
``_wait_slice``, ``_expire``) and how to stop its threads and connections (``_stop``); a tier that orders its jobs
also supplies ``_admit`` and ``_release``, and one that cleans up after a failure ``_settle``.
"""

from __future__ import annotations

import contextlib
import threading
from abc import abstractmethod
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvoffload.auth import TierSecret
from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.tiers.lower.job_waits import drain_jobs, wait_jobs
from kvoffload.transfer.base import TransferHandler, TransferResult

if TYPE_CHECKING:
    from kvoffload.transfer.host_pool import HostPool

SHUTDOWN_GRACE_S = 10.0
"""How long ``shutdown`` waits for unfinished jobs before failing them (a job with a deadline ends at it too)."""

BlockT = TypeVar("BlockT")


@dataclass(eq=False)
class LowerJob(Generic[BlockT]):
    """One job, from ``submit`` to its result."""

    job: TransferJob
    blocks: list[BlockT]
    start: float | None = None
    """The clock when it started (None while it waits for its turn)."""
    failed: bool = False
    """Its result is a failure (a block failed, or it ended as one)."""
    finished: bool = False
    """Its result is out (it ended, or its deadline passed): a late block or reply changes nothing."""
    copying: int = 0
    """Copies into or out of its slots running right now (memory speed: never stuck); ``_end`` waits for them."""
    copied: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def is_store(self) -> bool:
        return self.job.transfer_type[0] == Medium.HOST  # a validated job: host -> tier, or tier -> host


JobT = TypeVar("JobT", bound=LowerJob[Any])


class LowerTierHandler(TransferHandler, Generic[BlockT, JobT]):
    """Host pool <-> one tier under host: the bookkeeping of its jobs; a subclass does the I/O.

    Args:
        pool: this worker's host pool; entries are read from and written to the start of its slots.
        namespace: this rank's namespace; its ``fingerprint()`` is written into and checked in every block.
        entry_bytes: payload bytes of one offload block of each KV-cache group.
        secret: the tier's secret (``BlockFormat.of``), or None.
        clock: monotonic seconds, for the deadlines.
    Raises:
        ValueError: an entry does not fit in a host slot, or ``entry_bytes`` is empty or not positive.
    """

    store_type: tuple[Medium, Medium]
    """(HOST, the tier's medium)."""
    load_type: tuple[Medium, Medium]
    """(the tier's medium, HOST)."""

    def __init__(self, pool: HostPool, namespace: Namespace, entry_bytes: tuple[int, ...],
                 secret: TierSecret | None, clock: Callable[[], float]) -> None:
        slots = pool.buffer.numpy()
        if not entry_bytes or any(n <= 0 or n > slots.shape[1] for n in entry_bytes):
            raise ValueError(f"{type(self).__name__} entry_bytes {entry_bytes} must be positive and fit a host slot "
                             f"of {slots.shape[1]} bytes")
        self._slots = slots
        self._entry_bytes = entry_bytes
        self._fingerprint = namespace.fingerprint()
        self._fmt = BlockFormat.of(secret)
        self._clock = clock
        self._lock = threading.Lock()
        self._copied = threading.Condition(self._lock)
        self._jobs: dict[JobId, JobT] = {}
        self._finished: list[TransferResult] = []
        self._closed = False

    def submit(self, job: TransferJob) -> bool:
        state = self._plan(job)
        with self._lock:
            if self._closed:
                return False
            self._jobs[job.job_id] = state
            ready = self._admit(state)
        if ready:
            self._launch(state)
        return True

    def get_finished(self) -> list[TransferResult]:
        self._expire()
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: Collection[JobId]) -> None:
        with self._lock:
            states = [self._jobs[j] for j in job_ids if j in self._jobs]
        wait_jobs(states, self._wait_slice, self._expire)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            states = list(self._jobs.values())
        drain_jobs(states, self._wait_slice, self._expire, lambda state: self._end(state, failed=True),
                   SHUTDOWN_GRACE_S)
        self._stop()

    # The tier's part.

    @abstractmethod
    def _block(self, slot: int, key: OffloadKey, nbytes: int) -> BlockT:
        """One block of a job: host slot ``slot`` <-> ``key``'s block in the tier, ``nbytes`` of payload."""

    @abstractmethod
    def _new_job(self, job: TransferJob, blocks: list[BlockT]) -> JobT:
        """The state of a validated job."""

    @abstractmethod
    def _launch(self, state: JobT) -> None:
        """Start a job (it may end before this returns); never raises for a data-path problem."""

    @abstractmethod
    def _is_late(self, state: JobT) -> bool:
        """Whether the job is past its deadline (its slots are then no longer its own)."""

    @abstractmethod
    def _wait_slice(self, state: JobT) -> float:
        """How long to wait for ``state`` before checking the deadlines again."""

    @abstractmethod
    def _expire(self) -> None:
        """Fail the jobs past their deadline, even while their threads are stuck."""

    @abstractmethod
    def _stop(self) -> None:
        """Stop the tier's threads and connections (``shutdown``, after its jobs ended)."""

    def _admit(self, state: JobT) -> bool:
        """Under the lock, once ``state`` is registered: whether it may start now (else ``_release`` starts it)."""
        return True

    def _release(self, state: JobT) -> list[JobT]:
        """Under the lock, once ``state`` has its result: the jobs that may start now."""
        return []

    def _settle(self, state: JobT) -> None:
        """The tier's clean-up once ``state`` ended, before its result is out (its time counts it)."""

    # The skeleton.

    def _plan(self, job: TransferJob) -> JobT:
        """Validate a job and list its blocks (a malformed job is a scheduler bug: ValueError)."""
        host, tier = self._sides(job)
        if host.group_sizes != tier.group_sizes or len(host.group_sizes) > len(self._entry_bytes):
            raise ValueError(f"job {job.job_id}: group sizes {host.group_sizes} and {tier.group_sizes} "
                             f"differ or exceed the {len(self._entry_bytes)} groups of this tier")
        if host.skip_sub_blocks:
            raise ValueError(f"job {job.job_id}: skip_sub_blocks is not supported between host and "
                             f"{self.store_type[1].value}")
        if any(not 0 <= s < self._slots.shape[0] for s in host.slots):
            raise ValueError(f"job {job.job_id}: a slot of {host.slots} is outside the pool")
        # Every entry moves the largest group's bytes, whatever its group: the scheduler's tier jobs list the keys
        # of many groups as one (a key's group is folded into it, and the index does not keep it), so a group's
        # own size could truncate a larger group's entry. The block files and values are sized for it too.
        nbytes = max(self._entry_bytes)
        blocks = [self._block(s, k, nbytes) for s, k in zip(host.slots, tier.keys, strict=True)]
        return self._new_job(job, blocks)

    def _sides(self, job: TransferJob) -> tuple[HostBlocks, TierBlocks]:
        """The host side and the tier side of ``job``, whichever way it goes."""
        if job.transfer_type == self.store_type:
            host, tier = job.src, job.dst
        elif job.transfer_type == self.load_type:
            host, tier = job.dst, job.src
        else:
            raise ValueError(f"job {job.job_id}: {type(self).__name__} does not move {job.transfer_type}")
        assert isinstance(host, HostBlocks) and isinstance(tier, TierBlocks)
        return host, tier

    @contextlib.contextmanager
    def _holding_slots(self, state: JobT) -> Iterator[bool]:
        """Holds off ``_end`` while the body touches the job's slots; yields False, holding nothing, when the job
        has ended or is late (its slots may belong to other blocks now: the body must not touch them)."""
        with self._lock:
            held = not state.finished and not self._is_late(state)
            if held:
                state.copying += 1
        try:
            yield held
        finally:
            if held:
                with self._lock:
                    state.copying -= 1
                    if not state.copying:
                        self._copied.notify_all()

    def _end(self, state: JobT, failed: bool, then: Callable[[], None] | None = None) -> bool:
        """Give ``state`` its result, once; True if this call did (a later call, a late block or reply, changes
        nothing).

        Copies into its slots finish first. ``_settle`` and then ``then`` (what the outcome tells the breakers and
        the log) run before the result is out, so whoever sees the result also sees their effects.
        """
        with self._lock:
            if state.finished:
                return False
            state.finished = True
            state.failed |= failed
            while state.copying:
                self._copied.wait()
        self._settle(state)
        seconds = self._clock() - state.start if state.start is not None else 0.0
        if then is not None:
            then()
        self._publish(state, seconds)
        return True

    def _publish(self, state: JobT, seconds: float) -> None:
        ok = not state.failed
        result = TransferResult(state.job.job_id, ok, state.copied if ok else 0, seconds, state.job.transfer_type)
        with self._lock:
            self._finished.append(result)
            del self._jobs[state.job.job_id]
            released = self._release(state)
        state.done.set()
        for dependent in released:
            self._launch(dependent)
