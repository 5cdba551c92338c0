"""The chaos loop: engines of two users share a node pool while it is attacked the ways issue 34 found it broke:
engines SIGKILLed and SIGSTOPped, the pool's files removed, truncated and replaced, random words written into the
index (its header, slot table, hash table and mutex, its tenant table and the slots' tenant bytes: the engines
store for three tenants under shares; the slots' retention deadlines and their count: the engines hold some of
their blocks with hints). Throughout, no engine reads a wrong byte through the index,
no surviving engine crashes, an engine never frozen keeps making progress, and the pool's laws hold afterwards.

Raw writes into the slots' bytes by a trusted user stay outside what the index can catch (docs/node.md), so the
loop writes none. The test engines re-open the pool when they left it (a real engine goes on with misses until it
restarts), so the pool stays under load for the whole loop."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import subprocess
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

from tests.tiers.node.users import GROUP, USERS, as_user

from kvoffload import _nodeindex
from kvoffload.config import NodeTierConfig, TenantBy, TenantConfig
from kvoffload.keys import Namespace
from kvoffload.tiers.node.files import open_index
from kvoffload.tiers.node.index import NodeIndex
from kvoffload.tiers.node.liveness import EngineLocks
from kvoffload.tiers.node.segment import NodeGeometry, access_of, namespace_directory, open_directory

SLOTS, SLOT_BYTES, UNIVERSE = 24, 4096, 48
LOOP_S = 30.0
STALL_S = 10.0
"""The longest an engine never frozen itself may go without progress (each of its waits is 50 ms at most)."""

ENGINE = textwrap.dedent(f"""
    import os, random, sys, time
    from pathlib import Path
    from kvoffload import _mapguard, _nodeindex
    from kvoffload.config import NodeTierConfig, TenantBy, TenantConfig
    from kvoffload.index.retention import RetentionBook
    from kvoffload.keys import Namespace
    from kvoffload.tiers.node.files import guard, open_pool
    from kvoffload.tiers.node.index import NodeIndex
    from kvoffload.tiers.node.liveness import EngineLocks
    from kvoffload.tiers.node.segment import NodeGeometry, access_of, open_directory

    _nodeindex.set_wait_ms(50)
    node = NodeTierConfig(Path(sys.argv[1]), shared_group=int(sys.argv[2]))
    rng = random.Random(int(sys.argv[3]))
    lie = sys.argv[4] == "lie"  # writes each block's bytes wrong: what the readers' comparison must catch
    ns = Namespace(model="m", dtype="bf16", layout="chaos")
    geometry = NodeGeometry({SLOTS}, {SLOT_BYTES}, ns.chain_root())
    universe = [bytes([i]) * 16 for i in range({UNIVERSE})]
    TENANTS = TenantConfig(TenantBy.CACHE_SALT, 0.25, (("a", 0.5), ("b", 0.25)))
    book = RetentionBook(0.5)

    def attach():
        directory = open_directory(node, ns)
        segment, files, pool = open_pool(directory, 0, geometry, access_of(node))
        index = NodeIndex(segment, EngineLocks(directory, access_of(node)), files, tenants=TENANTS, retention=book)
        guards = [g for g in (guard(pool, index), guard(segment, index)) if g is not None]
        return index, segment, pool, guards

    def checked(segment, slots, epochs, state):
        try:
            return _nodeindex.verify(segment, tuple(slots), tuple(epochs), state)
        except _nodeindex.Damaged:
            return False

    index, segment, pool, guards = attach()
    print("ops 0", flush=True)
    op = 0
    while True:
        if index.detached is not None:  # a real engine goes on with misses until restarted: this one restarts
            index.close()
            index, segment, pool, guards = attach()
            print("reattached", flush=True)
        lost = lambda: any(_mapguard.lost(g) for g in guards)
        prompt = rng.sample(universe, rng.randint(1, 6))
        if rng.random() < 0.3:  # a hinted request: its blocks held for a while, in the pool or when stored
            book.hold(prompt, time.monotonic() + rng.uniform(0.05, 2.0))
        hits = index.lookup(prompt).hits
        if hits:
            spec = index.prepare_load(prompt[:hits])
            ok = 0 not in spec.epochs and checked(segment, spec.slots, spec.epochs, _nodeindex.READY)
            blocks = [bytes(pool[s * {SLOT_BYTES}:(s + 1) * {SLOT_BYTES}]) for s in spec.slots] if ok else []
            ok = ok and checked(segment, spec.slots, spec.epochs, _nodeindex.READY) and not lost()
            if ok and blocks != [key * {SLOT_BYTES // 16} for key in prompt[:hits]]:
                print("WRONG BYTES", flush=True)
                sys.exit(3)
            index.complete_load(prompt[:hits], success=ok)
        if index.tenant_book is not None:
            index.tenant_book.assign(prompt[hits:], rng.choice(["a", "b", "c", None]))
        out = index.prepare_store(prompt[hits:])
        if index.tenant_book is not None:
            index.tenant_book.clear()
        index.tenant_counts()
        index.retention.retained(), index.retention.counts()
        if out is not None:
            spec = out.store_spec
            ok = checked(segment, spec.slots, spec.epochs, _nodeindex.IN_FLIGHT) and not lost()  # the worker's check
            for key, slot in zip(out.keys_to_store, spec.slots) if ok else ():
                block = bytes(b ^ 1 for b in key) if lie else key
                pool[slot * {SLOT_BYTES}:(slot + 1) * {SLOT_BYTES}] = block * {SLOT_BYTES // 16}
            index.complete_store(out.keys_to_store, success=ok)
        op += 1
        if op % 10 == 0:
            print("ops", op, flush=True)
""")


class Engine:
    """An engine process and the times it reported progress (a reader thread drains its stdout)."""

    def __init__(self, node_path: Path, uid: int, seed: int, lie: bool = False) -> None:
        args = [str(node_path), str(GROUP), str(seed), "lie" if lie else "true"]
        self.process = subprocess.Popen([*as_user(uid), ENGINE, *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, cwd="/")
        self.progress: list[float] = []
        self.lines: list[str] = []
        self.frozen = False  # ever SIGSTOPped: its own gaps do not count
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.strip())
            if line.startswith("ops"):
                self.progress.append(time.monotonic())

    def longest_gap(self, until: float) -> float:
        times = [*self.progress, until]
        return max((b - a for a, b in itertools.pairwise(times)), default=until)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self._reader.join(timeout=5)


def directory_of(node_path: Path) -> Path:
    ns = Namespace(model="m", dtype="bf16", layout="chaos")
    return namespace_directory(NodeTierConfig(node_path, shared_group=GROUP), ns)


def test_a_reader_catches_an_engine_that_writes_wrong_bytes(shared_path: Path) -> None:
    """The control: the loop's comparison catches a wrong byte read through the index."""
    liar = Engine(shared_path, USERS[0], 1, lie=True)
    reader = Engine(shared_path, USERS[1], 1)
    try:
        reader.process.wait(timeout=60)
        assert reader.process.returncode == 3 and "WRONG BYTES" in reader.lines
    finally:
        liar.stop()
        reader.stop()


def scribble(directory: Path, rng: random.Random) -> str:
    """A random 8-byte word into the index: its sequence counter, hand, counters and attachments, or its slots
    and table (its geometry and magic make the engines leave it at once: the file faults cover that), or its tenant
    table; or a random byte as a slot's tenant; or a slot's retention deadline (random, or far in the future) or the
    count of retained slots."""
    path = directory / "index"
    layout = _nodeindex.LAYOUT
    try:
        size = path.stat().st_size
        where = rng.choice(["header", "slots", "tenants", "slot-tenant", "slot-deadline", "retained"])
        word = rng.randbytes(8)
        if where == "header":
            at = rng.randrange(layout["seq"], layout["att"] + 24 * _nodeindex.MAX_ATTACH, 8)
        elif where == "tenants":
            at = rng.randrange(layout["tenants_on"], layout["tenant"] + _nodeindex.MAX_TENANTS *
                               _nodeindex.TENANT_BYTES - 8, 8)
        elif where == "slot-tenant":
            at = _nodeindex.HEADER_BYTES + rng.randrange(SLOTS) * _nodeindex.SLOT_BYTES + layout["slot_tenant"]
            word = word[:1]
        elif where == "slot-deadline":
            at = _nodeindex.HEADER_BYTES + rng.randrange(SLOTS) * _nodeindex.SLOT_BYTES + layout["slot_deadline"]
            far = ((1 << 64) - 1, time.monotonic_ns() // 1_000_000 + 10**9)  # forever; 11 days ahead
            word = rng.choice([word, *(ms.to_bytes(8, "little") for ms in far)])
        elif where == "retained":
            at = layout["retained"]
        else:
            at = rng.randrange(_nodeindex.HEADER_BYTES, max(size - 8, _nodeindex.HEADER_BYTES + 1))
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(word)
        return f"scribble-{where}"
    except OSError:
        return "scribble-missed"


def file_fault(directory: Path, rng: random.Random) -> str:
    name = rng.choice(["index", "engines", "pool.0"])
    path = directory / name
    kind = rng.choice(["remove", "truncate", "replace"])
    try:
        if kind == "remove":
            os.unlink(path)
        elif kind == "truncate":
            os.truncate(path, rng.choice([0, path.stat().st_size // 2]))
        else:
            fresh = directory / "replacement"
            fresh.write_bytes(bytes(path.stat().st_size))
            os.chown(fresh, -1, GROUP)
            os.chmod(fresh, 0o660)
            os.replace(fresh, path)
    except FileNotFoundError:
        return f"{kind}-missed"
    return f"{kind}-{name}"


def test_the_pool_survives_the_chaos_loop(shared_path: Path) -> None:
    rng = random.Random(34)
    engines = [Engine(shared_path, USERS[i % 2], i) for i in range(4)]
    watcher = engines[0]  # never frozen nor killed: its progress is the bound on how long anyone waits
    faults: Counter[str] = Counter()
    seeds = iter(range(100, 10_000))
    try:
        deadline = time.monotonic() + LOOP_S
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.1, 0.4))
            victim = rng.choice(engines[1:])
            kind = rng.choice(["kill", "stop", "file", "scribble", "scribble", "scribble"])
            if kind == "kill":
                victim.stop()
                engines.remove(victim)
                engines.append(Engine(shared_path, rng.choice(USERS), next(seeds)))
                faults["sigkill"] += 1
            elif kind == "stop":
                victim.frozen = True
                victim.process.send_signal(signal.SIGSTOP)
                time.sleep(rng.uniform(0.2, 1.5))
                victim.process.send_signal(signal.SIGCONT)
                faults["sigstop"] += 1
            elif kind == "file":
                faults[file_fault(directory_of(shared_path), rng)] += 1
            else:
                faults[scribble(directory_of(shared_path), rng)] += 1
            for engine in engines:
                assert engine.process.poll() is None, (
                    f"an engine exited with {engine.process.returncode} (3: wrong bytes) after {dict(faults)}: "
                    f"{engine.lines[-3:]} {engine.process.stderr.read()[-3000:] if engine.process.stderr else ''}")
        end = time.monotonic()
        assert watcher.longest_gap(end) < STALL_S, (watcher.longest_gap(end), dict(faults))
        assert len(watcher.progress) > 10 and sum(len(e.progress) for e in engines) > 40, dict(faults)
    finally:
        for engine in engines:
            with contextlib.suppress(ProcessLookupError):
                engine.process.send_signal(signal.SIGCONT)
            engine.stop()
    print(f"chaos loop: {LOOP_S:.0f} s, faults {dict(sorted(faults.items()))}, watcher ops "
          f"{10 * len(watcher.progress)}, longest watcher gap {watcher.longest_gap(end):.2f} s")
    assert faults["sigkill"] and faults["sigstop"] and sum(v for k, v in faults.items() if "scribble" in k)
    assert faults["scribble-tenants"] and faults["scribble-slot-tenant"] and faults["scribble-slot-deadline"], \
        dict(faults)
    # Afterwards: whatever set is there now is whole, or made anew, and keeps its laws.
    node = NodeTierConfig(shared_path, shared_group=GROUP)
    ns = Namespace(model="m", dtype="bf16", layout="chaos")
    directory = open_directory(node, ns)
    segment, files = open_index(directory, NodeGeometry(SLOTS, SLOT_BYTES, ns.chain_root()), access_of(node))
    tenants = TenantConfig(TenantBy.CACHE_SALT, 0.25, (("a", 0.5), ("b", 0.25)))  # the engines' (ENGINE)
    index = NodeIndex(segment, EngineLocks(directory, access_of(node)), files, tenants=tenants)
    index._last_reclaim = 0.0
    index._reclaim()  # the dead released, damage repaired
    assert index.detached is None
    index.check_integrity()
    assert set(index.tenant_counts()) == {"a", "b", "other"}  # the table, reset by damage, written back
    index.close()
