"""Engines of two users sharing a pool (``node_shared_group``) are alive to each other exactly while they run: the
kernel's locks say so (tiers/node/liveness.py), not /proc, which Linux refuses for another user's process."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from pathlib import Path

from tests.tiers.node.users import GROUP, USERS, as_user

from kvoffload.config import NodeTierConfig
from kvoffload.keys import Namespace
from kvoffload.tiers.node.liveness import EngineLocks
from kvoffload.tiers.node.segment import access_of, open_directory

ENGINE = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from kvoffload.config import NodeTierConfig
    from kvoffload.keys import Namespace
    from kvoffload.tiers.node.index import NodeIndex
    from kvoffload.tiers.node.liveness import EngineLocks
    from kvoffload.tiers.node.files import open_index
    from kvoffload.tiers.node.segment import NodeGeometry, access_of, open_directory

    node = NodeTierConfig(Path(sys.argv[1]), shared_group=int(sys.argv[2]))
    ns = Namespace(model="m", dtype="bf16", layout="liveness")
    directory = open_directory(node, ns)
    segment, files = open_index(directory, NodeGeometry(8, 64, ns.chain_root()), access_of(node))
    index = NodeIndex(segment, EngineLocks(directory, access_of(node)), files)  # attaching first releases the dead
    if sys.argv[3] == "hold":
        print("attached", flush=True)
        sys.stdin.read()  # until the test kills this engine
    else:
        try:
            os.stat(f"/proc/{sys.argv[3]}/ns/pid")
            proc = "readable"
        except PermissionError:
            proc = "refused"
        except FileNotFoundError:
            proc = "gone"
        counters = index.pool_counters()
        print(counters["reclaimed"], counters["attached"], proc)
        index.close()
""")


def check(path: Path, other_pid: int) -> tuple[int, int, str]:
    """An engine of the second user attaches, reads the pool's counters, and detaches."""
    done = subprocess.run([*as_user(USERS[1]), ENGINE, str(path), str(GROUP), str(other_pid)], capture_output=True,
                          text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    reclaimed, attached, proc = done.stdout.split()
    return int(reclaimed), int(attached), proc


def test_an_engine_of_another_user_is_alive_while_it_runs_and_released_once_killed(shared_path: Path) -> None:
    holder = subprocess.Popen([*as_user(USERS[0]), ENGINE, str(shared_path), str(GROUP), "hold"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "attached"
        # The control: /proc, which liveness was read from before, is refused across users, so that check took
        # this running engine for dead and released its pins and slots under it.
        assert check(shared_path, holder.pid) == (0, 2, "refused")
        assert check(shared_path, holder.pid) == (0, 2, "refused")  # still alive at the next look
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The killed engine's lock went with it: released by the next look.
    assert check(shared_path, holder.pid) == (1, 1, "gone")


def test_the_engines_file_has_the_groups_mode_and_a_held_byte_is_seen_by_another_handle(node_path: Path) -> None:
    node = NodeTierConfig(node_path, shared_group=os.getegid())
    directory = open_directory(node, Namespace(model="m", dtype="bf16", layout="liveness-file"))
    mine, theirs = EngineLocks(directory, access_of(node)), EngineLocks(directory, access_of(node))
    assert oct((directory / "engines").stat().st_mode & 0o777) == "0o660"
    mine.hold(5)
    assert theirs.held(5) and not theirs.held(4)
    assert not mine.held(5)  # a handle does not conflict with its own lock: an engine never judges itself
    mine.close()  # what the kernel does when the engine's process ends
    assert not theirs.held(5)
    theirs.close()
