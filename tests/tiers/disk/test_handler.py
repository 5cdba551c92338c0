"""DiskHandler: host pool <-> block files, and every data-path fault as a failed result."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvoffload.config import ConfigError, DiskTierConfig
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.specs import DiskBlocks, HostBlocks, JobId, Medium, TransferJob
from kvoffload.tiers.disk.file_io import FileOps
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.lower.block_format import block_path, rank_directory
from kvoffload.transfer.base import TransferResult
from kvoffload.transfer.host_pool import HostPool

NS = Namespace(model="m", dtype="bf16", layout="pages=64")
ENTRY = (48, 32)  # two KV-cache groups with different block sizes
SLOT = 64


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FailingOps(FileOps):
    """The OS, except that writes (or reads) raise ``error`` and each call is counted."""

    def __init__(self, write_error: int | None = None, read_error: int | None = None,
                 fail_after: int = 0) -> None:
        self.write_error, self.read_error, self.fail_after = write_error, read_error, fail_after
        self.calls = 0

    def write_new(self, path: str, buffers: list[memoryview | bytes]) -> None:
        self.calls += 1
        if self.write_error is not None and self.calls > self.fail_after:
            raise OSError(self.write_error, os.strerror(self.write_error), path)
        super().write_new(path, buffers)

    def read_into(self, path: str, buffers: list[memoryview]) -> int:
        self.calls += 1
        if self.read_error is not None:
            raise OSError(self.read_error, os.strerror(self.read_error), path)
        return super().read_into(path, buffers)


def keys(n: int, salt: int = 0) -> tuple[OffloadKey, ...]:
    return tuple(offload_key(bytes([salt, i]) * 8, 0) for i in range(n))  # type: ignore[arg-type]


def make_pool(slots: int = 8) -> HostPool:
    pool = HostPool(slots, SLOT)
    pool.buffer.copy_(torch.randint(-128, 128, (slots, SLOT), dtype=torch.int8))
    return pool


@pytest.fixture
def config(tmp_path: Path) -> DiskTierConfig:
    return DiskTierConfig(path=tmp_path / "disk", io_threads=2, breaker_errors=3, breaker_cooldown_s=10.0,
                          read_deadline_s=1.0)


@pytest.fixture
def handler(config: DiskTierConfig) -> Iterator[DiskHandler]:
    h = DiskHandler(config, make_pool(), NS, ENTRY)
    yield h
    h.shutdown()


_ids = iter(range(1, 1 << 30))


Groups = tuple[int, ...] | None


def store(slots: tuple[int, ...], ks: tuple[OffloadKey, ...], groups: Groups = None) -> TransferJob:
    groups = groups or (len(slots),)
    return TransferJob(JobId(next(_ids)), HostBlocks(slots, groups), DiskBlocks(ks, groups))


def load(ks: tuple[OffloadKey, ...], slots: tuple[int, ...], groups: Groups = None) -> TransferJob:
    groups = groups or (len(slots),)
    return TransferJob(JobId(next(_ids)), DiskBlocks(ks, groups), HostBlocks(slots, groups))


def run(handler: DiskHandler, job: TransferJob) -> TransferResult:
    assert handler.submit(job)
    handler.wait([job.job_id])
    (result,) = [r for r in handler.get_finished() if r.job_id == job.job_id]
    return result


def path_of(config: DiskTierConfig, key: OffloadKey, ns: Namespace = NS) -> Path:
    return Path(block_path(rank_directory(config.path, ns), key))


def test_store_then_load_round_trips_both_groups_bit_exact(handler: DiskHandler) -> None:
    h_pool = handler._slots  # the handler's own pool rows
    ks = keys(3)
    expected = [bytes(h_pool[s, :48]) for s in (0, 1, 2)]
    stored = run(handler, store((0, 1, 2), ks, (2, 1)))
    assert stored.success and stored.bytes == 3 * 48  # any group's entry moves the largest group's bytes
    assert stored.transfer_type == (Medium.HOST, Medium.DISK)
    h_pool[5:8] = 0
    loaded = run(handler, load(ks, (5, 6, 7), (2, 1)))
    assert loaded.success and loaded.transfer_type == (Medium.DISK, Medium.HOST)
    assert [bytes(h_pool[s, :48]) for s in (5, 6, 7)] == expected


def test_files_are_private_named_by_key_and_no_temporary_file_remains(
        handler: DiskHandler, config: DiskTierConfig) -> None:
    ks = keys(2)
    assert run(handler, store((0, 1), ks)).success
    for key in ks:
        path = path_of(config, key)
        assert path.name == key.hex() + ".kvb" and path.parent.name == key.hex()[:2]
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(rank_directory(config.path, NS).stat().st_mode) == 0o700
    assert not list(config.path.rglob("*.tmp"))


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "append", "flip_header"])
def test_damaged_file_fails_its_load_and_is_removed(
        handler: DiskHandler, config: DiskTierConfig, damage: str) -> None:
    (key,) = keys(1)
    assert run(handler, store((0,), (key,))).success
    path = path_of(config, key)
    raw = bytearray(path.read_bytes())
    if damage == "flip_payload":
        raw[-1] ^= 0xFF
    elif damage == "flip_header":
        raw[20] ^= 0x01
    elif damage == "truncate":
        raw = raw[:-5]
    else:
        raw += b"x"
    path.write_bytes(raw)
    assert not run(handler, load((key,), (3,))).success
    assert not path.exists()


def test_block_of_another_namespace_is_never_loaded(handler: DiskHandler, config: DiskTierConfig) -> None:
    other = Namespace(model="other", dtype="bf16", layout="pages=64")
    with DiskHandlerContext(config, other) as foreign:
        (key,) = keys(1)
        assert run(foreign, store((0,), (key,))).success
        # Planted where this namespace looks for the key: its header still names the other namespace.
        path_of(config, key).write_bytes(path_of(config, key, other).read_bytes())
    assert not run(handler, load((key,), (1,))).success


def test_missing_file_fails_the_load_without_counting_as_a_disk_fault(handler: DiskHandler) -> None:
    for _ in range(5):
        assert not run(handler, load(keys(1, salt=9), (0,))).success
    assert not handler.breaker.is_open


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_write_error_fails_the_store_and_leaves_no_file(config: DiskTierConfig, code: int) -> None:
    ops = FailingOps(write_error=code, fail_after=2)  # the first two blocks are written, the third fails
    with DiskHandlerContext(config, NS, file_ops=ops) as h:
        ks = keys(3)
        result = run(h, store((0, 1, 2), ks))
        assert not result.success and result.bytes == 0
        assert not any(path_of(config, k).exists() for k in ks)
        assert not list(config.path.rglob("*.tmp"))
        assert run(h, load(ks[:1], (4,))).success is False  # nothing was kept


def test_repeated_errors_open_the_breaker_once_then_it_closes_after_cooldown(
        config: DiskTierConfig, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    ops = FailingOps(write_error=errno.EIO)
    with caplog.at_level(logging.ERROR), DiskHandlerContext(config, NS, file_ops=ops, clock=clock) as h:
        for salt in range(6):
            assert not run(h, store((0,), keys(1, salt))).success
        assert h.breaker.is_open and ops.calls == 3  # later jobs failed without touching the disk
        assert len([r for r in caplog.records if "switching the disk tier off" in r.message]) == 1
        ops.write_error = None
        clock.now += 11.0
        assert run(h, store((0,), keys(1, 42))).success


def test_read_slower_than_deadline_is_a_miss(config: DiskTierConfig) -> None:
    clock = FakeClock()

    class SlowOps(FileOps):
        def read_into(self, path: str, buffers: list[memoryview]) -> int:
            clock.now += 5.0  # this read takes 5 s, over the 1 s deadline
            return super().read_into(path, buffers)

    with DiskHandlerContext(config, NS, file_ops=SlowOps(), clock=clock) as h:
        ks = keys(1)
        assert run(h, store((0,), ks)).success
        assert not run(h, load(ks, (1,))).success


def test_jobs_to_the_same_destination_complete_in_submission_order(config: DiskTierConfig) -> None:
    gate = threading.Event()

    class GatedOps(FileOps):
        def write_new(self, path: str, buffers: list[memoryview | bytes]) -> None:
            gate.wait()
            super().write_new(path, buffers)

    with DiskHandlerContext(config, NS, file_ops=GatedOps()) as h:
        (key,) = keys(1)
        first, second = store((0,), (key,)), store((1,), (key,))
        assert h.submit(first) and h.submit(second)
        gate.set()
        h.wait([first.job_id, second.job_id])
        assert [r.job_id for r in h.get_finished()] == [first.job_id, second.job_id]
        assert run(h, load((key,), (2,))).success
        assert bytes(h._slots[2, :48]) == bytes(h._slots[1, :48])


def test_malformed_jobs_raise_value_error(handler: DiskHandler) -> None:
    with pytest.raises(ValueError, match="outside the pool"):
        handler.submit(store((99,), keys(1)))
    with pytest.raises(ValueError, match="does not move"):
        handler.submit(TransferJob(JobId(1), DiskBlocks(keys(1), (1,)), DiskBlocks(keys(1), (1,))))
    with pytest.raises(ValueError, match="skip_sub_blocks"):
        handler.submit(TransferJob(JobId(2), HostBlocks((0,), (1,), 1), DiskBlocks(keys(1), (1,))))


def test_entry_larger_than_a_host_slot_is_rejected(config: DiskTierConfig) -> None:
    with pytest.raises(ValueError, match="entry_bytes"):
        DiskHandler(config, make_pool(), NS, (SLOT + 1,))


def test_submit_after_shutdown_is_refused(config: DiskTierConfig) -> None:
    h = DiskHandler(config, make_pool(), NS, ENTRY)
    h.shutdown()
    h.shutdown()
    assert h.submit(store((0,), keys(1))) is False


def test_each_rank_writes_under_its_own_directory(config: DiskTierConfig) -> None:
    rank1 = Namespace(model="m", dtype="bf16", layout="pages=64", rank=1, world_size=2)
    rank0 = Namespace(model="m", dtype="bf16", layout="pages=64", rank=0, world_size=2)
    with DiskHandlerContext(config, rank1) as h:
        (key,) = keys(1)
        assert run(h, store((0,), (key,))).success
    assert path_of(config, key, rank1).exists() and not path_of(config, key, rank0).exists()
    world = path_of(config, key, rank0).parent.parent.parent
    assert path_of(config, key, rank1).parent.parent.parent == world


class DiskHandlerContext:
    """A handler over a fresh pool, shut down on exit."""

    def __init__(self, config: DiskTierConfig, ns: Namespace, **kwargs: object) -> None:
        self.handler = DiskHandler(config, make_pool(), ns, ENTRY, **kwargs)  # type: ignore[arg-type]

    def __enter__(self) -> DiskHandler:
        return self.handler

    def __exit__(self, *exc: object) -> None:
        self.handler.shutdown()


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
