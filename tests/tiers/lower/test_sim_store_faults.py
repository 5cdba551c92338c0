"""No engine step waits on a shared store: a simulated engine over the remote tier (a real redis-server) or the object
tier (a real Ceph RGW), each behind a ``FaultProxy`` that trickles, freezes, stays silent or black-holes connects.

Each run stores a prompt, pushes it out of the host, switches the fault on, and sends requests that need the store
(a hit on the stored prompt, a new prompt) among requests that do not. Every request must finish with the right
bytes (``SimEngine.check_all`` after each step), and no step may take longer than ``STEP_BOUND_S``, a quarter of
the tier's request timeout (``TIMEOUT_MS``): before lookups and deletes left the step, a lookup alone held a step
for the whole timeout (the control below shows that bound catching a step that waits). After the fault the store
serves again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload.testing import sim_workload
from kvoffload.testing.fault_proxy import Fault, FaultProxy
from kvoffload.testing.redis_server import RedisServer, RedisServerUnavailable
from kvoffload.testing.sim import SimEngine, Status
from kvoffload.testing.sim_workload import pushed_out, run_timed, tokens

TIMEOUT_MS = 800
"""The tier's connect and request timeouts here."""
STEP_BOUND_S = TIMEOUT_MS / 1000 / 4
"""The longest step allowed under any fault: well under one timeout."""
COOLDOWN_S = 1.0
"""The breaker's cool-down, after which the store is asked again."""
FAULTS = [Fault.TRICKLE, Fault.FREEZE, Fault.SILENT, Fault.BLACKHOLE]


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


def serves_again(engine: SimEngine) -> None:
    """After the fault and the breaker's cool-down, a prompt stored anew comes back from the store."""
    time.sleep(COOLDOWN_S)  # the engine's tiers run on the real clock
    prompt = pushed_out(engine, 2)
    again = engine.add_request("again", [*prompt, 8])
    run_timed(engine)
    assert again.status is Status.FINISHED and again.loaded_tokens == 16 and engine.corrupt_blocks == []


def run_under(engine: SimEngine, proxy: FaultProxy, fault: Fault) -> None:
    prompt = pushed_out(engine, 1)
    proxy.set(fault)
    hit = engine.add_request("hit", [*prompt, 7])
    new = engine.add_request("new", tokens(16, seed=50))
    local = engine.add_request("local", tokens(16, seed=1012))  # the last filler's prefix: the host has it
    times = run_timed(engine)
    assert {r.status for r in (hit, new, local)} == {Status.FINISHED}
    assert engine.corrupt_blocks == []
    assert max(times) < STEP_BOUND_S, f"a step took {max(times):.3f} s under {fault.name}"
    proxy.set(Fault.PASS)


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name.lower())
def test_no_step_waits_on_a_faulty_remote_store_and_every_request_finishes(redis_proxy: FaultProxy,
                                                                           fault: Fault) -> None:
    engine = remote_engine(redis_proxy)
    run_under(engine, redis_proxy, fault)
    serves_again(engine)


def test_control_the_step_bound_catches_a_step_that_waits_on_the_store(redis_proxy: FaultProxy) -> None:
    """The control: an index that waits for its search's answer on the step (as lookups did before) is caught."""
    engine = remote_engine(redis_proxy)
    prompt = pushed_out(engine, 1)
    index = engine.scheduler.index.lower_indexes[0]
    lookup = index.lookup

    def waiting_lookup(keys: Any) -> Any:
        result = lookup(keys)
        if result.pending:
            index.wait_answers(10.0)
            result = lookup(keys)
        return result

    index.lookup = waiting_lookup
    redis_proxy.set(Fault.FREEZE)
    engine.add_request("hit", [*prompt, 7])
    engine.add_request("new", tokens(16, seed=50))  # not remembered: its lookup searches the store
    with pytest.raises(AssertionError, match="a step took"):
        times = run_timed(engine)
        assert max(times) < STEP_BOUND_S, f"a step took {max(times):.3f} s under FREEZE"
    redis_proxy.set(Fault.PASS)
