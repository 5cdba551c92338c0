"""A real redis-server for the remote tier's scheduler-side tests (one per session, emptied before each test)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload.testing.redis_server import RedisServer, RedisServerUnavailable


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
