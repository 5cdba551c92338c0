"""Pinning a bench's client and server to CPUs of their own (``bench object --client-cpus/--server-cpus``).

On a small machine the server a bench starts (Ceph RGW) shares the cores with the client it measures, so every
microsecond the client spends is taken from the server too. Pinning the two to disjoint CPUs shows the client's
speed apart from that. A process's affinity is per thread on Linux, and a thread inherits its creator's: ``pin``
sets it on every thread a process has now, and the threads it makes later follow.
"""

from __future__ import annotations

import contextlib
import os


def parse_cpus(text: str, option: str) -> set[int]:
    """The CPUs of a list such as ``0``, ``0-1`` or ``0,2-3``, all of them among this process's own.

    Raises:
        ValueError: the list is malformed, or names a CPU this process may not run on (the error names ``option``).
    """
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, dash, last = part.partition("-")
            low, high = int(first), int(last if dash else first)
            if high < low:
                raise ValueError(part)
            cpus.update(range(low, high + 1))
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected CPUs such as 0, 0-1 or 0,2-3") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise ValueError(f"{option} {text!r}: this process may run on CPUs {sorted(allowed)} only")
    return cpus


def pin(pid: int, cpus: set[int]) -> int:
    """Run every thread of process ``pid`` on ``cpus`` from now on; returns how many threads were pinned."""
    pinned = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)
            pinned += 1
    return pinned
