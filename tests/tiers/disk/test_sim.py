"""The simulated engine with a small host tier over a larger disk tier: prefixes evicted from the host come back
from disk bit-exact, with both write policies, across two workers, and after a restart."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest

from kvoffload.testing import layouts, sim_workload
from kvoffload.testing.sim import SimEngine, Status
from kvoffload.testing.sim_workload import run_checked, tokens
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tools.cli import main


def make_engine(disk: Path, host_blocks: int = 4, workers: int = 1, **config: object) -> SimEngine:
    return sim_workload.make_engine(host_blocks=host_blocks, workers=workers, disk_path=str(disk),
                                    disk_bytes=1 << 24, **config)


def push_out_of_host(engine: SimEngine) -> None:
    """Other prompts fill the small host tier (4 blocks) and the device cache, so the first prompt is on disk only."""
    for i in range(3):
        engine.add_request(f"filler{i}", tokens(16, seed=100 + i))  # 4 blocks: each fits the host
        run_checked(engine)
    engine.pool.drop_cache()


@pytest.mark.parametrize("authenticated", [False, True], ids=["crc", "mac"])
@pytest.mark.parametrize("write_policy", ["write_through", "on_evict"])
def test_prefix_evicted_from_host_comes_back_from_disk_bit_exact(tmp_path: Path, write_policy: str,
                                                                 authenticated: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    secret = {}
    if authenticated:  # every block carries a MAC and a secret-derived name
        monkeypatch.setenv("KVOFFLOAD_TEST_SECRET", "s" * 32)
        secret = {"tier_secret_env": "KVOFFLOAD_TEST_SECRET"}
    engine = make_engine(tmp_path / "disk", disk_write_policy=write_policy, **secret)
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


def test_two_workers_promote_and_load_their_own_rank_files(tmp_path: Path) -> None:
    engine = make_engine(tmp_path, workers=2)
    prompt = tokens(16, seed=2)
    engine.add_request("a", prompt)
    run_checked(engine)
    push_out_of_host(engine)
    b = engine.add_request("b", [*prompt, 7])
    run_checked(engine)
    assert b.loaded_tokens == 16 and engine.corrupt_blocks == []
    assert {p.name for p in next(tmp_path.iterdir()).iterdir() if p.is_dir()} == {"rank0", "rank1"}


def test_a_restarted_engine_loads_the_blocks_already_on_disk(tmp_path: Path) -> None:
    first = make_engine(tmp_path)
    prompt = tokens(16, seed=3)
    first.add_request("a", prompt)
    run_checked(first)
    first.step()  # ships the write-through queued by the last store (run() stops before the manager's queue)
    run_checked(first)
    assert len(list(tmp_path.rglob("*.kvb"))) == 4
    second = make_engine(tmp_path)  # fresh host tier, device cache and index: only the disk remembers
    b = second.add_request("b", [*prompt, 7])
    run_checked(second)
    assert b.loaded_tokens == 16 and second.corrupt_blocks == []


def test_simulate_command_runs_with_the_disk_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--conversations", "2", "--turns", "2", "--user-tokens", "64", "--reply-tokens", "4",
                 "--device-blocks", "32", "--host-gib", "0.002", "--disk-path", str(tmp_path), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["corrupt_blocks"] == 0
    assert list(tmp_path.rglob("*.kvb"))


# ---- blocks that can be neither loaded nor removed ------------------------------------------------------------

STEP_BOUND = 10
"""Steps until a request over a bad block is done (6 here; the same request over good blocks takes 4)."""


def settled(engine: SimEngine) -> None:
    """Each step's background jobs finish before the next step, so that step counts do not depend on timing."""
    engine.check_all()
    for worker in engine.workers:
        worker.wait_all()


def on_disk_only(engine: SimEngine, root: Path, prompt: list[int]) -> list[Path]:
    """Run ``prompt`` and push it out of the host tier; return its block files (rank 0)."""
    before = set(root.rglob("*.kvb"))
    engine.add_request("a", prompt)
    run_checked(engine)
    engine.step()  # ships the write-through queued by the last store
    run_checked(engine)
    files = sorted(set(root.rglob("*.kvb")) - before)
    push_out_of_host(engine)
    return files


def read_only_file_system(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """The file system under ``root`` turned read-only: removing, renaming or creating files there fails."""
    def refuse(real):  # type: ignore[no-untyped-def]
        def call(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            if str(path).startswith(str(root)):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real(path, *args, **kwargs)
        return call

    real_open = os.open

    def open_(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if flags & os.O_CREAT and str(path).startswith(str(root)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse(os.unlink))
    monkeypatch.setattr(os, "rename", refuse(os.rename))
    monkeypatch.setattr(os, "open", open_)


def test_a_directory_at_a_block_path_is_recomputed_within_a_few_steps(tmp_path: Path) -> None:
    engine = make_engine(tmp_path)
    prompt = tokens(16, seed=4)
    first = on_disk_only(engine, tmp_path, prompt)[0]
    first.unlink()
    first.mkdir()  # neither loadable nor removable
    b = engine.add_request("b", [*prompt, 7])
    engine.run(max_steps=STEP_BOUND, on_step=settled)
    assert b.status is Status.FINISHED and b.loaded_tokens == 0
    assert engine.corrupt_blocks == []
    engine.scheduler.index.check_integrity()


def test_a_corrupt_block_on_a_file_system_turned_read_only_is_recomputed_within_a_few_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(tmp_path)
    prompt = tokens(16, seed=5)
    files = on_disk_only(engine, tmp_path, prompt)
    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0xFF
    files[0].write_bytes(raw)
    read_only_file_system(monkeypatch, tmp_path)
    b = engine.add_request("b", [*prompt, 7])
    with caplog.at_level(logging.DEBUG, logger="kvoffload"):
        engine.run(max_steps=STEP_BOUND, on_step=settled)
    assert b.status is Status.FINISHED and b.loaded_tokens == 0
    assert engine.corrupt_blocks == []
    assert [r for r in caplog.records if r.exc_info] == []  # no traceback: a failed removal is an I/O error
    (disk,) = [h for h in engine.workers[0].transfers.handlers if isinstance(h, DiskHandler)]
    assert disk.breaker.errors >= 1  # the breaker heard of the failed removal
    assert files[0].exists()


def test_a_larger_later_group_comes_back_from_disk_whole(tmp_path: Path) -> None:
    # Group 0 is the smaller one here (512 bytes a block, group 1 640): tier jobs list the keys of both groups as
    # one, so a handler sizing entries by group 0 truncated group 1's blocks (caught: 4 corrupt blocks).
    def smaller_group_first(**sizes: int) -> layouts.Made:
        made, _ = layouts.multi_group_layout(**sizes)
        return layouts.reordered(made, (1, 0))

    engine = make_engine(tmp_path, host_blocks=8, layout=smaller_group_first)
    assert engine.layout.group_block_bytes(0) < engine.layout.group_block_bytes(1)
    prompt = tokens(16, seed=1)
    engine.add_request("a", prompt)
    run_checked(engine)
    push_out_of_host(engine)
    b = engine.add_request("b", [*prompt, 7])
    run_checked(engine)
    assert b.loaded_tokens == 16 and engine.corrupt_blocks == [] and engine.verified_blocks >= 4
