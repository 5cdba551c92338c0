"""A writer killed with SIGKILL in the middle of stores leaves no wrong block loadable: after a restart every entry
of its slot file's table either loads the very block that key was stored with, or fails (a miss). A store writes
its blocks before their entries, so the crash windows are a block written without its entry, an entry naming a
slot whose block was overwritten since, or a block torn under its entry (a disk that reordered the two writes):
each is a miss."""

from __future__ import annotations

import hashlib
import itertools
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.tiers.disk.handlers import write_at

from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
from kvoffload.config import DiskTierConfig
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.tiers.disk.engine_files import prepare_engine, prepare_files
from kvoffload.tiers.disk.file_io import FileOps, open_slot_file, write_run
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.disk.paths import rank_directories, rank_directory, slot_file_path
from kvoffload.tiers.disk.slot_file import ENTRY_BYTES, PAGE, Layout, encode_entry, location
from kvoffload.tiers.lower.block_format import PLAIN, checksum, encode_header
from kvoffload.tiers.lower.trust import Access
from kvoffload.transfer.host_pool import HostPool

NS = Namespace(model="m", dtype="bf16", layout="crash")
PAYLOAD = 64 * 1024
STRIDE = PLAIN.file_bytes(PAYLOAD)
SLOTS = 32
DISK_BYTES = 2 * PAGE + SLOTS * (STRIDE + ENTRY_BYTES)
"""A slot file of 32 slots: the writer's 8-block jobs reuse every slot every four jobs."""


