"""The node pool's rows of ``kvoffload bench faults``: the longest step of two simulated engines sharing one node pool
while another process holds the pool's index lock for ``HOLD_S`` seconds (an engine frozen holding it), beside the
same workload with the lock free. Each engine gets a new prompt every ``EVERY`` steps, so stores, pins and unpins
keep wanting the lock throughout."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

HOLD_S = 3.0
EVERY = 20
"""Steps between two new prompts of one engine."""

_HOLDER = textwrap.dedent("""
    import fcntl, os, struct, sys
    fd = os.open(sys.argv[1], os.O_RDWR)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, struct.pack("hhxxxxqqixxxx", fcntl.F_WRLCK, os.SEEK_SET, int(sys.argv[2]), 1,
                                                    0))
    print("locked", flush=True)
    sys.stdin.read()
""")


def node_rows(rounds: int) -> list[dict[str, Any]]:
    """One row with the lock free and one with it held, as ``faults.StepRow`` fields."""
    rows = []
    for fault in ("free", "held 3 s"):
        times: list[float] = []
        finished = True
        for r in range(rounds):
            run_times, done = _round(fault != "free", seed=100 * r)
            times += run_times
            finished = finished and done
        rows.append({"tier": "node", "fault": fault, "side": "-", "max_step_ms": max(times) * 1e3,
                     "median_step_ms": statistics.median(times) * 1e3, "steps": len(times), "finished": finished})
    return rows


def _round(held: bool, seed: int) -> tuple[list[float], bool]:
    from kvoffload import _nodeindex
    from kvoffload.testing import sim_workload
    from kvoffload.testing.sim import Status
    from kvoffload.testing.sim_workload import run_timed, tokens

    path = Path(tempfile.mkdtemp(prefix="kvoffload-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        engines = [sim_workload.make_engine(host_blocks=16, host_scope="node", node_path=str(path)) for _ in "ab"]
        holder = _hold(path, _nodeindex.MAX_ATTACH) if held else None
        times: list[float] = []
        requests = []
        started = time.monotonic()
        step = 0
        while time.monotonic() - started < HOLD_S:
            for i, engine in enumerate(engines):
                if step % EVERY == 0:
                    requests.append(engine.add_request(f"r{i}.{step}", tokens(16, seed=seed + step + i)))
                began = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - began)
            step += 1
        if holder is not None:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait()
        for engine in engines:
            times += run_timed(engine, checked=False)
            engine.scheduler.index.close()
        return times, all(q.status is Status.FINISHED for q in requests)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _hold(path: Path, byte: int) -> subprocess.Popen[str]:
    (engines,) = path.glob("kvoffload-node-*/*/engines")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(engines), str(byte)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder
