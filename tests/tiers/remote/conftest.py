"""The remote tier's tests share the session's redis-server (``redis_server``, tests/conftest.py).

``server`` is that server, empty when the test starts; ``client`` is a plain client of it, which empties it before
the test and after it (planted values can be 64 MiB each). A test that kills, restarts or stalls its server takes
``own_server``; one that needs other settings (a password, no eviction, the DEBUG command) starts a
``RedisServer`` with them. A test that kills the shared server anyway fails, and the server is started again for
the tests after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload.testing.redis_server import RedisServer, RedisServerUnavailable


@pytest.fixture
def client(redis_server: RedisServer, redis_client: Any) -> Iterator[Any]:
    yield redis_client
    if redis_server.process is None or redis_server.process.poll() is not None:
        redis_server.restart()
        pytest.fail("the test killed the session's redis-server: a test that kills its server takes own_server")
    redis_client.flushall()


@pytest.fixture
def server(redis_server: RedisServer, client: Any) -> RedisServer:
    return redis_server


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A server of the test's own, to kill, restart or stop."""
    pytest.importorskip("redis")
    try:
        started = RedisServer()
    except RedisServerUnavailable as e:
        pytest.skip(str(e))
    with started:
        yield started
