"""``record_trace``: the engine writes each finished request as a trace line that ``kvoffload replay`` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.config import ConfigError
from kvoffload.testing.sim import SimEngine
from kvoffload.testing.sim_workload import make_engine, tokens
from kvoffload.tools.cli import main
from kvoffload.tools.replay.trace import read_trace

BLOCK = 4


def _engine(trace: Path, factor: int = 1) -> SimEngine:
    return make_engine(block_size=BLOCK, num_blocks=64, host_blocks=128, factor=factor, record_trace=str(trace))


def test_finished_requests_are_recorded_with_their_lengths_and_offload_keys(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    engine = _engine(path, factor=2)
    shared = tokens(3 * 2 * BLOCK, seed=1)  # three offload blocks of 8 tokens
    engine.add_request("a", shared + tokens(10, seed=2), max_new_tokens=3)
    engine.run()
    engine.add_request("b", shared + tokens(13, seed=3), max_new_tokens=2)
    engine.run()
    trace = read_trace(path)
    a, b = trace.requests
    assert trace.block_tokens == 2 * BLOCK
    assert (a.input_length, a.output_length, b.input_length, b.output_length) == (34, 3, 37, 2)
    assert len(a.keys) == len(b.keys) == 4  # full prompt blocks only
    assert a.keys[:3] == b.keys[:3] and a.keys[3] != b.keys[3]
    assert b.timestamp_ms >= a.timestamp_ms >= 0
    # They are the engine's own offload keys: the host tier holds every one of a's blocks under them.
    assert engine.scheduler.index.lookup(list(a.keys)).hits == len(a.keys)
    assert engine.scheduler.index.lookup([bytes(16)]).hits == 0  # and a wrong key would not be found


def test_a_recorded_trace_replays_with_the_shared_prefix_as_hits(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    engine = _engine(path)
    shared = tokens(6 * BLOCK, seed=4)
    for i in range(3):
        engine.add_request(f"r{i}", shared + tokens(7, seed=10 + i))
        engine.run()
    assert main(["replay", "--trace", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 3 and report["block_tokens"] == BLOCK
    # Requests 2 and 3 find the 6 shared blocks; their own 7th block (1 full block each) is new.
    assert {r["hit_blocks"] for r in report["results"]} == {12}
    assert {r["blocks"] for r in report["results"]} == {3 * 7}


def test_a_trace_path_that_cannot_be_opened_is_a_config_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "missing-dir" / "trace.jsonl"
    with pytest.raises(ConfigError, match=f"record_trace: .*{bad}"):
        _engine(bad)
