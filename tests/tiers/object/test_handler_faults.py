"""ObjectHandler against a real Ceph RGW that fails, faults injected for real: radosgw killed (at start-up and
mid-run), the OSD frozen (requests hang until the client's timeout), the bucket deleted under the handler, wrong
credentials, and bad objects planted at a block's name (damaged, empty, oversized, forged without the secret).
Every fault is a failed result of the right kind, logged once; the breaker opens as ``Fault.at_once`` says and
closes after its cool-down, driven by a fake clock."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

import pytest
from tests.forgeries import FORGERIES, forge
from tests.tiers.object.handlers import (
    COOLDOWN_S,
    ENTRY,
    NS,
    FakeClock,
    Handler,
    exists,
    keys,
    load,
    object_name,
    opened,
    plant,
    read_object,
    row,
    run,
    small_breaker,
    store,
    warnings_about,
)

from kvoffload.auth import TierSecret
from kvoffload.config import ObjectTierConfig
from kvoffload.keys import OffloadKey
from kvoffload.testing.ceph_rgw import CephRGW
from kvoffload.tiers.lower.block_format import HEADER_BYTES, BlockFormat
from kvoffload.tiers.object.client import connect
from kvoffload.tiers.object.faults import Fault

SECRET = TierSecret("test", b"k" * 32)
AFTER_COOLDOWN_S = COOLDOWN_S + 1.0


# ---- radosgw down ---------------------------------------------------------------------------------------------

def test_a_killed_radosgw_fails_jobs_opens_the_breaker_after_its_errors_and_serves_after_the_cool_down(
        ceph: CephRGW, config: ObjectTierConfig, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    with caplog.at_level(logging.WARNING, logger="kvoffload"), \
            Handler(small_breaker(config), clock=clock) as h:
        ks = keys(2)
        assert run(h, store((0, 1), ks)).success
        ceph.kill_rgw()
        try:
            failing = [store((2,), keys(1, salt=1)), load(ks, (4, 5)), store((3,), keys(1, salt=2))]
            for n, job in enumerate(failing, 1):  # refused, not timed out; the third opens the breaker
                result = run(h, job)
                assert not result.success and result.bytes == 0
                assert h.breaker.is_open == (n == 3)
            assert h.faults.counts[Fault.UNREACHABLE] == 3 and h.faults.counts[Fault.TIMEOUT] == 0
            sent = h.requests
            assert not run(h, load(ks, (4, 5))).success and h.requests == sent  # off: no request at all
            ceph.start_rgw()
            assert not run(h, load(ks, (4, 5))).success and h.requests == sent  # up, but still cooling down
        finally:
            ceph.start_rgw()
        clock.now += AFTER_COOLDOWN_S
        h._slots[4:6] = 0
        assert run(h, load(ks, (4, 5))).success
        assert [row(h, 4), row(h, 5)] == [row(h, 0), row(h, 1)] != [row(h, 1), row(h, 0)]
        assert h.breaker.trips == 1 and not h.breaker.is_open
    assert warnings_about(caplog, "object store unreachable") == 1
    assert warnings_about(caplog, "switching the object tier off") == 1
    assert warnings_about(caplog, "serving again") == 1


def test_a_radosgw_down_at_start_up_switches_the_tier_off_at_once_until_the_cool_down(
        ceph: CephRGW, config: ObjectTierConfig, s3: Any, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    ceph.kill_rgw()
    try:
        with caplog.at_level(logging.WARNING, logger="kvoffload"), \
                Handler(small_breaker(config), clock=clock) as h:
            assert h.breaker.is_open and h.faults.counts[Fault.UNREACHABLE] == 1
            assert warnings_about(caplog, "the object tier is off") == 1
            ceph.start_rgw()
            ks = keys(2)
            assert not run(h, store((0, 1), ks)).success and h.requests == 0  # cooling down: no request
            clock.now += AFTER_COOLDOWN_S
            assert run(h, store((0, 1), ks)).success
            assert [opened(s3, config, k) for k in ks] == [row(h, 0), row(h, 1)]
    finally:
        ceph.start_rgw()


# ---- the OSD frozen: requests hang ----------------------------------------------------------------------------

def _hanging(config: ObjectTierConfig, **changes: Any) -> ObjectTierConfig:
    """Short timeouts: a request to a frozen OSD ends at the client's read timeout."""
    return small_breaker(config, **{"connect_timeout_s": 0.5, "timeout_s": 2.0, **changes})


