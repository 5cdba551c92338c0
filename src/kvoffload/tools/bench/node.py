"""``kvoffload bench node``: loads from the node pool that engines share beside loads from a private host pool.

Per block size, engine A (a process of its own) stores ``--total-mib`` of blocks into a fresh node pool on
``--node-path`` through a real ``HostCopier`` and stays attached. This process, engine B, then loads them, again
and again: lookup, pin in the shared index (``NodeIndex``), copy through ``NodeCheck`` over a ``HostCopier`` into
its own KV cache, unpin. Beside each such load, the same blocks (the same bytes, slots and KV blocks) load from a
private ``HostPool`` through a ``HostCopier`` with the same threads; which side goes first alternates run by
run. Both sides' figures are GB/s from submit to the result (the node side's includes the epoch checks before
and after the copy; the pins are the scheduler's and are timed in the lookup row). ``ratio`` is the median of
the per-run ratios node / private (target >= 0.9). B checks once per row that the loaded bytes are A's.

The lookup row: a prompt of ``--lookup-keys`` keys (2,048: 32K tokens of 16-token blocks), all resident, looked
up in the node index and in a private ``SlotIndex`` of the same capacity, alternating (target: node <= 2x).

The engines row (``--engines N``, 4 by default, at 64 KiB blocks): N engine processes at once, each storing its
own share of the blocks and then loading every block, on one node pool; then N processes each storing and
loading the same bytes on a private pool of its own. Aggregate GB/s of the stores and of the loads, each side,
and the ratios node / private. Every engine process gets the same ``--threads``; nothing else is pinned, so on a
machine with fewer cores than N x threads both sides share the cores alike.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvoffload.tools.bench.common import Report, emit, format_table, positive_int
from kvoffload.tools.bench.disk import KIB, MIB, _size

if TYPE_CHECKING:
    from multiprocessing.synchronize import Barrier

    import torch

    from kvoffload.keys import OffloadKey
    from kvoffload.tiers.node.index import NodeIndex
    from kvoffload.transfer.base import TransferHandler

DEFAULT_BLOCKS = "4K,64K,1M"
ENGINES_BLOCK = 64 * KIB


@dataclass(frozen=True)
class LoadRow:
    block_bytes: int
    blocks: int
    node_load_gbps: float
    private_load_gbps: float
    ratio: float
    """Median of the per-run ratios node / private (target >= 0.9)."""
    bytes_equal: bool


@dataclass(frozen=True)
class LookupRow:
    keys: int
    node_us: float
    private_us: float
    ratio: float
    """Median of the per-run ratios node / private (target <= 2)."""


@dataclass(frozen=True)
class EnginesRow:
    engines: int
    block_bytes: int
    blocks: int
    node_store_gbps: float
    private_store_gbps: float
    store_ratio: float
    node_load_gbps: float
    private_load_gbps: float
    load_ratio: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("--block-sizes", default=DEFAULT_BLOCKS,
                        help=f"comma-separated block sizes of the load rows, K/M suffix (default {DEFAULT_BLOCKS})")
    parser.add_argument("--runs", type=positive_int, default=9, help="timed loads per side and row (default 9)")
    parser.add_argument("--total-mib", type=positive_int, default=64, help="MiB of blocks per row (default 64)")
    parser.add_argument("--threads", type=positive_int, default=2, help="copy threads of every handler (default 2)")
    parser.add_argument("--engines", type=positive_int, default=4, help="engines of the engines row (default 4)")
    parser.add_argument("--lookup-keys", type=positive_int, default=2048, help="keys of the lookup row")
    parser.add_argument("--node-path", type=Path, default=Path("/dev/shm"), help="tmpfs of the node pools")


def run(args: argparse.Namespace) -> int:
    sizes = [_size(s) for s in args.block_sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="kvoffload-bench-node-", dir=args.node_path))
    try:
        loads = [measure_loads(root, block, max(1, args.total_mib * MIB // block), args.runs, args.threads)
                 for block in sizes]
        lookup = measure_lookup(root, args.lookup_keys, max(args.runs, 51))
        engines = measure_engines(root, args.engines, ENGINES_BLOCK,
                                  max(args.engines, args.total_mib * MIB // ENGINES_BLOCK), args.threads)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [*map(asdict, loads), asdict(lookup), asdict(engines)]
    table = "\n\n".join((
        format_table(("block", "blocks", "node GB/s", "private GB/s", "ratio", "bytes equal"),
                     [(_human(r.block_bytes), r.blocks, r.node_load_gbps, r.private_load_gbps, r.ratio,
                       r.bytes_equal) for r in loads]),
        format_table(("lookup keys", "node us", "private us", "ratio"),
                     [(lookup.keys, lookup.node_us, lookup.private_us, lookup.ratio)]),
        format_table(("engines", "block", "node store GB/s", "private store GB/s", "ratio", "node load GB/s",
                      "private load GB/s", "ratio"),
                     [(engines.engines, _human(engines.block_bytes), engines.node_store_gbps,
                       engines.private_store_gbps, engines.store_ratio, engines.node_load_gbps,
                       engines.private_load_gbps, engines.load_ratio)]),
    ))
    notes = ("load ratio target >= 0.9 (node / private, same blocks, threads and KV cache, alternating runs); "
             "lookup ratio target <= 2",)
    settings = {"runs": args.runs, "total_mib": args.total_mib, "threads": args.threads, "engines": args.engines}
    emit(Report("node", rows, table, notes, settings), args)
    return 0 if all(r.bytes_equal for r in loads) else 1


# ---- one engine's parts ------------------------------------------------------------------------------------------

def _geometry(blocks: int, block: int, layout: str) -> tuple[Any, Any]:
    from kvoffload.keys import Namespace
    from kvoffload.tiers.node.segment import NodeGeometry

    namespace = Namespace(model="bench-node", dtype="int8", layout=layout)
    return namespace, NodeGeometry(blocks, block, namespace.chain_root())


def _attach(root: Path, blocks: int, block: int, layout: str, rank_pool: bool = True) -> tuple[NodeIndex, Any]:
    """This process as an engine of the node pool ``layout``: its index and (``rank_pool``) its rank-0 pool."""
    from kvoffload.config import NodeTierConfig
    from kvoffload.tiers.node.files import open_index, open_pool
    from kvoffload.tiers.node.index import NodeIndex
    from kvoffload.tiers.node.liveness import EngineLocks
    from kvoffload.tiers.node.pool import NodePool
    from kvoffload.tiers.node.segment import access_of, open_directory

    namespace, geometry = _geometry(blocks, block, layout)
    node = NodeTierConfig(root)
    directory = open_directory(node, namespace)
    pool = None
    if rank_pool:
        segment, files, mapping = open_pool(directory, 0, geometry, access_of(node))
        pool = NodePool(mapping, segment, blocks, block, False)
    else:
        segment, files = open_index(directory, geometry, access_of(node))
    return NodeIndex(segment, EngineLocks(directory, access_of(node)), files), pool


def _keys(n: int, first: int = 0) -> list[OffloadKey]:
    from kvoffload.keys import BlockHash, offload_key

    return [offload_key(BlockHash((first + i).to_bytes(8, "little")), 0) for i in range(n)]


def _kv(blocks: int, block: int, seed: int | None) -> tuple[torch.Tensor, Any]:
    """A CPU KV cache of ``blocks`` pages: seeded random bytes, or zeros."""
    import torch

    from kvoffload.canonical import BlockRef, CanonicalKV

    if seed is None:
        buffer = torch.zeros((blocks, block), dtype=torch.int8)
    else:
        generator = torch.Generator().manual_seed(seed)
        buffer = torch.randint(-128, 128, (blocks, block), dtype=torch.int8, generator=generator)
    return buffer, CanonicalKV((buffer,), ((BlockRef(0, block),),), num_blocks=blocks)


def _timed(handler: TransferHandler, job: Any) -> float:
    start = time.perf_counter()
    if not handler.submit(job):
        raise RuntimeError("bench node: a handler refused a job")
    handler.wait([job.job_id])
    results = handler.get_finished()
    seconds = time.perf_counter() - start
    if not all(r.success for r in results):
        raise RuntimeError(f"bench node: a job failed: {results}")
    return seconds


def _store(index: NodeIndex, handler: TransferHandler, keys: list[OffloadKey], first_block: int, job_id: int) -> float:
    """Store ``keys`` from KV blocks ``first_block...`` into the node pool; the copy's seconds."""
    from kvoffload.blocks import DeviceBlocks, JobId, TransferJob

    out = index.prepare_store(keys)
    if out is None or len(out.keys_to_store) != len(keys):
        raise RuntimeError("bench node: no room in the node pool")
    ids = tuple(range(first_block, first_block + len(keys)))
    seconds = _timed(handler, TransferJob(JobId(job_id), DeviceBlocks(ids, (len(ids),)), out.store_spec))
    index.complete_store(out.keys_to_store)
    return seconds


