"""Request traces: read the Mooncake JSONL format and kvoffload's own recorded traces into offload keys.

The line format is ``kvoffload.trace_format``'s (the core writes it when recording; this module reads it). A trace has
one block size: replay converts a capacity in tokens to blocks with it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from kvoffload.keys import OffloadKey
from kvoffload.trace_format import TraceError

MOONCAKE_BLOCK_TOKENS = 512


class Request(NamedTuple):
    """One request of a trace: its lengths and the offload keys of its prompt's blocks, first block first."""

    timestamp_ms: float
    input_length: int
    output_length: int
    keys: tuple[OffloadKey, ...]
    tenant: str | None = None
    """Whose request it is (``kvoffload replay --tenants``); None: the shared tenant's, as a request without a salt."""
    session: str | None = None
    """The agent session (conversation) it is a turn of (``kvoffload replay --sessions``); None: a one-off prompt."""
    retain_s: float | None = None
    """The retention hint it carries, in seconds; None: none."""


class Trace(NamedTuple):
    """A trace's requests in arrival order; every block holds ``block_tokens`` tokens (the last may be partial)."""

    requests: tuple[Request, ...]
    block_tokens: int

    @property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    @property
    def block_refs(self) -> int:
        """Block references over all requests (a block used by ten requests counts ten times)."""
        return sum(len(r.keys) for r in self.requests)

    def distinct_keys(self) -> int:
        """Blocks the trace ever references: the capacity at which nothing is ever evicted."""
        return len({key for r in self.requests for key in r.keys})

    def head(self, n: int) -> Trace:
        """The first ``n`` requests."""
        return Trace(self.requests[:n], self.block_tokens)

    def tenants(self) -> list[str | None]:
        """The tenants of the requests, in order of first arrival (None: requests without one)."""
        return list(dict.fromkeys(r.tenant for r in self.requests))

    def of_tenant(self, tenant: str | None) -> Trace:
        """Only ``tenant``'s requests, in arrival order."""
        return Trace(tuple(r for r in self.requests if r.tenant == tenant), self.block_tokens)


def int_key(block_id: int) -> OffloadKey:
    """The offload key of an integer block id: 8 bytes, big-endian."""
    return OffloadKey(block_id.to_bytes(8, "big"))


def read_trace(path: str | Path) -> Trace:
    """Read a trace file.

    Raises:
        TraceError: the file cannot be read, a line is not a JSON object of ``kvoffload.trace_format``'s schema (the
            message names its line number), the block sizes of two lines differ, or the file holds no request.
    """
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read trace {path}: {getattr(e, 'strerror', None) or e}") from None
    requests: list[Request] = []
    block_tokens: int | None = None
    # Keys repeat across requests (that is what a prefix hit is): one bytes object per key keeps the trace small and
    # lets every dict in the replay find its key by identity first.
    interned: dict[Any, OffloadKey] = {}
    for number, line in _numbered(lines):
        try:
            request, tokens = _parse(line, interned)
        except (ValueError, TypeError, KeyError) as e:
            raise TraceError(f"{path}, line {number}: {_reason(e)}") from None
        if block_tokens is None:
            block_tokens = tokens
        elif tokens != block_tokens:
            raise TraceError(f"{path}, line {number}: block_tokens {tokens} differs from {block_tokens} on the "
                             "lines before (a trace has one block size)")
        requests.append(request)
    if block_tokens is None:
        raise TraceError(f"trace {path} holds no request")
    return Trace(tuple(requests), block_tokens)


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as ``kvoffload.trace_format`` lines, keys as hex (as the recorder writes them); the optional
    fields only where a request has them, so a trace without them writes as it always did.

    Raises:
        TraceError: the file cannot be written (the message names it).
    """
    path = Path(path)
    lines = []
    for r in trace.requests:
        doc: dict[str, Any] = {"timestamp": r.timestamp_ms, "input_length": r.input_length,
                               "output_length": r.output_length, "block_tokens": trace.block_tokens,
                               "hash_ids": [key.hex() for key in r.keys]}
        optional = {"tenant": r.tenant, "session": r.session, "retain_s": r.retain_s}
        doc.update({field: value for field, value in optional.items() if value is not None})
        lines.append(json.dumps(doc) + "\n")
    try:
        path.write_text("".join(lines), encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot write trace {path}: {e.strerror or e}") from None


def _numbered(lines: Sequence[str]) -> Iterator[tuple[int, str]]:
    """Non-blank lines with their 1-based line numbers."""
    for number, line in enumerate(lines, start=1):
        if line.strip():
            yield number, line


def _reason(e: Exception) -> str:
    if isinstance(e, KeyError):
        return f"missing field {e.args[0]!r}"
    if isinstance(e, json.JSONDecodeError):
        return f"not JSON ({e.msg} at column {e.colno})"
    return str(e)


def _parse(line: str, interned: dict[Any, OffloadKey]) -> tuple[Request, int]:
    doc = json.loads(line)
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    ids = doc["hash_ids"]
    if not isinstance(ids, list):
        raise ValueError(f"hash_ids must be a list, got {type(ids).__name__}")
    keys = []
    for block_id in ids:
        key = interned.get(block_id) if type(block_id) in (int, str) else None
        if key is None:
            key = interned[block_id] = _key(block_id)
        keys.append(key)
    request = Request(_number("timestamp", doc["timestamp"]), _count("input_length", doc["input_length"]),
                      _count("output_length", doc["output_length"]), tuple(keys), _name("tenant", doc.get("tenant")),
                      _name("session", doc.get("session")), _retain(doc.get("retain_s")))
    tokens = _count("block_tokens", doc.get("block_tokens", MOONCAKE_BLOCK_TOKENS))
    if tokens == 0:
        raise ValueError("block_tokens must be positive")
    return request, tokens


def _key(block_id: object) -> OffloadKey:
    if isinstance(block_id, str):
        try:
            return OffloadKey(bytes.fromhex(block_id))
        except ValueError:
            raise ValueError(f"hash id {block_id!r} is not a hex string") from None
    if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < 1 << 64:
        raise ValueError(f"hash id {block_id!r} is neither a hex string nor an integer in [0, 2**64)")
    return int_key(block_id)


def _count(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field} must be a non-negative integer, got {value!r}")
    return value


def _name(field: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 256:
        raise ValueError(f"{field} must be a non-empty string of at most 256 characters, got {repr(value)[:60]}")
    return value


def _retain(value: object) -> float | None:
    if value is None:
        return None
    seconds = _number("retain_s", value)
    if not 0 <= seconds < math.inf:
        raise ValueError(f"retain_s must be a non-negative number of seconds, got {value!r}")
    return seconds


def _number(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{field} must be a number, got {value!r}")
    return float(value)
