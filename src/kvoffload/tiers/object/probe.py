"""The scheduler half's questions to the object store: how long a prompt's stored prefix is, and deleting this
engine's own objects.

Place in the data flow: ``ObjectIndex`` asks ``ObjectProbe.leading_run(keys)`` how many leading keys have every
rank's object in the bucket (a promotion may read them now), and ``delete(keys)`` when keys leave its own budget.
The workers' ``ObjectHandler`` moves the objects; nothing here reads or writes one.

Cost is the point of this module. S3 has no multi-key existence test, and one existence request (a GET of an
object's first byte: ``_exists`` says why not a ``HEAD``) costs 2-3 ms here, 10-30 ms on AWS: the 2,048 keys of a
long prompt, one by one, would be seconds. Keys are chained content hashes, so what a bucket holds of a prompt is
nearly always a prefix, and its length is found by search: one request for the first key (a new prompt, the
common case, costs one request), then rounds of ``fanout`` parallel requests spread evenly over the keys still in
doubt; each round divides them by ``fanout``. A 2,048-key prompt takes at most 1 + 4 rounds at a fan-out of 8
(``bench object`` has the figures). The first round over the rest includes its last key, so a prompt stored whole
is found in two rounds.

The answer assumes the stored keys are a prefix. Where they are not (a lifecycle rule or another engine deleted
a block inside the run), the run may count a key that is gone: its promotion fails in the worker, which reads
every object and verifies it, and the engine recomputes those tokens. It never serves a wrong block.

Failures are misses, never exceptions and never stalls: a search ends by ``timeout_s`` over all its rounds (its
requests' sockets are shut down then, ``tiers.lower.deadline``), a delete or the start-up check by ``request_s``
(connection included), whatever the server sends or how slowly; a timeout, a refusal (403) or throttling (503)
switches the probe off at once for the cool-down (each further attempt would cost the scheduler the same wait, or
add to the load of a throttling store), other errors count towards ``breaker_errors`` in a row. A store that is
not one (the start-up check found an object nobody wrote) switches the probe off for good.

Thread-safety: ``leading_run`` and ``delete`` may run at once on different threads (the index runs them in the
background); the counters are kept under a lock, the client and the request pool are thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

from kvoffload.keys import OffloadKey
from kvoffload.tiers.lower.breaker import CircuitBreaker
from kvoffload.tiers.lower.deadline import WATCHDOG, result_by
from kvoffload.tiers.object.client import NotAnObjectStore, ObjectNames, check_store, exists
from kvoffload.tiers.object.faults import classify

logger = logging.getLogger(__name__)

DELETE_BATCH = 1000
"""Names per ``DeleteObjects`` request (the API's limit)."""


class _Failed(Exception):
    """A request of the search failed (not a miss): the search has no answer."""


class ObjectProbe:
    """Prefix searches and deletes against the bucket, behind a breaker; thread-safe.

    Args:
        client: a boto3 S3 client (thread-safe).
        bucket: the bucket.
        names: the object names of this world.
        fanout: existence requests in flight at once in a search round.
        timeout_s: the most one ``leading_run`` may take over all its rounds; a slower one is a timeout.
        breaker: switches the probe off after failures.
        clock: monotonic seconds (for the search's timeout; the requests' own deadlines are on the real clock).
        request_s: the most a delete request or the start-up check may take (None: ``timeout_s``).
        where: the store, as logs name it (``client.where_of``; "": the client's endpoint and ``bucket``).
    """

    def __init__(self, client: Any, bucket: str, names: ObjectNames, *, fanout: int, timeout_s: float,
                 breaker: CircuitBreaker, clock: Callable[[], float] = time.monotonic,
                 request_s: float | None = None, where: str = "") -> None:
        self._client = client
        self._bucket = bucket
        self.names = names
        self._fanout = max(1, fanout)
        self._timeout_s = timeout_s
        self._request_s = request_s if request_s is not None else timeout_s
        self._where = where or f"{getattr(getattr(client, 'meta', None), 'endpoint_url', 'S3')} bucket {bucket}"
        self.breaker = breaker
        self._clock = clock
        self._pool = ThreadPoolExecutor(self._fanout * names.copies, "kvoffload-object-probe")
        self._lock = threading.Lock()
        self.refused: str | None = None
        """Why the store is not one (the start-up check); then the probe is off for good."""
        self.requests = 0
        """Existence requests sent so far (for the bench and tests)."""
        self.rounds = 0
        """Search rounds so far (one round: requests in parallel, then their answers)."""
        self.delete_errors = 0

    @property
    def available(self) -> bool:
        """Whether the store may be asked now (it is one, and the breaker is closed or its cool-down is over)."""
        return self.refused is None and self.breaker.allow()

    def check(self) -> bool:
        """The start-up check (``client.check_store``, as the workers do), within ``request_s``; False when it
        failed: then the probe is off, for the cool-down, or for good where the store is not one."""
        at = time.monotonic() + self._request_s
        try:
            future = self._pool.submit(check_store, self._client, self._bucket, self.names.base, self._where, at)
            result_by(future, at, "the object tier's start-up check")
        except NotAnObjectStore as e:
            self.refused = str(e)
            logger.error("%s (scheduler: every lookup is a miss)", e)
            return False
        except Exception as e:
            self.breaker.trip()
            logger.warning("object tier (scheduler): %s does not answer (%s: %s); lookups are misses for now",
                           self._where, classify(e).value, e)
            return False
        return True

    def leading_run(self, keys: Sequence[OffloadKey]) -> int | None:
        """How many leading ``keys`` have every rank's object in the bucket; None: the store did not answer."""
        if not keys:
            return 0
        if not self.available:
            return None
        started = self._clock()
        try:
            if not self._round(keys, [0], started)[0]:
                return self._answered(0)
            low, high = 1, len(keys)  # the run is in [low, high]
            while low < high:
                probes = _spread(low, high, self._fanout)
                found = self._round(keys, probes, started)
                missing = [p for p, ok in zip(probes, found, strict=True) if not ok]
                if not missing:
                    low = probes[-1] + 1
                else:
                    high = missing[0]
                    low = max([low] + [p + 1 for p in probes if p < high])
        except _Failed:
            return None
        return self._answered(low)

    def delete(self, keys: Sequence[OffloadKey]) -> bool:
        """Delete every rank's object of ``keys``; False (counted in ``delete_errors``) if it failed or was
        skipped. Deleting an object that is not there succeeds."""
        if not keys:
            return True
        if not self.available:
            self._count_delete_errors(len(keys))
            return False
        names = [name for key in keys for name in self.names.of(key)]
        try:
            for i in range(0, len(names), DELETE_BATCH):
                at = time.monotonic() + self._request_s
                future = self._pool.submit(self._delete_batch, names[i:i + DELETE_BATCH], at)
                result_by(future, at, "a DeleteObjects request")
        except Exception as e:
            self._tell_breaker(e)
            self._count_delete_errors(len(keys))
            return False
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def _delete_batch(self, names: list[str], at: float) -> None:
        batch = [{"Key": name} for name in names]
        with WATCHDOG.within(at, "a DeleteObjects request"):
            answer = self._client.delete_objects(Bucket=self._bucket, Delete={"Objects": batch, "Quiet": True})
        if answer.get("Errors"):
            raise RuntimeError(f"{len(answer['Errors'])} objects not deleted: {answer['Errors'][0]}")

    def _count_delete_errors(self, n: int) -> None:
        with self._lock:
            self.delete_errors += n

    def _round(self, keys: Sequence[OffloadKey], probes: list[int], started: float) -> list[bool]:
        """Whether every rank's object of each probed key exists: one round of parallel requests."""
        remaining = self._timeout_s - (self._clock() - started)
        if remaining <= 0:
            self._failed(TimeoutError(f"an existence search took longer than the {self._timeout_s:.3f} s timeout"))
        names = [(p, name) for p in probes for name in self.names.of(keys[p])]
        at = time.monotonic() + remaining  # the requests' sockets are shut down when the search ends
        futures = [self._pool.submit(self._exists, name, at) for _, name in names]
        with self._lock:
            self.rounds += 1
            self.requests += len(names)
        try:
            answers = [result_by(f, at) for f in futures]
        except TimeoutError:
            self._failed(TimeoutError(f"an existence search took longer than the {self._timeout_s:.3f} s timeout"))
        errors = [a for a in answers if isinstance(a, BaseException)]
        if errors:
            self._failed(errors[0])
        exists = dict.fromkeys(probes, True)
        for (p, _), answer in zip(names, answers, strict=True):
            exists[p] = exists[p] and answer is True
        return [exists[p] for p in probes]

    def _exists(self, name: str, at: float) -> bool | BaseException:
        """``client.exists``, its error returned (not raised) for the round to tell the breaker."""
        try:
            return exists(self._client, self._bucket, name, at)
        except Exception as e:
            return e

    def _answered(self, run: int) -> int:
        self.breaker.record(True)
        return run

    def _failed(self, error: BaseException) -> NoReturn:
        """Tell the breaker, then end the search."""
        self._tell_breaker(error)
        raise _Failed() from error

    def _tell_breaker(self, error: BaseException) -> None:
        """Count a failure; one every next request would meet (a timeout, a refusal, throttling, no bucket) opens
        the breaker at once."""
        fault = classify(error)
        self.breaker.fail(f"{fault.value}: {error}", at_once=fault.at_once)


def _spread(low: int, high: int, fanout: int) -> list[int]:
    """Up to ``fanout`` distinct positions in ``[low, high - 1]``, evenly spread, the last one ``high - 1``: the
    run (known to be in ``[low, high]``) is then bounded to one of the gaps between them."""
    span = high - low
    if span <= fanout:
        return list(range(low, high))
    return sorted({low - 1 + (span * (j + 1)) // fanout for j in range(fanout)})
