"""RemoteIndex against a redis-server that fails: dead, stalled, down at start-up, or refusing the password; each
a miss, never an exception or a stall, and the tier off once the breaker opens."""

from __future__ import annotations

import os
import signal

import pytest
from tests.tiers.remote.indexes import NS, VALUE, Counting, config, keys, make, write

from kvoffload.auth import TierSecret
from kvoffload.index.base import LookupResult
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.remote.index import RemoteIndex

redis = pytest.importorskip("redis")


# ---- a failing server ---------------------------------------------------------------------------------------


def test_a_dead_server_is_a_miss_then_off_without_asking(own_server: RedisServer) -> None:
    client = Counting(redis.Redis.from_url(own_server.url))
    m = make(own_server.url, client=client)
    ks = keys(2)
    write(redis.Redis.from_url(own_server.url), ks)
    assert m.lookup(ks).hits == 2
    own_server.kill()
    for _ in range(3):  # breaker_errors
        assert m.lookup(ks) == LookupResult(0)
    assert m.probe.breaker.is_open
    client.commands.clear()
    assert m.lookup(ks) == LookupResult(0) and m.prepare_store(keys(1, salt=1)) is None
    m.complete_store(ks, success=False)
    m.reset()
    assert client.commands == []  # off: nothing is sent
    m.check_integrity()


def test_a_stalled_server_is_a_miss_at_the_timeout_and_off_at_once(own_server: RedisServer) -> None:
    m = make(own_server.url, timeout_s=0.2)
    ks = keys(2)
    write(redis.Redis.from_url(own_server.url), ks)
    assert own_server.process is not None
    os.kill(own_server.process.pid, signal.SIGSTOP)
    try:
        assert m.lookup(ks) == LookupResult(0)
    finally:
        os.kill(own_server.process.pid, signal.SIGCONT)
    assert m.probe.breaker.trips == 1  # one timeout is enough: each next one would cost the scheduler as long


def test_a_server_down_at_start_up_leaves_the_tier_off_for_a_cool_down(caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer() as server:
        dead = server.url
    m = RemoteIndex.create(config(dead), NS, VALUE)
    assert m.probe.breaker.is_open and m.lookup(keys(1)) == LookupResult(0)
    assert "does not answer" in caplog.text


def test_a_wrong_password_is_a_miss_not_an_exception() -> None:
    with RedisServer({"requirepass": "right-password-1"}) as server:
        m = make(server.url, password=TierSecret("test", b"wrong-password"))
        assert m.lookup(keys(1)) == LookupResult(0) and m.probe.breaker.is_open
