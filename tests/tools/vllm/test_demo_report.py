"""The demo's workload and summary arithmetic, without an engine."""

from __future__ import annotations

import pytest

from kvoffload.testing.outputs import Control
from kvoffload.tools.vllm.cpu_binding import BindingMismatch, EngineBinding
from kvoffload.tools.vllm.demo_report import (
    RunResult,
    TurnResult,
    Workload,
    format_report,
    summarize,
    user_turns,
)

HOLDS, FAILS = Control(0.5), Control(0.0)


def turn(conv: int, t: int, ttft: float, offload_hit: int = 0, output: tuple[int, ...] = (5, 6),
         logprobs: tuple[float, ...] = (-1.0, -2.0)) -> TurnResult:
    top = tuple({o: lp} for o, lp in zip(output, logprobs, strict=False))
    return TurnResult(conversation=conv, turn=t, prompt_tokens=100, ttft_s=ttft, device_hit_tokens=0,
                      offload_hit_tokens=offload_hit, bytes_loaded=offload_hit * 10, bytes_stored=50,
                      tokens=output, logprobs=top)  # fmt: skip


def test_user_turns_open_with_system_prompt_and_long_message() -> None:
    w = Workload(conversations=3, turns=4, system_tokens=8, first_user_tokens=40, user_tokens=5, reply_tokens=2)
    turns = user_turns(w, vocab_size=300)
    assert len(turns) == 3 and all(len(c) == 4 for c in turns)
    assert all(len(c[0]) == 48 and all(len(m) == 5 for m in c[1:]) for c in turns)
    assert turns[0][0][:8] == turns[1][0][:8]  # the system prompt is shared
    assert turns[0][0][8:] != turns[1][0][8:]
    assert all(2 <= i < 300 for c in turns for m in c for i in m)


def test_user_turns_are_repeatable() -> None:
    assert user_turns(Workload(seed=3), 512) == user_turns(Workload(seed=3), 512)


def test_max_conversation_tokens_covers_the_last_turn() -> None:
    w = Workload(conversations=1, turns=3, system_tokens=10, first_user_tokens=100, user_tokens=7, reply_tokens=4)
    assert w.max_conversation_tokens() == 10 + 100 + 2 * 7 + 3 * 4


def test_workload_rejects_non_positive_sizes() -> None:
    with pytest.raises(ValueError, match="turns"):
        Workload(turns=0)


def test_ratio_pairs_hit_turns_with_the_same_turns_without_kvoffload() -> None:
    off = RunResult("off", (turn(0, 0, 1.0), turn(0, 1, 2.0), turn(0, 2, 4.0)), wall_s=7.0)
    on = RunResult("on", (turn(0, 0, 1.02), turn(0, 1, 0.2, offload_hit=64), turn(0, 2, 0.4, offload_hit=96)), 2.0)
    summary = summarize(off, on, HOLDS)
    assert summary["hit_turns"] == 2 and summary["miss_turns"] == 1
    assert summary["ttft_ratio_hit_turns"] == pytest.approx(0.3 / 3.0)
    assert summary["ttft_ratio_miss_turns"] == pytest.approx(1.02)
    assert summary["outputs_match"] is True
    assert summary["targets"] == {"ttft_ratio_hit_turns<=0.25": True, "miss_turns_within_5pct": True,
                                  "outputs_match": True}  # fmt: skip
    assert summary["on"]["bytes_loaded"] == 1600


def test_different_generated_tokens_are_reported_by_turn() -> None:
    off = RunResult("off", (turn(0, 0, 1.0), turn(1, 0, 1.0)), wall_s=2.0)
    on = RunResult("on", (turn(0, 0, 1.0), turn(1, 0, 1.0, output=(9,))), wall_s=2.0)
    summary = summarize(off, on, HOLDS)
    assert summary["outputs_match"] is False
    assert summary["mismatched_turns"] == [[1, 0]]
    assert "NO" in format_report(summary)


def test_no_hit_turns_gives_no_ratio() -> None:
    off = RunResult("off", (turn(0, 0, 1.0),), wall_s=1.0)
    summary = summarize(off, RunResult("on", (turn(0, 0, 1.0),), wall_s=1.0), None)
    assert summary["ttft_ratio_hit_turns"] is None
    assert summary["targets"]["ttft_ratio_hit_turns<=0.25"] is False


def test_runs_of_different_turns_are_rejected() -> None:
    with pytest.raises(ValueError, match="different turns"):
        summarize(RunResult("off", (turn(0, 0, 1.0),), 1.0), RunResult("on", (turn(1, 0, 1.0),), 1.0), HOLDS)


def test_logprobs_beyond_the_tolerance_are_a_mismatch() -> None:
    off = RunResult("off", (turn(0, 0, 1.0),), wall_s=1.0)
    on = RunResult("on", (turn(0, 0, 1.0, logprobs=(-1.0, -2.01)),), wall_s=1.0)
    assert summarize(off, on, HOLDS)["mismatched_turns"] == [[0, 0]]
    near = RunResult("on", (turn(0, 0, 1.0, logprobs=(-1.0, -2.0005)),), wall_s=1.0)
    assert summarize(off, near, HOLDS)["outputs_match"] is True


def test_outputs_match_is_not_claimed_when_the_control_failed() -> None:
    off = RunResult("off", (turn(0, 0, 1.0, offload_hit=64),), wall_s=1.0)
    summary = summarize(off, RunResult("on", (turn(0, 0, 1.0, offload_hit=64),), wall_s=1.0), FAILS)
    assert summary["outputs_match"] is None
    assert summary["targets"]["outputs_match"] is False
    assert summary["control"]["holds"] is False
    report = format_report(summary)
    assert "not meaningful" in report
    assert "generated tokens match" not in report


def test_the_summary_records_each_engine_s_binding() -> None:
    bound = EngineBinding("0-1", 2)
    off, on = (RunResult(name, (turn(0, 0, 1.0),), 1.0, bound) for name in ("off", "on"))
    summary = summarize(off, on, None)
    assert [(summary[run]["cpu_bind"], summary[run]["omp_threads"]) for run in ("off", "on")] == [("0-1", 2)] * 2
    assert "both engines computed on CPUs 0-1 with 2 OpenMP threads" in format_report(summary)


def test_engines_bound_differently_are_not_compared() -> None:
    off = RunResult("off", (turn(0, 0, 1.0),), 1.0, EngineBinding("0", 1))
    on = RunResult("on", (turn(0, 0, 0.1, offload_hit=64),), 1.0, EngineBinding("0-1", 2))
    with pytest.raises(BindingMismatch, match=r"off CPUs 0 \(1 OpenMP thread\), on CPUs 0-1 \(2 OpenMP threads\)"):
        summarize(off, on, HOLDS)


def test_a_turn_with_a_load_names_a_position_inside_the_loaded_run() -> None:
    t = TurnResult(conversation=0, turn=1, prompt_tokens=300, ttft_s=0.1, device_hit_tokens=64,
                   offload_hit_tokens=128, bytes_loaded=1, bytes_stored=0, tokens=(1,), logprobs=({1: -1.0},))
    assert 64 <= t.loaded_position() < 64 + 128  # type: ignore[operator]
    assert turn(0, 0, 1.0).loaded_position() is None
