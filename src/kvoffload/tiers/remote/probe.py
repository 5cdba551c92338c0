"""The scheduler half's questions to the remote tier's server: which values exist, and deleting this engine's own.

Place in the data flow: ``RemoteIndex`` asks ``RemoteProbe.leading_run(keys)`` how many leading keys every
rank's value exists for (a promotion can read them now), and ``delete(keys)`` when keys leave its own index. The
worker's ``RemoteHandler`` moves the values; nothing here reads or writes one.

Cost is the point of this module: the scheduler asks on every step, with a whole prompt's keys. redis-py spends
4 to 8 us of Python per pipelined command (2,048 ``EXISTS`` cost 8-18 ms), but one ``EXISTS`` naming 2,048 values
costs about 1 ms. So against one server a run is found by counting: ``EXISTS`` over a window of keys answers how
many of their values exist; all of them extends the run, fewer bounds it (the run cannot be longer than the
count), and the next window is the bounded one. Keys are chained content hashes, so what exists is nearly always a
prefix, and the second count confirms it; windows grow from ``FIRST_WINDOW`` so that a miss (a new prompt) costs
one small command. After ``MAX_ROUNDS`` without an answer, or against a cluster (whose client splits a multi-key
command into one command per hash slot anyway), one pipeline of single ``EXISTS`` per value gives it exactly.

Failures are misses, never exceptions and never stalls: redis-py's retries are off, and a lookup (all its rounds
together) or the start-up ``PING`` ends within ``connect_timeout_s + timeout_s`` however slowly the server answers
(``tiers.remote.connection.within``), each ``DEL`` of a delete within ``timeout_s`` on an open connection (a reset
sends one per ``DELETE_BATCH`` names). A timeout or a refused login switches the probe off at once for the
cool-down (each further attempt would cost the scheduler the same wait), other errors count towards
``breaker_errors`` in a row.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from redis import exceptions as rex

from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.tiers.lower.breaker import CircuitBreaker
from kvoffload.tiers.remote.client import rank_prefix, without_retries
from kvoffload.tiers.remote.connection import within

FIRST_WINDOW = 64
GROWTH = 8
MAX_ROUNDS = 8
DELETE_BATCH = 4096
"""Names per ``DEL`` command (a reset may drop millions of values)."""
NAME_CACHE = 1 << 15
"""Keys whose value names are remembered: a secret's keyed names cost about 8 us per key to compute."""

_FAILURES = (rex.RedisError, rex.RedisClusterException, OSError)
"""What a failing server or cluster raises (a cluster client's own errors are not ``RedisError``)."""
_AT_ONCE = (rex.TimeoutError, TimeoutError, rex.AuthenticationError, rex.AuthenticationWrongNumberOfArgsError,
            rex.NoPermissionError)
"""Failures that switch the probe off without waiting for ``breaker_errors``: every next call would meet them."""


class ValueNames:
    """Every rank's value name of a key (``tiers.remote.client.value_name`` for each rank; one name for a replicated
    namespace), remembered for recent keys."""

    def __init__(self, namespace: Namespace, fmt: BlockFormat) -> None:
        self._prefixes = tuple(rank_prefix(replace(namespace, rank=r), fmt) for r in namespace.copy_ranks)
        self._fmt = fmt
        self._names: dict[OffloadKey, str] = {}

    @property
    def copies(self) -> int:
        """Values per key: one per rank, or one for a replicated namespace."""
        return len(self._prefixes)

    def of(self, keys: Sequence[OffloadKey]) -> list[str]:
        """Names of ``keys``' values, every rank's for one key after the other."""
        names = self._names
        out: list[str] = []
        for key in keys:
            name = names.get(key)
            if name is None:
                if len(names) >= NAME_CACHE:
                    del names[next(iter(names))]  # the oldest: a prompt's keys are asked together
                name = names[key] = self._fmt.name(key)
            out.extend(prefix + name for prefix in self._prefixes)
        return out


