"""Store admission in the simulated engine: with second-sighting, a prefix computed once is not stored, the second
request that computes it stores it, the third loads it; outputs and loaded bytes stay right, and the stats count
every computed block once."""

from __future__ import annotations

import pytest

from kvoffload.connector.stats import SchedulerStats
from kvoffload.connector.stores import StoreAdmitter
from kvoffload.testing import layouts, sim_workload
from kvoffload.testing.sim import SimEngine, SimRequest
from kvoffload.testing.sim_workload import LayoutFactory, tokens

BLOCK = 4
PROMPT = 40
NEW_TOKENS = 9
"""Decode fills blocks 10 and 11 in later steps: each is offered to admission once, in the step it fills."""
COMPUTED_BLOCKS = (PROMPT + NEW_TOKENS - 1) // BLOCK
"""12: the last sampled token is never computed."""


def make_engine(admission: str, layout: LayoutFactory = layouts.attention_layout) -> SimEngine:
    return sim_workload.make_engine(layout, block_size=BLOCK, num_blocks=64, host_blocks=64, store_admission=admission)


def prompt(seed: int = 1) -> list[int]:
    return tokens(PROMPT, seed)


def stored_blocks(engine: SimEngine) -> int:
    return sum(u.used_blocks for u in engine.scheduler.usage())


def run_request(engine: SimEngine, req_id: str, tokens: list[int]) -> tuple[SimRequest, SchedulerStats, int]:
    """Run one request on a cold device cache: it, the scheduler's stats since the last one, blocks held after."""
    engine.pool.drop_cache()
    req = engine.add_request(req_id, tokens, max_new_tokens=NEW_TOKENS)
    engine.run(on_step=lambda e: e.check_all())
    return req, engine.scheduler.take_stats(), stored_blocks(engine)


def three_requests(engine: SimEngine) -> list[tuple[SimRequest, SchedulerStats, int]]:
    """The same prefix three times: ``a`` and ``b`` the same prompt, ``c`` all of ``b``'s tokens."""
    a = run_request(engine, "a", prompt())
    b = run_request(engine, "b", prompt())
    c = run_request(engine, "c", b[0].all_token_ids)
    return [a, b, c]


def check_second_sighting(runs: list[tuple[SimRequest, SchedulerStats, int]], groups: int = 1) -> None:
    """The stats count blocks of tokens; the tier holds one block per KV-cache group of each."""
    (_a, a_stats, a_held), (b, b_stats, b_held), (c, c_stats, _) = runs
    assert a_held == 0 and a_stats.declined_blocks == COMPUTED_BLOCKS and a_stats.admitted_blocks == 0
    assert b.loaded_tokens == 0
    assert b_held == groups * COMPUTED_BLOCKS and b_stats.admitted_blocks == COMPUTED_BLOCKS
    assert b_stats.declined_blocks == 0
    assert c.loaded_tokens == COMPUTED_BLOCKS * BLOCK
    assert c_stats.hit_tokens == c.loaded_tokens


@pytest.mark.parametrize("layout", [layouts.attention_layout, layouts.multi_group_layout],
                         ids=["attention", "multi_group"])
def test_second_sighting_stores_a_prefix_the_second_time_and_the_third_request_loads_it(layout) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine("second-sighting", layout)
    runs = three_requests(engine)
    check_second_sighting(runs, engine.num_groups)
    reference = three_requests(make_engine("all", layout))
    assert [r.all_token_ids for r, _, _ in runs] == [r.all_token_ids for r, _, _ in reference]
    assert engine.corrupt_blocks == [] and engine.verified_blocks == COMPUTED_BLOCKS  # loaded, checked bit for bit
    engine.scheduler.index.check_integrity()


def test_the_check_fails_when_admission_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    def store_all(self: StoreAdmitter, state: object, first: int, end: int) -> int:
        return end

    monkeypatch.setattr(StoreAdmitter, "admitted_end", store_all)
    with pytest.raises(AssertionError):
        check_second_sighting(three_requests(make_engine("second-sighting")))


