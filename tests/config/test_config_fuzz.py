"""Whatever the keys and values, parsing succeeds or raises a ConfigError naming the culprit: never another exception.

The property walks ``KEYS`` itself, so that a new key is covered without touching this file. A ranged key must also
accept exactly the values of its range (tests/config/test_config_ranges.py checks the bounds one by one).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.config import KEYS, ConfigError, EvictionPolicy, OffloadConfig
from kvoffload.config.values import FloatRange, IntRange


class Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def shown(key: Any) -> str:
    """How an unknown key is named in the error (a repr cut short, or its type when it has none)."""
    try:
        return repr(key)[:40]
    except Exception:
        return f"<{type(key).__name__}>"


CONTEXT = {"disk_path": "/tmp/kvoffload-fuzz", "remote_url": "redis://127.0.0.1:6379", "object_url": "s3://kvoffload-fuzz"}
"""Valid owners of the disk_*, remote_*, object_* and tier_secret_* keys, so a value is judged on its own."""

ODD_NUMBERS = [math.nan, math.inf, -math.inf, 1e300, -1e300, -1, 0, -0.0, 1e-300, 5e-324, 0.5, 2**31, 2**63 - 1,
               2**63, 2**64, 10**30, 10**400, -(10**400), 10**5000, 1e30]
ODD_TEXT = ["", " ", "\0", "a\0b", "/tmp/x\0", "~nosuchuser/x", "~nosuchuser", "~", "/", ".", "..", "-1", "0", "1e300",
            "nan", "inf", "true", "LRU", "x" * 5000, "/" + "d/" * 3000, "\udcff", "\ud800", "redis://h:99999",
            "redis://h:notaport", "redis://[::1", "redis://[::1]:6379", "redis://h:0", "redis://:pw@h:1",
            "redis://h:1/x", "redis://h:1?password=pw", "redis://h:1#f", "rediss://h", "unix://", "unix:///",
            "unix://host/sock", "http://h:1", "https://h", "http://u:p@h:1", "http://h:1/b", "s3://", "s3://b",
            "s3://kvoffload", "s3://kvoffload/a//b", "s3://Kv/x", "s3://1.2.3.4", "s3://a..b", "s3://u:p@kv/x",
            "redis://h:1 ", "redis:// h:1", "redis://é:1", "redis://h:1/0?db=1"]
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.sampled_from(ODD_NUMBERS), st.text(max_size=12),
    st.sampled_from(ODD_TEXT), st.binary(max_size=8), st.sampled_from(list(EvictionPolicy)),
    st.lists(st.one_of(st.integers(), st.sampled_from(ODD_TEXT)), max_size=3),
    st.tuples(st.sampled_from(ODD_TEXT)), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just(object()), st.just(float), st.just(b"\0"), st.just(bytearray(b"x")),
)


def near_misses(key: str) -> list[str]:
    return [key[:-1], key + "s", key.upper(), key.replace("_", "-"), f" {key}", f"{key} ", key.replace("_", ""),
            key[1:] + key[0], f"{key}\0"]


NON_STR_KEYS = [None, 0, 1, -1, 1.5, math.nan, True, b"disk_path", ("disk_path",), frozenset({"host_bytes"}),
                10**5000, Unprintable()]


def in_range(parser: IntRange | FloatRange, value: Any) -> bool:
    """Whether the range admits ``value``, decided here without the parser's code."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(parser, IntRange) and not isinstance(value, int):
        return False
    return parser.lo <= value <= parser.hi


def check(key: Any, value: Any) -> None:
    """Parse ``{key: value}`` among valid keys: success or a ConfigError naming ``key``; a ranged key's outcome
    is its range's."""
    raw: dict[Any, Any] = {k: v for k, v in CONTEXT.items() if k != key}
    raw[key] = value
    try:
        OffloadConfig.from_dict(raw)
    except ConfigError as e:
        culprit = key if isinstance(key, str) and key in KEYS else shown(key)
        assert culprit in str(e), (key, value, str(e))
        accepted = False
    else:
        accepted = True
    parser = KEYS[key][0] if isinstance(key, str) and key in KEYS else None
    if isinstance(parser, IntRange | FloatRange):
        assert accepted == in_range(parser, value), (key, value, accepted)


@pytest.mark.parametrize("key", list(KEYS))
@settings(max_examples=80, deadline=None)
@given(value=VALUES)
def test_any_value_of_any_key_parses_or_is_a_config_error_naming_the_key(key: str, value: Any) -> None:
    check(key, value)


@pytest.mark.parametrize("key", list(KEYS))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e300, -1, 0, 1e-300, 10**400, None, "a\0b",
                                   "~nosuchuser/x", [], {}, Unprintable()], ids=shown)
def test_each_odd_value_of_each_key_parses_or_is_a_config_error_naming_the_key(key: str, value: Any) -> None:
    check(key, value)


@pytest.mark.parametrize("key", list(KEYS))
def test_a_near_miss_of_each_key_is_an_unknown_key_suggesting_the_key(key: str) -> None:
    for name in near_misses(key):
        check(name, 1)
    with pytest.raises(ConfigError, match=f"unknown key '{key}s'.*did you mean '{key}'"):
        OffloadConfig.from_dict({f"{key}s": 1})


@pytest.mark.parametrize("key", NON_STR_KEYS, ids=shown)
def test_a_key_that_is_not_a_string_is_a_config_error_naming_it(key: Any) -> None:
    check(key, 1)
    with pytest.raises(ConfigError, match="is not a string"):
        OffloadConfig.from_dict({key: 1, "host_bytes": 1 << 20})


def test_the_check_catches_an_exception_that_is_not_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(v: Any) -> Any:
        raise TypeError("a parser bug")

    monkeypatch.setitem(KEYS, "model_id", (crash, KEYS["model_id"][1]))
    with pytest.raises(TypeError, match="a parser bug"):
        check("model_id", "m")
