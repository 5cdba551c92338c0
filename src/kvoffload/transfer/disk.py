"""Worker side of the disk tier: copies blocks between the host pool and block files, both ways.

The router sends this handler the jobs of (HOST, DISK) and (DISK, HOST). Each job is split into one task per
block, run on ``io_threads`` threads; a task writes or reads the first ``entry_bytes[g]`` bytes of a host slot
(for an entry of KV-cache group ``g``) in the format of ``disk_format``. Files live in this rank's directory
(checked at start-up by ``disk_tree.open_tree``) and carry this rank's namespace fingerprint, so a block is
only loaded by the rank and namespace that wrote it.

Failures are outcomes: a missing, corrupt or foreign file, an I/O error, or a read slower than
``read_deadline_s`` fails the job (its other blocks are skipped). A failed write removes the files the job
wrote, so nothing unindexed stays on disk; a corrupt file is removed. Repeated errors open a
``CircuitBreaker``: jobs then fail at once, without I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffload.config import DiskTierConfig
from kvoffload.disk_format import CorruptBlockError, GroupedLayout, block_path, entry_bytes_of, rank_directory
from kvoffload.disk_tree import Access, open_tree, scan
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.specs import DiskBlocks, HostBlocks, JobId, Medium, TransferJob
from kvoffload.transfer.base import TransferHandler, TransferResult
from kvoffload.transfer.disk_breaker import CircuitBreaker
from kvoffload.transfer.disk_io import FileOps, read_block, write_block

if TYPE_CHECKING:
    from kvoffload.transfer.host_pool import HostPool

logger = logging.getLogger(__name__)

HOST_TO_DISK = (Medium.HOST, Medium.DISK)
DISK_TO_HOST = (Medium.DISK, Medium.HOST)


@dataclass(frozen=True)
class _Block:
    slot: int
    key: OffloadKey
    path: str
    nbytes: int
    usable: bool
    """False in a fan-out directory that is a symbolic link: never read or written."""


@dataclass(eq=False)
class _Job:
    job: TransferJob
    blocks: list[_Block]
    remaining: int
    blockers: int = 0
    """Earlier unfinished jobs with the same destinations; this job starts when they finish."""
    dependents: list[_Job] = field(default_factory=list)
    start: float = 0.0
    failed: bool = False
    copied: int = 0
    written: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def is_write(self) -> bool:
        return self.job.transfer_type == HOST_TO_DISK

    def destinations(self) -> list[object]:
        return [b.path for b in self.blocks] if self.is_write else [b.slot for b in self.blocks]


class DiskHandler(TransferHandler):
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
            scheduler's ``DiskTierManager`` raises the same).
    """

    def __init__(self, config: DiskTierConfig, pool: HostPool, namespace: Namespace,
                 entry_bytes: tuple[int, ...], *, file_ops: FileOps | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        slots = pool.buffer.numpy()
        if not entry_bytes or any(n <= 0 or n > slots.shape[1] for n in entry_bytes):
            raise ValueError(f"DiskHandler entry_bytes {entry_bytes} must be positive and fit a host slot of "
                             f"{slots.shape[1]} bytes")
        self._slots = slots
        self._entry_bytes = entry_bytes
        self._fingerprint = namespace.fingerprint()
        access = Access(config.shared_group)
        self._tree = open_tree(config.path, rank_directory(config.path, namespace), access)
        scan(self._tree)  # Removes temporary files a crashed writer left here.
        self._ops = file_ops or FileOps()
        if self._ops.file_mode != access.file_mode:
            self._ops.file_mode = access.file_mode
        self._clock = clock
        self._deadline_s = config.read_deadline_s
        self.breaker = CircuitBreaker(config.breaker_errors, config.breaker_cooldown_s, clock)
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvoffload-disk")
        self._lock = threading.Lock()
        self._jobs: dict[JobId, _Job] = {}
        self._last_writer: dict[object, _Job] = {}
        self._finished: list[TransferResult] = []
        self._closed = False

    @classmethod
    def create(cls, config: DiskTierConfig, pool: HostPool, namespace: Namespace, layout: GroupedLayout,
               factor: int) -> DiskHandler:
        """The handler of one worker: entries of group ``g`` are ``factor * layout.group_block_bytes(g)``."""
        return cls(config, pool, namespace, entry_bytes_of(layout, factor))

    @property
    def directory(self) -> str:
        return str(self._tree.rank_dir)

    def submit(self, job: TransferJob) -> bool:
        state = self._plan(job)
        with self._lock:
            if self._closed:
                return False
            self._jobs[job.job_id] = state
            for dst in state.destinations():
                earlier = self._last_writer.get(dst)
                if earlier is not None and earlier is not state and state not in earlier.dependents:
                    earlier.dependents.append(state)
                    state.blockers += 1
                self._last_writer[dst] = state
            ready = state.blockers == 0
        if ready:
            self._dispatch(state)
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: Collection[JobId]) -> None:
        with self._lock:
            states = [self._jobs[j] for j in job_ids if j in self._jobs]
        for state in states:
            state.done.wait()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            states = list(self._jobs.values())
        for state in states:
            state.done.wait()
        self._executor.shutdown(wait=True)

    def _plan(self, job: TransferJob) -> _Job:
        """Validate a job and list its blocks (a malformed job is a scheduler bug: ValueError)."""
        if job.transfer_type == HOST_TO_DISK:
            host, disk = job.src, job.dst
        elif job.transfer_type == DISK_TO_HOST:
            host, disk = job.dst, job.src
        else:
            raise ValueError(f"job {job.job_id}: DiskHandler does not move {job.transfer_type}")
        assert isinstance(host, HostBlocks) and isinstance(disk, DiskBlocks)
        if host.group_sizes != disk.group_sizes or len(host.group_sizes) > len(self._entry_bytes):
            raise ValueError(f"job {job.job_id}: group sizes {host.group_sizes} and {disk.group_sizes} "
                             f"differ or exceed the {len(self._entry_bytes)} groups of this tier")
        if host.skip_sub_blocks:
            raise ValueError(f"job {job.job_id}: skip_sub_blocks is not supported between host and disk")
        if any(not 0 <= s < self._slots.shape[0] for s in host.slots):
            raise ValueError(f"job {job.job_id}: a slot of {host.slots} is outside the pool")
        groups = [g for g, n in enumerate(host.group_sizes) for _ in range(n)]
        tree = self._tree
        blocks = [_Block(s, k, block_path(tree.rank_dir, k), self._entry_bytes[g], tree.usable(k))
                  for s, k, g in zip(host.slots, disk.keys, groups, strict=True)]
        return _Job(job, blocks, remaining=len(blocks))

    def _dispatch(self, state: _Job) -> None:
        state.start = self._clock()
        if not state.blocks or not self.breaker.allow():
            state.failed = bool(state.blocks)
            self._finish(state)
            return
        for block in state.blocks:
            self._executor.submit(self._run_block, state, block)

    def _run_block(self, state: _Job, block: _Block) -> None:
        ok = False
        try:
            ok = self._copy(state, block)
        except Exception:  # A data-path bug must fail the job, not kill an I/O thread silently.
            logger.exception("disk tier: unexpected error in job %d", state.job.job_id)
        with self._lock:
            state.failed |= not ok
            state.copied += block.nbytes if ok else 0
            if ok and state.is_write:
                state.written.append(block.path)
            state.remaining -= 1
            last = state.remaining == 0
        if last:
            self._finish(state)

    def _copy(self, state: _Job, block: _Block) -> bool:
        """Move one block; False on any data-path failure (the breaker hears of all but plain misses)."""
        if state.failed or not block.usable or not self.breaker.allow() or self._is_late(state):
            return False  # The job fails anyway (a block failed, tier off, deadline passed): skip the I/O.
        payload = self._slots[block.slot, :block.nbytes].data
        try:
            if state.is_write:
                write_block(self._ops, block.path, self._fingerprint, block.key, payload)
            else:
                read_block(self._ops, block.path, self._fingerprint, block.key, payload)
        except FileNotFoundError:
            return False  # A miss (evicted by another engine sharing the directory), not a disk fault.
        except CorruptBlockError as e:
            logger.warning("disk tier: removing corrupt block file: %s", e)
            self._ops.unlink(block.path)
            self.breaker.record(False)
            return False
        except OSError as e:
            self._note_io_error(state, e)
            return False
        late = self._is_late(state)
        self.breaker.record(not late)
        return not late

    def _is_late(self, state: _Job) -> bool:
        """A read job past its deadline is a miss: the engine recomputes rather than wait on a slow disk."""
        return not state.is_write and self._clock() - state.start > self._deadline_s

    def _note_io_error(self, state: _Job, error: OSError) -> None:
        self.breaker.record(False)
        if not self.breaker.is_open:
            logger.debug("disk tier: job %d: %s", state.job.job_id, error)

    def _finish(self, state: _Job) -> None:
        if state.failed and state.written:
            for path in state.written:  # A failed store is never indexed: leave none of its files behind.
                self._ops.unlink(path)
        result = TransferResult(state.job.job_id, not state.failed, state.copied if not state.failed else 0,
                                self._clock() - state.start, state.job.transfer_type)
        with self._lock:
            self._finished.append(result)
            del self._jobs[state.job.job_id]
            for dst in state.destinations():
                if self._last_writer.get(dst) is state:
                    del self._last_writer[dst]
            released = [d for d in state.dependents if _release(d)]
        state.done.set()
        for dependent in released:
            self._dispatch(dependent)


def _release(dependent: _Job) -> bool:
    dependent.blockers -= 1
    return dependent.blockers == 0
