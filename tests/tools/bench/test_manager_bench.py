"""bench manager at tiny sizes: both sides measured, rows complete, ratios positive, JSON parses; a policy vLLM
lacks is compared with our own ARC."""

from __future__ import annotations

import argparse
import io
import json
from typing import Any

import pytest

from kvoffload.config import EvictionPolicy
from kvoffload.index.retention import RetainPolicy
from kvoffload.tools.bench import manager as bench
from kvoffload.tools.bench.common import Measurement, emit

pytest.importorskip("vllm.v1.kv_offload.cpu.manager")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--prompt-tokens", "128", "--capacity", "32", "--store-batch", "4", "--runs", "2",
                              "--warmup", "1", "--reps", "2", "--quiet", *argv])


def _rows(policy: EvictionPolicy) -> list[dict[str, Any]]:
    work = bench.make_workload(128, 16, 32, 4, runs=3, reps=2)
    return bench.measure(work, policy, runs=2, warmup=1)


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_every_operation_gets_a_row_with_both_sides_measured(policy: EvictionPolicy) -> None:
    rows = _rows(policy)
    assert [r["operation"] for r in rows] == list(bench.OPERATIONS)
    for row in rows:
        assert row["policy"] == policy.value
        assert row["baseline_name"] == (f"vLLM {policy.value}" if policy in bench.VLLM_POLICIES
                                        else "kvoffload arc")
        for side in ("ours", "baseline"):
            m = row[side]
            assert isinstance(m, Measurement) and m.runs == 2 and m.median > 0 and m.unit == "calls/s"
        assert row["ratio"] > 0
        assert row["note"]


def test_keys_per_call_are_the_prompt_and_the_store_batch() -> None:
    rows = {r["operation"]: r for r in _rows(EvictionPolicy.LRU)}
    assert rows["lookup"]["keys_per_call"] == 8
    assert rows["prepare_store"]["keys_per_call"] == rows["store"]["keys_per_call"] == 4


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_the_store_row_is_both_halves_of_a_store(policy: EvictionPolicy) -> None:
    work = bench.make_workload(128, 16, 32, 4, runs=1, reps=1)
    for side, kind in ((bench.OurSide, policy), bench.baseline(policy)):
        seconds = bench._run_once(*bench._build(side, work, kind), work, 0)
        assert seconds["store"] == pytest.approx(seconds["prepare_store"] + seconds["complete_store"])


def test_workload_refuses_a_prompt_larger_than_the_tier() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        bench.make_workload(1024, 16, 8, 4, runs=1, reps=1)


def test_run_prints_parseable_json_for_the_default_policies(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args("--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bench"] == "manager"
    assert {(r["operation"], r["policy"]) for r in doc["rows"]} == {
        (op, p) for op in bench.OPERATIONS for p in ("lru", "arc")}
    assert all(r["ours"]["median"] > 0 and r["baseline"]["median"] > 0 and r["ratio"] > 0 for r in doc["rows"])


def test_run_takes_every_policy_and_names_each_rows_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    names = ",".join(p.value for p in EvictionPolicy)
    assert bench.run(_args("--json", "--policies", names)) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["policy"]: r["baseline_name"] for r in rows} == {
        "lru": "vLLM lru", "arc": "vLLM arc", "s3fifo": "kvoffload arc", "tinylfu": "kvoffload arc",
        "adaptive": "kvoffload arc"}


def test_run_refuses_an_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args("--policies", "lru,mru")) == 2
    assert "mru" in capsys.readouterr().err


def test_table_names_every_row_and_the_plot_is_written(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    args = _args("--policies", "lru", "--plot", str(tmp_path / "m.png"))
    rows = bench.measure(bench.make_workload(128, 16, 32, 4, runs=3, reps=2), EvictionPolicy.LRU, 2, 1)
    out = io.StringIO()
    emit(bench.report(rows, args), args, out, plot=lambda path: bench._plot(path, rows))
    assert all(op in out.getvalue() for op in bench.OPERATIONS)
    assert (tmp_path / "m.png").stat().st_size > 0


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_with_tenants_ours_with_them_is_compared_with_ours_without(policy: EvictionPolicy,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args("--json", "--policies", policy.value, "--tenants", "3")) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["operation"] for r in rows] == list(bench.OPERATIONS)
    assert {r["baseline_name"] for r in rows} == {f"kvoffload {policy.value}"}
    assert all(r["ratio"] > 0 for r in rows)


def test_with_tenants_each_store_evicts_its_own_tenants_keys() -> None:
    """The stores the tenants side times are like the baseline's (each evicts its own size), and from its own
    tenant: the rule at work, not a path that skips it."""
    work = bench.make_workload(128, 16, 32, 4, runs=1, reps=1)
    side = bench.TenantSide(32, EvictionPolicy.LRU, tenants=3)
    side.fill(work.filler + work.prompt)
    before = side.manager.host_policy.usage()  # type: ignore[attr-defined]
    side.store_cycle(work.store_batches[0])
    assert side.manager.host_policy.usage() == before  # each tenant gave up as many keys as it stored


def test_run_refuses_too_many_tenants(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args("--tenants", "17")) == 2
    assert "--tenants 17 must be in [0, 16]" in capsys.readouterr().err


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_with_hints_both_hint_sides_are_compared_with_hints_off(policy: EvictionPolicy,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args("--json", "--policies", policy.value, "--hints")) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["rows"]
    assert doc["settings"]["hints"] is True
    assert [r["operation"] for r in rows] == list(bench.OPERATIONS) * 2
    assert {r["baseline_name"] for r in rows} == {f"kvoffload {policy.value}"}
    assert [bench._hinted(r) for r in rows] == ["none"] * len(bench.OPERATIONS) + ["half"] * len(bench.OPERATIONS)
    assert all(r["ratio"] > 0 for r in rows)


def test_with_hints_and_no_hint_given_the_wrapper_holds_nothing() -> None:
    work = bench.make_workload(128, 16, 32, 4, runs=1, reps=1)
    side = bench.HintSide(32, EvictionPolicy.LRU, hinted=False, request=len(work.prompt))
    side.fill(work.filler + work.prompt)
    side.store_cycle(work.store_batches[0])
    policy = side.manager.host_policy
    assert isinstance(policy, RetainPolicy) and policy.retained() == 0 and not side.book.active


def test_with_hints_half_hinted_the_prompt_is_retained_and_stores_retain_and_demote() -> None:
    """The hinted side times the wrapper at work: the prompt retained, the tier at its cap (half of it), and
    every other store held, each pushing an older retained key back to the inner policy, while every store still
    evicts exactly its own size (``check_stores``)."""
    work = bench.make_workload(128, 16, 32, 4, runs=1, reps=1)
    side = bench.HintSide(32, EvictionPolicy.LRU, hinted=True, request=len(work.prompt))
    side.fill(work.filler + work.prompt)
    policy = side.manager.host_policy
    assert isinstance(policy, RetainPolicy)
    assert policy.retained() == 16 and all(key in policy._held for key in work.prompt)
    side.store_cycle(work.store_batches[0])
    held = [key for batch in work.store_batches[0][::2] for key in batch]
    assert all(key in policy._held for key in held)
    assert policy.counts().demoted == len(held) and policy.retained() == 16
    side.manager.check_integrity()


def test_run_refuses_tenants_and_hints_together(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args("--tenants", "2", "--hints")) == 2
    assert "--tenants and --hints" in capsys.readouterr().err
