"""bench overhead at tiny sizes: every step kind measured, connector time inside step time, JSON parses."""

from __future__ import annotations

import argparse
import json

import pytest

from kvoffload.tools.bench import overhead as bench


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--requests", "8", "--prompt-tokens", "32", "--block-size", "4", "--runs", "3",
                              "--warmup", "1", "--quiet", *argv])


def test_steps_are_admission_then_decode_then_finish_with_connector_time() -> None:
    samples = bench.run_steps(8, 32, 4, decode_steps=12)
    kinds = [s.kind for s in samples]
    assert kinds[0] == "admission" and kinds[-1] == "finish"
    assert "decode" in kinds
    for s in samples:
        assert 0 < s.connector_s <= s.step_s
        assert set(s.by_call) <= set(bench.SCHEDULER_CALLS) | set(bench.WORKER_CALLS)


def test_every_connector_call_is_timed_over_a_run() -> None:
    samples = bench.run_steps(8, 32, 4, decode_steps=12)
    seen = {name for s in samples for name in s.by_call}
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
            "update_connector_output", "request_finished", "start_kv_transfers", "prepare_store_kv",
            "get_finished"} <= seen


def test_nested_timed_calls_count_once() -> None:
    class Thing:
        def outer(self) -> int:
            return self.inner() + 1

        def inner(self) -> int:
            return 1

    timer = bench.CallTimer()
    thing = Thing()
    timer.wrap(thing, "outer")
    timer.wrap(thing, "inner")
    assert thing.outer() == 2
    seconds, by_call = timer.take()
    assert set(by_call) == {"outer"} and seconds == pytest.approx(by_call["outer"])
    assert timer.take() == (0.0, {})


def test_summary_rows_leave_out_warm_up_decode_steps() -> None:
    samples = bench.run_steps(8, 32, 4, decode_steps=12)
    rows = {r["step_kind"]: r for r in bench.summarize_steps(samples, warmup=2)}
    decode = sum(1 for s in samples if s.kind == "decode")
    assert rows["decode"]["steps"] == decode - 2
    for row in rows.values():
        assert row["connector"].median > 0 and 0 < row["share"] <= 1


def test_run_prints_parseable_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args("--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bench"] == "overhead" and doc["settings"]["requests"] == 8
    assert {r["step_kind"] for r in doc["rows"]} == {"admission", "decode", "finish"}
    assert all(r["connector"]["median"] > 0 for r in doc["rows"])


def test_table_states_the_target_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args()) == 0
    assert "decode target < 100 us/step:" in capsys.readouterr().out


def test_vs_vllm_times_both_scheduler_halves_on_vllms_own_scheduler_outputs() -> None:
    import subprocess
    import sys

    pytest.importorskip("vllm")
    # A process of its own, as a user runs it: vLLM's logs must stay out of the JSON on stdout.
    done = subprocess.run([sys.executable, "-m", "kvoffload.tools.cli", "bench", "overhead", "--vs-vllm", "--requests",
                           "4", "--prompt-tokens", "32", "--runs", "4", "--warmup", "1", "--rounds", "1", "--json",
                           "--quiet"], capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(done.stdout)
    rows = report["rows"]
    assert [r["step_kind"] for r in rows] == ["admission", "decode", "finish"]
    for r in rows:
        assert r["requests"] == 4 and r["ours"]["median"] > 0 and r["vllm"]["median"] > 0
        assert r["ratio"] == pytest.approx(r["vllm"]["median"] / r["ours"]["median"])
    # --runs + --warmup tokens each: the first comes with the admission step, the last with a finish step (and a
    # second finish step tells vLLM's connector of the finished requests)
    assert [r["steps"] for r in rows] == [1, 3, 2]
    assert rows[0]["ratio_with_vllm_hashing"] > rows[0]["ratio"]


def test_vs_vllm_refuses_a_run_where_one_side_stored_less() -> None:
    from kvoffload.tools.bench.overhead_vllm import _check_same_work, _Side

    sides = [_Side("ours", None, lambda m: m, lambda m: 0, stored_blocks=8),
             _Side("vllm", None, lambda m: m, lambda m: 0, stored_blocks=6)]
    with pytest.raises(RuntimeError, match="blocks stored"):
        _check_same_work(sides, 8)
    sides[1].stored_blocks = 8
    _check_same_work(sides, 8)


def test_events_sides_are_measured_in_one_run_with_the_bytes_an_announced_block_keeps(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args("--json", "--events")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {(r["events"], r["step_kind"]) for r in doc["rows"]} == {
        (side, kind) for side in bench.EVENT_SIDES.values() for kind in ("admission", "decode", "finish")}
    published = [r for r in doc["rows"] if r["events"] == "published" and r["step_kind"] == "admission"]
    assert published[0]["mean_us_by_call"]["take_announcements"] > 0
    assert any("announced blocks keep" in note and "bytes each" in note for note in doc["notes"])


def test_hints_sides_are_measured_in_one_run_each_beside_hints_off(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args("--json", "--hints")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["hints"] is True
    assert {(r["hints"], r["step_kind"]) for r in doc["rows"]} == {
        (side, kind) for side in bench.HINT_SIDES.values() for kind in ("admission", "decode", "finish")}
    for r in doc["rows"]:
        assert r["vs_off"] > 0
        if r["hints"] == "off":
            assert r["vs_off"] == 1.0
    assert any("hints: off = max_retain_s 0" in note for note in doc["notes"])


@pytest.mark.parametrize(("hints", "retained"), [(None, None), (False, 0), (True, 4 * 8)])
def test_hint_sides_build_the_scheduler_they_name(hints: bool | None, retained: int | None) -> None:
    """Hints off builds no retention at all; on with no hint holds nothing; every other request hinted keeps its
    stored blocks (4 of 8 requests, 8 prompt blocks of 4 tokens each; the 4 tokens decoded never fill a stored
    block, the last one never being computed), still without a hit."""
    run = bench.SideRun(bench.Side(None, hints), 8, 32, 4, 3, seed=0)
    try:
        while run.engine.has_work:
            run.step()
        run.check_misses()
        retention = run.engine.scheduler.retention
        if retained is None:
            assert retention is None
        else:
            assert [tier.retained() for tier in retention.book.tiers] == [retained]
    finally:
        run.shutdown()


def test_sides_are_stepped_in_turn_on_engines_of_their_own() -> None:
    samples = bench.run_sides([bench.Side(None, None), bench.Side(None, True)], 8, 32, 4, decode_steps=6)
    assert len(samples) == 2
    for side in samples:
        assert side[0].kind == "admission" and side[-1].kind == "finish"
