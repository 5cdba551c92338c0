"""Store admission in replay: the manager's own rules (``kvoffload.index.admission``) decide how many leading
missed blocks are stored; the bounds ignore them."""

from __future__ import annotations

from tests.tools.replay.traces import trace

from kvoffload.config import EvictionPolicy, StoreAdmission
from kvoffload.tools.replay import Bound, replay

SECOND = StoreAdmission.SECOND_SIGHTING


def test_all_stores_every_missed_block() -> None:
    result = replay(trace([0, 1], [0, 1], [0, 1]), 4, EvictionPolicy.LRU)
    assert (result.admission, result.stored_blocks, result.declined_blocks, result.hit_blocks) == ("all", 2, 0, 4)


def test_second_sighting_stores_a_block_seen_before() -> None:
    result = replay(trace([0, 1], [0, 1], [0, 1], [2]), 4, EvictionPolicy.LRU, admission=SECOND)
    # Request 0 offers 0, 1 (declined), request 1 offers them again (stored), request 2 hits, 2 is seen once.
    assert (result.admission, result.stored_blocks, result.declined_blocks, result.hit_blocks) == (
        "second-sighting", 2, 3, 2)


def test_the_bounds_ignore_the_admission_rule() -> None:
    t = trace([0, 1], [0, 1], [0, 1])
    assert replay(t, 4, Bound.OPTIMUM, admission=SECOND).admission == "all"
    assert replay(t, 4, Bound.UNBOUNDED, admission=SECOND).hit_blocks == 4
