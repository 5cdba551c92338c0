"""The simulated engine with a small host tier over a larger disk tier: prefixes evicted from the host come back
from disk bit-exact, with both write policies, across two workers, and after a restart."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvoffload.cli import main
from kvoffload.config import OffloadConfig
from kvoffload.testing import layouts
from kvoffload.testing.sim import SimEngine, Status

BLOCK = 4


def make_engine(disk: Path, host_blocks: int = 4, workers: int = 1, **config: object) -> SimEngine:
    layout, make_kv = layouts.attention_layout(num_blocks=48, block_size=BLOCK)
    slot = max(layout.group_block_bytes(g) for g in range(len(layout.groups)))
    raw = {"offload_block_tokens": BLOCK, "host_bytes": host_blocks * slot, "disk_path": str(disk),
           "disk_bytes": 1 << 24, **config}
    return SimEngine(layout, make_kv, OffloadConfig.from_dict(raw), block_size=BLOCK, num_workers=workers)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def run_checked(engine: SimEngine) -> None:
    engine.run(on_step=lambda e: e.check_all())


def push_out_of_host(engine: SimEngine) -> None:
    """Other prompts fill the small host tier and the device cache, so the first prompt is on disk only."""
    for i in range(3):
        engine.add_request(f"filler{i}", tokens(24, seed=100 + i))
        run_checked(engine)
    engine.pool.drop_cache()


@pytest.mark.parametrize("write_policy", ["write_through", "on_evict"])
def test_prefix_evicted_from_host_comes_back_from_disk_bit_exact(tmp_path: Path, write_policy: str) -> None:
    engine = make_engine(tmp_path, disk_write_policy=write_policy)
    prompt = tokens(16, seed=1)
    engine.add_request("a", prompt)
    run_checked(engine)
    push_out_of_host(engine)
    b = engine.add_request("b", [*prompt, 7])
    run_checked(engine)
    assert b.status is Status.FINISHED
    assert b.loaded_tokens == 16 and b.device_hit_tokens == 0
    assert engine.corrupt_blocks == [] and engine.verified_blocks >= 4
    engine.scheduler.manager.check_integrity()


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
