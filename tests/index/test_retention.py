"""Retention hints in a tier's policy (index/retention.py): retained keys go after every unretained key, oldest
deadline first; a passed deadline makes a key ordinary; the cap; with no hint, the inner policy's order key for key;
with tenants, after the unretained keys of the same tenant."""

from __future__ import annotations

import random

import pytest

from kvoffload.config import EvictionPolicy
from kvoffload.index.base import IntegrityError
from kvoffload.index.policies import LRUPolicy
from kvoffload.index.policies.base import CanEvict, Policy, any_key
from kvoffload.index.policies.registry import make_policy
from kvoffload.index.retention import RetainPolicy, RetentionBook
from kvoffload.index.tenants import TenantBook
from kvoffload.index.tier_policies import retention_book_of, tier_policy
from kvoffload.keys import OffloadKey, offload_key
from kvoffload.testing.policy_conformance import POLICY_CHECKS


def key(i: int) -> OffloadKey:
    return offload_key(i.to_bytes(16, "big"), 0)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(size: int = 10, share: float = 1.0, kind: EvictionPolicy = EvictionPolicy.LRU
         ) -> tuple[RetainPolicy, RetentionBook, Clock]:
    clock = Clock()
    book = RetentionBook(share, clock)
    return RetainPolicy(make_policy(kind, size), book, size, "host"), book, clock


@pytest.mark.parametrize("kind", list(EvictionPolicy))
@pytest.mark.parametrize("check", POLICY_CHECKS, ids=lambda c: c.__name__)
def test_with_no_hint_the_wrapper_conforms_for_every_policy(check: object, kind: EvictionPolicy) -> None:
    check(lambda capacity: RetainPolicy(make_policy(kind, capacity), RetentionBook(0.5), capacity))  # type: ignore[operator]


def refusing(refused: set[OffloadKey]) -> CanEvict:
    return lambda k: k not in refused


def drive(policy: Policy, seed: int, book: RetentionBook | None = None) -> list[list[OffloadKey] | None]:
    """A random mix of inserts, touches, removes and victims (some refused) over 60 keys, in a tier of 16."""
    rng, out = random.Random(seed), []
    for step in range(600):
        k = key(rng.randrange(60))
        op = rng.random()
        if book is not None and step == 50:
            book.hold([key(i) for i in range(60)], 10.0**9)
        if op < 0.4 and k not in policy:
            if len(policy) >= 16:
                out.append(policy.victims(1, any_key))
            policy.insert(k)
        elif op < 0.7:
            policy.touch_all([k, key(rng.randrange(60))])
        elif op < 0.8:
            policy.remove(k)
        else:
            refused = {key(rng.randrange(60)) for _ in range(4)}
            out.append(policy.victims(rng.randrange(3), refusing(refused)))
        policy.check_integrity()
    return out


@pytest.mark.parametrize("kind", list(EvictionPolicy))
def test_with_no_hint_victims_are_the_inner_policys_key_for_key(kind: EvictionPolicy) -> None:
    for seed in range(3):
        plain = drive(make_policy(kind, 16), seed)
        assert drive(RetainPolicy(make_policy(kind, 16), RetentionBook(0.5), 16), seed) == plain
        # The comparison can fail: the same run with every key held from step 50 chooses other victims.
        assert drive(RetainPolicy(make_policy(kind, 16), RetentionBook(0.5), 16), seed, RetentionBook(0.5)) \
            == plain  # a book the policy is not on changes nothing
    book = RetentionBook(0.5)
    assert drive(RetainPolicy(make_policy(kind, 16), book, 16), 0, book) != drive(make_policy(kind, 16), 0)


def test_retained_keys_go_after_every_unretained_key_oldest_deadline_first() -> None:
    policy, book, _ = make()
    book.hold([key(2)], 2000.0)
    book.hold([key(5)], 1500.0)
    policy.insert_all([key(i) for i in range(10)])
    policy.touch(key(0))  # LRU order of the unretained: 1 3 4 6 7 8 9 0
    assert policy.victims(10, any_key) == [key(i) for i in (1, 3, 4, 6, 7, 8, 9, 0, 5, 2)]
    assert len(policy) == 0 and policy.counts().evicted == 2


def test_a_run_is_taken_from_the_unretained_first_and_retained_keys_only_when_needed() -> None:
    policy, book, _ = make()
    policy.insert_all([key(i) for i in range(6)])
    book.hold([key(0)], 2000.0)  # resident already: they leave the inner policy
    book.hold([key(1)], 1900.0)
    assert policy.victims(3, any_key) == [key(2), key(3), key(4)]
    refuse_5: CanEvict = lambda k: k != key(5)  # noqa: E731
    assert policy.victims(2, refuse_5) == [key(1), key(0)]  # 5 refused: the retained go, oldest deadline first
    assert policy.victims(2, refuse_5) is None and key(5) in policy  # atomic: nothing changed
    assert len(policy) == 1


def test_a_passed_deadline_makes_the_key_ordinary_as_if_stored_then() -> None:
    policy, book, clock = make()
    book.hold([key(0)], 1100.0)
    policy.insert_all([key(i) for i in range(4)])
    assert policy.retained() == 1
    clock.now = 1100.0  # the deadline passes: 0 joins the LRU order as newest
    assert policy.retained() == 0
    assert policy.victims(4, any_key) == [key(1), key(2), key(3), key(0)]
    assert book.deadline(key(0)) is None


