"""kvoffload's log lines in vLLM's log: each case runs in a fresh interpreter, as vLLM configures logging on import."""

from __future__ import annotations

import os
import re
import subprocess
import sys

# What vLLM's default format makes of a record: "(<process> pid=<pid>) LEVEL MM-DD HH:MM:SS [where:line] message".
LINE = r"\(\S+ pid=\d+\) {level} \d\d-\d\d \d\d:\d\d:\d\d \[{where}:\d+\] {message}"

SCRIPT = """
import logging, vllm.logger
from vllm.config.logging import LoggingConfig
from kvoffload.integrations.vllm.logs import join_vllm_logging
vllm.logger.configure_logging(LoggingConfig())  # what vLLM does at engine start, in each of its processes
{before}
print("joined", join_vllm_logging(), flush=True)
logging.getLogger("kvoffload.connector.scheduler").warning("a store failed: %d blocks", 3)
logging.getLogger("kvoffload.connector.worker").info("worker ready")
logging.getLogger("kvoffload.connector.worker").debug("per-step detail")
vllm.logger.init_logger("vllm.v1.core.sched.scheduler").warning("vllm's own line")
"""


def _run(before: str = "", **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(before=before)], capture_output=True, text=True,
                         env={**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stderr", **env}, timeout=120,
                         check=True)
    return out.stdout + out.stderr


def _has(text: str, level: str, where: str, message: str) -> bool:
    return re.search(LINE.format(level=level, where=re.escape(where), message=re.escape(message)), text) is not None


def test_kvoffload_lines_read_like_vllm_s_with_level_and_logger_name() -> None:
    text = _run()
    assert "joined True" in text
    assert _has(text, "WARNING", "kvoffload.connector.scheduler", "a store failed: 3 blocks")
    assert _has(text, "INFO", "kvoffload.connector.worker", "worker ready")  # vLLM's level: INFO shows
    assert "per-step detail" not in text
    assert text.count("a store failed") == 1  # not also through the root logger
    assert _has(text, "WARNING", "<string>", "vllm's own line")  # vLLM's own line, logged from the script


def test_without_joining_a_warning_has_no_level_time_or_name() -> None:
    # The check above can fail: this is the line a default server printed before (Python's last-resort handler).
    text = _run(before="join_vllm_logging = lambda: None")
    assert "a store failed: 3 blocks" in text and "worker ready" not in text
    assert not _has(text, "WARNING", "kvoffload.connector.scheduler", "a store failed: 3 blocks")


def test_vllm_s_level_applies_to_kvoffload_too() -> None:
    text = _run(VLLM_LOGGING_LEVEL="DEBUG")
    assert _has(text, "DEBUG", "kvoffload.connector.worker", "per-step detail")


def test_an_application_s_own_logging_is_left_alone() -> None:
    text = _run(VLLM_CONFIGURE_LOGGING="0")  # vLLM configures nothing: kvoffload behaves like any library
    assert "joined False" in text
    configured = "logging.getLogger('kvoffload').addHandler(logging.StreamHandler())"
    text = _run(before=configured)
    assert "joined False" in text and "a store failed: 3 blocks" in text
    assert not _has(text, "WARNING", "kvoffload.connector.scheduler", "a store failed: 3 blocks")
