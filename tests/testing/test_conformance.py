"""HostCopier against the handler conformance suite, in both directions (CPU; CUDA when present)."""

from __future__ import annotations

import pytest
import torch

from kvoffload.blocks import JobId, TransferJob
from kvoffload.testing.conformance import ALL_CHECKS, Check, ConformanceError, check_transfer_handler
from kvoffload.testing.device_host_harness import DeviceHostHarness
from kvoffload.transfer.base import TransferHandler, TransferResult

DIRECTIONS = {"store": True, "load": False}


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_device_host_handler_passes_check_on_cpu(check: Check, direction: str) -> None:
    check(DeviceHostHarness(store=DIRECTIONS[direction]))


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_device_host_handler_with_one_thread_and_factor_one_conforms(direction: str) -> None:
    check_transfer_handler(DeviceHostHarness(store=DIRECTIONS[direction], factor=1, threads=1))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_device_host_handler_conforms_on_cuda(direction: str) -> None:
    check_transfer_handler(DeviceHostHarness(store=DIRECTIONS[direction], device="cuda"))


class _ReportsTwice(TransferHandler):
    """A broken handler: reports every job on every get_finished call."""

    def __init__(self, harness: DeviceHostHarness) -> None:
        self._inner = DeviceHostHarness.new_handler(harness)
        self._seen: list[TransferResult] = []

    def submit(self, job: TransferJob) -> bool:
        return self._inner.submit(job)

    def get_finished(self) -> list[TransferResult]:
        self._seen += self._inner.get_finished()
        return list(self._seen)

    def wait(self, job_ids: object) -> None:
        self._inner.wait(job_ids)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        self._inner.shutdown()


class _AcceptsAfterShutdown(_ReportsTwice):
    """A broken handler: keeps accepting after shutdown."""

    def get_finished(self) -> list[TransferResult]:
        return self._inner.get_finished()

    def submit(self, job: TransferJob) -> bool:
        self._inner.submit(job)
        return True


class _BrokenHarness(DeviceHostHarness):
    def __init__(self, broken: type[_ReportsTwice]) -> None:
        super().__init__(store=True)
        self._broken = broken

    def new_handler(self) -> TransferHandler:
        return self._broken(self)


def test_suite_catches_a_handler_that_reports_results_twice() -> None:
    from kvoffload.testing.conformance import check_each_result_reported_once

    with pytest.raises(ConformanceError, match="reported again"):
        check_each_result_reported_once(_BrokenHarness(_ReportsTwice))


def test_suite_catches_a_handler_that_accepts_jobs_after_shutdown() -> None:
    from kvoffload.testing.conformance import check_submit_after_shutdown_refused

    with pytest.raises(ConformanceError, match="after shutdown"):
        check_submit_after_shutdown_refused(_BrokenHarness(_AcceptsAfterShutdown))


def test_harness_verify_rejects_a_job_that_was_never_run() -> None:
    harness = DeviceHostHarness(store=True)
    assert not harness.verify(harness.make_job(JobId(1)))
