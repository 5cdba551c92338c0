"""The host tier's memory: one int8 buffer of fixed-size slots.

The host index (scheduler side) hands out slot numbers; the worker side copies bytes into and out of them:
device<->host copies (``transfer/host_copier.py``) and host<->disk I/O (``tiers/disk/handler.py``) both read and write
rows of this buffer, from their own threads. The pool is deliberately a plain shared buffer with no locking:
the scheduler never gives one slot to two jobs that could run at the same time.

A slot holds one offload block: ``factor`` engine blocks (sub-blocks) of one KV-cache group, sub-block ``j``
at byte offset ``j * group_block_bytes(g)``, so ``slot_bytes = factor * max_block_bytes``. Groups with
smaller blocks leave the tail of their slots unused.

A private, unpinned buffer has its pages populated at start-up (``warm_pages.py``: in the constructor for up to
half a second, the rest on a daemon thread while stores may already run), so the first stores into it run at memory
speed rather than at page-fault speed; the cost is the whole buffer committed from start-up. Pinned memory is
resident already, and a caller's ``buffer`` (the node pool's shared mapping) is its owner's business.
"""

from __future__ import annotations

import logging
import weakref

import torch

from kvoffload.transfer import warm_pages

logger = logging.getLogger(__name__)


class HostPoolAllocationError(MemoryError):
    """The pool's buffer could not be allocated; the message names the size asked for."""


class HostPool:
    """``num_slots`` rows of ``slot_bytes`` bytes in one int8 tensor, ``buffer``.

    Args:
        num_slots: how many offload blocks the tier holds.
        slot_bytes: bytes of one slot (``factor * max_block_bytes``).
        pin_memory: page-lock the buffer so CUDA copies run asynchronously; ignored when CUDA is unavailable.
        buffer: use this ``(num_slots, slot_bytes)`` int8 tensor instead of allocating one (``pinned`` then says
            whether its owner page-locked it).
        warm: populate the pages of a buffer it allocates unpinned (``warming`` follows it; None when there is
            none): the first stores then run at memory speed. Benchmarks turn it off to measure a cold pool.

    Raises:
        ValueError: ``num_slots`` or ``slot_bytes`` is not positive.
        HostPoolAllocationError: the buffer could not be allocated.
    """

    def __init__(self, num_slots: int, slot_bytes: int, pin_memory: bool = False,
                 buffer: torch.Tensor | None = None, warm: bool = True) -> None:
        if num_slots <= 0:
            raise ValueError(f"HostPool: num_slots must be positive, got {num_slots}")
        if slot_bytes <= 0:
            raise ValueError(f"HostPool: slot_bytes must be positive, got {slot_bytes}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.pinned = pin_memory and torch.cuda.is_available()
        self.warming: warm_pages.Warming | None = None
        if buffer is not None:  # memory someone else owns (the node pool's shared mapping): used as it is
            if buffer.dtype != torch.int8 or tuple(buffer.shape) != (num_slots, slot_bytes):
                raise ValueError(f"HostPool: buffer must be int8 of shape ({num_slots}, {slot_bytes}), got "
                                 f"{buffer.dtype} {tuple(buffer.shape)}")
            self.buffer = buffer
            return
        try:
            self.buffer = torch.empty((num_slots, slot_bytes), dtype=torch.int8, pin_memory=self.pinned)
        except (RuntimeError, MemoryError) as e:
            raise HostPoolAllocationError(
                f"HostPool: cannot allocate {self.nbytes} bytes ({self.nbytes / (1 << 30):.2f} GiB = "
                f"{num_slots} slots x {slot_bytes} bytes{', pinned' if self.pinned else ''}): {e}"
            ) from e
        logger.info("host pool: %d slots x %d bytes (%.2f GiB, pinned=%s)",
                    num_slots, slot_bytes, self.nbytes / (1 << 30), self.pinned)
        if warm and not self.pinned:
            self.warming = warm_pages.warm(self.buffer)
            # A pool dropped while its pages are still being populated stops the thread, which frees the memory.
            weakref.finalize(self, self.warming.stop)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def slot(self, index: int) -> torch.Tensor:
        """Row ``index`` of ``buffer`` (a view: writing it writes the pool).

        Raises:
            ValueError: ``index`` is not a slot of this pool.
        """
        if not 0 <= index < self.num_slots:
            raise ValueError(f"HostPool: slot {index} out of range [0, {self.num_slots})")
        return self.buffer[index]
