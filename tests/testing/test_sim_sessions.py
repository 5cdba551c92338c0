"""Retention hints in the simulated engine: a session's first turn sends a hint, one-off prompts then flood the host
tier (and the disk under it), and the session's next turn loads its whole prefix bit-exact; the same flood without
the hint evicts it (the control)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.testing.test_sim import tokens

from kvoffload.testing.sim import SimEngine
from kvoffload.testing.sim_workload import close_engine, make_engine, run_checked

HINT = {"kvoffload": {"retain_s": 600}}


def paused_session_hit(hint: dict[str, Any] | None, **config: Any) -> int:
    """A 24-token turn (6 host blocks of 16) with ``hint``, then 12 one-off prompts of 40 new tokens (120 blocks),
    then the next turn (the first one's prompt and output, and more) after the device cache is dropped: the tokens
    it loads."""
    return paused_session(make_engine(host_blocks=16, **config), hint)


def paused_session(engine: SimEngine, hint: dict[str, Any] | None) -> int:
    prefix = tokens(24, seed=1)
    first = engine.add_request("turn-0", prefix, max_new_tokens=4)
    first.kv_transfer_params = hint
    run_checked(engine)
    for i in range(12):
        engine.add_request(f"one-off-{i}", tokens(40, seed=100 + i))
        run_checked(engine)
    engine.pool.drop_cache()
    again = engine.add_request("turn-1", [*first.all_token_ids, 7, 8, 9])
    run_checked(engine)
    return again.loaded_tokens


def test_a_hinted_session_comes_back_to_its_prefix_after_a_flood() -> None:
    assert paused_session_hit(HINT) >= 24


def test_control_the_same_flood_evicts_an_unhinted_session() -> None:
    assert paused_session_hit(None) == 0


def test_control_hints_off_by_configuration_evicts_it_too() -> None:
    assert paused_session_hit(HINT, max_retain_s=0) == 0


def test_a_session_retained_share_too_small_for_its_prefix_loses_its_tail() -> None:
    # 4 of 16 blocks may be retained: the prefix's first blocks are demoted first (their deadlines are the oldest
    # only by key order: one hint), so the run from the first block breaks and less than the whole prefix loads.
    assert 0 < paused_session_hit(HINT, retain_share=0.25) < 24  # part of it: the share's blocks held


@pytest.mark.parametrize("hinted", [True, False])
def test_on_a_disk_under_the_host_the_hint_keeps_the_prefix_there_too(tmp_path: Path, hinted: bool) -> None:
    # Host 16 blocks, disk 20 (20,000 bytes of the sim's small blocks): the flood's 120 blocks pass through both.
    engine = make_engine(host_blocks=16, disk_path=str(tmp_path / "disk"), disk_bytes=20_000)
    try:
        got = paused_session(engine, HINT if hinted else None)
        retention = engine.scheduler.retention
        assert retention is not None
        retained = {tier.tier: tier.retained() for tier in retention.book.tiers}
    finally:
        close_engine(engine)
    assert (got >= 24) if hinted else got == 0
    assert retained == ({"host": 7, "disk": 7} if hinted else {"host": 0, "disk": 0})  # prompt and output blocks