def _load(index: NodeIndex, handler: TransferHandler, keys: list[OffloadKey], job_id: int) -> float:
    """Pin, load into KV blocks 0... and unpin ``keys``; the copy's seconds."""
    from kvoffload.blocks import DeviceBlocks, JobId, TransferJob

    if index.lookup(keys).hits != len(keys):
        raise RuntimeError("bench node: the stored blocks are not all in the node pool")
    src = index.prepare_load(keys)
    ids = tuple(range(len(keys)))
    seconds = _timed(handler, TransferJob(JobId(job_id), src, DeviceBlocks(ids, (len(ids),))))
    index.complete_load(keys)
    return seconds


def _engine_a(root: Path, blocks: int, block: int, threads: int, seed: int, ready: Barrier, done: Barrier) -> None:
    """Engine A: stores every block, then stays attached until B is done."""
    from kvoffload.transfer.host_copier import HostCopier

    index, pool = _attach(root, blocks, block, f"bench-{block}")
    _, kv = _kv(blocks, block, seed)
    handler = HostCopier(kv, pool, factor=1, threads=threads)
    _store(index, handler, _keys(blocks), 0, 0)
    handler.shutdown()
    ready.wait()
    done.wait()
    index.close()


def measure_loads(root: Path, block: int, blocks: int, runs: int, threads: int) -> LoadRow:
    """One load row: A stores in its process, B (here) loads from the node pool and from a private pool."""
    import torch

    from kvoffload.blocks import DeviceBlocks, HostBlocks, JobId, TransferJob
    from kvoffload.tiers.node.handler import NodeCheck
    from kvoffload.transfer.host_copier import HostCopier
    from kvoffload.transfer.host_pool import HostPool

    context = multiprocessing.get_context("spawn")
    ready, done = context.Barrier(2), context.Barrier(2)
    seed = block
    a = context.Process(target=_engine_a, args=(root, blocks, block, threads, seed, ready, done))
    a.start()
    try:
        ready.wait(timeout=300)
        index, pool = _attach(root, blocks, block, f"bench-{block}")
        buffer, kv = _kv(blocks, block, None)
        node = NodeCheck(HostCopier(kv, pool, factor=1, threads=threads), pool.index)
        keys = _keys(blocks)
        _load(index, node, keys, 0)
        expected, _ = _kv(blocks, block, seed)
        equal = bool(torch.equal(buffer, expected))  # A stored KV block i as key i; B loaded key i into block i
        slots = index.prepare_load(keys).slots
        index.complete_load(keys)
        private_pool = HostPool(blocks, block)
        private_pool.buffer.copy_(pool.buffer)  # the same bytes in the same slots
        private = HostCopier(kv, private_pool, factor=1, threads=threads)
        to_kv = DeviceBlocks(tuple(range(blocks)), (blocks,))
        ratios, node_s, private_s = [], [], []
        for i in range(runs + 1):
            pair = []
            for side in ((0, 1) if i % 2 else (1, 0)):
                if side == 0:
                    pair.append(("node", _load(index, node, keys, 1 + i)))
                else:
                    job = TransferJob(JobId(1 + i), HostBlocks(slots, (blocks,)), to_kv)
                    pair.append(("private", _timed(private, job)))
            if i == 0:
                continue  # warm-up
            seconds = dict(pair)
            node_s.append(seconds["node"])
            private_s.append(seconds["private"])
            ratios.append(seconds["private"] / seconds["node"])
        node.shutdown()
        private.shutdown()
        index.close()
    finally:
        done.wait(timeout=300)
        a.join(timeout=60)
    total = blocks * block
    return LoadRow(block, blocks, _gbps(total, node_s), _gbps(total, private_s), round(statistics.median(ratios), 3),
                   equal)


