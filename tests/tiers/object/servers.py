"""A loopback HTTP server that misbehaves on purpose, for the object tier's deadline and bounded-read tests.

``FakeStore`` answers every request the way its ``mode`` says: ``missing`` as S3 answers a name nobody wrote
(404 NoSuchKey; 200 to a HEAD, as to HeadBucket), ``ok`` as a web server that is not a store (200 and one byte,
to anything), ``huge`` 200 with a body of ``HUGE`` bytes made as they are sent (to a GET; 204 to the rest),
``trickle`` a 404 one byte every ``TRICKLE_S``, ``frozen`` nothing at all, ``cut`` a GET's answer announced as
``CUT_LENGTH`` bytes and broken off after ``CUT_SENT`` of them (its connection closed; 204 to the rest). It counts
requests (and their methods), connections and the bytes it sent, and notes when a client closed a connection (what
frees the client's thread). Raw sockets and a thread per connection: every byte and every close is the test's to
decide.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

HUGE = 128 << 20
CUT_LENGTH, CUT_SENT = 4096, 100
TRICKLE_S = 0.2
CHUNK = 64 << 10
_NO_SUCH_KEY = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>NoSuchKey</Code>"
                b"<Message>The specified key does not exist.</Message></Error>")


def _answer(status: str, body: bytes, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {size}\r\n\r\n").encode() + body


class _HungUp(Exception):
    """The server closed the connection on purpose."""


class FakeStore:
    """One loopback server; ``close`` stops it and every connection it holds."""

    def __init__(self, mode: str = "missing") -> None:
        self.mode = mode
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._connections: list[socket.socket] = []
        self.requests = 0
        self.methods: list[str] = []
        """Each request's method, in order."""
        self.sent = 0
        self.closed_at: list[float] = []
        """When (monotonic) a client closed each connection it gave up or dropped."""
        self._stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def accepted(self) -> int:
        """Connections the clients opened so far."""
        with self._lock:
            return len(self._connections)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stopped.set()
        self._listener.close()
        with self._lock:
            for conn in self._connections:
                conn.close()

    def __enter__(self) -> FakeStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        pending = b""
        try:
            while True:
                while b"\r\n\r\n" not in pending:
                    data = conn.recv(65536)
                    if not data:
                        raise ConnectionResetError("the client closed the connection")
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                pending = self._skip_body(conn, head, pending)
                method = head.split(b" ", 1)[0].decode()
                with self._lock:
                    self.requests += 1
                    self.methods.append(method)
                self._respond(conn, method)
        except _HungUp:
            pass  # the server closed it: not a client letting go
        except OSError:
            if not self._stopped.is_set():
                with self._lock:
                    self.closed_at.append(time.monotonic())
                    self._changed.notify_all()

    def _skip_body(self, conn: socket.socket, head: bytes, pending: bytes) -> bytes:
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(pending) < length:
            data = conn.recv(65536)
            if not data:
                raise ConnectionResetError("the client closed the connection")
            pending += data
        return pending[length:]

    def _respond(self, conn: socket.socket, method: str) -> None:
        mode, head_only = self.mode, method == "HEAD"
        if mode == "missing" and head_only:  # HeadBucket: the bucket is there
            self._send(conn, _answer("200 OK", b""))
        elif mode == "missing":
            self._send(conn, _answer("404 Not Found", _NO_SUCH_KEY))
        elif mode == "ok":
            self._send(conn, _answer("200 OK", b"" if head_only else b"x"))
        elif mode == "trickle":
            for byte in _answer("404 Not Found", _NO_SUCH_KEY):
                self._send(conn, bytes([byte]))
                time.sleep(TRICKLE_S)
        elif mode == "huge" and method != "GET":  # a huge answer to a GET only (botocore reads the others)
            self._send(conn, b"HTTP/1.1 204 No Content\r\n\r\n")
        elif mode == "huge":
            self._send(conn, _answer("200 OK", b"", HUGE))
            chunk = b"\0" * CHUNK
            for _ in range(0 if head_only else HUGE // CHUNK):
                self._send(conn, chunk)
        elif mode == "cut" and method != "GET":
            self._send(conn, b"HTTP/1.1 204 No Content\r\n\r\n")
        elif mode == "cut":
            self._send(conn, _answer("206 Partial Content", b"\1" * CUT_SENT, CUT_LENGTH))
            conn.close()
            raise _HungUp()
        elif mode == "frozen":
            while conn.recv(65536):
                pass
            raise ConnectionResetError("the client closed the connection")

    def _send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        with self._lock:
            self.sent += len(data)

    def wait_closed(self, count: int, timeout_s: float) -> list[float]:
        """When the first ``count`` connections were closed by their client (fewer: not within ``timeout_s``)."""
        with self._changed:
            self._changed.wait_for(lambda: len(self.closed_at) >= count, timeout_s)
            return self.closed_at[:count]
