"""Every test here ends with the simulated engines it listed in ``tests.testing.engines.MADE`` closed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.testing.engines import MADE

from kvoffload.testing.sim_workload import close_engine


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    yield
    while MADE:
        close_engine(MADE.pop())
