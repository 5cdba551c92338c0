"""The worker's connection to the remote tier: one redis-py client, made again when making it failed.

``RemoteHandler`` asks ``RemoteLink.client()`` for the client in its lanes. For one server the client is lazy
(``tiers.remote.client.connect`` never touches the network), but a Redis Cluster client asks a start-up node for the
slot map in its constructor, which fails while the cluster is down: then there is no client yet, and the next job
after the breaker's cool-down tries again. The start-up ``probe`` (a ``PING``) tells the handler whether the tier
is up before the first job.

Retries: redis-py 8 retries a failed command 10 times with backoff by default (seconds of sleeping per command
against a dead server, and 11 timeouts against a stalled one). A failed job is cheap here (the engine recomputes,
the store is skipped), a stalled engine step is not, so the client made here (``tiers.remote.client.connect``) never
retries: every command is bounded by ``connect_timeout_s`` + ``timeout_s``. A client passed in by the caller keeps
its own retry policy.
"""

from __future__ import annotations

import threading
from typing import Any

from kvoffload.config import ConfigError, RemoteTierConfig
from kvoffload.tiers.remote.client import connect


class RemoteLink:
    """Holds the client; thread-safe (the two lanes and the probe share it).

    Args:
        config: the remote tier's settings.
        client: a redis-py client to use as it is (tests pass one); None: ``connect(config, values_in_place=True)``.
    Raises:
        ConfigError: redis-py is not installed.
    """

    def __init__(self, config: RemoteTierConfig, client: Any | None = None) -> None:
        try:
            import redis  # noqa: F401  (fail here, at start-up, not in a lane)
        except ImportError:
            raise ConfigError('remote_url needs redis-py: pip install "kvoffload[redis]"') from None
        self._config = config
        self._owned = client is None
        self._client = client
        self._lock = threading.Lock()

    def client(self) -> Any:
        """The client, made now if it is not there yet.

        Raises:
            redis.exceptions.RedisError: making it failed (a cluster that is down); the next call tries again.
        """
        with self._lock:
            if self._client is None:
                self._client = connect(self._config, values_in_place=True)
            return self._client

    def probe(self) -> None:
        """One ``PING``, within the timeouts.

        Raises:
            redis.exceptions.RedisError: the server is absent, refuses us, or is too slow.
        """
        self.client().ping()

    def close(self) -> None:
        """Close the connections of a client made here (a caller's client is the caller's to close)."""
        if not self._owned:
            return
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

