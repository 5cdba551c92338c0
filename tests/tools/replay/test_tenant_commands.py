"""``kvoffload replay --tenants`` and ``kvoffload plan --tenants`` through ``kvoffload.tools.cli.main``: the JSON
and the table, and bad options answered with a message naming the culprit and exit code 2."""

from __future__ import annotations

import json

import pytest

from kvoffload.tools.cli import main

TRACE = "synthetic:tenants-flood:100"
QUOTAS = '{"default": 0.2, "t0": 0.2, "t1": 0.2, "t2": 0.2, "t3": 0.2}'


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_tenants_json_has_each_tenants_three_results(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "replay", "--trace", TRACE, "--capacity", "1600", "--tenants", QUOTAS,
                   "--model", "llama-3.2-1b")
    assert doc["quotas"] == json.loads(QUOTAS) and doc["policy"] == "lru"
    rows = {r["tenant"]: r for r in doc["tenants"]}
    assert list(rows) == ["t0", "t1", "t2", "t3", "flood"]
    t0 = rows["t0"]
    assert t0["alone"]["capacity_blocks"] == 20 and t0["with_quotas"]["capacity_blocks"] == 100
    assert t0["with_over_alone"] == t0["with_quotas"]["token_hit_rate"] / t0["alone"]["token_hit_rate"]
    assert t0["with_quotas"]["resident_bytes"] == t0["with_quotas"]["resident_blocks"] * 16 * 32768
    assert rows["flood"]["with_over_alone"] is None  # alone, a flood hits nothing
    total = doc["total"]["with_quotas"]
    assert total["resident_blocks"] == 100
    assert total["hit_tokens"] == sum(r["with_quotas"]["hit_tokens"] for r in rows.values())


def test_replay_tenants_prints_a_row_per_tenant_and_the_total(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--trace", TRACE, "--capacity", "1600", "--tenants", "equal", "--policy", "s3fifo"]) == 0
    out = capsys.readouterr().out
    assert "policy s3fifo in each tenant" in out and "with/alone" in out
    rows = [line.split()[0] for line in out.splitlines()[4:]]
    assert rows == ["flood", "t3", "t0", "t2", "t1", "total"]  # equal: named in order of first arrival


def test_plan_tenants_suggests_shares_that_replay_takes(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "plan", "--trace", TRACE, "--model", "llama-3.1-8b", "--tenants", "--capacity", "1600")
    assert doc["quotas"]["flood"] == 0.05 and len(doc["tenants"]) == 5
    assert [p["share"] for p in doc["tenants"][0]["curve"]][:3] == [0.05, 0.1, 0.15]
    assert main(["replay", "--trace", TRACE, "--capacity", "1600", "--tenants", json.dumps(doc["quotas"])]) == 0
    capsys.readouterr()
    assert main(["plan", "--trace", TRACE, "--model", "llama-3.1-8b", "--tenants", "--capacity", "1600"]) == 0
    assert "replay them: kvoffload replay" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["replay", "--tenants", "{"], "neither 'equal' nor a JSON mapping"),
    (["replay", "--tenants", '{"default": 0.9, "t0": 0.9}'], "more than the whole tier"),
    (["replay", "--tenants", "equal", "--engines", "2"], "leave out --engines"),
    (["replay", "--tenants", "equal", "--admission", "second-sighting"], "leave out --admission"),
    (["replay", "--tenants", "equal", "--policy", "lru", "--policy", "arc"], "at most one --policy"),
    (["plan", "--model", "llama-3.1-8b", "--tenants"], "--tenants needs --capacity"),
    (["plan", "--model", "llama-3.1-8b", "--tenants", "--capacity", "1600", "--floor", "0.5"], "do not fit"),
])
def test_bad_tenant_options_exit_2_naming_the_culprit(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                      message: str) -> None:
    assert main([argv[0], "--trace", TRACE, *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert f"kvoffload {argv[0]}: error: " in err and message in err
