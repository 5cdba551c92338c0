"""The scheduler half's step scan (C): which requests got new blocks, and whose next offload block filled."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import _stepscan


def scan(n: int, new_block_ids: Sequence[object], computed: Sequence[int], partial: Sequence[int],
         offset: int) -> tuple[list[int], list[int]]:
    """``_stepscan.scan`` with the thresholds given as the int64 array the scheduler keeps."""
    return _stepscan.scan(n, new_block_ids, computed, array("q", partial), offset)


def reference(new_block_ids: Sequence[object], computed: Sequence[int], partial: Sequence[int],
              offset: int) -> tuple[list[int], list[int]]:
    """What the scan must return, in plain Python: the truthy block lists, and computed + offset > partial."""
    grown = [i for i, blocks in enumerate(new_block_ids) if blocks]
    filled = [i for i, (c, p) in enumerate(zip(computed, partial, strict=True)) if c + offset > p]
    return grown, filled


block_lists = st.one_of(st.none(), st.just(()), st.just(([],)), st.lists(st.lists(st.integers(0, 9), max_size=2),
                                                                        min_size=1, max_size=2).map(tuple))
columns = st.integers(0, 40).flatmap(lambda n: st.tuples(
    st.lists(block_lists, min_size=n, max_size=n),
    st.lists(st.integers(0, 1 << 40), min_size=n, max_size=n),
    st.lists(st.integers(-1, 1 << 40) | st.just((1 << 62) - 1), min_size=n, max_size=n),
    st.sampled_from((0, 1))))


@given(columns)
def test_scan_is_the_plain_python_passes(cols):
    new_block_ids, computed, partial, offset = cols
    assert scan(len(computed), new_block_ids, computed, partial, offset) == reference(*cols)


def test_an_off_by_one_scan_would_fail_the_property():
    # A request exactly at its threshold (computed + offset == partial) is not full yet: a scan comparing with >=
    # gives another answer than the reference, so the property above catches it.
    def mutant(new_block_ids, computed, partial, offset):
        return reference(new_block_ids, computed, partial, offset)[0], [
            i for i, (c, p) in enumerate(zip(computed, partial, strict=True)) if c + offset >= p]

    cols = ([None, ([3],)], [15, 16], [16, 16], 0)
    assert scan(2, *cols) == reference(*cols) == ([1], [])
    assert mutant(*cols) != reference(*cols)
    assert scan(2, cols[0], cols[1], cols[2], 1) == ([1], [1])


def test_tuples_and_other_sequences_are_read_too():
    assert scan(3, (None, ([4],), None), (1, 2, 3), [0, 5, 5], 1) == ([1], [0])


@pytest.mark.parametrize(("n", "blocks", "computed", "partial", "offset"), [
    (2, [None], [1, 2], [0, 0], 0),
    (2, [None, None], [1], [0, 0], 0),
    (1, [None], [1], [0], 2),
])
def test_columns_of_other_lengths_or_a_bad_offset_are_refused(n, blocks, computed, partial, offset):
    with pytest.raises(ValueError, match="StepSchedule: columns of"):
        scan(n, blocks, computed, partial, offset)


def test_thresholds_of_another_length_or_not_a_buffer_are_refused():
    with pytest.raises(ValueError, match="partial holds 8 bytes, not 2 int64"):
        scan(2, [None, None], [1, 2], [0], 0)
    with pytest.raises(TypeError):
        _stepscan.scan(1, [None], [1], [0], 0)  # a list: the scheduler keeps an array


def test_a_count_that_is_not_an_int64_names_the_request():
    with pytest.raises(ValueError, match="request 1"):
        scan(2, [None, None], [1, "x"], [0, 0], 0)
    with pytest.raises(ValueError, match="request 0"):
        scan(1, [None], [1 << 70], [0], 0)
    with pytest.raises(TypeError, match="new_block_ids must be a sequence"):
        scan(1, 5, [1], [0], 0)
