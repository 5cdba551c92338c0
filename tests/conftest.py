"""Shared by every test: kvoffload's logger as pytest needs it.

A connector built in the test process (the in-process e2e engines) joins vLLM's logging
(``integrations/vllm/logs.py``): the ``kvoffload`` logger then writes through vLLM's handlers and stops
propagating, so pytest's ``caplog`` (on the root logger) would no longer see kvoffload's records in later tests.
Each test starts with the logger as a library's: no handler of ours, propagating.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _kvoffload_logger_propagates() -> Iterator[None]:
    yield
    logger = logging.getLogger("kvoffload")
    for handler in [h for h in logger.handlers if type(h).__name__ == "_ToVllmHandlers"]:
        logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)
