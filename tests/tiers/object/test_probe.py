"""ObjectProbe against a real Ceph RGW: the prefix search finds exactly how many leading keys have every rank's
object, in a few rounds of parallel one-byte GETs; a hole inside the run is what it may count past (documented here); a
store that is killed or frozen is an answer of None and an open breaker, never an exception; deletes go in batches.

Most tests search prompts built from two key lists of 2,048: ``STORED``, whose objects a module bucket holds
(written once: each example of the property test then costs only its requests), and ``ABSENT``, never written. The
prompt whose stored prefix is L keys is ``STORED[:L] + ABSENT[L:]``; a LIST of the bucket is the reference.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.tiers.object.conftest import admin_client, empty_bucket
from tests.tiers.object.indexes import NS, NS2, Counting, FakeClock, keys, listed, probe, tier, write

from kvoffload.config import ObjectTierConfig
from kvoffload.keys import OffloadKey
from kvoffload.testing.ceph_rgw import CephRGW
from kvoffload.tiers.object import probe as probe_module
from kvoffload.tiers.object.client import connect
from kvoffload.tiers.object.probe import ObjectProbe, _spread

PROMPT = 2048
STORED, ABSENT = keys(PROMPT, salt=1), keys(PROMPT, salt=2)
FANOUT = ObjectTierConfig.lookup_fanout
MAX_ROUNDS = 10


@pytest.fixture(scope="module")
def shared(ceph_rgw: CephRGW) -> Iterator[ObjectTierConfig]:
    """A bucket holding ``STORED``'s objects, for the tests of this module that do not change it."""
    s3 = admin_client(ceph_rgw)
    bucket = f"kvoffload-t-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    config = ObjectTierConfig(bucket=bucket, endpoint=ceph_rgw.endpoint, region=ceph_rgw.region)
    write(s3, config, STORED)
    yield config
    empty_bucket(s3, bucket, remove=True)


@pytest.fixture
def stored(shared: ObjectTierConfig, ceph: CephRGW, credentials: None) -> ObjectTierConfig:
    return shared


def prompt(run: int) -> list[OffloadKey]:
    """A prompt of ``PROMPT`` keys whose first ``run`` have their objects in the shared bucket."""
    return STORED[:run] + ABSENT[run:]


def listed_run(names: set[str], p: ObjectProbe, ks: Sequence[OffloadKey]) -> int:
    """The brute-force reference: leading keys all of whose objects a LIST of the bucket named."""
    return next((i for i, k in enumerate(ks) if not set(p.names.of(k)) <= names), len(ks))


def check_search(p: ObjectProbe, ks: Sequence[OffloadKey], names: set[str]) -> tuple[int, int]:
    """The probe finds the reference's run within the round and request bounds; returns its (rounds, requests)."""
    rounds, requests = p.rounds, p.requests
    run = p.leading_run(ks)
    rounds, requests = p.rounds - rounds, p.requests - requests
    assert run == listed_run(names, p, ks)
    assert 1 <= rounds <= MAX_ROUNDS and requests <= 1 + p._fanout * (rounds - 1)
    return rounds, requests


# ---- the search finds the stored prefix ------------------------------------------------------------------------


@settings(max_examples=8, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=st.integers(0, PROMPT))
def test_the_search_finds_the_stored_prefix_of_a_long_prompt(stored: ObjectTierConfig, s3: Any, run: int) -> None:
    p = probe(stored)
    names = listed(s3, stored.bucket)
    assert len(names) == PROMPT
    assert listed_run(names, p, prompt(run)) == run  # the reference agrees with how the prompt was built
    check_search(p, prompt(run), names)


@pytest.mark.parametrize("run", [0, 1, 2, FANOUT, FANOUT + 1, PROMPT - 1, PROMPT])
def test_the_search_finds_the_stored_prefix_at_its_edges(stored: ObjectTierConfig, s3: Any, run: int) -> None:
    p = probe(stored)
    check_search(p, prompt(run), listed(s3, stored.bucket))
    assert p.leading_run(prompt(run)[:run + 1]) == run  # the prompt cut short after its first miss
    assert p.leading_run(STORED[:run]) == run  # a prompt stored whole, of any length


def test_an_off_by_one_search_is_caught_by_the_reference(stored: ObjectTierConfig, s3: Any) -> None:
    """The control: a probe that also counts the key its search ended on fails the check the real one passes."""
    class CountsTheFirstMiss(ObjectProbe):
        def _answered(self, run: int) -> int:
            return super()._answered(run + 1)

    real = probe(stored)
    wrong = CountsTheFirstMiss(real._client, stored.bucket, real.names, fanout=FANOUT, timeout_s=10.0,
                               breaker=real.breaker)
    names = listed(s3, stored.bucket)
    check_search(real, prompt(700), names)
    with pytest.raises(AssertionError):
        check_search(wrong, prompt(700), names)


def test_a_new_prompt_costs_one_round_of_one_request_per_copy(stored: ObjectTierConfig) -> None:
    for ns, copies in ((NS, 1), (NS2, 2), (dataclasses.replace(NS2, replicated=True), 1)):
        p = probe(stored, ns=ns)
        assert p.leading_run(ABSENT) == 0
        assert (p.rounds, p.requests) == (1, copies)
    assert probe(stored).leading_run([]) == 0


def test_a_long_prompt_takes_a_few_rounds_at_the_default_fanout(stored: ObjectTierConfig) -> None:
    p = probe(stored)
    assert p._fanout == FANOUT == 4
    assert p.leading_run(STORED) == PROMPT and (p.rounds, p.requests) == (2, 1 + FANOUT)  # stored whole
    for run in (1, 100, 1000, 1500, 2000):
        before = p.rounds, p.requests
        assert p.leading_run(prompt(run)) == run
        rounds, requests = p.rounds - before[0], p.requests - before[1]
        assert rounds <= 7 and requests <= 1 + FANOUT * (rounds - 1), (run, rounds, requests)