def _stored(config: ObjectTierConfig, ks: tuple[OffloadKey, ...]) -> list[bytes]:
    """Store ``ks`` from a handler with the default timeouts; their payloads."""
    with Handler(config) as h:
        assert run(h, store(tuple(range(len(ks))), ks)).success
        return [row(h, s) for s in range(len(ks))]


@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_frozen_osd_fails_a_job_at_its_timeout_without_blocking_the_caller_and_opens_the_breaker_at_once(
        ceph: CephRGW, config: ObjectTierConfig, caplog: pytest.LogCaptureFixture, direction: str) -> None:
    ks = keys(2)
    expected = _stored(config, ks)
    clock = FakeClock()  # the cool-down's; the hung requests end at the client's own (real) read timeout
    with caplog.at_level(logging.WARNING, logger="kvoffload"), Handler(_hanging(config), clock=clock) as h:
        h._slots[4:6] = 0
        ceph.stop_osd()
        try:
            job = load(ks, (4, 5)) if direction == "load" else store((0, 1), keys(2, salt=1))
            assert h.submit(job)  # queued: returns while its requests hang
            assert h.get_finished() == []  # nothing has answered; the call does not wait for it
            h.wait([job.job_id])
            assert [(r.job_id, r.success, r.bytes) for r in h.get_finished()] == [(job.job_id, False, 0)]
            assert h.faults.counts[Fault.TIMEOUT] == 1 and h.faults.counts[Fault.ERROR] == 0
            assert h.breaker.is_open and h.breaker.trips == 1  # at once: every next request would hang too
            assert not h._slots[4:6].any()
            sent = h.requests
            assert not run(h, load(ks, (4, 5))).success and h.requests == sent  # off: no request hangs
        finally:
            ceph.start_osd()
        clock.now += AFTER_COOLDOWN_S
        assert run(h, load(ks, (4, 5))).success
        assert [row(h, 4), row(h, 5)] == expected != [row(h, 0), row(h, 1)]
    assert warnings_about(caplog, "too slow") == 1


def test_a_job_past_its_budget_fails_with_the_one_queued_behind_it_and_its_late_answer_is_dropped(
        ceph: CephRGW, config: ObjectTierConfig) -> None:
    """Long timeouts, so the request is still hanging when the fake clock passes the job's budget: the result
    comes from ``get_finished`` then, and the answer that comes once the OSD runs again writes no slot."""
    clock = FakeClock()
    client = connect(config, pool_size=16)
    sending = threading.Event()
    client.meta.events.register("before-send.s3.GetObject", lambda **_: sending.set())
    with Handler(_hanging(config, timeout_s=60.0), client=client, clock=clock) as h:
        ks = keys(1)
        assert run(h, store((0,), ks)).success
        h._slots[3] = 0
        sending.clear()  # the start-up check was a GET too
        ceph.stop_osd()
        try:
            job, queued = load(ks, (3,)), load(ks, (3,))
            assert h.submit(job)
            assert sending.wait(60)  # its GET is on the wire
            assert h.submit(queued)  # behind it on the load lane
            clock.now += 1000.0
            results = h.get_finished()
            assert [(r.job_id, r.success) for r in results] == [(job.job_id, False), (queued.job_id, False)]
            assert h.faults.counts[Fault.TIMEOUT] == 1 and h.breaker.is_open
        finally:
            ceph.start_osd()
        assert h._lanes[False].wait_idle(120)  # the late answer has come back to the lane
        assert not h._slots[3].any()
        assert h.faults.counts[Fault.TIMEOUT] == 1 and h.faults.counts[Fault.ERROR] == 0  # it changed nothing


