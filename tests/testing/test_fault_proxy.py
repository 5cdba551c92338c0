"""FaultProxy in front of a real redis-server (and as an HTTP server that answers huge bodies), with plain sockets:
each fault does what it says to new and existing connections, and the counters count."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest

from kvoffload.testing.fault_proxy import Fault, FaultProxy
from kvoffload.testing.redis_server import RedisServer

TIMEOUT_S = 0.3


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[FaultProxy]:
    with FaultProxy("127.0.0.1", redis_server.port, trickle_s=0.05) as p:
        yield p


def connected(proxy: FaultProxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT_S)


def ping(sock: socket.socket) -> bytes:
    sock.sendall(b"PING\r\n")
    return reply_of(sock)


def reply_of(sock: socket.socket) -> bytes:
    """One line of a reply (redis-server's answer to PING)."""
    reply = b""
    while not reply.endswith(b"\r\n"):
        data = sock.recv(64)
        if not data:
            break
        reply += data
    return reply


def test_pass_forwards_a_ping_and_counts_the_answer(proxy: FaultProxy) -> None:
    with connected(proxy) as sock:
        assert ping(sock) == b"+PONG\r\n"
    # The proxy counts a send once it returned: the client may have read the bytes a moment before.
    _wait_for(lambda: proxy.bytes_to_clients == len(b"+PONG\r\n"))
    assert proxy.accepted == 1


def test_trickle_sends_the_answer_a_byte_at_a_time(proxy: FaultProxy) -> None:
    proxy.set(Fault.TRICKLE)
    with connected(proxy) as sock:
        started = time.monotonic()
        assert ping(sock) == b"+PONG\r\n"  # each byte comes within the 0.3 s read timeout
        took = time.monotonic() - started
    assert took >= 6 * proxy.trickle_s  # 7 bytes: 6 pauses between them


@pytest.mark.parametrize("fault", [Fault.FREEZE, Fault.SILENT, Fault.BLACKHOLE])
def test_a_frozen_connection_times_the_client_out_and_resumes_after_the_fault(proxy: FaultProxy,
                                                                             fault: Fault) -> None:
    with connected(proxy) as sock:
        assert ping(sock) == b"+PONG\r\n"
        proxy.set(fault)
        with pytest.raises(TimeoutError):
            ping(sock)
        proxy.set(Fault.PASS)
        sock.settimeout(5)
        assert reply_of(sock) == b"+PONG\r\n"  # the held PING's answer: nothing lost, nothing made up
        assert ping(sock) == b"+PONG\r\n"


@pytest.mark.parametrize("fault", [Fault.FREEZE, Fault.SILENT])
def test_a_new_connection_is_accepted_but_never_answered(proxy: FaultProxy, fault: Fault) -> None:
    proxy.set(fault)
    with connected(proxy) as sock, pytest.raises(TimeoutError):
        ping(sock)
    assert proxy.accepted == 1 and proxy.bytes_to_clients == 0


def test_blackhole_leaves_a_connect_hanging_until_its_timeout_then_pass_serves_again(proxy: FaultProxy) -> None:
    proxy.set(Fault.BLACKHOLE)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        connected(proxy)  # no SYN-ACK: the connect itself times out, not a read
    assert time.monotonic() - started >= TIMEOUT_S
    proxy.set(Fault.PASS)
    with connected(proxy) as sock:
        assert ping(sock) == b"+PONG\r\n"
    assert proxy.accepted == 1  # the black hole accepted nothing


def test_huge_body_sends_the_advertised_length() -> None:
    size = 3 << 20
    with FaultProxy("127.0.0.1", 1, Fault.HUGE_BODY, huge_bytes=size) as proxy, \
            socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        for _ in range(2):  # every request on the connection
            sock.sendall(b"GET /bucket/name HTTP/1.1\r\nHost: x\r\n\r\n")
            head, body = _read_head(sock)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and f"Content-Length: {size}".encode() in head
            got = len(body)
            while got < size:
                got += len(sock.recv(min(1 << 20, size - got)))
            assert got == size
        # The proxy counts a send once it returned, which may be after the client read its last byte.
        _wait_for(lambda: proxy.bytes_to_clients == 2 * (len(head) + size))


def test_huge_body_counts_a_client_that_hangs_up_instead_of_reading_it() -> None:
    with FaultProxy("127.0.0.1", 1, Fault.HUGE_BODY) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            sock.sendall(b"PUT /b/n HTTP/1.1\r\nContent-Length: 4\r\n\r\nbody")
            _read_head(sock)
        _wait_for(lambda: proxy.client_closed == 1)
        assert proxy.bytes_to_clients < proxy.huge_bytes


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", body


def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll the proxy's thread for a counter (it has no event to wait on)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the proxy never saw the client close"
        time.sleep(0.01)
