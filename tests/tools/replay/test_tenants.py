"""Replay with tenants: per-tenant counts on hand-worked traces, the quotas parser, and the two figures of the issue
(isolation under a flood, the cost of quotas when nobody floods), each shown to catch a missing or wrong rule."""

from __future__ import annotations

import pytest

from kvoffload.config import EvictionPolicy
from kvoffload.tools.replay.synthetic import FLOOD, synthetic
from kvoffload.tools.replay.tenants import (
    Quotas,
    compare_tenants,
    isolation_misses,
    parse_quotas,
    replay_alone,
    replay_tenants,
    resident_blocks,
    total_gap,
)
from kvoffload.tools.replay.trace import Request, Trace, int_key

BLOCK = 4
QUOTAS = '{"default": 0.2, "t0": 0.2, "t1": 0.2, "t2": 0.2, "t3": 0.2}'
TIER = 200


def tenant_trace(*prompts: tuple[str | None, list[int]]) -> Trace:
    return Trace(tuple(Request(float(i), len(ids) * BLOCK, 1, tuple(int_key(b) for b in ids), tenant)
                       for i, (tenant, ids) in enumerate(prompts)), BLOCK)


# a stores 2 blocks; b (not named: the default share) floods 6; a comes back.
FLOODED = tenant_trace(("a", [1, 2]), ("b", [10, 11]), ("b", [12, 13]), ("b", [14, 15]), ("a", [1, 2]))
HALVES = Quotas(("a",), (0.5,), 0.5)


def test_quotas_keep_an_under_share_tenants_blocks_through_a_flood() -> None:
    with_quotas = replay_tenants(FLOODED, 4, quotas=HALVES)
    a, b = with_quotas.tenants["a"], with_quotas.tenants["b"]
    assert (a.hit_blocks, a.evicted_blocks, resident_blocks(a)) == (2, 0, 2)
    assert (b.stored_blocks, b.evicted_blocks, resident_blocks(b)) == (6, 4, 2)
    assert with_quotas.total.strategy == "lru+quotas"


def test_without_quotas_the_flood_evicts_the_other_tenants_blocks_and_they_count_as_its_losses() -> None:
    without = replay_tenants(FLOODED, 4)
    a = without.tenants["a"]
    # a's blocks go to b's stores: the evictions count against a, whose blocks they were, and a's two first
    # blocks were never read (waste); a's repeat misses and stores them again.
    assert (a.hit_blocks, a.evicted_blocks, a.wasted_blocks, a.stored_blocks) == (0, 2, 2, 4)
    assert without.total.strategy == "lru"


def test_tenant_figures_add_up_to_the_totals() -> None:
    result = replay_tenants(synthetic(f"synthetic:tenants-flood:{TIER}"), TIER,
                            quotas=parse_quotas(QUOTAS, Trace((), 16)))
    for field in ("requests", "input_tokens", "hit_tokens", "blocks", "hit_blocks", "stored_blocks",
                  "evicted_blocks", "wasted_blocks", "unread_blocks"):
        assert sum(getattr(r, field) for r in result.tenants.values()) == getattr(result.total, field), field
    assert resident_blocks(result.total) == TIER
    assert result.total.capacity_blocks == TIER


def test_requests_without_a_tenant_count_for_the_shared_tenant() -> None:
    result = replay_tenants(tenant_trace((None, [1]), (None, [1])), 2)
    assert list(result.tenants) == ["shared"] and result.tenants["shared"].hit_blocks == 1


def test_alone_replays_each_tenant_on_its_share() -> None:
    alone = replay_alone(FLOODED, 4, HALVES)
    assert alone["a"].capacity_blocks == 2 and alone["a"].hit_blocks == 2
    assert alone["b"].capacity_blocks == 2 and alone["b"].requests == 3


def test_a_capacity_below_one_block_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity 0 blocks"):
        replay_tenants(FLOODED, 0)


def test_parse_quotas_takes_a_tenant_quota_mapping_or_equal() -> None:
    q = parse_quotas(QUOTAS, FLOODED)
    assert (q.names, q.default, q.share_of("t1"), q.share_of("anyone")) == (("t0", "t1", "t2", "t3"), 0.2, 0.2, 0.2)
    assert q.spec() == {"default": 0.2, "t0": 0.2, "t1": 0.2, "t2": 0.2, "t3": 0.2}
    equal = parse_quotas("equal", FLOODED)
    assert (equal.names, equal.shares, equal.default) == (("a", "b"), (0.5, 0.5), 0.0)


@pytest.mark.parametrize(("text", "message"), [
    ("{nope", "neither 'equal' nor a JSON mapping"),
    ('{"t0": 0.5}', 'with a "default"'),
    ('{"default": 0.6, "t0": 0.6}', "more than the whole tier"),
    ('{"default": 0.5, "other": 0.5}', '"other" is the name'),
])
def test_parse_quotas_names_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quotas(text, FLOODED)


def test_equal_refuses_a_trace_of_more_tenants_than_can_be_named() -> None:
    many = tenant_trace(*((f"t{i}", [i]) for i in range(17)))
    with pytest.raises(ValueError, match="17 tenants"):
        parse_quotas("equal", many)


def flood_comparison(use_quotas: bool) -> list[str]:
    trace = synthetic(f"synthetic:tenants-flood:{TIER}")
    return isolation_misses(compare_tenants(trace, TIER, parse_quotas(QUOTAS, trace), use_quotas=use_quotas),
                            exempt=[FLOOD])


def test_under_a_flood_every_chat_tenant_keeps_its_shares_hit_rate_with_quotas() -> None:
    assert flood_comparison(use_quotas=True) == []


def test_the_isolation_check_catches_a_replay_without_quotas() -> None:
    # Control: the same check on a "with quotas" side that has none finds every chat tenant below 0.9x.
    assert flood_comparison(use_quotas=False) == ["t0", "t1", "t2", "t3"]


def test_without_a_flood_quotas_cost_under_two_points_of_total_hit_rate() -> None:
    trace = synthetic(f"synthetic:tenants-calm:{TIER}")
    assert abs(total_gap(compare_tenants(trace, TIER, parse_quotas(QUOTAS, trace)))) < 0.02


def test_the_total_check_catches_quotas_that_starve_most_tenants() -> None:
    # Control: t1..t3 at a hundredth of the tier each evict their own blocks at once; the gap shows it.
    trace = synthetic(f"synthetic:tenants-calm:{TIER}")
    starving = parse_quotas('{"default": 0.01, "t0": 0.97, "t1": 0.01, "t2": 0.01}', trace)
    assert total_gap(compare_tenants(trace, TIER, starving)) < -0.1


def test_rows_list_named_tenants_first_and_every_policy_kind_replays() -> None:
    trace = synthetic(f"synthetic:tenants-flood:{TIER}")
    for kind in EvictionPolicy:
        comparison = compare_tenants(trace, TIER, parse_quotas(QUOTAS, trace), kind)
        assert [r.tenant for r in comparison.rows] == ["t0", "t1", "t2", "t3", FLOOD]
        assert comparison.with_quotas.strategy == f"{kind.value}+quotas"
