"""S3-FIFO: a key used in the small queue moves to main, a key back from the ghost queue goes to main, main gives a
used key one more round, and the queues stay bounded and apart."""

from __future__ import annotations

import pytest
from tests.index.workloads import anything, filled, key, keys, scan

from kvoffload.index.base import IntegrityError
from kvoffload.index.policies import LRUPolicy, S3FIFOPolicy


def test_s3fifo_keys_used_in_the_small_queue_move_to_main_and_outlive_new_ones() -> None:
    policy = filled(S3FIFOPolicy(10), *range(1, 11))
    policy.touch(key(1))
    # Victims come from the small queue: key 1 was used there, so it moves to main instead.
    assert policy.victims(3, anything) == keys(2, 3, 4)
    scan(policy, 10, range(100, 130))
    assert key(1) in policy
    policy.check_integrity()


def test_s3fifo_a_key_back_from_the_ghost_queue_goes_to_main() -> None:
    policy = filled(S3FIFOPolicy(10), *range(1, 11))
    assert policy.victims(1, anything) == keys(1)  # unused: out, remembered in the ghost queue
    policy.insert(key(1))
    scan(policy, 10, range(100, 130))  # new keys churn the small queue only
    assert key(1) in policy
    lru = filled(LRUPolicy(), *range(2, 11), 1)
    scan(lru, 10, range(100, 130))
    assert key(1) not in lru


def test_s3fifo_main_gives_a_used_key_another_round_once() -> None:
    policy = S3FIFOPolicy(10)
    for i in range(1, 4):  # three keys in main through the ghost queue, key 1 used there
        policy.insert(key(i))
        policy.victims(1, anything)
        policy.insert(key(i))
    policy.touch(key(1))
    assert policy.victims(3, anything) == keys(2, 3, 1)


def test_s3fifo_a_key_promoted_after_main_ran_out_can_still_be_its_victim() -> None:
    policy = S3FIFOPolicy(20)  # S's share: 2 keys
    policy.insert(key(1))
    assert policy.victims(1, anything) == keys(1)
    policy.insert(key(1))  # back from the ghost queue: in M
    policy.insert(key(2))
    policy.touch(key(2))
    # M's only key may not go; S's used key moves to M, and is then M's victim (its use spent).
    assert policy.victims(1, lambda k: k != key(1)) == keys(2)
    policy.check_integrity()


def test_s3fifo_ghost_queue_holds_at_most_the_capacity() -> None:
    policy = S3FIFOPolicy(4)
    scan(policy, 4, range(50))
    assert len(policy._ghost) == 4
    policy.check_integrity()


def test_s3fifo_uses_of_keys_not_resident_do_not_count_and_stay_bounded() -> None:
    policy = filled(S3FIFOPolicy(10), 1, 2)
    policy.touch_all(keys(*range(100, 1100)))
    assert len(policy._used) <= 2 * len(policy) + 64
    policy.insert(key(100))  # used before it was resident: not a use now
    assert key(100) not in policy._used
    policy.check_integrity()


def test_s3fifo_check_integrity_raises_on_a_key_in_both_queues() -> None:
    policy = filled(S3FIFOPolicy(8), 1, 2)
    policy._main[key(1)] = None
    with pytest.raises(IntegrityError, match="both S and M"):
        policy.check_integrity()
