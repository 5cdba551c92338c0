"""``CircuitBreaker``: consecutive errors open it for a cool-down; a success resets the count only if its I/O began
after the latest error (I/O threads report in the order their I/O ends)."""

from __future__ import annotations

import pytest

from kvoffload.tiers.lower.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_success_begun_before_the_latest_error_does_not_reset_the_count() -> None:
    breaker = CircuitBreaker(3, 10.0, Clock())
    slow = breaker.errors  # a slow read begins while the disk still works
    breaker.record(False)
    breaker.record(False)  # the disk failed meanwhile
    breaker.record(True, since=slow)  # the slow read ends well: it says nothing of the disk now
    breaker.record(False)
    assert breaker.is_open and breaker.trips == 1


def test_a_success_begun_after_the_latest_error_resets_the_count() -> None:
    """The control: the same order of events, the success begun after the errors, keeps the breaker closed."""
    breaker = CircuitBreaker(3, 10.0, Clock())
    breaker.record(False)
    breaker.record(False)
    breaker.record(True, since=breaker.errors)
    breaker.record(False)
    assert not breaker.is_open and breaker.trips == 0


def test_the_breaker_closes_after_its_cool_down() -> None:
    clock = Clock()
    breaker = CircuitBreaker(1, 10.0, clock)
    breaker.record(False)
    assert breaker.is_open and not breaker.allow()
    clock.now = 10.0
    assert breaker.allow() and not breaker.is_open


def test_a_failure_every_next_attempt_would_meet_opens_it_at_once_and_logs_once(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    breaker = CircuitBreaker(8, 10.0, clock, tier="object tier (scheduler)")
    breaker.fail("request timeout", at_once=True)
    breaker.fail("request timeout", at_once=True)  # a search already under way when it opened
    assert breaker.is_open and breaker.trips == 1 and breaker.errors == 2
    assert [r.getMessage() for r in caplog.records].count(
        "object tier (scheduler): request timeout; switching the object tier (scheduler) off for 10.0 s") == 1
    clock.now = 10.0
    assert breaker.allow() and not breaker.is_open


def test_an_ordinary_failure_only_counts_towards_the_threshold() -> None:
    """The control: the same failure not ``at_once`` leaves the breaker closed below its threshold."""
    breaker = CircuitBreaker(8, 10.0, Clock())
    breaker.fail("server error")
    assert not breaker.is_open and breaker.errors == 1
