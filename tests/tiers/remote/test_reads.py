"""RemoteHandler's loads read no more than a value's size: planted huge values, lists, hashes and empty strings at
a value's name fail the load, are deleted, never come into the worker's memory, and never open the breaker."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
import torch
from tests.tiers.jobs import TierJobs, run

from kvoffload.auth import TierSecret
from kvoffload.blocks import Medium, TransferJob
from kvoffload.config import RemoteTierConfig
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.testing.redis_server import RedisCluster, RedisServer
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.tiers.remote.client import value_name
from kvoffload.tiers.remote.faults import Fault
from kvoffload.tiers.remote.handler import RemoteHandler
from kvoffload.tiers.remote.stage import BATCH_BYTES
from kvoffload.transfer.host_pool import HostPool

redis = pytest.importorskip("redis")

NS = Namespace(model="m", dtype="bf16", layout="bounded-reads")
ENTRY = (48, 32)
SLOT = 64
SECRETS = {"plain": None, "secret": TierSecret("test", b"k" * 32)}
FORMATS = {fmt_id: BlockFormat.of(secret) for fmt_id, secret in SECRETS.items()}
PLANTED = 64 << 20
"""The size of each planted huge value (a writer may plant up to Redis's 512 MiB)."""
SLACK = 16 << 20
"""What a load may add to the peak besides one batch: allocator pages, thread stacks, small replies."""

def keys(n: int, salt: int = 0) -> tuple[OffloadKey, ...]:
    return tuple(offload_key(bytes([salt, i]) * 8, 0) for i in range(n))  # type: ignore[arg-type]


_jobs = TierJobs(Medium.REMOTE)
store, load = _jobs.store, _jobs.load


def succeeds(handler: RemoteHandler, job: TransferJob) -> bool:
    return run(handler, job).success


def make_handler(url: str, fmt_id: str, client: Any | None = None, **changes: Any) -> RemoteHandler:
    config = RemoteTierConfig(urls=(url,), breaker_errors=3, breaker_cooldown_s=10.0, secret=SECRETS[fmt_id])
    pool = HostPool(16, SLOT)
    pool.buffer.copy_(torch.randint(-128, 128, (16, SLOT), dtype=torch.int8))
    return RemoteHandler(dataclasses.replace(config, **changes), pool, NS, ENTRY, client=client)


def plant(client: Any, name: str, kind: str, value_bytes: int = 0) -> None:
    """Put something that is not a value of ``value_bytes`` at ``name`` (``SETRANGE`` grows a huge string on the
    server alone: the test process never holds it)."""
    client.delete(name)
    if kind == "huge":
        client.setrange(name, PLANTED - 1, b"x")
    elif kind == "one_byte_long":
        client.set(name, bytes(value_bytes + 1))
    elif kind == "empty":
        client.set(name, b"")
    elif kind == "list":
        client.rpush(name, b"not a block")
    elif kind == "hash":
        client.hset(name, "field", b"not a block")
    else:
        client.sadd(name, b"not a block")


class PeakRss:
    """How much this process's peak resident memory rose inside the ``with`` block (``growth``, in bytes).

    The kernel's peak (``VmHWM``) is reset to the current resident size on entry (``/proc/self/clear_refs``), so the
    growth counts every allocation of the block, Python's and C's (redis-py's and hiredis's buffers) alike.
    """

    growth = 0

    def __enter__(self) -> PeakRss:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pytest.skip("resetting the peak RSS needs Linux's /proc/self/clear_refs")
        self._start = _status_kib("VmRSS")
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.growth = (_status_kib("VmHWM") - self._start) << 10


def _status_kib(field: str) -> int:
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert found is not None
    return int(found.group(1))


@pytest.fixture(params=list(FORMATS))
def fmt_id(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def handler(server: RedisServer, client: Any, fmt_id: str) -> Iterator[RemoteHandler]:
    h = make_handler(server.url, fmt_id)
    yield h
    h.shutdown()


def names(fmt_id: str, ks: tuple[OffloadKey, ...]) -> list[str]:
    return [value_name(NS, FORMATS[fmt_id], k) for k in ks]


# ---- planted huge values ----------------------------------------------------------------------------------------

def test_planted_64_mib_values_fail_the_load_are_deleted_and_add_less_than_a_batch_to_the_peak(
        handler: RemoteHandler, client: Any, fmt_id: str) -> None:
    ks = keys(4)
    for name in names(fmt_id, ks):
        plant(client, name, "huge")
    assert succeeds(handler, store((0, 1, 2, 3), keys(4, salt=1)))  # warm the lanes up on ordinary bytes
    with PeakRss() as peak:
        loaded = succeeds(handler, load(ks, (4, 5, 6, 7)))
    assert not loaded and peak.growth < BATCH_BYTES + SLACK
    assert [client.exists(n) for n in names(fmt_id, ks)] == [0, 0, 0, 0]  # else SET NX would keep them for good
    assert handler.faults.counts[Fault.CORRUPT] == 1 and not handler.breaker.is_open


def test_the_peak_measure_sees_a_whole_get_of_the_same_values(client: Any) -> None:
    """The control: the old loads' pipeline of ``GET`` fails the bound above by far (four values, 256 MiB)."""
    ks = keys(4)
    for name in names("plain", ks):
        plant(client, name, "huge")
    with PeakRss() as peak:
        pipe = client.pipeline(transaction=False)
        for name in names("plain", ks):
            pipe.get(name)
        replies = pipe.execute()
        del replies
    assert peak.growth > 3 * PLANTED > BATCH_BYTES + SLACK


def test_no_read_asks_for_more_than_one_byte_past_a_values_size(server: RedisServer, client: Any,
                                                                  fmt_id: str) -> None:
    reads: list[tuple[Any, ...]] = []
    plain_redis: Any = redis.Redis

    class RecordingRedis(plain_redis):
        def pipeline(self, *args: Any, **kwargs: Any) -> Any:
            pipe = super().pipeline(*args, **kwargs)
            execute = pipe.execute

            def recorded(*a: Any, **kw: Any) -> Any:
                reads.extend(c[0] for c in pipe.command_stack if c[0][0] != "SET")
                return execute(*a, **kw)

            pipe.execute = recorded
            return pipe

    recording = RecordingRedis.from_url(server.url)
    h = make_handler(server.url, fmt_id, client=recording)
    try:
        ks = keys(3)
        job = store((0, 1, 2), ks, (2, 1))
        assert succeeds(h, job)
        assert succeeds(h, load(ks, (3, 4, 5), (2, 1)))
    finally:
        h.shutdown()
        recording.close()
    fmt = FORMATS[fmt_id]
    sizes = [fmt.file_bytes(max(ENTRY))] * 3  # every entry is the largest group's size (lower/handler.py)
    assert reads == [("GETRANGE", name, 0, size) for name, size in zip(names(fmt_id, ks), sizes, strict=True)]


# ---- other things at a value's name -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["one_byte_long", "empty", "list", "hash", "set"])
def test_a_planted_value_fails_every_load_is_deleted_and_never_opens_the_breaker(
        handler: RemoteHandler, client: Any, fmt_id: str, kind: str) -> None:
    ks = keys(3)
    assert succeeds(handler, store((0, 1, 2), ks))
    name = names(fmt_id, ks)[2]
    for _ in range(5):  # more than breaker_errors
        plant(client, name, kind, FORMATS[fmt_id].file_bytes(ENTRY[0]))
        assert not succeeds(handler, load(ks, (3, 4, 5)))
        assert client.exists(name) == 0
    assert handler.faults.counts[Fault.CORRUPT] == 5 and handler.faults.counts[Fault.ERROR] == 0
    assert not handler.breaker.is_open and handler.breaker.errors == 0
    assert succeeds(handler, store((0, 1, 2), ks)) and succeeds(handler, load(ks, (3, 4, 5)))  # stored again, served


def test_a_planted_empty_value_is_told_from_a_missing_one(handler: RemoteHandler, client: Any, fmt_id: str) -> None:
    ks = keys(3)
    assert succeeds(handler, store((0, 1, 2), ks))
    missing, empty, _ = names(fmt_id, ks)
    client.delete(missing)
    plant(client, empty, "empty")
    assert not succeeds(handler, load(ks, (3, 4, 5)))
    assert handler.faults.counts[Fault.CORRUPT] == 1 and client.exists(empty) == 0
    assert not succeeds(handler, load(ks, (3, 4, 5)))  # now only misses: no fault
    assert handler.faults.counts[Fault.CORRUPT] == 1 and sum(handler.faults.counts.values()) == 1
    assert client.exists(missing) == 0 and client.exists(empty) == 0


def test_planted_values_in_a_cluster_are_deleted_and_fail_the_load() -> None:
    with RedisCluster(3) as cluster:
        h = make_handler(cluster.urls[0], "plain", urls=cluster.urls, cluster=True)
        c = redis.RedisCluster.from_url(cluster.urls[0])
        try:
            ks = keys(6)
            assert succeeds(h, store(tuple(range(6)), ks))
            planted = names("plain", ks)[1::2]
            for name, kind in zip(planted, ["huge", "list", "hash"], strict=True):
                plant(c, name, kind)
            assert not succeeds(h, load(ks, tuple(range(6, 12))))
            assert [c.exists(n) for n in planted] == [0, 0, 0]
            assert h.faults.counts[Fault.CORRUPT] == 1 and not h.breaker.is_open
        finally:
            h.shutdown()
            c.close()
