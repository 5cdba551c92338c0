"""The worker half around a KV-cache release: ``unregister_kv_caches`` and ``restore_kv_caches``.

vLLM (0.33 on) calls unregister while the pages still hold their bytes, then releases them, maps fresh zeroed
pages at the same addresses and calls restore. These tests play that on CPU tensors: unregister, then
``recommit`` (every page zeroed, one block rewritten by the engine), then restore.
"""

from kvoffload.blocks import DeviceBlocks, HostBlocks, JobId, Medium, TierBlocks, TransferJob
from kvoffload.config import OffloadConfig
from kvoffload.connector.metadata import ConnectorMetadata, LoadJob
from kvoffload.connector.worker import ConnectorWorker, WorkerFinished
from kvoffload.keys import Namespace, offload_key
from kvoffload.testing.layouts import attention_layout
from kvoffload.tiers.disk.engine_files import prepare_engine
from kvoffload.tiers.disk.slot_file import location
from kvoffload.tiers.lower.block_format import PLAIN

NEW = 7  # what the engine writes after the recommit; the seeded bytes are random in [1, 63]


def make_worker(**config):
    layout, make_kv = attention_layout(num_blocks=8, block_size=4)
    worker = ConnectorWorker(OffloadConfig.from_dict({"host_bytes": 1 << 20, **config}), layout, 4,
                             Namespace("m", "fp16", layout.describe()))
    worker.register_kv_caches(make_kv())
    assert worker.pool is not None
    worker.pool.buffer.zero_()  # a slot nothing copied into stays zero
    return worker


def store(job_id, block, slot):
    return TransferJob(JobId(job_id), DeviceBlocks((block,), (1,)), HostBlocks((slot,), (1,)))


def load(job_id, slot, block):
    return TransferJob(JobId(job_id), HostBlocks((slot,), (1,)), DeviceBlocks((block,), (1,)))


def pages(worker, block):
    return [view[block].clone() for view in worker.kv.views]


def recommit(worker, rewritten):
    """What vLLM does between the hooks: fresh zeroed pages, then the engine writes one block anew."""
    for view in worker.kv.views:
        view.zero_()
        view[rewritten].fill_(NEW)


def next_step(worker, meta=None):
    worker.start_kv_transfers(meta or ConnectorMetadata())
    worker.wait_all()
    return worker.get_finished()


def slot_is_empty(worker, slot):
    return not worker.pool.buffer[slot].any()


def test_a_store_deferred_before_unregister_fails_and_never_reads_the_recommitted_pages():
    worker = make_worker()
    worker.prepare_store_kv(ConnectorMetadata(store_jobs=(store(0, 3, 0),)))

    worker.unregister_kv_caches()
    recommit(worker, rewritten=3)
    worker.restore_kv_caches()
    poll = next_step(worker)

    assert poll.report.failed == {0: 1} and poll.report.completed == {}
    assert slot_is_empty(worker, 0)


def test_a_store_in_flight_at_unregister_finishes_first_with_the_old_bytes():
    worker = make_worker()
    old = pages(worker, 3)
    meta = ConnectorMetadata(store_jobs=(store(0, 3, 0),))
    worker.prepare_store_kv(meta)
    worker.handle_preemptions(ConnectorMetadata())  # the next step submits it: its copy runs in the background

    worker.unregister_kv_caches()
    recommit(worker, rewritten=3)
    worker.restore_kv_caches()
    poll = next_step(worker, ConnectorMetadata(load_jobs=(LoadJob("r", load(1, 0, 5)),)))

    assert poll.report.completed == {0: 1, 1: 1} and poll.report.failed == {}
    assert all(now.equal(before) for now, before in zip(pages(worker, 5), old, strict=True))


def test_a_load_not_yet_reported_at_unregister_fails_and_names_its_blocks():
    worker = make_worker()
    worker.start_kv_transfers(ConnectorMetadata(load_jobs=(LoadJob("r", load(0, 0, 6)),)))

    worker.unregister_kv_caches()
    recommit(worker, rewritten=3)
    worker.restore_kv_caches()
    poll = worker.get_finished()

    assert poll.finished_loads == {"r"} and poll.failed_loads == {"r"} and poll.load_errors == {6}
    assert poll.report.failed == {0: 1} and poll.report.completed == {}


