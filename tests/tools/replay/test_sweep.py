"""Sweeps: log-spaced capacities, and points replayed in a process pool equal to the same points replayed here."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise
from pathlib import Path

from tests.tools.replay.traces import trace, write_jsonl

from kvoffload.config import EvictionPolicy, StoreAdmission
from kvoffload.tools.replay import Bound, Trace
from kvoffload.tools.replay.sweep import capacity_sweep, run_points, sweep_points


def footprint_trace(blocks: int) -> Trace:
    return trace(list(range(blocks)), block_tokens=512)


def test_capacities_are_log_spaced_from_a_tenth_of_a_million_to_thirty_million_tokens() -> None:
    capacities = capacity_sweep(footprint_trace(200_000))
    assert len(capacities) == 12
    assert capacities[0] * 512 == 99_840 and capacities[-1] * 512 == 30_000_128
    ratios = [b / a for a, b in pairwise(capacities)]
    assert max(ratios) / min(ratios) < 1.01


def test_capacities_stop_at_the_trace_footprint() -> None:
    assert capacity_sweep(footprint_trace(1000))[-1] == 1000
    assert capacity_sweep(footprint_trace(10)) == [10]


def test_a_sweep_has_one_unbounded_point() -> None:
    points = sweep_points([4, 8], [EvictionPolicy.LRU, Bound.OPTIMUM], StoreAdmission.ALL)
    assert [(p.strategy, p.capacity_blocks) for p in points] == [
        (Bound.UNBOUNDED, 8), (EvictionPolicy.LRU, 4), (Bound.OPTIMUM, 4), (EvictionPolicy.LRU, 8),
        (Bound.OPTIMUM, 8)]


def test_points_replayed_in_worker_processes_equal_those_replayed_here(tmp_path: Path) -> None:
    path = str(write_jsonl(tmp_path / "t.jsonl", [[0, 1, 2], [0, 1, 3], [4, 5], [0, 1, 2], [4, 6], [0, 1, 3]]))
    points = sweep_points([2, 3], [*EvictionPolicy, Bound.OPTIMUM], StoreAdmission.ALL)
    here = run_points(path, points, workers=1)
    pooled = run_points(path, points, workers=2)
    assert [replace(r, seconds=0) for r in pooled] == [replace(r, seconds=0) for r in here]
    assert [r.strategy for r in here][:2] == ["unbounded", "lru"]
