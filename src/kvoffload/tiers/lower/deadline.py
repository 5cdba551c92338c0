"""Wall-clock deadlines for requests over a network, which a server cannot stretch (the object tier's requests).

A socket timeout bounds each read, not a request: a server that sends one byte a little faster than the timeout
holds a request, and the thread that sent it, for as long as it likes. Here a request runs ``within`` its deadline
on the thread that sends it; the connection it uses tells the watchdog its socket (``watch``) when it connects and
when it sends; the watchdog (``WATCHDOG``, rung by ``ALARMS``) shuts down (``SHUT_RDWR``) the sockets of a request
past its deadline, so that the blocked read fails at once, the thread is free and the server sees the connection
closed. ``within`` then raises ``TimeoutError``, whatever the broken read raised.

What a watchdog cannot cut short (a resolver, ``getaddrinfo``, has no socket to shut; nor has a connect under way)
the caller bounds: the request runs on another thread and the caller waits on it until the deadline at most
(``result_by``). So a caller never waits past a deadline, and a thread is freed at it wherever it holds a socket.

Each watched socket is a duplicate (``os.dup``) the watchdog owns until the request ends: shutting it down reaches
the connection, and its number can never be reused meanwhile by a socket that another thread opened.

The watchdog's clock is ``ALARMS``, the process's one thread that runs callbacks at their time, which the remote
tier's connections (``tiers.remote.connection``) use for their own deadlines too.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)

TICK_S = 0.005
"""How late an alarm may ring: the alarm thread wakes once for every alarm due within a tick."""


class Alarms:
    """One daemon thread that runs each callback at its time (monotonic seconds), earliest first; thread-safe.
    ``ALARMS`` is the process's one. A callback runs on that thread and must be short; one that raises is logged."""

    def __init__(self, tick_s: float = TICK_S) -> None:
        self._tick_s = tick_s
        self._reset()

    def _reset(self) -> None:
        """A fresh state (also in a forked child, which has none of its parent's threads)."""
        self._wake = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def at(self, when: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` at ``when`` (or at once, if it has passed)."""
        with self._wake:
            heapq.heappush(self._heap, (when, next(self._order), callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvoffload-alarms", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is callback:
                self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                now = time.monotonic()
                due = []
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
                if not due:
                    self._wake.wait(self._heap[0][0] - now + self._tick_s if self._heap else None)
                    continue
            for callback in due:
                try:
                    callback()
                except Exception:  # the thread rings every other alarm of the process
                    logger.exception("an alarm's callback raised")


ALARMS = Alarms()
os.register_at_fork(after_in_child=ALARMS._reset)


class Deadline:
    """One request's end (monotonic seconds) and the sockets its connections use."""

    __slots__ = ("at", "expired", "finished", "sockets")

    def __init__(self, at: float) -> None:
        self.at = at
        self.expired = False
        """The watchdog shut its sockets down."""
        self.finished = False
        """The request ended (its sockets are closed)."""
        self.sockets: dict[Any, tuple[socket.socket, socket.socket]] = {}
        """Each connection's socket and the watchdog's duplicate of it."""


_local = threading.local()


class Watchdog:
    """Shuts down the sockets of requests past their deadline (``ALARMS`` rings it); thread-safe. ``WATCHDOG`` is
    the process's one."""

    def __init__(self, alarms: Alarms) -> None:
        self._alarms = alarms
        self._reset()

    def _reset(self) -> None:
        """A fresh state (also in a forked child, which has none of its parent's threads)."""
        self._lock = threading.Lock()
        self._owners: dict[Any, Deadline] = {}
        self.expired = 0
        """Deadlines that passed before their request ended (for tests)."""

    @contextlib.contextmanager
    def within(self, at: float, what: str = "a request") -> Iterator[Deadline]:
        """Run the body as one request that must end by ``at`` (``time.monotonic()`` seconds).

        Raises:
            TimeoutError: ``at`` has passed already (nothing is sent), or passed while the body ran (from the error
                the body met: its socket was shut down).
        """
        if at <= time.monotonic():
            raise TimeoutError(f"{what}: its deadline passed before it was sent")
        deadline = self._start(at)
        previous = getattr(_local, "deadline", None)
        _local.deadline = deadline
        try:
            yield deadline
        except Exception as e:
            if deadline.expired or time.monotonic() >= at:
                raise TimeoutError(f"{what} did not end by its deadline") from e
            raise
        finally:
            _local.deadline = previous
            self._finish(deadline)

    def watch(self, connection: Any, sock: socket.socket | None) -> None:
        """``connection`` sends the current thread's request on ``sock`` (or, without a request ``within`` a
        deadline, is no longer watched)."""
        deadline: Deadline | None = getattr(_local, "deadline", None)
        with self._lock:
            previous = self._owners.pop(connection, None)
            if previous is not None and previous is not deadline:
                _close(previous.sockets.pop(connection, None))  # its request ended or moved on: never shut it
            if deadline is None or deadline.finished or sock is None:
                return
            self._owners[connection] = deadline
            kept = deadline.sockets.get(connection)
            if kept is not None and kept[0] is sock:
                return
            _close(deadline.sockets.pop(connection, None))
            try:
                duplicate = socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
            except OSError:
                return  # closed already: the request fails on its own
            deadline.sockets[connection] = (sock, duplicate)
            if deadline.expired:
                _shut(duplicate)

    def _start(self, at: float) -> Deadline:
        deadline = Deadline(at)
        self._alarms.at(at, functools.partial(self._expire, deadline))
        return deadline

    def _expire(self, deadline: Deadline) -> None:
        """On the alarm thread, at the deadline: shut its request's sockets down, if it still runs."""
        with self._lock:
            if deadline.finished:
                return
            deadline.expired = True
            self.expired += 1
            for _, duplicate in deadline.sockets.values():
                _shut(duplicate)

    def _finish(self, deadline: Deadline) -> None:
        with self._lock:
            deadline.finished = True
            for connection, pair in deadline.sockets.items():
                _close(pair)
                if self._owners.get(connection) is deadline:
                    del self._owners[connection]
            deadline.sockets.clear()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _close(pair: tuple[socket.socket, socket.socket] | None) -> None:
    if pair is not None:
        pair[1].close()


def result_by(future: Future[T], at: float, what: str = "a request") -> T:
    """``future``'s result, waiting until ``at`` (monotonic seconds) at most.

    Raises:
        TimeoutError: no result by ``at`` (a request not begun is cancelled; one under way ends by its own
            deadline, or when the resolver it waits on answers).
        Exception: the one ``future`` raised.
    """
    try:
        return future.result(timeout=max(0.0, at - time.monotonic()))
    except FuturesTimeout:  # TimeoutError itself from Python 3.11 on: told apart by the future being unfinished
        if future.done():
            raise
        future.cancel()
        raise TimeoutError(f"{what} did not end by its deadline") from None


WATCHDOG = Watchdog(ALARMS)
os.register_at_fork(after_in_child=WATCHDOG._reset)
