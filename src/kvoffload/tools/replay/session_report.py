"""``kvoffload replay --sessions``: every row of a replay with retention hints (``sessions.py``) on one trace and
capacity, and their table and JSON.

The rows: each ``--policy`` without hints (default LRU, ARC and the adaptive policy), LRU with each kind of hint
(the trace's own, ``expected``, and a fixed 10 minutes), and Belady's optimum without hints (it knows the future,
and is the bound that "of optimum" divides by).
"""

from __future__ import annotations

import argparse
from typing import Any

from kvoffload.config import EvictionPolicy
from kvoffload.tools.bench.common import format_table
from kvoffload.tools.replay.loop import Bound, Strategy
from kvoffload.tools.replay.optimum import next_uses
from kvoffload.tools.replay.sessions import MAX_RETAIN_S, RETAIN_SHARE, Hints, SessionReplay, replay_sessions
from kvoffload.tools.replay.trace import Trace

DEFAULT_POLICIES = (EvictionPolicy.LRU, EvictionPolicy.ARC, EvictionPolicy.ADAPTIVE)


def add_session_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", action="store_true",
                        help="session turns' and one-off prompts' hit rates apart, without and with retention hints "
                             "(a trace with session and retain_s fields: --trace agentic[:FIELD=VALUE,...])")
    parser.add_argument("--retain-share", type=float, default=RETAIN_SHARE,
                        help=f"with --sessions: the share of the tier retained blocks may hold (default "
                             f"{RETAIN_SHARE}, as the connector's retain_share)")
    parser.add_argument("--max-retain-s", type=float, default=MAX_RETAIN_S,
                        help=f"with --sessions: the cap on a hint in seconds (default {MAX_RETAIN_S:g}, as the "
                             f"connector's max_retain_s)")


def check_session_options(args: argparse.Namespace) -> None:
    """Raises ValueError naming the option that ``--sessions`` cannot take, or a bad value."""
    if args.engines is not None or args.tenants is not None:
        raise ValueError("--sessions replays one tier: leave out --engines and --tenants")
    if not 0 <= args.retain_share <= 1:
        raise ValueError(f"--retain-share {args.retain_share} is not within [0, 1]")
    if not args.max_retain_s > 0:
        raise ValueError(f"--max-retain-s {args.max_retain_s} must be positive")


def session_rows(trace: Trace, blocks: int, policies: list[EvictionPolicy] | None = None,
                 share: float = RETAIN_SHARE, max_retain_s: float = MAX_RETAIN_S) -> list[SessionReplay]:
    """The rows of the module docstring, in that order."""
    plain: list[tuple[Strategy, Hints]] = [(p, Hints.OFF) for p in policies or DEFAULT_POLICIES]
    hinted: list[tuple[Strategy, Hints]] = [(EvictionPolicy.LRU, Hints.EXPECTED), (EvictionPolicy.LRU, Hints.FIXED)]
    rows = [replay_sessions(trace, blocks, s, h, max_retain_s, share) for s, h in plain + hinted]
    rows.append(replay_sessions(trace, blocks, Bound.OPTIMUM, future=next_uses(trace)))
    return rows


def _optimum(rows: list[SessionReplay]) -> SessionReplay:
    return next(r for r in rows if r.strategy == Bound.OPTIMUM.value)


def _of(value: float, bound: float) -> float | None:
    return value / bound if bound else None


def sessions_table(rows: list[SessionReplay]) -> str:
    best = _optimum(rows).session.token_hit_rate
    headers = ["strategy", "session hit", "of optimum", "one-off hit", "retained peak", "retained mean",
               "retained hits", "hints", "capped", "demoted", "seconds"]
    table = [[r.label, r.session.token_hit_rate, _of(r.session.token_hit_rate, best), r.oneoff.token_hit_rate,
              r.retained_peak, round(r.retained_mean), r.retained_hits, r.hinted, r.capped, r.demoted,
              round(r.seconds, 2)] for r in rows]
    return format_table(headers, table)


def sessions_doc(rows: list[SessionReplay]) -> dict[str, Any]:
    best = _optimum(rows).session.token_hit_rate
    return {"rows": [{"strategy": r.strategy, "hints": r.hints.value, "label": r.label,
                      "session": r.session.to_dict(), "oneoff": r.oneoff.to_dict(),
                      "session_of_optimum": _of(r.session.token_hit_rate, best),
                      "hinted": r.hinted, "capped": r.capped, "retained_peak": r.retained_peak,
                      "retained_mean": r.retained_mean, "retained_hits": r.retained_hits, "demoted": r.demoted,
                      "retained_evicted": r.retained_evicted, "seconds": r.seconds} for r in rows]}


def session_summary(trace: Trace, args: argparse.Namespace) -> str:
    sessions = {r.session for r in trace.requests if r.session is not None}
    turns = sum(1 for r in trace.requests if r.session is not None)
    return (f"{turns} session turns of {len(sessions)} sessions, {len(trace.requests) - turns} one-off prompts; "
            f"hints capped at {args.max_retain_s:g} s, retained blocks at {args.retain_share:g} of the tier; "
            f"token hit rates per kind of request")
