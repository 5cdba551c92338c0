"""The simulated engine with a small host tier over a larger disk tier: prefixes evicted from the host come back
from disk bit-exact, with both write policies, across two workers (each rank its own slot file, naming the same
blocks at the same slots), after a restart (the engine takes its number back and finds its blocks in its file), and
from a second engine running beside the first; a block that can be neither loaded nor emptied is recomputed within a
few steps."""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.testing import layouts, sim_workload
from kvoffload.testing.sim import SimEngine, Status
from kvoffload.testing.sim_workload import close_engine, run_checked, tokens
from kvoffload.testing.slot_files import StoredBlock, slot_files, stored_blocks
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.lower.block_format import HEADER_BYTES
from kvoffload.tools.cli import main


class Engines:
    """The test's engines, each closed once (at the latest when the test ends: a disk index holds a thread and an
    engine number)."""

    def __init__(self) -> None:
        self.running: list[SimEngine] = []

    def make(self, disk: Path, host_blocks: int = 4, workers: int = 1, **config: object) -> SimEngine:
        engine = sim_workload.make_engine(host_blocks=host_blocks, workers=workers, disk_path=str(disk),
                                          disk_bytes=1 << 20, **config)
        self.running.append(engine)
        return engine

    def close(self, engine: SimEngine) -> None:
        self.running.remove(engine)
        close_engine(engine)


@pytest.fixture
def engines() -> Iterator[Engines]:
    made = Engines()
    yield made
    for engine in list(made.running):
        made.close(engine)


def disk_index(engine: SimEngine) -> DiskIndex:
    (index,) = [i for i in engine.scheduler.index.lower_indexes if isinstance(i, DiskIndex)]
    return index


def disk_handler(engine: SimEngine, rank: int = 0) -> DiskHandler:
    (handler,) = [h for h in engine.workers[rank].transfers.handlers if isinstance(h, DiskHandler)]
    return handler


def push_out_of_host(engine: SimEngine) -> None:
    """Other prompts fill the small host tier (4 blocks) and the device cache, so the first prompt is on disk only."""
    for i in range(3):
        engine.add_request(f"filler{i}", tokens(16, seed=100 + i))  # 4 blocks: each fits the host
        run_checked(engine)
    engine.pool.drop_cache()


