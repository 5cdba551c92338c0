"""RemoteHandler against real redis-server processes that fail: absent at start-up, killed mid-run, restarted empty,
full, refusing the password, plain behind a rediss:// URL, stalled, or answering after a job's deadline; every
fault a failed result, logged once, and the breakers open as they should."""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import pytest
from tests.tiers.remote.handlers import (
    ENTRY,
    NS,
    FakeClock,
    Handler,
    keys,
    load,
    make_config,
    make_pool,
    row,
    run,
    store,
    warnings_about,
)

from kvoffload.auth import TierSecret
from kvoffload.blocks import Medium
from kvoffload.testing.redis_server import RedisServer, free_port
from kvoffload.tiers.lower.block_format import PLAIN
from kvoffload.tiers.remote.client import value_name
from kvoffload.tiers.remote.faults import Fault
from kvoffload.tiers.remote.handler import RemoteHandler

redis = pytest.importorskip("redis")


# ---- faults of a real server ----------------------------------------------------------------------------------

def test_a_server_absent_at_start_up_is_off_until_the_cool_down_then_serves(
        caplog: pytest.LogCaptureFixture) -> None:
    clock, port = FakeClock(), free_port()
    with caplog.at_level(logging.WARNING, logger="kvoffload"), \
            Handler(make_config(f"redis://127.0.0.1:{port}"), clock=clock) as h:
        assert h.breaker.is_open and warnings_about(caplog, "the remote tier is off") == 1
        ks = keys(2)
        assert not run(h, store((0, 1), ks)).success
        assert h.faults.counts[Fault.UNREACHABLE] == 1  # the start-up probe only: that job tried no I/O
        with RedisServer(port=port):
            assert not run(h, store((0, 1), ks)).success  # still cooling down
            clock.now += 11.0
            assert run(h, store((0, 1), ks)).success
            h._slots[4:6] = 0
            assert run(h, load(ks, (4, 5))).success and row(h, 4) == row(h, 0)
        assert warnings_about(caplog, "serving again") == 1


