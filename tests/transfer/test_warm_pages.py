"""warm_pages: a warmed buffer is resident and takes no page faults, keeps every byte written into it before or
while it is populated, ends its thread, stops when asked, and stays cold and usable where the kernel refuses."""

from __future__ import annotations

import errno
import logging
import mmap
import threading
from pathlib import Path

import pytest
import torch
from tests.transfer.pages import faults_writing, gated, resident_share

from kvoffload.transfer import warm_pages
from kvoffload.transfer.warm_pages import THREAD_NAME, WarmState, libc_madvise, warm

PAGE = mmap.PAGESIZE
BUFFER_BYTES = 64 << 20  # above glibc's largest mmap threshold: always fresh, never-touched pages
CHUNK = 1 << 20


def fresh_buffer() -> torch.Tensor:
    return torch.empty(BUFFER_BYTES, dtype=torch.int8)


def pattern(tensor: torch.Tensor) -> torch.Tensor:
    """A byte per page, varying with the page, in every other page (the rest left untouched)."""
    values = (torch.arange(tensor.numel() // PAGE) % 120 + 1).to(torch.int8)
    values[1::2] = 0
    return values


def write_pattern(tensor: torch.Tensor) -> None:
    pages = tensor[:tensor.numel() // PAGE * PAGE].view(-1, PAGE)
    values = pattern(tensor)
    pages[0::2, 0] = values[0::2]


def read_pattern(tensor: torch.Tensor) -> torch.Tensor:
    return tensor[:tensor.numel() // PAGE * PAGE].view(-1, PAGE)[:, 0].clone()


def test_a_fresh_buffer_is_cold_and_warm_makes_it_resident() -> None:
    buffer = fresh_buffer()
    assert resident_share(buffer) < 0.01  # the check sees a cold buffer as cold
    warming = warm(buffer, chunk_bytes=CHUNK)
    assert warming.state is WarmState.WARM and not warming.in_background
    assert warming.populated_bytes == warming.nbytes >= BUFFER_BYTES - PAGE
    assert resident_share(buffer) == 1.0


def _thp_always() -> bool:
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(_thp_always(), reason="huge pages fault once per 2 MiB: the per-page count does not apply")
def test_writing_a_warmed_buffer_takes_no_page_faults_and_a_cold_one_a_fault_a_page() -> None:
    pages = BUFFER_BYTES // PAGE
    cold = fresh_buffer()
    assert faults_writing(cold) >= pages * 0.9
    warmed = fresh_buffer()
    warm(warmed, chunk_bytes=CHUNK)
    assert faults_writing(warmed) <= pages // 100


def test_bytes_written_before_warming_are_kept() -> None:
    buffer = fresh_buffer()
    write_pattern(buffer)  # half the pages present, half not yet
    warm(buffer, chunk_bytes=CHUNK)
    assert torch.equal(read_pattern(buffer), pattern(buffer))
    assert resident_share(buffer) == 1.0


def test_stores_written_while_warming_in_the_background_are_kept() -> None:
    buffer = fresh_buffer()
    release, calls = threading.Event(), []
    warming = warm(buffer, sync_budget_s=0, chunk_bytes=CHUNK, madvise=gated(release, calls))
    assert warming.in_background and warming.state is WarmState.RUNNING
    # Stores from this thread, from the end backwards, while the thread populates from the start: they meet.
    rows = buffer[:BUFFER_BYTES // PAGE * PAGE].view(-1, PAGE)
    values = pattern(buffer)
    release.set()
    for page in range(rows.shape[0] - 2, -1, -2):
        rows[page, 0] = values[page]
    assert warming.wait(10)
    assert warming.state is WarmState.WARM
    assert torch.equal(read_pattern(buffer), values)


def test_background_population_ends_its_thread() -> None:
    buffer = fresh_buffer()
    warming = warm(buffer, sync_budget_s=0, chunk_bytes=CHUNK)
    assert warming.in_background
    assert warming.wait(10)
    assert warming.state is WarmState.WARM and warming.seconds >= warming.sync_seconds
    assert not any(t.name == THREAD_NAME for t in threading.enumerate())
    assert resident_share(buffer) == 1.0


def test_stop_ends_population_after_the_chunk_in_progress() -> None:
    buffer = fresh_buffer()
    release, calls = threading.Event(), []
    warming = warm(buffer, sync_budget_s=0, chunk_bytes=CHUNK, madvise=gated(release, calls))
    warming.stop()
    release.set()
    assert warming.wait(10)
    assert warming.state is WarmState.STOPPED
    assert calls == [CHUNK] and warming.populated_bytes == CHUNK
    assert resident_share(buffer) < 0.05


def test_a_kernel_without_the_advice_leaves_the_buffer_cold_and_usable(caplog: pytest.LogCaptureFixture) -> None:
    buffer = fresh_buffer()
    with caplog.at_level(logging.INFO, logger=warm_pages.__name__):
        warming = warm(buffer, advice=12345, chunk_bytes=CHUNK)  # no such advice: the kernel's own EINVAL
    assert warming.state is WarmState.UNSUPPORTED and warming.populated_bytes == 0
    records = [r for r in caplog.records if r.name == warm_pages.__name__]
    assert [(r.levelno, "stays cold" in r.getMessage()) for r in records] == [(logging.INFO, True)]
    assert resident_share(buffer) < 0.01
    buffer.fill_(3)
    assert bool((buffer == 3).all())


def test_another_error_is_one_warning_and_leaves_the_rest_cold(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def out_of_memory_after_one_chunk(address: int, length: int, advice: int) -> int:
        calls.append(length)
        return libc_madvise(address, length, advice) if len(calls) == 1 else errno.ENOMEM

    buffer = fresh_buffer()
    with caplog.at_level(logging.INFO, logger=warm_pages.__name__):
        warming = warm(buffer, chunk_bytes=CHUNK, madvise=out_of_memory_after_one_chunk)
    assert warming.state is WarmState.FAILED and warming.populated_bytes == CHUNK
    records = [r for r in caplog.records if r.name == warm_pages.__name__]
    assert [(r.levelno, "ENOMEM" in r.getMessage()) for r in records] == [(logging.WARNING, True)]


@pytest.mark.parametrize("chunk_bytes", [0, PAGE + 1])
def test_a_chunk_that_is_not_whole_pages_is_rejected(chunk_bytes: int) -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        warm(torch.empty(PAGE * 4, dtype=torch.int8), chunk_bytes=chunk_bytes)


def test_a_buffer_smaller_than_a_page_has_nothing_to_populate() -> None:
    warming = warm(torch.empty(100, dtype=torch.int8))
    assert warming.state is WarmState.WARM and warming.nbytes == 0
