"""``kvoffload node status`` and ``remove``: what an operator sees of the pools on a machine, and removing one
only when no live engine uses it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tests.tiers.node.pools import engine_in, keys, store

from kvoffload.tiers.node.index import NodeIndex
from kvoffload.tools.cli import main


def engine(node_path: Path) -> tuple[NodeIndex, Path]:
    return engine_in(node_path, layout="node-tool")


def status(node_path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    assert main(["node", "status", "--node-path", str(node_path), "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_status_lists_a_pool_with_its_engines_and_occupancy(node_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    index, directory = engine(node_path)
    store(index, keys(3))
    (pool,) = status(node_path, capsys)
    assert pool["directory"] == str(directory) and pool["owner"] == str(os.geteuid())
    assert (pool["engines_attached"], pool["engines_alive"], pool["used"], pool["capacity"]) == (1, 1, 3, 8)
    assert pool["problem"] is None and pool["counters"]["stores"] == 3  # type: ignore[index]
    assert main(["node", "status", "--node-path", str(node_path)]) == 0
    assert "1 attached, 1 alive" in capsys.readouterr().out


def test_status_reports_a_truncated_or_damaged_pool_without_crashing(node_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _, directory = engine(node_path)
    os.truncate(directory / "pool.0", 0)
    (pool,) = status(node_path, capsys)
    assert "pool.0 was truncated" in str(pool["problem"])
    os.truncate(directory / "index", 0)
    (pool,) = status(node_path, capsys)
    assert pool["problem"] is not None and pool["capacity"] == 0


def test_remove_is_refused_while_an_engine_lives_and_done_once_none_does(node_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    index, directory = engine(node_path)
    assert main(["node", "remove", directory.name, "--node-path", str(node_path)]) == 1
    assert "1 live engine(s) use it" in capsys.readouterr().out and directory.exists()
    index.close()
    assert main(["node", "remove", directory.name, "--node-path", str(node_path)]) == 0
    assert "removed" in capsys.readouterr().out and not directory.exists()
    assert status(node_path, capsys) == []


def test_remove_needs_one_pool_or_all(node_path: Path) -> None:
    assert main(["node", "remove", "--node-path", str(node_path)]) == 2
    assert main(["node", "remove", "nothing-here", "--node-path", str(node_path)]) == 1