def test_a_namespace_of_two_ranks_needs_every_ranks_object(s3: Any, config: ObjectTierConfig) -> None:
    ks = keys(40)
    write(s3, config, ks[:30], NS2, ranks=[0])
    write(s3, config, ks[:20], NS2, ranks=[1])  # rank 1's copies end sooner
    p = probe(config, ns=NS2)
    assert p.leading_run(ks) == 20 and p.leading_run(ks[:20]) == 20 and p.leading_run(ks[20:]) == 0
    assert probe(config, ns=NS2, fanout=1).leading_run(ks) == 20
    assert probe(config).leading_run(ks) == 0  # a world of one rank names other objects


def test_a_hole_inside_the_run_is_counted_past_unless_a_probe_lands_on_it(stored: ObjectTierConfig) -> None:
    """A known limitation: the search assumes the stored keys are a prefix. A key gone from inside the run (a
    lifecycle rule, another engine's delete) is found only if a probe lands on it; otherwise the run counts past it
    and the worker's load of it fails (it reads and verifies every object), which costs a recompute."""
    p = probe(stored)
    probed = _spread(1, PROMPT, FANOUT)  # the second round's positions: all found, so the search ends there
    assert probed[-1] == PROMPT - 1 and len(probed) == FANOUT
    unseen, seen = probed[0] // 2, probed[0]
    answers = []
    for hole in (unseen, seen, 0):
        ks, rounds = list(STORED), p.rounds
        ks[hole] = ABSENT[hole]
        answers.append((p.leading_run(ks), p.rounds - rounds))
    assert answers[0] == (PROMPT, 2)  # counted past the hole: the search never looked at it
    assert answers[1][0] == seen and answers[2] == (0, 1)  # a probe landed on it: the run ends there


# ---- failures --------------------------------------------------------------------------------------------------


def test_a_killed_radosgw_is_none_and_an_open_breaker_then_deletes_are_skipped(s3: Any, ceph: CephRGW,
                                                                            config: ObjectTierConfig) -> None:
    clock = FakeClock()
    client = Counting(connect(tier(config)))
    p = probe(config, client=client, clock=clock)
    ks = keys(3)
    write(s3, config, ks)
    assert p.leading_run(ks) == 3
    ceph.kill_rgw()
    try:
        answers = [p.leading_run(ks) for _ in range(3)]  # breaker_errors
        assert answers == [None, None, None] and p.breaker.is_open and not p.available
        client.clear()
        assert p.leading_run(ks) is None and p.delete(ks) is False
        assert client.calls == [] and p.delete_errors == 3  # off: nothing is sent
    finally:
        ceph.start_rgw()
    assert p.delete(ks) is False  # up again, but the cool-down is not over
    clock.now += 60.0
    assert p.delete(ks) is True and listed(s3, config.bucket) == set()
    assert p.leading_run(ks) == 0 and not p.breaker.is_open


def test_a_failed_delete_is_false_and_counted_not_an_exception(s3: Any, ceph: CephRGW,
                                                               config: ObjectTierConfig) -> None:
    """A delete that meets a dead radosgw while the breaker is still closed (the index deletes on a failed load, a
    failed store, an eviction: all on the scheduler's step) is an answer, as a search is."""
    ks = keys(3)
    write(s3, config, ks)
    p = probe(config)
    ceph.kill_rgw()
    try:
        answer = p.delete(ks)
    finally:
        ceph.start_rgw()
    assert answer is False and p.delete_errors == 3 and not p.breaker.is_open  # one error of three
    assert len(listed(s3, config.bucket)) == 3


def test_a_frozen_store_is_none_at_the_search_timeout_and_trips_at_once(s3: Any, ceph: CephRGW,
                                                                        config: ObjectTierConfig) -> None:
    ks = keys(2)
    write(s3, config, ks)
    p = probe(config, timeout_s=0.5)
    assert p.leading_run(ks) == 2  # connected: the frozen OSD is met by requests, not by the connect
    ceph.stop_osd()
    try:
        assert p.leading_run(ks) is None
    finally:
        ceph.start_osd()
    assert p.breaker.trips == 1 and p.breaker.is_open  # one timeout: each next search would cost as long


def test_check_answers_true_for_the_bucket_and_false_for_a_missing_one(stored: ObjectTierConfig) -> None:
    assert probe(stored).check() is True
    missing = probe(dataclasses.replace(stored, bucket="kvoffload-never-made"))
    assert missing.check() is False and missing.breaker.is_open and missing.leading_run(STORED) is None


def test_a_bucket_gone_after_start_up_is_a_fault_not_a_miss(stored: ObjectTierConfig) -> None:
    """faults.is_missing: a missing bucket is a fault (it trips the breaker at once), not a miss."""
    p = probe(dataclasses.replace(stored, bucket="kvoffload-never-made"))
    assert p.leading_run(STORED) is None
    assert p.breaker.is_open


def test_delete_removes_every_ranks_objects_in_batches(s3: Any, config: ObjectTierConfig,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe_module, "DELETE_BATCH", 3)
    ks, kept = keys(5), keys(2, salt=9)
    write(s3, config, ks + kept, NS2)
    client = Counting(connect(tier(config)))
    p = probe(config, ns=NS2, client=client)
    assert p.delete(ks) is True
    assert client.count("delete_objects") == 4  # 10 names, 3 a request
    assert listed(s3, config.bucket) == {n for k in kept for n in p.names.of(k)}
    assert p.delete(ks) is True and p.delete([]) is True  # deleting what is not there succeeds
    assert p.delete_errors == 0