def test_a_later_hold_extends_a_deadline_and_an_earlier_one_does_not_shorten_it() -> None:
    policy, book, clock = make()
    book.hold([key(0)], 1100.0)
    policy.insert_all([key(0), key(1)])
    book.hold([key(0)], 1300.0)
    book.hold([key(0)], 1050.0)
    clock.now = 1200.0
    assert policy.retained() == 1 and book.deadline(key(0)) == 1300.0
    assert policy.victims(1, any_key) == [key(1)]


def test_past_the_cap_the_longest_hint_becomes_ordinary() -> None:
    policy, book, _ = make(size=10, share=0.2)  # 2 retained keys at most
    for i, deadline in enumerate((1500.0, 1800.0, 1200.0)):  # hints of 500, 800 and 200 s, given now
        book.hold([key(i)], deadline)
        policy.insert(key(i))
    assert policy.retained() == 2 and policy.counts().demoted == 1
    policy.insert(key(3))
    assert policy.victims(2, any_key) == [key(1), key(3)]  # 1 (the longest hint, demoted) is the oldest ordinary key
    policy.check_integrity()


def test_past_the_cap_of_equal_hints_the_oldest_deadline_becomes_ordinary() -> None:
    policy, book, clock = make(size=10, share=0.2)
    for i in range(3):  # the same 600 s hint, given a second apart
        book.hold([key(i)], clock.now + 600)
        policy.insert(key(i))
        clock.now += 1
    assert policy.victims(1, any_key) == [key(0)]
    assert policy.retained() == 2


def test_no_share_means_nothing_is_retained() -> None:
    policy, book, _ = make(share=0.0)
    book.hold([key(0)], 2000.0)
    policy.insert_all([key(0), key(1)])
    assert policy.retained() == 0 and policy.victims(1, any_key) == [key(0)]


def test_a_retained_key_touched_counts_a_hit_and_keeps_its_place() -> None:
    policy, book, _ = make()
    book.hold([key(0)], 2000.0)
    policy.insert_all([key(0), key(1)])
    policy.touch_all([key(0), key(1)])
    assert policy.counts().hits == 1
    policy.remove(key(0))
    assert key(0) not in policy and policy.retained() == 0


def test_integrity_finds_a_key_both_retained_and_ordinary() -> None:
    policy, book, _ = make()
    book.hold([key(0)], 2000.0)
    policy.insert(key(0))
    policy.inner.insert(key(0))  # what a bug would do
    with pytest.raises(IntegrityError, match="both retained"):
        policy.check_integrity()


class TakesRetainedFirst(RetainPolicy):
    """A wrong wrapper: evicts retained keys before the others."""

    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        held = sorted(self._held, key=self._held.__getitem__)[:n]
        for k in held:
            del self._held[k]
        rest = self.inner.victims(n - len(held), can_evict) if n > len(held) else []
        return None if rest is None else held + rest


@pytest.mark.parametrize("wrong", [False, True])
def test_randomly_a_retained_key_is_never_a_victim_while_an_unretained_one_may_go(wrong: bool) -> None:
    cls = TakesRetainedFirst if wrong else RetainPolicy
    clock = Clock()
    book = RetentionBook(0.5, clock)
    policy = cls(LRUPolicy(), book, 16, "host")
    rng = random.Random(5)
    broken = False
    for _ in range(2000):
        k = key(rng.randrange(50))
        op = rng.random()
        clock.now += rng.random()
        if op < 0.1:
            book.hold([k, key(rng.randrange(50))], clock.now + rng.uniform(1, 30))
        elif op < 0.6 and k not in policy:
            if len(policy) >= 16:
                retained = {x for x in map(key, range(50)) if x in policy and book.deadline(x) is not None
                            and x not in policy.inner}
                ordinary = {x for x in map(key, range(50)) if x in policy.inner}
                got = policy.victims(2, any_key) or []
                if any(v in retained for v in got) and not ordinary <= set(got):
                    broken = True
            policy.insert(k)
        elif op < 0.9:
            policy.touch(k)
        else:
            policy.remove(k)
    assert broken == wrong  # the right wrapper never breaks the rule; the wrong one is caught


def test_with_tenants_retained_keys_go_after_their_own_tenants_unretained_keys() -> None:
    clock = Clock()
    tenants, book = TenantBook(["a", "b"], [0.5, 0.5, 0.0]), RetentionBook(0.5, clock)
    policy = tier_policy(tenants, book, EvictionPolicy.LRU, 8, "host")
    assert isinstance(policy, Policy) and retention_book_of(policy) is book
    a, b = [key(i) for i in range(4)], [key(10 + i) for i in range(4)]
    book.hold([a[0]], 2000.0)
    for group, keys in (("a", a), ("b", b)):
        tenants.assign(keys, group)
        policy.insert_all(keys)
        tenants.clear()
    assert [t.retained() for t in book.tiers] == [1]
    tenants.assign([key(20)], "a")  # a stores one more: it is at its quota and gives its own oldest unretained
    policy.entering([key(20)])
    assert policy.victims(1, any_key) == [a[1]]
    tenants.clear()


def test_the_book_keeps_the_latest_deadlines_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvoffload.index.retention as retention

    monkeypatch.setattr(retention, "MAX_DEADLINES", 3)
    clock = Clock()
    book = RetentionBook(0.5, clock)
    book.hold([key(i) for i in range(5)], 1100.0)
    assert len(book.deadlines) == 3
    clock.now = 1100.0
    book.hold([key(9)], 1200.0)
    assert list(book.deadlines) == [key(9)] and book.active


def test_a_share_outside_0_1_is_refused() -> None:
    with pytest.raises(ValueError, match="share"):
        RetentionBook(1.5)
