"""kvoffload's log lines in vLLM's log: same handlers, same format, same level.

vLLM configures only its own ``vllm`` logger (its handler, its format, ``VLLM_LOGGING_LEVEL``), so in a default
server kvoffload's INFO lines were dropped and a warning reached stderr through Python's last-resort handler,
with no level, time or logger name. ``join_vllm_logging`` sends the ``kvoffload`` logger's records to the
``vllm`` logger's handlers, at vLLM's level, so that they read like vLLM's own lines. vLLM's format shows
``[file:line]``; ours show the logger's name there instead (``[kvoffload.connector.scheduler:412]``), since a bare
``scheduler.py`` would read as vLLM's own scheduler.

Left alone: a ``kvoffload`` logger that has handlers already (a ``VLLM_LOGGING_CONFIG_PATH`` config, or the
application, configured it), and a ``vllm`` logger without handlers (``VLLM_CONFIGURE_LOGGING=0``: the
application owns logging, and kvoffload's records go to the root logger like any library's).
"""

from __future__ import annotations

import logging

PACKAGE_LOGGER = "kvoffload"
VLLM_LOGGER = "vllm"


class _ToVllmHandlers(logging.Handler):
    """Hands each record to the ``vllm`` logger's handlers as they are when it is logged."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        record.filename = record.name  # vLLM's formatter shows it as [fileinfo:lineno]
        for handler in self.target.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def join_vllm_logging() -> bool:
    """Route kvoffload's log records through vLLM's handlers, at vLLM's level.

    Call it once vLLM has configured logging in the process (it does so at engine start, in each of its
    processes): the connector calls it when it is built. Calling it again is cheap and takes up vLLM's level
    anew; records always go to the handlers the ``vllm`` logger has when they are logged.

    Returns:
        Whether kvoffload's logger writes through vLLM's handlers (False: left as it was, see the module).
    """
    ours, theirs = logging.getLogger(PACKAGE_LOGGER), logging.getLogger(VLLM_LOGGER)
    joined = any(isinstance(h, _ToVllmHandlers) for h in ours.handlers)
    if not joined and (ours.handlers or not theirs.handlers):
        return False
    if not joined:
        ours.addHandler(_ToVllmHandlers(theirs))
        ours.propagate = False  # vLLM's own records do not propagate either; root would print them twice
    ours.setLevel(theirs.getEffectiveLevel())
    return True
