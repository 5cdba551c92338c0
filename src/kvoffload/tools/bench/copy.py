"""``kvoffload bench copy``: device<->host copy GB/s of ``HostCopier`` beside memcpy of the same
bytes.

For each page size and direction, one job of ``blocks_per_job`` blocks is run again and again through a real
handler (submit, wait), each run paired with one memcpy of the same bytes, buffer to buffer, interleaved so
both see the same machine load. The baseline is libc ``memcpy`` (one call, one core) on CPU and one contiguous
``copy_`` (a single cudaMemcpy) with CUDA. Rows report medians after warm-up runs: the handler's GB/s (submit to
wait returning: planning, queueing and copies), memcpy GB/s, their ratio (median of the per-run ratios) and
the spread (max - min) / median of the handler's GB/s. Block ids and slots are a random permutation, so
hardly two blocks of a job are adjacent: runs of consecutive blocks, which the handler merges into one copy,
only make it faster. ``--device`` says where the "device" KV cache lives: ``cpu`` (CPU memory), ``cuda`` (the
GPU, with a pinned host pool; an error without CUDA) or ``auto`` (the default: the GPU when there is one).

With CUDA, rows also say which path the copier chose for the job (``batched`` or ``per_copy``, see
``transfer/cuda_batch.py``), and run the same job again with batching off: ``per_copy_gbps`` and
``per_copy_ratio`` beside the handler's figures. ``--layers N`` gives every block N per-layer pages (N views,
one slot holds a block's N pages), the shape of a real model's KV cache.

Where a run's time goes: ``plan_ms`` is the time ``submit`` spent checking and planning the job (the
handler's ``plan_seconds``), ``copy_ms`` the copier's own time for it (``TransferResult.seconds``: the copies,
cut into pieces across threads); the shares are their medians over runs as parts of the handler's time. What
neither covers is handing the job between threads.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from kvoffload.blocks import DeviceBlocks, HostBlocks, TransferJob
    from kvoffload.canonical import CanonicalKV
    from kvoffload.transfer.host_copier import HostCopier
    from kvoffload.transfer.host_pool import HostPool

KIB = 1 << 10
MIB = 1 << 20
DEFAULT_PAGE_SIZES = (4 * KIB, 64 * KIB, MIB)
DEFAULT_JOB_BYTES = 32 * MIB
MAX_BLOCKS = 4096
WARMUP_RUNS = 2


NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False"


@dataclass(frozen=True)
class Row:
    page_bytes: int
    blocks_per_job: int
    direction: str
    gbps: float
    memcpy_gbps: float
    ratio: float
    runs: int
    spread: float
    plan_ms: float
    copy_ms: float
    plan_share: float
    copy_share: float


@dataclass(frozen=True)
class CudaRow(Row):
    """A row measured on the GPU: the path the copier took, and the same job with batching off."""

    device: str
    layers: int
    path: str
    per_copy_gbps: float
    per_copy_ratio: float


def _size(text: str) -> int:
    units = {"k": KIB, "kib": KIB, "m": MIB, "mib": MIB, "": 1}
    t = text.strip().lower()
    digits = t.rstrip("kmib")
    try:
        value = int(digits) * units[t[len(digits):]]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use bytes or a K/M suffix, e.g. 64K") from None
    if not 4 * KIB <= value <= 2 * MIB:
        raise argparse.ArgumentTypeError(f"page size {text!r} outside 4K..2M")
    return value


def _page_sizes(text: str) -> tuple[int, ...]:
    return tuple(_size(part) for part in text.split(","))


def _bounded(lo: int, hi: int, name: str) -> type[int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{name} must be in {lo}..{hi}, got {value}")
        return value

    return parse  # type: ignore[return-value]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows instead of a table")
    parser.add_argument("--runs", type=_bounded(1, 1000, "--runs"), default=11,
                        help=f"timed runs per row, after {WARMUP_RUNS} warm-up runs (default 11)")
    parser.add_argument("--page-sizes", type=_page_sizes, default=DEFAULT_PAGE_SIZES,
                        help="comma-separated block sizes, 4K..2M (default 4K,64K,1M)")
    parser.add_argument("--blocks-per-job", type=_bounded(1, MAX_BLOCKS, "--blocks-per-job"), default=None,
                        help=f"blocks per job, 1..{MAX_BLOCKS} (default: 32 MiB worth, at most {MAX_BLOCKS})")
    parser.add_argument("--threads", type=_bounded(1, 64, "--threads"), default=2,
                        help="copy threads of the handler (CPU KV cache; default 2)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the KV cache lives: auto (the GPU when there is one; default), cpu, cuda")
    parser.add_argument("--layers", type=_bounded(1, 64, "--layers"), default=1,
                        help="per-layer pages per block, each in its own view (default 1)")


def run(args: argparse.Namespace) -> int:
    import sys

    import torch

    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print(f"kvoffload bench copy: --device cuda {NO_CUDA}", file=sys.stderr)
        return 2
    rows: list[Row] = []
    for page in args.page_sizes:
        blocks = args.blocks_per_job or max(1, min(MAX_BLOCKS, DEFAULT_JOB_BYTES // (page * args.layers)))
        for store in (True, False):
            if device == "cuda":
                rows.append(measure_cuda(page, blocks, store, args.runs, args.layers))
            else:
                rows.append(measure(page, blocks, store, args.runs, args.threads, "cpu", args.layers))
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(_table(rows))
    return 0


def measure_cuda(page_bytes: int, blocks: int, store: bool, runs: int, layers: int = 1) -> CudaRow:
    """A ``measure`` row on the GPU, with the path the copier chose and the same job with batching off."""
    row = measure(page_bytes, blocks, store, runs, 1, "cuda", layers)
    per_copy = measure(page_bytes, blocks, store, runs, 1, "cuda", layers, batching=False)
    path = "batched" if _batched(page_bytes, blocks, store, layers) else "per_copy"
    return CudaRow(**asdict(row), device="cuda", layers=layers, path=path, per_copy_gbps=per_copy.gbps,
                   per_copy_ratio=per_copy.ratio)


def measure(page_bytes: int, blocks: int, store: bool, runs: int, threads: int, device: str = "cpu",
            layers: int = 1, batching: bool = True) -> Row:
    """One row: ``runs`` timed (handler, memcpy) pairs after warm-up, for one job shape."""
    from kvoffload.blocks import JobId, TransferJob
    from kvoffload.transfer.host_copier import HostCopier

    # The handler moves every block (its ``layers`` pages) to a random slot of an equal-sized pool (and back);
    # the baseline copies the very same bytes, buffer to buffer, in one contiguous copy. Same source and
    # destination memory on both sides, so neither gains from caches the other cannot use; only the order and the
    # batching differ.
    buffer, kv, pool, device_spec, host_spec = _setup(page_bytes, blocks, layers, device)
    total = blocks * layers * page_bytes
    view_bytes, pool_bytes = buffer.view(-1), pool.buffer.view(-1)
    src, dst = (view_bytes, pool_bytes) if store else (pool_bytes, view_bytes)
    handler = HostCopier(kv, pool, factor=1, threads=threads, cuda_batching=batching)
    runs_s: list[_Run] = []
    try:
        for i in range(WARMUP_RUNS + runs):
            job_id = JobId(i)
            job = (TransferJob(job_id, device_spec, host_spec) if store
                   else TransferJob(job_id, host_spec, device_spec))
            h, p, c = _time_job(handler, job)
            m = _time_memcpy(dst, src)
            if i >= WARMUP_RUNS:
                runs_s.append(_Run(h, m, p, c))
    finally:
        handler.shutdown()
    return _row(page_bytes, blocks, store, total, runs_s)


def _setup(page_bytes: int, blocks: int, layers: int, device: str
           ) -> tuple[torch.Tensor, CanonicalKV, HostPool, DeviceBlocks, HostBlocks]:
    """The KV buffer (``layers`` views of ``blocks`` pages, end to end), its canonical form, a pool, the specs."""
    import torch

    from kvoffload.blocks import DeviceBlocks, HostBlocks
    from kvoffload.canonical import BlockRef, CanonicalKV
    from kvoffload.transfer.host_pool import HostPool

    rng = random.Random(page_bytes * 7 + blocks)
    buffer = torch.ones((layers * blocks, page_bytes), dtype=torch.int8, device=device)
    views = tuple(buffer[i * blocks:(i + 1) * blocks] for i in range(layers))
    kv = CanonicalKV(views, (tuple(BlockRef(i, page_bytes) for i in range(layers)),), num_blocks=blocks)
    pool = HostPool(blocks, layers * page_bytes, pin_memory=True)
    if device == "cuda" and not pool.pinned:
        raise RuntimeError("bench copy: the host pool could not be pinned")
    pool.buffer.fill_(1)  # touch every page now, not inside a timed run
    ids = tuple(rng.sample(range(blocks), blocks))
    slots = tuple(rng.sample(range(blocks), blocks))
    return buffer, kv, pool, DeviceBlocks(ids, (blocks,)), HostBlocks(slots, (blocks,))


def _batched(page_bytes: int, blocks: int, store: bool, layers: int) -> bool:
    """Whether the CUDA copier batches this row's job (the same plan, built on CPU tensors)."""
    from kvoffload.blocks import JobId, TransferJob
    from kvoffload.transfer import cuda_batch
    from kvoffload.transfer.copy_plan import PlanLayout, build_plan

    _, kv, pool, device_spec, host_spec = _setup(page_bytes, blocks, layers, "cpu")
    job = (TransferJob(JobId(0), device_spec, host_spec) if store else TransferJob(JobId(0), host_spec, device_spec))
    layout = PlanLayout.of(kv, pool.num_slots, int(pool.buffer.stride(0)), 1)
    return cuda_batch.split(build_plan(layout, job)) is not None


