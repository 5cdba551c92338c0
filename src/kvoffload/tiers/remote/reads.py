"""Bounded reads of the remote tier's values: no reply is longer than the value a load expects, plus one byte.

A writer of the store (with or without the tier secret: ``SCAN`` shows the names) can put anything at a name that
a load reads: a 512 MiB string, a list, a hash. A ``GET`` would bring a huge value into the worker whole, and only
then would its length be checked (four planted 64 MiB values added 256 MiB to one worker's peak memory for one
promotion). ``RemoteHandler`` reads each value of a batch with ``GETRANGE name 0 expected`` instead: the end is
inclusive, so a reply is at most ``expected + 1`` bytes, and that byte more shows a value too long without the
rest of it ever being sent. What a name holds is then one of:

- a string: its reply goes on to the value checks (``tiers.lower.block_codec.open_into``), which judge it as they judge
  any value, its header first (so an older format's value is unauthentic, whatever its size) and then its length (a
  reply one byte longer than expected fails there); a string that is too long is also deleted here at once;
- another type (``WRONGTYPE``): damage, deleted here;
- nothing: ``GETRANGE`` answers ``b""`` both for a missing name and for a planted empty string, and ``DEL`` tells
  them apart (``_deleted``); a planted empty string is damage.

Every value of a batch that cannot be right is deleted in one pipeline, not only the first one that the checks
meet, so that the next ``SET NX`` can replace them all. Damage fails the load as a damaged value (the engine
recomputes; not a server fault, so planted values never open the breaker). Every command names one value, so a
Redis Cluster serves them as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvoffload.tiers.lower.block_format import CorruptBlockError
from kvoffload.tiers.remote.faults import raise_first_error

logger = logging.getLogger(__name__)


class Reads(NamedTuple):
    """What one pipeline of bounded reads found; at most one of ``missing`` and ``damage`` is set."""

    values: list[bytes]
    """One reply per name, each at most one byte longer than expected (use them only when nothing else is set)."""
    missing: bool = False
    """A value is not there: an ordinary miss, not a fault."""
    damage: CorruptBlockError | None = None
    """A name held no string, or an empty one; every such name, and every too long string, is deleted already."""


def read_bounded(client: Any, wanted: Sequence[tuple[str, int]]) -> Reads:
    """Read every ``(name, expected bytes)`` of ``wanted`` in one pipeline, no reply longer than expected + 1.

    Raises:
        redis.exceptions.RedisError, OSError: the server failed (not a value: a server fault).
    """
    pipe = client.pipeline(transaction=False)
    for name, expected in wanted:
        pipe.getrange(name, 0, expected)  # inclusive end: one byte more than a well-formed value has
    replies = pipe.execute(raise_on_error=False)
    raise_first_error([r for r in replies if not _wrong_type(r)])
    found = list(zip(wanted, replies, strict=True))
    not_strings = [name for (name, _), reply in found if _wrong_type(reply)]
    too_long = [name for (name, expected), reply in found if not _wrong_type(reply) and len(reply) > expected]
    empty = [name for (name, _), reply in found if reply == b""]
    if not not_strings and not too_long and not empty:
        return Reads(replies)
    planted_empty = _deleted(client, [*not_strings, *too_long], empty)
    damaged = [(name, "is not a string (WRONGTYPE)") for name in not_strings] + \
              [(name, "is an empty string") for name in planted_empty]
    if damaged:
        (first, why), more = damaged[0], len(damaged) + len(too_long) - 1
        also = f", as were {more} more of its batch" if more else ""
        return Reads(replies, damage=CorruptBlockError(f"value {first} {why}: deleted{also}"))
    return Reads(replies, missing=len(empty) > len(planted_empty))


def _deleted(client: Any, doomed: list[str], empty: list[str]) -> list[str]:
    """Delete the ``doomed`` names and the ``empty`` ones; returns the empty names that held a value.

    Why ``DEL`` tells a miss from a planted empty string: it answers 1 only where something was there, and it
    removes that in the same command. An ``EXISTS`` beside every ``GETRANGE`` would tell them apart too, but would
    add a command per value to every load; this costs one round trip on a batch that fails anyway. A value another
    engine writes between the two commands is deleted as well: a lost copy (stored again later), never a wrong one.
    A refused ``DEL`` (an ACL without it) is only logged: the load fails anyway, and a miss stays a miss.
    """
    pipe = client.pipeline(transaction=False)
    for name in (*doomed, *empty):
        pipe.delete(name)
    replies = pipe.execute(raise_on_error=False)
    refused = [r for r in replies if isinstance(r, Exception)]
    if refused:
        logger.debug("remote tier: could not delete %d damaged value(s): %s", len(refused), refused[0])
    return [name for name, deleted in zip(empty, replies[len(doomed):], strict=True) if deleted == 1]


def _wrong_type(reply: Any) -> bool:
    return isinstance(reply, Exception) and str(reply).startswith("WRONGTYPE")
