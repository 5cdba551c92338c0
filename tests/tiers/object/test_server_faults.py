"""The object tier against servers that misbehave (tests/tiers/object/servers.py) and against the real RGW.

Deadlines a server cannot stretch: a start-up check (the scheduler's and the worker's) and an existence search end
by their deadline whatever the server does (trickles its answer a byte at a time, never answers, resolves slowly),
and the connection is shut then, so that the thread is free (the server sees it closed). Reads no longer than asked:
a server sending 128 MiB to a one-byte GET is read two bytes, and its connection dropped. A load's answer lands in
the caller's buffer (``tiers.object.body.read_into``): a whole one's connection is reused, one that breaks off is a
failed request, never a short (deleted) object. A store that is not one (a
web server answering 200 to everything) is refused for the engine's life with one error naming it, never its
credentials; the real RGW passes the same check.

Timeouts here are 300 ms (connect) + 300 ms (request): a check's deadline is 0.6 s. The bounds allow ``MARGIN`` for
a loaded machine; the code before these deadlines took 9 s (trickle) or the resolver's whole delay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tests.tiers.object.handlers import FakeClock, Handler, load, run, store
from tests.tiers.object.handlers import keys as job_keys
from tests.tiers.object.indexes import NS, OBJECT, keys, name
from tests.tiers.object.servers import CUT_SENT, HUGE, FakeStore

from kvoffload.config import ObjectTierConfig
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.tiers.lower.breaker import CircuitBreaker
from kvoffload.tiers.object.body import AnswerCutShort, read_into
from kvoffload.tiers.object.client import ObjectNames, connect
from kvoffload.tiers.object.faults import Fault, classify
from kvoffload.tiers.object.index import ObjectIndex
from kvoffload.tiers.object.probe import ObjectProbe

TIMEOUT_S = 0.3
DEADLINE_S = 2 * TIMEOUT_S
"""A start-up check's: object_connect_timeout_ms + object_timeout_ms."""
MARGIN_S = 2.0
"""Beyond a deadline, for a loaded 2-core machine (the code before the deadlines took 10-15 s here, so the bound
still tells them apart). The start-up checks' tests make their boto3 client before the clock starts: making one took
up to 2.6 s in CI, which a deadline on the check does not bound."""
ACCESS_KEY, SECRET_KEY = "AKIAKVOFFLOADTEST", "never-shown-secret-key"
BUCKET = "kv-fake"


@pytest.fixture
def fake_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys for signing (the fake server checks nothing), and nothing of this machine's own AWS set-up."""
    for variable in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def server(fake_credentials: None) -> Iterator[FakeStore]:
    with FakeStore() as s:
        # botocore loads S3's service model once per process (about a second on a loaded machine): loaded here, so
        # that the timed checks measure the check.
        connect(on(s))
        yield s


def on(s: FakeStore, **changes: Any) -> ObjectTierConfig:
    settings = {"connect_timeout_s": TIMEOUT_S, "timeout_s": TIMEOUT_S, "breaker_errors": 3,
                "breaker_cooldown_s": 60.0, "capacity_bytes": 8 * OBJECT}
    return ObjectTierConfig(bucket=BUCKET, endpoint=s.endpoint, region="us-east-1", **{**settings, **changes})


@contextlib.contextmanager
def scheduler_index(config: ObjectTierConfig, client: Any = None) -> Iterator[ObjectIndex]:
    """The scheduler's index, made as the engine makes it (its start-up check included)."""
    index = ObjectIndex.create(config, NS, OBJECT, client=client)
    try:
        yield index
    finally:
        close = getattr(index, "close", None)  # background lookups' threads, where the index has them
        if close is not None:
            close()
        index.probe.close()


def timed(make: Any) -> tuple[Any, float]:
    began = time.monotonic()
    value = make()
    return value, time.monotonic() - began


def closed_within(s: FakeStore, since: float, bound_s: float) -> bool:
    """The client closed its connection (its thread let go of it) within ``bound_s`` of ``since``."""
    closed = s.wait_closed(1, since + bound_s - time.monotonic() + 1.0)
    return bool(closed) and closed[0] - since <= bound_s


# ---- deadlines ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["trickle", "frozen"])
def test_the_schedulers_start_up_check_ends_by_its_deadline_and_lets_go_of_the_connection(
        server: FakeStore, mode: str) -> None:
    server.mode = mode
    client = connect(on(server))  # made before the clock starts: the deadline bounds the check, not boto3's set-up
    began = time.monotonic()
    with scheduler_index(on(server), client) as index, contextlib.closing(client):
        took = time.monotonic() - began
        assert took < DEADLINE_S + MARGIN_S, took  # before: 9 s against a trickle (a byte every 0.2 s)
        assert not index.probe.available and index.probe.breaker.is_open  # not answered: off for the cool-down
        assert closed_within(server, began, DEADLINE_S + MARGIN_S)


