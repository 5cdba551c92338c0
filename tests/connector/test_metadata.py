import pickle

from kvoffload.blocks import DeviceBlocks, HostBlocks, JobId, TransferJob
from kvoffload.connector.metadata import ConnectorMetadata, LoadJob, WorkerReport


def test_worker_reports_add_up_across_workers():
    a = WorkerReport.of([JobId(1), JobId(2)], [JobId(3)])
    b = WorkerReport.of([JobId(1)], [JobId(2)])
    total = a.aggregate(b)
    assert total.completed == {1: 2, 2: 1}
    assert total.failed == {3: 1, 2: 1}
    assert not total.is_empty
    assert WorkerReport().is_empty


def test_metadata_pickles_small():
    job = TransferJob(JobId(7), HostBlocks((1, 2), (2,)), DeviceBlocks((5, 6), (2,)))
    meta = ConnectorMetadata(load_jobs=(LoadJob("r", job),), jobs_to_flush=frozenset({JobId(3)}))
    again = pickle.loads(pickle.dumps(meta))
    assert again == meta
    assert len(pickle.dumps(meta)) < 1024
    assert ConnectorMetadata().is_empty and not meta.is_empty
