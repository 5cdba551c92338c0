"""How a disk job is cut into tasks: runs of consecutive slots of one engine's file, each one system call, at most
``RUN_BYTES`` and an even share of the job per I/O thread."""

from __future__ import annotations

from tests.tiers.disk.handlers import keys

from kvoffload.tiers.disk.runs import RUN_BYTES, DiskBlock, runs
from kvoffload.tiers.disk.slot_file import location


def blocks(places: list[int], nbytes: int = 64 << 10) -> list[DiskBlock]:
    return [DiskBlock(i, k, nbytes, p) for i, (k, p) in enumerate(zip(keys(len(places)), places, strict=True))]


def shape(out: list[list[DiskBlock]]) -> list[list[int]]:
    return [[b.place for b in run] for run in out]


def test_consecutive_slots_are_one_run_and_a_gap_starts_another() -> None:
    assert shape(runs(blocks([5, 3, 4, 9, 10]), threads=1)) == [[3, 4, 5], [9, 10]]  # sorted by place


def test_a_run_holds_at_most_run_bytes_and_an_even_share_of_the_job() -> None:
    many = blocks(list(range(64)))  # 64 KiB blocks: 16 fit in RUN_BYTES
    assert [len(r) for r in runs(many, threads=1)] == [RUN_BYTES // (64 << 10)] * 4
    assert [len(r) for r in runs(many, threads=8)] == [8] * 8  # every thread gets work
    assert [len(r) for r in runs(blocks(list(range(4)), nbytes=RUN_BYTES), threads=1)] == [1] * 4


def test_slots_of_two_engines_files_are_never_one_run() -> None:
    last_of_0, first_of_1 = location(0, (1 << 32) - 1), location(1, 0)  # consecutive as numbers
    assert first_of_1 == last_of_0 + 1
    assert shape(runs(blocks([last_of_0, first_of_1]), threads=1)) == [[last_of_0], [first_of_1]]


def test_a_place_named_twice_is_two_runs_not_one_longer_one() -> None:
    assert shape(runs(blocks([7, 7, 8]), threads=1)) == [[7], [7, 8]]
