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

Failures are misses, never exceptions and never stalls: every request is bounded by the configured timeouts, a
search by ``timeout_s`` over all its rounds; a timeout, a refusal (403) or throttling (503) switches the probe off
at once for the cool-down (each further attempt would cost the scheduler the same wait, or add to the load of a
throttling store), other errors count towards ``breaker_errors`` in a row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as futures_timeout
from typing import Any, NoReturn

from kvoffload.keys import OffloadKey
from kvoffload.tiers.lower.breaker import CircuitBreaker
from kvoffload.tiers.object.client import ObjectNames
from kvoffload.tiers.object.faults import classify, error_code, is_missing

logger = logging.getLogger(__name__)

DELETE_BATCH = 1000
"""Names per ``DeleteObjects`` request (the API's limit)."""


class _Failed(Exception):
    """A request of the search failed (not a miss): the search has no answer."""


class ObjectProbe:
    """Prefix searches and deletes against the bucket, behind a breaker; used by the scheduler thread alone.

    Args:
        client: a boto3 S3 client (thread-safe).
        bucket: the bucket.
        names: the object names of this world.
        fanout: existence requests in flight at once in a search round.
        timeout_s: the most one ``leading_run`` may take over all its rounds; a slower one is a timeout.
        breaker: switches the probe off after failures.
        clock: monotonic seconds.
    """

    def __init__(self, client: Any, bucket: str, names: ObjectNames, *, fanout: int, timeout_s: float,
                 breaker: CircuitBreaker, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._bucket = bucket
        self.names = names
        self._fanout = max(1, fanout)
        self._timeout_s = timeout_s
        self.breaker = breaker
        self._clock = clock
        self._pool = ThreadPoolExecutor(self._fanout * names.copies, "kvoffload-object-probe")
        self.requests = 0
        """Existence requests sent so far (for the bench and tests)."""
        self.rounds = 0
        """Search rounds so far (one round: requests in parallel, then their answers)."""
        self.delete_errors = 0

    @property
    def available(self) -> bool:
        """Whether the store may be asked now (the breaker is closed, or its cool-down is over)."""
        return self.breaker.allow()

    def check(self) -> bool:
        """One ``HeadBucket`` (as the workers do at start-up); False when it failed: then the probe is off."""
        try:
            self._client.head_bucket(Bucket=self._bucket)
        except Exception as e:
            self.breaker.trip()
            logger.warning("object tier (scheduler): bucket %s does not answer (%s: %s); lookups are misses for now",
                           self._bucket, classify(e).value, e)
            return False
        return True

    def leading_run(self, keys: Sequence[OffloadKey]) -> int | None:
        """How many leading ``keys`` have every rank's object in the bucket; None: the store did not answer."""
        if not keys:
            return 0
        if not self.breaker.allow():
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
        if not self.breaker.allow():
            self.delete_errors += len(keys)
            return False
        names = [name for key in keys for name in self.names.of(key)]
        try:
            for i in range(0, len(names), DELETE_BATCH):
                batch = [{"Key": name} for name in names[i:i + DELETE_BATCH]]
                answer = self._client.delete_objects(Bucket=self._bucket, Delete={"Objects": batch, "Quiet": True})
                if answer.get("Errors"):
                    raise RuntimeError(f"{len(answer['Errors'])} objects not deleted: {answer['Errors'][0]}")
        except Exception as e:
            self._tell_breaker(e)
            self.delete_errors += len(keys)
            return False
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def _round(self, keys: Sequence[OffloadKey], probes: list[int], started: float) -> list[bool]:
        """Whether every rank's object of each probed key exists: one round of parallel requests."""
        remaining = self._timeout_s - (self._clock() - started)
        if remaining <= 0:
            self._failed(TimeoutError(f"an existence search took longer than the {self._timeout_s:.3f} s timeout"))
        names = [(p, name) for p in probes for name in self.names.of(keys[p])]
        futures = [self._pool.submit(self._exists, name) for _, name in names]
        self.rounds += 1
        self.requests += len(names)
        try:
            answers = [f.result(timeout=remaining) for f in futures]
        except (TimeoutError, futures_timeout):  # one class from Python 3.11 on, two before
            self._failed(TimeoutError(f"an existence search took longer than the {self._timeout_s:.3f} s timeout"))
        errors = [a for a in answers if isinstance(a, BaseException)]
        if errors:
            self._failed(errors[0])
        exists = dict.fromkeys(probes, True)
        for (p, _), answer in zip(names, answers, strict=True):
            exists[p] = exists[p] and answer is True
        return [exists[p] for p in probes]

    def _exists(self, name: str) -> bool | BaseException:
        """Whether object ``name`` exists, by a GET of its first byte; an error other than a miss is returned.

        Not a ``HEAD``: a HEAD's error has no body, so a missing bucket answers the same 404 as a missing object
        and a deleted bucket would look empty (a miss) instead of a fault. A one-byte GET costs a GET (priced as a
        HEAD on AWS), and its error names ``NoSuchKey`` or ``NoSuchBucket``. An empty object (416) exists: the
        worker's load finds it damaged and deletes it.
        """
        try:
            # Read, not closed unread: only a connection whose answer was read whole goes back to the pool.
            self._client.get_object(Bucket=self._bucket, Key=name, Range="bytes=0-0")["Body"].read()
        except Exception as e:
            if is_missing(e):
                return False
            return True if error_code(e) == "InvalidRange" else e
        return True

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
