"""Worker side of the disk tier: copies blocks between the host pool and slot files, both ways.

The router sends this handler the jobs of (HOST, DISK) and (DISK, HOST). Each job is split into one task per block,
run on ``io_threads`` daemon threads (``IoThreads``); a task writes or reads the first ``max(entry_bytes)`` bytes of
a host slot (an entry of any KV-cache group: ``tiers.lower.handler`` says why) in the format of
``tiers.lower.block_format``, at the (engine, slot) ``location`` the spec names: one positioned write of the block
and one of its table entry, or one positioned read (``tiers.disk.file_io``). Slot files live in this rank's
directory, checked at start-up (``tiers.disk.tree.open_tree``), are opened once each and kept open, and their blocks
carry this rank's namespace fingerprint, so a block is only loaded by the rank and namespace that wrote it. A
replicated namespace (every rank holds the same bytes) has one directory and one fingerprint for all ranks: rank 0
writes it (the other ranks' handlers are wrapped in ``transfer.skip_writes.SkipWrites``) and every rank reads it.

Failures are outcomes: a missing file, a slot that holds another block now, a corrupt or foreign block, something
other than a regular file, an I/O error, or a read slower than ``read_deadline_s`` fails the job (its other blocks
are skipped). A failed write empties the table entries the job wrote, so no engine finds its blocks; a corrupt
block's entry is emptied too, and an entry that cannot be emptied is an I/O error. Repeated errors open a
``CircuitBreaker``: jobs then fail at once, without I/O.

Reads that never return (a hung mount): a read job fails when its deadline passes, whether or not its threads came
back (``get_finished``, ``wait`` and ``shutdown`` check the deadlines). A read lands in its thread's own buffer and
is copied into the host slot only while its job is live, so a late read never writes a slot that the scheduler has
since given to another block. While every I/O thread is stuck the tier is off (jobs fail at once). ``shutdown``
waits for reads until their deadline and for writes ``SHUTDOWN_GRACE_S`` at most, then fails what is left and leaves
stuck threads behind (they are daemons).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from kvoffload.blocks import Medium, TransferJob
from kvoffload.config import DiskTierConfig
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.disk.file_io import (
    FileOps,
    SlotFile,
    SlotReusedError,
    clear_entry,
    open_slot_file,
    read_run,
    write_run,
)
from kvoffload.tiers.disk.paths import rank_directory, slot_file_path
from kvoffload.tiers.disk.runs import DiskBlock, DiskJob, runs
from kvoffload.tiers.disk.slot_file import split_location
from kvoffload.tiers.disk.tree import Access, open_tree
from kvoffload.tiers.lower.block_format import CorruptBlockError, UnauthenticBlockError
from kvoffload.tiers.lower.breaker import CircuitBreaker
from kvoffload.tiers.lower.handler import SHUTDOWN_GRACE_S, LowerTierHandler
from kvoffload.tiers.lower.io_threads import IoThreads

if TYPE_CHECKING:
    from kvoffload.transfer.host_pool import HostPool

logger = logging.getLogger(__name__)

HOST_TO_DISK = (Medium.HOST, Medium.DISK)
DISK_TO_HOST = (Medium.DISK, Medium.HOST)
__all__ = ["DISK_TO_HOST", "HOST_TO_DISK", "SHUTDOWN_GRACE_S", "DiskHandler"]
class DiskHandler(LowerTierHandler[DiskBlock, DiskJob]):
    """Host pool <-> the slot files of one rank. Register it for both (HOST, DISK) and (DISK, HOST).

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
        self._files: dict[int, SlotFile] = {}
        self._retired: list[SlotFile] = []
        self._ops = file_ops or FileOps()
        if self._ops.file_mode != access.file_mode:
            self._ops.file_mode = access.file_mode
        self._deadline_s = config.read_deadline_s
        self.breaker = CircuitBreaker(config.breaker_errors, config.breaker_cooldown_s, clock)
        self._threads = IoThreads(config.io_threads, "kvoffload-disk", clock)
        self._last_writer: dict[object, DiskJob] = {}
        self._down = False
        self._removal_failures = 0
        self.unauthentic_blocks = 0
        """Blocks refused because their MAC was not this tier's secret's (never loaded)."""

    @property
    def directory(self) -> str:
        return str(self._tree.rank_dir)

    def _block(self, slot: int, key: OffloadKey, nbytes: int) -> DiskBlock:
        return DiskBlock(slot, key, nbytes)

    def _plan(self, job: TransferJob) -> DiskJob:
        state = super()._plan(job)
        places = self._sides(job)[1].slots
        if len(places) != len(state.blocks):
            raise ValueError(f"job {job.job_id}: the disk tier's spec names no slot for its keys")
        state.blocks = [replace(b, place=p) for b, p in zip(state.blocks, places, strict=True)]
        return state

    def _new_job(self, job: TransferJob, blocks: list[DiskBlock]) -> DiskJob:
        return DiskJob(job, blocks, remaining=len(blocks))

    def _admit(self, state: DiskJob) -> bool:
        """Order ``state`` after the unfinished jobs with one of its destinations (``TransferHandler``'s rule)."""
        for dst in state.destinations():
            earlier = self._last_writer.get(dst)
            if earlier is not None and earlier is not state and state not in earlier.dependents:
                earlier.dependents.append(state)
                state.blockers += 1
            self._last_writer[dst] = state
        return state.blockers == 0

    def _release(self, state: DiskJob) -> list[DiskJob]:
        for dst in state.destinations():
            if self._last_writer.get(dst) is state:
                del self._last_writer[dst]
        return [d for d in state.dependents if _unblock(d)]

    def _stop(self) -> None:
        self._threads.stop()
        with self._lock:
            files, self._files = [*self._files.values(), *self._retired], {}
            self._retired = []
        for file in files:
            with contextlib.suppress(OSError):
                self._ops.close(file.fd)

    def _file(self, engine: int) -> SlotFile:
        """Engine ``engine``'s slot file in this rank's directory, opened on first use and kept open.

        Raises:
            FileNotFoundError: there is none (its engine's files were trimmed); OSError, CorruptBlockError: it
                cannot be opened or is not a slot file.
        """
        file = self._files.get(engine)
        if file is None:
            opened = open_slot_file(self._ops, slot_file_path(self._tree.rank_dir, engine))
            with self._lock:
                file = self._files.setdefault(engine, opened)
            if file is not opened:
                self._ops.close(opened.fd)
        return file

    def _reopen(self, file: SlotFile) -> None:
        """After a failed read: open the file again on next use if another file stands at its path now (a
        trimmed and remade file of that engine number). The old descriptor is closed at shutdown only, as another
        thread may be reading through it."""
        try:
            if os.path.samestat(os.stat(file.path, follow_symlinks=False), os.fstat(file.fd)):
                return
        except OSError:
            pass  # gone: open it again (and fail then) next time
        with self._lock:
            for engine in [e for e, open_file in self._files.items() if open_file is file]:
                del self._files[engine]
                self._retired.append(file)

    def _launch(self, state: DiskJob) -> None:
        state.start = self._clock()
        if not state.blocks or not self.breaker.allow() or self._all_stuck():
            self._end(state, failed=bool(state.blocks))
            return
        for run in runs(state.blocks, self._threads.size):
            self._threads.submit(functools.partial(self._run_task, state, run))

    def _run_task(self, state: DiskJob, run: list[DiskBlock]) -> None:
        ok = False
        try:
            ok = self._copy(state, run)
        except Exception:  # A data-path bug must fail the job, not kill an I/O thread silently.
            logger.exception("disk tier: unexpected error in job %d", state.job.job_id)
        with self._lock:
            if state.finished:
                return  # It failed at its deadline: its result is out.
            state.failed |= not ok
            if ok:
                state.copied += sum(b.nbytes for b in run)
                if state.is_store:
                    state.written.extend(run)
            state.remaining -= len(run)
            last = state.remaining == 0
        if last:
            self._end(state, failed=False)

    def _copy(self, state: DiskJob, run: list[DiskBlock]) -> bool:
        """Move a run of blocks at consecutive slots; False on any data-path failure (the breaker hears of all but
        plain misses)."""
        if state.failed or state.finished or not self.breaker.allow() or self._is_late(state):
            return False  # The job fails anyway (a block failed, tier off, deadline passed): skip the I/O.
        since = self.breaker.errors
        engine, first = split_location(run[0].place)
        file = None
        try:
            file = self._file(engine)
            if not state.is_store:
                return self._read(state, run, file, first)
            write_run(self._ops, file, first, [b.key for b in run],
                      [self._slots[b.slot, :b.nbytes].data for b in run], self._fingerprint, self._fmt)
        except FileNotFoundError as e:
            if state.is_store:  # this engine's own file is gone: a fault, or every store would fail unseen
                self._note_io_error(state, e)
            self._reopen_after(file)
            return False  # A load's miss (its engine's files were trimmed), not a disk fault.
        except CorruptBlockError as e:  # not a slot file where one should be
            self.breaker.record(False)
            logger.warning("disk tier: %s", e)
            return False
        except OSError as e:
            self._note_io_error(state, e)
            return False
        self.breaker.record(True, since)
        return True

    def _read(self, state: DiskJob, run: list[DiskBlock], file: SlotFile, first: int) -> bool:
        """Read the run off the disk, then put it into its host slots if the job is live and on time."""
        since = self.breaker.errors
        puts = read_run(self._ops, file, first, [b.key for b in run], run[0].nbytes, self._fingerprint, self._fmt)
        for i, put in enumerate(puts):
            if isinstance(put, CorruptBlockError):
                return self._bad_block(file, first + i, run[i].key, put)
        bad: tuple[int, CorruptBlockError] | None = None
        with self._holding_slots(state) as held:
            for i, block in enumerate(run if held else ()):
                try:
                    puts[i](self._slots[block.slot, :block.nbytes].data)  # type: ignore[operator]
                except CorruptBlockError as e:  # a sealed block that does not open
                    bad = (i, e)
                    break
        if bad is not None:
            return self._bad_block(file, first + bad[0], run[bad[0]].key, bad[1])
        if not held:
            if not state.finished:
                self.breaker.record(False)  # Late, not yet failed by its deadline: a slow disk.
            return False
        self.breaker.record(True, since)
        return True

    def _bad_block(self, file: SlotFile, slot: int, key: OffloadKey, error: CorruptBlockError) -> bool:
        """A slot that does not hold ``key``'s block: a miss when it was reused, else its entry is emptied."""
        if isinstance(error, SlotReusedError):
            self._reopen(file)
            return False
        if isinstance(error, UnauthenticBlockError):
            self._note_unauthentic(error)  # someone without the secret wrote it: not the disk's fault
        else:
            self.breaker.record(False)
            logger.warning("disk tier: dropping a corrupt block: %s", error)
        self._clear(file, slot, key)
        self._reopen(file)
        return False

    def _is_late(self, state: DiskJob) -> bool:
        """A read job past its deadline is a miss: the engine recomputes rather than wait on a slow disk."""
        return (not state.is_store and state.start is not None
                and self._clock() - state.start > self._deadline_s)

    def _wait_slice(self, state: DiskJob) -> float:
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

    def _reopen_after(self, file: SlotFile | None) -> None:
        if file is not None:
            self._reopen(file)

    def _clear(self, file: SlotFile | None, slot: int, key: OffloadKey) -> None:
        """Empty ``slot``'s entry if it names ``key``; failing to is an I/O error (a file system that turned
        read-only), logged once."""
        if file is None:
            return
        try:
            clear_entry(self._ops, file, slot, key, self._fmt)
        except OSError as e:
            self.breaker.record(False)
            with self._lock:
                self._removal_failures += 1
                first = self._removal_failures == 1
            if first:
                logger.warning("disk tier: cannot empty the entry of slot %d of %s: %s (later failures are logged "
                               "at debug level)", slot, file.path, e)
            else:
                logger.debug("disk tier: cannot empty the entry of slot %d of %s: %s", slot, file.path, e)

    def _note_unauthentic(self, error: UnauthenticBlockError) -> None:
        with self._lock:
            self.unauthentic_blocks += 1
            first = self.unauthentic_blocks == 1
        if first:
            logger.warning("disk tier: a block failed authentication and was not loaded (%s); later ones are "
                           "counted and logged at debug level", error)
        else:
            logger.debug("disk tier: %s", error)

    def _note_io_error(self, state: DiskJob, error: OSError) -> None:
        self.breaker.record(False)
        if not self.breaker.is_open:
            logger.debug("disk tier: job %d: %s", state.job.job_id, error)

    def _settle(self, state: DiskJob) -> None:
        if state.failed:
            for block in state.written:  # A failed store is never indexed: no engine may find its blocks.
                engine, slot = split_location(block.place)
                self._clear(self._files.get(engine), slot, block.key)


def _unblock(dependent: DiskJob) -> bool:
    dependent.blockers -= 1
    return dependent.blockers == 0
