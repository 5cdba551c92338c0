"""SchedulerStats: every counter counts in ``is_empty`` and ``aggregate`` (both are spelled out for speed)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kvoffload.connector.stats import RetentionFigures, SchedulerStats, TenantFigures

COUNTERS = [f.name for f in fields(SchedulerStats) if f.name not in ("tenants", "retention")]


@pytest.mark.parametrize("name", COUNTERS)
def test_each_counter_makes_the_stats_non_empty_and_adds_up(name: str) -> None:
    one = SchedulerStats(**{name: 3})
    assert not one.is_empty()
    total = one.aggregate(SchedulerStats(**{name: 4}))
    assert getattr(total, name) == 7
    assert all(getattr(total, other) == 0 for other in COUNTERS if other != name)
    assert total.tenants is None


def test_tenant_figures_make_the_stats_non_empty_add_up_and_move_out_on_take() -> None:
    one = SchedulerStats(tenants=TenantFigures({"a": [10, 4]}, {"host": {"a": [512, 2, 1, 3]}}))
    assert not one.is_empty()
    two = SchedulerStats(tenants=TenantFigures({"a": [5, 5], "b": [1, 0]}, {"host": {"a": [256, 1, 1, 1]}}))
    total = one.aggregate(two)
    assert total.tenants == TenantFigures({"a": [15, 9], "b": [1, 0]}, {"host": {"a": [256, 3, 2, 4]}})
    taken = one.take()
    assert taken.tenants is not None and one.tenants is None and one.is_empty()
    assert TenantFigures.from_dict(taken.tenants.as_dict()) == taken.tenants


def test_retention_figures_make_the_stats_non_empty_add_up_and_move_out_on_take() -> None:
    one = SchedulerStats(retention=RetentionFigures([2, 1, 0], {"host": [4096, 3, 0, 1]}))
    assert not one.is_empty()
    two = SchedulerStats(retention=RetentionFigures([1, 0, 5], {"host": [1024, 1, 2, 0], "disk": [8192, 0, 0, 0]}))
    total = one.aggregate(two)
    assert total.retention == RetentionFigures([3, 1, 5], {"host": [1024, 4, 2, 1], "disk": [8192, 0, 0, 0]})
    taken = one.take()
    assert taken.retention is not None and one.retention is None and one.is_empty()
    assert RetentionFigures.from_dict(taken.retention.as_dict()) == taken.retention


def test_fresh_stats_are_empty() -> None:
    assert SchedulerStats().is_empty()
