"""``kvoffload bench pool``: the host pool's start-up: what the constructor costs, how long populating its pages
takes (``transfer/warm_pages.py``), and how fast the first stores into a fresh pool run, beside stores into the same
pool once its pages are present.

Each run makes three fresh private pools of ``--pool-mib``, one at a time, in a rotating order:

- ``cold``: ``HostPool(..., warm=False)``, the pool as it was before warming: every page faults on its first store;
- ``warmed``: ``HostPool(...)`` as an engine makes it, stores started as soon as the constructor returns (the part
  the constructor did not populate goes on in the background, beside the stores);
- ``warmed_waited``: the same, stores started once population has ended.

A pass stores one slot-sized block (random bytes, ``--slot-bytes``) into every slot once, one libc ``memcpy`` per
slot on one core (the copy the host copier makes, without its threads), and is timed as GB/s. The first pass is
the "first stores"; a second pass into the same pool is the "warm" baseline, and ``ratio`` is the median of the
per-run ratios first / warm (target >= 0.8 for the warmed pools). ``construct_s`` is the constructor's time (the
start-up delay), ``populate_s`` the population's, from start to end (background part included). Between the passes
every slot is compared with the block: stores racing population must all survive (``bytes_equal``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvoffload.tools.bench.common import Report, emit, format_table, positive_int
from kvoffload.tools.bench.disk import KIB, MIB, _size

if TYPE_CHECKING:
    import torch

    from kvoffload.transfer.host_pool import HostPool

KINDS = ("cold", "warmed", "warmed_waited")
_libc = ctypes.CDLL(None)
_libc.memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_libc.memcmp.restype = ctypes.c_int
WAIT_S = 600.0


@dataclass(frozen=True)
class Sample:
    """One fresh pool's figures."""

    construct_s: float
    populate_s: float
    background: bool
    first_gbps: float
    warm_gbps: float
    bytes_equal: bool


@dataclass(frozen=True)
class Row:
    kind: str
    pool_bytes: int
    slot_bytes: int
    construct_s: float
    populate_s: float
    background: bool
    first_gbps: float
    warm_gbps: float
    ratio: float
    """Median of the per-run ratios first / warm (target >= 0.8 for the warmed pools)."""
    runs: int
    spread: float
    bytes_equal: bool


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("--pool-mib", type=positive_int, default=2048, help="MiB of each pool (default 2048)")
    parser.add_argument("--slot-bytes", type=_size, default=2 * MIB,
                        help="bytes of a slot and of the block stored into it, K/M suffix (default 2M)")
    parser.add_argument("--runs", type=positive_int, default=3,
                        help="fresh pools of each kind, one at a time (default 3)")


def run(args: argparse.Namespace) -> int:
    import torch

    slots = max(1, args.pool_mib * MIB // args.slot_bytes)
    samples: dict[str, list[Sample]] = {kind: [] for kind in KINDS}
    for i in range(args.runs):
        block = torch.randint(-128, 128, (args.slot_bytes,), dtype=torch.int8)
        for kind in KINDS[i % len(KINDS):] + KINDS[:i % len(KINDS)]:
            samples[kind].append(measure(kind, slots, block))
    rows = [_row(kind, slots, args.slot_bytes, s) for kind, s in samples.items()]
    table = format_table(
        ("kind", "pool MiB", "slot", "construct s", "populate s", "background", "first GB/s", "warm GB/s", "ratio",
         "spread", "bytes equal"),
        [(r.kind, r.pool_bytes // MIB, f"{r.slot_bytes // KIB} KiB", r.construct_s, r.populate_s, r.background,
          r.first_gbps, r.warm_gbps, r.ratio, r.spread, r.bytes_equal) for r in rows])
    notes = (f"medians of {args.runs} fresh pools each; first = the first store into every slot, warm = a second "
             "pass into the same pool; ratio = first / warm (target >= 0.8 warmed); construct s = the start-up delay",)
    settings = {"runs": args.runs, "pool_mib": args.pool_mib, "slot_bytes": args.slot_bytes}
    emit(Report("pool", [asdict(r) for r in rows], table, notes, settings), args)
    return 0 if all(r.bytes_equal for r in rows) else 1


def measure(kind: str, slots: int, block: torch.Tensor) -> Sample:
    """One fresh pool of ``kind``: construct it, store ``block`` into every slot twice, check the slots between."""
    from kvoffload.transfer.host_pool import HostPool

    gc.collect()  # the previous pool's memory goes back before this one is made
    start = time.perf_counter()
    pool = HostPool(slots, block.numel(), warm=kind != "cold")
    construct_s = time.perf_counter() - start
    warming = pool.warming
    if kind == "warmed_waited" and warming is not None:
        warming.wait(WAIT_S)
    first = _store_every_slot(pool, block)
    if warming is not None:
        warming.wait(WAIT_S)
    equal = all(_same_bytes(pool.slot(i), block) for i in range(slots))
    warm = _store_every_slot(pool, block)
    return Sample(construct_s, warming.seconds if warming is not None else 0.0,
                  warming is not None and warming.in_background, first, warm, equal)


def _store_every_slot(pool: HostPool, block: torch.Tensor) -> float:
    """GB/s of one memcpy of ``block`` into each slot in turn."""
    src, size = block.data_ptr(), block.numel()
    base, stride = pool.buffer.data_ptr(), int(pool.buffer.stride(0))
    start = time.perf_counter()
    for i in range(pool.num_slots):
        ctypes.memmove(base + i * stride, src, size)
    return pool.nbytes / (time.perf_counter() - start) / 1e9


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # libc memcmp: torch.equal takes 7 ms a 2 MiB slot here, which made the check most of the bench's time.
    return a.numel() == b.numel() and _libc.memcmp(a.data_ptr(), b.data_ptr(), a.numel()) == 0


def _row(kind: str, slots: int, slot_bytes: int, samples: list[Sample]) -> Row:
    first = [s.first_gbps for s in samples]
    median = statistics.median(first)
    return Row(
        kind=kind,
        pool_bytes=slots * slot_bytes,
        slot_bytes=slot_bytes,
        construct_s=round(statistics.median(s.construct_s for s in samples), 4),
        populate_s=round(statistics.median(s.populate_s for s in samples), 4),
        background=any(s.background for s in samples),
        first_gbps=round(median, 3),
        warm_gbps=round(statistics.median(s.warm_gbps for s in samples), 3),
        ratio=round(statistics.median(s.first_gbps / s.warm_gbps for s in samples), 3),
        runs=len(samples),
        spread=round((max(first) - min(first)) / median, 3),
        bytes_equal=all(s.bytes_equal for s in samples),
    )
