"""Worker side of the disk tier: copies blocks between the host pool and block files, both ways.

The router sends this handler the jobs of (HOST, DISK) and (DISK, HOST). Each job is split into one task per
block, run on ``io_threads`` daemon threads (``IoThreads``); a task writes or reads the first ``max(entry_bytes)``
bytes of a host slot (an entry of any KV-cache group: ``tiers.lower.handler`` says why) in the format of
``tiers.lower.block_format``. Files live in this
rank's directory, checked at start-up (``tiers.disk.tree.open_tree``), and carry this rank's namespace fingerprint, so
a block is only loaded by the rank and namespace that wrote it. A replicated namespace (every rank holds the same
bytes) has one directory and one fingerprint for all ranks: rank 0 writes it (the other ranks' handlers are wrapped
in ``transfer.skip_writes.SkipWrites``) and every rank reads it.

Failures are outcomes: a missing, corrupt or foreign file, something other than a regular file, an I/O error,
or a read slower than ``read_deadline_s`` fails the job (its other blocks are skipped). A failed write removes
the files the job wrote, so nothing unindexed stays on disk; a corrupt file is removed, and a removal that fails
is an I/O error too. Repeated errors open a ``CircuitBreaker``: jobs then fail at once, without I/O.

Reads that never return (a hung mount): a read job fails when its deadline passes, whether or not its threads
came back (``get_finished``, ``wait`` and ``shutdown`` check the deadlines). A read lands in its thread's own
buffer and is copied into the host slot only while its job is live, so a late read never writes a slot that the
scheduler has since given to another block. While every I/O thread is stuck the tier is off (jobs fail at
once). ``shutdown`` waits for reads until their deadline and for writes ``SHUTDOWN_GRACE_S`` at most, then
fails what is left and leaves stuck threads behind (they are daemons).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffload.blocks import Medium, TransferJob
from kvoffload.config import DiskTierConfig
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.disk.file_io import FileOps, read_for_slot, write_block
from kvoffload.tiers.disk.paths import block_path, rank_directory
from kvoffload.tiers.disk.tree import Access, open_tree, scan
from kvoffload.tiers.lower.block_format import CorruptBlockError, UnauthenticBlockError
from kvoffload.tiers.lower.breaker import CircuitBreaker
from kvoffload.tiers.lower.handler import SHUTDOWN_GRACE_S, LowerJob, LowerTierHandler
from kvoffload.tiers.lower.io_threads import IoThreads

if TYPE_CHECKING:
    from kvoffload.transfer.host_pool import HostPool

logger = logging.getLogger(__name__)

HOST_TO_DISK = (Medium.HOST, Medium.DISK)
DISK_TO_HOST = (Medium.DISK, Medium.HOST)
__all__ = ["DISK_TO_HOST", "HOST_TO_DISK", "SHUTDOWN_GRACE_S", "DiskHandler"]


@dataclass(frozen=True)
class _Block:
    slot: int
    key: OffloadKey
    path: str
    nbytes: int
    usable: bool
    """False in a fan-out directory that is a symbolic link: never read or written."""


@dataclass(eq=False)
class _Job(LowerJob[_Block]):
    remaining: int = 0
    """Blocks not done yet (``_new_job`` sets it to all of them)."""
    blockers: int = 0
    """Earlier unfinished jobs with the same destinations; this job starts when they finish."""
    dependents: list[_Job] = field(default_factory=list)
    written: list[str] = field(default_factory=list)

    def destinations(self) -> list[object]:
        return [b.path for b in self.blocks] if self.is_store else [b.slot for b in self.blocks]


class DiskHandler(LowerTierHandler[_Block, _Job]):
    """Host pool <-> block files of one rank. Register it for both (HOST, DISK) and (DISK, HOST).

    Args:
        config: the disk tier's settings (``path``, ``io_threads``, ``read_deadline_s``, breaker settings,
            ``shared_group``).
        pool: this worker's host pool; entries are read from and written to the start of its slots.
        namespace: this rank's namespace; its ``fingerprint()`` is written into and checked in every file.
        entry_bytes: payload bytes of one offload block of each KV-cache group
            (``factor * group_block_bytes(g)``).
        file_ops: the system-call seam (tests inject failures through it).
        clock: monotonic seconds, for read deadlines and the breaker's cool-down.
    Raises:
        ValueError: an entry does not fit in a host slot, or ``entry_bytes`` is empty or not positive.
        ConfigError: the rank directory cannot be created, or another user could write the tree (the
            scheduler's ``DiskIndex`` raises the same).
    """

    store_type = HOST_TO_DISK
    load_type = DISK_TO_HOST

    def __init__(self, config: DiskTierConfig, pool: HostPool, namespace: Namespace,
                 entry_bytes: tuple[int, ...], *, file_ops: FileOps | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(pool, namespace, entry_bytes, config.secret, clock)
        access = Access(config.shared_group)
        self._tree = open_tree(config.path, rank_directory(config.path, namespace, self._fmt), access, self._fmt)
        scan(self._tree)  # Removes temporary files a crashed writer left here.
        self._ops = file_ops or FileOps()
        if self._ops.file_mode != access.file_mode:
            self._ops.file_mode = access.file_mode
        self._deadline_s = config.read_deadline_s
        self.breaker = CircuitBreaker(config.breaker_errors, config.breaker_cooldown_s, clock)
        self._threads = IoThreads(config.io_threads, "kvoffload-disk", clock)
        self._last_writer: dict[object, _Job] = {}
        self._down = False
        self._removal_failures = 0
        self.unauthentic_blocks = 0
        """Block files refused because their MAC was not this tier's secret's (never loaded)."""

    @property
    def directory(self) -> str:
        return str(self._tree.rank_dir)

    def _block(self, slot: int, key: OffloadKey, nbytes: int) -> _Block:
        tree = self._tree
        return _Block(slot, key, block_path(tree.rank_dir, key, tree.fmt), nbytes, tree.usable(key))

    def _new_job(self, job: TransferJob, blocks: list[_Block]) -> _Job:
        return _Job(job, blocks, remaining=len(blocks))

    def _admit(self, state: _Job) -> bool:
        """Order ``state`` after the unfinished jobs with one of its destinations (``TransferHandler``'s rule)."""
        for dst in state.destinations():
            earlier = self._last_writer.get(dst)
            if earlier is not None and earlier is not state and state not in earlier.dependents:
                earlier.dependents.append(state)
                state.blockers += 1
            self._last_writer[dst] = state
        return state.blockers == 0

    def _release(self, state: _Job) -> list[_Job]:
        for dst in state.destinations():
            if self._last_writer.get(dst) is state:
                del self._last_writer[dst]
        return [d for d in state.dependents if _unblock(d)]

    def _stop(self) -> None:
        self._threads.stop()

    def _launch(self, state: _Job) -> None:
        state.start = self._clock()
        if not state.blocks or not self.breaker.allow() or self._all_stuck():
            self._end(state, failed=bool(state.blocks))
            return
        for block in state.blocks:
            self._threads.submit(functools.partial(self._run_block, state, block))

    def _run_block(self, state: _Job, block: _Block) -> None:
        ok = False
        try:
            ok = self._copy(state, block)
        except Exception:  # A data-path bug must fail the job, not kill an I/O thread silently.
            logger.exception("disk tier: unexpected error in job %d", state.job.job_id)
        with self._lock:
            if state.finished:
                return  # It failed at its deadline: its result is out.
            state.failed |= not ok
            state.copied += block.nbytes if ok else 0
            if ok and state.is_store:
                state.written.append(block.path)
            state.remaining -= 1
            last = state.remaining == 0
        if last:
            self._end(state, failed=False)

    def _copy(self, state: _Job, block: _Block) -> bool:
        """Move one block; False on any data-path failure (the breaker hears of all but plain misses)."""
        if state.failed or state.finished or not block.usable or not self.breaker.allow() or self._is_late(state):
            return False  # The job fails anyway (a block failed, tier off, deadline passed): skip the I/O.
        since = self.breaker.errors
        try:
            if state.is_store:
                write_block(self._ops, block.path, self._fingerprint, block.key,
                            self._slots[block.slot, :block.nbytes].data, self._fmt)
            elif not self._read(state, block):
                if not state.finished:
                    self.breaker.record(False)  # Late, not yet failed by its deadline: a slow disk.
                return False
        except FileNotFoundError:
            return False  # A miss (evicted by another engine sharing the directory), not a disk fault.
        except UnauthenticBlockError as e:
            self._note_unauthentic(e)  # someone without the secret wrote it: not the disk's fault
            self._unlink(block.path)
            return False
        except CorruptBlockError as e:
            self.breaker.record(False)
            self._discard(block.path, e)
            return False
        except OSError as e:
            self._note_io_error(state, e)
            return False
        self.breaker.record(True, since)
        return True

    def _read(self, state: _Job, block: _Block) -> bool:
        """Read the block off the disk, then put it into its slot if the job is live and on time (False if not)."""
        put = read_for_slot(self._ops, block.path, self._fingerprint, block.key, block.nbytes, self._fmt)
        with self._holding_slots(state) as held:
            if held:
                put(self._slots[block.slot, :block.nbytes].data)
        return held

    def _is_late(self, state: _Job) -> bool:
        """A read job past its deadline is a miss: the engine recomputes rather than wait on a slow disk."""
        return (not state.is_store and state.start is not None
                and self._clock() - state.start > self._deadline_s)

    def _wait_slice(self, state: _Job) -> float:
        """How long to wait for ``state`` before checking the deadlines again."""
        if state.is_store or state.start is None:
            return self._deadline_s
        return max(0.0, self._deadline_s - (self._clock() - state.start))

    def _expire(self) -> None:
        """Fail the read jobs past their deadline, even while their threads are stuck in a read."""
        with self._lock:
            late = [s for s in self._jobs.values() if not s.finished and self._is_late(s)]
        for state in late:
            if self._end(state, failed=True):
                self.breaker.record(False)
                logger.debug("disk tier: job %d failed at its %.1f s deadline", state.job.job_id, self._deadline_s)

    def _all_stuck(self) -> bool:
        """Whether every I/O thread has been stuck in one block for longer than the read deadline."""
        down = self._threads.stuck(self._deadline_s) >= self._threads.size
        if down != self._down:
            self._down = down
            if down:
                logger.error("disk tier: all %d I/O threads are stuck for more than %.1f s; disk jobs fail at "
                             "once until one comes back", self._threads.size, self._deadline_s)
            else:
                logger.warning("disk tier: an I/O thread came back; disk jobs run again")
        return down

    def _discard(self, path: str, why: Exception) -> None:
        logger.warning("disk tier: removing corrupt block file: %s", why)
        self._unlink(path)

    def _unlink(self, path: str) -> None:
        """Remove ``path``; failing to is an I/O error (a file system that turned read-only), logged once."""
        try:
            self._ops.unlink(path)
        except OSError as e:
            self.breaker.record(False)
            with self._lock:
                self._removal_failures += 1
                first = self._removal_failures == 1
            if first:
                logger.warning("disk tier: cannot remove block file %s: %s (later failures are logged at debug "
                               "level)", path, e)
            else:
                logger.debug("disk tier: cannot remove block file %s: %s", path, e)

    def _note_unauthentic(self, error: UnauthenticBlockError) -> None:
        with self._lock:
            self.unauthentic_blocks += 1
            first = self.unauthentic_blocks == 1
        if first:
            logger.warning("disk tier: a block failed authentication and was not loaded (%s); later ones are "
                           "counted and logged at debug level", error)
        else:
            logger.debug("disk tier: %s", error)

    def _note_io_error(self, state: _Job, error: OSError) -> None:
        self.breaker.record(False)
        if not self.breaker.is_open:
            logger.debug("disk tier: job %d: %s", state.job.job_id, error)

    def _settle(self, state: _Job) -> None:
        if state.failed:
            for path in state.written:  # A failed store is never indexed: leave none of its files behind.
                self._unlink(path)


def _unblock(dependent: _Job) -> bool:
    dependent.blockers -= 1
    return dependent.blockers == 0
