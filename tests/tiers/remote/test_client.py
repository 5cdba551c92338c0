"""remote_client.connect against real servers: the workers' clients send values in place (redis-py's Python
packer), for one server and for every node of a cluster; the scheduler's keep redis-py's defaults. Every client's
connections carry a deadline per command (``tiers.remote.connection``), whose resolver is bounded too."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from kvoffload.config import RemoteTierConfig
from kvoffload.testing.redis_server import RedisCluster, RedisServer
from kvoffload.tiers.remote import connection as deadlines
from kvoffload.tiers.remote.client import connect, in_place_connection

redis = pytest.importorskip("redis")
from redis.connection import (  # noqa: E402
    Connection,
    HiredisRespSerializer,
    PythonRespSerializer,
    SSLConnection,
    UnixDomainSocketConnection,
)


def connections(client: Any) -> list[Any]:
    """A new connection of each of ``client``'s pools (every node's, for a cluster)."""
    pools = ([n.redis_connection.connection_pool for n in client.get_nodes()] if hasattr(client, "get_nodes")
             else [client.connection_pool])
    return [pool.make_connection() for pool in pools]


def packers(client: Any) -> set[type]:
    """The packer types of the connections ``client``'s pools make."""
    return {type(c._command_packer) for c in connections(client)}


def with_deadlines(client: Any) -> bool:
    return all(isinstance(c, deadlines._Deadline) for c in connections(client))


def test_each_scheme_gets_its_own_redis_py_connection_class() -> None:
    for scheme, base in (("redis", Connection), ("rediss", SSLConnection), ("unix", UnixDomainSocketConnection)):
        cls = in_place_connection(scheme)
        assert issubclass(cls, base) and cls is in_place_connection(scheme)
    assert not issubclass(in_place_connection("redis"), SSLConnection)


def test_a_worker_client_of_one_server_sends_values_in_place_and_they_arrive_whole(server: RedisServer) -> None:
    config = RemoteTierConfig(urls=(server.url,))
    client = connect(config, values_in_place=True)
    try:
        assert packers(client) == {PythonRespSerializer} and with_deadlines(client)
        value = bytes(range(256)) * 64  # above the 6,000-byte cut-off: sent as its own chunk
        client.set("v", memoryview(value))
        assert client.get("v") == value
    finally:
        client.close()
    plain = connect(config)
    try:
        if redis.utils.HIREDIS_AVAILABLE:
            assert packers(plain) == {HiredisRespSerializer}  # the scheduler's client: redis-py's default
        assert with_deadlines(plain)
    finally:
        plain.close()


def test_a_worker_client_of_a_cluster_sends_values_in_place_through_every_node() -> None:
    with RedisCluster(3) as cluster:
        client = connect(RemoteTierConfig(urls=cluster.urls, cluster=True), values_in_place=True)
        try:
            assert len(client.get_nodes()) == 3 and packers(client) == {PythonRespSerializer}
            assert with_deadlines(client)
            for i in range(20):
                client.set(f"k{i}", memoryview(bytes([i]) * 7000))
            assert all(client.get(f"k{i}") == bytes([i]) * 7000 for i in range(20))
        finally:
            client.close()


def test_each_scheme_gets_a_connection_class_with_a_deadline() -> None:
    for scheme, base in (("redis", Connection), ("rediss", SSLConnection), ("unix", UnixDomainSocketConnection)):
        for in_place in (False, True):
            cls = deadlines.deadline_connection(scheme, in_place)
            assert issubclass(cls, base) and issubclass(cls, deadlines._Deadline) and cls.in_place is in_place
    assert issubclass(deadlines.deadline_connection("rediss"), deadlines._BoundedTcp)  # its TCP connect is ours


def test_a_resolver_that_does_not_answer_fails_at_the_connect_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    def stalled(*args: Any, **kwargs: Any) -> Any:
        time.sleep(5)  # a DNS server that does not answer
        raise socket.gaierror("never")

    monkeypatch.setattr(socket, "getaddrinfo", stalled)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        deadlines.resolve("kv-cache.internal", 6379, 0, started + 0.2)
    assert time.monotonic() - started < 1.0


def test_a_host_name_is_resolved_and_served(server: RedisServer) -> None:
    client = connect(RemoteTierConfig(urls=(f"redis://localhost:{server.port}",)))
    try:
        assert client.ping()
    finally:
        client.close()
