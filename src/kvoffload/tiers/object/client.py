"""The object tier's connection and object names, shared by both halves (no torch here).

Both the scheduler's ``ObjectIndex`` (existence searches, deletes of its own objects) and every worker's
``ObjectHandler`` (the objects themselves) make their client with ``connect(config)``: boto3's low-level S3 client,
which is thread-safe, so one client serves every request thread of a process. Why boto3: it is the reference
client of the API (every S3-compatible server is tested against it), it takes credentials from the standard chain
(environment, shared files, SSO, instance and pod roles) and refreshes expiring ones, and on this machine it runs
1 MiB and 4 MiB objects at the server's speed from a thread pool (docs/object.md has the figures). Its retries are
off: a failed request is a failed job (a recompute, or a skipped store), never seconds of backoff on a step.

Objects are named ``<prefix>/kvoffload/<world>/r<rank>/<name>``: ``world`` and ``name`` are
``BlockFormat.world_name`` / ``BlockFormat.name`` (the chain root and the key, or keyed by the tier secret, so that
nobody without the secret can tell which prompt an object belongs to), and a replicated namespace's one copy is
under ``rep`` instead of ``r<rank>``. One bucket safely holds several models and deployments.

Deadlines: botocore's ``read_timeout`` bounds each socket read, so a server that trickles its answer (or a slow
resolver) held a request for as long as it liked. Every request here runs ``within`` a wall-clock deadline
(``tiers.lower.deadline``): ``request_s(config)`` (``connect_timeout_s + timeout_s``: resolver, connect, request,
headers and body together), plus its bytes at a minimum rate for a block's load or store, or what is left of a
prefix search. ``connect`` gives the client connection classes that tell the process's watchdog their socket when
they connect and when they send; at the deadline the watchdog shuts the socket down, the blocked read fails at once
(``within`` raises ``TimeoutError``) and the thread is free. They are set through botocore's private
``client._endpoint.http_session._pool_classes_by_scheme`` (botocore 1.3x-1.4x): where it is absent, a warning says
so once and the callers' own waits (each request runs on a pool thread; the caller waits until the deadline at
most) still bound every caller, but not the thread. The caller's wait is also what bounds a resolver, which no
socket can interrupt.

Every body is read no further than the request asked for (``exists``: its byte, plus one that shows a server
ignoring the range, whose connection is then dropped, never returned to the pool).

Start-up (``check_store``, both halves): a GET of a random name under this tier's prefix must answer "no such
key". A server that says it exists (an HTTP server answering 200 to everything) is not an S3 store: it would make
every prompt a full hit and every promotion a failure, so the tier is refused for the engine's life.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import uuid
from dataclasses import replace
from typing import Any

from kvoffload.config import ConfigError, ObjectTierConfig
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.tiers.lower.deadline import WATCHDOG
from kvoffload.tiers.object.faults import error_code, is_missing

logger = logging.getLogger(__name__)

PREFIX = "kvoffload"
NAME_CACHE = 1 << 15
"""Keys whose object names are remembered: a secret's keyed names cost about 8 us per key to compute."""


def require_boto3() -> None:
    """Refuse at start-up, by name, what would otherwise fail in the first request."""
    if importlib.util.find_spec("boto3") is None:
        raise ConfigError('object_url needs boto3: pip install "kvoffload[s3]"')


