"""Store admission rules: leading counts, second sightings within a bounded memory."""

from __future__ import annotations

import pytest

from kvoffload.config import StoreAdmission
from kvoffload.keys import OffloadKey
from kvoffload.manager.admission import SIGHTING_MEMORY, AdmitAll, SecondSighting, make_admission


def key(i: int) -> OffloadKey:
    return OffloadKey(i.to_bytes(4, "big"))


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]


def test_make_admission_builds_every_rule() -> None:
    assert isinstance(make_admission(StoreAdmission.ALL, 8), AdmitAll)
    rule = make_admission(StoreAdmission.SECOND_SIGHTING, 8)
    assert isinstance(rule, SecondSighting) and rule._limit == SIGHTING_MEMORY * 8


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_make_admission_rejects_a_capacity_that_is_not_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        make_admission(StoreAdmission.ALL, bad)  # type: ignore[arg-type]


def test_admit_all_stores_every_block() -> None:
    assert AdmitAll().admit(keys(1, 2, 3)) == 3
    assert AdmitAll().admit([]) == 0


def test_second_sighting_declines_the_first_and_admits_the_second() -> None:
    rule = SecondSighting(16)
    assert rule.admit(keys(1, 2, 3)) == 0
    assert rule.admit(keys(1, 2, 3)) == 3
    assert rule.admit(keys(1, 2, 3)) == 3  # still remembered: a block stored and evicted is stored again


def test_second_sighting_admits_only_the_leading_seen_blocks() -> None:
    rule = SecondSighting(16)
    rule.admit(keys(1, 2))
    assert rule.admit(keys(1, 2, 3, 4)) == 2
    rule.admit(keys(5))
    # Block 5 was seen, but after block 9 that was not: a block is useless without the blocks before it.
    assert rule.admit(keys(1, 9, 5)) == 1


def test_second_sighting_forgets_the_least_recently_offered_keys_beyond_its_limit() -> None:
    rule = SecondSighting(3)
    rule.admit(keys(1, 2, 3))
    rule.admit(keys(1))  # offered again: now the most recent
    rule.admit(keys(4, 5))
    assert len(rule) == 3
    assert rule.admit(keys(1)) == 1
    assert rule.admit(keys(2)) == 0 and rule.admit(keys(3)) == 0


def test_second_sighting_rejects_a_limit_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="limit 0"):
        SecondSighting(0)
