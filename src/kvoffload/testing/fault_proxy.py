"""``FaultProxy``: a loopback TCP proxy in front of a real server that misbehaves on demand, as a network does.

A tier's tests put it between a client and a real server (redis-server, a Ceph radosgw) and switch its ``Fault`` at
run time, to check that every wait of the client ends within its configured deadline whatever the network does:

- ``PASS``: bytes go both ways untouched.
- ``TRICKLE``: the server's answers reach the client one byte every ``trickle_s``: each socket read of the client
  returns in time, so only a deadline over the whole command catches it.
- ``FREEZE``: nothing moves either way; connections stay open (a frozen radosgw or OSD, a SIGSTOPped redis-server).
  Bytes the proxy holds are kept, and a connection resumes where it stopped when the fault is lifted, as a server
  given SIGCONT would.
- ``SILENT``: new connections are accepted and their requests read, but nothing is answered (no upstream connection
  is made); existing connections freeze.
- ``BLACKHOLE``: connects never complete: a new connection's SYN gets no answer, and existing connections freeze
  (a network that drops every packet). How, without root: the listening socket is replaced by one on the same port
  with a backlog of 0 whose accept queue is filled by one connection of the proxy's own and never accepted; Linux
  then drops every further SYN (``LISTENOVERFLOWS``), so a client's ``connect`` hangs in SYN-SENT until its connect
  timeout. ``set`` checks that the last filling connect does hang, and raises ``RuntimeError`` on a kernel where it
  does not. Lifting the fault closes that socket and listens again on the port (a connect in that instant is
  refused; one still retrying its SYN then completes).
- ``HUGE_BODY`` (HTTP servers): every request on a new connection is answered ``HTTP/1.1 200 OK`` with a body of
  ``huge_bytes`` zeros (made as it is sent, never held) and a correct ``Content-Length``; existing connections pass.

Counters (``bytes_to_clients``, ``accepted``, ``client_closed``) let a test check, for example, that a client dropped
a connection rather than reading a whole huge body. Every thread is a daemon; ``close`` (or leaving the ``with``
block) closes every socket. Loopback only (127.0.0.1); nothing but the standard library.
"""

from __future__ import annotations

import contextlib
import enum
import select
import socket
import threading
from collections.abc import Callable
from types import TracebackType

__all__ = ["Fault", "FaultProxy"]

HOST = "127.0.0.1"
CHUNK = 64 * 1024
POLL_S = 0.05
"""How often a blocked proxy thread looks at the fault and at ``close`` again."""


class Fault(enum.Enum):
    """What the proxy does to the bytes (see the module docstring)."""

    PASS = "pass"
    TRICKLE = "trickle"
    FREEZE = "freeze"
    SILENT = "silent"
    BLACKHOLE = "blackhole"
    HUGE_BODY = "huge body"


