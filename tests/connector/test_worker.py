"""The worker half on its own: deferred stores, load reports, failures as values."""

from kvoffload.blocks import NO_BLOCK, DeviceBlocks, HostBlocks, JobId, TransferJob
from kvoffload.config import OffloadConfig
from kvoffload.connector.metadata import ConnectorMetadata, LoadJob
from kvoffload.connector.worker import ConnectorWorker, WorkerFinished
from kvoffload.keys import Namespace
from kvoffload.testing.layouts import attention_layout


def make_worker(**config):
    layout, make_kv = attention_layout(num_blocks=8, block_size=4)
    worker = ConnectorWorker(OffloadConfig.from_dict({"host_bytes": 1 << 20, **config}), layout, 4,
                             Namespace("m", "fp16", layout.describe()))
    worker.register_kv_caches(make_kv())
    return worker


def store(job_id, block, slot):
    return TransferJob(JobId(job_id), DeviceBlocks((block,), (1,)), HostBlocks((slot,), (1,)))


def load(job_id, slot, block):
    return TransferJob(JobId(job_id), HostBlocks((slot,), (1,)), DeviceBlocks((block,), (1,)))


def test_stores_wait_for_the_next_step_then_round_trip_the_bytes():
    worker = make_worker()
    kv = worker.kv
    meta = ConnectorMetadata(store_jobs=(store(0, 3, 0),))
    worker.start_kv_transfers(meta)
    worker.prepare_store_kv(meta)
    assert worker.transfers.pending_job_ids == []  # deferred: nothing submitted during this step
    worker.start_kv_transfers(ConnectorMetadata())  # the next step submits it
    worker.wait_all()
    # The scheduler half loads a block only once its store completed.
    worker.start_kv_transfers(ConnectorMetadata(load_jobs=(LoadJob("r", load(1, 0, 5)),)))
    worker.wait_all()
    poll = worker.get_finished()
    assert poll.finished_loads == {"r"} and poll.failed_loads == set() and poll.load_errors == set()
    assert poll.report.completed == {0: 1, 1: 1}
    for view in kv.views:
        assert view[5].equal(view[3])
    assert poll.stats is not None and set(poll.stats.by_type) == {"device_to_host", "host_to_device"}
    assert worker.get_finished() == WorkerFinished()  # reset on read


def test_a_failed_load_reports_its_request_and_device_blocks():
    worker = make_worker(inject_load_failures=1)
    worker.start_kv_transfers(ConnectorMetadata(load_jobs=(LoadJob("r", load(0, 0, 6)),)))
    worker.wait_all()
    poll = worker.get_finished()
    assert poll.finished_loads == {"r"} and poll.failed_loads == {"r"} and poll.load_errors == {6}
    assert poll.report.failed == {0: 1} and poll.report.completed == {}


def test_a_failed_load_never_reports_a_hole_as_a_bad_block():
    worker = make_worker(inject_load_failures=1)
    job = TransferJob(JobId(0), HostBlocks((0, 1), (2,)), DeviceBlocks((NO_BLOCK, 6), (2,)))
    worker.start_kv_transfers(ConnectorMetadata(load_jobs=(LoadJob("r", job),)))
    worker.wait_all()
    poll = worker.get_finished()
    assert poll.load_errors == {6} and poll.failed_loads == {"r"}


def test_flushing_waits_for_the_deferred_stores_of_a_finished_request():
    worker = make_worker()
    worker.prepare_store_kv(ConnectorMetadata(store_jobs=(store(0, 2, 1),)))
    worker.handle_preemptions(ConnectorMetadata(jobs_to_flush=frozenset({JobId(0)})))
    assert worker.get_finished().report.completed == {0: 1}
