"""adapters.step_schedule: vLLM's SchedulerOutput as columns, new requests first, with the tokens computed after
the step (decode, chunked prefill, speculative tokens left out), and which requests bring their whole block table
(every new request, vLLM 0.34's resumed ones among them, and up to 0.33 the resumed running ones) or were
preempted."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector import utils as kv_connector_utils
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from kvoffload.integrations.vllm import adapters


def output(new: list[tuple[str, int, int]], cached: list[tuple[str, int, int]],
           spec: dict[str, list[int]] | None = None) -> SchedulerOutput:
    """``new`` and ``cached``: (request id, computed before the step, tokens scheduled)."""
    out = SchedulerOutput.make_empty()
    # prefill_token_ids: required from vLLM 0.34, a keyword since 0.31
    out.scheduled_new_reqs = [NewRequestData(r, [1] * 64, [], None, None, ([i, i + 1],), before, None,
                                             prefill_token_ids=[1] * 64)
                              for i, (r, before, _) in enumerate(new)]
    data = CachedRequestData.make_empty()
    for i, (r, before, _) in enumerate(cached):
        data.req_ids.append(r)
        data.new_block_ids.append(([100 + i],) if i % 2 else None)
        data.num_computed_tokens.append(before)
        data.num_output_tokens.append(1)
    out.scheduled_cached_reqs = data
    out.num_scheduled_tokens = {r: n for r, _, n in [*new, *cached]}
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    out.scheduled_spec_decode_tokens = spec or {}
    return out


def test_a_decode_step_adds_one_token_to_every_request() -> None:
    step = adapters.step_schedule(output([], [("a", 40, 1), ("b", 17, 1), ("c", 99, 1)]))
    assert list(step.req_ids) == ["a", "b", "c"]
    assert step.computed_after() == [41, 18, 100]
    assert list(step.new_block_ids) == [None, ([101],), None]


def test_new_requests_come_first_and_chunks_count_their_scheduled_tokens() -> None:
    step = adapters.step_schedule(output([("n", 0, 32), ("m", 16, 48)], [("a", 40, 1), ("b", 64, 16)]))
    assert list(step.req_ids) == ["n", "m", "a", "b"]
    assert step.computed_after() == [32, 64, 41, 80]
    assert list(step.new_block_ids) == [([0, 1],), ([1, 2],), None, ([101],)]


def test_speculative_tokens_are_not_counted_as_computed() -> None:
    step = adapters.step_schedule(output([], [("a", 40, 4), ("b", 17, 1)], spec={"a": [5, 6, 7]}))
    assert step.computed_after() == [41, 18]


def test_resumed_and_preempted_requests_are_named() -> None:
    out = output([], [("a", 40, 1), ("b", 10, 1)])
    out.scheduled_cached_reqs.resumed_req_ids = {"b"}
    out.preempted_req_ids = {"c"}
    step = adapters.step_schedule(out)
    assert step.resumed == {"b"} and step.preempted_req_ids == {"c"}


def yield_req_data_033(out: SchedulerOutput) -> Iterator[tuple[str, Any, bool]]:
    """vLLM 0.33's ``kv_connector.utils.yield_req_data``: its third value became "the whole block table", true for
    new requests too (up to 0.32 it was true only for requests resumed after a preemption)."""
    for r in out.scheduled_new_reqs:
        yield r.req_id, r.block_ids, True
    cached = out.scheduled_cached_reqs
    yield from zip(cached.req_ids, cached.new_block_ids, (r in cached.resumed_req_ids for r in cached.req_ids),
                   strict=True)


@pytest.mark.parametrize("helper", ["installed", "0.33"])
def test_a_new_request_brings_its_whole_table_and_is_not_preempted_whatever_vllms_helper_says(
        monkeypatch: pytest.MonkeyPatch, helper: str) -> None:
    # The adapter reads resumed_req_ids and preempted_req_ids, never yield_req_data (api_surface.AVOIDED): a new
    # request's block ids are its whole table, and it must not be fenced.
    if helper == "0.33":
        monkeypatch.setattr(kv_connector_utils, "yield_req_data", yield_req_data_033)
    out = output([("n", 0, 32)], [("a", 40, 1), ("b", 10, 1)])
    out.scheduled_cached_reqs.resumed_req_ids = {"b"}
    out.preempted_req_ids = {"c"}

    step = adapters.step_schedule(out)

    assert list(step.req_ids) == ["n", "a", "b"]
    assert step.resumed == {"n", "b"}
    assert step.preempted_req_ids == {"c"}


def test_without_resumed_req_ids_a_request_re_sent_in_full_replaces_its_old_table() -> None:
    # vLLM 0.34: CachedRequestData has no resumed_req_ids; a resumed request comes back among the new ones.
    out = output([("r", 0, 64)], [("a", 40, 1)])
    vars(out.scheduled_cached_reqs).pop("resumed_req_ids", None)  # also on 0.31 to 0.33, which have it
    assert not hasattr(out.scheduled_cached_reqs, "resumed_req_ids")

    step = adapters.step_schedule(out)

    assert step.resumed == {"r"}
    assert list(step.req_ids) == ["r", "a"] and step.new_block_ids[0] == ([0, 1],)
