"""Replay with retention hints: a session whose prefix one-offs evict during its pause hits with a hint and misses
without; deadlines run on the trace's clock; traces without hints replay as the plain loop does."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from tests.tools.replay.traces import BLOCK

from kvoffload.config import EvictionPolicy
from kvoffload.tools.cli import main
from kvoffload.tools.replay import Bound, Request, Trace, int_key, read_trace, replay
from kvoffload.tools.replay.agentic import AgenticSpec, agentic
from kvoffload.tools.replay.sessions import Hints, replay_sessions

CAPACITY = 12
"""Blocks: the session's 4 and 8 more, so two one-offs of 4 new blocks each push the session out under LRU."""


def request(at_s: float, ids: list[int], session: str | None = None, retain_s: float | None = None) -> Request:
    return Request(at_s * 1000, len(ids) * BLOCK, 1, tuple(int_key(i) for i in ids), None, session, retain_s)


def paused_session(retain_s: float, oneoffs: int = 6) -> Trace:
    """A session's turn at 0 s hinting ``retain_s``, ``oneoffs`` one-offs of 4 new blocks during its pause, and
    its next turn at 100 s extending the first."""
    middle = [request(10.0 + i, [100 + 4 * i + j for j in range(4)]) for i in range(oneoffs)]
    return Trace((request(0, [1, 2, 3, 4], "s", retain_s), *middle, request(100, [1, 2, 3, 4, 5, 6], "s")), BLOCK)


def session_hits(trace: Trace, hints: Hints, strategy: EvictionPolicy | Bound = EvictionPolicy.LRU) -> int:
    return replay_sessions(trace, CAPACITY, strategy, hints).session.hit_blocks


def test_a_hint_keeps_a_sessions_prefix_that_one_offs_evict_without_it() -> None:
    trace = paused_session(retain_s=120)
    assert session_hits(trace, Hints.OFF) == 0  # the control: LRU loses the prefix during the pause
    assert session_hits(trace, Hints.OFF, EvictionPolicy.ARC) == 0
    assert session_hits(trace, Hints.EXPECTED) == 4
    assert session_hits(trace, Hints.FIXED) == 4
    assert session_hits(trace, Hints.OFF, Bound.OPTIMUM) == 4  # what the hint lets LRU reach


def test_the_one_offs_pay_for_the_hint_only_what_the_retained_blocks_take() -> None:
    trace = paused_session(retain_s=120)
    off, on = (replay_sessions(trace, CAPACITY, EvictionPolicy.LRU, h) for h in (Hints.OFF, Hints.EXPECTED))
    assert on.oneoff.hit_blocks == off.oneoff.hit_blocks == 0  # one-offs never repeat here
    assert (on.hinted, on.capped, on.retained_hits, on.retained_peak) == (1, 0, 4, 4)
    assert (off.hinted, off.retained_peak, off.retained_hits) == (0, 0, 0)


def test_a_deadline_runs_on_the_traces_clock_and_lapses() -> None:
    # Shorter than the pause: the prefix is ordinary again when the one-offs arrive from 10 s on. A book on the
    # machine's clock, or one that ignored deadlines, would give 0 above or 4 here.
    assert session_hits(paused_session(retain_s=5), Hints.EXPECTED) == 0
    assert session_hits(paused_session(retain_s=5), Hints.FIXED) == 4  # 600 s: still held at 100 s


def test_a_hint_over_the_cap_is_cut_to_it() -> None:
    trace = paused_session(retain_s=7200)
    # Cut to 5 s, the hint lapses before the one-offs arrive.
    result = replay_sessions(trace, CAPACITY, EvictionPolicy.LRU, Hints.EXPECTED, max_retain_s=5)
    assert (result.hinted, result.capped, result.session.hit_blocks) == (1, 1, 0)


def test_retained_blocks_stay_within_the_share() -> None:
    result = replay_sessions(paused_session(retain_s=120), CAPACITY, EvictionPolicy.LRU, Hints.EXPECTED, share=0.25)
    assert result.retained_peak == 3 and result.demoted >= 1
    assert result.session.hit_blocks == 0  # the prefix's first block, demoted, went: the rest is no prefix hit


def test_on_an_agentic_trace_hints_lift_lru_towards_the_optimum() -> None:
    trace = agentic(AgenticSpec(sessions=3, duration_s=900.0, oneoff_per_s=3.0))
    rates = {h: replay_sessions(trace, 300, EvictionPolicy.LRU, h).session.token_hit_rate for h in Hints}
    optimum = replay_sessions(trace, 300, Bound.OPTIMUM).session.token_hit_rate
    assert rates[Hints.OFF] < 0.8 * optimum
    assert rates[Hints.EXPECTED] > rates[Hints.OFF] + 0.1 and rates[Hints.EXPECTED] >= 0.9 * optimum


PACKED = Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.gz"


@pytest.fixture(scope="module")
def mooncake_head(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    lines = gzip.decompress(PACKED.read_bytes()).decode().splitlines()[:400]
    path = tmp_path_factory.mktemp("trace") / "head.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert all("session" not in json.loads(line) for line in lines)
    return read_trace(path)


@pytest.mark.parametrize("strategy", [EvictionPolicy.LRU, EvictionPolicy.ARC, Bound.OPTIMUM])
def test_a_trace_without_hints_replays_as_the_plain_loop_does(mooncake_head: Trace, strategy: object) -> None:
    blocks = 600
    plain = replay(mooncake_head, blocks, strategy)  # type: ignore[arg-type]
    hints = Hints.OFF if isinstance(strategy, Bound) else Hints.EXPECTED  # a RetainPolicy that is never given any
    split = replay_sessions(mooncake_head, blocks, strategy, hints)  # type: ignore[arg-type]
    assert split.session.requests == 0 and split.hinted == 0
    assert (split.oneoff.hit_tokens, split.oneoff.hit_blocks, split.oneoff.stored_blocks,
            split.oneoff.evicted_blocks, split.oneoff.wasted_blocks) == (
        plain.hit_tokens, plain.hit_blocks, plain.stored_blocks, plain.evicted_blocks, plain.wasted_blocks)


def test_replay_sessions_prints_every_row_and_saves_the_trace(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    name = "agentic:sessions=2,duration_s=120,oneoff_per_s=1"
    saved = tmp_path / "a.jsonl"
    assert main(["replay", "--trace", name, "--capacity", "51200", "--sessions", "--json",
                 "--save-trace", str(saved)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in doc["rows"]] == ["lru", "arc", "adaptive", "lru+hints expected",
                                                 "lru+hints fixed-600", "optimum"]
    assert doc["rows"][-1]["session_of_optimum"] == 1.0 and doc["rows"][3]["hinted"] > 0
    assert read_trace(saved) == agentic(AgenticSpec(sessions=2, duration_s=120, oneoff_per_s=1))
    assert main(["replay", "--trace", name, "--capacity", "51200", "--sessions", "--policy", "lru"]) == 0
    assert "lru+hints fixed-600" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "culprit"), [(["--engines", "2"], "--engines"),
                                               (["--retain-share", "1.5"], "--retain-share"),
                                               (["--max-retain-s", "0"], "--max-retain-s")])
def test_bad_session_options_exit_2_naming_the_culprit(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                       culprit: str) -> None:
    assert main(["replay", "--trace", "agentic:duration_s=60", "--sessions", *argv]) == 2
    assert culprit in capsys.readouterr().err