def test_a_server_killed_mid_run_fails_jobs_logs_once_and_opens_the_breaker(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    with RedisServer() as server, caplog.at_level(logging.WARNING, logger="kvoffload"), \
            Handler(make_config(server.url), clock=clock) as h:
        ks = keys(4)
        assert run(h, store((0, 1, 2, 3), ks)).success
        jobs = [load(ks, (8, 9, 10, 11)) for _ in range(3)] + [store((4,), keys(1, salt=1))]
        assert all(h.submit(job) for job in jobs)
        server.kill()
        h.wait([j.job_id for j in jobs])
        results = {r.job_id: r for r in h.get_finished()}
        assert sorted(results) == sorted(j.job_id for j in jobs)  # each reported, once
        if any(r.success for r in results.values() if r.transfer_type == (Medium.REMOTE, Medium.HOST)):
            assert row(h, 8) == row(h, 0)  # a load that made it before the kill loaded the right bytes
        for salt in range(2, 8):
            assert not run(h, store((0,), keys(1, salt))).success
        assert h.breaker.is_open and h.breaker.trips == 1
        assert warnings_about(caplog, "server unreachable") == 1
        assert warnings_about(caplog, "switching the remote tier off") == 1


def test_a_server_restarted_empty_turns_loads_into_misses() -> None:
    with RedisServer() as server, Handler(make_config(server.url)) as h:
        ks = keys(2)
        assert run(h, store((0, 1), ks)).success
        server.restart()
        assert not run(h, load(ks, (4, 5))).success  # the values are gone
        assert run(h, store((0, 1), ks)).success
        h._slots[4:6] = 0
        assert run(h, load(ks, (4, 5))).success and row(h, 5) == row(h, 1)


def test_a_full_server_refuses_stores_but_still_serves_loads(caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer({"maxmemory-policy": "noeviction"}) as server, \
            caplog.at_level(logging.WARNING, logger="kvoffload"), Handler(make_config(server.url)) as h:
        ks = keys(2)
        assert run(h, store((0, 1), ks)).success
        _overfill(server)
        for salt in range(1, 6):
            result = run(h, store((2,), keys(1, salt)))
            assert not result.success and result.bytes == 0
        assert h.store_breaker.is_open and not h.breaker.is_open
        assert warnings_about(caplog, "out of memory") == 1
        h._slots[4:6] = 0
        assert run(h, load(ks, (4, 5))).success and row(h, 4) == row(h, 0)


def _overfill(server: RedisServer) -> None:
    """2 MiB of other values, then ``maxmemory 1mb``: the server is over it for good (it evicts nothing), so every
    ``SET`` is refused (filling up to the limit instead ends in a refusal caused by a passing query buffer)."""
    c = redis.Redis.from_url(server.url)
    try:
        pipe = c.pipeline(transaction=False)
        for i in range(256):
            pipe.set(f"filler:{i}", bytes(8192))
        pipe.execute()
        c.config_set("maxmemory", "1mb")
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            c.set("probe", b"x")
    finally:
        c.close()


def test_a_wrong_password_fails_every_job_and_is_logged_once_without_the_password(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    with RedisServer({"requirepass": "right-password-1"}) as server, \
            caplog.at_level(logging.DEBUG, logger="kvoffload"):
        wrong = make_config(server.url, password=TierSecret("test", b"wrong-password-2"))
        with Handler(wrong, clock=clock) as h:
            assert h.breaker.is_open
            clock.now += 11.0
            assert not run(h, store((0,), keys(1))).success
            assert h.faults.counts[Fault.AUTH] == 2
        with Handler(make_config(server.url, password=TierSecret("test", b"right-password-1"))) as h:
            assert run(h, store((0,), keys(1))).success  # the control: the right one is sent and works
    assert warnings_about(caplog, "authentication refused") == 1
    shown = [r.getMessage() for r in caplog.records]
    assert not [m for m in shown if "wrong-password-2" in m or "right-password-1" in m]


def test_a_rediss_url_against_a_plain_server_is_a_tls_failure(server: RedisServer,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        config = make_config(server.url.replace("redis://", "rediss://"), connect_timeout_s=0.2, timeout_s=0.2)
        with Handler(config, clock=clock) as h:
            assert h.breaker.is_open and h.faults.counts[Fault.TLS] == 1
            assert not run(h, store((0,), keys(1))).success
            clock.now += 11.0
            assert not run(h, store((0,), keys(1))).success
            assert h.faults.counts[Fault.TLS] == 2
    assert warnings_about(caplog, "TLS handshake failed") == 1


def _stall(server: RedisServer, seconds: int) -> threading.Thread:
    """Run ``DEBUG SLEEP`` from another client; return once the server has stopped answering."""
    sleeper = threading.Thread(target=lambda: redis.Redis.from_url(server.url, socket_timeout=30).execute_command(
        "DEBUG", "SLEEP", str(seconds)), daemon=True)
    sleeper.start()
    for _ in range(500):  # polling the server, not our own work
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=0.05) as conn:
                conn.sendall(b"PING\r\n")
                conn.recv(16)
        except TimeoutError:
            return sleeper
    raise AssertionError("the server never stalled")


def test_a_stalled_server_fails_the_job_at_the_command_timeout_then_serves_again() -> None:
    with RedisServer({"enable-debug-command": "yes"}) as server, \
            Handler(make_config(server.url, timeout_s=0.2)) as h:
        ks = keys(1)
        assert run(h, store((0,), ks)).success
        sleeper = _stall(server, 2)
        h._slots[3] = 0
        assert not run(h, load(ks, (3,))).success
        assert h.faults.counts[Fault.TIMEOUT] == 1 and not h._slots[3].any()
        sleeper.join()
        assert run(h, load(ks, (3,))).success and row(h, 3) == row(h, 0)


def test_a_job_past_its_deadline_fails_with_those_queued_behind_it_and_its_late_reply_is_dropped() -> None:
    class SignallingRedis(redis.Redis):
        """Says when a pipeline starts talking to the server."""

        executing = threading.Event()

        def pipeline(self, *args: Any, **kwargs: Any) -> Any:
            pipe = super().pipeline(*args, **kwargs)
            execute = pipe.execute

            def signalled(*a: Any, **kw: Any) -> Any:
                self.executing.set()
                return execute(*a, **kw)

            pipe.execute = signalled
            return pipe

    clock = FakeClock()
    with RedisServer({"enable-debug-command": "yes"}) as server:
        slow = SignallingRedis.from_url(server.url, socket_timeout=30)
        h = RemoteHandler(make_config(server.url), make_pool(), NS, ENTRY, client=slow, clock=clock)
        try:
            ks = keys(1)
            assert run(h, store((0,), ks)).success
            SignallingRedis.executing.clear()
            sleeper = _stall(server, 1)
            h._slots[3] = 0
            job = load(ks, (3,))
            assert h.submit(job)
            assert SignallingRedis.executing.wait(10)
            queued = load(ks, (3,))  # behind it on the load lane
            assert h.submit(queued)
            clock.now += 100.0  # past the job's deadline; its GET has not been answered
            results = h.get_finished()
            assert [(r.job_id, r.success) for r in results] == [(job.job_id, False), (queued.job_id, False)]
            sleeper.join()
            assert h._lanes[False].wait_idle(30)  # the late reply has come back to the lane
            assert not h._slots[3].any()
        finally:
            h.shutdown()
            slow.close()


@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_job_late_between_its_pipelines_touches_no_slot_after_its_deadline(server: RedisServer,
                                                                            direction: str) -> None:
    """Cut into pipelines of one value, the job passes its deadline during a pipeline: no slot is read for a
    value (whose slot's owner may reuse it now) or written from one after that. A store has already sealed the
    next value while it still owned the slots (that is the overlap), so it sends two of three values; a load
    has copied the first value in and never copies the second."""
    clock = FakeClock()
    executes = 0
    late_after = 1 if direction == "store" else 2
    armed = direction == "store"  # a load's values are stored first, on time

    class LateRedis(redis.Redis):
        def pipeline(self, *args: Any, **kwargs: Any) -> Any:
            pipe = super().pipeline(*args, **kwargs)
            execute = pipe.execute

            def late(*a: Any, **kw: Any) -> Any:
                nonlocal executes
                replies = execute(*a, **kw)
                executes += 1
                if armed and executes == late_after:
                    if direction == "store":
                        # The overlap this case is about: the helper seals the next value while this pipeline
                        # runs. Wait for that seal (queued on the helper's one thread before this pipeline
                        # started), or on a busy machine the deadline may pass before it did.
                        h._helpers[True].submit(lambda: None).result()
                    clock.now += 100.0
                return replies

            pipe.execute = late
            return pipe

    client = LateRedis.from_url(server.url)
    client.flushall()
    h = RemoteHandler(make_config(server.url), make_pool(), NS, ENTRY, client=client, clock=clock, batch_bytes=1)
    try:
        ks = keys(3)
        if direction == "load":
            assert run(h, store((0, 1, 2), ks)).success
            executes, clock.now, armed = 0, 0.0, True  # counting starts again with the load
            h._slots[3:6] = 0
        result = run(h, store((0, 1, 2), ks) if direction == "store" else load(ks, (3, 4, 5)))
        assert not result.success
        if direction == "store":
            assert [client.exists(value_name(NS, PLAIN, k)) for k in ks] == [1, 1, 0]
        else:
            assert [bool(h._slots[s].any()) for s in (3, 4, 5)] == [True, False, False]
    finally:
        h.shutdown()
        client.close()
