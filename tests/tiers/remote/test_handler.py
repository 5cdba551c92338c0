"""RemoteHandler against real redis-server processes: round trips, the value layout, bad values, and every fault
(absent, killed, restarted empty, stalled, full, wrong password, TLS against a plain server) as failed results."""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tests.forgeries import FORGERIES, forge

from kvoffload.auth import TAG_BYTES, TierSecret
from kvoffload.config import RemoteTierConfig
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.specs import HostBlocks, JobId, Medium, RemoteBlocks, TransferJob
from kvoffload.testing.redis_server import RedisCluster, RedisServer, free_port
from kvoffload.tiers.lower.block_format import (
    HEADER_BYTES,
    PLAIN,
    BlockFormat,
    checksum,
    decode_header,
)
from kvoffload.tiers.remote.client import value_name
from kvoffload.tiers.remote.faults import Fault
from kvoffload.tiers.remote.handler import RemoteHandler
from kvoffload.tiers.remote.stage import BATCH_BYTES
from kvoffload.transfer.base import TransferResult
from kvoffload.transfer.host_pool import HostPool

redis = pytest.importorskip("redis")

NS = Namespace(model="m", dtype="bf16", layout="pages=64")
ENTRY = (48, 32)  # two KV-cache groups with different block sizes
SLOT = 64
SECRET = TierSecret("test", b"k" * 32)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def keys(n: int, salt: int = 0) -> tuple[OffloadKey, ...]:
    return tuple(offload_key(bytes([salt, i]) * 8, 0) for i in range(n))  # type: ignore[arg-type]


def make_pool(slots: int = 16) -> HostPool:
    pool = HostPool(slots, SLOT)
    pool.buffer.copy_(torch.randint(-128, 128, (slots, SLOT), dtype=torch.int8))
    return pool


def make_config(url: str, **changes: Any) -> RemoteTierConfig:
    return dataclasses.replace(RemoteTierConfig(urls=(url,), breaker_errors=3, breaker_cooldown_s=10.0), **changes)


_ids = iter(range(1, 1 << 30))

Groups = tuple[int, ...] | None


def store(slots: tuple[int, ...], ks: tuple[OffloadKey, ...], groups: Groups = None) -> TransferJob:
    groups = groups or (len(slots),)
    return TransferJob(JobId(next(_ids)), HostBlocks(slots, groups), RemoteBlocks(ks, groups))


def load(ks: tuple[OffloadKey, ...], slots: tuple[int, ...], groups: Groups = None) -> TransferJob:
    groups = groups or (len(slots),)
    return TransferJob(JobId(next(_ids)), RemoteBlocks(ks, groups), HostBlocks(slots, groups))


def run(handler: RemoteHandler, job: TransferJob) -> TransferResult:
    assert handler.submit(job)
    handler.wait([job.job_id])
    (result,) = [r for r in handler.get_finished() if r.job_id == job.job_id]
    return result


def row(handler: RemoteHandler, slot: int, nbytes: int = ENTRY[0]) -> bytes:
    return bytes(handler._slots[slot, :nbytes])


@pytest.fixture
def config(server: RedisServer) -> RemoteTierConfig:
    return make_config(server.url)


BATCHES = {"one-pipeline": BATCH_BYTES, "pipelines-of-2": 2 * PLAIN.file_bytes(ENTRY[0])}
"""Every data-path test runs with a job in one pipeline, and cut into pipelines of two values (the helper threads
then seal or verify one batch while the lane sends or receives the next)."""


