"""Every numeric key has a range: its bounds are accepted, the next values out are refused naming the key and the
range, and docs/configuration.md shows the range the parser applies."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from kvoffload.config import GIB, KEYS, ConfigError, OffloadConfig
from kvoffload.config.values import MAX_BYTES, FloatRange, GibSize, IntRange

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = {"disk_path": "/tmp/kvoffload-ranges", "remote_url": "redis://127.0.0.1:6379", "object_url": "s3://kvoffload-x"}
RANGED = {key: parser for key, (parser, _) in KEYS.items() if isinstance(parser, IntRange | FloatRange)}
ISSUE_21_KEYS = {"offload_block_tokens", "host_bytes", "host_gib", "disk_io_threads", "copy_threads",
                 "disk_read_deadline_ms", "disk_breaker_errors", "disk_breaker_cooldown_s", "remote_timeout_ms",
                 "remote_connect_timeout_ms", "remote_ttl_s", "remote_bytes", "remote_gib", "remote_breaker_errors",
                 "remote_breaker_cooldown_s", "prefill_tokens_per_s", "inject_load_failures", "inject_load_corruption"}


def parse(key: str, value: Any) -> OffloadConfig:
    return OffloadConfig.from_dict({**CONTEXT, key: value})


def edges(parser: IntRange | FloatRange) -> tuple[list[Any], list[Any]]:
    """The values at the range's bounds, and the nearest ones out of it (plus wrong types for the range's kind)."""
    if isinstance(parser, IntRange):
        return [parser.lo, parser.hi], [parser.lo - 1, parser.hi + 1, float(parser.lo), True, 10**400]
    below, above = math.nextafter(parser.lo, -math.inf), math.nextafter(parser.hi, math.inf)
    return [parser.lo, parser.hi], [below, above, math.nan, math.inf, -math.inf, -parser.hi, 10**400, "1"]


def assert_range_enforced(key: str) -> None:
    parser = RANGED[key]
    inside, outside = edges(parser)
    for value in inside:
        parse(key, value)
    for value in outside:
        with pytest.raises(ConfigError) as err:
            parse(key, value)
        assert f"{key}=" in str(err.value) and parser.accepted in str(err.value), (key, value)


def test_every_numeric_key_that_issue_21_names_has_a_range() -> None:
    assert set(RANGED) >= ISSUE_21_KEYS


@pytest.mark.parametrize("key", sorted(RANGED))
def test_a_range_accepts_its_bounds_and_refuses_the_next_values_out(key: str) -> None:
    assert_range_enforced(key)


def test_removing_a_range_check_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def type_check_only(self: IntRange, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"must be an integer in {self.accepted}")
        return v

    monkeypatch.setattr(IntRange, "__call__", type_check_only)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        assert_range_enforced("disk_io_threads")


@pytest.mark.parametrize("key", sorted(RANGED))
def test_the_docs_table_shows_the_range_the_parser_applies(key: str) -> None:
    rows = [line for line in (ROOT / "docs" / "configuration.md").read_text().splitlines()
            if line.startswith(f"| `{key}` |")]
    assert len(rows) == 1
    assert rows[0].split(" | ")[2] == RANGED[key].accepted


def test_gib_sizes_run_from_one_byte_to_the_largest_size() -> None:
    parser = KEYS["host_gib"][0]
    assert isinstance(parser, GibSize)
    assert parse("host_gib", parser.lo).host.capacity_bytes == 1
    assert parse("host_gib", parser.hi).host.capacity_bytes == MAX_BYTES
    assert parse("host_gib", 0.5).host.capacity_bytes == GIB // 2


def test_durations_in_ms_become_seconds_at_both_ends() -> None:
    low, high = parse("remote_timeout_ms", 1).remote, parse("remote_timeout_ms", 3_600_000).remote
    assert low is not None and high is not None
    assert (low.timeout_s, high.timeout_s) == (0.001, 3600.0)
