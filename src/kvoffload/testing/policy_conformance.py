"""A conformance suite for eviction policies (``kvoffload.index.policies.base.Policy``), ours and third parties'.

A policy's author passes a factory (tier capacity in keys -> a fresh policy) to every check::

    from kvoffload.testing.policy_conformance import POLICY_CHECKS

    @pytest.mark.parametrize("check", POLICY_CHECKS, ids=lambda c: c.__name__)
    def test_my_policy_conforms(check):
        check(MyPolicy)

Each check drives fresh policies the way a tier's index does (never more resident keys than the capacity; victims
asked for before inserting into a full tier) and raises ``PolicyConformanceError`` naming the broken rule of the
interface: victims are exactly ``n`` resident keys that ``can_evict`` allowed, or None and no change at all; a
refused key stays resident and first in line; keys only inserted leave oldest first; a resident key inserted again
is a use, not a second copy; unknown keys are ignored; the batch methods behave as the one-key methods in a loop;
``check_integrity`` holds, and ``len`` and ``in`` agree with what was inserted, evicted and removed. Checks compare
policies by what they do (the victims they choose), never by their internals.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvoffload.index.policies.base import Policy
from kvoffload.keys import OffloadKey

PolicyFactory = Callable[[int], Policy]
"""Builds a fresh, empty policy for a tier of the given capacity in keys."""

CAPACITY = 16
"""The tier size the randomized checks play; their keys come from a universe of ``UNIVERSE`` keys (enough for
policies that age their history every few capacities' worth of keys to do so)."""
UNIVERSE = 100
SEEDS = range(8)


class PolicyConformanceError(AssertionError):
    """A policy broke a rule of the ``Policy`` interface; the message says which."""


def _fail(rule: str) -> PolicyConformanceError:
    return PolicyConformanceError(f"Policy rule broken: {rule}")


def key(i: int) -> OffloadKey:
    """Key number ``i`` of the checks (16 bytes, like a real key)."""
    return OffloadKey(i.to_bytes(16, "big"))


def _anything(k: OffloadKey) -> bool:
    return True


def _filled(new: PolicyFactory, *ids: int, capacity: int = CAPACITY) -> Policy:
    policy = new(capacity)
    for i in ids:
        policy.insert(key(i))
    return policy


def check_fresh_keys_leave_oldest_first(new: PolicyFactory) -> None:
    """Keys a fresh policy only had inserted (never used) are evicted in insertion order, and stop being resident."""
    policy = _filled(new, 1, 2, 3, capacity=8)
    got = policy.victims(2, _anything)
    if got != [key(1), key(2)]:
        raise _fail(f"victims(2) of keys 1, 2, 3 inserted in that order returned {_ids(got)}, not [1, 2]")
    if len(policy) != 1 or key(1) in policy or key(2) in policy or key(3) not in policy:
        raise _fail(f"after evicting keys 1 and 2 of 1, 2, 3: len {len(policy)}, key 3 resident "
                    f"{key(3) in policy}, an evicted key still resident {key(1) in policy or key(2) in policy}")


def check_zero_victims_is_an_empty_list(new: PolicyFactory) -> None:
    """``victims(0)`` returns [] and changes nothing, on an empty policy too."""
    for policy in (new(8), _filled(new, 1, capacity=8)):
        before = len(policy)
        if policy.victims(0, _anything) != [] or len(policy) != before:
            raise _fail("victims(0) did not return [] or changed the resident keys")


def check_victims_is_atomic(new: PolicyFactory) -> None:
    """When fewer than ``n`` keys may go, ``victims`` returns None and the policy behaves as if never asked."""
    for seed in SEEDS:
        rng = random.Random(seed)
        asked, untouched = new(CAPACITY), new(CAPACITY)
        for policy in (asked, untouched):
            _drive(policy, random.Random(seed), 60, batched=False)
        may_go = {k for k in _resident(asked) if rng.random() < 0.5}
        got = asked.victims(len(may_go) + 1, may_go.__contains__)
        if got is not None:
            raise _fail(f"victims({len(may_go) + 1}) with only {len(may_go)} keys allowed returned {_ids(got)}")
        if _resident(asked) != _resident(untouched):
            raise _fail("a victims call that returned None changed the resident keys")
        _same_future(asked, untouched, seed, "a victims call that returned None changed later choices")


def check_victims_are_allowed_resident_and_exactly_n(new: PolicyFactory) -> None:
    """Victims are exactly ``n`` distinct resident keys, none refused; they and only they stop being resident."""
    for seed in SEEDS:
        rng = random.Random(seed)
        policy = new(CAPACITY)
        _drive(policy, rng, 60, batched=False)
        for _ in range(10):
            before = _resident(policy)
            refused = {k for k in before if rng.random() < 0.3}
            n = rng.randrange(1, 5)
            got = policy.victims(n, lambda k: k not in refused)  # noqa: B023 (called before the next loop)
            if got is None:
                if len(before - refused) >= n:
                    raise _fail(f"victims({n}) returned None with {len(before - refused)} keys allowed to go")
                continue
            if len(got) != n or len(set(got)) != n or not set(got) <= before - refused:
                raise _fail(f"victims({n}) returned {_ids(got)}: not {n} distinct resident, allowed keys")
            if _resident(policy) != before - set(got) or len(policy) != len(before) - n:
                raise _fail(f"after victims({n}) the resident keys are not the earlier ones less the victims")
            _refill(policy, rng)


def check_refused_keys_stay_first_in_line(new: PolicyFactory) -> None:
    """A key ``can_evict`` refuses stays resident, and is the next victim once it may go."""
    policy = _filled(new, 1, 2, 3, capacity=8)
    got = policy.victims(1, lambda k: k != key(1))
    if got != [key(2)] or key(1) not in policy:
        raise _fail(f"victims(1) refusing key 1 of 1, 2, 3 returned {_ids(got)} (want [2]) or dropped key 1")
    got = policy.victims(1, _anything)
    if got != [key(1)]:
        raise _fail(f"key 1, refused before, did not keep its place: the next victim was {_ids(got)}")


def check_reinsert_is_a_use_not_a_copy(new: PolicyFactory) -> None:
    """Inserting a resident key again keeps one copy: ``len`` does not grow, one eviction makes it non-resident."""
    policy = _filled(new, 1, 2, capacity=8)
    policy.insert(key(1))
    policy.insert_all([key(2), key(2)])
    if len(policy) != 2:
        raise _fail(f"inserting resident keys again made len {len(policy)}, not 2")
    got = policy.victims(2, _anything)
    if got is None or sorted(got) != [key(1), key(2)] or len(policy) != 0 or key(1) in policy:
        raise _fail(f"evicting both keys of a policy that had them inserted twice returned {_ids(got)}")


def check_unknown_and_removed_keys(new: PolicyFactory) -> None:
    """``remove`` forgets a key; removing or touching a key that is not resident changes nothing."""
    policy = _filled(new, 1, 2, capacity=8)
    policy.remove(key(1))
    policy.remove(key(9))
    policy.touch(key(9))
    policy.touch_all([key(9), key(1)])
    if len(policy) != 1 or key(1) in policy or key(9) in policy or key(2) not in policy:
        raise _fail(f"after removing key 1 and touching unknown keys: len {len(policy)}, resident "
                    f"{_ids(sorted(_resident(policy)))} (want [2])")
    if policy.victims(2, _anything) is not None:
        raise _fail("victims(2) of one resident key did not return None")
    if policy.victims(1, _anything) != [key(2)]:
        raise _fail("the one resident key left was not its victim")


def check_touch_all_is_touch_one_by_one(new: PolicyFactory) -> None:
    """``touch_all(keys)`` (also given an iterator) does what ``touch`` of each key in turn does."""
    _check_batches(new, "touch_all")


def check_insert_all_is_insert_one_by_one(new: PolicyFactory) -> None:
    """``insert_all(keys)`` (also given an iterator) does what ``insert`` of each key in turn does."""
    _check_batches(new, "insert_all")


def check_integrity_and_size_under_random_use(new: PolicyFactory) -> None:
    """Under random inserts, uses, evictions (some refused) and removals, ``check_integrity`` passes and ``len``
    and ``in`` agree with a model of the resident keys."""
    for seed in SEEDS:
        policy = new(CAPACITY)
        model: set[OffloadKey] = set()
        for op in _operations(random.Random(seed), 200):
            op.apply(policy, model, batched=seed % 2 == 1)
            policy.check_integrity()
            if len(policy) != len(model) or _resident(policy) != model:
                raise _fail(f"after {op.kind} the policy holds {len(policy)} keys, the model {len(model)} "
                            f"(seed {seed})")


POLICY_CHECKS: tuple[Callable[[PolicyFactory], None], ...] = (
    check_fresh_keys_leave_oldest_first,
    check_zero_victims_is_an_empty_list,
    check_victims_is_atomic,
    check_victims_are_allowed_resident_and_exactly_n,
    check_refused_keys_stay_first_in_line,
    check_reinsert_is_a_use_not_a_copy,
    check_unknown_and_removed_keys,
    check_touch_all_is_touch_one_by_one,
    check_insert_all_is_insert_one_by_one,
    check_integrity_and_size_under_random_use,
)


def check_policy(new: PolicyFactory) -> None:
    """Run every check against ``new``.

    Raises:
        PolicyConformanceError: the first broken rule.
    """
    for check in POLICY_CHECKS:
        check(new)


# ---- random operations ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Op:
    """One step of a tier's life: ``insert`` (victims first when full), ``use``, ``remove`` or ``evict``."""

    kind: str
    keys: tuple[OffloadKey, ...]
    n: int = 0
    refuse: frozenset[OffloadKey] = frozenset()

    def apply(self, policy: Policy, model: set[OffloadKey], batched: bool) -> list[OffloadKey] | None:
        """Apply to ``policy`` and to ``model`` (its resident keys); returns what ``victims`` chose, if asked."""
        got = None
        if self.kind == "use":
            if batched:
                policy.touch_all(iter(self.keys))
            else:
                for k in self.keys:
                    policy.touch(k)
        elif self.kind == "remove":
            for k in self.keys:
                policy.remove(k)
            model.difference_update(self.keys)
        elif self.kind == "evict":
            got = _evict(policy, model, self.n, self.refuse)
        else:
            got = self._insert(policy, model, batched)
        return got

    def _insert(self, policy: Policy, model: set[OffloadKey], batched: bool) -> list[OffloadKey] | None:
        new = [k for k in dict.fromkeys(self.keys) if k not in model]
        room = len(new) - (CAPACITY - len(model))
        got = _evict(policy, model, room, self.refuse | set(self.keys)) if room > 0 else []
        if got is None:
            return None  # the tier could not make room: nothing is stored
        if batched:
            policy.insert_all(iter(self.keys))
        else:
            for k in self.keys:
                policy.insert(k)
        model.update(self.keys)
        return got


def _evict(policy: Policy, model: set[OffloadKey], n: int, refuse: frozenset[OffloadKey] | set[OffloadKey]
           ) -> list[OffloadKey] | None:
    got = policy.victims(n, lambda k: k not in refuse)
    if got is not None:
        model.difference_update(got)
    return got


def _operations(rng: random.Random, steps: int) -> Iterator[_Op]:
    """Prefix-like runs of neighbouring keys and scattered ones, repeats included; every kind of step."""
    for _ in range(steps):
        start = rng.randrange(UNIVERSE)
        ks = tuple(key(i % UNIVERSE) for i in (range(start, start + rng.randrange(1, 6)) if rng.random() < 0.6
                                                else [rng.randrange(UNIVERSE) for _ in range(rng.randrange(1, 5))]))
        refuse = frozenset(key(rng.randrange(UNIVERSE)) for _ in range(rng.randrange(4)))
        kind = rng.choices(("insert", "use", "remove", "evict"), weights=(5, 4, 1, 1))[0]
        yield _Op(kind, ks, rng.randrange(1, 4), refuse)


def _drive(policy: Policy, rng: random.Random, steps: int, batched: bool) -> list[list[OffloadKey] | None]:
    model = _resident(policy)
    return [op.apply(policy, model, batched) for op in _operations(rng, steps)]


def _check_batches(new: PolicyFactory, method: str) -> None:
    for seed in SEEDS:
        batch, single = new(CAPACITY), new(CAPACITY)
        # Only the method under check differs: the other runs one key at a time on both sides.
        chose_batch = _drive_one_batched(batch, random.Random(seed), method)
        chose_single = _drive(single, random.Random(seed), 120, batched=False)
        if chose_batch != chose_single:
            raise _fail(f"{method} chose other victims than its one-key method in a loop (seed {seed})")
        _same_future(batch, single, seed, f"{method} left the policy in another state than its one-key method")


def _drive_one_batched(policy: Policy, rng: random.Random, method: str) -> list[list[OffloadKey] | None]:
    model = _resident(policy)
    out = []
    for op in _operations(rng, 120):
        batched = (op.kind == "use") == (method == "touch_all")
        out.append(op.apply(policy, model, batched))
    return out


def _same_future(a: Policy, b: Policy, seed: int, rule: str) -> None:
    """Both policies make the same choices from here on: the same random steps, then victims to the last key."""
    chose_a = _drive(a, random.Random(1000 + seed), 40, batched=False)
    chose_b = _drive(b, random.Random(1000 + seed), 40, batched=False)
    drain_a = [a.victims(1, _anything) for _ in range(len(a))]
    drain_b = [b.victims(1, _anything) for _ in range(len(b))]
    if chose_a != chose_b or drain_a != drain_b:
        raise _fail(f"{rule} (seed {seed})")


def _refill(policy: Policy, rng: random.Random) -> None:
    while len(policy) < CAPACITY:
        k = key(rng.randrange(UNIVERSE))
        policy.insert(k)


def _resident(policy: Policy) -> set[OffloadKey]:
    return {key(i) for i in range(UNIVERSE) if key(i) in policy}


def _ids(keys: list[OffloadKey] | None) -> list[int] | None:
    return None if keys is None else [int.from_bytes(k, "big") for k in keys]