_FROZEN = (Fault.FREEZE, Fault.SILENT, Fault.BLACKHOLE)
"""Faults under which an established connection moves nothing."""


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_host:upstream_port``; thread-safe.

    Args:
        upstream_host, upstream_port: the real server.
        fault: the fault at start (``set`` changes it).
        trickle_s: seconds between two bytes under ``TRICKLE``.
        huge_bytes: the body length under ``HUGE_BODY``.
    """

    def __init__(self, upstream_host: str, upstream_port: int, fault: Fault = Fault.PASS, *,
                 trickle_s: float = 0.2, huge_bytes: int = 128 << 20) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.trickle_s = trickle_s
        self.huge_bytes = huge_bytes
        self.bytes_to_clients = 0
        """Bytes sent to clients, forwarded or made up."""
        self.accepted = 0
        """Connections accepted."""
        self.client_closed = 0
        """Connections the client closed (or reset) while the proxy still served them."""
        self._fault = Fault.PASS
        self._changed = threading.Condition()
        self._closed = False
        self._sockets: set[socket.socket] = set()
        self._gone: set[socket.socket] = set()
        self._listener = self._listen(backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self._fillers: list[socket.socket] = []
        self._start(self._accept_loop)
        self.set(fault)

    @property
    def host(self) -> str:
        return HOST

    @property
    def url_host(self) -> str:
        """``host:port`` of the proxy, for a URL (``redis://`` + it, ``http://`` + it)."""
        return f"{HOST}:{self.port}"

    @property
    def fault(self) -> Fault:
        return self._fault

    def set(self, fault: Fault) -> None:
        """Switch to ``fault``; new connections and (see ``Fault``) existing ones follow at once.

        Raises:
            RuntimeError: ``BLACKHOLE`` on a kernel whose full accept queue still completes connects.
        """
        with self._changed:
            if fault is self._fault:
                return
            if fault is Fault.BLACKHOLE:
                _close(self._listener)  # one listener per port: the old one goes first
                self._listener = self._blackhole()
            elif self._fault is Fault.BLACKHOLE:
                _close(self._listener)
                self._listener = self._listen(backlog=128)
                for filler in self._fillers:
                    filler.close()
                self._fillers = []
            self._fault = fault
            self._changed.notify_all()

    def close(self) -> None:
        """Close every socket; the proxy's threads exit within ``POLL_S``."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            doomed = [self._listener, *self._fillers, *self._sockets]
        for sock in doomed:
            _close(sock)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    # Listening and accepting.

    def _listen(self, backlog: int) -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((HOST, getattr(self, "port", 0)))
        listener.listen(backlog)
        return listener

    def _blackhole(self) -> socket.socket:
        """A listener of backlog 0 whose accept queue is full (see the module docstring)."""
        listener = self._listen(backlog=0)
        for _ in range(8):  # Linux queues one connection at backlog 0; a second one hangs
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex((HOST, self.port))
            self._fillers.append(filler)
            if not select.select([], [filler], [], 0.2)[1]:
                return listener
        raise RuntimeError("BLACKHOLE: this kernel completes connects to a full accept queue")

    def _accept_loop(self) -> None:
        while not self._closed:
            with self._changed:
                listener, blackhole = self._listener, self._fault is Fault.BLACKHOLE
            if blackhole:
                self._wait(lambda: self._fault is not Fault.BLACKHOLE)
                continue
            try:
                if not select.select([listener], [], [], POLL_S)[0]:
                    continue
                client, _ = listener.accept()
            except (OSError, ValueError):  # the listener was swapped or closed meanwhile
                continue
            self._serve(client, self._fault)  # the fault when it came, not when the wait began

    def _serve(self, client: socket.socket, fault: Fault) -> None:
        with self._changed:
            self.accepted += 1
            self._sockets.add(client)
        if fault is Fault.SILENT:
            self._start(self._swallow, client)
        elif fault is Fault.HUGE_BODY:
            self._start(self._answer_huge, client)
        else:
            self._start(self._connect_upstream, client)

    def _connect_upstream(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            self._end(client)
            return
        with self._changed:
            self._sockets.add(upstream)
        self._start(self._pump, upstream, client, True)
        self._pump(client, upstream, False)

    # Moving bytes.

    def _pump(self, source: socket.socket, target: socket.socket, to_client: bool) -> None:
        """Forward ``source`` to ``target`` as the fault says, until either end closes."""
        client = target if to_client else source
        try:
            while True:
                self._wait(lambda: self._fault not in _FROZEN)
                if self._closed:
                    return
                if not select.select([source], [], [], POLL_S)[0]:
                    continue
                data = source.recv(CHUNK)
                if not data:
                    if not to_client:
                        self._count_closed(client)
                    return
                self._deliver(target, memoryview(data), to_client)
        except (OSError, ValueError):  # a reset, or the other direction's end closed the sockets
            if client.fileno() != -1:
                self._count_closed(client)
        finally:
            self._end(source)
            self._end(target)

    def _deliver(self, target: socket.socket, data: memoryview, to_client: bool) -> None:
        while data:
            self._wait(lambda: self._fault not in _FROZEN)
            if self._closed:
                return
            trickle = to_client and self._fault is Fault.TRICKLE
            sent = self._send(target, data[:1] if trickle else data)
            if to_client:
                with self._changed:
                    self.bytes_to_clients += sent
            data = data[sent:]
            if trickle and data:
                self._wait(lambda: self._fault is not Fault.TRICKLE, self.trickle_s)

    def _send(self, target: socket.socket, data: memoryview) -> int:
        """Send some of ``data``, looking at ``close`` while the peer does not read."""
        target.settimeout(POLL_S)
        while not self._closed:
            try:
                return target.send(data)
            except TimeoutError:
                continue
        return 0

    def _swallow(self, client: socket.socket) -> None:
        """Read the client's requests and answer nothing."""
        try:
            while not self._closed:
                if select.select([client], [], [], POLL_S)[0] and not client.recv(CHUNK):
                    break
            else:
                return
        except (OSError, ValueError):
            pass
        finally:
            self._end(client)
        self._count_closed(client)

    def _answer_huge(self, client: socket.socket) -> None:
        """Answer each request with ``huge_bytes`` of zeros until the client closes."""
        zeros = memoryview(bytes(CHUNK))
        head = (f"HTTP/1.1 200 OK\r\nContent-Length: {self.huge_bytes}\r\n"
                "Content-Type: application/octet-stream\r\n\r\n").encode()
        try:
            while _read_request(client, lambda: self._closed):
                self._deliver(client, memoryview(head), True)
                left = self.huge_bytes
                while left and not self._closed:
                    part = zeros[:min(left, CHUNK)]
                    self._deliver(client, part, True)
                    left -= len(part)
        except (OSError, ValueError):
            pass
        finally:
            if not self._closed:
                self._count_closed(client)
            self._end(client)

    # Plumbing.

    def _wait(self, ready: Callable[[], bool], timeout: float | None = None) -> None:
        """Until ``ready()`` or ``close`` (or ``timeout`` seconds)."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed or ready(), timeout)

    def _count_closed(self, client: socket.socket) -> None:
        """Count ``client``'s connection as closed by the client, once."""
        with self._changed:
            if client not in self._gone and not self._closed:
                self._gone.add(client)
                self.client_closed += 1

    def _end(self, sock: socket.socket) -> None:
        with self._changed:
            self._sockets.discard(sock)
        _close(sock)

    def _start(self, target: Callable[..., None], *args: object) -> None:
        threading.Thread(target=target, args=args, daemon=True, name="kvoffload-fault-proxy").start()


def _read_request(client: socket.socket, closed: Callable[[], bool]) -> bool:
    """Read one HTTP request (its head, then a ``Content-Length`` body); False when the client closed first."""
    head = b""
    while b"\r\n\r\n" not in head:
        if closed():
            return False
        if not select.select([client], [], [], POLL_S)[0]:
            continue
        data = client.recv(CHUNK)
        if not data:
            return False
        head += data
    top, _, body = head.partition(b"\r\n\r\n")
    length = 0
    for line in top.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip() or 0)
    left = length - len(body)
    while left > 0:
        if closed():
            return False
        if not select.select([client], [], [], POLL_S)[0]:
            continue
        data = client.recv(min(left, CHUNK))
        if not data:
            return False
        left -= len(data)
    return True


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