class RemoteProbe:
    """Existence counts and deletes against the server, behind a breaker.

    Args:
        connect: makes the redis-py client (called again after a failure to make one: a cluster that is down).
        names: the value names of this world.
        cluster: the client is a ``RedisCluster`` (pipelines of single commands instead of counting).
        timeout_s: the most one ``leading_run`` may take over all its rounds; a slower one is a timeout.
        breaker: switches the probe off after failures.
        clock: monotonic seconds.
        connect_timeout_s: what a call may take on top of ``timeout_s`` when it must connect first.
    """

    def __init__(self, connect: Callable[[], Any], names: ValueNames, *, cluster: bool, timeout_s: float,
                 breaker: CircuitBreaker, clock: Callable[[], float] = time.monotonic,
                 connect_timeout_s: float = 0.0) -> None:
        self._connect = connect
        self._client: Any | None = None
        self.names = names
        self._cluster = cluster
        self._timeout_s = timeout_s
        self._call_s = connect_timeout_s + timeout_s
        self.breaker = breaker
        self._clock = clock
        self.delete_errors = 0

    @property
    def available(self) -> bool:
        """Whether the server may be asked now (the breaker is closed, or its cool-down is over)."""
        return self.breaker.allow()

    def check(self) -> bool:
        """One ``PING`` (as the workers do at start-up); False when it failed: then the probe is off for now."""
        if self._call(lambda client: client.ping(), self._call_s) is not None:
            return True
        self.breaker.trip()
        return False

    def leading_run(self, keys: Sequence[OffloadKey]) -> int | None:
        """How many leading ``keys`` have every rank's value on the server; None: the server did not answer."""
        if not keys:
            return 0
        started = self._clock()
        exact = self._exact if self._cluster else self._counting
        run: int | None = self._call(lambda client: exact(client, keys, started), self._call_s)
        return run

    def delete(self, keys: Sequence[OffloadKey]) -> bool:
        """``DEL`` every rank's value of ``keys``; False (counted in ``delete_errors``) if it failed or was skipped."""
        if not keys:
            return True
        names = self.names.of(keys)

        def run(client: Any) -> bool:
            for i in range(0, len(names), DELETE_BATCH):
                client.delete(*names[i:i + DELETE_BATCH])  # a cluster client splits it by hash slot
            return True

        if self._call(run) is None:
            self.delete_errors += len(keys)
            return False
        return True

    def _call(self, command: Callable[[Any], Any], total_s: float = math.inf) -> Any | None:
        """``command(client)`` within ``total_s``, its failure a None (the breaker is told either way)."""
        if not self.breaker.allow():
            return None
        try:
            with within(total_s):  # a cluster client's connect is in its constructor
                if self._client is None:
                    self._client = without_retries(self._connect())
                result = command(self._client)
        except _FAILURES as e:
            self.breaker.fail(e, at_once=isinstance(e, _AT_ONCE))
            return None
        self.breaker.record(True)
        return result

    def _counting(self, client: Any, keys: Sequence[OffloadKey], started: float) -> int:
        """The run by ``EXISTS`` counts over growing windows (see the module docstring); ``low <= run <= high``."""
        world = self.names.copies
        low, high, end = 0, len(keys), min(len(keys), FIRST_WINDOW)
        for _ in range(MAX_ROUNDS):
            window = keys[low:end]
            count = int(client.exists(*self.names.of(window)))
            if count == world * len(window):
                low, end = end, min(high, end + (end - low) * GROWTH)
            else:
                # The run's values in the window are all counted, so the run ends within ``count`` keys of low.
                high = min(high, low + count // world, end - 1)
                end = high
            if low >= high:
                return low
            self._check_deadline(started)
        return low + self._exact(client, keys[low:high], started)

    def _exact(self, client: Any, keys: Sequence[OffloadKey], started: float) -> int:
        """The run by one pipeline of single ``EXISTS``, window by window."""
        world = self.names.copies
        low, end = 0, min(len(keys), FIRST_WINDOW)
        while low < len(keys):
            pipe = client.pipeline(transaction=False)
            for name in self.names.of(keys[low:end]):
                pipe.exists(name)
            found = pipe.execute()
            for i in range(end - low):
                if not all(found[i * world:(i + 1) * world]):
                    return low + i
            low, end = end, min(len(keys), end + (end - low) * GROWTH)
            self._check_deadline(started)
        return low

    def _check_deadline(self, started: float) -> None:
        if self._clock() - started > self._timeout_s:
            raise rex.TimeoutError(f"an existence lookup took longer than the {self._timeout_s:.3f} s timeout")