def test_device_jobs_while_unregistered_fail_without_touching_the_pages():
    worker = make_worker()
    worker.pool.buffer[0].fill_(NEW)
    before = pages(worker, 6)
    worker.unregister_kv_caches()

    meta = ConnectorMetadata(load_jobs=(LoadJob("r", load(0, 0, 6)),), store_jobs=(store(1, 2, 1),))
    worker.start_kv_transfers(meta)
    worker.prepare_store_kv(meta)
    worker.handle_preemptions(ConnectorMetadata())
    worker.wait_all()
    poll = worker.get_finished()

    assert poll.report.failed == {0: 1, 1: 1} and poll.report.completed == {}
    assert poll.failed_loads == {"r"} and poll.load_errors == {6}
    assert all(now.equal(b) for now, b in zip(pages(worker, 6), before, strict=True))
    assert slot_is_empty(worker, 1)


def test_tier_jobs_go_on_while_unregistered(tmp_path):
    worker = make_worker(disk_path=str(tmp_path / "disk"), disk_bytes=1 << 22)
    assert worker.pool is not None
    config = OffloadConfig.from_dict({"disk_path": str(tmp_path / "disk"), "disk_bytes": 1 << 22}).disk
    assert config is not None
    prepare_engine(config, worker.namespace, PLAIN.file_bytes(worker.pool.slot_bytes))  # the scheduler's part
    worker.pool.buffer[0].fill_(NEW)
    key = offload_key(b"block", 0)  # type: ignore[arg-type]
    slot = (location(0, 0),)
    write = TransferJob(JobId(0), HostBlocks((0,), (1,)), TierBlocks(Medium.DISK, (key,), (1,), slot))
    read = TransferJob(JobId(1), TierBlocks(Medium.DISK, (key,), (1,), slot), HostBlocks((1,), (1,)))

    worker.unregister_kv_caches()
    written = next_step(worker, ConnectorMetadata(tier_jobs=(write,)))
    read_back = next_step(worker, ConnectorMetadata(tier_jobs=(read,)))

    assert written.report.completed == {0: 1} and read_back.report.completed == {1: 1}
    assert worker.pool.buffer[1].equal(worker.pool.buffer[0])
    worker.shutdown()


def test_jobs_after_restore_round_trip_the_new_bytes():
    worker = make_worker()
    worker.unregister_kv_caches()
    recommit(worker, rewritten=3)
    worker.restore_kv_caches()
    new = pages(worker, 3)

    worker.prepare_store_kv(ConnectorMetadata(store_jobs=(store(0, 3, 0),)))
    stored = next_step(worker)
    loaded = next_step(worker, ConnectorMetadata(load_jobs=(LoadJob("r", load(1, 0, 5)),)))

    assert stored.report.completed == {0: 1} and loaded.report.completed == {1: 1}
    assert loaded.failed_loads == set() and loaded.load_errors == set()
    assert all(now.equal(b) for now, b in zip(pages(worker, 5), new, strict=True))


def test_each_job_is_reported_once_across_repeated_hooks():
    worker = make_worker()
    worker.start_kv_transfers(ConnectorMetadata(load_jobs=(LoadJob("a", load(0, 0, 6)),)))
    worker.prepare_store_kv(ConnectorMetadata(store_jobs=(store(1, 2, 1),)))
    worker.handle_preemptions(ConnectorMetadata())  # store 1 in flight
    worker.prepare_store_kv(ConnectorMetadata(store_jobs=(store(2, 3, 2),)))  # store 2 deferred

    worker.unregister_kv_caches()
    worker.unregister_kv_caches()  # vLLM: idempotent (sleep after a discard)
    recommit(worker, rewritten=3)
    worker.restore_kv_caches()
    worker.restore_kv_caches()
    polls = [worker.get_finished(), next_step(worker), next_step(worker)]

    completed = [job for p in polls for job, n in p.report.completed.items() for _ in range(n)]
    failed = [job for p in polls for job, n in p.report.failed.items() for _ in range(n)]
    assert sorted(completed) == [1] and sorted(failed) == [0, 2]
    assert polls[1:] == [WorkerFinished(), WorkerFinished()]