def test_shutdown_while_requests_hang_reports_each_job_once_as_failed(ceph: CephRGW,
                                                                     config: ObjectTierConfig) -> None:
    ks = keys(2)
    _stored(config, ks)
    with Handler(_hanging(config)) as h:
        h._slots[4:7] = 0
        ceph.stop_osd()
        try:
            jobs = [load(ks, (4, 5)), store((2,), keys(1, salt=1)), load(ks[:1], (6,))]
            assert all(h.submit(job) for job in jobs)
            h.shutdown()  # returns once each job has ended (at its timeout) or been failed
            results = h.get_finished() + h.get_finished()
            assert sorted((r.job_id, r.success) for r in results) == sorted((j.job_id, False) for j in jobs)
            assert not h._slots[4:7].any() and not h.submit(load(ks, (4, 5)))
        finally:
            ceph.start_osd()


# ---- the bucket and the credentials ---------------------------------------------------------------------------

def _delete_bucket(s3: Any, bucket: str) -> None:
    names = [{"Key": o["Key"]} for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    if names:
        s3.delete_objects(Bucket=bucket, Delete={"Objects": names, "Quiet": True})
    s3.delete_bucket(Bucket=bucket)


def test_a_bucket_deleted_under_the_handler_fails_a_load_as_a_fault_not_a_miss_and_opens_the_breaker(
        config: ObjectTierConfig, s3: Any, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    with caplog.at_level(logging.WARNING, logger="kvoffload"), \
            Handler(small_breaker(config), clock=clock) as h:
        ks = keys(2)
        assert run(h, store((0, 1), ks)).success
        _delete_bucket(s3, config.bucket)
        assert not run(h, load(ks, (4, 5))).success
        assert h.faults.counts[Fault.NO_BUCKET] == 1 and h.breaker.is_open and h.breaker.trips == 1
        sent = h.requests
        assert not run(h, store((0, 1), ks)).success and h.requests == sent
        s3.create_bucket(Bucket=config.bucket)
        clock.now += AFTER_COOLDOWN_S
        assert run(h, store((0, 1), ks)).success
        assert [opened(s3, config, k) for k in ks] == [row(h, 0), row(h, 1)]
    assert warnings_about(caplog, "bucket missing") == 1


def test_a_missing_bucket_at_start_up_is_named_and_switches_the_tier_off(
        config: ObjectTierConfig, s3: Any, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    absent = dataclasses.replace(small_breaker(config), bucket=config.bucket + "-absent")
    with caplog.at_level(logging.WARNING, logger="kvoffload"), Handler(absent, clock=clock) as h:
        assert h.breaker.is_open and h.faults.counts[Fault.NO_BUCKET] == 1
        assert not run(h, load(keys(1), (3,))).success and h.requests == 0
        clock.now += AFTER_COOLDOWN_S
        assert not run(h, load(keys(1), (3,))).success
        assert h.faults.counts[Fault.NO_BUCKET] == 2 and h.breaker.trips == 2
    assert warnings_about(caplog, "bucket missing") == 1


def test_wrong_credentials_are_denied_switch_the_tier_off_at_once_and_are_never_logged(
        config: ObjectTierConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    right = os.environ["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-key-0123456789")
    with caplog.at_level(logging.DEBUG, logger="kvoffload"):
        with Handler(small_breaker(config), clock=clock) as h:
            assert h.breaker.is_open and h.faults.counts[Fault.DENIED] == 1  # the start-up HeadBucket
            clock.now += AFTER_COOLDOWN_S
            assert not run(h, store((0,), keys(1))).success
            assert h.faults.counts[Fault.DENIED] == 2 and h.breaker.is_open and h.breaker.trips == 2
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", right)
        with Handler(small_breaker(config)) as h:  # the control: the right key is taken from the chain and works
            assert not h.breaker.is_open and run(h, store((0,), keys(1))).success
    assert warnings_about(caplog, "access denied") == 1
    assert not [r for r in caplog.records if "wrong-secret-key" in r.getMessage() or right in r.getMessage()]


# ---- bad objects ----------------------------------------------------------------------------------------------

DAMAGES = ("junk", "flip_payload", "flip_header", "truncate", "append", "empty")


def _damaged(value: bytes, damage: str) -> bytes:
    raw = bytearray(value)
    if damage == "junk":
        return os.urandom(len(value))
    if damage == "flip_payload":
        raw[-1] ^= 0xFF
    elif damage == "flip_header":
        raw[20] ^= 0x01
    elif damage == "truncate":
        del raw[-5:]
    elif damage == "append":
        raw += b"x"
    else:
        raw.clear()
    return bytes(raw)


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_object_fails_its_load_is_deleted_and_is_stored_afresh(
        config: ObjectTierConfig, s3: Any, damage: str) -> None:
    ks = keys(3)
    with Handler(small_breaker(config)) as h:
        assert run(h, store((0, 1, 2), ks)).success
        genuine = read_object(s3, config, ks[2])
        assert genuine is not None
        plant(s3, config, ks[2], _damaged(genuine, damage))
        h._slots[3:6] = 0
        result = run(h, load(ks, (3, 4, 5)))
        assert not result.success and result.bytes == 0
        assert not h._slots[5].any()  # a plain block is checked before a byte reaches its slot
        assert not exists(s3, config, ks[2]) and exists(s3, config, ks[0])  # only the damaged one deleted
        assert h.faults.counts[Fault.CORRUPT] == 1 and not h.breaker.is_open  # one object, not the store
        assert run(h, store((0, 1, 2), ks)).success and run(h, load(ks, (3, 4, 5))).success
        assert [row(h, s) for s in (3, 4, 5)] == [row(h, s) for s in (0, 1, 2)]
        assert row(h, 5) != _damaged(genuine, "junk")[HEADER_BYTES:HEADER_BYTES + ENTRY[0]]


def test_a_few_damaged_objects_never_switch_the_tier_off(config: ObjectTierConfig, s3: Any) -> None:
    """Anyone who may write the bucket can plant bad objects: they are not the store failing."""
    with Handler(small_breaker(config)) as h:
        for salt in range(5):  # more than breaker_errors
            (key,) = keys(1, salt)
            plant(s3, config, key, os.urandom(HEADER_BYTES + ENTRY[0]))
            assert not run(h, load((key,), (3,))).success
        assert h.faults.counts[Fault.CORRUPT] == 5 and not h.breaker.is_open and h.breaker.trips == 0


def test_an_oversized_object_is_read_no_further_than_one_byte_past_a_block_and_deleted(
        config: ObjectTierConfig, s3: Any) -> None:
    expected = BlockFormat.of(None).file_bytes(ENTRY[0])
    client = connect(config, pool_size=16)
    received: list[int] = []
    client.meta.events.register("after-call.s3.GetObject",
                                lambda parsed, **_: received.append(int(parsed.get("ContentLength", -1))))
    ks = keys(2)
    with Handler(small_breaker(config), client=client) as h:
        received.clear()  # the start-up check's GET of a name that is missing
        assert run(h, store((0, 1), ks)).success
        plant(s3, config, ks[1], os.urandom(32 << 20))  # 32 MiB at a block's name
        h._slots[3:5] = 0
        assert not run(h, load((ks[1],), (4,))).success
        assert received == [expected + 1]  # the server sent one byte past a block, not 32 MiB
        assert not exists(s3, config, ks[1]) and h.faults.counts[Fault.CORRUPT] == 1
        assert not h._slots[4].any()
        assert run(h, load((ks[0],), (3,))).success and row(h, 3) == row(h, 0)
        assert received == [expected + 1, expected]  # the control: a block of the right size is read whole


@pytest.mark.parametrize("forgery", FORGERIES)
def test_an_object_planted_without_the_secret_is_never_loaded_and_is_deleted(
        config: ObjectTierConfig, s3: Any, forgery: str) -> None:
    sealed = small_breaker(config, secret=SECRET)
    (key,) = keys(1)
    with Handler(sealed) as h:
        assert run(h, store((0,), (key,))).success
        genuine = read_object(s3, sealed, key)
        assert genuine is not None
        plant(s3, sealed, key, forge(forgery, BlockFormat.of(SECRET), NS.fingerprint(), key, genuine))
        assert not run(h, load((key,), (3,))).success
        assert h.faults.counts[Fault.UNAUTHENTIC] == 1 and not h.breaker.is_open
        assert not exists(s3, sealed, key)
        plant(s3, sealed, key, genuine)  # the control: the genuine object at the same name loads
        h._slots[3] = 0
        assert run(h, load((key,), (3,))).success and row(h, 3) == row(h, 0)
        assert object_name(sealed, key) != object_name(config, key)