@pytest.fixture(params=list(BATCHES.values()), ids=list(BATCHES))
def batch_bytes(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def handler(config: RemoteTierConfig, batch_bytes: int) -> Iterator[RemoteHandler]:
    h = RemoteHandler(config, make_pool(), NS, ENTRY, batch_bytes=batch_bytes)
    yield h
    h.shutdown()


class Handler:
    """A handler over a fresh pool, shut down on exit."""

    def __init__(self, config: RemoteTierConfig, ns: Namespace = NS, **kwargs: Any) -> None:
        self.handler = RemoteHandler(config, make_pool(), ns, ENTRY, **kwargs)

    def __enter__(self) -> RemoteHandler:
        return self.handler

    def __exit__(self, *exc: object) -> None:
        self.handler.shutdown()


def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return len([r for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()])


# ---- the data path --------------------------------------------------------------------------------------------

def test_store_then_load_round_trips_several_groups_bit_exact(handler: RemoteHandler) -> None:
    ks = keys(5)
    sizes = (48,) * 5  # an entry of any group moves the largest group's bytes (tiers/lower/handler.py)
    expected = [row(handler, s, n) for s, n in zip(range(5), sizes, strict=True)]
    stored = run(handler, store((0, 1, 2, 3, 4), ks, (3, 2)))
    assert stored.success and stored.bytes == sum(sizes) and stored.transfer_type == (Medium.HOST, Medium.REMOTE)
    handler._slots[8:13] = 0
    loaded = run(handler, load(ks, (8, 9, 10, 11, 12), (3, 2)))
    assert loaded.success and loaded.bytes == sum(sizes) and loaded.transfer_type == (Medium.REMOTE, Medium.HOST)
    assert [row(handler, s, n) for s, n in zip(range(8, 13), sizes, strict=True)] == expected


def test_a_value_is_named_by_world_rank_and_key_and_holds_the_disk_block_encoding(
        handler: RemoteHandler, client: Any) -> None:
    (key,) = keys(1)
    assert run(handler, store((0,), (key,))).success
    name = value_name(NS, PLAIN, key)
    assert name == f"kvoffload:{NS.chain_root().hex()[:16]}:r0:{key.hex()}"
    value = client.get(name)
    assert len(value) == HEADER_BYTES + ENTRY[0]
    assert decode_header(value[:HEADER_BYTES], NS.fingerprint(), key, ENTRY[0]) == checksum(value[HEADER_BYTES:])
    assert value[HEADER_BYTES:] == row(handler, 0)
    assert client.ttl(name) == -1  # no TTL unless configured


def test_a_second_store_of_a_key_keeps_the_first_writers_value(handler: RemoteHandler, client: Any) -> None:
    (key,) = keys(1)
    assert run(handler, store((0,), (key,))).success
    assert run(handler, store((1,), (key,))).success  # NX: already there is a success, not a fault
    assert client.get(value_name(NS, PLAIN, key))[HEADER_BYTES:] == row(handler, 0) != row(handler, 1)


def test_values_expire_after_the_configured_ttl(config: RemoteTierConfig, client: Any) -> None:
    (key,) = keys(1)
    with Handler(dataclasses.replace(config, ttl_s=100)) as h:
        assert run(h, store((0,), (key,))).success
    assert 0 < client.ttl(value_name(NS, PLAIN, key)) <= 100


def test_a_missing_value_fails_its_load_without_counting_as_a_fault(handler: RemoteHandler) -> None:
    *present, absent = keys(3)
    assert run(handler, store((0, 1), tuple(present))).success
    for _ in range(5):
        assert not run(handler, load((*present, absent), (3, 4, 5))).success
    assert not handler.breaker.is_open and not any(handler.faults.counts.values())


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "append", "empty"])
def test_a_damaged_value_is_never_loaded_and_is_deleted(handler: RemoteHandler, client: Any, damage: str) -> None:
    ks = keys(3)  # the damaged one last: in the second pipeline when batched
    assert run(handler, store((0, 1, 2), ks)).success
    name = value_name(NS, PLAIN, ks[2])
    value = bytearray(client.get(name))
    if damage == "flip_payload":
        value[-1] ^= 0xFF
    elif damage == "flip_header":
        value[20] ^= 0x01
    elif damage == "truncate":
        value = value[:-5]
    elif damage == "append":
        value += b"x"
    else:
        value = bytearray()
    client.set(name, bytes(value))
    handler._slots[3:6] = 0
    assert not run(handler, load(ks, (3, 4, 5))).success
    assert not handler._slots[5].any()
    assert client.exists(name) == 0  # else SET NX would keep it for good
    assert handler.faults.counts[Fault.CORRUPT] == 1
    assert run(handler, store((0, 1, 2), ks)).success and run(handler, load(ks, (3, 4, 5))).success
    assert [row(handler, s) for s in (3, 4, 5)] == [row(handler, s) for s in (0, 1, 2)]


def test_a_value_of_another_namespace_is_never_loaded(handler: RemoteHandler, client: Any,
                                                      config: RemoteTierConfig) -> None:
    other = Namespace(model="other", dtype="bf16", layout="pages=64")
    (key,) = keys(1)
    with Handler(config, other) as foreign:
        assert run(foreign, store((0,), (key,))).success
    client.set(value_name(NS, PLAIN, key), client.get(value_name(other, PLAIN, key)))  # planted where NS looks
    assert not run(handler, load((key,), (1,))).success


