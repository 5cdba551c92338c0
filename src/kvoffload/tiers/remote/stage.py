"""Staging buffers for the remote tier's stores, and the batches a job's pipelines are cut into.

A ``SET`` needs its value (header, payload, MAC) in one buffer, so a store copies each host slot's payload once.
Into fresh ``bytes`` (``b"".join``) that copy page-faults its way through new memory on every job: measured at 2x
the cost of the copy itself, and the store then ran at 0.5-0.6x a raw ``SET`` of the same bytes. ``SealStage``
copies into two buffers it keeps, so the memory stays mapped; the values it hands out are views into them, which
redis-py sends as they are. Two, because ``RemoteHandler`` seals batch k+1 into one while the other still holds
batch k, on its way to the socket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from typing import Any, TypeVar

import numpy as np

from kvoffload.keys import OffloadKey
from kvoffload.tiers.lower.block_codec import seal_into
from kvoffload.tiers.lower.block_format import BlockFormat

BATCH_BYTES = 8 << 20
"""About this many value bytes per pipeline: large enough that a pipeline's round trip is noise, small enough that
sealing one batch (or verifying one) overlaps the network time of the next (``RemoteHandler``)."""

Item = TypeVar("Item")


def batches(items: Sequence[Item], per_batch: int) -> list[Sequence[Item]]:
    """``items`` cut into consecutive runs of ``per_batch`` (the last one shorter)."""
    return [items[i:i + per_batch] for i in range(0, len(items), per_batch)]


class SealStage:
    """Two staging buffers of ``per_batch`` values of up to ``value_bytes`` each; not thread-safe (one store lane
    seals into it, one batch at a time).

    Args:
        fmt: the tier's block format (header, and MAC when it has a secret).
        fingerprint: the namespace fingerprint every header carries.
        value_bytes: the largest value (``fmt.file_bytes`` of the largest payload).
        per_batch: values per batch.
    """

    def __init__(self, fmt: BlockFormat, fingerprint: bytes, value_bytes: int, per_batch: int) -> None:
        self._fmt = fmt
        self._fingerprint = fingerprint
        self._value_bytes = value_bytes
        self._buffers = [np.empty(per_batch * value_bytes, dtype=np.uint8) for _ in range(2)]

    def seal(self, buffer: int, blocks: Sequence[tuple[OffloadKey, np.ndarray]]) -> list[memoryview]:
        """Copy each payload into staging buffer ``buffer`` (0 or 1) behind its header, with its MAC after it.

        Returns views of the values, valid until the next ``seal`` into the same buffer. The CRC is taken of the
        staged copy, so a value's checksum always matches the bytes it is sent with.
        """
        stage = self._buffers[buffer]
        values: list[memoryview] = []
        for i, (key, payload) in enumerate(blocks):
            at = i * self._value_bytes
            out = stage[at:at + self._value_bytes].data
            end = seal_into(self._fmt, self._fingerprint, key, payload.data, out)
            values.append(out[:end])
        return values


Product = TypeVar("Product")


def overlapped(helper: Executor, work: Sequence[Item], produce: Callable[[int, Item], Product],
               consume: Callable[[Item, Product], None], *, helper_produces: bool) -> None:
    """``consume(item, produce(k, item))`` for each ``k, item`` of ``work``, in order, two items in flight.

    The helper thread runs ``produce`` (then the caller consumes item k while the helper produces item k+1) or
    ``consume`` (the caller produces item k+1 while the helper consumes item k). At most two products live at
    once, so ``k % 2`` names a buffer that no live product uses. The first exception of either side ends the
    loop and is raised here, after the helper's task in flight has finished (it may be using a buffer).
    """
    pending: Future[Any] | None = None
    try:
        if helper_produces:
            pending = helper.submit(produce, 0, work[0])
            for k, item in enumerate(work):
                assert pending is not None
                product = pending.result()
                pending = helper.submit(produce, (k + 1) % 2, work[k + 1]) if k + 1 < len(work) else None
                consume(item, product)
        else:
            for k, item in enumerate(work):
                product = produce(k % 2, item)
                if pending is not None:
                    pending.result()
                pending = helper.submit(consume, item, product)
            assert pending is not None
            done, pending = pending, None
            done.result()
    finally:
        if pending is not None:
            wait([pending])
