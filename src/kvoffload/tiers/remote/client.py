"""The remote tier's connection and value names, shared by both halves (no torch here).

Both the scheduler's ``RemoteIndex`` (existence look-ups, deletes of its own values) and every worker's
``RemoteHandler`` (the values themselves) connect with ``connect(config)``: redis-py's ``Redis`` for one server,
its ``RedisCluster`` for a cluster; never a protocol client of our own. Values are named
``kvoffload:<world>:r<rank>:<name>``: ``world`` and ``name`` are ``BlockFormat.world_name`` / ``BlockFormat.name``
(the chain root and the key, or keyed by the tier secret), so one server safely holds several models and no
engine ever reads another namespace's values. Every command names one value, so a cluster needs no hash tags.
"""

from __future__ import annotations

import functools
from typing import Any

from kvoffload.config import RemoteTierConfig
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.lower.block_format import BlockFormat

PREFIX = "kvoffload"


def connect(config: RemoteTierConfig, values_in_place: bool = False) -> Any:
    """A redis-py client for ``config`` (lazy: it connects at the first command), with retries off
    (``without_retries``) and a total deadline per command (``tiers.remote.connection``): ``timeout_s``, plus
    ``connect_timeout_s`` for a command that must connect first.

    ``values_in_place``: the client sends large arguments as they are, straight from the caller's buffer, instead of
    copying every command into one buffer first (``in_place_connection``); for the workers, whose ``SET`` values are
    megabytes.

    Raises:
        ImportError: redis-py is not installed (``pip install "kvoffload[redis]"``).
    """
    import redis
    from redis.cluster import ClusterNode, RedisCluster

    from kvoffload.tiers.remote.connection import deadline_connection

    password = None if config.password is None else config.password.value.decode()
    scheme = config.urls[0].partition("://")[0]
    common: dict[str, Any] = {"username": config.username, "password": password,
                              "socket_connect_timeout": config.connect_timeout_s,
                              "socket_timeout": config.timeout_s,
                              "connection_class": deadline_connection(scheme, values_in_place)}
    if config.cluster:
        startup = [ClusterNode(*_node(url)) for url in config.urls]
        # The cluster client passes a connection class on to its nodes' pools only when it is given a URL (its
        # ``url`` argument). TLS then comes from the class itself (an SSLConnection): a rediss:// URL or
        # ssl=True would put redis-py's own class back.
        first = "redis://" + config.urls[0].partition("://")[2]
        return without_retries(RedisCluster(url=first, startup_nodes=startup[1:], **common))
    return without_retries(redis.Redis.from_url(config.urls[0], **common))


@functools.cache
def in_place_connection(scheme: str) -> type:
    """redis-py's connection class for ``scheme``, packing commands with redis-py's Python packer.

    With hiredis installed, redis-py packs every command with hiredis, which copies each argument (a ``SET``'s
    whole value) into one new buffer; the Python packer hands arguments above 6,000 bytes and every
    ``memoryview`` to the socket as they are. The store path's value then goes from its staging buffer to the
    socket with no copy in between (``tiers/remote/stage.py``). Replies are still parsed by hiredis.
    """
    from redis._parsers import Encoder
    from redis.connection import Connection, PythonRespSerializer, SSLConnection, UnixDomainSocketConnection

    base = {"rediss": SSLConnection, "unix": UnixDomainSocketConnection}.get(scheme, Connection)

    class InPlace(base):  # type: ignore[valid-type, misc]
        def __init__(self, **kwargs: Any) -> None:
            encoder = Encoder(kwargs.get("encoding", "utf-8"), kwargs.get("encoding_errors", "strict"),
                              kwargs.get("decode_responses", False))
            kwargs.setdefault("command_packer", PythonRespSerializer(BUFFER_CUTOFF, encoder.encode))
            super().__init__(**kwargs)

    InPlace.__name__ = InPlace.__qualname__ = f"InPlace{base.__name__}"
    return InPlace


BUFFER_CUTOFF = 6000
"""Arguments above this many bytes are sent on their own (redis-py's own cut-off for its Python packer)."""


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
    """The names of ``rank``'s values (default: the namespace's own rank) start with this; a replicated
    namespace's one copy, which every rank reads, has one prefix (``rep``) whatever the rank."""
    if namespace.replicated:
        return f"{world_prefix(namespace, fmt)}rep:"
    r = namespace.rank if rank is None else rank
    return f"{world_prefix(namespace, fmt)}r{r}:"


def value_name(namespace: Namespace, fmt: BlockFormat, key: OffloadKey, rank: int | None = None) -> str:
    """The name of ``key``'s value written by ``rank`` (default: the namespace's own rank)."""
    return rank_prefix(namespace, fmt, rank) + fmt.name(key)
