"""The copier's inner loop: the C extension moves the bytes asked; cutting a job's ranges into pieces for
threads."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload._blockcopy import copy_ranges
from kvoffload.transfer.cpu_copy import Ranges, split_ranges


def test_ranges_land_where_asked() -> None:
    src = torch.arange(4096, dtype=torch.int32).view(torch.int8)
    dst = torch.zeros_like(src)
    ranges = [(0, 100, 37), (500, 4000, 1000), (9000, 0, 4)]  # (dst offset, src offset, bytes)
    d, s, n = (np.asarray(col, dtype=np.int64) for col in zip(*ranges, strict=True))
    copy_ranges(d + dst.data_ptr(), s + src.data_ptr(), n)
    expected = torch.zeros_like(src)
    for do, so, nb in ranges:
        expected[do:do + nb] = src[so:so + nb]
    assert torch.equal(dst, expected)


def test_the_extension_rejects_mismatched_arrays() -> None:
    one = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="one length"):
        copy_ranges(one, np.zeros(2, dtype=np.int64), one)
    with pytest.raises(ValueError, match="negative"):
        copy_ranges(one, one, np.full(1, -1, dtype=np.int64))


def _bytes(ranges: Ranges) -> list[tuple[int, int]]:
    """Every (dst, src) byte pair the ranges copy, in order."""
    return [(d + i, s + i) for d, s, n in zip(*(a.tolist() for a in ranges), strict=True) for i in range(n)]


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=12), parts=st.integers(1, 9))
def test_split_cuts_the_same_bytes_in_order_into_pieces_of_near_equal_size(sizes: list[int], parts: int) -> None:
    n = len(sizes)
    size = np.array(sizes, dtype=np.int64)
    ranges = Ranges(np.arange(n, dtype=np.int64) * 1000 + 7, np.arange(n, dtype=np.int64) * 100, size)
    pieces = split_ranges(ranges, parts)
    assert list(itertools.chain.from_iterable(map(_bytes, pieces))) == _bytes(ranges)
    total = int(size.sum())
    cuts = sorted({k * total // parts for k in range(parts + 1)})
    assert [int(p.size.sum()) for p in pieces] == [b - a for a, b in itertools.pairwise(cuts)]
    assert all(len(p.size) and p.size.min() > 0 for p in pieces)
    for p in pieces:  # copy_ranges takes C-contiguous int64 buffers only
        assert all(a.dtype == np.int64 and a.flags.c_contiguous for a in p)


def test_one_range_bigger_than_a_piece_is_cut_into_every_piece() -> None:
    one = Ranges(np.array([1000], dtype=np.int64), np.array([0], dtype=np.int64), np.array([100], dtype=np.int64))
    pieces = split_ranges(one, 4)
    assert [(p.dst.tolist(), p.src.tolist(), p.size.tolist()) for p in pieces] == [
        ([1000], [0], [25]), ([1025], [25], [25]), ([1050], [50], [25]), ([1075], [75], [25])]
