"""The trace file format and its writer: what the engine records (``record_trace``) and ``kvoffload replay`` reads.

One JSON object per line, in arrival order (the file's order is the order replay feeds the requests in):

- ``timestamp``: arrival time in milliseconds;
- ``input_length``, ``output_length``: token counts;
- ``hash_ids``: one id per block of the prompt, prefix-chained (equal ids mean an equal prefix up to and including
  that block). Integers (the Mooncake release; each becomes an 8-byte big-endian ``OffloadKey``) or hex strings
  (``TraceRecorder`` writes the offload keys themselves);
- ``block_tokens`` (recorded traces only): tokens per block; absent means 512, the Mooncake block size;
- ``tenant`` (optional): whose request it is, a non-empty string (``kvoffload replay --tenants``); absent or null
  means the shared tenant's, as a request without a salt. The recorder does not write it yet.
- ``session`` (optional): the agent session or conversation the request is a turn of, a non-empty string; absent or
  null: a request of no session (a one-off prompt). ``kvoffload replay --sessions`` counts hit rates per kind.
- ``retain_s`` (optional): the retention hint the client sent with the request (``kv_transfer_params``
  ``{"kvoffload": {"retain_s": N}}``, docs/configuration.md ``max_retain_s``): seconds, a non-negative number, that
  it asks its prompt's and output's blocks to stay; absent or null: no hint. The agentic generator
  (tools/replay/agentic.py) writes both; the recorder does not write them yet.

Readers ignore fields they do not know, and every optional field's absence means what it meant before the field
existed: an older trace reads, and replays, unchanged.

A trace has one block size: replay converts a capacity in tokens to blocks with it. The recorder writes keys as hex,
lengths and offload keys only, never tokens, so users can size their tiers on their own traffic without their prompts
leaving the machine (a key is a one-way hash of a block's tokens). The reader is ``kvoffload.tools.replay.trace``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

logger = logging.getLogger(__name__)


class TraceError(ValueError):
    """A trace that cannot be read or written: the message names the file and, for bad input, the line."""


class TraceRecorder:
    """Appends one trace line per request to a file.

    Opening is the only step that raises: after it, an I/O error while writing is logged once and recording
    stops, so a full disk never fails a request. Lines are flushed one by one (a crashed engine leaves a trace
    that reads up to its last request). Not thread-safe: one scheduler thread calls it.

    Args:
        path: the trace file; created, or appended to if it exists.
    Raises:
        TraceError: ``path`` cannot be opened for appending (the message names it).
    """

    __slots__ = ("_file", "path")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file: TextIO | None = self.path.open("a", encoding="utf-8", buffering=1)
        except OSError as e:
            raise TraceError(f"cannot record a trace to {self.path}: {e.strerror or e}") from None

    @property
    def recording(self) -> bool:
        """False once closed or stopped by a write error."""
        return self._file is not None

    def record(self, timestamp_ms: float, input_length: int, output_length: int, block_tokens: int,
               keys: Sequence[bytes]) -> None:
        """Append one request: arrival time, lengths, tokens per block and its blocks' offload keys in order."""
        file = self._file
        if file is None:
            return
        line = json.dumps({"timestamp": timestamp_ms, "input_length": input_length, "output_length": output_length,
                           "block_tokens": block_tokens, "hash_ids": [key.hex() for key in keys]})
        try:
            file.write(line + "\n")
        except (OSError, ValueError) as e:  # ValueError: the file was closed under us
            logger.warning("trace recording to %s stopped: %s", self.path, e)
            self._stop()

    def close(self) -> None:
        """Flush and close the file; never raises. Later ``record`` calls do nothing."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError as e:
                logger.warning("trace recording to %s: the last lines may be lost: %s", self.path, e)
            self._file = None

    def _stop(self) -> None:
        file, self._file = self._file, None
        try:
            if file is not None:
                file.close()
        except OSError:
            pass  # already reported: the write that failed is why we stop
