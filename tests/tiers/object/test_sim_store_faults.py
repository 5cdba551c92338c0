"""No engine step waits on the object tier's store: a simulated engine over a real Ceph RGW behind a
``FaultProxy`` that trickles, freezes, stays silent, black-holes connects or answers every request with a 128 MiB
body (tests/tiers/lower/store_faults.py says what each run checks)."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from tests.tiers.lower.store_faults import (
    COOLDOWN_S,
    TIMEOUT_MS,
    check_the_bound_catches_a_waiting_step,
    run_under,
    serves_again,
)

from kvoffload.testing import sim_workload
from kvoffload.testing.ceph_rgw import CephRGW
from kvoffload.testing.fault_proxy import Fault, FaultProxy
from kvoffload.testing.sim import SimEngine


def object_engine(proxy: FaultProxy, bucket: str) -> SimEngine:
    return sim_workload.make_engine(host_blocks=4, object_url=f"s3://{bucket}/sim",
                                    object_endpoint=f"http://{proxy.url_host}", object_bytes=1 << 24,
                                    object_timeout_ms=TIMEOUT_MS, object_connect_timeout_ms=TIMEOUT_MS,
                                    object_breaker_cooldown_s=COOLDOWN_S)


@pytest.fixture
def rgw_proxy(ceph: CephRGW) -> Iterator[FaultProxy]:
    where = urlsplit(ceph.endpoint)
    with FaultProxy(where.hostname or "127.0.0.1", where.port or 80) as proxy:
        yield proxy


@pytest.mark.parametrize("fault", [Fault.TRICKLE, Fault.FREEZE, Fault.SILENT, Fault.BLACKHOLE, Fault.HUGE_BODY],
                         ids=lambda f: f.name.lower())
def test_no_step_waits_on_a_faulty_object_store_and_every_request_finishes(rgw_proxy: FaultProxy, bucket: str,
                                                                           fault: Fault) -> None:
    engine = object_engine(rgw_proxy, bucket)
    run_under(engine, rgw_proxy, fault)
    serves_again(engine)


def test_control_the_step_bound_catches_a_step_that_waits_on_the_store(rgw_proxy: FaultProxy, bucket: str) -> None:
    check_the_bound_catches_a_waiting_step(object_engine(rgw_proxy, bucket), rgw_proxy)
