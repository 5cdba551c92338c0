"""A total wall-clock deadline for every remote command: redis-py connections that a watchdog cuts off at it.

Both halves' clients (``tiers.remote.client.connect``) use these connection classes, so no engine step and no
worker lane waits on the store longer than its timeouts, whatever the server or the network does.

Why redis-py's own timeouts are not enough: ``socket_timeout`` bounds each socket *read*, not a command. A server or
a network that sends a reply a byte at a time, each byte within the timeout, holds a command for as many timeouts as
the reply has bytes: through ``testing.FaultProxy``'s TRICKLE (a byte every 0.2 s, timeouts of 0.3 s) a scheduler
lookup on a new connection took 63 s (the handshake's replies trickle too) instead of failing at 0.6 s. The connect
is no better bounded: redis-py resolves the host with ``getaddrinfo``, which no timeout bounds (a stalled DNS server
holds it for seconds), tries every address it gets for ``socket_connect_timeout`` each, and retries a failed connect
by the connection's own retry policy (which ``without_retries`` on a client does not always reach: a cluster's
nodes make their own connections).

How (``deadline_connection(scheme, in_place)``: redis-py's connection class for the URL's scheme, plus):

- A deadline per command. redis-py calls ``connect()`` on every checkout from a pool, connected or not; that arms
  it: ``socket_timeout`` from then, plus ``socket_connect_timeout`` when the connection must connect first (the
  TCP connect, TLS and the handshake included). A pipeline is one command. A caller may shorten every deadline
  it arms on this thread (``within``: a lookup's rounds share one, a worker's job its budget).
- The process's one alarm thread (``tiers.lower.deadline.ALARMS``, which the object tier's deadlines use too):
  when a deadline passes while its connection is inside a socket call
  (connecting, sending, reading), it shuts that socket down (``shutdown(SHUT_RDWR)``, which on Linux also aborts a
  connect still in SYN-SENT). The blocked call returns at once and the connection raises redis-py's
  ``TimeoutError``; redis-py drops the connection, so no later command reads the rest of a cut reply. A connection
  between calls (idle in its pool) is never touched, and a call begun after its deadline fails at once.
- The host resolved on a helper thread, within the connect's time (an IP address needs no resolver); every address
  it gives shares one ``socket_connect_timeout``.
- No retries of its own.

Cost: a lock, a heap push and two counter updates per command (about 2 us).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from redis import exceptions as rex
from redis._parsers import Encoder
from redis.backoff import NoBackoff
from redis.connection import Connection, PythonRespSerializer, SSLConnection, UnixDomainSocketConnection
from redis.retry import Retry

from kvoffload.tiers.lower.deadline import ALARMS

BUFFER_CUTOFF = 6000
"""Arguments above this many bytes are sent on their own (redis-py's own cut-off for its Python packer)."""

_WITHIN: ContextVar[float] = ContextVar("kvoffload_remote_within", default=math.inf)


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Every command this thread starts in the block ends ``seconds`` from now at the latest."""
    token = _WITHIN.set(min(_WITHIN.get(), time.monotonic() + seconds))
    try:
        yield
    finally:
        _WITHIN.reset(token)


class _Deadline:
    """The deadline half of a connection class (mixed in before redis-py's class; see the module docstring)."""

    in_place = False
    """Pack commands with redis-py's Python packer (``tiers.remote.client.in_place_connection`` says why)."""
    socket_timeout: float | None
    socket_connect_timeout: float | None
    _sock: socket.socket | None

    def __init__(self, **kwargs: Any) -> None:
        self._guard = threading.Lock()
        """Held while the alarm cuts a socket and while the owner closes one, so a closed one is never cut."""
        self._deadline = math.inf
        self._budget = 0.0
        self._calls = 0
        self._cut = False
        self._connecting: socket.socket | None = None
        kwargs["retry"] = Retry(NoBackoff(), 0)
        if self.in_place:
            encoder = Encoder(kwargs.get("encoding", "utf-8"), kwargs.get("encoding_errors", "strict"),
                              kwargs.get("decode_responses", False))
            kwargs.setdefault("command_packer", PythonRespSerializer(BUFFER_CUTOFF, encoder.encode))
        super().__init__(**kwargs)

    def connect(self) -> None:
        """Arms the command's deadline (redis-py calls this on every checkout), then connects if need be."""
        connecting = (self.socket_connect_timeout or 0.0) if self._sock is None else 0.0
        budget = (self.socket_timeout or math.inf) + connecting
        now = time.monotonic()
        with self._guard:
            self._deadline, self._cut = min(now + budget, _WITHIN.get()), False
            self._budget = self._deadline - now
        if self._deadline < math.inf:
            ALARMS.at(self._deadline, self._cut_if_due)
        self._bounded(super().connect)  # type: ignore[misc]

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        try:
            self._bounded(super().connect_check_health, *args, **kwargs)  # type: ignore[misc]
        finally:
            with self._guard:
                self._connecting = None

    def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
        self._bounded(super().send_packed_command, *args, **kwargs)  # type: ignore[misc]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        return self._bounded(super().read_response, *args, **kwargs)  # type: ignore[misc]

    def disconnect(self, *args: Any, **kwargs: Any) -> None:
        with self._guard:
            super().disconnect(*args, **kwargs)  # type: ignore[misc]

    def _bounded(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call`` inside the command's deadline: refused after it, cut at it (both a ``TimeoutError``)."""
        with self._guard:
            late = time.monotonic() >= self._deadline
            self._calls += not late
        if late:
            self.disconnect()
            raise rex.TimeoutError(self._late())
        try:
            return call(*args, **kwargs)
        except Exception as e:
            if self._cut:
                self.disconnect()
                raise rex.TimeoutError(self._late()) from e
            raise
        finally:
            with self._guard:
                self._calls -= 1

    def _cut_if_due(self) -> None:
        """On the alarm thread: shut the socket down if a call still runs past the deadline."""
        with self._guard:
            sock = self._sock or self._connecting
            if self._calls == 0 or time.monotonic() < self._deadline or sock is None:
                return  # between calls, or re-armed for a later command (whose own entry is due later)
            self._cut = True
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # not SSLSocket's: it drops its SSL object

    def _late(self) -> str:
        where = getattr(self, "path", None) or f"{getattr(self, 'host', '?')}:{getattr(self, 'port', '?')}"
        return f"Timeout: {where} did not answer within the command's {self._budget:.3f} s deadline"


class _BoundedTcp(Connection):
    """redis-py's TCP connect with the host resolved, and every address tried, within one connect timeout."""

    _deadline: float
    _guard: threading.Lock
    _connecting: socket.socket | None

    def _connect(self) -> socket.socket:
        by = min(self._deadline, time.monotonic() + (self.socket_connect_timeout or math.inf))
        error: OSError = TimeoutError(f"connecting to {self.host}:{self.port} took longer than its timeout")
        for family, kind, proto, _, address in resolve(self.host, self.port, self.socket_type, by):
            left = by - time.monotonic()
            if left <= 0:
                break
            sock = socket.socket(family, kind, proto)
            with self._guard:
                self._connecting = sock  # the watchdog may cut it (a TLS handshake after it too)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.socket_keepalive:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    for option, value in self.socket_keepalive_options.items():
                        sock.setsockopt(socket.IPPROTO_TCP, option, value)
                sock.settimeout(left)
                sock.connect(address)
                sock.settimeout(self.socket_timeout)
                return sock
            except OSError as e:
                error = e
                with self._guard:
                    sock.close()
        raise error


def resolve(host: str, port: int, kind: int, by: float) -> list[Any]:
    """``getaddrinfo`` for a stream socket, given up at monotonic time ``by`` (then ``TimeoutError``); a thread asks
    the resolver, which no timeout bounds, unless ``host`` is an IP address."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return socket.getaddrinfo(host, port, kind, socket.SOCK_STREAM)
    answer: list[Any] = []
    done = threading.Event()

    def ask() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, kind, socket.SOCK_STREAM))
        except OSError as e:
            answer.append(e)
        done.set()

    threading.Thread(target=ask, daemon=True, name="kvoffload-remote-resolve").start()
    if not done.wait(max(0.0, by - time.monotonic())):
        raise TimeoutError(f"resolving {host} took longer than the connect timeout")
    if isinstance(answer[0], OSError):
        raise answer[0]
    return list(answer[0])


@functools.cache
def deadline_connection(scheme: str, in_place: bool = False) -> type:
    """The connection class for ``scheme`` (redis, rediss, unix) with a deadline per command (module docstring);
    ``in_place``: commands packed by redis-py's Python packer, which sends large values as they are."""
    bases: tuple[type, ...] = {"rediss": (SSLConnection, _BoundedTcp),
                               "unix": (UnixDomainSocketConnection,)}.get(scheme, (_BoundedTcp,))
    name = f"Deadline{'InPlace' if in_place else ''}{bases[0].__name__.lstrip('_')}"
    return type(name, (_Deadline, *bases), {"in_place": in_place})
