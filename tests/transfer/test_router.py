"""The router: jobs go to the handler of their media pair; handler exceptions never reach the engine step."""

import pytest

from kvoffload.blocks import DeviceBlocks, HostBlocks, JobId, Medium, TransferJob
from kvoffload.transfer.base import TransferHandler, TransferResult
from kvoffload.transfer.faults import FailFirstLoads
from kvoffload.transfer.router import JobRouter


class InstantHandler(TransferHandler):
    """Finishes every job at once (a handler whose copies take no time), or raises when told to."""

    def __init__(self, raise_on_submit=False):
        self.raise_on_submit = raise_on_submit
        self.done: list[TransferResult] = []
        self.waited: list[JobId] = []
        self.closed = False

    def submit(self, job):
        if self.raise_on_submit:
            raise OSError("device lost")
        self.done.append(TransferResult(job.job_id, True, 10, 0.1, job.transfer_type))
        return True

    def get_finished(self):
        done, self.done = self.done, []
        return done

    def wait(self, job_ids):
        self.waited.extend(job_ids)

    def shutdown(self):
        self.closed = True


def store(job_id):
    return TransferJob(JobId(job_id), DeviceBlocks((1,), (1,)), HostBlocks((0,), (1,)))


def load(job_id):
    return TransferJob(JobId(job_id), HostBlocks((0,), (1,)), DeviceBlocks((1,), (1,)))


def test_jobs_are_routed_by_media_pair_and_waits_go_to_their_handler():
    to_host, to_device = InstantHandler(), InstantHandler()
    router = JobRouter()
    router.register(Medium.DEVICE, Medium.HOST, to_host)
    router.register(Medium.HOST, Medium.DEVICE, to_device)
    assert router.submit(store(1)) and router.submit(load(2))
    router.wait([JobId(1), JobId(2)])
    assert (to_host.waited, to_device.waited) == ([1], [2])
    assert sorted(r.job_id for r in router.get_finished()) == [1, 2]
    router.shutdown()
    assert to_host.closed and to_device.closed


def test_a_handler_that_raises_on_submit_refuses_the_job():
    router = JobRouter()
    router.register(Medium.DEVICE, Medium.HOST, InstantHandler(raise_on_submit=True))
    assert router.submit(store(1)) is False


def test_a_job_without_a_route_is_a_programming_error():
    router = JobRouter()
    with pytest.raises(ValueError, match="no handler for device -> host"):
        router.submit(store(1))
    router.register(Medium.DEVICE, Medium.HOST, InstantHandler())
    with pytest.raises(ValueError, match="already registered"):
        router.register(Medium.DEVICE, Medium.HOST, InstantHandler())


def test_fault_injection_fails_only_the_first_loads_and_copies_nothing_for_them():
    inner = InstantHandler()
    faulty = FailFirstLoads(inner, 2)
    for job in (load(1), store(2), load(3), load(4)):
        assert faulty.submit(job)
    results = {r.job_id: r.success for r in faulty.get_finished()}
    assert results == {1: False, 2: True, 3: False, 4: True}
