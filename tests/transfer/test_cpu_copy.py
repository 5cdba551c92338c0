"""The copier's inner loop: the C extension and its pure-Python fallback move the same bytes."""

import numpy as np
import pytest
import torch

from kvoffload.transfer import cpu_copy


@pytest.mark.parametrize("copy", [cpu_copy.copy_ranges, cpu_copy._copy_ranges_in_python])
def test_ranges_land_where_asked(copy):
    src = torch.arange(4096, dtype=torch.int32).view(torch.int8)
    dst = torch.zeros_like(src)
    ranges = [(0, 100, 37), (500, 4000, 1000), (9000, 0, 4)]  # (dst offset, src offset, bytes)
    d, s, n = (np.asarray(col, dtype=np.int64) for col in zip(*ranges, strict=True))
    copy(d + dst.data_ptr(), s + src.data_ptr(), n)
    expected = torch.zeros_like(src)
    for do, so, nb in ranges:
        expected[do:do + nb] = src[so:so + nb]
    assert torch.equal(dst, expected)


def test_the_extension_is_built_and_rejects_mismatched_arrays():
    from kvoffload._blockcopy import copy_ranges  # make test builds it; the fallback is for odd installs

    one = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="one length"):
        copy_ranges(one, np.zeros(2, dtype=np.int64), one)
    with pytest.raises(ValueError, match="negative"):
        copy_ranges(one, one, np.full(1, -1, dtype=np.int64))
