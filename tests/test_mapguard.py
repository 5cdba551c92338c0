"""The SIGBUS guard (C): a guarded mapping of a /dev/shm file truncated under us turns to zero pages, marked lost.

Without the guard the same access kills the process with SIGBUS (shown in a child process, so the test can fail);
a fault outside every guarded range still reaches the handler installed before ours (the default, or Python's
faulthandler), and a SIGBUS sent with kill() still kills.
"""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvoffload import _mapguard

SIZE = 1 << 20
PATTERN = bytes(range(1, 256)) * (SIZE // 255) + bytes(range(1, SIZE % 255 + 1))


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory on /dev/shm (a tmpfs: a truncated file's pages are gone), removed after the test."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    path = Path(tempfile.mkdtemp(prefix="kvoffload-mapguard-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def map_file(path: Path, size: int) -> mmap.mmap:
    """A new file of ``size`` bytes, mapped shared and writable, as the node pool maps its files."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def test_a_truncated_guarded_mapping_reads_zeros_and_is_lost(shm_dir: Path) -> None:
    path = shm_dir / "pool"
    m = map_file(path, SIZE)
    guard = _mapguard.guard(m)
    try:
        m[:] = PATTERN
        assert bytes(m[0:4096]) == PATTERN[:4096]
        assert not _mapguard.lost(guard)
        faults = _mapguard.faults()
        os.truncate(path, 0)
        head = bytes(m[0:4096])  # SIGBUS without the guard
        copied = torch.frombuffer(m, dtype=torch.int8).clone()
        m[0:4] = b"kvkv"
        assert _mapguard.lost(guard)
        assert head == bytes(4096)
        assert not copied.any()
        assert m[0:4] == b"kvkv" and m[4:] == bytes(SIZE - 4)  # private zero pages now: the file stays empty
        assert os.stat(path).st_size == 0
        assert _mapguard.faults() > faults
    finally:
        _mapguard.unguard(guard)
        m.close()


def test_torch_copies_into_a_truncated_guarded_mapping_survive(shm_dir: Path) -> None:
    """Writes through torch (its copy may run in several threads), the pool's store direction."""
    size = 16 << 20
    path = shm_dir / "pool"
    m = map_file(path, size)
    guard = _mapguard.guard(m)
    try:
        os.truncate(path, size // 4)
        source = torch.ones(size, dtype=torch.uint8)
        target = torch.frombuffer(m, dtype=torch.uint8)
        target.copy_(source)
        del target
        assert _mapguard.lost(guard)
    finally:
        _mapguard.unguard(guard)
        m.close()


CHILD = textwrap.dedent("""
    import mmap, os, signal, sys
    from kvoffload import _mapguard

    mode, directory = sys.argv[1], sys.argv[2]

    def map_file(name, size):
        fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        m[:] = b"x" * size
        return m

    guarded = map_file("guarded", 1 << 16)
    other = map_file("other", 1 << 16)
    if mode != "unguarded":
        _mapguard.guard(guarded)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGBUS)
    touched = "other" if mode == "outside" else "guarded"
    os.truncate(os.path.join(directory, touched), 0)
    print("read", len(bytes((guarded if touched == "guarded" else other)[:4096])), flush=True)
""")
READ_LINE = next(n for n, line in enumerate(CHILD.splitlines(), 1) if line.startswith('print("read"'))


def run_child(mode: str, directory: Path, *python_options: str) -> subprocess.CompletedProcess[str]:
    """The child in a mode, its files in a new ``directory``; without faulthandler unless an option enables it."""
    directory.mkdir()
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    return subprocess.run([sys.executable, *python_options, "-c", CHILD, mode, str(directory)], capture_output=True,
                          text=True, timeout=60, env=environ)


def test_the_guard_is_what_saves_the_process(shm_dir: Path) -> None:
    guarded = run_child("guarded", shm_dir / "with")
    assert guarded.returncode == 0, guarded.stderr
    assert guarded.stdout == "read 4096\n"
    unguarded = run_child("unguarded", shm_dir / "without")
    assert unguarded.returncode == -signal.SIGBUS, unguarded.stderr
    assert unguarded.stdout == ""


@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_fault_outside_every_range_still_kills(shm_dir: Path, faulthandler: bool) -> None:
    child = run_child("outside", shm_dir / "outside", *(["-X", "faulthandler"] if faulthandler else []))
    assert child.returncode == -signal.SIGBUS, child.stderr
    assert child.stdout == ""
    if faulthandler:  # the handler before ours ran: its traceback names the line that faulted
        assert "Fatal Python error: Bus error" in child.stderr
        assert f'File "<string>", line {READ_LINE} in <module>' in child.stderr, child.stderr
    else:
        assert "Fatal Python error" not in child.stderr


def test_a_sigbus_sent_by_kill_still_kills(shm_dir: Path) -> None:
    child = run_child("kill", shm_dir / "kill")
    assert child.returncode == -signal.SIGBUS, child.stderr
    assert child.stdout == ""


def test_ids_are_reused_and_only_writable_page_aligned_buffers_are_guarded() -> None:
    first, second = mmap.mmap(-1, 4096), mmap.mmap(-1, 4096)
    a = _mapguard.guard(first)
    b = _mapguard.guard(second)
    assert a != b
    with pytest.raises(BufferError):
        first.close()  # guarded: the mapping is held until unguard
    _mapguard.unguard(a)
    with pytest.raises(ValueError, match="no guarded range"):
        _mapguard.lost(a)
    with pytest.raises(ValueError, match="no guarded range"):
        _mapguard.unguard(a)
    again = _mapguard.guard(first)
    assert again == a
    _mapguard.unguard(again)
    _mapguard.unguard(b)
    first.close()
    second.close()
    with pytest.raises((TypeError, BufferError)):
        _mapguard.guard(b"read only")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _mapguard.guard(7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="starts on a page"):
        _mapguard.guard(memoryview(mmap.mmap(-1, 8192))[1:])
    for bad in (-1, _mapguard.MAX_RANGES):
        with pytest.raises(ValueError, match="no guarded range"):
            _mapguard.lost(bad)


def test_a_full_table_refuses_until_a_range_is_unguarded() -> None:
    maps = [mmap.mmap(-1, 4096) for _ in range(_mapguard.MAX_RANGES + 1)]
    guards: list[int] = []
    try:
        with pytest.raises(RuntimeError, match="in use"):  # other tests of this process may hold a few
            for m in maps:
                guards.append(_mapguard.guard(m))
        assert len(guards) <= _mapguard.MAX_RANGES
        _mapguard.unguard(guards.pop())
        guards.append(_mapguard.guard(maps[-1]))
    finally:
        for guard in guards:
            _mapguard.unguard(guard)
        for m in maps:
            m.close()


def test_concurrent_readers_survive_a_truncation_to_half(shm_dir: Path) -> None:
    path = shm_dir / "pool"
    m = map_file(path, SIZE)
    m[:] = PATTERN
    guard = _mapguard.guard(m)
    stop = threading.Event()
    passes = [0, 0]
    errors: list[BaseException] = []

    def read(reader: int) -> None:
        try:
            while not stop.is_set():
                for offset in range(0, SIZE, 16384):
                    bytes(m[offset:offset + 16384])
                passes[reader] += 1
        except BaseException as error:
            errors.append(error)

    def wait_for(done: list[int]) -> None:
        deadline = time.monotonic() + 30
        while any(p < d for p, d in zip(passes, done, strict=True)) and not errors:
            assert time.monotonic() < deadline, passes
            time.sleep(0.001)

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    try:
        for thread in readers:
            thread.start()
        wait_for([1, 1])
        os.truncate(path, SIZE // 2)
        wait_for([p + 2 for p in passes])  # a whole pass each over the lost half, after the truncation
    finally:
        stop.set()
        for thread in readers:
            thread.join()
    try:
        assert errors == []
        assert _mapguard.lost(guard)
        assert m[:] == bytes(SIZE)  # the whole range, the half still in the file too
    finally:
        _mapguard.unguard(guard)
        m.close()
