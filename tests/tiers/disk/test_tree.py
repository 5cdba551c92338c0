"""disk_tree.open_tree and the directories above disk_path: whoever can write one of them could swap the tier's
tree after start-up, so each must be safe (as OpenSSH's StrictModes), or a tier secret must authenticate blocks."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

from kvoffload.auth import TierSecret
from kvoffload.config import ConfigError, DiskTierConfig
from kvoffload.keys import Namespace
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.disk.tree import Access, Tree, open_tree
from kvoffload.tiers.lower.block_format import PLAIN, BlockFormat
from kvoffload.transfer.host_pool import HostPool

OTHER_UID = 12345
SECRET = BlockFormat.of(TierSecret("test", b"k" * 32))
PRIVATE = Access()
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="changes owners (chown), which only root may")


def ladder(tmp_path: Path) -> tuple[Path, Path]:
    """``tmp_path/top/middle/kv``, every directory ``0755``: (``top``, the ``disk_path``)."""
    middle = tmp_path / "top" / "middle"
    middle.mkdir(parents=True)
    for directory in (middle.parent, middle):
        directory.chmod(0o755)
    return middle.parent, middle / "kv"


def opened(disk_path: Path, fmt: BlockFormat = PLAIN, access: Access = PRIVATE) -> Tree:
    return open_tree(disk_path, disk_path / "world" / "0", access, fmt)


def refused(disk_path: Path, problem: str) -> pytest.RaisesExc[ConfigError]:
    return pytest.raises(ConfigError, match=f"disk_path={re.escape(repr(str(disk_path)))}: .*{problem}")


def test_a_disk_path_under_safe_directories_opens(tmp_path: Path) -> None:
    _, disk_path = ladder(tmp_path)
    assert opened(disk_path).rank_dir.is_dir()


@needs_root
def test_an_ancestor_owned_by_another_user_is_refused_naming_it(tmp_path: Path) -> None:
    top, disk_path = ladder(tmp_path)
    opened(disk_path)
    os.chown(top, OTHER_UID, -1)
    with refused(disk_path, f"{re.escape(str(top))} is owned by uid {OTHER_UID}"):
        opened(disk_path)


def test_an_ancestor_writable_by_others_is_refused_before_the_tree_is_made(tmp_path: Path) -> None:
    top, disk_path = ladder(tmp_path)
    top.chmod(0o757)
    with refused(disk_path, f"{re.escape(str(top))} is writable by others"):
        opened(disk_path)
    assert not (disk_path / "world").exists()


def test_an_ancestor_writable_by_a_group_is_accepted_only_for_the_shared_group(tmp_path: Path) -> None:
    top, disk_path = ladder(tmp_path)
    os.chown(top, -1, 4242)
    top.chmod(0o775)
    with refused(disk_path, f"{re.escape(str(top))} is writable by group 4242"):
        opened(disk_path)
    assert opened(disk_path, access=Access(gid=4242)).rank_dir.is_dir()
    with refused(disk_path, "writable by group 4242"):
        opened(disk_path, access=Access(gid=4343))


def test_a_sticky_ancestor_writable_by_others_is_accepted(tmp_path: Path) -> None:
    top, disk_path = ladder(tmp_path)
    top.chmod(0o1777)  # like /tmp: others cannot rename or remove ``middle``, which is ours
    assert opened(disk_path).rank_dir.is_dir()


@needs_root
def test_a_sticky_ancestor_is_refused_when_the_entry_on_our_path_is_another_users(tmp_path: Path) -> None:
    top, target = ladder(tmp_path)
    top.chmod(0o1777)
    target.mkdir(mode=0o700)
    link = top / "kv-link"  # an entry of the sticky directory that its owner (not us) could replace
    link.symlink_to(target, target_is_directory=True)
    opened(link)
    os.lchown(link, OTHER_UID, -1)
    with refused(link, f"{re.escape(str(top))} is writable by others, sticky, but .*kv-link in it is owned by uid "
                       f"{OTHER_UID}"):
        opened(link)


def test_the_directories_a_symbolic_link_at_disk_path_leads_through_are_checked(tmp_path: Path) -> None:
    top, target = ladder(tmp_path)
    target.mkdir(mode=0o700)
    link = tmp_path / "kv"  # an administrator's link, in a safe directory, into an unsafe one
    link.symlink_to(Path("top") / "middle" / "kv", target_is_directory=True)  # relative: resolved from tmp_path
    opened(link)
    top.chmod(0o757)
    with refused(link, f"{re.escape(str(top))} is writable by others"):
        opened(link)


def test_a_loop_of_symbolic_links_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(ConfigError, match="cannot hold the disk tier"):
        opened(tmp_path / "a" / "kv")


def test_with_a_tier_secret_an_unsafe_ancestor_is_one_warning_not_an_error(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    top, disk_path = ladder(tmp_path)
    top.chmod(0o757)
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert opened(disk_path, SECRET).rank_dir.is_dir()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"{top} is writable by others" in warnings[0] and str(disk_path) in warnings[0]
    caplog.clear()
    top.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        opened(disk_path, SECRET)
    assert caplog.records == []


def test_both_halves_refuse_an_unsafe_ancestor_with_the_same_error(tmp_path: Path) -> None:
    top, disk_path = ladder(tmp_path)
    top.chmod(0o757)
    config, ns = DiskTierConfig(path=disk_path, capacity_bytes=1 << 20), Namespace("m", "bf16", "pages=64")
    with refused(disk_path, "writable by others") as scheduler:
        DiskIndex.create(config, ns, 1024)
    with refused(disk_path, "writable by others") as worker:
        DiskHandler(config, HostPool(1, 64), ns, (64,))
    assert str(worker.value) == str(scheduler.value)
