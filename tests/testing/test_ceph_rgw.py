"""kvoffload.testing.ceph_rgw: a real S3 server (Ceph radosgw on loopback) that answers, keeps its data, and fails
the ways the object-store tier must survive: radosgw gone (refused at once), an OSD gone (requests hang until the
client's timeout)."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from kvoffload.testing import ceph_rgw as ceph_rgw_module
from kvoffload.testing.ceph_rgw import CephRGW, CephStartError, CephUnavailable

MIB = 1 << 20
FAULT_READ_TIMEOUT_S = 2.0
MARGIN_S = 3.0  # scheduling on a busy 2-core machine; a hang that the timeout does not end is far longer


def put_mib(s3: Any, bucket: str) -> bytes:
    """1 MiB of random bytes stored at key ``k``: what each fault test reads back after the server recovers."""
    data = os.urandom(MIB)
    s3.put_object(Bucket=bucket, Key="k", Body=data)
    return data


def s3_client(server: CephRGW, read_timeout_s: float = 10.0, attempts: int = 2) -> Any:
    """A boto3 client of ``server`` with bounded waits: ``attempts`` in all (the default retries once)."""
    config = Config(connect_timeout=2, read_timeout=read_timeout_s, s3={"addressing_style": "path"},
                    retries={"total_max_attempts": attempts, "mode": "standard"})
    return boto3.client("s3", endpoint_url=server.endpoint, region_name=server.region, config=config,
                        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key)


@pytest.fixture
def server(ceph_rgw: CephRGW) -> Iterator[CephRGW]:
    """The session's cluster, whole again after the test whatever fault it left (cheap when none)."""
    yield ceph_rgw
    ceph_rgw.start_osd()
    ceph_rgw.start_rgw()


@pytest.fixture
def s3(server: CephRGW) -> Any:
    return s3_client(server)


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"test-{uuid.uuid4().hex[:16]}"
    s3.create_bucket(Bucket=name)
    return name


def error_code(error: ClientError) -> tuple[str, int]:
    return error.response["Error"]["Code"], error.response["ResponseMetadata"]["HTTPStatusCode"]


@pytest.mark.ceph
def test_put_get_range_head_list_delete(s3: Any, bucket: str) -> None:
    data = os.urandom(MIB)
    put = s3.put_object(Bucket=bucket, Key="dir/one", Body=data)
    assert put["ETag"].strip('"') == hashlib.md5(data).hexdigest()  # what the server stored is what was sent
    assert s3.get_object(Bucket=bucket, Key="dir/one")["Body"].read() == data

    part = s3.get_object(Bucket=bucket, Key="dir/one", Range="bytes=1000-4999")
    assert part["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert part["ContentRange"] == f"bytes 1000-4999/{MIB}"
    assert part["Body"].read() == data[1000:5000]

    head = s3.head_object(Bucket=bucket, Key="dir/one")
    assert (head["ContentLength"], head["ETag"]) == (MIB, put["ETag"])

    s3.put_object(Bucket=bucket, Key="dir/two", Body=b"2")
    s3.put_object(Bucket=bucket, Key="other", Body=b"")
    listed = s3.list_objects_v2(Bucket=bucket)["Contents"]
    assert [(o["Key"], o["Size"]) for o in listed] == [("dir/one", MIB), ("dir/two", 1), ("other", 0)]
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="dir/")["Contents"]] == ["dir/one", "dir/two"]

    s3.delete_object(Bucket=bucket, Key="dir/one")
    with pytest.raises(ClientError) as gone:
        s3.head_object(Bucket=bucket, Key="dir/one")
    assert error_code(gone.value)[1] == 404
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]] == ["dir/two", "other"]
    s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "dir/two"}, {"Key": "other"}]})
    s3.delete_bucket(Bucket=bucket)
    with pytest.raises(ClientError) as no_bucket:
        s3.head_bucket(Bucket=bucket)
    assert error_code(no_bucket.value)[1] == 404


@pytest.mark.ceph
def test_a_key_never_written_is_no_such_key(s3: Any, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="written", Body=b"x")
    with pytest.raises(s3.exceptions.NoSuchKey) as missing:
        s3.get_object(Bucket=bucket, Key="never-written")
    assert error_code(missing.value) == ("NoSuchKey", 404)
    s3.put_object(Bucket=bucket, Key="written", Body=b"second")  # an overwrite is read back, never the old bytes
    assert s3.get_object(Bucket=bucket, Key="written")["Body"].read() == b"second"


@pytest.mark.ceph
def test_data_survives_an_rgw_kill_and_restart(server: CephRGW, s3: Any, bucket: str) -> None:
    data = put_mib(s3, bucket)
    server.kill_rgw()
    assert "client.rgw.a" not in server.running()
    once = s3_client(server, attempts=1)  # made before the clock starts: only the request is timed
    start = time.monotonic()
    with pytest.raises(EndpointConnectionError):
        once.get_object(Bucket=bucket, Key="k")
    assert time.monotonic() - start < 1.0  # refused at once, no timeout involved

    server.start_rgw()
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == data


@pytest.mark.ceph
def test_a_frozen_osd_makes_a_get_hang_until_the_read_timeout(server: CephRGW, s3: Any, bucket: str) -> None:
    data = put_mib(s3, bucket)
    impatient = s3_client(server, read_timeout_s=FAULT_READ_TIMEOUT_S, attempts=1)
    server.stop_osd()
    start = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        impatient.get_object(Bucket=bucket, Key="k")["Body"].read()
    waited = time.monotonic() - start
    assert FAULT_READ_TIMEOUT_S <= waited < FAULT_READ_TIMEOUT_S + MARGIN_S  # radosgw sends nothing, no 5xx

    server.start_osd()
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == data


@pytest.mark.ceph
def test_data_survives_an_osd_stop_and_start(server: CephRGW, s3: Any, bucket: str) -> None:
    data = put_mib(s3, bucket)
    osd_pid = server.running()["osd.0"]
    server.stop_osd(hard=True)
    assert "osd.0" not in server.running()
    server.start_osd()
    assert server.running()["osd.0"] != osd_pid
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == data


# ---- without a cluster -------------------------------------------------------------------------------------------


def test_missing_binaries_say_how_to_install_them(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ceph_rgw_module.shutil, "which", lambda name: None if name == "radosgw" else f"/x/{name}")
    with pytest.raises(CephUnavailable, match=r"radosgw not installed: run `make setup-ceph`"):
        CephRGW(tmp_path)


def test_a_used_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ceph.conf").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        CephRGW(tmp_path)


def test_the_session_cluster_is_started_afresh_once_when_a_try_fails(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    import tests.conftest as session

    tries: list[list[Path]] = []

    def flaky(directory: Path) -> object:
        tries.append(list(directory.iterdir()))  # what the try found there
        (directory / "left-by-the-try").touch()
        if len(tries) < 4:
            raise CephStartError("mon.a exited with 1 while starting")
        return "started"

    monkeypatch.setattr(session, "CephRGW", flaky)
    with pytest.raises(CephStartError):  # two tries, both failed: the second's error
        session._start_ceph(tmp_path)
    assert len(tries) == 2
    assert session._start_ceph(tmp_path) == "started"  # its first try fails, its second starts
    assert len(tries) == 4
    assert tries[1] == tries[3] == []  # each second try started in an emptied directory