class _Run(NamedTuple):
    """Seconds of one timed run: the handler's job, the memcpy, planning the job, the copier's part of the job."""

    handler: float
    memcpy: float
    plan: float
    copy: float


def _time_job(handler: HostCopier, job: TransferJob) -> tuple[float, float, float]:
    """The job's seconds from submit to wait returning, the handler's planning and the copier's part of them."""
    planned = handler.plan_seconds
    start = time.perf_counter()
    handler.submit(job)
    handler.wait([job.job_id])
    seconds = time.perf_counter() - start
    results = handler.get_finished()
    if not all(r.success for r in results):
        raise RuntimeError(f"bench copy: a job failed: {results}")
    return seconds, handler.plan_seconds - planned, sum(r.seconds for r in results)


def _time_memcpy(dst: torch.Tensor, src: torch.Tensor) -> float:
    import ctypes

    import torch

    start = time.perf_counter()
    if dst.is_cuda or src.is_cuda:
        dst.copy_(src, non_blocking=False)
        torch.cuda.synchronize()
    else:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    return time.perf_counter() - start


def _row(page: int, blocks: int, store: bool, total: int, runs: list[_Run]) -> Row:
    gbps = [total / r.handler / 1e9 for r in runs]
    median = statistics.median(gbps)
    return Row(
        page_bytes=page,
        blocks_per_job=blocks,
        direction="device_to_host" if store else "host_to_device",
        gbps=round(median, 3),
        memcpy_gbps=round(statistics.median(total / r.memcpy / 1e9 for r in runs), 3),
        ratio=round(statistics.median(r.memcpy / r.handler for r in runs), 3),
        runs=len(runs),
        spread=round((max(gbps) - min(gbps)) / median, 3),
        plan_ms=round(statistics.median(r.plan for r in runs) * 1e3, 4),
        copy_ms=round(statistics.median(r.copy for r in runs) * 1e3, 4),
        plan_share=round(statistics.median(r.plan / r.handler for r in runs), 3),
        copy_share=round(statistics.median(r.copy / r.handler for r in runs), 3),
    )


