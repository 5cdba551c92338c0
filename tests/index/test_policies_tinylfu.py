"""W-TinyLFU: a candidate leaving the window displaces main's victim only if it was used more; counts age, outlive
an eviction, and the window and main stay apart."""

from __future__ import annotations

import pytest
from tests.index.workloads import anything, filled, key, scan

from kvoffload.index.base import IntegrityError
from kvoffload.index.policies import TinyLFUPolicy


def full_tinylfu(capacity: int) -> TinyLFUPolicy:
    """A full tier: keys 0 .. capacity-1 inserted once each (the oldest have left the window for main)."""
    policy = TinyLFUPolicy(capacity)
    scan(policy, capacity, range(capacity))
    assert policy.victims(1, anything) is not None  # the window overflows into main
    policy.insert(key(capacity))
    return policy


def test_tinylfu_a_candidate_used_more_than_the_victim_displaces_it() -> None:
    policy = full_tinylfu(100)
    candidate = next(iter(policy._window))
    victim = next(iter(policy._main))
    policy.touch(candidate)
    assert policy.frequency(candidate) > policy.frequency(victim)
    assert policy.victims(1, anything) == [victim]
    assert candidate in policy._main


def test_tinylfu_a_candidate_used_no_more_than_the_victim_is_evicted() -> None:
    policy = full_tinylfu(100)
    candidate = next(iter(policy._window))
    victim = next(iter(policy._main))
    assert policy.frequency(candidate) == policy.frequency(victim)
    assert policy.victims(1, anything) == [candidate]
    assert victim in policy


def test_tinylfu_counts_age_after_a_sample_period() -> None:
    policy = TinyLFUPolicy(4)
    policy.insert(key(1))
    for _ in range(4):
        policy.touch(key(1))
    assert policy.frequency(key(1)) == 5
    scan(policy, 4, range(100, 120))  # more than a period's distinct keys (16), with victims asked
    assert policy.frequency(key(1)) <= 2
    policy.check_integrity()


def test_tinylfu_remembers_the_frequency_of_an_evicted_key() -> None:
    policy = filled(TinyLFUPolicy(4), 1)
    policy.touch(key(1))
    policy.remove(key(1))
    assert policy.frequency(key(1)) == 2


def test_tinylfu_check_integrity_raises_on_a_key_in_both_spaces() -> None:
    policy = filled(TinyLFUPolicy(8), 1, 2)  # key 1 has moved on to the main space, key 2 is in the window
    policy._main[key(2)] = None
    with pytest.raises(IntegrityError, match="partition"):
        policy.check_integrity()


def test_tinylfu_evicts_window_keys_behind_a_refused_one_when_main_keys_may_not_go() -> None:
    policy = full_tinylfu(100)
    scan(policy, 100, range(200, 203))  # the window holds 200-202 (and the one that entered before)
    window = list(policy._window)
    may_go = set(window[1:])
    got = policy.victims(len(may_go), may_go.__contains__)
    assert got is not None and set(got) == may_go
    assert window[0] in policy
    policy.check_integrity()
