"""The object tier's tests share the session's Ceph cluster with radosgw (``ceph_rgw``, tests/conftest.py).

Every test here is marked ``ceph`` (``make test`` runs them; ``make check`` does not start Ceph). ``bucket`` is a
fresh bucket of the test's own, removed afterwards; ``s3`` is an administrator's client of the server (long
timeouts, for planting and checking objects); ``config`` is the tier's configuration for ``bucket``. The tier
itself finds its credentials as it would in production, in boto3's chain: ``credentials`` puts the server's keys
in the environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``) for the test. A test that kills radosgw or
stops the OSD undoes it (``ceph``); one that leaves them down fails, and they are started again for the next.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.config import ObjectTierConfig
from kvoffload.testing.ceph_rgw import CephRGW

boto3 = pytest.importorskip("boto3")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.ceph)


def admin_client(server: CephRGW, read_timeout_s: float = 30.0) -> Any:
    """A client with the server's keys and long timeouts (the first CreateBucket of a cluster takes seconds)."""
    from botocore.config import Config

    config = Config(connect_timeout=5, read_timeout=read_timeout_s, s3={"addressing_style": "path"},
                    retries={"total_max_attempts": 2, "mode": "standard"})
    return boto3.client("s3", endpoint_url=server.endpoint, region_name=server.region, config=config,
                        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key)


def empty_bucket(s3: Any, bucket: str, remove: bool = False) -> None:
    """Delete every object of ``bucket`` (and the bucket when ``remove``); a missing bucket is no error."""
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                s3.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
        if remove:
            s3.delete_bucket(Bucket=bucket)
    except s3.exceptions.NoSuchBucket:
        pass


@pytest.fixture
def ceph(ceph_rgw: CephRGW) -> Iterator[CephRGW]:
    """The session's server; after the test, radosgw and the OSD must be up (a test that stopped them fails)."""
    yield ceph_rgw
    running = ceph_rgw.running()
    if len(running) < 3 or ceph_rgw.osd_stopped:
        ceph_rgw.start_osd()
        ceph_rgw.start_rgw()
        pytest.fail("the test left radosgw or the OSD down: it must start them again")


@pytest.fixture
def s3(ceph: CephRGW) -> Any:
    return admin_client(ceph)


@pytest.fixture
def credentials(ceph: CephRGW, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's keys where boto3's chain finds them first, and nothing of this machine's own AWS set-up."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ceph.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ceph.secret_key)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def bucket(s3: Any, credentials: None) -> Iterator[str]:
    name = f"kvoffload-t-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    yield name
    empty_bucket(s3, name, remove=True)


@pytest.fixture
def config(ceph: CephRGW, bucket: str) -> ObjectTierConfig:
    return ObjectTierConfig(bucket=bucket, endpoint=ceph.endpoint, region=ceph.region)
