"""A conformance suite for ``TransferHandler`` implementations, ours and third parties'.

A handler's author writes a ``HandlerHarness`` (fresh handlers, jobs whose result can be checked, a job the
handler accepts but cannot complete) and runs every check against it::

    from kvoffload.testing.conformance import ALL_CHECKS

    @pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
    def test_my_handler_conforms(check):
        check(MyHarness())

Each check builds its own handler, shuts it down, and raises ``ConformanceError`` naming the broken rule of the
interface in ``kvoffload.transfer.base``: every accepted job reported exactly once; ``wait`` returns only once the
asked jobs are finished, with their results still queued; a failure is a result, never an exception; two jobs
writing one destination finish in submission order; a shut-down handler refuses jobs; ``shutdown`` is idempotent.
``DeviceHostHarness`` (``testing/device_host_harness.py``) is the harness of our device<->host handler and a
model for others.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvoffload.blocks import JobId, TransferJob
from kvoffload.transfer.base import TransferHandler, TransferResult

MAX_OUTSTANDING = 16
"""The most jobs a check has in flight at once: a harness's recent jobs must not overlap (see ``make_job``)."""


class ConformanceError(AssertionError):
    """A handler broke a rule of the ``TransferHandler`` interface; the message says which."""


class HandlerHarness(ABC):
    """What a handler's author provides to run the suite.

    The harness owns the memory jobs read and write (KV views, host pool, files) and fills sources with fresh
    bytes as it makes jobs, so ``verify`` can tell a copy apart from stale data.
    """

    @abstractmethod
    def new_handler(self) -> TransferHandler:
        """A fresh handler over the harness's memory; the check shuts it down."""

    @abstractmethod
    def make_job(self, job_id: JobId) -> TransferJob:
        """A valid job whose source now holds fresh bytes.

        Its source and destination must not overlap those of the previous ``MAX_OUTSTANDING`` jobs made.
        """

    @abstractmethod
    def make_same_destination_jobs(self, first: JobId, second: JobId) -> tuple[TransferJob, TransferJob]:
        """Two valid jobs with one destination and different sources holding different fresh bytes."""

    @abstractmethod
    def make_failing_job(self, job_id: JobId) -> TransferJob:
        """A job the harness's handlers accept but cannot complete (e.g. by fault injection)."""

    @abstractmethod
    def verify(self, job: TransferJob) -> bool:
        """Whether ``job``'s destination holds its source's bytes."""

    @abstractmethod
    def job_bytes(self, job: TransferJob) -> int:
        """Bytes that ``job`` copies when it succeeds."""


Check = Callable[[HandlerHarness], None]


def _fail(rule: str) -> ConformanceError:
    return ConformanceError(f"TransferHandler rule broken: {rule}")


@contextmanager
def _handler(harness: HandlerHarness) -> Iterator[TransferHandler]:
    handler = harness.new_handler()
    try:
        yield handler
    finally:
        handler.shutdown()


def _submit(handler: TransferHandler, job: TransferJob) -> None:
    if not handler.submit(job):
        raise _fail(f"a running handler refused valid job {job.job_id}")


def _finish(handler: TransferHandler, jobs: list[TransferJob]) -> dict[JobId, TransferResult]:
    """Wait for ``jobs``, then take their results in one ``get_finished`` call, checking each comes once."""
    handler.wait([j.job_id for j in jobs])
    results: dict[JobId, TransferResult] = {}
    for r in handler.get_finished():
        if r.job_id in results:
            raise _fail(f"job {r.job_id} reported twice in one get_finished()")
        results[r.job_id] = r
    missing = [j.job_id for j in jobs if j.job_id not in results]
    if missing:
        raise _fail(f"wait() returned but get_finished() lacks jobs {missing}")
    return results


def _check_success(harness: HandlerHarness, job: TransferJob, result: TransferResult) -> None:
    if not result.success:
        raise _fail(f"valid job {job.job_id} failed")
    if result.bytes != harness.job_bytes(job):
        raise _fail(f"job {job.job_id} reports {result.bytes} bytes, copied {harness.job_bytes(job)}")
    if result.transfer_type != job.transfer_type or result.seconds < 0:
        raise _fail(f"job {job.job_id}: result {result} has a wrong transfer_type or negative seconds")
    if not harness.verify(job):
        raise _fail(f"job {job.job_id} succeeded but its destination does not hold the source bytes")


