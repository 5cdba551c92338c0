"""The agentic trace generator: seeded, turns that extend the previous turn's prompt, pauses in the spec's range,
hints that cover the gap to the next turn, one-offs at the spec's rate; its trace fields written and read back."""

from __future__ import annotations

import itertools
import json
import random
from collections import defaultdict
from pathlib import Path

import pytest

from kvoffload.tools.replay import Request, TraceError, read_trace
from kvoffload.tools.replay.agentic import (
    BLOCK_TOKENS,
    DECODE_TOKENS_PER_S,
    ONEOFF_SYSTEM_BLOCKS,
    SERVICE_S,
    SYSTEM_BLOCKS,
    AgenticSpec,
    agentic,
    agentic_trace,
    parse_spec,
    pause,
)
from kvoffload.tools.replay.trace import Trace, write_trace

SPEC = AgenticSpec(sessions=4, duration_s=1800.0, oneoff_per_s=2.0)


@pytest.fixture(scope="module")
def small() -> Trace:
    return agentic(SPEC)


def turns_of(trace: Trace) -> dict[str, list[Request]]:
    out: dict[str, list[Request]] = defaultdict(list)
    for r in trace.requests:
        if r.session is not None:
            out[r.session].append(r)
    return out


def test_the_trace_is_the_same_for_a_seed_and_differs_for_another(small: Trace) -> None:
    assert agentic(SPEC) == small
    assert agentic(AgenticSpec(seed=1, sessions=4, duration_s=1800.0, oneoff_per_s=2.0)) != small


def test_one_offs_do_not_move_the_sessions(small: Trace) -> None:
    calm = agentic(AgenticSpec(sessions=4, duration_s=1800.0, oneoff_per_s=0.0))
    assert [r for r in small.requests if r.session] == list(calm.requests)


def test_each_turn_extends_the_previous_prompt_with_its_output_and_a_tool_result(small: Trace) -> None:
    sessions = turns_of(small)
    assert len(sessions) >= 8 and sum(len(t) for t in sessions.values()) >= 60
    for turns in sessions.values():
        for before, after in itertools.pairwise(turns):
            assert after.keys[:len(before.keys)] == before.keys
            grown = len(after.keys) - len(before.keys)
            assert 2 <= grown <= 17  # one output block and a tool result of 1 to 16
            assert after.input_length == len(after.keys) * BLOCK_TOKENS
    firsts = {turns[0].keys[:SYSTEM_BLOCKS] for turns in sessions.values()}
    assert len(firsts) == 1  # every session starts on the shared system prompt


def test_pauses_lie_in_the_range_and_each_hint_covers_the_gap_to_the_next_turn(small: Trace) -> None:
    service = SERVICE_S + BLOCK_TOKENS / DECODE_TOKENS_PER_S
    for turns in turns_of(small).values():
        for before, after in itertools.pairwise(turns):
            gap = (after.timestamp_ms - before.timestamp_ms) / 1000
            assert SPEC.pause_min_s - 0.002 <= gap - service <= SPEC.pause_max_s + 0.002
            assert before.retain_s is not None and gap < before.retain_s <= gap + 1
        assert turns[-1].retain_s is None or turns[-1].timestamp_ms > (SPEC.duration_s - SPEC.pause_max_s) * 1000
    rng = random.Random(0)
    draws = [pause(rng, SPEC) for _ in range(20_000)]
    assert min(draws) == SPEC.pause_min_s and max(draws) == SPEC.pause_max_s  # the clip is reached at both ends
    assert 0.01 < sum(d > 600 for d in draws) / len(draws) < 0.04  # the heavy tail the docstring claims


def test_one_offs_arrive_at_the_rate_and_share_only_their_system_prompt(small: Trace) -> None:
    oneoffs = [r for r in small.requests if r.session is None]
    assert abs(len(oneoffs) / SPEC.duration_s - SPEC.oneoff_per_s) < 0.15
    assert all(r.retain_s is None for r in oneoffs)
    seen: set[bytes] = set()
    for r in oneoffs:
        own = r.keys[ONEOFF_SYSTEM_BLOCKS:]
        assert own and seen.isdisjoint(own)
        seen.update(own)
    sessions = {k for r in small.requests if r.session for k in r.keys}
    assert sessions.isdisjoint(seen)


def test_requests_are_in_arrival_order(small: Trace) -> None:
    stamps = [r.timestamp_ms for r in small.requests]
    assert stamps == sorted(stamps)


def test_the_trace_name_sets_fields_and_bad_ones_name_the_culprit() -> None:
    assert parse_spec("agentic:seed=3,oneoff_per_s=1.5") == AgenticSpec(seed=3, oneoff_per_s=1.5)
    assert parse_spec("agentic") == AgenticSpec()
    with pytest.raises(ValueError, match="'colour=1' is not FIELD=VALUE"):
        parse_spec("agentic:colour=1")
    with pytest.raises(ValueError, match="sessions needs a number"):
        parse_spec("agentic:sessions=many")
    with pytest.raises(ValueError, match="pause_min_s <= pause_median_s"):
        agentic_trace("agentic:pause_min_s=60")


def test_a_written_trace_reads_back_with_its_sessions_and_hints(small: Trace, tmp_path: Path) -> None:
    path = tmp_path / "agentic.jsonl"
    write_trace(small, path)
    assert read_trace(path) == small
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert all("tenant" not in doc for doc in lines)  # an absent field is left out, not written as null
    assert any("retain_s" in doc and "session" in doc for doc in lines)


LINE = {"timestamp": 0, "input_length": 8, "output_length": 1, "block_tokens": 4, "hash_ids": [1, 2]}


def test_old_lines_have_no_session_nor_hint_and_read_as_before(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(LINE) + "\n" + json.dumps({**LINE, "session": "a", "retain_s": 30}) + "\n")
    old, new = read_trace(path).requests
    assert old == Request(0.0, 8, 1, old.keys) and old.session is None and old.retain_s is None
    assert (new.session, new.retain_s) == ("a", 30.0)


@pytest.mark.parametrize(("field", "bad", "message"), [("retain_s", -1, "retain_s must be a non-negative"),
                                                      ("retain_s", "1", "retain_s must be a number"),
                                                      ("session", "", "session must be a non-empty string")])
def test_a_bad_session_field_names_its_line(tmp_path: Path, field: str, bad: object, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(LINE) + "\n" + json.dumps({**LINE, field: bad}) + "\n")
    with pytest.raises(TraceError, match=f"line 2: {message}"):
        read_trace(path)
