"""``kvoffload bench object`` runs end to end against the session's Ceph radosgw and reports every figure (tiny
sizes: this checks, never times)."""

from __future__ import annotations

import json
import os
import statistics
import uuid
from collections.abc import Iterator

import pytest
from tests.tiers.object.conftest import admin_client, empty_bucket

from kvoffload.testing.ceph_rgw import CephRGW
from kvoffload.tools.bench.object import LOOKUP_KEYS, LOOKUP_STORED
from kvoffload.tools.cli import main

pytestmark = pytest.mark.ceph


@pytest.fixture
def bucket(ceph_rgw: CephRGW, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh bucket, and the server's keys where boto3's chain (the bench's client) finds them."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ceph_rgw.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ceph_rgw.secret_key)
    s3 = admin_client(ceph_rgw)
    name = f"kvoffload-bench-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    yield name
    empty_bucket(s3, name, remove=True)


def test_bench_object_json_reports_both_directions_beside_boto3_and_the_lookups(
        ceph_rgw: CephRGW, bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))  # pinned where it runs anyway: the option runs
    assert main(["bench", "object", "--endpoint", ceph_rgw.endpoint, "--bucket", bucket, "--block-sizes", "64K",
                 "--total-mib", "1", "--rounds", "2", "--fanouts", "2", "--json", "--tier-secret",
                 "--client-cpus", cpus]) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["rows"]
    assert row["block_bytes"] == 64 * 1024 and row["blocks"] == 16
    for field in ("store_gbps", "raw_put_gbps", "load_gbps", "raw_get_gbps", "sealed_store_gbps", "sealed_load_gbps"):
        assert row[field] > 0
    assert row["store_ratio"] == pytest.approx(row["store_gbps"] / row["raw_put_gbps"])
    assert row["sealed_load_ratio"] == pytest.approx(row["sealed_load_gbps"] / row["load_gbps"])
    seconds = row["seconds"]
    assert all(len(seconds[side]) == 2 for side in ("store", "load", "put", "get", "sealed_store", "sealed_load"))
    assert row["load_ratio_paired"] == pytest.approx(statistics.median(
        r / h for r, h in zip(seconds["get"], seconds["load"], strict=True)))
    assert all(row["client_cpu_ms"][side] > 0 for side in seconds)  # what the client itself spent per block
    assert report["client_cpus"] == cpus
    assert (row["store_requests_per_block"], row["load_requests_per_block"]) == (1.0, 1.0)
    lookups = report["lookups"]
    assert [(x["fanout"], x["stored"], x["found"]) for x in lookups] == [(2, n, n) for n in LOOKUP_STORED]
    miss, _, whole = lookups
    assert (miss["rounds"], miss["requests"]) == (1, 1) and whole["rounds"] == 2
    assert whole["found"] == LOOKUP_KEYS  # the prompt stored whole was found whole


def test_bench_object_refuses_to_pin_a_server_it_did_not_start(ceph_rgw: CephRGW, bucket: str) -> None:
    with pytest.raises(ValueError, match="--server-cpus"):
        main(["bench", "object", "--endpoint", ceph_rgw.endpoint, "--bucket", bucket, "--server-cpus", "0"])
