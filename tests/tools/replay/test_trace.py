"""Reading traces: the Mooncake format, kvoffload's recorded format, and errors that name the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.tools.replay.traces import write_jsonl

from kvoffload.tools.replay import TraceError, int_key, read_trace


def test_mooncake_ids_become_8_byte_big_endian_keys(tmp_path: Path) -> None:
    t = read_trace(write_jsonl(tmp_path / "t.jsonl", [[0, 1], [0, 2]]))
    assert t.block_tokens == 512
    assert t.requests[0].keys == (bytes(8), (1).to_bytes(8, "big"))
    assert t.requests[1].keys[1] == int_key(2)
    assert (t.requests[1].timestamp_ms, t.requests[1].input_length, t.requests[1].output_length) == (10.0, 1024, 7)
    # The shared first block is one object in both requests.
    assert t.requests[0].keys[0] is t.requests[1].keys[0]
    assert (t.input_tokens, t.block_refs, t.distinct_keys()) == (2048, 4, 3)


def test_recorded_traces_carry_hex_keys_and_their_block_size(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    path.write_text(json.dumps({"timestamp": 1.5, "input_length": 40, "output_length": 3, "block_tokens": 16,
                                "hash_ids": ["00ff", "abcd"]}) + "\n\n")
    t = read_trace(path)
    assert t.block_tokens == 16
    assert t.requests[0].keys == (b"\x00\xff", b"\xab\xcd")


def lines_error(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert str(path) in str(e.value)
    return str(e.value)


GOOD = json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0]})


def test_malformed_lines_are_named_by_number(tmp_path: Path) -> None:
    assert "line 3: not JSON" in lines_error(tmp_path, GOOD, "", "{oops")
    assert "line 2: missing field 'hash_ids'" in lines_error(tmp_path, GOOD, '{"timestamp": 0}')
    assert "line 1: expected a JSON object" in lines_error(tmp_path, "[1, 2]")


@pytest.mark.parametrize(("change", "message"), [
    ({"hash_ids": ["zz"]}, "hash id 'zz' is not a hex string"),
    ({"hash_ids": [-1]}, "hash id -1 is neither a hex string nor an integer"),
    ({"hash_ids": [True]}, "hash id True is neither a hex string nor an integer"),
    ({"hash_ids": 5}, "hash_ids must be a list"),
    ({"input_length": -3}, "input_length must be a non-negative integer"),
    ({"timestamp": "noon"}, "timestamp must be a number"),
    ({"block_tokens": 0}, "block_tokens must be positive"),
])
def test_bad_fields_are_named(tmp_path: Path, change: dict[str, object], message: str) -> None:
    line = json.dumps({**json.loads(GOOD), **change})
    assert f"line 1: {message}" in lines_error(tmp_path, line)


def test_a_trace_has_one_block_size(tmp_path: Path) -> None:
    other = json.dumps({**json.loads(GOOD), "block_tokens": 256})
    assert "line 2: block_tokens 256 differs from 512" in lines_error(tmp_path, GOOD, other)


def test_missing_and_empty_files_are_errors_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"cannot read trace .*nowhere\.jsonl"):
        read_trace(tmp_path / "nowhere.jsonl")
    assert "holds no request" in lines_error(tmp_path, "")
