"""Several engines on one node: the routers, private tiers of C/N beside one node pool of C on hand-worked traces,
N=1 equal to the plain replay, and ``kvoffload replay --engines``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from tests.tools.replay.traces import BLOCK, chained_prompts, trace, write_jsonl

from kvoffload.config import EvictionPolicy, StoreAdmission
from kvoffload.tools.cli import main
from kvoffload.tools.replay import Bound, Strategy, replay
from kvoffload.tools.replay.engines import (
    Engines,
    Router,
    assign,
    merge,
    parse_engines,
    replay_private,
    split,
)

STRATEGIES: list[Strategy] = [*EvictionPolicy, Bound.OPTIMUM, Bound.UNBOUNDED]
ALL = StoreAdmission.ALL
ROUND_ROBIN = Engines(2, Router.ROUND_ROBIN)


def test_round_robin_sends_request_i_to_engine_i_mod_n() -> None:
    assert assign(7, Engines(3, Router.ROUND_ROBIN)) == [0, 1, 2, 0, 1, 2, 0]


def test_random_draws_one_seeded_choice_per_request() -> None:
    engines = Engines(4, Router.RANDOM, seed=11)
    rng = random.Random(11)
    assert assign(50, engines) == [rng.randrange(4) for _ in range(50)]
    assert assign(50, engines) == assign(50, Engines(4, Router.RANDOM, seed=11))
    assert assign(50, engines) != assign(50, Engines(4, Router.RANDOM, seed=12))
    assert set(assign(50, engines)) == {0, 1, 2, 3}


def test_split_keeps_arrival_order_within_each_engine() -> None:
    t = trace([0], [1], [2], [3], [4])
    parts = split(t, [1, 0, 1, 1, 0], 3)
    assert [[r.keys for r in p.requests] for p in parts] == [
        [t.requests[1].keys, t.requests[4].keys], [t.requests[0].keys, t.requests[2].keys, t.requests[3].keys], []]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_shared_prefix_hits_more_in_one_node_pool_than_in_private_tiers(strategy: Strategy) -> None:
    # Four requests of the same 3-block prompt; node pool 4 blocks, 2 engines of 2 blocks, round-robin.
    # Node: the first request misses, the other three hit all 3 blocks: 9 blocks, 36 tokens.
    # Private: each engine misses its first request and stores the 2 leading blocks that fit, then hits those 2
    # on its second: 4 blocks, 16 tokens. Unbounded private tiers: each engine's second request hits 3: 6 blocks.
    t = trace(*[[0, 1, 2]] * 4)
    private = replay_private(t, 4, strategy, ALL, assign(4, ROUND_ROBIN), 2)
    node = replay(t, 4, strategy)
    expected_private = 6 if strategy is Bound.UNBOUNDED else 4
    assert (node.hit_blocks, node.hit_tokens) == (9, 9 * BLOCK)
    assert (private.hit_blocks, private.hit_tokens) == (expected_private, expected_private * BLOCK)
    assert private.input_tokens == node.input_tokens == 12 * BLOCK
    assert private.capacity_blocks == (6 if strategy is Bound.UNBOUNDED else 4)


def test_a_router_sending_everything_to_one_engine_is_caught() -> None:
    # A 2-block prompt four times, private tiers of 2 blocks: round-robin makes each engine miss once (4 hits), a
    # router that sends every request to engine 0 misses once in all (6 hits, as the node pool).
    t = trace(*[[0, 1]] * 4)
    right = replay_private(t, 4, EvictionPolicy.LRU, ALL, assign(4, ROUND_ROBIN), 2)
    wrong = replay_private(t, 4, EvictionPolicy.LRU, ALL, [0, 0, 0, 0], 2)
    assert (right.hit_blocks, wrong.hit_blocks) == (4, 6)


@settings(max_examples=30, deadline=None)
@given(chained_prompts(max_requests=8))
def test_one_engine_private_and_node_equal_the_plain_replay(prompts: list[list[int]]) -> None:
    t = trace(*prompts)
    one = Engines(1, Router.RANDOM, seed=5)
    for strategy in STRATEGIES:
        plain = replay(t, 3, strategy)
        private = replay_private(t, 3, strategy, ALL, assign(len(prompts), one), 1)
        assert {**private.to_dict(), "seconds": 0} == {**plain.to_dict(), "seconds": 0}


def test_merge_adds_the_counts_and_keeps_the_strategy() -> None:
    a, b = replay(trace([0, 1], [0, 1]), 2), replay(trace([5], [6], [5]), 2)
    merged = merge([a, b])
    assert (merged.strategy, merged.requests, merged.hit_blocks, merged.capacity_blocks) == ("lru", 5, 3, 4)
    assert merged.input_tokens == a.input_tokens + b.input_tokens


@pytest.mark.parametrize(("count", "router", "seed", "message"), [
    (0, None, None, "--engines 0"),
    (None, "random", None, "--router needs --engines"),
    (None, None, 3, "--seed needs --engines"),
    (2, "prefix", None, "unknown --router 'prefix'"),
    (2, "round-robin", 3, "--seed needs --router random"),
])
def test_bad_engine_options_name_the_flag(count: int | None, router: str | None, seed: int | None,
                                          message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_engines(count, router, seed)


def test_without_engines_there_is_no_multi_engine_run() -> None:
    assert parse_engines(None, None, None) is None
    assert parse_engines(2, None, None) == Engines(2, Router.ROUND_ROBIN, 0)


@pytest.fixture
def shared_prefix_file(tmp_path: Path) -> str:
    return str(write_jsonl(tmp_path / "trace.jsonl", [[0, 1, 2]] * 4))


def test_replay_engines_prints_both_setups(shared_prefix_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--trace", shared_prefix_file, "--capacity", "2048", "--engines", "2", "--router",
            "round-robin", "--workers", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "2 engines, router round-robin: private tiers of 1,024 tokens each, or one node pool of 2,048" in out[1]
    assert out[2].split()[:4] == ["strategy", "admission", "private", "hit"]
    rows = {line.split()[0]: line.split()[2:4] for line in out[4:]}
    assert list(rows) == [*(p.value for p in EvictionPolicy), "optimum", "unbounded"]
    assert rows["lru"] == ["0.333", "0.75"] and rows["unbounded"] == ["0.5", "0.75"]


def test_replay_engines_json_has_private_rows_and_the_comparison(shared_prefix_file: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--trace", shared_prefix_file, "--capacity", "2048", "--engines", "2", "--router", "random",
            "--seed", "1", "--json", "--workers", "2"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["engines"] == {"count": 2, "router": "random", "seed": 1, "private_capacity_tokens": 1024}
    node = {r["strategy"]: r for r in doc["results"]}
    private = {r["strategy"]: r for r in doc["private"]}
    assert node["optimum"]["fraction_of_optimum"] == private["optimum"]["fraction_of_optimum"] == 1.0
    comparison = {c["strategy"]: c for c in doc["comparison"]}
    lru = comparison["lru"]
    assert lru["node_token_hit_rate"] == node["lru"]["token_hit_rate"] == 0.75
    assert lru["private_token_hit_rate"] == private["lru"]["token_hit_rate"]
    assert lru["gain"] == pytest.approx(lru["node_token_hit_rate"] - lru["private_token_hit_rate"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--engines", "0"], "--engines 0"),
    (["--router", "random"], "--router needs --engines"),
    (["--engines", "2", "--router", "sticky"], "unknown --router 'sticky'"),
])
def test_bad_engine_flags_exit_2_naming_the_flag(shared_prefix_file: str, capsys: pytest.CaptureFixture[str],
                                                 argv: list[str], message: str) -> None:
    assert main(["replay", "--trace", shared_prefix_file, *argv]) == 2
    err = capsys.readouterr().err
    assert "kvoffload replay: error: " in err and message in err
