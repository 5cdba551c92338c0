"""Trace replay: real request traces through the real tier manager and policies, beside the bounds.

``trace.py`` reads traces (the Mooncake JSONL, and kvoffload's own from ``record.py``); ``loop.py`` feeds them
through ``HostTierManager``; ``optimum.py`` is Belady's offline policy; ``models.py`` turns capacities into bytes;
``sweep.py`` runs many points; ``replay_command.py`` and ``plan_command.py`` are ``kvoffload replay`` and
``kvoffload plan``. Imports no torch and no engine.
"""

from kvoffload.replay.loop import Bound, Strategy, replay
from kvoffload.replay.optimum import NextUse, OptimumPolicy, next_uses
from kvoffload.replay.record import TraceRecorder
from kvoffload.replay.result import ReplayResult
from kvoffload.replay.trace import Request, Trace, TraceError, int_key, read_trace

__all__ = ["Bound", "NextUse", "OptimumPolicy", "ReplayResult", "Request", "Strategy", "Trace", "TraceError",
           "TraceRecorder", "int_key", "next_uses", "read_trace", "replay"]
