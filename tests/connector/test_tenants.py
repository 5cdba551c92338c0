"""QuotaFile: the quota file is watched on a thread of its own (the engine step only takes what it read), read once
per change, and a file whose mapping is refused is counted and never taken."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from kvoffload.connector.tenants import QUOTA_POLL_S, QuotaFile


def test_the_watcher_thread_reads_a_changed_file_and_the_step_takes_it_once(tmp_path: Path) -> None:
    quota = tmp_path / "quota.json"
    quota.write_text(json.dumps({"default": 1.0}))
    watcher = QuotaFile(quota)
    try:
        time.sleep(QUOTA_POLL_S * 1.5)
        assert watcher.take() is None  # unchanged since start-up: nothing to take
        quota.write_text(json.dumps({"default": 0.5, "acme": 0.5}))
        os.utime(quota, ns=(1, 1))
        deadline = time.monotonic() + 10 * QUOTA_POLL_S
        taken = None
        while taken is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the watcher's thread, not this one, reads the file
            taken = watcher.take()
        assert taken == (0.5, (("acme", 0.5),))
        assert watcher.take() is None
    finally:
        watcher.close()


def test_a_refused_mapping_is_counted_once_and_never_taken(tmp_path: Path) -> None:
    quota = tmp_path / "quota.json"
    quota.write_text(json.dumps({"default": 1.0}))
    watcher = QuotaFile(quota, start=False)
    quota.write_text('{"default": 0.7, "a": 0.5}')
    os.utime(quota, ns=(2, 2))
    watcher.check()
    watcher.check()  # the same change again: not read twice
    assert watcher.errors == 1 and watcher.take() is None
