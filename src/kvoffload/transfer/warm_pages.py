"""Populating a host buffer's pages before its first stores: ``warm(tensor)``.

A fresh private host pool (``host_pool.py``) is address space only: the kernel gives each 4 KiB page its memory on
the first write to it, one page fault per page, so the first stores into a new pool ran at page-fault speed (1.0-1.5
GB/s on this project's 2-core VM, 0.28-0.40x the speed into the same pages once present; 0.3 against 10+ GB/s
reported on larger machines). ``warm`` asks the kernel to fault every page in ahead with
``madvise(MADV_POPULATE_WRITE)`` (Linux >= 5.14): the pages are allocated and mapped writable *without their
contents changing*, so stores may already write into the buffer while it runs, from any thread, and nothing they
wrote is lost.

Where it runs: in the caller's thread for up to ``SYNC_BUDGET_S`` (start-up waits that long at most, plus one
chunk), then, for what is left, on a daemon thread. Both go a chunk (``CHUNK_BYTES``) per call, so ``stop`` (the
pool collected) ends the thread within one chunk; the thread holds the tensor until it ends, so the memory cannot be
freed under a call.

Failure leaves the buffer cold, never wrong: a kernel without the advice answers EINVAL (one info line); any other
error (ENOMEM: nothing left to commit) is one warning, and the rest of the buffer stays cold. Writing zeros instead
is no fallback: on a background thread it would race with stores.

Cost: the whole buffer is committed at start-up (it counts in the process's RSS and against a cgroup's memory limit
from then on, not as it fills), and populating it takes a core for ``nbytes`` / 2.7 GB/s on this project's VM.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python 3.11's mmap module lacks the constant
CHUNK_BYTES = 64 << 20
SYNC_BUDGET_S = 0.5
THREAD_NAME = "kvoffload-warm-pages"

# (address, length, advice) -> 0, or the errno madvise set.
Madvise = Callable[[int, int, int], int]


class WarmState(enum.Enum):
    RUNNING = "running"
    WARM = "warm"  # every whole page of the buffer populated
    UNSUPPORTED = "unsupported"  # the kernel refused the advice (EINVAL): the buffer is cold
    FAILED = "failed"  # another error stopped population part way: the rest is cold
    STOPPED = "stopped"  # ``stop`` came first: the rest is cold


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def libc_madvise(address: int, length: int, advice: int) -> int:
    """libc's ``madvise``: 0, or the errno it set (ctypes drops the GIL for the call)."""
    if _libc.madvise(address, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def page_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The whole pages inside ``tensor``'s bytes, ``(start, end)`` addresses: madvise takes page-aligned ranges,
    and the partial pages at the edges may hold someone else's bytes (the allocator's header)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    return first, max(first, last)


class Warming:
    """Populating one tensor's pages, made and started by ``warm``.

    ``state`` is ``RUNNING`` until it ends in another ``WarmState``; ``sync_seconds`` is the time ``warm`` spent in
    the caller's thread, ``seconds`` the time from start to end (so far, while running). Thread-safe: ``stop``,
    ``wait`` and the attributes may be used from any thread.
    """

    def __init__(self, tensor: torch.Tensor, advice: int, chunk_bytes: int, madvise: Madvise) -> None:
        if chunk_bytes <= 0 or chunk_bytes % mmap.PAGESIZE:
            raise ValueError(f"warm_pages: chunk_bytes must be a positive multiple of {mmap.PAGESIZE}, "
                             f"got {chunk_bytes}")
        self._tensor: torch.Tensor | None = tensor
        self._next, self._end = page_range(tensor)
        self.nbytes = self._end - self._next
        self._advice, self._chunk, self._madvise = advice, chunk_bytes, madvise
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.state = WarmState.RUNNING
        self._started = time.perf_counter()
        self._ended: float | None = None
        self.sync_seconds = 0.0

    @property
    def seconds(self) -> float:
        return (self._ended or time.perf_counter()) - self._started

    @property
    def populated_bytes(self) -> int:
        """Bytes populated so far (all of ``nbytes`` when ``WARM``)."""
        return self.nbytes - (self._end - self._next)

    @property
    def in_background(self) -> bool:
        """Whether the rest went to a thread (true even once it ended)."""
        return self._thread is not None

    def stop(self) -> None:
        """Ask population to stop after the chunk in progress; returns at once (a finalizer may call it)."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for population to end (the thread too, when there is one); whether it has."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._done.is_set()

    def _start(self, sync_budget_s: float) -> None:
        ended = self._populate(self._started + sync_budget_s)
        self.sync_seconds = self.seconds
        if not ended:
            self._thread = threading.Thread(target=self._populate, args=(float("inf"),), daemon=True,
                                            name=THREAD_NAME)
            self._thread.start()

    def _populate(self, until: float) -> bool:
        """Populate chunk by chunk until the end, ``stop``, an error or ``until``; whether it ended."""
        while self._next < self._end:
            if self._stop.is_set():
                return self._finish(WarmState.STOPPED)
            if time.perf_counter() >= until:
                return False
            length = min(self._chunk, self._end - self._next)
            error = self._madvise(self._next, length, self._advice)
            if error:
                self._log_failure(error)
                return self._finish(WarmState.UNSUPPORTED if error == errno.EINVAL else WarmState.FAILED)
            self._next += length
        logger.info("warm pages: %.2f GiB populated in %.2f s (%.2f s of it before start-up went on)",
                    self.nbytes / (1 << 30), self.seconds, self.sync_seconds if self.in_background else self.seconds)
        return self._finish(WarmState.WARM)

    def _finish(self, state: WarmState) -> bool:
        self.state = state
        self._ended = time.perf_counter()
        self._tensor = None  # the memory may go once its owner lets it
        self._done.set()
        return True

    def _log_failure(self, error: int) -> None:
        name = errno.errorcode.get(error, str(error))
        if error == errno.EINVAL:
            logger.info("warm pages: the kernel cannot populate pages ahead (madvise advice %d: %s; "
                        "MADV_POPULATE_WRITE needs Linux >= 5.14): the buffer stays cold, its first stores fault "
                        "its pages in", self._advice, name)
        else:
            logger.warning("warm pages: populating stopped after %.2f of %.2f GiB (madvise: %s, %s): the rest "
                           "stays cold", self.populated_bytes / (1 << 30), self.nbytes / (1 << 30), name,
                           os.strerror(error))


def warm(tensor: torch.Tensor, *, sync_budget_s: float = SYNC_BUDGET_S, chunk_bytes: int = CHUNK_BYTES,
         advice: int = MADV_POPULATE_WRITE, madvise: Madvise = libc_madvise) -> Warming:
    """Populate ``tensor``'s pages: in this thread for up to ``sync_budget_s`` seconds, the rest on a daemon thread.

    Args:
        tensor: a CPU tensor in this process's private memory (not pinned: already resident; not a shared
            mapping: its owner's business).
        sync_budget_s: how long the caller may wait; 0 sends all of it to the thread.
        chunk_bytes: bytes per madvise call, a multiple of the page size: how soon ``stop`` takes effect.
        advice, madvise: the advice and the call that gives it (tests pass others to reach the failures).

    Returns:
        The population, ended (state not ``RUNNING``) unless ``in_background``.

    Raises:
        ValueError: ``chunk_bytes`` is not a positive multiple of the page size.
    """
    warming = Warming(tensor, advice, chunk_bytes, madvise)
    warming._start(sync_budget_s)
    return warming
