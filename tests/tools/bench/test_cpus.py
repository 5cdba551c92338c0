"""``tools.bench.cpus``: the CPU lists ``bench object --client-cpus/--server-cpus`` take, and pinning a process."""

from __future__ import annotations

import os
import threading

import pytest

from kvoffload.tools.bench.cpus import parse_cpus, pin

ALLOWED = os.sched_getaffinity(0)


def test_a_cpu_list_names_single_cpus_and_ranges() -> None:
    first = min(ALLOWED)
    assert parse_cpus(str(first), "--x") == {first}
    assert parse_cpus(",".join(map(str, sorted(ALLOWED))), "--x") == ALLOWED
    if {0, 1} <= ALLOWED:
        assert parse_cpus("0-1", "--x") == {0, 1}


@pytest.mark.parametrize("text", ["", "a", "1-", "0,,1", "1-0", str(max(ALLOWED) + 1), f"0-{max(ALLOWED) + 1}"])
def test_a_malformed_list_or_a_cpu_this_process_may_not_use_is_refused_by_its_option(text: str) -> None:
    with pytest.raises(ValueError, match="--server-cpus"):
        parse_cpus(text, "--server-cpus")


def test_pinning_moves_every_thread_and_the_threads_made_later_follow() -> None:
    started, release = threading.Event(), threading.Event()
    seen: list[set[int]] = []

    def before() -> None:
        started.set()
        release.wait()
        seen.append(os.sched_getaffinity(0))  # a thread that existed when the process was pinned

    older = threading.Thread(target=before)
    older.start()
    started.wait()
    one = {min(ALLOWED)}
    try:
        assert pin(os.getpid(), one) >= 2  # this thread and the older one at least
        release.set()
        older.join()
        later = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        later.start()
        later.join()
        assert seen == [one, one]
    finally:
        release.set()
        pin(os.getpid(), ALLOWED)
    assert os.sched_getaffinity(0) == ALLOWED
