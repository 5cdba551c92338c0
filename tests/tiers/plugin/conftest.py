"""The ram tier (``ramtier/``) installed the way a package installs a tier: by its distribution's metadata.

``ramtier_installed`` writes a ``ramtier_test-0.0.dist-info`` directory (``METADATA`` and an ``entry_points.txt``
naming ``ramtier.spec:RamTierSpec`` in the ``kvoffload.tiers`` group) into a temporary directory and puts it and
this directory (the package's parent) on ``sys.path`` for the test, as an installed package's site directory would
be: ``importlib.metadata.entry_points(group="kvoffload.tiers")`` then finds it. Tests import ``ramtier`` only once
it is installed, so a test without the fixture sees no such tier.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

PLUGIN_ROOT = Path(__file__).resolve().parent
"""The directory holding the ``ramtier`` package."""
ENTRY_POINT = "ramtier = ramtier.spec:RamTierSpec"


def write_distribution(site: Path, entry_point: str = ENTRY_POINT) -> Path:
    """A distribution's metadata directory in ``site``, registering ``entry_point`` in ``kvoffload.tiers``."""
    info = site / "ramtier_test-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ramtier-test\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[kvoffload.tiers]\n{entry_point}\n")
    return info


@pytest.fixture
def ramtier_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The ram tier installed for this test; its site directory."""
    site = tmp_path / "site-packages"
    write_distribution(site)
    monkeypatch.syspath_prepend(str(PLUGIN_ROOT))
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()  # the metadata finder caches what each path entry holds
    return site
