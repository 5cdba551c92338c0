"""A trace the core's TraceRecorder writes replays as the same keys, lengths and arrival times."""

from __future__ import annotations

from pathlib import Path

from kvoffload.tools.replay import read_trace, replay
from kvoffload.trace_format import TraceRecorder


def test_a_recorded_trace_replays_with_the_same_keys(tmp_path: Path) -> None:
    keys = [bytes.fromhex("00" * 15 + "01"), bytes.fromhex("ab" * 16)]
    recorder = TraceRecorder(tmp_path / "trace.jsonl")
    recorder.record(1000.0, 40, 5, 16, keys)
    recorder.record(1250.5, 20, 2, 16, keys[:1])
    recorder.close()
    t = read_trace(tmp_path / "trace.jsonl")
    assert t.block_tokens == 16
    assert [r.keys for r in t.requests] == [tuple(keys), tuple(keys[:1])]
    assert [(r.timestamp_ms, r.input_length, r.output_length) for r in t.requests] == [(1000.0, 40, 5), (1250.5, 20, 2)]
    assert replay(t, 4).hit_blocks == 1
