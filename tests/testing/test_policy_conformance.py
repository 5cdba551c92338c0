"""The policy conformance suite can fail: each check catches a policy that breaks its rule (a mutant of LRU).

tests/index/test_policies.py runs the suite over every ``EvictionPolicy``.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from kvoffload.index.policies import CanEvict, LRUPolicy
from kvoffload.keys import OffloadKey
from kvoffload.testing import policy_conformance as pc
from kvoffload.testing.policy_conformance import POLICY_CHECKS, PolicyConformanceError, check_policy


class _NewestFirst(LRUPolicy):
    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        chosen = [k for k in reversed(self._order) if can_evict(k)][:n] if n > 0 else []
        if len(chosen) < n:
            return None
        for k in chosen:
            del self._order[k]
        return chosen


class _ZeroIsNone(LRUPolicy):
    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        return None if n == 0 else super().victims(n, can_evict)


class _NotAtomic(LRUPolicy):
    """Evicts what it can even when it cannot find ``n``."""

    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        chosen = [k for k in self._order if can_evict(k)][:n]
        for k in chosen:
            del self._order[k]
        return chosen if len(chosen) == n else None


class _IgnoresRefusals(LRUPolicy):
    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        return super().victims(n, lambda k: True)


class _RefusedToTheBack(LRUPolicy):
    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        for k in [k for k in self._order if not can_evict(k)]:
            self._order.move_to_end(k)
        return super().victims(n, can_evict)


class _CountsCopies(LRUPolicy):
    """Inserting a resident key again counts it twice."""

    __slots__ = ("_copies",)

    def __init__(self) -> None:
        super().__init__()
        self._copies = 0

    def insert(self, key: OffloadKey) -> None:
        self._copies += key in self
        super().insert(key)

    def insert_all(self, keys: Iterable[OffloadKey]) -> None:
        for k in keys:
            self.insert(k)

    def __len__(self) -> int:
        return super().__len__() + self._copies


class _TouchInserts(LRUPolicy):
    """A use of a key that is not resident makes it resident."""

    def touch(self, key: OffloadKey) -> None:
        self.insert(key)

    def touch_all(self, keys: Iterable[OffloadKey]) -> None:
        for k in keys:
            self.touch(k)


class _LazyTouchAll(LRUPolicy):
    def touch_all(self, keys: Iterable[OffloadKey]) -> None:
        pass


class _InsertAllBackwards(LRUPolicy):
    def insert_all(self, keys: Iterable[OffloadKey]) -> None:
        super().insert_all(reversed(list(keys)))


class _RemoveKeepsLen(LRUPolicy):
    """Forgets removed keys in ``in`` but not in ``len``."""

    __slots__ = ("_removed",)

    def __init__(self) -> None:
        super().__init__()
        self._removed = 0

    def remove(self, key: OffloadKey) -> None:
        self._removed += key in self
        super().remove(key)

    def __len__(self) -> int:
        return super().__len__() + self._removed


MUTANTS = {
    pc.check_fresh_keys_leave_oldest_first: _NewestFirst,
    pc.check_zero_victims_is_an_empty_list: _ZeroIsNone,
    pc.check_victims_is_atomic: _NotAtomic,
    pc.check_victims_are_allowed_resident_and_exactly_n: _IgnoresRefusals,
    pc.check_refused_keys_stay_first_in_line: _RefusedToTheBack,
    pc.check_reinsert_is_a_use_not_a_copy: _CountsCopies,
    pc.check_unknown_and_removed_keys: _TouchInserts,
    pc.check_touch_all_is_touch_one_by_one: _LazyTouchAll,
    pc.check_insert_all_is_insert_one_by_one: _InsertAllBackwards,
    pc.check_integrity_and_size_under_random_use: _RemoveKeepsLen,
}


def test_every_check_has_a_mutant() -> None:
    assert set(MUTANTS) == set(POLICY_CHECKS)


@pytest.mark.parametrize("check", POLICY_CHECKS, ids=lambda c: c.__name__)
def test_check_passes_lru_and_fails_its_mutant(check) -> None:  # type: ignore[no-untyped-def]
    check(lambda capacity: LRUPolicy())
    mutant = MUTANTS[check]
    with pytest.raises(PolicyConformanceError, match="Policy rule broken"):
        check(lambda capacity: mutant())


def test_check_policy_runs_every_check_and_names_the_first_broken_rule() -> None:
    check_policy(lambda capacity: LRUPolicy())
    with pytest.raises(PolicyConformanceError, match=r"not \[1, 2\]"):
        check_policy(lambda capacity: _NewestFirst())
