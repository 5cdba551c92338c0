"""TraceRecorder: one JSON line per request, keys in hex; a bad path fails at once, a write error never does."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvoffload.trace_format import TraceError, TraceRecorder


def test_a_request_is_one_json_line_with_its_keys_in_hex(tmp_path: Path) -> None:
    recorder = TraceRecorder(tmp_path / "trace.jsonl")
    recorder.record(1250.5, 40, 5, 16, [bytes.fromhex("00" * 15 + "01"), bytes.fromhex("ab" * 16)])
    recorder.close()
    assert (tmp_path / "trace.jsonl").read_text() == (
        '{"timestamp": 1250.5, "input_length": 40, "output_length": 5, "block_tokens": 16, '
        '"hash_ids": ["00000000000000000000000000000001", "abababababababababababababababab"]}\n')


def test_recording_appends_to_an_existing_trace(tmp_path: Path) -> None:
    for _ in range(2):
        recorder = TraceRecorder(tmp_path / "trace.jsonl")
        recorder.record(0.0, 16, 1, 16, [b"\x01"])
        recorder.close()
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == 2


def test_a_path_that_cannot_be_opened_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=f"cannot record a trace to {tmp_path}/no/such/dir/t.jsonl"):
        TraceRecorder(tmp_path / "no" / "such" / "dir" / "t.jsonl")


def test_a_write_error_is_logged_once_and_stops_recording(caplog: pytest.LogCaptureFixture) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full to fail a write")
    recorder = TraceRecorder("/dev/full")  # opens fine; every flushed write fails with ENOSPC
    with caplog.at_level(logging.WARNING, logger="kvoffload.trace_format"):
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
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == 1
