"""SchedulerStats: every counter counts in ``is_empty`` and ``aggregate`` (both are spelled out for speed)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kvoffload.connector.stats import SchedulerStats

COUNTERS = [f.name for f in fields(SchedulerStats)]


@pytest.mark.parametrize("name", COUNTERS)
def test_each_counter_makes_the_stats_non_empty_and_adds_up(name: str) -> None:
    one = SchedulerStats(**{name: 3})
    assert not one.is_empty()
    total = one.aggregate(SchedulerStats(**{name: 4}))
    assert getattr(total, name) == 7
    assert all(getattr(total, other) == 0 for other in COUNTERS if other != name)


def test_fresh_stats_are_empty() -> None:
    assert SchedulerStats().is_empty()
