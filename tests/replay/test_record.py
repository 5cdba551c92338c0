"""TraceRecorder: what it writes replays as the same keys; a bad path fails at once, a write error never does."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvoffload.replay import TraceError, TraceRecorder, read_trace, replay


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


def test_recording_appends_to_an_existing_trace(tmp_path: Path) -> None:
    for _ in range(2):
        recorder = TraceRecorder(tmp_path / "trace.jsonl")
        recorder.record(0.0, 16, 1, 16, [b"\x01"])
        recorder.close()
    assert len(read_trace(tmp_path / "trace.jsonl").requests) == 2


def test_a_path_that_cannot_be_opened_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=f"cannot record a trace to {tmp_path}/no/such/dir/t.jsonl"):
        TraceRecorder(tmp_path / "no" / "such" / "dir" / "t.jsonl")


def test_a_write_error_is_logged_once_and_stops_recording(caplog: pytest.LogCaptureFixture) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full to fail a write")
    recorder = TraceRecorder("/dev/full")  # opens fine; every flushed write fails with ENOSPC
    with caplog.at_level(logging.WARNING, logger="kvoffload.replay.record"):
        recorder.record(0.0, 16, 1, 16, [b"\x01"])
        recorder.record(1.0, 16, 1, 16, [b"\x02"])
    assert not recorder.recording
    assert [r.getMessage() for r in caplog.records] == [
        "trace recording to /dev/full stopped: [Errno 28] No space left on device"]
    recorder.close()


def test_records_after_close_are_ignored(tmp_path: Path) -> None:
    recorder = TraceRecorder(tmp_path / "trace.jsonl")
    recorder.record(0.0, 16, 1, 16, [b"\x01"])
    recorder.close()
    recorder.close()
    recorder.record(1.0, 16, 1, 16, [b"\x02"])
    assert len(read_trace(tmp_path / "trace.jsonl").requests) == 1
