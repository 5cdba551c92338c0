"""Asking the kernel about a buffer's pages, for the tests of populating them (warm_pages, HostPool)."""

from __future__ import annotations

import ctypes
import mmap
import resource
import threading

import torch

from kvoffload.transfer import warm_pages
from kvoffload.transfer.warm_pages import libc_madvise, page_range

PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def resident_share(tensor: torch.Tensor) -> float:
    """The share of the tensor's whole pages in memory, asked of the kernel (mincore)."""
    start, end = page_range(tensor)
    pages = (end - start) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    assert _libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in bytes(vec)) / pages


def faults_writing(tensor: torch.Tensor) -> int:
    """Minor page faults this thread takes writing every byte of the tensor once."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    ctypes.memset(tensor.data_ptr(), 7, tensor.numel())
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def gated(release: threading.Event, calls: list[int]) -> warm_pages.Madvise:
    """A madvise whose first call waits for ``release``, then gives the real advice."""
    def advise(address: int, length: int, advice: int) -> int:
        calls.append(length)
        if len(calls) == 1:
            assert release.wait(10)
        return libc_madvise(address, length, advice)

    return advise
