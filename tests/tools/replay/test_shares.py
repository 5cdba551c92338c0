"""Sizing shares: the greedy split on hand-made curves (concave, flat, flat-then-climbing), its floor and errors, and
the suggestion for a flooded trace (the flood at the floor, every chat tenant at or above its equal share's worth)."""

from __future__ import annotations

import pytest

from kvoffload.tools.replay.result import ReplayResult
from kvoffload.tools.replay.shares import Curve, split_steps, suggest_shares
from kvoffload.tools.replay.synthetic import FLOOD, synthetic
from kvoffload.tools.replay.tenants import compare_tenants, isolation_misses

TIER = 200


def curve(name: str, hits: list[int]) -> Curve:
    """A curve of ``hits`` hit tokens at 1, 2, ... steps."""
    results = [ReplayResult("lru", "all", k + 1, 16, 1, 1000, h, 1, 0, 0, 0, 0, 0, 0, 0.0)
               for k, h in enumerate(hits)]
    return Curve(name, results)


def test_steps_go_where_they_buy_the_most_hit_tokens() -> None:
    steep = curve("steep", [100, 190, 270, 340, 400, 450, 490, 520, 540, 550])
    gentle = curve("gentle", [50, 95, 135, 170, 200, 225, 245, 260, 270, 275])
    given, default = split_steps([steep, gentle], 10, 1)
    assert sum(given) + default == 10 and default == 1
    assert given[0] > given[1] >= 1


def test_a_flat_curve_stays_at_the_floor_and_unused_steps_go_to_the_default() -> None:
    flat = curve("flood", [0] * 10)
    small = curve("small", [10, 20, 20, 20, 20, 20, 20, 20, 20, 20])
    given, default = split_steps([flat, small], 10, 1)
    assert given == [1, 2] and default == 7


def test_a_curve_that_climbs_late_gets_the_run_that_reaches_the_climb() -> None:
    # One step at a time, "loop" gains nothing until 5 steps; looking at runs sees 1000 tokens over 4 steps.
    loop = curve("loop", [0, 0, 0, 0, 1000, 1000, 1000, 1000, 1000, 1000])
    small = curve("small", [10, 20, 30, 40, 50, 60, 70, 80, 90, 100])
    given, _ = split_steps([loop, small], 10, 1)
    assert given[0] == 5


def test_split_refuses_floors_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        split_steps([curve(str(i), [0] * 4) for i in range(4)], 4, 1)


def test_the_suggestion_keeps_the_flood_at_the_floor_and_isolates_the_chat_tenants() -> None:
    trace = synthetic(f"synthetic:tenants-flood:{TIER}")
    suggestion = suggest_shares(trace, TIER)
    shares = dict(zip(suggestion.quotas.names, suggestion.quotas.shares, strict=True))
    assert shares[FLOOD] == 0.05
    assert all(shares[t] >= 0.15 for t in ("t0", "t1", "t2", "t3"))
    assert sum(shares.values()) + suggestion.quotas.default == pytest.approx(1.0)
    comparison = compare_tenants(trace, TIER, suggestion.quotas)
    assert isolation_misses(comparison, exempt=[FLOOD]) == []
    assert comparison.with_quotas.token_hit_rate > comparison.without_quotas.token_hit_rate


def test_the_floor_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match="floor 0"):
        suggest_shares(synthetic("synthetic:tenants-calm:20"), 20, floor=0)
