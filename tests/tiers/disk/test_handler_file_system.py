"""DiskHandler on a file system that misbehaves: reads that never return, a path that is not a slot file (a FIFO, a
symlink, a directory), a table entry that cannot be emptied (a file system turned read-only), and a directory tree
it must not trust; each a failed result or a clear error, never a hang and never a wrong block."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.tiers.disk.handlers import (
    ENTRY,
    NS,
    DiskHandlerContext,
    FakeClock,
    block_at,
    keys,
    load,
    make_pool,
    mode_of,
    names,
    prepare,
    run,
    store,
    write_at,
)

from kvoffload.blocks import TransferJob
from kvoffload.config import ConfigError, DiskTierConfig
from kvoffload.tiers.disk.file_io import FileOps
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.disk.paths import rank_directory, slot_file_path, world_directory
from kvoffload.tiers.lower.block_format import PLAIN
from kvoffload.transfer.base import TransferResult

# ---- reads that never return ----------------------------------------------------------------------------------

def finishes(handler: DiskHandler, job: TransferJob, within_s: float = 30.0) -> TransferResult | None:
    """``run``, but None instead of a hang when the job never finishes (the hang is the bug under test)."""
    assert handler.submit(job)
    waiter = threading.Thread(target=handler.wait, args=([job.job_id],), daemon=True)
    waiter.start()
    waiter.join(within_s)
    if waiter.is_alive():
        return None
    (result,) = [r for r in handler.get_finished() if r.job_id == job.job_id]
    return result


def unblock_fifo(path: Path) -> None:
    """Give a reader stuck opening the FIFO ``path`` its end of file (so a failing test does not hang)."""
    with contextlib.suppress(OSError):  # no reader waiting on it
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def _make_fifo(path: Path, genuine: Path) -> None:
    os.mkfifo(path)


def _make_directory(path: Path, genuine: Path) -> None:
    path.mkdir()


def _make_symlink(path: Path, genuine: Path) -> None:
    """A link to the genuine slot file (its blocks valid): refused all the same."""
    path.symlink_to(genuine)


@pytest.mark.parametrize("make", [_make_fifo, _make_directory, _make_symlink], ids=["fifo", "directory", "symlink"])
def test_what_is_not_a_regular_file_at_the_slot_file_path_is_refused_without_blocking(
        config: DiskTierConfig, tmp_path: Path, make: Callable[[Path, Path], None]) -> None:
    """A planted file or an accident: the genuine file moved away and something else made at its path. The
    handler neither reads nor writes through it, and never blocks on it (a FIFO would hold an I/O thread)."""
    (key,) = keys(1)
    with DiskHandlerContext(config, NS) as writer:
        assert run(writer, store((0,), (key,))).success
    path = Path(slot_file_path(rank_directory(config.path, NS), 0))
    genuine = tmp_path / "genuine.kvs"
    shutil.move(path, genuine)
    make(path, genuine)
    before = genuine.read_bytes()
    h = DiskHandler(config, make_pool(), NS, ENTRY)  # opens the path on its first job
    h._slots[1] = 0
    try:
        loaded = finishes(h, load((key,), (1,)))
        stored = finishes(h, store((2,), keys(1, salt=5)))
    finally:
        unblock_fifo(path)
        h.shutdown()
    assert loaded is not None and not loaded.success and not h._slots[1].any()
    assert stored is not None and not stored.success
    assert os.path.lexists(path)  # not removed, never replaced: only a scheduler makes slot files
    assert genuine.read_bytes() == before  # nothing written through a link


class StuckOps(FileOps):
    """Reads of blocks at offsets ``stuck`` says (a hung mount) block inside the read until ``release`` is set.
    ``entered`` counts the reads stuck so far; ``reads`` the block reads (not the file header's)."""

    def __init__(self) -> None:
        self.stuck: Callable[[int], bool] = lambda offset: False
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.reads = 0

    def pread_into(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset:
            self.reads += 1
        if self.stuck(offset):
            self.entered.release()
            self.release.wait()
        return super().pread_into(fd, buffers, offset)


def test_a_stuck_read_fails_its_job_at_the_deadline_and_the_tier_keeps_serving(config: DiskTierConfig) -> None:
    clock, ops = FakeClock(), StuckOps()
    prepare(config)
    h = DiskHandler(config, make_pool(), NS, ENTRY, file_ops=ops, clock=clock)
    try:
        stuck, fine = keys(2)
        assert run(h, store((0,), (stuck,))).success and run(h, store((1,), (fine,))).success
        h._slots[3] = 0
        at = block_at(config, stuck).offset
        ops.stuck = lambda offset: offset == at
        job = load((stuck,), (3,))
        assert h.submit(job)
        assert ops.entered.acquire(timeout=30)
        clock.now += 5.0  # past the 1 s deadline; the read has not returned
        (result,) = h.get_finished()
        assert result.job_id == job.job_id and not result.success
        assert run(h, load((fine,), (4,))).success  # the other I/O thread still serves
        assert bytes(h._slots[4, :48]) == bytes(h._slots[1, :48])
    finally:
        ops.release.set()
        h.shutdown()
    assert not h._slots[3].any()  # the late read never landed in a slot the job no longer owns
    assert names(config, stuck)  # a late read is no sign of damage: the block stays


def test_a_late_read_never_writes_a_host_slot_given_away_since(config: DiskTierConfig) -> None:
    """The late read returns a genuine, whole block after its job failed and its host slot was given to another
    block: the slot keeps what was put there since."""
    clock, ops = FakeClock(), StuckOps()
    prepare(config)
    h = DiskHandler(config, make_pool(), NS, ENTRY, file_ops=ops, clock=clock)
    try:
        (key,) = keys(1)
        assert run(h, store((0,), (key,))).success
        at = block_at(config, key).offset
        ops.stuck = lambda offset: offset == at
        assert h.submit(load((key,), (3,)))
        assert ops.entered.acquire(timeout=30)
        clock.now += 5.0
        assert [r.success for r in h.get_finished()] == [False]
        h._slots[3] = 7  # the scheduler gave the slot to another block
        ops.stuck = lambda offset: False
        ops.release.set()
        assert h._threads.wait_idle(30)  # the read came back and its task ended
        assert (h._slots[3] == 7).all()
    finally:
        ops.release.set()
        h.shutdown()


def test_shutdown_returns_while_a_read_is_stuck(config: DiskTierConfig) -> None:
    clock, ops = FakeClock(), StuckOps()
    prepare(config)
    h = DiskHandler(config, make_pool(), NS, ENTRY, file_ops=ops, clock=clock)
    (key,) = keys(1)
    assert run(h, store((0,), (key,))).success
    ops.stuck = lambda offset: offset >= block_at(config, key).offset
    try:
        assert h.submit(load((key,), (3,)))
        assert ops.entered.acquire(timeout=30)
        clock.now += 5.0
        closer = threading.Thread(target=h.shutdown, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive()
        assert [r.success for r in h.get_finished()] == [False]
    finally:
        ops.release.set()


def test_while_every_io_thread_is_stuck_jobs_fail_at_once_and_run_again_when_one_returns(
        config: DiskTierConfig) -> None:
    clock, ops = FakeClock(), StuckOps()
    prepare(config)
    h = DiskHandler(config, make_pool(), NS, ENTRY, file_ops=ops, clock=clock)  # two I/O threads
    try:
        ks = keys(3)
        for slot, key in enumerate(ks):
            assert run(h, store((slot,), (key,))).success
        data = min(block_at(config, k).offset for k in ks)
        ops.stuck = lambda offset: offset >= data  # every block read
        for slot, key in enumerate(ks[:2]):
            assert h.submit(load((key,), (4 + slot,)))
            assert ops.entered.acquire(timeout=30)
        clock.now += 5.0
        reads = ops.reads
        result = finishes(h, load(ks[2:], (6,)))
        assert result is not None and not result.success and ops.reads == reads  # failed without a read
        ops.stuck = lambda offset: False
        ops.release.set()
        assert h._threads.wait_idle(30)
        clock.now += 100.0  # past the breaker's cool-down too: the deadlines counted as errors
        assert run(h, load(ks[2:], (6,))).success
    finally:
        ops.release.set()
        h.shutdown()


# ---- an entry that cannot be emptied ----------------------------------------------------------------------------

class ReadOnlyOps(FileOps):
    """Writes fail with EROFS once ``read_only`` is set (the file system was remounted read-only)."""

    read_only = False

    def pwrite(self, fd: int, buffers: list[memoryview | bytes], offset: int) -> None:
        if self.read_only:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        super().pwrite(fd, buffers, offset)


def test_an_entry_that_cannot_be_emptied_is_an_io_error_logged_once(
        config: DiskTierConfig, caplog: pytest.LogCaptureFixture) -> None:
    ops = ReadOnlyOps()
    with DiskHandlerContext(config, NS, file_ops=ops) as h:
        (key,) = keys(1)
        assert run(h, store((0,), (key,))).success
        at = block_at(config, key)
        write_at(at.path, at.offset, b"garbage")
        ops.read_only = True
        with caplog.at_level(logging.DEBUG, logger="kvoffload"):
            for _ in range(2):
                assert not run(h, load((key,), (1,))).success
        assert [r for r in caplog.records if r.exc_info] == []
        assert len([r for r in caplog.records
                    if r.levelno >= logging.WARNING and "cannot empty the entry" in r.getMessage()]) == 1
        assert h.breaker.errors == 4  # each load: the corrupt block, and the entry that stayed
    assert names(config, key)  # it did stay: the next load fails again, never loads garbage


# ---- the tier's directory tree --------------------------------------------------------------------------------

def test_the_worker_refuses_a_world_writable_pre_created_tier_directory(config: DiskTierConfig) -> None:
    config.path.mkdir()
    config.path.chmod(0o777)
    with pytest.raises(ConfigError, match=f"{re.escape(str(config.path))}.*writable by others"):
        DiskHandler(config, make_pool(), NS, ENTRY)


def test_the_worker_never_writes_into_a_symlinked_rank_directory(config: DiskTierConfig, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    rank_dir = rank_directory(config.path, NS)
    rank_dir.parent.mkdir(parents=True, mode=0o700)
    config.path.chmod(0o700)
    rank_dir.symlink_to(victim, target_is_directory=True)
    with pytest.raises(ConfigError, match="symbolic link"):
        DiskHandler(config, make_pool(), NS, ENTRY)
    with pytest.raises(ConfigError, match="symbolic link"):
        prepare(config)
    assert list(victim.iterdir()) == []


def test_a_shared_group_tier_makes_group_readable_slot_and_lock_files(config: DiskTierConfig) -> None:
    shared = dataclasses.replace(config, shared_group=4242)
    index = DiskIndex.create(shared, NS, PLAIN.file_bytes(max(ENTRY)))  # the scheduler makes the files
    try:
        with DiskHandlerContext(shared, NS) as h:
            (key,) = keys(1)
            assert run(h, store((0,), (key,))).success
        world = world_directory(shared.path, NS)
        for path in (block_at(shared, key).path, world / "engine-0.lock", world / "engines.lock"):
            assert (mode_of(path), path.stat().st_gid) == (0o660, 4242), path
        for directory in (shared.path, world, world / "rank0"):
            assert (mode_of(directory), directory.stat().st_gid) == (0o2770, 4242), directory
    finally:
        index.close()


def test_a_disk_path_that_cannot_hold_the_tier_is_the_same_config_error_in_both_halves(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    config = DiskTierConfig(path=blocker / "disk")
    with pytest.raises(ConfigError, match=r"disk_path=.*cannot hold the disk tier") as worker:
        DiskHandler(config, make_pool(), NS, ENTRY)
    with pytest.raises(ConfigError, match=r"disk_path=.*cannot hold the disk tier") as scheduler:
        DiskIndex.create(config, NS, 1024)
    assert str(worker.value) == str(scheduler.value)
