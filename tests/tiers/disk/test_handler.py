"""DiskHandler: host pool <-> slot files, and every data-path fault as a failed result, never a wrong block (on a
file system that misbehaves: test_handler_file_system.py; with a secret: test_handler_auth.py; slot files changed
under running handlers, and two engines: test_handler_regions.py)."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import struct
import threading
import zlib

import pytest
from tests.tiers.disk.handlers import (
    ENTRY,
    NS,
    SLOT,
    DiskHandlerContext,
    FakeClock,
    at_engine,
    at_places,
    block_at,
    keys,
    load,
    make_pool,
    mode_of,
    names,
    read_block,
    run,
    store,
    write_at,
)

from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
from kvoffload.config import DiskTierConfig
from kvoffload.keys import Namespace
from kvoffload.tiers.disk.file_io import FileOps
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.disk.paths import rank_directory, world_directory
from kvoffload.tiers.disk.slot_file import location
from kvoffload.tiers.lower.block_format import HEADER_BYTES, PLAIN, checksum, encode_header


class FailingOps(FileOps):
    """The OS, except that positioned writes (or reads of blocks) raise ``error``: the writes after the first
    ``fail_after`` (``failures`` of them; None: every one). Counts writes and block reads."""

    def __init__(self, write_error: int | None = None, read_error: int | None = None, fail_after: int = 0,
                 failures: int | None = None) -> None:
        self.write_error, self.read_error = write_error, read_error
        self.fail_after, self.failures = fail_after, failures
        self.writes = self.reads = 0
        self._lock = threading.Lock()

    def pwrite(self, fd: int, buffers: list[memoryview | bytes], offset: int) -> None:
        with self._lock:
            self.writes += 1
            fail = (self.write_error is not None and self.writes > self.fail_after
                    and (self.failures is None or self.writes <= self.fail_after + self.failures))
        if fail:
            assert self.write_error is not None
            raise OSError(self.write_error, os.strerror(self.write_error))
        super().pwrite(fd, buffers, offset)

    def pread_into(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset == 0:  # the file's header, read when the handler opens it
            return super().pread_into(fd, buffers, offset)
        with self._lock:
            self.reads += 1
        if self.read_error is not None:
            raise OSError(self.read_error, os.strerror(self.read_error))
        return super().pread_into(fd, buffers, offset)


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


def test_a_block_sits_at_its_slot_named_by_its_key_and_the_slot_and_lock_files_are_private(
        handler: DiskHandler, config: DiskTierConfig) -> None:
    ks = keys(2)
    assert run(handler, store((0, 1), ks)).success
    for slot, key in enumerate(ks):
        block = read_block(config, key)
        assert block[32:48] == key and block[HEADER_BYTES:] == bytes(handler._slots[slot, :48])
        assert names(config, key)
    rank_dir = rank_directory(config.path, NS)
    assert sorted(p.name for p in rank_dir.iterdir()) == ["engine-0.kvs"]  # one file, whatever the blocks
    index = DiskIndex.create(config, NS, PLAIN.file_bytes(max(ENTRY)))  # the scheduler's locks
    try:
        world = world_directory(config.path, NS)
        assert sorted(p.name for p in world.iterdir()) == ["engine-0.lock", "engines.lock", "rank0"]
        for path in (rank_dir / "engine-0.kvs", world / "engine-0.lock", world / "engines.lock"):
            assert mode_of(path) == 0o600
        for directory in (config.path, world, rank_dir):
            assert mode_of(directory) == 0o700
    finally:
        index.close()


def _oversized(block: bytes) -> bytes:
    """``block`` with a header stating one payload byte more (its checksum made to hold)."""
    raw = bytearray(block)
    struct.pack_into("<Q", raw, 48, len(block) - HEADER_BYTES + 1)
    struct.pack_into("<I", raw, 60, zlib.crc32(bytes(raw[:60])))
    return bytes(raw)


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "planted", "oversized"])
def test_a_damaged_block_fails_its_load_and_its_entry_is_emptied(
        handler: DiskHandler, config: DiskTierConfig, damage: str) -> None:
    (key,) = keys(1)
    assert run(handler, store((0,), (key,))).success and names(config, key)
    at = block_at(config, key)
    block = read_block(config, key)
    if damage == "flip_payload":
        write_at(at.path, at.offset + at.nbytes - 1, bytes([block[-1] ^ 0xFF]))
    elif damage == "flip_header":
        write_at(at.path, at.offset + 20, bytes([block[20] ^ 0x01]))
    elif damage == "truncate":
        os.truncate(at.path, at.offset + at.nbytes - 5)  # the file cut short inside the block
    elif damage == "planted":
        write_at(at.path, at.offset, b"garbage")
    else:
        write_at(at.path, at.offset, _oversized(block))
    handler._slots[3] = 0
    assert not run(handler, load((key,), (3,))).success
    assert not handler._slots[3].any()  # nothing of it reached the host slot
    assert not names(config, key)  # emptied: no engine indexes it again
    assert handler.breaker.errors == 1  # a disk fault


def test_a_block_of_another_namespace_is_never_loaded_and_its_entry_is_emptied(
        handler: DiskHandler, config: DiskTierConfig) -> None:
    other = Namespace(model="other", dtype="bf16", layout="pages=64")
    (key,) = keys(1)
    with DiskHandlerContext(config, other) as foreign:
        assert run(foreign, store((0,), (key,))).success
    # Copied into this namespace's slot for the key: the same key, but its header names the other namespace.
    at = block_at(config, key)
    assert at.path != block_at(config, key, other).path
    write_at(at.path, at.offset, read_block(config, key, other))
    assert not run(handler, load((key,), (1,))).success
    assert handler.breaker.errors == 1
    assert run(handler, store((0,), (key,))).success and run(handler, load((key,), (1,))).success  # the control


def test_a_slot_holding_another_keys_whole_block_is_a_plain_miss(handler: DiskHandler,
                                                                  config: DiskTierConfig) -> None:
    """A reused slot (what another engine reads through a table it read before the slot was given to another
    block) and a swapped block (another key's block copied into the slot) look alike: a miss, never the other
    block, not a disk fault; the entry is left to the slot's owner."""
    a, b = keys(2)
    assert run(handler, store((0, 1), (a, b))).success
    at = block_at(config, a)
    write_at(at.path, at.offset, read_block(config, b))
    handler._slots[3] = 0
    for _ in range(5):  # more than the breaker's three errors
        assert not run(handler, load((a,), (3,))).success
    assert not handler._slots[3].any() and handler.breaker.errors == 0 and not handler.breaker.is_open
    assert names(config, a)
    assert run(handler, load((b,), (3,))).success and bytes(handler._slots[3, :48]) == bytes(handler._slots[1, :48])


def test_a_load_from_an_engine_without_a_slot_file_is_a_plain_miss(handler: DiskHandler) -> None:
    """Its files were trimmed (the engine stopped, and another started alone): not a disk fault."""
    for _ in range(5):
        assert not run(handler, at_engine(7).load(keys(1, salt=9), (0,))).success
    assert handler.breaker.errors == 0 and not handler.breaker.is_open


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC], ids=["EIO", "ENOSPC"])
def test_a_write_error_fails_the_store_and_empties_the_entries_it_wrote(config: DiskTierConfig, code: int) -> None:
    # One I/O thread: the job's runs go in slot order. Keys at slots 0-1 are one run (its blocks, then its
    # entries: two writes), the key at slot 5 another, whose first write fails; the entries of the first are
    # then emptied (the file system takes writes again: the table is not where space ran out).
    ops = FailingOps(write_error=code, fail_after=2, failures=1)
    one_thread = dataclasses.replace(config, io_threads=1)
    ks = keys(6, salt=3)
    chosen = (ks[0], ks[1], ks[5])
    jobs = at_places({k: location(0, s) for k, s in zip(chosen, (0, 1, 5), strict=True)})
    with DiskHandlerContext(one_thread, NS, file_ops=ops) as h:
        result = run(h, jobs.store((0, 1, 2), chosen))
        assert not result.success and result.bytes == 0
    index = DiskIndex.create(config, NS, PLAIN.file_bytes(max(ENTRY)))  # a restart finds none of them
    try:
        assert [index.lookup([k]).hits for k in chosen] == [0, 0, 0]
    finally:
        index.close()
    assert ops.writes == 3 + 2  # the run's blocks and entries, the failed write, then two entries emptied


