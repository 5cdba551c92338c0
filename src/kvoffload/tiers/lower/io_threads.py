"""A lower tier's I/O threads (the disk tier's readers and writers, the remote and object tiers' lanes): daemons
that say when they are stuck.

A read from a hung network mount, or a socket to a server that stopped answering, can hold a thread for good.
``ThreadPoolExecutor`` joins its threads at interpreter exit, so one such read would hang the process's exit; these
threads are daemons, and ``stop`` never waits for them. ``stuck`` counts the threads busy on one task for longer
than a deadline, so a handler can switch its tier off while none is left to serve.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

Task = Callable[[], None]


class IoThreads:
    """``count`` daemon threads running tasks in submission order; thread-safe.

    Args:
        count: how many threads.
        name: prefix of their names.
        clock: monotonic seconds (the handler's, so that tests can drive ``stuck`` with a fake clock).
    """

    def __init__(self, count: int, name: str, clock: Callable[[], float]) -> None:
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._clock = clock
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy_since: dict[int, float] = {}
        self.size = count
        self._name = name
        for i in range(count):
            threading.Thread(target=self._serve, args=(i,), name=f"{name}-{i}", daemon=True).start()

    def submit(self, task: Task) -> None:
        self._tasks.put(task)

    def stuck(self, older_than_s: float) -> int:
        """Threads running one task for more than ``older_than_s`` seconds."""
        now = self._clock()
        with self._lock:
            return sum(1 for since in self._busy_since.values() if now - since > older_than_s)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no thread runs a task (queued tasks may remain); False if ``timeout_s`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._busy_since, timeout_s)

    def stop(self) -> None:
        """Let each thread exit after the tasks already queued (a stuck one exits when its task returns)."""
        for _ in range(self.size):
            self._tasks.put(None)

    def _serve(self, index: int) -> None:
        while (task := self._tasks.get()) is not None:
            with self._lock:
                self._busy_since[index] = self._clock()
            try:
                task()
            except Exception:  # A task's bug must not kill the thread that serves the others.
                logger.exception("%s: an I/O task raised", self._name)
            finally:
                with self._lock:
                    del self._busy_since[index]
                    if not self._busy_since:
                        self._idle.notify_all()