def payload_of(key: OffloadKey) -> bytes:
    """The payload the writer stores under ``key`` (the writer script computes the same)."""
    return hashlib.blake2b(key, digest_size=64).digest() * (PAYLOAD // 64)


# Stores 8-block jobs forever through the real handler (4 runs of 2 blocks on 4 threads), each block's payload a
# function of its key, at slots that wrap around the file. Once every slot was written twice, a run whose blocks
# are written over other keys' but whose entries are not yet prints, and waits there for the kill; the job's other
# runs are wherever the kill finds them.
WRITER = textwrap.dedent(f"""
    import hashlib, sys, threading, time, numpy
    from pathlib import Path
    from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
    from kvoffload.config import DiskTierConfig
    from kvoffload.keys import Namespace, offload_key
    from kvoffload.tiers.disk.engine_files import prepare_engine
    from kvoffload.tiers.disk.file_io import FileOps
    from kvoffload.tiers.disk.handler import DiskHandler
    from kvoffload.tiers.disk.slot_file import location
    from kvoffload.transfer.host_pool import HostPool

    config = DiskTierConfig(path=Path(sys.argv[1]), io_threads=4, capacity_bytes={DISK_BYTES})
    ns = Namespace(model="m", dtype="bf16", layout="crash")
    layout = prepare_engine(config, ns, {STRIDE})

    armed = threading.Event()
    told = threading.Lock()

    class SlowEntries(FileOps):
        # Widens the window between a run's blocks and its entries (the other runs' crash windows); once armed,
        # one run tells the parent from inside its window and stays there until the kill.
        def pwrite(self, fd, buffers, offset):
            if offset < layout.data_offset:
                if armed.is_set() and told.acquire(blocking=False):
                    print("writing", flush=True)
                    time.sleep(60)
                time.sleep(0.002)
            super().pwrite(fd, buffers, offset)

    pool = HostPool(8, {PAYLOAD})
    rows = pool.buffer.numpy()
    handler = DiskHandler(config, pool, ns, ({PAYLOAD},), file_ops=SlowEntries())
    for i in range(1 << 30):
        keys = tuple(offload_key(i.to_bytes(8, "little") + bytes([j]), 0) for j in range(8))
        for j, key in enumerate(keys):
            rows[j, :] = numpy.frombuffer(hashlib.blake2b(key, digest_size=64).digest() * {PAYLOAD // 64},
                                          dtype=numpy.int8)
        places = tuple(location(0, (8 * i + j) % layout.capacity) for j in range(8))
        job = TransferJob(JobId(i + 1), HostBlocks(tuple(range(8)), (8,)), TierBlocks(Medium.DISK, keys, (8,), places))
        handler.submit(job)
        handler.wait([job.job_id])  # the host slots are rewritten only once the job is over
        handler.get_finished()
        if i == 2 * {SLOTS} // 8:
            armed.set()  # every slot was written twice: the next job's blocks go over other keys'
""")

_job_ids = itertools.count(1)


def config_of(path: Path) -> DiskTierConfig:
    # Failed loads are expected here: the breaker must not turn the tier off while every entry is tried.
    return DiskTierConfig(path=path, capacity_bytes=DISK_BYTES, read_deadline_s=30.0, breaker_errors=1000)


def load_through(index: DiskIndex, handler: DiskHandler, key: OffloadKey) -> bytes | None:
    """Load ``key`` as the engine would (lookup, the index's spec, the handler, completion): its payload, or None
    when the load failed (the host slot is zeroed first, and must stay so)."""
    assert index.lookup([key]).hits == 1
    spec = index.prepare_load([key])
    assert isinstance(spec, TierBlocks)
    slots = handler._slots
    slots[0] = 0
    job = TransferJob(JobId(next(_job_ids)), spec, HostBlocks((0,), (1,)))
    assert handler.submit(job)
    handler.wait([job.job_id])
    (result,) = [r for r in handler.get_finished() if r.job_id == job.job_id]
    index.complete_load([key], result.success)
    if not result.success:
        assert not slots[0].any()  # nothing of what was there reached the host slot
        return None
    return bytes(slots[0, :PAYLOAD])


def test_sigkill_during_stores_leaves_every_entry_bit_exact_or_a_miss(tmp_path: Path) -> None:
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None
    try:
        assert writer.stdout.readline().strip() == "writing"  # blocks until a run is between its two writes
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        writer.stdout.close()

    config = config_of(tmp_path)
    layout = Layout.for_budget(DISK_BYTES, STRIDE)
    assert layout is not None and layout.capacity == SLOTS
    table = prepare_files(rank_directories(tmp_path, NS), 0, layout, Access(None))  # kept: it has this layout
    named = [OffloadKey(name) for _, name in table.placed]
    assert len(named) >= SLOTS - 8  # the writer filled the file; at most the last job's entries are missing

    index = DiskIndex.create(config, NS, STRIDE)  # the restart: the index rebuilt from the table
    handler = DiskHandler(config, HostPool(2, PAYLOAD), NS, (PAYLOAD,))
    try:
        loaded = {key: load_through(index, handler, key) for key in named}
        wrong = [key for key, got in loaded.items() if got is not None and got != payload_of(key)]
        assert wrong == []
        whole = [key for key, got in loaded.items() if got is not None]
        # Misses: the entries of the killed job's runs (at least the one that waited), naming keys whose slots
        # hold its blocks now; nothing else.
        assert len(named) - 8 <= len(whole) < len(named)

        # The comparison is no formality: a well-formed block of the key with another payload (what a writer
        # that rewrote a host slot during its store would leave) loads, and is caught.
        victim, donor = whole[0], whole[1]
        slot = next(s for s, name in table.placed if name == victim)
        other = payload_of(donor)
        write_at(Path(slot_file_path(rank_directory(tmp_path, NS), 0)), layout.slot_offset(slot),
                 encode_header(NS.fingerprint(), victim, PAYLOAD, checksum(other)) + other)
        assert load_through(index, handler, victim) == other != payload_of(victim)
    finally:
        handler.shutdown()
        index.close()


def block_of(key: OffloadKey, fingerprint: bytes = NS.fingerprint()) -> bytes:
    payload = payload_of(key)
    return encode_header(fingerprint, key, PAYLOAD, checksum(payload)) + payload


@pytest.mark.parametrize("torn", [40, STRIDE // 2, STRIDE - 1], ids=["mid-header", "half", "all-but-a-byte"])
def test_a_block_without_its_entry_and_an_entry_over_a_torn_block_are_misses(tmp_path: Path, torn: int) -> None:
    config = config_of(tmp_path)
    layout = prepare_engine(config, NS, STRIDE)
    path = slot_file_path(rank_directory(tmp_path, NS), 0)
    a, b, c, d = (offload_key(bytes([9, i]) * 8, 0) for i in range(4))  # type: ignore[arg-type]
    ops = FileOps()
    file = open_slot_file(ops, path)
    try:
        # slot 0: A's block, whole, but no entry (the crash came between its store's two writes)
        write_at(Path(path), layout.slot_offset(0), block_of(a))
        # slot 1: B stored whole; then C's store over it, its entry on the disk but only ``torn`` bytes of its
        # block (a disk that reordered the writes, with no flush between them)
        write_run(ops, file, 1, [b], [memoryview(payload_of(b))], NS.fingerprint())
        write_at(Path(path), layout.slot_offset(1), block_of(c)[:torn])
        write_at(Path(path), layout.entry_offset(1), encode_entry(c, 1))
        # slot 2: D stored whole (the control: the same reads load it)
        write_run(ops, file, 2, [d], [memoryview(payload_of(d))], NS.fingerprint())
    finally:
        ops.close(file.fd)

    index = DiskIndex.create(config, NS, STRIDE)
    handler = DiskHandler(config, HostPool(2, PAYLOAD), NS, (PAYLOAD,))
    try:
        assert [index.lookup([k]).hits for k in (a, b, c, d)] == [0, 0, 1, 1]  # A and B: not named, misses
        assert load_through(index, handler, d) == payload_of(d)
        assert load_through(index, handler, c) is None
        assert index.lookup([c]).hits == 0  # dropped from the index after its failed load ...
        with open(path, "rb") as f:
            assert os.pread(f.fileno(), ENTRY_BYTES, layout.entry_offset(1)) == bytes(ENTRY_BYTES)  # ... and table
        # A reader holding the table from before C's store (B at slot 1): a miss as well, never C's bytes.
        slots = handler._slots
        slots[1] = 0
        stale = TransferJob(JobId(next(_job_ids)), TierBlocks(Medium.DISK, (b,), (1,), (location(0, 1),)),
                            HostBlocks((1,), (1,)))
        assert handler.submit(stale)
        handler.wait([stale.job_id])
        assert [r.success for r in handler.get_finished()] == [False] and not slots[1].any()
    finally:
        handler.shutdown()
        index.close()
