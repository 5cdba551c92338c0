"""Waiting on a handler's background jobs that have deadlines: the waits of ``handler.LowerTierHandler``.

It keeps one state per job with a ``done`` event, fails overdue jobs in an ``expire`` pass, and must return from
``wait`` and ``shutdown`` even while an I/O thread is stuck. These two loops are that waiting, once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar


class _HasDone(Protocol):
    @property
    def done(self) -> threading.Event: ...


Job = TypeVar("Job", bound=_HasDone)


def wait_jobs(states: Iterable[Job], wait_slice: Callable[[Job], float], expire: Callable[[], None]) -> None:
    """Return when every job of ``states`` is done; ``expire`` runs between slices so overdue jobs fail."""
    for state in states:
        while not state.done.wait(wait_slice(state)):
            expire()


def drain_jobs(states: Iterable[Job], wait_slice: Callable[[Job], float], expire: Callable[[], None],
               abandon: Callable[[Job], object], grace_s: float) -> None:
    """Like ``wait_jobs``, for at most ``grace_s``; jobs still running then are ``abandon``-ed (failed)."""
    give_up = time.monotonic() + grace_s
    for state in states:
        while not state.done.wait(min(wait_slice(state), max(0.0, give_up - time.monotonic()))):
            expire()
            if time.monotonic() >= give_up:
                abandon(state)  # its thread is stuck: the thread stays behind (a daemon), not the caller