def test_store_all_counts_every_computed_block_as_admitted() -> None:
    (_a, stats, held), (b, _, _), _ = three_requests(make_engine("all"))
    assert held == COMPUTED_BLOCKS and stats.admitted_blocks == COMPUTED_BLOCKS and stats.declined_blocks == 0
    assert b.loaded_tokens == PROMPT - 1  # every block of b's prompt, all but its last token


def test_blocks_found_in_the_device_cache_are_reuses_and_stored_without_asking() -> None:
    engine = make_engine("second-sighting")
    first, _, _ = run_request(engine, "a", prompt())
    # The device cache still holds a's blocks: b finds them there, a reuse, so they are stored at once.
    b = engine.add_request("b", first.all_token_ids, max_new_tokens=1)
    engine.run(on_step=lambda e: e.check_all())
    stats = engine.scheduler.take_stats()
    assert b.device_hit_tokens == COMPUTED_BLOCKS * BLOCK
    assert stored_blocks(engine) == COMPUTED_BLOCKS
    assert stats.declined_blocks == stats.admitted_blocks == 0


def test_after_a_declined_block_a_request_stores_none_of_its_later_blocks() -> None:
    engine = make_engine("second-sighting")
    run_request(engine, "a", prompt())
    # b shares a's first 20 tokens only: blocks 0-4 are second sightings, block 5 on are new.
    _, stats, held = run_request(engine, "b", prompt()[:20] + prompt(seed=2)[20:])
    assert held == 5 and stats.admitted_blocks == 5 and stats.declined_blocks == COMPUTED_BLOCKS - 5


def test_adaptive_admission_sees_each_prompt_once_and_stores_every_block_at_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvoffload.index.admission import AdaptiveAdmission

    seen: list[int] = []
    looked_up = AdaptiveAdmission.looked_up

    def counted(rule: AdaptiveAdmission, keys: list[object]) -> None:
        seen.append(len(keys))
        looked_up(rule, keys)  # type: ignore[arg-type]

    monkeypatch.setattr(AdaptiveAdmission, "looked_up", counted)
    engine = make_engine("adaptive")
    rule = engine.scheduler.admission
    assert isinstance(rule, AdaptiveAdmission) and rule.admits_all  # no evidence yet: every block
    (_, a_stats, a_held), (b, _, _), _ = three_requests(engine)
    assert a_stats.admitted_blocks == COMPUTED_BLOCKS and a_held == COMPUTED_BLOCKS
    assert b.loaded_tokens == PROMPT - 1  # b hits what a stored: every block, all but the last token
    assert seen == [PROMPT // BLOCK] * 2 + [(PROMPT + NEW_TOKENS) // BLOCK]  # each prompt's full blocks, once


def test_adaptive_eviction_is_steered_by_the_rule_the_scheduler_builds() -> None:
    from kvoffload.config import EvictionPolicy
    from kvoffload.index.admission import AdaptiveAdmission
    from kvoffload.index.policies import AdaptivePolicy
    from kvoffload.index.retention import RetainPolicy

    engine = sim_workload.make_engine(block_size=BLOCK, num_blocks=64, host_blocks=64, eviction_policy="adaptive")
    rule, policy = engine.scheduler.admission, engine.scheduler.index.host_policy
    assert isinstance(policy, RetainPolicy)  # hints are on by default: the adaptive policy orders the rest
    policy = policy.inner
    assert isinstance(policy, AdaptivePolicy) and isinstance(rule, AdaptiveAdmission) and rule._steer is policy
    assert policy.live is EvictionPolicy.LRU and rule.admits_all  # behind store_admission all: every block
    (_, a_stats, a_held), (b, _, _), _ = three_requests(engine)
    assert a_stats.admitted_blocks == COMPUTED_BLOCKS and a_held == COMPUTED_BLOCKS
    assert b.loaded_tokens == PROMPT - 1  # every block of b's prompt, all but its last token
