"""The synthetic traces: built the same on every run, named as the replay takes them, and each of the shape it is
for (the rule it favours wins on it, which a trace of another shape would not show)."""

from __future__ import annotations

import pytest

from kvoffload.config import EvictionPolicy, StoreAdmission
from kvoffload.tools.cli import main
from kvoffload.tools.replay.loop import replay
from kvoffload.tools.replay.sweep import load
from kvoffload.tools.replay.synthetic import DEFAULT_TIER, TRACES, synthetic

TIER = 200


def hit_rate(name: str, policy: EvictionPolicy = EvictionPolicy.LRU,
             admission: StoreAdmission = StoreAdmission.ALL) -> float:
    return replay(synthetic(f"{name}:{TIER}"), TIER, policy, admission).token_hit_rate


@pytest.mark.parametrize("name", TRACES)
def test_each_trace_is_the_same_on_every_run(name: str) -> None:
    first, again = synthetic(f"{name}:{TIER}"), synthetic(f"{name}:{TIER}")
    assert first == again and len(first.requests) > TIER
    assert synthetic(name) == TRACES[name](DEFAULT_TIER)


def test_recency_rewards_storing_every_block_over_second_sightings() -> None:
    assert hit_rate("recency") > hit_rate("recency", admission=StoreAdmission.SECOND_SIGHTING) + 0.05


def test_loops_defeat_lru_and_frequency_survives_the_single_block_loop() -> None:
    assert hit_rate("loop") == 0 and hit_rate("chain-loop") == 0
    assert hit_rate("loop", EvictionPolicy.TINYLFU) > 0.3
    assert hit_rate("chain-loop", EvictionPolicy.S3FIFO) > 0.2


def test_zipf_rewards_frequency_and_scans_reward_scan_resistance() -> None:
    assert hit_rate("zipf", EvictionPolicy.ARC) > hit_rate("zipf") + 0.02
    assert hit_rate("scan", EvictionPolicy.S3FIFO) > hit_rate("scan") + 0.02


def test_chat_reuses_the_tails_of_its_turns() -> None:
    assert hit_rate("chat") > 0.3


@pytest.mark.parametrize("bad", ["synthetic:nope", "synthetic:loop:0", "synthetic:loop:x", "synthetic:loop:1:2"])
def test_a_bad_name_is_a_value_error_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match="synthetic"):
        synthetic(bad)


def test_the_replay_command_takes_a_synthetic_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--trace", f"synthetic:recency:{TIER}", "--capacity", str(TIER * 16),
                 "--policy", "lru", "--admission", "adaptive", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "adaptive" in out and "optimum" in out
    assert load(f"synthetic:recency:{TIER}", with_future=False)[0].block_tokens == 16
