"""Cost-aware loading in the simulated engine: a deliberately slow disk tier's hits are skipped (recomputed, and
counted), a fast one's are loaded. The slowness is a fake clock that each disk read advances by a time per block
it reads, so nothing waits."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.testing.engines import MADE

from kvoffload.blocks import Medium
from kvoffload.testing import sim_workload
from kvoffload.testing.sim import SimEngine, Status
from kvoffload.testing.sim_workload import tokens
from kvoffload.testing.slot_files import slot_files, stored_blocks
from kvoffload.tiers.disk.file_io import FileOps
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.lower.block_format import file_bytes

PREFILL_TOKENS_PER_S = 1_000.0  # recomputing a 4-block (16-token) prefix costs 16 ms


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowReads(FileOps):
    """Each block read takes ``seconds`` of the fake clock's time (a run of blocks read at once: as many times)."""

    def __init__(self, clock: FakeClock, seconds: float, block_bytes: int) -> None:
        self.clock, self.seconds, self.block_bytes = clock, seconds, block_bytes

    def pread_into(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset:  # offset 0: a slot file's header, read once as the file is opened
            self.clock.now += self.seconds * (sum(len(b) for b in buffers) // self.block_bytes)
        return super().pread_into(fd, buffers, offset)




def make_engine(disk: Path, read_seconds: float, **config: object) -> SimEngine:
    clock = FakeClock()
    engine = sim_workload.make_engine(host_blocks=4, clock=clock, disk_path=str(disk), disk_bytes=1 << 20,
                                      prefill_tokens_per_s=PREFILL_TOKENS_PER_S, disk_read_deadline_ms=1e9, **config)
    MADE.append(engine)
    block_bytes = file_bytes(max(engine.layout.group_block_bytes(g) for g in range(len(engine.layout.groups))))
    for handler in engine.workers[0].transfers.handlers:
        if isinstance(handler, DiskHandler):
            handler._ops = SlowReads(clock, read_seconds, block_bytes)  # the disk tier's system-call seam
    return engine


def settled(engine: SimEngine) -> None:
    engine.check_all()
    for worker in engine.workers:
        worker.wait_all()


def reload_from_disk(engine: SimEngine, rounds: int) -> list[int]:
    """Serve a prefix, push it out of the host tier, serve it again, ``rounds`` times; tokens loaded each time."""
    prompt, loaded = tokens(16, seed=1), []
    engine.add_request("first", prompt)
    engine.run(on_step=settled)
    for r in range(rounds):
        for i in range(3):  # fillers of 4 blocks each push the prefix out of the 4-slot host tier
            engine.add_request(f"filler{r}-{i}", tokens(16, seed=100 + 10 * r + i))
            engine.run(on_step=settled)
        engine.pool.drop_cache()
        again = engine.add_request(f"again{r}", [*prompt, r])
        engine.run(on_step=settled)
        assert again.status is Status.FINISHED
        loaded.append(again.loaded_tokens)
    assert engine.corrupt_blocks == []
    return loaded


@pytest.mark.parametrize(("read_seconds", "policy"), [(0.0001, "auto"), (0.05, "auto"), (0.05, "always")])
def test_a_slow_tiers_hits_are_skipped_and_a_fast_tiers_are_loaded(tmp_path: Path, read_seconds: float,
                                                                   policy: str) -> None:
    engine = make_engine(tmp_path, read_seconds, load_policy=policy)
    loaded = reload_from_disk(engine, rounds=5)
    cost = engine.scheduler.load_cost
    speed = cost.speed(Medium.DISK)
    assert speed is not None  # the first promotions measured the tier
    # 4 blocks from this disk: 4 reads of read_seconds (fast: 0.4 ms; slow: 200 ms); recomputing them: 16 ms.
    slow = policy == "auto" and read_seconds > 0.01
    if slow:
        assert loaded[:2] == [16, 16] and loaded[2:] == [0, 0, 0]  # learnt from two loads, then recomputed
        assert cost.skipped_blocks == 3 * 4
        assert engine.scheduler.take_stats().skipped_slow_tokens == 3 * 16  # what the metric counts
    else:
        assert loaded == [16] * 5 and cost.skipped_blocks == 0


def test_never_writes_the_lower_tier_but_does_not_read_it(tmp_path: Path) -> None:
    engine = make_engine(tmp_path, 0.0001, load_policy="never")
    assert reload_from_disk(engine, rounds=2) == [0, 0]
    assert engine.scheduler.load_cost.skipped_blocks == 2 * 4
    assert [block for p in slot_files(tmp_path) for block in stored_blocks(p)]  # written all the same