@pytest.mark.parametrize("authenticated", [False, True], ids=["crc", "mac"])
@pytest.mark.parametrize("write_policy", ["write_through", "on_evict"])
def test_prefix_evicted_from_host_comes_back_from_disk_bit_exact(tmp_path: Path, write_policy: str,
                                                                 authenticated: bool, engines: Engines,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    secret = {}
    if authenticated:  # every block carries a MAC and a secret-derived name
        monkeypatch.setenv("KVOFFLOAD_TEST_SECRET", "s" * 32)
        secret = {"tier_secret_env": "KVOFFLOAD_TEST_SECRET"}
    engine = engines.make(tmp_path / "disk", disk_write_policy=write_policy, **secret)
    prompt = tokens(16, seed=1)
    engine.add_request("a", prompt)
    run_checked(engine)
    push_out_of_host(engine)
    b = engine.add_request("b", [*prompt, 7])
    run_checked(engine)
    assert b.status is Status.FINISHED
    assert b.loaded_tokens == 16 and b.device_hit_tokens == 0
    assert engine.corrupt_blocks == [] and engine.verified_blocks >= 4
    engine.scheduler.index.check_integrity()


def test_two_workers_promote_and_load_their_own_rank_files(tmp_path: Path, engines: Engines) -> None:
    engine = engines.make(tmp_path, workers=2)
    prompt = tokens(16, seed=2)
    engine.add_request("a", prompt)
    run_checked(engine)
    push_out_of_host(engine)
    b = engine.add_request("b", [*prompt, 7])
    run_checked(engine)
    assert b.loaded_tokens == 16 and engine.corrupt_blocks == []
    files = slot_files(tmp_path)
    assert [(p.parent.name, p.name) for p in files] == [("rank0", "engine-0.kvs"), ("rank1", "engine-0.kvs")]
    rank0, rank1 = ({(block.slot, block.name) for block in stored_blocks(p)} for p in files)
    assert rank0 == rank1 and len(rank0) >= 4  # each rank stored its own bytes of the same blocks, slot for slot


def test_a_restarted_engine_loads_the_blocks_already_on_disk(tmp_path: Path, engines: Engines) -> None:
    first = engines.make(tmp_path)
    prompt = tokens(16, seed=3)
    first.add_request("a", prompt)
    run_checked(first, ship_write_through=True)
    (file,) = slot_files(tmp_path)
    assert len(stored_blocks(file)) == 4
    engines.close(first)  # lets go of engine number 0
    second = engines.make(tmp_path)  # fresh host tier, device cache and index: only the disk remembers
    assert disk_index(second).engine == 0 and disk_index(second).usage()[0].used_blocks == 4
    b = second.add_request("b", [*prompt, 7])
    run_checked(second)
    assert b.loaded_tokens == 16 and second.corrupt_blocks == []


def tables_read(engine: SimEngine) -> None:
    """Wait until ``engine``'s disk index has read the other engines' tables once (its thread reads them as it
    starts; a lookup that misses them would only ask for another read)."""
    foreign = disk_index(engine)._foreign
    assert foreign is not None
    deadline = time.monotonic() + 10.0
    while foreign.reads == 0:
        assert time.monotonic() < deadline, "the other engines' tables were not read in 10 s"
        time.sleep(0.005)


def test_a_second_engine_beside_the_first_loads_the_blocks_the_first_stored(tmp_path: Path,
                                                                            engines: Engines) -> None:
    first = engines.make(tmp_path)
    prompt = tokens(16, seed=6)
    first.add_request("a", prompt)
    run_checked(first, ship_write_through=True)
    second = engines.make(tmp_path)  # the first still runs: the second takes number 1, its own file
    assert disk_index(second).engine == 1
    tables_read(second)
    b = second.add_request("b", [*prompt, 7])
    run_checked(second)
    assert b.loaded_tokens == 16 and second.corrupt_blocks == [] and second.verified_blocks >= 4
    assert disk_index(second).usage()[0].used_blocks == 0  # the first's blocks count in the first's budget only
    assert [p.name for p in slot_files(tmp_path)] == ["engine-0.kvs", "engine-1.kvs"]


def test_simulate_command_runs_with_the_disk_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--conversations", "2", "--turns", "2", "--user-tokens", "64", "--reply-tokens", "4",
                 "--device-blocks", "32", "--host-gib", "0.002", "--disk-path", str(tmp_path), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["corrupt_blocks"] == 0
    assert [block for p in slot_files(tmp_path) for block in stored_blocks(p)]


# ---- blocks that can be neither loaded nor removed ------------------------------------------------------------

STEP_BOUND = 10
"""Steps until a request over a bad block is done (6 here; the same request over good blocks takes 4)."""


def settled(engine: SimEngine) -> None:
    """Each step's background jobs finish before the next step, so that step counts do not depend on timing."""
    engine.check_all()
    for worker in engine.workers:
        worker.wait_all()


def on_disk_only(engine: SimEngine, root: Path, prompt: list[int]) -> list[StoredBlock]:
    """Run ``prompt`` and push it out of the host tier; return its blocks in rank 0's slot file."""
    before = {(b.path, b.slot, b.name) for p in slot_files(root) for b in stored_blocks(p)}
    engine.add_request("a", prompt)
    run_checked(engine, ship_write_through=True)
    blocks = [b for p in slot_files(root) for b in stored_blocks(p) if (b.path, b.slot, b.name) not in before]
    push_out_of_host(engine)
    assert len(blocks) == 4
    return blocks


def damage(block: StoredBlock) -> None:
    """Flip the first payload byte of ``block`` in place (its header still names its key)."""
    with open(block.path, "r+b") as f:
        f.seek(block.offset + HEADER_BYTES)
        byte = f.read(1)
        f.seek(block.offset + HEADER_BYTES)
        f.write(bytes([byte[0] ^ 0xFF]))


def read_only_file_system(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """The file system under ``root`` turned read-only: writing, creating, renaming or removing files there fails
    (files opened before included)."""
    def refused(path: object) -> OSError:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def under_root(fd: int) -> bool:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(root))

    def refuse_path(real):  # type: ignore[no-untyped-def]
        def call(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            if str(path).startswith(str(root)):
                raise refused(path)
            return real(path, *args, **kwargs)
        return call

    def refuse_fd(real):  # type: ignore[no-untyped-def]
        def call(fd, *args, **kwargs):  # type: ignore[no-untyped-def]
            if under_root(fd):
                raise refused(os.readlink(f"/proc/self/fd/{fd}"))
            return real(fd, *args, **kwargs)
        return call

    real_open = os.open

    def open_(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if flags & os.O_CREAT and str(path).startswith(str(root)):
            raise refused(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse_path(os.unlink))
    monkeypatch.setattr(os, "rename", refuse_path(os.rename))
    monkeypatch.setattr(os, "open", open_)
    for name in ("pwrite", "pwritev", "ftruncate"):
        monkeypatch.setattr(os, name, refuse_fd(getattr(os, name)))


def test_a_block_whose_slot_file_is_no_longer_a_regular_file_is_recomputed_within_a_few_steps(
        tmp_path: Path, engines: Engines) -> None:
    """A second engine found the first's blocks in its table; then a directory took the file's place: neither
    loadable nor its entries emptied. The load fails as it opens the path, and the request is recomputed."""
    first = engines.make(tmp_path)
    prompt = tokens(16, seed=4)
    path = on_disk_only(first, tmp_path, prompt)[0].path
    second = engines.make(tmp_path)
    tables_read(second)
    path.rename(path.with_name("moved"))
    path.mkdir()
    b = second.add_request("b", [*prompt, 7])
    second.run(max_steps=STEP_BOUND, on_step=settled)
    assert b.status is Status.FINISHED and b.loaded_tokens == 0
    assert second.corrupt_blocks == []
    assert disk_handler(second).breaker.errors >= 1  # the load met the directory (a hung read would not end)
    second.scheduler.index.check_integrity()


@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read-only"])
def test_a_corrupt_block_is_recomputed_within_a_few_steps_and_its_entry_emptied_where_it_can_be(
        tmp_path: Path, read_only: bool, engines: Engines, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    engine = engines.make(tmp_path)
    prompt = tokens(16, seed=5)
    bad = on_disk_only(engine, tmp_path, prompt)[0]
    damage(bad)
    if read_only:
        read_only_file_system(monkeypatch, tmp_path)
    b = engine.add_request("b", [*prompt, 7])
    with caplog.at_level(logging.DEBUG, logger="kvoffload"):
        engine.run(max_steps=STEP_BOUND, on_step=settled)
    monkeypatch.undo()
    assert b.status is Status.FINISHED and b.loaded_tokens == 0
    assert engine.corrupt_blocks == []
    assert [r for r in caplog.records if r.exc_info] == []  # no traceback: a failed clear is an I/O error
    errors = disk_handler(engine).breaker.errors
    names = {(block.slot, block.name) for block in stored_blocks(bad.path)}
    if read_only:
        assert (bad.slot, bad.name) in names  # its entry could not be emptied: the next read fails it again
        assert errors >= 2  # the breaker heard of the corrupt block and of the failed clear
    else:
        assert (bad.slot, bad.name) not in names  # no engine finds it again
        assert errors >= 1


def test_a_larger_later_group_comes_back_from_disk_whole(tmp_path: Path, engines: Engines) -> None:
    # Group 0 is the smaller one here (512 bytes a block, group 1 640): tier jobs list the keys of both groups as
    # one, so a handler sizing entries by group 0 truncated group 1's blocks (caught: 4 corrupt blocks).
    def smaller_group_first(**sizes: int) -> layouts.Made:
        made, _ = layouts.multi_group_layout(**sizes)
        return layouts.reordered(made, (1, 0))

    engine = engines.make(tmp_path, host_blocks=8, layout=smaller_group_first)
    assert engine.layout.group_block_bytes(0) < engine.layout.group_block_bytes(1)
    prompt = tokens(16, seed=1)
    engine.add_request("a", prompt)
    run_checked(engine)
    push_out_of_host(engine)
    b = engine.add_request("b", [*prompt, 7])
    run_checked(engine)
    assert b.loaded_tokens == 16 and engine.corrupt_blocks == [] and engine.verified_blocks >= 4
