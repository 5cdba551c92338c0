"""The simulated engines a test of tests/testing made: ``conftest.py`` closes them when the test ends (their disk
tier's table thread and engine number)."""

from __future__ import annotations

from kvoffload.testing.sim import SimEngine

MADE: list[SimEngine] = []
