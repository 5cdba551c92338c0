"""What went wrong with a remote job, in a few named kinds, each logged once per outage.

``RemoteHandler`` turns every exception that redis-py (or a value check) raises inside a job into a ``Fault``:
the job fails and the engine recomputes or skips the store; ``tiers.lower.fault_log.FaultLog`` logs each kind once
per outage. Messages come from redis-py's
exceptions and our own checks: they name the server, never the password (it is only in the client's connection
arguments).

redis-py is imported lazily: a worker without a remote tier never needs it installed.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

from kvoffload.tiers.lower.block_format import CorruptBlockError, UnauthenticBlockError
from kvoffload.tiers.lower.fault_log import FaultLog, TierFault

logger = logging.getLogger(__name__)
__all__ = ["Fault", "FaultLog", "classify", "delete_quietly", "raise_first_error"]


class Fault(TierFault):
    UNREACHABLE = "server unreachable"
    TIMEOUT = "server too slow (command timeout)"
    FULL = "server out of memory (stores refused)"
    AUTH = "authentication refused"
    TLS = "TLS handshake failed"
    CORRUPT = "damaged value"
    UNAUTHENTIC = "value failed authentication"
    ERROR = "server error"

    @property
    def is_server_fault(self) -> bool:
        """Counts towards the breaker: the server or the way to it is failing (not a bad value, not a full one).

        A bad value is one name's problem, and any writer of the store can plant one (``SCAN`` shows the names):
        counted, a few planted values would switch the tier off for every engine."""
        return self not in (Fault.FULL, Fault.CORRUPT, Fault.UNAUTHENTIC)


def classify(error: BaseException) -> Fault:
    """The kind of a job's failure (anything unexpected is ``ERROR``)."""
    from redis import exceptions as rex

    if isinstance(error, UnauthenticBlockError):
        return Fault.UNAUTHENTIC
    if isinstance(error, CorruptBlockError):
        return Fault.CORRUPT
    if _tls(error):
        return Fault.TLS  # a rediss:// URL against a plain server ends as a handshake timeout: TLS, not slowness
    if isinstance(error, rex.AuthenticationError | rex.AuthenticationWrongNumberOfArgsError | rex.NoPermissionError):
        return Fault.AUTH
    if isinstance(error, rex.OutOfMemoryError) or (isinstance(error, rex.ResponseError)
                                                   and str(error).startswith("OOM")):
        return Fault.FULL
    if isinstance(error, rex.TimeoutError | TimeoutError):
        return Fault.TIMEOUT
    if isinstance(error, rex.ConnectionError | rex.ClusterDownError | rex.RedisClusterException | OSError):
        return Fault.UNREACHABLE
    return Fault.ERROR


def _tls(error: BaseException) -> bool:
    seen: BaseException | None = error
    for _ in range(8):  # the chain of causes; bounded, since a cycle is possible
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError) or "handshake operation" in str(seen):  # the ssl module's timeout
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def raise_first_error(replies: list[Any]) -> None:
    """A pipeline run with ``raise_on_error=False`` answers a failed command with its exception: raise it."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


def delete_quietly(client: Any, name: str) -> None:
    """Delete value ``name``; a failure is only logged at debug level."""
    try:
        client.delete(name)
    except Exception as e:  # the job fails anyway; a server fault shows on the next job
        logger.debug("remote tier: could not delete a damaged value: %s", e)
