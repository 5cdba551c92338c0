"""The remote tier through a FaultProxy in front of a real redis-server that trickles, freezes, stays silent or
black-holes connects: every wait of either half ends by its deadline as a failure value (a miss, False, a failed
job), never an exception or a stall, and the tier serves the right bytes again once the fault is lifted.

Deadlines: a command may take ``connect_timeout_s + timeout_s`` when it must connect first, ``timeout_s`` on an open
connection (``tiers.remote.connection``); a worker's job ``connect_timeout_s + 2 * timeout_s``. ``MARGIN_S`` is what
a busy test machine may add on top (thread wake-ups, the proxy's own polling).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from tests.tiers.remote import indexes
from tests.tiers.remote.handlers import Handler, keys, load, make_config, row, run, store

from kvoffload.config import RemoteTierConfig
from kvoffload.testing.fault_proxy import Fault, FaultProxy
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.lower.block_format import PLAIN
from kvoffload.tiers.lower.breaker import CircuitBreaker
from kvoffload.tiers.remote.client import connect
from kvoffload.tiers.remote.link import RemoteLink
from kvoffload.tiers.remote.probe import RemoteProbe, ValueNames

redis = pytest.importorskip("redis")

TIMEOUT_S = 0.3
CONNECT_S = 0.3
MARGIN_S = 0.3
COOLDOWN_S = 5.0
NEW_CONNECTION_S = CONNECT_S + TIMEOUT_S + MARGIN_S
OPEN_CONNECTION_S = TIMEOUT_S + MARGIN_S
FAULTS = [Fault.TRICKLE, Fault.FREEZE, Fault.SILENT, Fault.BLACKHOLE]
T = TypeVar("T")


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[FaultProxy]:
    """In front of the session's server; a byte every 0.2 s keeps each of the client's reads within its 0.3 s."""
    with FaultProxy("127.0.0.1", server.port, trickle_s=0.2) as p:
        yield p


class SkewClock:
    """Monotonic time that a test can move forward past a breaker's cool-down."""

    def __init__(self) -> None:
        self.skew = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skew


def config_of(proxy: FaultProxy, **changes: Any) -> RemoteTierConfig:
    return make_config(f"redis://{proxy.url_host}", timeout_s=TIMEOUT_S, connect_timeout_s=CONNECT_S,
                       breaker_errors=2, breaker_cooldown_s=COOLDOWN_S, **changes)


def probe_of(proxy: FaultProxy) -> RemoteProbe:
    """The scheduler half's probe, as ``RemoteIndex.create`` makes it."""
    config = config_of(proxy)
    return RemoteProbe(lambda: connect(config), ValueNames(indexes.NS, PLAIN), cluster=False,
                       timeout_s=config.timeout_s, breaker=CircuitBreaker(8, COOLDOWN_S, tier="test"))


def timed(call: Callable[[], T]) -> tuple[T, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


# ---- the scheduler half ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("open_first", [False, True], ids=["new connection", "open connection"])
def test_a_lookup_under_a_fault_is_a_miss_by_its_deadline(proxy: FaultProxy, client: Any, fault: Fault,
                                                          open_first: bool) -> None:
    ks = indexes.keys(4)
    indexes.write(client, ks)
    probe = probe_of(proxy)
    if open_first:
        assert probe.leading_run(ks) == 4  # the control: through the proxy, it answers
    proxy.set(fault)
    run_, took = timed(lambda: probe.leading_run(ks))
    assert run_ is None and probe.breaker.is_open  # a timeout switches lookups off at once
    assert took < (OPEN_CONNECTION_S if open_first else NEW_CONNECTION_S)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_delete_under_a_fault_fails_by_its_deadline(proxy: FaultProxy, client: Any, fault: Fault) -> None:
    ks = indexes.keys(2)
    probe = probe_of(proxy)
    assert probe.check()
    proxy.set(fault)
    deleted, took = timed(lambda: probe.delete(ks))
    assert deleted is False and probe.delete_errors == 2 and took < OPEN_CONNECTION_S


@pytest.mark.parametrize("fault", FAULTS)
def test_the_start_up_checks_under_a_fault_fail_by_their_deadline(proxy: FaultProxy, fault: Fault) -> None:
    proxy.set(fault)
    probe = probe_of(proxy)
    answered, took = timed(probe.check)
    assert answered is False and probe.breaker.is_open and took < NEW_CONNECTION_S
    link = RemoteLink(config_of(proxy))
    started = time.monotonic()
    with pytest.raises(redis.exceptions.RedisError):
        link.probe()
    assert time.monotonic() - started < NEW_CONNECTION_S
    link.close()
    handler, took = timed(lambda: Handler(config_of(proxy)))
    with handler as h:
        assert h.breaker.is_open and took < NEW_CONNECTION_S  # the worker starts, with the tier off for now


def test_the_proxy_passes_the_remote_tier_untouched(proxy: FaultProxy, client: Any) -> None:
    """The control for the tests above: through a proxy that passes, every call succeeds."""
    ks = indexes.keys(3)
    indexes.write(client, ks)
    probe = probe_of(proxy)
    assert probe.check() and probe.leading_run(ks) == 3 and probe.delete(ks)
    assert probe.leading_run(ks) == 0


# ---- the worker half ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", FAULTS)
def test_worker_jobs_under_a_fault_fail_by_their_deadline_and_serve_right_bytes_after_it(
        proxy: FaultProxy, client: Any, fault: Fault) -> None:
    clock = SkewClock()
    config = config_of(proxy)
    budget = config.connect_timeout_s + 2 * config.timeout_s
    with Handler(config, clock=clock) as h:
        ks = keys(2)
        assert run(h, store((0, 1), ks)).success  # the worker's connections are open now
        proxy.set(fault)
        h._slots[4:8] = 0
        jobs = [load(ks, (4, 5)), store((2,), keys(1, salt=1))]
        started = time.monotonic()
        assert all(h.submit(job) for job in jobs)
        assert h.get_finished() == []  # the engine step does not wait for a stalled server
        h.wait([job.job_id for job in jobs])
        took = time.monotonic() - started
        assert sorted((r.job_id, r.success) for r in h.get_finished()) == sorted((j.job_id, False) for j in jobs)
        assert took < budget + MARGIN_S
        # Each lane let go of its socket by the command's deadline, not only wrote its job off: the next job
        # is not queued behind a thread still reading a trickle.
        assert h._lanes[False].wait_idle(MARGIN_S) and h._lanes[True].wait_idle(MARGIN_S)
        assert not h._slots[4:6].any() and h.breaker.is_open
        proxy.set(Fault.PASS)
        assert not run(h, load(ks, (4, 5))).success  # cooling down: no I/O
        clock.skew += COOLDOWN_S + 1
        assert run(h, load(ks, (4, 5))).success and (row(h, 4), row(h, 5)) == (row(h, 0), row(h, 1))
        late = run(h, load(keys(1, salt=1), (7,)))  # the store under the fault may or may not have landed
        assert not late.success or row(h, 7) == row(h, 2)
        assert run(h, store((3,), keys(1, salt=2))).success and run(h, load(keys(1, salt=2), (6,))).success
        assert row(h, 6) == row(h, 3)
