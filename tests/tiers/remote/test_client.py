"""remote_client.connect against real servers: the workers' clients send values in place (redis-py's Python
packer), for one server and for every node of a cluster; the scheduler's keep redis-py's defaults."""

from __future__ import annotations

from typing import Any

import pytest

from kvoffload.config import RemoteTierConfig
from kvoffload.testing.redis_server import RedisCluster, RedisServer
from kvoffload.tiers.remote.client import connect, in_place_connection

redis = pytest.importorskip("redis")
from redis.connection import (  # noqa: E402
    Connection,
    HiredisRespSerializer,
    PythonRespSerializer,
    SSLConnection,
    UnixDomainSocketConnection,
)


def packers(client: Any) -> set[type]:
    """The packer types of the connections ``client``'s pools make (every node's, for a cluster)."""
    pools = ([n.redis_connection.connection_pool for n in client.get_nodes()] if hasattr(client, "get_nodes")
             else [client.connection_pool])
    return {type(pool.make_connection()._command_packer) for pool in pools}


def test_each_scheme_gets_its_own_redis_py_connection_class() -> None:
    for scheme, base in (("redis", Connection), ("rediss", SSLConnection), ("unix", UnixDomainSocketConnection)):
        cls = in_place_connection(scheme)
        assert issubclass(cls, base) and cls is in_place_connection(scheme)
    assert not issubclass(in_place_connection("redis"), SSLConnection)


def test_a_worker_client_of_one_server_sends_values_in_place_and_they_arrive_whole(server: RedisServer) -> None:
    config = RemoteTierConfig(urls=(server.url,))
    client = connect(config, values_in_place=True)
    try:
        assert packers(client) == {PythonRespSerializer}
        value = bytes(range(256)) * 64  # above the 6,000-byte cut-off: sent as its own chunk
        client.set("v", memoryview(value))
        assert client.get("v") == value
    finally:
        client.close()
    plain = connect(config)
    try:
        if redis.utils.HIREDIS_AVAILABLE:
            assert packers(plain) == {HiredisRespSerializer}  # the scheduler's client: redis-py's default
    finally:
        plain.close()


def test_a_worker_client_of_a_cluster_sends_values_in_place_through_every_node() -> None:
    with RedisCluster(3) as cluster:
        client = connect(RemoteTierConfig(urls=cluster.urls, cluster=True), values_in_place=True)
        try:
            assert len(client.get_nodes()) == 3 and packers(client) == {PythonRespSerializer}
            for i in range(20):
                client.set(f"k{i}", memoryview(bytes([i]) * 7000))
            assert all(client.get(f"k{i}") == bytes([i]) * 7000 for i in range(20))
        finally:
            client.close()
