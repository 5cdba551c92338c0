"""The engine side of trace recording (the ``record_trace`` option): each finished request becomes one line of
a trace that ``kvoffload replay`` and ``kvoffload plan`` read (``kvoffload.trace_format`` writes the lines).

A line holds the request's arrival time (ms since the scheduler half started), its prompt and output lengths,
the offload block size in tokens and the keys of its prompt's full offload blocks, of the first KV-cache group
(one-way hashes of their tokens: the prompts never leave the engine). Requests finished without a lookup (never
scheduled by this connector) are not recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvoffload.config import ConfigError
from kvoffload.connector.requests import RequestState
from kvoffload.trace_format import TraceError, TraceRecorder


class TraceTap:
    """Writes finished requests to a trace file.

    Raises:
        ConfigError: the file cannot be opened for appending (the message names it).
    """

    def __init__(self, path: Path, offload_tokens: int, clock: Callable[[], float]) -> None:
        try:
            self._recorder = TraceRecorder(path)
        except TraceError as e:
            raise ConfigError(f"record_trace: {e}") from None
        self._offload_tokens = offload_tokens
        self._start = clock()

    def finished(self, state: RequestState) -> None:
        """Record ``state``'s request (I/O errors stop the recording, logged once: see ``TraceRecorder``)."""
        prompt = state.prompt_tokens
        keys = state.keys(0, prompt // self._offload_tokens, 0)
        self._recorder.record(round((state.arrival - self._start) * 1000, 3), prompt,
                              len(state.request.all_token_ids) - prompt, self._offload_tokens, keys)

    def close(self) -> None:
        self._recorder.close()
