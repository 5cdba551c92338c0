"""Many replays of one trace: every policy and bound at every capacity of a sweep, in a process pool.

Each point is an independent replay (``loop.replay``), so points run in parallel, one per process. A worker reads
the trace once and keeps it (with its next-use table, for the optimum); forked workers inherit the parent's copy.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import NamedTuple

from kvoffload.config import EvictionPolicy, StoreAdmission
from kvoffload.tools.replay.agentic import PREFIX as AGENTIC_PREFIX
from kvoffload.tools.replay.agentic import agentic_trace
from kvoffload.tools.replay.loop import Bound, Strategy, replay
from kvoffload.tools.replay.optimum import NextUse, next_uses
from kvoffload.tools.replay.result import ReplayResult
from kvoffload.tools.replay.synthetic import PREFIX, synthetic
from kvoffload.tools.replay.tenant_traces import PREFIX as TENANTS_PREFIX
from kvoffload.tools.replay.tenant_traces import tenant_trace
from kvoffload.tools.replay.trace import Trace, read_trace


class Point(NamedTuple):
    """One replay of a sweep."""

    strategy: Strategy
    capacity_blocks: int
    admission: StoreAdmission


def policies() -> list[EvictionPolicy]:
    """Every eviction policy the index has (new ones show up in replay and plan by themselves)."""
    return list(EvictionPolicy)


def capacity_sweep(trace: Trace, points: int = 12, low_tokens: int = 100_000,
                   high_tokens: int = 30_000_000) -> list[int]:
    """``points`` capacities in blocks, log-spaced from ``low_tokens`` to ``high_tokens`` or to the trace's whole
    footprint (every block it references) if that is smaller; fewer when blocks repeat."""
    footprint = max(1, trace.distinct_keys()) * trace.block_tokens
    high = min(high_tokens, footprint)
    low = min(low_tokens, high)
    if points <= 1 or low == high:
        return [max(1, high // trace.block_tokens)]
    ratio = (high / low) ** (1 / (points - 1))
    blocks = [max(1, round(low * ratio**i / trace.block_tokens)) for i in range(points)]
    return sorted(set(blocks))


_LOADED: dict[str, tuple[Trace, NextUse | None]] = {}
"""Traces read in this process, by path (the parent's copy is inherited by forked workers)."""


def load(path: str, with_future: bool = True) -> tuple[Trace, NextUse | None]:
    """Read the trace at ``path`` (or build the ``synthetic:NAME`` one, the ``tenants:N[+flood]:PATH`` one or the
    ``agentic[:FIELD=VALUE,...]`` one) once per process; with its next-use table if ``with_future``.

    Raises:
        TraceError: as ``read_trace``. ValueError: an unknown synthetic trace, a malformed ``tenants:`` or
            ``agentic`` one.
    """
    trace, future = _LOADED.get(path) or (_build(path), None)
    if with_future and future is None:
        future = next_uses(trace)
    _LOADED[path] = (trace, future)
    return trace, future


def _build(path: str) -> Trace:
    if path.startswith(PREFIX):
        return synthetic(path)
    if path.startswith(TENANTS_PREFIX):
        return tenant_trace(path)
    if path == AGENTIC_PREFIX or path.startswith(AGENTIC_PREFIX + ":"):
        return agentic_trace(path)
    return read_trace(path)


def run_point(path: str, point: Point) -> ReplayResult:
    """Replay one point of the trace at ``path`` (the function a worker runs)."""
    trace, future = load(path, with_future=point.strategy is Bound.OPTIMUM)
    return replay(trace, point.capacity_blocks, point.strategy, point.admission, future)


def run_points(path: str, points: Sequence[Point], workers: int | None = None,
               progress: Callable[[ReplayResult], None] | None = None) -> list[ReplayResult]:
    """Replay every point, in ``workers`` processes (default: one per core; 1 runs them here), in input order.

    ``progress`` is called with each result as it arrives.
    """
    workers = workers or min(len(points), os.cpu_count() or 1)
    if workers <= 1 or len(points) <= 1:
        results = []
        for point in points:
            results.append(run_point(path, point))
            if progress:
                progress(results[-1])
        return results
    load(path, with_future=any(p.strategy is Bound.OPTIMUM for p in points))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        results = []
        for result in pool.map(run_point, [path] * len(points), points):
            results.append(result)
            if progress:
                progress(result)
        return results


def sweep_points(capacities: Sequence[int], strategies: Sequence[Strategy],
                 admission: StoreAdmission) -> list[Point]:
    """Every strategy at every capacity, plus one unbounded point (its capacity is the trace's footprint)."""
    points = [Point(Bound.UNBOUNDED, max(capacities), admission)]
    points.extend(Point(s, c, admission) for c in capacities for s in strategies if s is not Bound.UNBOUNDED)
    return points