@pytest.mark.parametrize("mode", ["trickle", "frozen"])
def test_the_workers_start_up_check_ends_by_its_deadline_and_lets_go_of_the_connection(
        server: FakeStore, mode: str) -> None:
    server.mode = mode
    client = connect(on(server))
    began = time.monotonic()
    with Handler(on(server), client=client) as h, contextlib.closing(client):
        took = time.monotonic() - began
        assert took < DEADLINE_S + MARGIN_S, took
        assert h.breaker.is_open
        assert closed_within(server, began, DEADLINE_S + MARGIN_S)


def test_a_slow_resolver_holds_the_start_up_check_no_longer_than_its_deadline(
        server: FakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """getaddrinfo cannot be interrupted, and this machine has no second resolver to make slow: the test makes the
    resolver slow by patching ``socket.getaddrinfo`` (every connection the client makes resolves through it)."""
    resolve, released = socket.getaddrinfo, threading.Event()

    def slow(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if port == server.port:
            released.wait(10.0)
        return resolve(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    client = connect(on(server))  # makes no request, so resolves nothing
    try:
        began = time.monotonic()
        with scheduler_index(on(server), client) as index, contextlib.closing(client):
            took = time.monotonic() - began
            assert took < DEADLINE_S + MARGIN_S, took  # before: as long as the resolver took (10 s here)
            assert not index.probe.available and index.probe.breaker.is_open
    finally:
        released.set()


def test_an_existence_search_against_a_trickle_ends_by_its_timeout_and_lets_go_of_the_connection(
        server: FakeStore) -> None:
    with scheduler_index(on(server)) as index:
        assert index.probe.available  # the start-up check met an S3 answer
        server.mode = "trickle"
        began = time.monotonic()
        run, took = timed(lambda: index.probe.leading_run(keys(1)))
        assert run is None and took < TIMEOUT_S + MARGIN_S, took
        assert closed_within(server, began, TIMEOUT_S + MARGIN_S)  # before: only once the trickle ended, 9 s on


# ---- reads no longer than asked -------------------------------------------------------------------------------


def test_an_existence_check_reads_two_bytes_of_a_huge_answer_and_drops_the_connection(server: FakeStore) -> None:
    with scheduler_index(on(server)) as index:
        server.mode = "huge"
        began = time.monotonic()
        assert index.probe.leading_run(keys(1)) == 1  # a server ignoring the range has answered "exists"
        assert closed_within(server, began, MARGIN_S)
        assert server.sent < HUGE // 4, server.sent  # socket buffers at most; before: all 128 MiB, read into memory


def test_a_load_reads_one_byte_past_a_block_of_a_huge_answer_and_fails(server: FakeStore) -> None:
    with Handler(on(server)) as h:
        server.mode = "huge"
        began = time.monotonic()
        assert not run(h, load(job_keys(1), (3,))).success
        assert closed_within(server, began, MARGIN_S)
        assert server.sent < HUGE // 4, server.sent


def get(client: Any) -> Any:
    """The body of a GET of some object (the fake server answers every GET alike)."""
    return client.get_object(Bucket=BUCKET, Key="any")["Body"]


def test_a_whole_answer_lands_in_the_buffer_without_botocores_read_and_its_connection_is_reused(
        server: FakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from botocore.response import StreamingBody

    def refused(*_: Any) -> bytes:
        raise AssertionError("read through StreamingBody.read: a copy more than needed")

    server.mode = "ok"  # 200 and one byte, keep-alive
    client = connect(on(server))
    monkeypatch.setattr(StreamingBody, "read", refused)
    buffer = memoryview(bytearray(8))
    for _ in range(3):
        assert read_into(get(client), buffer) == 1 and buffer[0] == ord("x")
    assert server.accepted == 1 and not server.closed_at  # one connection served all three


def test_an_answer_longer_than_the_buffer_is_read_to_its_end_and_its_connection_dropped(server: FakeStore) -> None:
    server.mode = "huge"
    client = connect(on(server))
    buffer = memoryview(bytearray(1 << 20))
    began = time.monotonic()
    assert read_into(get(client), buffer) == len(buffer)
    assert closed_within(server, began, MARGIN_S)
    assert server.sent < HUGE // 4, server.sent


def test_an_answer_that_breaks_off_is_a_failed_request_not_a_short_object(server: FakeStore) -> None:
    server.mode = "cut"
    client = connect(on(server))
    with pytest.raises(AnswerCutShort) as failed:
        read_into(get(client), memoryview(bytearray(1 << 20)))
    assert classify(failed.value) is Fault.UNREACHABLE  # a server fault, counted by the breaker


def test_a_body_without_an_http_response_is_read_by_its_own_read_no_further_than_the_buffer() -> None:
    class Body:
        def __init__(self, data: bytes) -> None:
            self.data, self.closed = data, False

        def read(self, n: int) -> bytes:
            part, self.data = self.data[:n], self.data[n:]
            return part

        def close(self) -> None:
            self.closed = True

    buffer = memoryview(bytearray(4))
    for data, got in ((b"ab", 2), (b"abcdefgh", 4)):
        body = Body(data)
        assert read_into(body, buffer) == got and bytes(buffer[:got]) == data[:got] and body.closed


def test_a_load_whose_answer_breaks_off_fails_and_deletes_no_object(server: FakeStore) -> None:
    # Timeouts no loaded machine runs past (this is no deadline test): a start-up check that timed out would open
    # the breaker, and the load would fail without its GET.
    with Handler(on(server, connect_timeout_s=5.0, timeout_s=5.0)) as h:
        server.mode = "cut"
        assert not run(h, load(job_keys(1), (3,))).success
        assert server.methods[1:] == ["GET"]  # the start-up check, the load's GET, and no DELETE
        assert server.sent < 1024 + CUT_SENT


# ---- a store that is not one ----------------------------------------------------------------------------------


def test_a_web_server_answering_200_to_everything_is_refused_by_the_scheduler_for_good(
        server: FakeStore, caplog: pytest.LogCaptureFixture) -> None:
    server.mode = "ok"
    config = on(server)
    clock = FakeClock()
    names = ObjectNames(config, NS, BlockFormat.of(None))
    breaker = CircuitBreaker(3, 60.0, clock, tier="object tier (test)")
    probe = ObjectProbe(connect(config), BUCKET, names, fanout=4, timeout_s=TIMEOUT_S, breaker=breaker, clock=clock)
    with caplog.at_level(logging.INFO, logger="kvoffload"):
        assert probe.check() is False
    clock.now += 1e6  # long past any cool-down
    asked = server.requests
    assert not probe.available and probe.leading_run(keys(4)) is None and probe.delete(keys(1)) is False
    assert server.requests == asked == 1  # the check alone; a lookup sends nothing
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and server.endpoint in errors[0] and BUCKET in errors[0], errors
    assert "not an S3 object store" in errors[0]
    assert not any(ACCESS_KEY in r.getMessage() or SECRET_KEY in r.getMessage() for r in caplog.records)
    probe.close()


def test_a_web_server_answering_200_to_everything_is_refused_by_the_worker_for_good(
        server: FakeStore, caplog: pytest.LogCaptureFixture) -> None:
    server.mode = "ok"
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger="kvoffload"), Handler(on(server), clock=clock) as h:
        clock.now += 1e6
        asked, sent = server.requests, h.requests
        assert not run(h, load(job_keys(2), (3, 4))).success and not run(h, store((0,), job_keys(1))).success
        assert server.requests == asked == 1 and h.requests == sent  # failed at once, without I/O
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and server.endpoint in errors[0] and BUCKET in errors[0], errors
    assert not any(ACCESS_KEY in r.getMessage() or SECRET_KEY in r.getMessage() for r in caplog.records)


# ---- the real RGW ---------------------------------------------------------------------------------------------


def test_the_start_up_check_passes_on_a_real_radosgw_which_answers_no_such_key(config: ObjectTierConfig) -> None:
    client = connect(config)
    codes: list[str] = []
    client.meta.events.register("after-call.s3.GetObject",
                                lambda parsed, **_: codes.append(parsed.get("Error", {}).get("Code", "found")))
    with scheduler_index(dataclasses.replace(config, capacity_bytes=8 * OBJECT), client) as index:
        assert index.probe.available and codes == ["NoSuchKey"]  # one GET of a random name, missing as it must be
        assert index.probe.check() is True and codes == ["NoSuchKey"] * 2


def test_an_existence_check_on_a_real_radosgw_reads_one_byte_of_a_large_object(s3: Any,
                                                                                config: ObjectTierConfig) -> None:
    (key,) = keys(1)
    s3.put_object(Bucket=config.bucket, Key=name(config, key), Body=b"\1" * (4 << 20))
    client = connect(config)
    lengths: list[int] = []
    client.meta.events.register("after-call.s3.GetObject",
                                lambda parsed, **_: lengths.append(int(parsed.get("ContentLength", -1))))
    with scheduler_index(dataclasses.replace(config, capacity_bytes=8 * OBJECT), client) as index:
        lengths.clear()  # the start-up check's
        assert index.probe.leading_run([key]) == 1 and index.probe.leading_run(keys(1, salt=7)) == 0
    assert lengths == [1, -1]  # one byte of 4 MiB; a miss
