"""``ProbedIndex`` off the engine step: a lookup that needs the store answers pending and never waits for it, a later
lookup takes the answer, a search past its deadline is a miss, and deletes are queued; ``TieredIndex`` promotes
nothing while a lower tier's answer is on its way.

The store is a gate the test opens (tests/tiers/lower/gated.py): with the gate shut, a call that returned did not
wait on the store (the index before this change asked on the caller's thread and would block these tests for good;
tests/testing/test_sim_store_faults.py shows the steps it held against a real server).
"""

from __future__ import annotations

from collections.abc import Sequence

from tests.tiers.lower.gated import Clock, GatedProbe, keys

from kvoffload.blocks import Medium, TierBlocks
from kvoffload.index.base import LookupResult
from kvoffload.index.slot_index import SlotIndex
from kvoffload.index.tiered import Below, TieredIndex
from kvoffload.keys import OffloadKey
from kvoffload.tiers.lower.probed_index import ProbedIndex


def spec_of(ks: Sequence[OffloadKey], slots: Sequence[int]) -> TierBlocks:
    return TierBlocks(Medium.REMOTE, keys=tuple(ks), group_sizes=(len(ks),))


def index(probe: GatedProbe, clock: Clock, cache_s: float = 1.0) -> ProbedIndex:
    return ProbedIndex(probe, 8, Medium.REMOTE, spec_of, cache_s=cache_s, clock=clock, deadline_s=2.0)


def test_a_lookup_answers_pending_at_once_and_a_later_one_takes_the_answer() -> None:
    probe, clock = GatedProbe(run=3), Clock()
    m = index(probe, clock)
    ks = keys(5)
    assert m.lookup(ks) == LookupResult(0, pending=True)  # the store has not answered: the step goes on
    probe.gate.set()
    assert m.wait_answers(10.0)
    assert m.lookup(ks) == LookupResult(3)
    assert m.lookup(ks) == LookupResult(3) and len(probe.searched) == 1  # remembered for cache_s: no search
    m.close()


def test_with_no_answer_cache_the_answer_is_still_taken_once() -> None:
    """``cache_s`` 0 (ask every time) must not leave a lookup pending for ever: the search's own answer counts."""
    probe, clock = GatedProbe(run=2), Clock()
    m = index(probe, clock, cache_s=0.0)
    ks = keys(4)
    assert m.lookup(ks).pending
    probe.gate.set()
    assert m.wait_answers(10.0)
    assert m.lookup(ks) == LookupResult(2)
    m.close()


def test_a_search_past_its_deadline_is_a_miss() -> None:
    probe, clock = GatedProbe(run=4), Clock()
    m = index(probe, clock)
    ks = keys(4)
    assert m.lookup(ks).pending
    clock.now = 2.0  # the store still holds the search's thread
    assert m.lookup(ks) == LookupResult(0)
    assert m.searches.late == 1
    probe.gate.set()
    m.close()


def test_a_failed_store_is_deleted_in_the_background() -> None:
    probe, clock = GatedProbe(), Clock()
    m = index(probe, clock)
    ks = keys(2)
    out = m.prepare_store(ks)
    assert out is not None
    m.complete_store(out.keys_to_store, success=False)  # returns with the store's delete still held
    assert m.deletes.waiting == 2 and probe.deleted == []
    probe.gate.set()
    assert m.deletes.wait_idle(10.0) and probe.deleted == [tuple(ks)]
    m.check_integrity()
    m.close()


def test_tiered_promotes_nothing_until_the_lower_tier_answers() -> None:
    probe, clock = GatedProbe(run=3), Clock()
    lower = index(probe, clock)
    m = TieredIndex(SlotIndex(4), [Below(lower)])
    ks = keys(3)
    assert m.lookup(ks) == LookupResult(0, pending=True)
    assert m.take_transfers() == [] and m.host.usage()[0].used_blocks == 0  # no host room reserved meanwhile
    probe.gate.set()
    assert lower.wait_answers(10.0)
    assert m.lookup(ks) == LookupResult(0, pending=True)  # now promoted
    (promotion,) = m.take_transfers()
    assert promotion.src == spec_of(ks, ())
    m.check_integrity()
    m.close()


def test_a_store_that_answers_at_once_is_answered_on_the_ask_that_starts_the_search() -> None:
    """A healthy store's search is waited for a moment (``background.INLINE_WAIT_S``): no step goes by."""
    probe, clock = GatedProbe(run=3), Clock()
    probe.gate.set()
    m = index(probe, clock)
    assert m.lookup(keys(5)) == LookupResult(3)
    m.close()