def _table(rows: list[Row]) -> str:
    cuda = bool(rows) and all(isinstance(r, CudaRow) for r in rows)
    header = ("page", "blocks", "direction", "GB/s", "memcpy", "ratio", "spread", "plan", "copy")
    lines = ["{:>8} {:>6} {:<15} {:>7} {:>7} {:>6} {:>6} {:>6} {:>6}".format(*header)
             + (" {:<8} {:>8} {:>6}".format("path", "per-copy", "ratio") if cuda else "")]
    for r in rows:
        lines.append(f"{_human(r.page_bytes):>8} {r.blocks_per_job:>6} {r.direction:<15} {r.gbps:>7.2f} "
                     f"{r.memcpy_gbps:>7.2f} {r.ratio:>6.2f} {r.spread:>6.2f} {r.plan_share:>6.0%} "
                     f"{r.copy_share:>6.0%}"
                     + (f" {r.path:<8} {r.per_copy_gbps:>8.2f} {r.per_copy_ratio:>6.2f}"
                        if isinstance(r, CudaRow) else ""))
    lines.append(f"median of {rows[0].runs if rows else 0} runs; ratio = handler / memcpy of the same bytes; "
                 "plan, copy = shares of the handler's time spent planning the job and copying it"
                 + ("; path = what the copier chose, per-copy = the same job with batching off" if cuda else ""))
    return "\n".join(lines)


def _human(n: int) -> str:
    return f"{n // MIB}M" if n % MIB == 0 else f"{n // KIB}K" if n % KIB == 0 else str(n)