def connect(config: ObjectTierConfig, pool_size: int | None = None) -> Any:
    """A boto3 S3 client for ``config``: retries off, the configured timeouts, ``pool_size`` connections (default:
    ``io_threads``). It makes no request; credentials are looked up by boto3's chain when the first one is signed.

    Raises:
        ConfigError: boto3 is not installed.
    """
    require_boto3()
    import boto3
    from botocore.config import Config

    path_style = config.path_style if config.path_style is not None else config.endpoint is not None
    settings = Config(
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.timeout_s,
        retries={"total_max_attempts": 1, "mode": "standard"},
        max_pool_connections=pool_size or config.io_threads,
        s3={"addressing_style": "path" if path_style else "virtual"},
        # Checksums only where the API requires them (DeleteObjects): every object carries its own CRC or tag.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    session = boto3.session.Session()
    region = config.region or session.region_name or "us-east-1"
    client = session.client("s3", endpoint_url=config.endpoint, region_name=region, config=settings)
    watch_deadlines(client)
    return client


def request_s(config: ObjectTierConfig) -> float:
    """The most one request may take, connection (resolver, connect) and whole answer included."""
    return config.connect_timeout_s + config.timeout_s


def where_of(config: ObjectTierConfig) -> str:
    """The store as logs name it (an endpoint never carries credentials)."""
    return f"{config.endpoint or 'AWS S3'} bucket {config.bucket}"


def base_prefix(config: ObjectTierConfig) -> str:
    """Every name of this tier starts with this (``<prefix>/kvoffload``)."""
    return f"{config.prefix}/{PREFIX}" if config.prefix else PREFIX


def rank_prefix(config: ObjectTierConfig, namespace: Namespace, fmt: BlockFormat) -> str:
    """The names of this rank's objects start with this (a replicated namespace's one copy: ``rep``)."""
    rank = "rep" if namespace.replicated else f"r{namespace.rank}"
    return f"{base_prefix(config)}/{fmt.world_name(namespace.chain_root())}/{rank}/"


class NotAnObjectStore(Exception):
    """The endpoint said that an object nobody wrote exists: it is not the S3 store it claims to be."""


def exists(client: Any, bucket: str, name: str, at: float) -> bool:
    """Whether object ``name`` exists, by a GET of its first byte that ends by ``at`` (monotonic seconds).

    Not a ``HEAD``: a HEAD's error has no body, so a missing bucket answers the same 404 as a missing object and a
    deleted bucket would look empty (a miss) instead of a fault. A one-byte GET costs a GET (priced as a HEAD on
    AWS), and its error names ``NoSuchKey`` or ``NoSuchBucket``. An empty object (416) exists: the worker's load
    finds it damaged and deletes it. A server that ignores the range and sends more has answered "exists" too: one
    byte past the one asked for is read, no more, and the connection is dropped.

    Raises:
        TimeoutError: no whole answer by ``at``.
        Exception: the request failed otherwise (boto3's error).
    """
    try:
        with WATCHDOG.within(at, f"an existence check of {name}"):
            body = client.get_object(Bucket=bucket, Key=name, Range="bytes=0-0")["Body"]
            try:
                body.read(2)
            finally:
                body.close()  # after a whole answer, its connection is back in the pool; else it is dropped
    except Exception as e:
        if is_missing(e):
            return False
        if error_code(e) == "InvalidRange":
            return True
        raise
    return True


def check_store(client: Any, bucket: str, base: str, where: str, at: float) -> None:
    """The start-up check of both halves: a random name under ``base`` (``ObjectNames.base``) must be missing, by
    ``at``. ``where`` names the store in the error (``where_of(config)``).

    Raises:
        NotAnObjectStore: the store says it exists.
        Exception: the request failed (a store down, slow, refusing us, without the bucket: ``faults.classify``).
    """
    name = f"{base}/.probe-{uuid.uuid4()}"
    if exists(client, bucket, name, at):
        raise NotAnObjectStore(f"object tier: {where} is not an S3 object store: it answered that {name}, an "
                               f"object nobody wrote, exists (an S3 store answers NoSuchKey); the object tier is off "
                               f"for this engine's life: check object_endpoint and object_url")


def watch_deadlines(client: Any) -> bool:
    """Give ``client`` connections that tell ``WATCHDOG`` their socket; False (a warning, once) where this botocore
    has no place for them: then a request past its deadline is abandoned by its caller, not cut off."""
    try:
        classes = client._endpoint.http_session._pool_classes_by_scheme
        pools = _watched_pools()
        if not isinstance(classes, dict) or set(classes) != set(pools):
            raise AttributeError(f"_pool_classes_by_scheme is {classes!r}")
    except (AttributeError, ImportError) as e:
        _warn_unwatched(e)
        return False
    classes.update(pools)  # the dict the client's pool managers share: their pools are made on first use
    return True


@functools.cache
def _warn_unwatched(error: BaseException) -> None:
    logger.warning("object tier: this botocore's connections cannot be watched (%s): a request past its deadline "
                   "fails, but its thread waits until the server or the read timeout ends it", error)


@functools.cache
def _watched_pools() -> dict[str, type]:
    """botocore's connection pools, whose connections tell the watchdog their socket on connecting and sending."""
    from botocore import awsrequest

    for base in (awsrequest.AWSHTTPConnection, awsrequest.AWSHTTPSConnection):
        if not callable(getattr(base, "_new_conn", None)):
            raise AttributeError(f"{base.__name__} has no _new_conn")

    class Watched:
        sock: Any

        def _new_conn(self) -> Any:
            sock = super()._new_conn()  # type: ignore[misc]
            WATCHDOG.watch(self, sock)
            return sock

        def request(self, *args: Any, **kwargs: Any) -> Any:
            WATCHDOG.watch(self, self.sock)  # a connection from the pool: its socket for this request
            return super().request(*args, **kwargs)  # type: ignore[misc]

    class HTTPConnection(Watched, awsrequest.AWSHTTPConnection):
        pass

    class HTTPSConnection(Watched, awsrequest.AWSHTTPSConnection):
        pass

    class HTTPPool(awsrequest.AWSHTTPConnectionPool):
        ConnectionCls = HTTPConnection

    class HTTPSPool(awsrequest.AWSHTTPSConnectionPool):
        ConnectionCls = HTTPSConnection

    return {"http": HTTPPool, "https": HTTPSPool}


class ObjectNames:
    """Every rank's object name of a key (one name for a replicated namespace), remembered for recent keys."""

    def __init__(self, config: ObjectTierConfig, namespace: Namespace, fmt: BlockFormat) -> None:
        self.base = base_prefix(config)
        """Every name of this tier starts with this."""
        self._prefixes = tuple(rank_prefix(config, replace(namespace, rank=r), fmt) for r in namespace.copy_ranks)
        self._fmt = fmt
        self._names: dict[OffloadKey, str] = {}

    @property
    def copies(self) -> int:
        """Objects per key: one per rank, or one for a replicated namespace."""
        return len(self._prefixes)

    def of(self, key: OffloadKey) -> list[str]:
        """The names of ``key``'s objects, one per rank."""
        names = self._names
        name = names.get(key)
        if name is None:
            if len(names) >= NAME_CACHE:
                del names[next(iter(names))]  # the oldest: a prompt's keys are asked together
            name = names[key] = self._fmt.name(key)
        return [prefix + name for prefix in self._prefixes]
