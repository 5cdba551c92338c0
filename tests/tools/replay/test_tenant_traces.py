"""Multi-tenant traces: the optional tenant field of a trace line, the seeded tenants-calm/tenants-flood traces, and
a single-tenant trace split by session into salted tenants (``tenants:N[+flood]:PATH``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from tests.tools.replay.traces import write_jsonl

from kvoffload.tools.replay import TraceError, read_trace
from kvoffload.tools.replay.sweep import load
from kvoffload.tools.replay.synthetic import CHAT_TENANTS, FLOOD, FLOOD_BLOCKS, synthetic
from kvoffload.tools.replay.tenant_traces import assign_sessions, session_tenant, tenant_trace
from kvoffload.tools.replay.trace import Request, Trace, int_key

TIER = 200
LINE = {"timestamp": 0, "input_length": 8, "output_length": 1, "block_tokens": 4, "hash_ids": [1, 2]}


def test_a_trace_line_may_name_its_tenant_and_old_lines_have_none(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({**LINE, "tenant": "acme"}) + "\n" + json.dumps(LINE) + "\n")
    t = read_trace(path)
    assert [r.tenant for r in t.requests] == ["acme", None]
    assert t.tenants() == ["acme", None]
    assert t.of_tenant("acme").requests == t.requests[:1]


@pytest.mark.parametrize("bad", ["", 7, "x" * 257])
def test_a_bad_tenant_names_its_line(tmp_path: Path, bad: object) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(LINE) + "\n" + json.dumps({**LINE, "tenant": bad}) + "\n")
    with pytest.raises(TraceError, match="line 2: tenant must be a non-empty string"):
        read_trace(path)


def keysets(trace_name: str) -> dict[str | None, set[bytes]]:
    out: dict[str | None, set[bytes]] = {}
    for r in synthetic(trace_name).requests:
        out.setdefault(r.tenant, set()).update(r.keys)
    return out


def test_tenant_traces_are_seeded_and_their_tenants_keys_are_disjoint() -> None:
    flood = synthetic(f"synthetic:tenants-flood:{TIER}")
    assert flood == synthetic(f"synthetic:tenants-flood:{TIER}")
    sets = keysets(f"synthetic:tenants-flood:{TIER}")
    assert set(sets) == {*CHAT_TENANTS, FLOOD}
    assert sum(len(s) for s in sets.values()) == len(set().union(*sets.values()))


def test_the_flood_is_half_the_requests_of_long_prompts_never_seen_again() -> None:
    flood = synthetic(f"synthetic:tenants-flood:{TIER}")
    counts = Counter(r.tenant for r in flood.requests)
    assert 0.45 < counts[FLOOD] / len(flood.requests) < 0.55
    floods = [r for r in flood.requests if r.tenant == FLOOD]
    assert all(len(r.keys) == FLOOD_BLOCKS for r in floods)
    assert len({k for r in floods for k in r.keys}) == FLOOD_BLOCKS * len(floods)


def test_the_calm_trace_is_the_flood_trace_without_its_flood() -> None:
    flood, calm = synthetic(f"synthetic:tenants-flood:{TIER}"), synthetic(f"synthetic:tenants-calm:{TIER}")
    chats = [(r.tenant, r.keys) for r in flood.requests if r.tenant != FLOOD]
    assert chats == [(r.tenant, r.keys) for r in calm.requests]
    assert {r.tenant for r in calm.requests} == set(CHAT_TENANTS)


def mooncake_like(tmp_path: Path) -> Path:
    # Every prompt starts with block 0 (a system prompt); conversations 1 and 2 come back with longer prompts.
    return write_jsonl(tmp_path / "m.jsonl", [[0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0], [0, 5, 6]], block=4)


def test_sessions_keep_their_tenant_and_tenants_get_salted_keys(tmp_path: Path) -> None:
    original = read_trace(mooncake_like(tmp_path))
    split = assign_sessions(original, 16)
    tenants = [r.tenant for r in split.requests]
    assert tenants[0] == tenants[2] and tenants[1] == tenants[3]
    assert tenants == [session_tenant(r, 16) for r in original.requests]
    by_tenant: dict[str | None, set[bytes]] = {}
    for r in split.requests:
        by_tenant.setdefault(r.tenant, set()).update(r.keys)
    assert sum(len(s) for s in by_tenant.values()) == len(set().union(*by_tenant.values()))
    assert not set(original.requests[0].keys) & set(split.requests[0].keys)
    # A session's turns share their salted prefix, as the original's do.
    assert split.requests[2].keys[:2] == split.requests[0].keys


def test_the_session_rule_spreads_sessions_over_every_tenant() -> None:
    many = Trace(tuple(Request(0.0, 8, 1, (int_key(0), int_key(i))) for i in range(1, 401)), 4)
    counts = Counter(r.tenant for r in assign_sessions(many, 4).requests)
    assert set(counts) == {"t0", "t1", "t2", "t3"} and min(counts.values()) > 60


def test_the_mooncake_flood_is_about_half_the_requests_with_fresh_keys(tmp_path: Path) -> None:
    original = read_trace(mooncake_like(tmp_path))
    doubled = original._replace(requests=original.requests * 50)
    flooded = assign_sessions(doubled, 4, flood=True)
    floods = [r for r in flooded.requests if r.tenant == FLOOD]
    assert 0.4 < len(floods) / len(flooded.requests) < 0.6
    assert len({k for r in floods for k in r.keys}) == sum(len(r.keys) for r in floods)
    assert [r for r in flooded.requests if r.tenant != FLOOD] == list(assign_sessions(doubled, 4).requests)


def test_load_reads_a_tenants_trace_by_name(tmp_path: Path) -> None:
    path = mooncake_like(tmp_path)
    trace, _ = load(f"tenants:3+flood:{path}", with_future=False)
    assert trace == tenant_trace(f"tenants:3+flood:{path}")
    assert {r.tenant for r in trace.requests} <= {"t0", "t1", "t2", FLOOD}


@pytest.mark.parametrize(("name", "message"), [
    ("tenants:x:p.jsonl", "expected tenants:N:PATH"),
    ("tenants:4", "expected tenants:N:PATH"),
    ("tenants:0:{path}", "0 tenants; give 1 to 16"),
    ("tenants:17:{path}", "17 tenants"),
])
def test_a_bad_tenants_name_says_what_is_expected(tmp_path: Path, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tenant_trace(name.format(path=mooncake_like(tmp_path)))
