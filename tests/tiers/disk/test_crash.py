"""A writer killed with SIGKILL in the middle of writes leaves no corrupt or half-written block visible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from kvoffload.config import DiskTierConfig
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.disk.file_io import FileOps, read_block
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.disk.paths import block_path, rank_directory
from kvoffload.tiers.lower.block_format import file_bytes

NS = Namespace(model="m", dtype="bf16", layout="crash")
PAYLOAD = 256 * 1024

# Writes blocks forever through the real handler; prints once some are on disk so the parent knows when to kill.
WRITER = textwrap.dedent(f"""
    import sys, torch
    from pathlib import Path
    from kvoffload.config import DiskTierConfig
    from kvoffload.keys import Namespace, offload_key
    from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
    from kvoffload.tiers.disk.handler import DiskHandler
    from kvoffload.transfer.host_pool import HostPool

    pool = HostPool(8, {PAYLOAD})
    pool.buffer.copy_(torch.randint(-128, 128, (8, {PAYLOAD}), dtype=torch.int8))
    handler = DiskHandler(DiskTierConfig(path=Path(sys.argv[1]), io_threads=4), pool,
                          Namespace(model="m", dtype="bf16", layout="crash"), ({PAYLOAD},))
    for i in range(1 << 30):
        keys = tuple(offload_key(i.to_bytes(8, "little") + bytes([j]), 0) for j in range(8))
        job = TransferJob(JobId(i), HostBlocks(tuple(range(8)), (8,)), TierBlocks(Medium.DISK, keys, (8,)))
        handler.submit(job)
        if i == 4:
            handler.wait([JobId(i)])
            print("writing", flush=True)
""")


def test_sigkill_during_writes_leaves_only_whole_blocks(tmp_path: Path) -> None:
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == "writing"  # blocks until the writer is mid-stream
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()  # reaped: its pid is dead, so its temporary files count as crash leftovers

    manager = DiskIndex.create(DiskTierConfig(path=tmp_path), NS, file_bytes(PAYLOAD))
    found = [OffloadKey(bytes.fromhex(p.stem)) for p in tmp_path.rglob("*.kvb")]
    assert len(found) >= 8 and manager.lookup(found).hits == len(found)
    assert not list(tmp_path.rglob("*.tmp"))
    out = memoryview(bytearray(PAYLOAD))
    directory = rank_directory(tmp_path, NS)
    for key in found:
        read_block(FileOps(), block_path(directory, key), NS.fingerprint(), key, out)  # raises if corrupt
