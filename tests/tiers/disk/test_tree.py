"""tree.open_tree and the directories above disk_path: whoever can write one of them could swap the tier's tree
after start-up, so each must be safe (as OpenSSH's StrictModes), or a tier secret must authenticate blocks. Nothing
below disk_path may be a symbolic link. A rank directory of the old one-file-per-block format is named in one
warning and never read."""

from __future__ import annotations

import builtins
import logging
import os
import re
from pathlib import Path

import pytest

from kvoffload.auth import TierSecret
from kvoffload.config import ConfigError, DiskTierConfig
from kvoffload.keys import Namespace, offload_key
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.disk.paths import rank_directory
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


@pytest.mark.parametrize("below", ["world", "world/0"], ids=["world", "rank"])
def test_a_symbolic_link_below_disk_path_is_refused_naming_it_and_what_it_points_at_is_left_alone(
        tmp_path: Path, below: str) -> None:
    disk_path, victim = tmp_path / "kv", tmp_path / "victim"
    link = disk_path / below
    for directory in (link.parent, victim):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    link.symlink_to(victim, target_is_directory=True)
    with refused(disk_path, f"{re.escape(str(link))} is a symbolic link"):
        opened(disk_path)
    assert list(victim.iterdir()) == []


# ---- the old format: one file per block, in fan-out directories -------------------------------------------------

def test_an_old_format_rank_directory_draws_one_warning_naming_it_and_is_never_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    disk_path, ns = tmp_path / "kv", Namespace("m", "bf16", "pages=64")
    rank_dir = rank_directory(disk_path, ns)
    old_key = offload_key(b"o" * 16, 0)  # type: ignore[arg-type]
    block = rank_dir / old_key.hex()[:2] / f"{old_key.hex()}.kvb"  # where version 1 kept a block
    block.parent.mkdir(parents=True)
    block.write_bytes(b"a version 1 block")
    (rank_dir / "0f").mkdir()
    (rank_dir / "AB").mkdir()  # not a fan-out name
    (rank_dir / "cd").write_bytes(b"")  # a file, not a directory
    (rank_dir / "ef").symlink_to(tmp_path, target_is_directory=True)
    touched: list[str] = []

    def watch(real):  # type: ignore[no-untyped-def]
        def call(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            touched.append(os.fspath(path))
            return real(path, *args, **kwargs)
        return call

    for module, name in ((os, "open"), (os, "scandir"), (os, "listdir"), (os, "stat"), (builtins, "open")):
        monkeypatch.setattr(module, name, watch(getattr(module, name)))
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        opened_tree = open_tree(disk_path, rank_dir, PRIVATE)
        index = DiskIndex.create(DiskTierConfig(path=disk_path, capacity_bytes=1 << 20), ns, 1024)
        assert index.lookup([old_key]).hits == 0
        index.close()
    monkeypatch.undo()
    assert opened_tree.rank_dir == rank_dir
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # one per start-up: open_tree here, then the index's
    assert str(rank_dir) in warnings[0] and "holds 2 fan-out directories" in warnings[0]
    assert not [p for p in touched if p.startswith(str(block.parent)) or p.startswith(str(rank_dir / "0f"))]
    assert block.read_bytes() == b"a version 1 block"  # not read, not removed (the engine started alone)
    caplog.clear()
    block.unlink()
    for name in ("0f", block.parent.name):
        (rank_dir / name).rmdir()
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        open_tree(disk_path, rank_dir, PRIVATE)
    assert caplog.records == []  # AB, cd and ef are no fan-outs
