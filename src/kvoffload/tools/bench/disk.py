"""``kvoffload bench disk``: host<->disk GB/s of ``DiskHandler`` beside raw sequential I/O of the same bytes,
and the time to rebuild the disk index at start-up.

Per block size, each round writes ``--total-mib`` of blocks through a real handler (one job, submit to wait:
planning, headers, checksums, one positioned write per run of consecutive slots and one of their table entries, into
a slot file made as a scheduler makes it), then writes the same bytes to one file sequentially in
block-sized ``os.write`` calls (the baseline); then reads both back (the handler reads and verifies every
block into the host pool). Before each read the page cache is dropped when the process may do so (root:
``/proc/sys/vm/drop_caches``); otherwise reads of just-written files come from the page cache, for both sides,
and the output says so. Neither side calls fsync: both measure what the engine waits for. Rows report medians
over rounds and the ratio handler / baseline.

``--tier-secret``: a second handler, given a throwaway secret, seals every block (AES-256-GCM, ``kvoffload.auth``)
and moves the same blocks in the same rounds, interleaved with the plain handler's (which of the two goes first
turns round by round) and the raw I/O; its rows are
reported beside the plain ones with the ratio sealed / plain (target: at least 0.9).

The rebuild figure: a fresh slot file whose table names ``--rebuild-blocks`` blocks (the index reads the table
only), then ``DiskIndex.create`` is timed (engine number, file check, table read, index insert).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvoffload.tools.bench.jobs import timed_job

KIB = 1 << 10
MIB = 1 << 20


@dataclass(frozen=True)
class Row:
    block_bytes: int
    blocks: int
    write_gbps: float
    raw_write_gbps: float
    write_ratio: float
    read_gbps: float
    raw_read_gbps: float
    read_ratio: float
    checksum_gbps: float
    sealed_write_gbps: float | None = None
    sealed_read_gbps: float | None = None
    seal_gbps: float | None = None
    """AES-256-GCM sealing of one block, in memory, one thread (the sealed rows' CPU cost)."""

    @property
    def sealed_write_ratio(self) -> float | None:
        return sealed_ratio(self.sealed_write_gbps, self.write_gbps)

    @property
    def sealed_read_ratio(self) -> float | None:
        return sealed_ratio(self.sealed_read_gbps, self.read_gbps)


def sealed_ratio(sealed_gbps: float | None, plain_gbps: float) -> float | None:
    """Sealed / plain, or None when the bench ran without ``--tier-secret``."""
    return None if sealed_gbps is None else sealed_gbps / plain_gbps


def add_tier_secret_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--tier-secret", action="store_true",
                        help=f"also run a handler with a throwaway tier secret (sealed {what}) beside the plain one")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-sizes", default="64K,1M",
                        help="comma-separated block sizes with K/M suffix (default 64K,1M)")
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per round and direction")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per block size (median reported)")
    parser.add_argument("--io-threads", type=int, default=4, help="the handler's I/O threads")
    parser.add_argument("--rebuild-blocks", type=int, default=100_000, help="block files for the rebuild test")
    parser.add_argument("--directory", type=Path, default=None,
                        help="where to write (default: a fresh directory under the system temp directory)")
    parser.add_argument("--no-drop-caches", action="store_true",
                        help="do not try to drop the page cache before reads (reads may hit it)")
    add_tier_secret_argument(parser, "blocks")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _size(text: str) -> int:
    t = text.strip().upper()
    scale = {"K": KIB, "M": MIB}.get(t[-1:], 1)
    try:
        value = int(t.rstrip("KM")) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad block size {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"bad block size {text!r}")
    return value


