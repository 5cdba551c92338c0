"""Engines killed with SIGKILL at random points (holding the mutex, pins, or half-written slots) leave the node
pool consistent for the others: the index's laws hold, a surviving engine never stalls, and no engine ever reads
bytes that are not the block it asked for."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kvoffload.config import NodeTierConfig
from kvoffload.keys import Namespace
from kvoffload.tiers.node.files import open_index
from kvoffload.tiers.node.index import NodeIndex
from kvoffload.tiers.node.liveness import EngineLocks
from kvoffload.tiers.node.segment import NodeGeometry, access_of, open_directory

SLOTS = 16
SLOT_BYTES = 64
UNIVERSE = 48  # keys the engines share: more than the slots, so they evict each other's blocks
LAYOUT = "node-crash"

# One engine: random lookups, loads (pin, check the epoch, read, check again, compare) and stores (reserve, write
# the block's bytes, complete), without end. Exits 3 on a wrong byte read, prints once per 100 operations.
ENGINE = textwrap.dedent(f"""
    import random, sys
    from pathlib import Path
    from kvoffload import _nodeindex
    from kvoffload.config import NodeTierConfig
    from kvoffload.keys import Namespace
    from kvoffload.tiers.node.index import NodeIndex
    from kvoffload.tiers.node.liveness import EngineLocks
    from kvoffload.tiers.node.files import open_pool
    from kvoffload.tiers.node.segment import NodeGeometry, access_of, open_directory

    ns = Namespace(model="m", dtype="bf16", layout="{LAYOUT}")
    node = NodeTierConfig(Path(sys.argv[1]))
    directory = open_directory(node, ns)
    geometry = NodeGeometry({SLOTS}, {SLOT_BYTES}, ns.chain_root())
    segment, files, pool = open_pool(directory, 0, geometry, access_of(node))
    index = NodeIndex(segment, EngineLocks(directory, access_of(node)), files)
    rng = random.Random(int(sys.argv[2]))
    universe = [bytes([i]) * 16 for i in range({UNIVERSE})]
    limit = int(sys.argv[3])
    lie = sys.argv[4:] == ["lie"]  # writes each block's bytes wrong: what the reads' comparison must catch
    for op in range(limit or 1 << 62):
        prompt = rng.sample(universe, rng.randint(1, 6))
        hits = index.lookup(prompt).hits
        if hits:
            spec = index.prepare_load(prompt[:hits])
            ok = _nodeindex.verify(index._segment, spec.slots, spec.epochs)
            blocks = [pool[s * {SLOT_BYTES}:(s + 1) * {SLOT_BYTES}] for s in spec.slots]
            ok = ok and _nodeindex.verify(index._segment, spec.slots, spec.epochs)
            if ok and blocks != [key * 4 for key in prompt[:hits]]:
                print("WRONG BYTES", flush=True)
                sys.exit(3)
            index.complete_load(prompt[:hits], success=ok)
        out = index.prepare_store(prompt[hits:])
        if out is not None:
            for key, slot in zip(out.keys_to_store, out.store_spec.slots):
                pool[slot * {SLOT_BYTES}:(slot + 1) * {SLOT_BYTES}] = bytes(b ^ 1 for b in key) * 4 if lie else key * 4
            index.complete_store(out.keys_to_store)
        if op % 100 == 0:
            print("ops", op, flush=True)
    index.check_integrity()
    print("done", flush=True)
""")

# Holds the mutex most of the time (a reserve of many keys scans them all under it), to be killed holding it.
LOCKER = textwrap.dedent(f"""
    import os, sys
    from pathlib import Path
    from kvoffload import _nodeindex
    from kvoffload.config import NodeTierConfig
    from kvoffload.keys import Namespace
    from kvoffload.tiers.node.files import open_index
    from kvoffload.tiers.node.liveness import EngineLocks
    from kvoffload.tiers.node.segment import NodeGeometry, access_of, open_directory, own_identity

    ns = Namespace(model="m", dtype="bf16", layout="{LAYOUT}")
    node = NodeTierConfig(Path(sys.argv[1]))
    directory = open_directory(node, ns)
    segment, _ = open_index(directory, NodeGeometry({SLOTS}, {SLOT_BYTES}, ns.chain_root()), access_of(node))
    locks = EngineLocks(directory, access_of(node))  # no byte held: found dead at once, as it should
    me = _nodeindex.attach(segment, locks.fd, os.getpid(), *own_identity())
    many = os.urandom(16 * 200_000)
    print("locking", flush=True)
    while True:
        _nodeindex.reserve(segment, locks.fd, me, many)
""")


def start(script: str, node_path: Path, *args: object) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", script, str(node_path), *map(str, args)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    first = process.stdout.readline().split()  # started: attached and working
    assert first and first[0] in ("ops", "locking"), first
    return process


def kill(process: subprocess.Popen[str]) -> None:
    assert process.poll() is None, f"an engine exited on its own with {process.returncode} (3: wrong bytes)"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


def test_engines_killed_at_random_points_leave_a_consistent_pool(node_path: Path) -> None:
    rng = random.Random(23)
    engines = [start(ENGINE, node_path, seed, 0) for seed in range(3)]
    for round_ in range(12):
        time.sleep(rng.uniform(0.0, 0.15))
        victim = engines.pop(rng.randrange(len(engines)))
        kill(victim)  # anywhere: mid-store, holding pins, inside the mutex
        if round_ % 3 == 0:  # and once in a while an engine killed holding the mutex
            locker = start(LOCKER, node_path)
            time.sleep(rng.uniform(0.01, 0.05))
            kill(locker)
        engines.append(start(ENGINE, node_path, 100 + round_, 0))
    for engine in engines:
        kill(engine)

    # A new engine finishes a bounded run (no stall on what the dead left), reading no wrong byte.
    survivor = subprocess.run([sys.executable, "-c", ENGINE, str(node_path), "999", "3000"], capture_output=True,
                              text=True, timeout=120)
    assert survivor.returncode == 0, survivor.stdout[-500:] + survivor.stderr[-2000:]
    assert survivor.stdout.split()[-1] == "done"

    ns = Namespace(model="m", dtype="bf16", layout=LAYOUT)
    node = NodeTierConfig(node_path)
    directory = open_directory(node, ns)
    index = NodeIndex(*open_index(directory, NodeGeometry(SLOTS, SLOT_BYTES, ns.chain_root()), access_of(node))[:1],
                      EngineLocks(directory, access_of(node)))
    index.check_integrity()
    stats = index.pool_counters()
    repairs = stats["repairs"]
    assert repairs >= 1, stats  # a locker was killed inside the mutex at least once, and repaired after
    assert stats["reclaimed"] >= 12, stats  # every killed engine's pins and stores were released
    assert stats["attached"] == 1, stats  # this one: every dead engine's attachment is free again


def test_the_engines_catch_wrong_bytes(node_path: Path) -> None:
    """The comparison the crash loop relies on is shown to fail a run that serves wrong bytes."""
    liar = subprocess.run([sys.executable, "-c", ENGINE, str(node_path), "5", "3000", "lie"], capture_output=True,
                          text=True, timeout=120)
    assert liar.returncode == 3 and "WRONG BYTES" in liar.stdout
