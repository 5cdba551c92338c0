"""DiskHandler: host pool <-> block files, and every data-path fault as a failed result (on a file system that
misbehaves: test_handler_file_system.py; with a secret: test_handler_auth.py)."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading

import pytest
from tests.tiers.disk.handlers import (
    ENTRY,
    NS,
    SLOT,
    DiskHandlerContext,
    FakeClock,
    keys,
    load,
    make_pool,
    path_of,
    run,
    store,
)

from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
from kvoffload.config import DiskTierConfig
from kvoffload.keys import Namespace
from kvoffload.tiers.disk.file_io import FileOps
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.paths import rank_directory


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
        both = TierBlocks(Medium.DISK, keys(1), (1,))
        handler.submit(TransferJob(JobId(1), both, both))
    with pytest.raises(ValueError, match="skip_sub_blocks"):
        handler.submit(TransferJob(JobId(2), HostBlocks((0,), (1,), 1), TierBlocks(Medium.DISK, keys(1), (1,))))


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