def drop_caches() -> bool:
    """Drop the page cache (needs root); False when not allowed here."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        return False
    return True


def _raw_write(path: Path, data: memoryview, blocks: int) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(blocks):
            os.write(fd, data)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _raw_read(path: Path, buf: memoryview, blocks: int) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(blocks):
            os.readv(fd, [buf])
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _crc_gbps(block_bytes: int) -> float:
    from kvoffload.tiers.lower.block_format import checksum

    data = os.urandom(block_bytes)
    n = max(1, (64 * MIB) // block_bytes)
    start = time.perf_counter()
    for _ in range(n):
        checksum(data)
    return n * block_bytes / (time.perf_counter() - start) / 1e9


def _seal_gbps(block_bytes: int) -> float:
    from kvoffload.auth import TierSecret
    from kvoffload.keys import OffloadKey
    from kvoffload.tiers.lower.block_codec import seal_into
    from kvoffload.tiers.lower.block_format import BlockFormat

    fmt = BlockFormat.of(TierSecret("bench", os.urandom(32)))
    data, out = memoryview(os.urandom(block_bytes)), memoryview(bytearray(fmt.file_bytes(block_bytes)))
    n = max(1, (64 * MIB) // block_bytes)
    start = time.perf_counter()
    for i in range(n):
        seal_into(fmt, bytes(16), OffloadKey(i.to_bytes(16, "little")), data, out)
    return n * block_bytes / (time.perf_counter() - start) / 1e9


def bench_block_size(root: Path, block_bytes: int, args: argparse.Namespace, drop: bool) -> Row:
    import torch

    from kvoffload.auth import TierSecret
    from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
    from kvoffload.config import DiskTierConfig
    from kvoffload.keys import Namespace, offload_key
    from kvoffload.tiers.disk.engine_files import prepare_engine
    from kvoffload.tiers.disk.handler import DiskHandler
    from kvoffload.tiers.disk.slot_file import ENTRY_BYTES, PAGE, location
    from kvoffload.tiers.lower.block_format import BlockFormat
    from kvoffload.transfer.host_pool import HostPool

    blocks = max(1, args.total_mib * MIB // block_bytes)
    slots = min(blocks, 256)
    pool = HostPool(slots, block_bytes)
    pool.buffer.copy_(torch.randint(-128, 128, (slots, block_bytes), dtype=torch.int8))
    ns = Namespace(model="bench", dtype="int8", layout=f"bench-{block_bytes}")
    secrets = {"": None} | ({"s": TierSecret("bench --tier-secret", os.urandom(32))} if args.tier_secret else {})
    budget = 4 * PAGE + blocks * (BlockFormat.of(None).file_bytes(block_bytes) + 16 + ENTRY_BYTES)
    configs = {side: DiskTierConfig(path=root / "tier", io_threads=args.io_threads, secret=secret,
                                    capacity_bytes=budget) for side, secret in secrets.items()}
    for config in configs.values():
        prepare_engine(config, ns, BlockFormat.of(config.secret).file_bytes(block_bytes))  # the scheduler's part
    handlers = {side: DiskHandler(config, pool, ns, (block_bytes,)) for side, config in configs.items()}
    data = memoryview(os.urandom(block_bytes))
    buf = memoryview(bytearray(block_bytes))
    results: dict[str, list[float]] = {k: [] for k in ("rw", "rr", *(d + s for s in handlers for d in "wr"))}
    host = HostBlocks(tuple(i % slots for i in range(blocks)), (blocks,))
    job_ids = iter(range(1 << 30))
    try:
        for rnd in range(args.rounds):
            keys = tuple(offload_key(rnd.to_bytes(4, "little") + i.to_bytes(8, "little"), 0)  # type: ignore[arg-type]
                         for i in range(blocks))
            disk = TierBlocks(Medium.DISK, keys, (blocks,), tuple(location(0, i) for i in range(blocks)))
            # Which handler goes first turns round by round: the second writes while the first's pages are
            # still being written back.
            order = list(handlers.items())[rnd % len(handlers):] + list(handlers.items())[:rnd % len(handlers)]
            for side, handler in order:
                results["w" + side].append(timed_job(handler, TransferJob(JobId(next(job_ids)), host, disk)))
            results["rw"].append(_raw_write(root / "raw", data, blocks))
            for side, handler in order:
                if drop:
                    drop_caches()
                results["r" + side].append(timed_job(handler, TransferJob(JobId(next(job_ids)), disk, host)))
            if drop:
                drop_caches()
            results["rr"].append(_raw_read(root / "raw", buf, blocks))
    finally:
        for handler in handlers.values():
            handler.shutdown()
    gbps = {k: blocks * block_bytes / statistics.median(v) / 1e9 for k, v in results.items()}
    sealed = {"sealed_write_gbps": gbps["ws"], "sealed_read_gbps": gbps["rs"],
              "seal_gbps": _seal_gbps(block_bytes)} if args.tier_secret else {}
    return Row(block_bytes, blocks, gbps["w"], gbps["rw"], gbps["w"] / gbps["rw"], gbps["r"], gbps["rr"],
               gbps["r"] / gbps["rr"], _crc_gbps(block_bytes), **sealed)


def bench_rebuild(root: Path, blocks: int) -> float:
    """Seconds for ``DiskIndex.create`` over a slot file whose table names ``blocks`` blocks."""
    from kvoffload.config import DiskTierConfig
    from kvoffload.keys import Namespace, offload_key
    from kvoffload.tiers.disk.engine_files import prepare_engine
    from kvoffload.tiers.disk.index import DiskIndex
    from kvoffload.tiers.disk.paths import rank_directory, slot_file_path
    from kvoffload.tiers.disk.slot_file import ENTRY_BYTES, PAGE, encode_entry
    from kvoffload.tiers.lower.block_format import file_bytes

    ns = Namespace(model="bench", dtype="int8", layout="rebuild")
    size = file_bytes(64 * KIB)
    config = DiskTierConfig(path=root / "rebuild", capacity_bytes=4 * PAGE + blocks * (size + ENTRY_BYTES))
    layout = prepare_engine(config, ns, size)
    table = b"".join(encode_entry(offload_key(i.to_bytes(8, "little"), 0), i)  # type: ignore[arg-type]
                     for i in range(blocks))
    with open(slot_file_path(rank_directory(config.path, ns), 0), "r+b") as f:
        f.seek(layout.table_offset)
        f.write(table)
    start = time.perf_counter()
    manager = DiskIndex.create(config, ns, size)
    elapsed = time.perf_counter() - start
    manager.close()
    if manager.usage()[0].used_blocks != blocks:
        raise RuntimeError("bench disk: the rebuilt index lost blocks")
    return elapsed


def run(args: argparse.Namespace) -> int:
    sizes = [_size(s) for s in args.block_sizes.split(",")]
    base = args.directory or Path(tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="kvoffload-bench-disk-", dir=base))
    try:
        dropped = not args.no_drop_caches and drop_caches()
        rows = [bench_block_size(root, size, args, dropped) for size in sizes]
        rebuild_s = bench_rebuild(root, args.rebuild_blocks) if args.rebuild_blocks else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _report(rows, rebuild_s, args, dropped, root)
    return 0


def _report(rows: list[Row], rebuild_s: float | None, args: argparse.Namespace, dropped: bool,
            root: Path) -> None:
    cache = ("page cache dropped before every read" if dropped else
             "page cache NOT dropped (not allowed here, or --no-drop-caches): reads of just-written files "
             "hit the page cache, on both sides")
    if args.json:
        print(json.dumps({"rows": [asdict(r) | {"sealed_write_ratio": r.sealed_write_ratio,
                                                "sealed_read_ratio": r.sealed_read_ratio} for r in rows],
                          "rebuild_blocks": args.rebuild_blocks,
                          "rebuild_seconds": rebuild_s, "page_cache_dropped": dropped,
                          "directory": str(root.parent), "io_threads": args.io_threads}, indent=2))
        return
    print(f"kvoffload bench disk: {root.parent}, {args.io_threads} I/O threads, {args.rounds} rounds; {cache}; "
          "no fsync on either side")
    print(f"{'block':>8} {'blocks':>7} {'write':>7} {'raw w':>7} {'ratio':>6} {'read':>7} {'raw r':>7} "
          f"{'ratio':>6} {'crc32c':>7}   (GB/s)")
    for r in rows:
        print(f"{r.block_bytes // KIB:>7}K {r.blocks:>7} {r.write_gbps:>7.2f} {r.raw_write_gbps:>7.2f} "
              f"{r.write_ratio:>6.2f} {r.read_gbps:>7.2f} {r.raw_read_gbps:>7.2f} {r.read_ratio:>6.2f} "
              f"{r.checksum_gbps:>7.2f}")
    if args.tier_secret:
        print("with a throwaway tier secret (sealed: AES-256-GCM), the same blocks in the same rounds:")
        print(f"{'block':>8} {'write':>7} {'vs pl':>6} {'read':>7} {'vs pl':>6} {'seal':>7}   (GB/s; vs pl = sealed / "
              "plain, target >= 0.9)")
        for r in rows:
            print(f"{r.block_bytes // KIB:>7}K {r.sealed_write_gbps:>7.2f} {r.sealed_write_ratio:>6.2f} "
                  f"{r.sealed_read_gbps:>7.2f} {r.sealed_read_ratio:>6.2f} {r.seal_gbps:>7.2f}")
    if rebuild_s is not None:
        print(f"index rebuild: {args.rebuild_blocks} blocks in {rebuild_s:.3f} s")