def check_job_succeeds_with_its_bytes(harness: HandlerHarness) -> None:
    """One valid job: accepted, successful, byte count and destination right."""
    with _handler(harness) as handler:
        job = harness.make_job(JobId(1))
        _submit(handler, job)
        _check_success(harness, job, _finish(handler, [job])[job.job_id])


def check_each_result_reported_once(harness: HandlerHarness) -> None:
    """Results never repeat across ``get_finished`` calls, before or after more waits."""
    with _handler(harness) as handler:
        jobs = [harness.make_job(JobId(i)) for i in range(1, 5)]
        for job in jobs:
            _submit(handler, job)
        _finish(handler, jobs)
        handler.wait([j.job_id for j in jobs])
        again = handler.get_finished()
        if again:
            raise _fail(f"results reported again: {[r.job_id for r in again]}")


def check_wait_returns_after_asked_jobs(harness: HandlerHarness) -> None:
    """After ``wait([id])`` the destination is written; unknown ids do not block."""
    with _handler(harness) as handler:
        first, second = harness.make_job(JobId(1)), harness.make_job(JobId(2))
        _submit(handler, first)
        _submit(handler, second)
        handler.wait([first.job_id])
        if not harness.verify(first):
            raise _fail(f"wait([{first.job_id}]) returned before job {first.job_id} wrote its destination")
        handler.wait([JobId(10_000)])
        _finish(handler, [first, second])


def check_failure_is_a_result(harness: HandlerHarness) -> None:
    """A job that cannot complete is accepted and reported failed; the handler keeps working."""
    with _handler(harness) as handler:
        bad = harness.make_failing_job(JobId(1))
        _submit(handler, bad)
        if _finish(handler, [bad])[bad.job_id].success:
            raise _fail(f"job {bad.job_id}, which cannot complete, reported success")
        good = harness.make_job(JobId(2))
        _submit(handler, good)
        _check_success(harness, good, _finish(handler, [good])[good.job_id])


def check_many_jobs_all_arrive(harness: HandlerHarness) -> None:
    """``MAX_OUTSTANDING`` jobs in flight at once all succeed, each reported once."""
    with _handler(harness) as handler:
        jobs = [harness.make_job(JobId(i)) for i in range(1, MAX_OUTSTANDING + 1)]
        for job in jobs:
            _submit(handler, job)
        results = _finish(handler, jobs)
        for job in jobs:
            _check_success(harness, job, results[job.job_id])


def check_same_destination_in_submission_order(harness: HandlerHarness) -> None:
    """Two jobs writing one destination: the second one's bytes are what remains."""
    with _handler(harness) as handler:
        first, second = harness.make_same_destination_jobs(JobId(1), JobId(2))
        _submit(handler, first)
        _submit(handler, second)
        results = _finish(handler, [first, second])
        if not (results[first.job_id].success and results[second.job_id].success):
            raise _fail("a valid job of a same-destination pair failed")
        if not harness.verify(second) or harness.verify(first):
            raise _fail(f"job {first.job_id} overwrote job {second.job_id}, submitted after it")


def check_submit_after_shutdown_refused(harness: HandlerHarness) -> None:
    """A shut-down handler returns False from ``submit`` and never reports that job."""
    handler = harness.new_handler()
    handler.shutdown()
    job = harness.make_job(JobId(1))
    if handler.submit(job):
        raise _fail("submit() after shutdown() accepted a job")
    handler.wait([job.job_id])
    if handler.get_finished():
        raise _fail("a job refused after shutdown() was reported")


def check_shutdown_is_idempotent(harness: HandlerHarness) -> None:
    """A second ``shutdown`` is harmless, and a job accepted before it is still reported once."""
    handler = harness.new_handler()
    job = harness.make_job(JobId(1))
    _submit(handler, job)
    handler.shutdown()
    handler.shutdown()
    reported = [r.job_id for r in handler.get_finished() + handler.get_finished()]
    if reported != [job.job_id]:
        raise _fail(f"job {job.job_id}, accepted before shutdown(), reported {reported} (want it once)")


ALL_CHECKS: tuple[Check, ...] = (
    check_job_succeeds_with_its_bytes,
    check_each_result_reported_once,
    check_wait_returns_after_asked_jobs,
    check_failure_is_a_result,
    check_many_jobs_all_arrive,
    check_same_destination_in_submission_order,
    check_submit_after_shutdown_refused,
    check_shutdown_is_idempotent,
)


def check_transfer_handler(harness: HandlerHarness) -> None:
    """Run every check against ``harness``.

    Raises:
        ConformanceError: the first broken rule.
    """
    for check in ALL_CHECKS:
        check(harness)