def measure_lookup(root: Path, n: int, runs: int) -> LookupRow:
    """A prompt of ``n`` resident keys looked up in the node index and in a private ``SlotIndex``."""
    from kvoffload.config import EvictionPolicy
    from kvoffload.index.slot_index import SlotIndex

    index, _ = _attach(root, n, 64, "bench-lookup", rank_pool=False)
    private = SlotIndex(n, EvictionPolicy.LRU)
    keys = _keys(n, first=1 << 40)
    for manager in (index, private):
        if manager.prepare_store(keys) is None:
            raise RuntimeError("bench node: the lookup row's keys do not fit its index")
        manager.complete_store(keys)
    ratios, node_s, private_s = [], [], []
    for i in range(runs):
        seconds = {}
        for name, manager in (("node", index), ("private", private)) if i % 2 else (("private", private),
                                                                                    ("node", index)):
            start = time.perf_counter()
            hits = manager.lookup(keys).hits
            seconds[name] = time.perf_counter() - start
            if hits != n:
                raise RuntimeError(f"bench node: {name} lookup found {hits} of {n} keys")
        node_s.append(seconds["node"])
        private_s.append(seconds["private"])
        ratios.append(seconds["node"] / seconds["private"])
    index.close()
    return LookupRow(n, round(statistics.median(node_s) * 1e6, 1), round(statistics.median(private_s) * 1e6, 1),
                     round(statistics.median(ratios), 3))


