"""The node pool's files: refused with a clear error naming the key when they are not what every engine sharing
them agreed on, or not safe to share; remade when a killed process left them half made."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload import _nodeindex
from kvoffload.config import ConfigError, NodeTierConfig
from kvoffload.keys import Namespace
from kvoffload.tiers.node.files import ENGINES_NAME, INDEX_NAME, open_index, open_pool
from kvoffload.tiers.node.liveness import EngineLocks
from kvoffload.tiers.node.segment import (
    NodeGeometry,
    access_of,
    filesystem_type,
    namespace_directory,
    open_directory,
    own_identity,
    process_identity,
)

NS = Namespace(model="m", dtype="bf16", layout="node-segment")
GEOMETRY = NodeGeometry(8, 256, NS.chain_root())


def index_in(node_path: Path, geometry: NodeGeometry = GEOMETRY) -> object:
    node = NodeTierConfig(node_path)
    return open_index(open_directory(node, NS), geometry, access_of(node))[0]


def test_engines_of_one_namespace_open_one_index(node_path: Path) -> None:
    first, second = index_in(node_path), index_in(node_path)
    assert _nodeindex.stats(first)["capacity"] == 8
    node = NodeTierConfig(node_path)
    locks = EngineLocks(open_directory(node, NS), access_of(node))
    assert _nodeindex.attach(first, locks.fd, 1, 2, 3) == 0
    assert _nodeindex.attachments(second) == [(0, 1, 2, 3)]  # the same memory
    directory = namespace_directory(NodeTierConfig(node_path), NS)
    assert directory.parent.name == f"kvoffload-node-{os.geteuid()}" and directory.name == NS.chain_root().hex()
    assert oct(directory.stat().st_mode & 0o777) == "0o700"


def test_another_namespace_gets_its_own_directory(node_path: Path) -> None:
    other = Namespace(model="other", dtype="bf16", layout="node-segment")
    node = NodeTierConfig(node_path)
    assert namespace_directory(node, NS) != namespace_directory(node, other)


def test_a_path_off_tmpfs_is_refused_naming_node_path(tmp_path: Path) -> None:
    if filesystem_type(tmp_path) == "tmpfs":
        pytest.skip("the test directory is itself on a tmpfs here")
    with pytest.raises(ConfigError, match=r"node_path=.* not a tmpfs"):
        open_directory(NodeTierConfig(tmp_path), NS)


def test_a_missing_path_is_refused(node_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"node_path=.* is not a directory"):
        open_directory(NodeTierConfig(node_path / "absent"), NS)


def test_another_geometry_is_refused_naming_host_bytes(node_path: Path) -> None:
    index_in(node_path)
    with pytest.raises(ConfigError, match=r"host_bytes/host_gib: .* holds 8 slots of 256 bytes.* asks for 16"):
        index_in(node_path, NodeGeometry(16, 256, NS.chain_root()))


def test_another_version_is_refused(node_path: Path) -> None:
    index_in(node_path)
    path = namespace_directory(NodeTierConfig(node_path), NS) / INDEX_NAME
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", _nodeindex.VERSION + 1))
    with pytest.raises(ConfigError, match=f"version {_nodeindex.VERSION + 1}; this kvoffload uses version"):
        index_in(node_path)


def test_an_index_of_another_namespace_than_its_directory_is_made_anew(node_path: Path) -> None:
    """The directory's name is the namespace: an index saying otherwise was damaged, never another engine's."""
    index_in(node_path)
    other = index_in(node_path, NodeGeometry(8, 256, bytes(16)))
    assert _nodeindex.stats(other)["fingerprint"] == bytes(16)


def test_a_half_made_index_is_made_again(node_path: Path) -> None:
    """A process killed between creating the file and writing its magic leaves zeros: the next one formats it."""
    directory = open_directory(NodeTierConfig(node_path), NS)
    (directory / INDEX_NAME).write_bytes(bytes(4096))
    os.chmod(directory / INDEX_NAME, 0o600)
    assert _nodeindex.stats(index_in(node_path))["capacity"] == 8


def test_a_world_writable_directory_is_refused(node_path: Path) -> None:
    directory = open_directory(NodeTierConfig(node_path), NS)
    os.chmod(directory, 0o777)
    with pytest.raises(ConfigError, match=r"node_path: .* writable by others"):
        open_directory(NodeTierConfig(node_path), NS)


def test_a_node_path_others_may_write_is_refused(node_path: Path) -> None:
    os.chmod(node_path, 0o777)  # not sticky: anyone could swap the pool's directory
    with pytest.raises(ConfigError, match=r"node_path=.* writable by others \(and not sticky\)"):
        open_directory(NodeTierConfig(node_path), NS)


def test_a_symbolic_link_is_refused(node_path: Path) -> None:
    directory = namespace_directory(NodeTierConfig(node_path), NS)
    elsewhere = node_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    directory.parent.mkdir(mode=0o700)
    directory.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="symbolic link"):
        open_directory(NodeTierConfig(node_path), NS)


def test_an_index_file_others_may_write_is_refused(node_path: Path) -> None:
    index_in(node_path)
    os.chmod(namespace_directory(NodeTierConfig(node_path), NS) / INDEX_NAME, 0o666)
    with pytest.raises(ConfigError, match=r"node_path: .* writable by others"):
        index_in(node_path)


def test_a_pool_of_another_size_is_refused(node_path: Path) -> None:
    directory = open_directory(NodeTierConfig(node_path), NS)
    open_pool(directory, 0, GEOMETRY, access_of(NodeTierConfig(node_path)))
    with pytest.raises(ConfigError, match=r"host_bytes/host_gib: the node pool at .* holds 8 slots of 256 bytes"):
        open_pool(directory, 0, NodeGeometry(16, 256, NS.chain_root()), access_of(NodeTierConfig(node_path)))


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_files_an_engine_makes_have_their_modes_whatever_the_umask(node_path: Path, umask: int) -> None:
    """A shared group's files are 0660 (0640 under umask 022 refused the group's other users), private ones 0600."""
    for group, mode in ((os.getegid(), 0o660), (None, 0o600)):
        node = NodeTierConfig(node_path / f"g{group}", shared_group=group)
        node.path.mkdir(mode=0o700)
        previous = os.umask(umask)
        try:
            directory = open_directory(node, NS)
            open_pool(directory, 0, GEOMETRY, access_of(node))
        finally:
            os.umask(previous)
        assert {f.name: oct(f.stat().st_mode & 0o777) for f in directory.iterdir()} == {
            INDEX_NAME: oct(mode), ENGINES_NAME: oct(mode), "pool.0": oct(mode)}


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(mode=0o700)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_full_tmpfs_is_an_error_at_start_up_not_a_sigbus_later(node_path: Path) -> None:
    with small_tmpfs(node_path / "small", "1m") as small:
        node = NodeTierConfig(small)
        directory = open_directory(node, NS)
        big = NodeGeometry(64, 64 * 1024, NS.chain_root())  # 4 MiB of slots in 1 MiB
        with pytest.raises(ConfigError, match="the tmpfs is full: lower host_bytes"):
            open_pool(directory, 0, big, access_of(node))
        assert (directory / "pool.0").stat().st_size == 0  # nothing half-sized for the next engine to map


def test_process_identity_tells_a_reused_pid_from_the_engine() -> None:
    start, pidns = own_identity()
    assert process_identity(os.getpid()) == (start, pidns)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = process_identity(child.pid)
    child.wait()
    assert process_identity(child.pid) is None and identity != (start, pidns)
