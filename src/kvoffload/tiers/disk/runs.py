"""A disk job's state and its blocks, and how a job is cut into runs of consecutive slots (``DiskHandler``'s)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.keys import OffloadKey
from kvoffload.tiers.disk.slot_file import split_location
from kvoffload.tiers.lower.handler import LowerJob

RUN_BYTES = 1 << 20
"""A task moves at most this much of consecutive slots with one system call (fewer calls and Python steps per byte
for small blocks; more, smaller tasks would not read faster)."""


@dataclass(frozen=True)
class DiskBlock:
    slot: int
    key: OffloadKey
    nbytes: int
    place: int = -1
    """The (engine, slot) ``location`` in the tier (``_plan`` sets it from the spec)."""


@dataclass(eq=False)
class DiskJob(LowerJob[DiskBlock]):
    remaining: int = 0
    """Blocks not done yet (``_new_job`` sets it to all of them)."""
    blockers: int = 0
    """Earlier unfinished jobs with the same destinations; this job starts when they finish."""
    dependents: list[DiskJob] = field(default_factory=list)
    written: list[DiskBlock] = field(default_factory=list)

    def destinations(self) -> list[object]:
        return [b.place for b in self.blocks] if self.is_store else [b.slot for b in self.blocks]


def runs(blocks: list[DiskBlock], threads: int) -> list[list[DiskBlock]]:
    """A job's blocks as tasks: blocks at consecutive places of one file, at most ``RUN_BYTES`` and an even share
    of the job, so that every thread has work and a task is one system call."""
    most = max(1, min(RUN_BYTES // max(1, blocks[0].nbytes), -(-len(blocks) // threads)))
    out: list[list[DiskBlock]] = []
    run: list[DiskBlock] = []
    for block in sorted(blocks, key=lambda b: b.place):
        last = run[-1].place if run else -2
        if run and (block.place != last + 1 or len(run) == most or split_location(last)[0] != split_location(
                block.place)[0]):
            out.append(run)
            run = []
        run.append(block)
    if run:
        out.append(run)
    return out
