"""Trace replay: real request traces through the real tier index and policies, beside the bounds.

``trace.py`` reads traces (the Mooncake JSONL, and kvoffload's own, which the core's ``kvoffload.trace_format``
writes); ``loop.py`` feeds them through ``SlotIndex``; ``optimum.py`` is Belady's offline policy; ``models.py``
turns capacities into bytes; ``sweep.py`` runs many points; ``engines.py`` splits a trace over several engines'
private tiers beside one node pool; ``tenants.py`` replays a multi-tenant trace with and without quotas
(``tenant_traces.py`` splits a trace into tenants, ``shares.py`` sizes their shares, ``tenant_report.py`` and
``plan_tenants.py`` print them); ``agentic.py`` builds traces of agent sessions with retention hints among one-off
prompts and ``sessions.py`` replays them with and without the hints (``session_report.py`` prints them);
``replay_command.py`` and ``plan_command.py`` are ``kvoffload replay`` and
``kvoffload plan``. Imports no torch and no engine.
"""

from kvoffload.tools.replay.loop import Bound, Strategy, replay
from kvoffload.tools.replay.optimum import NextUse, OptimumPolicy, next_uses
from kvoffload.tools.replay.result import ReplayResult
from kvoffload.tools.replay.trace import Request, Trace, int_key, read_trace
from kvoffload.trace_format import TraceError

__all__ = ["Bound", "NextUse", "OptimumPolicy", "ReplayResult", "Request", "Strategy", "Trace", "TraceError",
           "int_key", "next_uses", "read_trace", "replay"]
