"""kvoffload's log lines in vLLM's log: each case runs in a fresh interpreter, as vLLM configures logging on import."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

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


CONFIGURED = "logging.getLogger('kvoffload').addHandler(logging.StreamHandler())"
CASES: dict[str, tuple[str, dict[str, str]]] = {
    "joined": ("", {}),
    "not joined": ("join_vllm_logging = lambda: None", {}),
    "vllm at debug": ("", {"VLLM_LOGGING_LEVEL": "DEBUG"}),
    "vllm configures nothing": ("", {"VLLM_CONFIGURE_LOGGING": "0"}),
    "application's handler": (CONFIGURED, {}),
}
"""Case -> (code run before joining, environment): each in a fresh interpreter."""


@pytest.fixture(scope="module")
def logs() -> dict[str, str]:
    """Each case's stdout and stderr. The interpreters run at once: each spends seconds importing vLLM."""
    procs = {name: subprocess.Popen([sys.executable, "-c", SCRIPT.format(before=before)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stderr", **env})
             for name, (before, env) in CASES.items()}
    outputs = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{err[-4000:]}"
        outputs[name] = out + err
    return outputs


def _has(text: str, level: str, where: str, message: str) -> bool:
    return re.search(LINE.format(level=level, where=re.escape(where), message=re.escape(message)), text) is not None


def test_kvoffload_lines_read_like_vllm_s_with_level_and_logger_name(logs: dict[str, str]) -> None:
    text = logs["joined"]
    assert "joined True" in text
    assert _has(text, "WARNING", "kvoffload.connector.scheduler", "a store failed: 3 blocks")
    assert _has(text, "INFO", "kvoffload.connector.worker", "worker ready")  # vLLM's level: INFO shows
    assert "per-step detail" not in text
    assert text.count("a store failed") == 1  # not also through the root logger
    assert _has(text, "WARNING", "<string>", "vllm's own line")  # vLLM's own line, logged from the script


def test_without_joining_a_warning_has_no_level_time_or_name(logs: dict[str, str]) -> None:
    # The check above can fail: this is the line a default server printed before (Python's last-resort handler).
    text = logs["not joined"]
    assert "a store failed: 3 blocks" in text and "worker ready" not in text
    assert not _has(text, "WARNING", "kvoffload.connector.scheduler", "a store failed: 3 blocks")


def test_vllm_s_level_applies_to_kvoffload_too(logs: dict[str, str]) -> None:
    text = logs["vllm at debug"]
    assert _has(text, "DEBUG", "kvoffload.connector.worker", "per-step detail")


def test_an_application_s_own_logging_is_left_alone(logs: dict[str, str]) -> None:
    # vLLM configures nothing: kvoffload behaves like any library.
    assert "joined False" in logs["vllm configures nothing"]
    text = logs["application's handler"]
    assert "joined False" in text and "a store failed: 3 blocks" in text
    assert not _has(text, "WARNING", "kvoffload.connector.scheduler", "a store failed: 3 blocks")
