"""Store admission in replay: ``all`` by default; a rule of ``kvoffload.manager.admission`` (the fixed API:
``make_admission(kind, capacity_blocks).admit(keys) -> int``) decides how many leading missed blocks are stored."""

from __future__ import annotations

import enum
import sys
import types
from collections.abc import Sequence

import pytest
from tests.replay.traces import trace

from kvoffload import config
from kvoffload.config import EvictionPolicy
from kvoffload.keys import OffloadKey
from kvoffload.replay import Bound, replay
from kvoffload.replay.admission import admission_names, make_admit


class _Kinds(enum.Enum):
    SECOND_SIGHTING = "second-sighting"
    ALL = "all"


class _SecondSighting:
    """Stores the leading missed blocks that were seen before (a stand-in with the API's shape)."""

    def __init__(self, kind: _Kinds, capacity_blocks: int) -> None:
        self.seen: set[OffloadKey] = set()

    def admit(self, keys: Sequence[OffloadKey]) -> int:
        count = 0
        while count < len(keys) and keys[count] in self.seen:
            count += 1
        self.seen.update(keys)
        return count


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("kvoffload.manager.admission")
    module.make_admission = _SecondSighting  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvoffload.manager.admission", module)
    monkeypatch.setattr(config, "StoreAdmission", _Kinds, raising=False)


def test_all_stores_every_missed_block() -> None:
    assert make_admit("all", 4)([OffloadKey(b"a"), OffloadKey(b"b")]) == 2
    assert admission_names()[0] == "all"


def test_a_rule_of_the_manager_decides_what_replay_stores(stand_in: None) -> None:
    assert admission_names() == ["all", "second-sighting"]
    t = trace([0, 1], [0, 1], [0, 1])
    everything = replay(t, 4, EvictionPolicy.LRU)
    second = replay(t, 4, EvictionPolicy.LRU, admission="second-sighting")
    assert (everything.hit_blocks, everything.stored_blocks) == (4, 2)
    # Seen once in request 0 (declined), stored in request 1, hit in request 2.
    assert (second.admission, second.hit_blocks, second.stored_blocks, second.declined_blocks) == (
        "second-sighting", 2, 2, 2)


def test_the_bounds_ignore_the_admission_rule(stand_in: None) -> None:
    t = trace([0, 1], [0, 1], [0, 1])
    assert replay(t, 4, Bound.OPTIMUM, admission="second-sighting").admission == "all"
    assert replay(t, 4, Bound.UNBOUNDED, admission="second-sighting").hit_blocks == 4


def test_second_sighting_of_the_manager_stores_a_block_seen_before() -> None:
    pytest.importorskip("kvoffload.manager.admission")
    t = trace([0, 1], [0, 1], [0, 1], [2])
    result = replay(t, 4, EvictionPolicy.LRU, admission="second-sighting")
    # Request 0 offers 0, 1 (declined), request 1 offers them again (stored), request 2 hits, 2 is seen once.
    assert (result.stored_blocks, result.declined_blocks, result.hit_blocks) == (2, 3, 2)
