"""No engine step waits on the remote tier's store: a simulated engine over a real redis-server behind a
``FaultProxy`` that trickles, freezes, stays silent or black-holes connects (tests/tiers/lower/store_faults.py says
what each run checks; tests/tiers/object/test_sim_store_faults.py runs the same over a Ceph RGW)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.tiers.lower.store_faults import (
    COOLDOWN_S,
    TIMEOUT_MS,
    check_the_bound_catches_a_waiting_step,
    run_under,
    serves_again,
)

from kvoffload.testing import sim_workload
from kvoffload.testing.fault_proxy import Fault, FaultProxy
from kvoffload.testing.redis_server import RedisServer, RedisServerUnavailable
from kvoffload.testing.sim import SimEngine


def remote_engine(proxy: FaultProxy) -> SimEngine:
    return sim_workload.make_engine(host_blocks=4, remote_url=f"redis://{proxy.url_host}", remote_bytes=1 << 24,
                                    remote_timeout_ms=TIMEOUT_MS, remote_connect_timeout_ms=TIMEOUT_MS,
                                    remote_breaker_cooldown_s=COOLDOWN_S)


@pytest.fixture
def redis_proxy() -> Iterator[FaultProxy]:
    """A redis-server of the test's own (an empty store), behind a proxy."""
    pytest.importorskip("redis")
    try:
        server = RedisServer()
    except RedisServerUnavailable as e:
        pytest.skip(str(e))
    with server, FaultProxy("127.0.0.1", server.port) as proxy:
        yield proxy


@pytest.mark.parametrize("fault", [Fault.TRICKLE, Fault.FREEZE, Fault.SILENT, Fault.BLACKHOLE],
                         ids=lambda f: f.name.lower())
def test_no_step_waits_on_a_faulty_remote_store_and_every_request_finishes(redis_proxy: FaultProxy,
                                                                           fault: Fault) -> None:
    engine = remote_engine(redis_proxy)
    run_under(engine, redis_proxy, fault)
    serves_again(engine)


def test_control_the_step_bound_catches_a_step_that_waits_on_the_store(redis_proxy: FaultProxy) -> None:
    check_the_bound_catches_a_waiting_step(remote_engine(redis_proxy), redis_proxy)
