"""Fixtures of the node tier's tests."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from tests.tiers.node.users import USERS, as_user


@pytest.fixture
def shared_path(node_path: Path) -> Path:
    """``node_path``, made usable by both users of ``users.USERS`` (the test skips without root and setpriv)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run engines as two other users")
    os.chmod(node_path, 0o1777)  # as /dev/shm is: anyone may make an entry, only its owner may replace it
    probe = subprocess.run([*as_user(USERS[0]), "import kvoffload"], capture_output=True, text=True, cwd="/")
    if probe.returncode != 0:
        pytest.skip(f"another user cannot import kvoffload from this checkout: {probe.stderr.strip()[-200:]}")
    return node_path
