"""DiskHandler on a file system that misbehaves: reads that never return, paths that are not block files (a FIFO,
a symlink), a corrupt file that cannot be removed, and a directory tree it must not trust; each a failed result or
a clear error, never a hang."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import stat
import threading
from pathlib import Path

import pytest
from tests.tiers.disk.handlers import (
    ENTRY,
    NS,
    DiskHandlerContext,
    FakeClock,
    keys,
    load,
    make_pool,
    path_of,
    run,
    store,
)

from kvoffload.blocks import TransferJob
from kvoffload.config import ConfigError, DiskTierConfig
from kvoffload.tiers.disk.file_io import FileOps
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.index import DiskIndex
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


def test_a_fifo_at_a_block_path_fails_its_load_without_blocking(
        handler: DiskHandler, config: DiskTierConfig) -> None:
    (key,) = keys(1)
    fifo = path_of(config, key)
    os.mkfifo(fifo)
    try:
        result = finishes(handler, load((key,), (0,)))
    finally:
        unblock_fifo(fifo)
    assert result is not None and not result.success
    assert not fifo.exists()  # not a block file: removed like a corrupt one


def test_a_symlink_at_a_block_path_is_never_followed(handler: DiskHandler, config: DiskTierConfig,
                                                     tmp_path: Path) -> None:
    a, b = keys(2)
    assert run(handler, store((0,), (a,))).success
    target = tmp_path / "target.kvb"
    target.write_bytes(path_of(config, a).read_bytes())
    path_of(config, a).unlink()
    path_of(config, a).symlink_to(target)  # a valid block, but behind a link
    assert not run(handler, load((a,), (1,))).success
    assert target.exists()
    path_of(config, b).symlink_to(tmp_path / "written-through-the-link")
    assert run(handler, store((2,), (b,))).success  # the link is replaced, never written through
    assert not (tmp_path / "written-through-the-link").exists() and not path_of(config, b).is_symlink()


class StuckOps(FileOps):
    """Reads of ``stuck_path`` (or of any path, with ``stuck_path`` "*") block inside the read until ``release``
    is set (a hung mount). ``entered`` counts the reads stuck so far."""

    def __init__(self) -> None:
        self.stuck_path = ""
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.reads = 0

    def read_into(self, path: str, buffers: list[memoryview]) -> int:
        self.reads += 1
        if self.stuck_path not in (path, "*"):
            return super().read_into(path, buffers)
        self.entered.release()
        self.release.wait()
        return super().read_into(path, buffers)


def test_a_stuck_read_fails_its_job_at_the_deadline_and_the_tier_keeps_serving(config: DiskTierConfig) -> None:
    clock, ops = FakeClock(), StuckOps()
    h = DiskHandler(config, make_pool(), NS, ENTRY, file_ops=ops, clock=clock)
    try:
        stuck, fine = keys(2)
        assert run(h, store((0,), (stuck,))).success and run(h, store((1,), (fine,))).success
        h._slots[3] = 0
        ops.stuck_path = str(path_of(config, stuck))
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


def test_shutdown_returns_while_a_read_is_stuck(config: DiskTierConfig) -> None:
    clock, ops = FakeClock(), StuckOps()
    h = DiskHandler(config, make_pool(), NS, ENTRY, file_ops=ops, clock=clock)
    (key,) = keys(1)
    assert run(h, store((0,), (key,))).success
    ops.stuck_path = str(path_of(config, key))
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


# ---- a corrupt file that cannot be removed --------------------------------------------------------------------

class ReadOnlyOps(FileOps):
    def unlink(self, path: str) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)


def test_a_corrupt_file_that_cannot_be_removed_is_an_io_error_logged_once(
        config: DiskTierConfig, caplog: pytest.LogCaptureFixture) -> None:
    with DiskHandlerContext(config, NS, file_ops=ReadOnlyOps()) as h:
        (key,) = keys(1)
        assert run(h, store((0,), (key,))).success
        path_of(config, key).write_bytes(b"garbage")
        with caplog.at_level(logging.DEBUG, logger="kvoffload"):
            for _ in range(2):
                assert not run(h, load((key,), (1,))).success
        assert [r for r in caplog.records if r.exc_info] == []
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING and "remove" in r.getMessage()]) == 1
        assert h.breaker.errors == 4  # each load: the corrupt file, and the failed removal


# ---- the tier's directory tree --------------------------------------------------------------------------------

def test_the_worker_refuses_a_world_writable_pre_created_tier_directory(config: DiskTierConfig) -> None:
    config.path.mkdir()
    config.path.chmod(0o777)
    with pytest.raises(ConfigError, match=f"{re.escape(str(config.path))}.*writable by others"):
        DiskHandler(config, make_pool(), NS, ENTRY)


def test_the_worker_never_writes_into_a_symlinked_fan_out_directory(config: DiskTierConfig, tmp_path: Path) -> None:
    (key,) = keys(1)
    victim = tmp_path / "victim"
    victim.mkdir()
    fan_out = path_of(config, key).parent
    fan_out.parent.mkdir(parents=True)
    fan_out.symlink_to(victim, target_is_directory=True)
    with DiskHandlerContext(config, NS) as h:
        assert not run(h, store((0,), (key,))).success
    assert list(victim.iterdir()) == []


def test_a_shared_group_tier_writes_group_readable_files(config: DiskTierConfig) -> None:
    shared = dataclasses.replace(config, shared_group=4242)
    with DiskHandlerContext(shared, NS) as h:
        (key,) = keys(1)
        assert run(h, store((0,), (key,))).success
    info = path_of(shared, key).stat()
    assert stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == 4242


def test_while_every_io_thread_is_stuck_jobs_fail_at_once_and_run_again_when_one_returns(
        config: DiskTierConfig) -> None:
    clock, ops = FakeClock(), StuckOps()
    h = DiskHandler(config, make_pool(), NS, ENTRY, file_ops=ops, clock=clock)  # two I/O threads
    try:
        ks = keys(3)
        for slot, key in enumerate(ks):
            assert run(h, store((slot,), (key,))).success
        ops.stuck_path = "*"
        for slot, key in enumerate(ks[:2]):
            assert h.submit(load((key,), (4 + slot,)))
            assert ops.entered.acquire(timeout=30)
        clock.now += 5.0
        reads = ops.reads
        result = finishes(h, load(ks[2:], (6,)))
        assert result is not None and not result.success and ops.reads == reads  # failed without a read
        ops.stuck_path = ""
        ops.release.set()
        assert h._threads.wait_idle(30)
        clock.now += 100.0  # past the breaker's cool-down too: the deadlines counted as errors
        assert run(h, load(ks[2:], (6,))).success
    finally:
        ops.release.set()
        h.shutdown()


def test_a_disk_path_that_cannot_hold_the_tier_is_the_same_config_error_in_both_halves(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    config = DiskTierConfig(path=blocker / "disk")
    with pytest.raises(ConfigError, match=r"disk_path=.*cannot hold the disk tier") as worker:
        DiskHandler(config, make_pool(), NS, ENTRY)
    with pytest.raises(ConfigError, match=r"disk_path=.*cannot hold the disk tier") as scheduler:
        DiskIndex.create(config, NS, 1024)
    assert str(worker.value) == str(scheduler.value)