def test_malformed_jobs_raise_value_error(handler: RemoteHandler) -> None:
    with pytest.raises(ValueError, match="outside the pool"):
        handler.submit(store((99,), keys(1)))
    with pytest.raises(ValueError, match="does not move"):
        handler.submit(TransferJob(JobId(1), RemoteBlocks(keys(1), (1,)), RemoteBlocks(keys(1), (1,))))
    with pytest.raises(ValueError, match="skip_sub_blocks"):
        handler.submit(TransferJob(JobId(2), HostBlocks((0,), (1,), 1), RemoteBlocks(keys(1), (1,))))
    with pytest.raises(ValueError, match="entry_bytes"):
        RemoteHandler(make_config("redis://127.0.0.1:1"), make_pool(), NS, (SLOT + 1,))


def test_create_sizes_the_entries_from_the_layout(config: RemoteTierConfig) -> None:
    class Layout:
        groups = ("attention", "state")

        def group_block_bytes(self, group: int) -> int:
            return (16, 8)[group]

    h = RemoteHandler.create(config, make_pool(), NS, Layout(), factor=2)
    try:
        assert h._entry_bytes == (32, 16)
    finally:
        h.shutdown()


# ---- with a secret --------------------------------------------------------------------------------------------

FMT = BlockFormat.of(SECRET)


@pytest.fixture
def secret_handler(config: RemoteTierConfig, batch_bytes: int) -> Iterator[RemoteHandler]:
    with Handler(dataclasses.replace(config, secret=SECRET), batch_bytes=batch_bytes) as h:
        yield h


def test_sealed_values_round_trip_under_names_that_are_not_their_keys_and_hide_their_contents(
        secret_handler: RemoteHandler, client: Any) -> None:
    ks = keys(2)
    expected = [row(secret_handler, s) for s in (0, 1)]
    assert run(secret_handler, store((0, 1), ks)).success
    for key in ks:
        name = value_name(NS, FMT, key)
        assert key.hex() not in name and NS.chain_root().hex()[:16] not in name
        assert client.strlen(name) == HEADER_BYTES + ENTRY[0] + TAG_BYTES
        value = client.get(name)
        assert key not in value and NS.fingerprint() not in value and expected[0][:32] not in value
    secret_handler._slots[5:7] = 0
    assert run(secret_handler, load(ks, (5, 6))).success
    assert [row(secret_handler, s) for s in (5, 6)] == expected


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_planted_copied_or_rewritten_value_is_never_loaded(
        secret_handler: RemoteHandler, client: Any, forgery: str) -> None:
    (key,) = keys(1)
    assert run(secret_handler, store((0,), (key,))).success
    name = value_name(NS, FMT, key)
    client.set(name, forge(forgery, FMT, NS.fingerprint(), key, client.get(name)))
    secret_handler._slots[3] = 0
    assert not run(secret_handler, load((key,), (3,))).success
    assert secret_handler.faults.counts[Fault.UNAUTHENTIC] == 1
    assert not secret_handler.breaker.is_open and client.exists(name) == 0


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


# ---- a cluster ------------------------------------------------------------------------------------------------

def test_a_round_trip_through_a_three_node_cluster() -> None:
    with RedisCluster(3) as cluster:
        config = dataclasses.replace(make_config(cluster.urls[0]), urls=cluster.urls, cluster=True)
        for salt, batch_bytes in enumerate(BATCHES.values()):
            with Handler(config, batch_bytes=batch_bytes) as h:
                ks = keys(12, salt)
                sizes = (48,) * 7 + (32,) * 5
                expected = [row(h, s, n) for s, n in enumerate(sizes)]
                assert run(h, store(tuple(range(12)), ks, (7, 5))).success
                h._slots[:12] = 0
                assert run(h, load(ks, tuple(range(12)), (7, 5))).success
                assert [row(h, s, n) for s, n in enumerate(sizes)] == expected
        held = [redis.Redis.from_url(url).dbsize() for url in cluster.urls]
        assert sum(held) == 24 and sum(1 for n in held if n) >= 2  # the values are spread over the nodes


