"""The remote tier's connection and value names, shared by both halves (no torch here).

Both the scheduler's ``RemoteTierManager`` (existence look-ups, deletes of its own values) and every worker's
``RemoteHandler`` (the values themselves) connect with ``connect(config)``: redis-py's ``Redis`` for one server,
its ``RedisCluster`` for a cluster; never a protocol client of our own. Values are named
``kvoffload:<world>:r<rank>:<name>``: ``world`` and ``name`` are ``BlockFormat.world_name`` / ``BlockFormat.name``
(the chain root and the key, or keyed by the tier secret), so one server safely holds several models and no
engine ever reads another namespace's values. Every command names one value, so a cluster needs no hash tags.
"""

from __future__ import annotations

from typing import Any

from kvoffload.config import RemoteTierConfig
from kvoffload.disk_format import BlockFormat
from kvoffload.keys import Namespace, OffloadKey

PREFIX = "kvoffload"


def connect(config: RemoteTierConfig) -> Any:
    """A redis-py client for ``config`` (lazy: it connects at the first command, within the timeouts), with
    retries off (``without_retries``).

    Raises:
        ImportError: redis-py is not installed (``pip install "kvoffload[redis]"``).
    """
    import redis
    from redis.cluster import ClusterNode, RedisCluster

    password = None if config.password is None else config.password.value.decode()
    common: dict[str, Any] = {"username": config.username, "password": password,
                              "socket_connect_timeout": config.connect_timeout_s,
                              "socket_timeout": config.timeout_s}
    if config.cluster:
        nodes = [_node(url) for url in config.urls]
        ssl = any(url.startswith("rediss://") for url in config.urls)
        return without_retries(RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in nodes],
                                            ssl=ssl, **common))
    return without_retries(redis.Redis.from_url(config.urls[0], **common))


def without_retries(client: Any) -> Any:
    """``client`` with redis-py's retries off: redis-py 8 retries a failed command 10 times with backoff (seconds
    against a dead server), and every remote command must fail within its timeout instead."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client.set_retry(Retry(NoBackoff(), 0))
    return client


def _node(url: str) -> tuple[str, int]:
    netloc = url.partition("://")[2].split("/", 1)[0]
    host, _, port = netloc.rpartition(":")
    return host or "127.0.0.1", int(port or 6379)


def world_prefix(namespace: Namespace, fmt: BlockFormat) -> str:
    """The names of every rank's values of this world start with this."""
    return f"{PREFIX}:{fmt.world_name(namespace.chain_root())}:"


def rank_prefix(namespace: Namespace, fmt: BlockFormat, rank: int | None = None) -> str:
    """The names of ``rank``'s values (default: the namespace's own rank) start with this."""
    r = namespace.rank if rank is None else rank
    return f"{world_prefix(namespace, fmt)}r{r}:"


def value_name(namespace: Namespace, fmt: BlockFormat, key: OffloadKey, rank: int | None = None) -> str:
    """The name of ``key``'s value written by ``rank`` (default: the namespace's own rank)."""
    return rank_prefix(namespace, fmt, rank) + fmt.name(key)