def _engine_many(root: Path | None, engine: int, engines: int, blocks: int, block: int, threads: int,
                 start: Barrier, out: Any) -> None:
    """One of N engines: store its share of the blocks, wait for all, load every block; the seconds of both.
    ``root`` None: a private pool of its own holding the same blocks."""
    from kvoffload.blocks import DeviceBlocks, HostBlocks, JobId, TransferJob
    from kvoffload.tiers.node.handler import NodeCheck
    from kvoffload.transfer.host_copier import HostCopier
    from kvoffload.transfer.host_pool import HostPool

    share = blocks // engines
    first = engine * share
    _, kv = _kv(blocks, block, engine)
    keys = _keys(share * engines, first=1 << 20)
    handler: TransferHandler
    if root is None:
        pool = HostPool(blocks, block)
        pool.buffer.fill_(1)
        handler = HostCopier(kv, pool, factor=1, threads=threads)
        mine = tuple(range(first, first + share))
        start.wait()
        store_s = _timed(handler, TransferJob(JobId(0), DeviceBlocks(mine, (share,)), HostBlocks(mine, (share,))))
        start.wait()
        ids = tuple(range(share * engines))
        load_s = _timed(handler, TransferJob(JobId(1), HostBlocks(ids, (len(ids),)), DeviceBlocks(ids, (len(ids),))))
    else:
        index, node_pool = _attach(root, blocks, block, f"bench-engines-{block}")
        handler = NodeCheck(HostCopier(kv, node_pool, factor=1, threads=threads), node_pool.index)
        start.wait()
        store_s = _store(index, handler, keys[first:first + share], first, 0)
        start.wait()
        load_s = _load(index, handler, keys, 1)
        index.close()
    handler.shutdown()
    out.put((store_s, load_s))


def measure_engines(root: Path, engines: int, block: int, blocks: int, threads: int) -> EnginesRow:
    """N engines storing and loading at once: on one node pool, then each on its own private pool."""
    context = multiprocessing.get_context("spawn")
    gbps: dict[str, tuple[float, float]] = {}
    share = blocks // engines
    for side, where in (("node", root), ("private", None)):
        start, out = context.Barrier(engines), context.Queue()
        processes = [context.Process(target=_engine_many, args=(where, e, engines, blocks, block, threads, start,
                                                                out)) for e in range(engines)]
        for p in processes:
            p.start()
        times = [out.get(timeout=600) for _ in processes]
        for p in processes:
            p.join(timeout=60)
        stored, loaded = share * engines * block, share * engines * engines * block
        gbps[side] = (round(stored / max(t[0] for t in times) / 1e9, 2), round(loaded / max(t[1] for t in times) / 1e9,
                                                                             2))
    (ns, nl), (ps, pl) = gbps["node"], gbps["private"]
    return EnginesRow(engines, block, share * engines, ns, ps, round(ns / ps, 3), nl, pl, round(nl / pl, 3))


def _gbps(total: int, seconds: list[float]) -> float:
    return round(total / statistics.median(seconds) / 1e9, 2)


def _human(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"
