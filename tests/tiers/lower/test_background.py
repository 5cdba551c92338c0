"""``Searches`` and ``Deletes``: a shared store's questions run off the caller's thread, bounded, never waited for.

The probe is a gate the test opens (tests/tiers/lower/gated.py): "the caller did not wait" is a fact of the order
of events, not of a timing.
"""

from __future__ import annotations

import pytest
from tests.tiers.lower.gated import Clock, GatedProbe, keys

from kvoffload.tiers.lower import background
from kvoffload.tiers.lower.background import Deletes, SearchAnswer, Searches


def test_a_search_answers_later_and_the_caller_never_waits() -> None:
    probe, clock = GatedProbe(run=3), Clock()
    searches = Searches(probe, deadline_s=2.0, clock=clock)
    ks = keys(8)
    assert searches.answer(ks) is None  # started; the store has not answered (the gate is shut)
    assert searches.answer(ks) is None  # asked again before the answer: still on its way
    probe.gate.set()
    assert searches.wait(10.0)
    assert searches.answer(ks) == SearchAnswer(3)
    assert searches.started == 1 and probe.searched == [tuple(ks)] and searches.unanswered == 0
    assert searches.answer(ks) is None and searches.started == 2  # an answer is given once: a new search
    searches.close()


def test_a_search_past_its_deadline_is_a_miss_whatever_its_thread_does() -> None:
    probe, clock = GatedProbe(run=5), Clock()
    searches = Searches(probe, deadline_s=2.0, clock=clock)
    ks = keys(4)
    assert searches.answer(ks) is None
    clock.now = 1.9
    assert searches.answer(ks) is None
    clock.now = 2.0
    assert searches.answer(ks) == SearchAnswer(None, late=True)  # the store still holds the thread
    assert searches.late == 1 and searches.unanswered == 1 and searches.open == 0
    probe.gate.set()  # its late answer is dropped: the next ask starts anew
    assert searches.answer(ks) is None and searches.started == 2
    searches.close()


def test_searches_open_at_once_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background, "MAX_SEARCHES", 3)
    probe, clock = GatedProbe(), Clock()
    searches = Searches(probe, deadline_s=2.0, clock=clock)
    for salt in range(3):
        assert searches.answer(keys(2, salt)) is None
    assert searches.answer(keys(2, 9)) == SearchAnswer(None)  # a stuck store cannot pile up searches
    assert searches.refused == 1 and searches.unanswered == 1 and searches.open == 3
    clock.now = 2.0 + background.KEEP_ANSWER_S  # nobody asked again: the stale ones go to make room
    assert searches.answer(keys(2, 9)) is None and searches.open == 1
    probe.gate.set()
    searches.close()


def test_a_probe_that_raises_is_a_store_not_answering() -> None:
    probe, clock = GatedProbe(run=2), Clock()
    probe.raises = True
    searches = Searches(probe, deadline_s=2.0, clock=clock)
    assert searches.answer(keys(2)) is None
    probe.gate.set()
    assert searches.wait(10.0)
    assert searches.answer(keys(2)) == SearchAnswer(None)
    searches.close()


def test_deletes_are_queued_and_never_waited_for() -> None:
    probe = GatedProbe()
    deletes = Deletes(probe, "test tier")
    deletes.submit(keys(3))  # returns though the store holds the delete
    deletes.submit(keys(2, salt=1))
    assert deletes.waiting == 5 and not probe.deleted
    probe.gate.set()
    assert deletes.wait_idle(10.0)
    assert probe.deleted == [tuple(keys(3)), tuple(keys(2, salt=1))] and deletes.failed == 0
    deletes.close()


def test_deletes_past_the_bound_are_dropped_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background, "MAX_DELETE_KEYS", 4)
    probe = GatedProbe()
    deletes = Deletes(probe, "test tier")
    deletes.submit(keys(3))
    deletes.submit(keys(2, salt=1))  # 5 > 4 waiting: dropped
    assert deletes.dropped == 2 and deletes.waiting == 3
    probe.gate.set()
    assert deletes.wait_idle(10.0) and probe.deleted == [tuple(keys(3))]
    deletes.close()


def test_a_failed_delete_is_counted() -> None:
    probe = GatedProbe()
    probe.raises = True
    probe.gate.set()
    deletes = Deletes(probe, "test tier")
    deletes.submit(keys(2))
    assert deletes.wait_idle(10.0) and deletes.failed == 2
    deletes.close()