def test_repeated_errors_open_the_breaker_once_then_it_closes_after_cooldown(
        config: DiskTierConfig, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    ops = FailingOps(write_error=errno.EIO)
    with caplog.at_level(logging.ERROR), DiskHandlerContext(config, NS, file_ops=ops, clock=clock) as h:
        for salt in range(6):
            assert not run(h, store((0,), keys(1, salt))).success
        assert h.breaker.is_open and ops.writes == 3  # later jobs failed without touching the disk
        assert len([r for r in caplog.records if "switching the disk tier off" in r.message]) == 1
        ops.write_error = None
        clock.now += 11.0
        assert run(h, store((0,), keys(1, 42))).success


def test_a_read_error_fails_the_load_and_counts_toward_the_breaker(handler: DiskHandler,
                                                                   config: DiskTierConfig) -> None:
    (key,) = keys(1)
    assert run(handler, store((0,), (key,))).success
    ops = FailingOps(read_error=errno.EIO)
    with DiskHandlerContext(config, NS, file_ops=ops) as h:
        assert not run(h, load((key,), (1,))).success
        assert ops.reads == 1 and h.breaker.errors == 1
    assert names(config, key)  # an I/O error says nothing of the block: it stays


def test_read_slower_than_deadline_is_a_miss_that_never_lands(config: DiskTierConfig) -> None:
    clock = FakeClock()

    class SlowOps(FileOps):
        slow = False

        def pread_into(self, fd: int, buffers: list[memoryview], offset: int) -> int:
            if self.slow:
                clock.now += 5.0  # this read takes 5 s, over the 1 s deadline
            return super().pread_into(fd, buffers, offset)

    ops = SlowOps()
    with DiskHandlerContext(config, NS, file_ops=ops, clock=clock) as h:
        ks = keys(1)
        assert run(h, store((0,), ks)).success
        ops.slow = True
        h._slots[1] = 0
        assert not run(h, load(ks, (1,))).success
        assert not h._slots[1].any()


def test_jobs_to_the_same_destination_complete_in_submission_order(config: DiskTierConfig) -> None:
    gate = threading.Event()

    class GatedOps(FileOps):
        def pwrite(self, fd: int, buffers: list[memoryview | bytes], offset: int) -> None:
            gate.wait()
            super().pwrite(fd, buffers, offset)

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
    with pytest.raises(ValueError, match="names no slot"):
        handler.submit(TransferJob(JobId(3), HostBlocks((0,), (1,)), TierBlocks(Medium.DISK, keys(1), (1,))))


def test_entry_larger_than_a_host_slot_is_rejected(config: DiskTierConfig) -> None:
    with pytest.raises(ValueError, match="entry_bytes"):
        DiskHandler(config, make_pool(), NS, (SLOT + 1,))


def test_submit_after_shutdown_is_refused(config: DiskTierConfig) -> None:
    h = DiskHandler(config, make_pool(), NS, ENTRY)
    h.shutdown()
    h.shutdown()
    assert h.submit(store((0,), keys(1))) is False


def test_each_rank_writes_its_own_slot_file(config: DiskTierConfig) -> None:
    rank1 = Namespace(model="m", dtype="bf16", layout="pages=64", rank=1, world_size=2)
    rank0 = Namespace(model="m", dtype="bf16", layout="pages=64", rank=0, world_size=2)
    (key,) = keys(1)
    with DiskHandlerContext(config, rank1) as h:
        assert run(h, store((0,), (key,))).success
        payload = bytes(h._slots[0, :48])
    assert read_block(config, key, rank1)[HEADER_BYTES:] == payload and names(config, key, rank1)
    assert read_block(config, key, rank0) == bytes(block_at(config, key, rank0).nbytes)  # rank 0's slot: untouched
    assert not names(config, key, rank0)
    one, zero = block_at(config, key, rank1).path, block_at(config, key, rank0).path
    assert (one.parent.name, zero.parent.name) == ("rank1", "rank0") and one.parent.parent == zero.parent.parent


def test_a_block_written_by_hand_in_the_format_loads(handler: DiskHandler, config: DiskTierConfig) -> None:
    """The tests' picture of the format (header at the slot's start, then the payload) is the handler's: a block
    and entry written here load bit-exact, so the damage above is damage to the real layout."""
    (key,) = keys(1, salt=77)
    payload = os.urandom(48)
    at = block_at(config, key)
    write_at(at.path, at.offset, encode_header(NS.fingerprint(), key, 48, checksum(payload)) + payload)
    handler._slots[2] = 0
    assert run(handler, load((key,), (2,))).success and bytes(handler._slots[2, :48]) == payload
