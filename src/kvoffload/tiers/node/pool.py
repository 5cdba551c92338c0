"""The node tier's worker side memory: one rank's slots in the node pool's shared mapping, as a ``HostPool``.

Every handler that reads or writes the private pool works on this one unchanged: the copies go straight between
the shared pages and the device (no private copy in between). Both mappings are guarded (``_mapguard``): a pool
file or index truncated under the engine reads as zeros instead of killing it with SIGBUS, and the pool is
``lost``: ``NodeCheck`` fails every job on it from then on. On a CUDA worker the mapping is page-locked with
``cudaHostRegister`` so copies run asynchronously, as from a private pinned pool; where that fails the copies
still run, synchronously, and the worker says so once.
"""

from __future__ import annotations

import logging
import mmap

import torch

from kvoffload import _mapguard
from kvoffload.tiers.node.files import guard
from kvoffload.transfer.host_pool import HostPool

logger = logging.getLogger(__name__)


class NodePool(HostPool):
    """A rank's ``pool.<rank>`` mapping as ``num_slots`` slots, with the index mapping its loads are checked in.

    Args:
        mapping: the rank's pool file, mapped (``segment.open_pool_file``).
        index: the namespace's index, mapped (``segment.open_index``): what ``NodeCheck`` verifies epochs in.
    """

    def __init__(self, mapping: mmap.mmap, index: mmap.mmap, num_slots: int, slot_bytes: int,
                 pin_memory: bool) -> None:
        buffer = torch.frombuffer(mapping, dtype=torch.int8, count=num_slots * slot_bytes)
        super().__init__(num_slots, slot_bytes, buffer=buffer.view(num_slots, slot_bytes))
        self.mapping = mapping  # kept open for as long as the pool's tensor uses it
        self.index = index
        self._guards = [g for g in (guard(mapping, self), guard(index, self)) if g is not None]
        self.pinned = pin_memory and torch.cuda.is_available() and _register(self.buffer)
        logger.info("node pool: %d slots x %d bytes (%.2f GiB) shared, pinned=%s", num_slots, slot_bytes,
                    self.nbytes / (1 << 30), self.pinned)


    def lost(self) -> bool:
        """Whether a SIGBUS replaced the pool's or the index's pages (a file truncated under this engine)."""
        return any(_mapguard.lost(g) for g in self._guards)


def _register(buffer: torch.Tensor) -> bool:
    nbytes = buffer.numel()
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
    if int(err) != 0:
        logger.warning("node tier: cudaHostRegister of the node pool (%d bytes) failed (%s): its copies run "
                       "synchronously", nbytes, err)
        return False
    return True
