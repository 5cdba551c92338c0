"""The scheduler half's retention hints (connector/retention.py): a hint is read once per request, capped, and a
bad one ignored with one warning and a count; a hinted request's prompt blocks are held at its first lookup and all
of its blocks when it finishes; with ``max_retain_s`` 0 no tier keeps deadlines."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
from tests.connector.schedulers import BLOCK, Req, complete, make_scheduler, run_prefill

from kvoffload.connector.retention import hint_problem
from kvoffload.index.policies import LRUPolicy
from kvoffload.index.retention import RetainPolicy


def hinted(name: str, tokens: int, hint: Any) -> Req:
    return Req(name, list(range(tokens)), kv_transfer_params=None if hint is None else {"kvoffload": hint})


@pytest.mark.parametrize(("hint", "seconds", "counts"), [
    ({"retain_s": 60}, 60.0, [1, 0, 0]),
    ({"retain_s": 2.5}, 2.5, [1, 0, 0]),
    ({"retain_s": 10**9}, 60.0, [1, 1, 0]),  # capped to max_retain_s
    ({"retain_s": 0}, None, [1, 0, 0]),  # asks for nothing
    ({"retain_s": -1}, None, [0, 0, 1]),
    ({"retain_s": math.nan}, None, [0, 0, 1]),
    ({"retain_s": math.inf}, None, [0, 0, 1]),
    ({"retain_s": True}, None, [0, 0, 1]),
    ({"retain_s": "600"}, None, [0, 0, 1]),
    ({"retain_s": 600, "pin": True}, None, [0, 0, 1]),
    ({}, None, [0, 0, 1]),
    (600, None, [0, 0, 1]),
    (None, None, [0, 0, 0]),  # no kvoffload entry: not a hint at all
])
def test_a_hint_is_read_capped_or_ignored_and_counted(hint: Any, seconds: float | None, counts: list[int]) -> None:
    sched = make_scheduler(max_retain_s=60)
    retention = sched.retention
    assert retention is not None
    assert retention.retain_s(hinted("r", 40, hint)) == seconds
    figures = retention.take_figures()
    assert (figures.hints if figures is not None else [0, 0, 0]) == counts


def test_other_connectors_params_are_not_a_hint() -> None:
    retention = make_scheduler().retention
    assert retention is not None
    assert retention.retain_s(Req("r", [1], kv_transfer_params={"do_remote_decode": True})) is None
    assert retention.take_figures() is None


def test_bad_hints_warn_once_per_engine(caplog: pytest.LogCaptureFixture) -> None:
    retention = make_scheduler().retention
    assert retention is not None
    with caplog.at_level(logging.WARNING, logger="kvoffload.connector.retention"):
        for i in range(3):
            retention.retain_s(hinted(f"r{i}", 8, {"retain_s": "soon"}))
    assert len(caplog.records) == 1 and "retain_s must be a number" in caplog.records[0].getMessage()


def test_hint_problems_name_what_is_wrong() -> None:
    assert hint_problem({"retain_s": 1}) is None
    assert "unknown key(s) x" in (hint_problem({"retain_s": 1, "x": 2}) or "")
    assert "no retain_s" in (hint_problem({}) or "")


def test_a_hinted_requests_prompt_is_held_at_its_first_lookup_and_all_its_blocks_when_it_finishes() -> None:
    sched = make_scheduler(host_blocks=8)
    retention = sched.retention
    assert retention is not None
    book = retention.book
    req = hinted("r", 3 * BLOCK + 1, {"retain_s": 600})
    complete(sched, run_prefill(sched, req))
    prompt = sched._requests["r"].keys(0, 3, 0)
    assert all(book.deadline(k) is not None for k in prompt)
    assert [t.retained() for t in book.tiers] == [3]  # stored, and kept
    req.all_token_ids += list(range(100, 100 + BLOCK))  # decoded a block more: held when it finishes
    later = sched._requests["r"].keys(0, 4, 0)
    sched.request_finished("r")
    assert book.deadline(later[3]) is not None and book.deadline(later[0]) is not None


def test_unhinted_requests_hold_nothing() -> None:
    sched = make_scheduler(host_blocks=8)
    complete(sched, run_prefill(sched, Req("r", list(range(3 * BLOCK + 1)))))
    sched.request_finished("r")
    assert sched.retention is not None and not sched.retention.book.active


def test_max_retain_s_0_keeps_no_deadlines_anywhere() -> None:
    sched = make_scheduler(max_retain_s=0)
    assert sched.retention is None
    assert isinstance(sched.index.host_policy, LRUPolicy)  # the configured policy itself, as before hints
    assert isinstance(make_scheduler().index.host_policy, RetainPolicy)
    req = hinted("r", 2 * BLOCK + 1, {"retain_s": 600})
    complete(sched, run_prefill(sched, req))  # a hint is then nothing at all
