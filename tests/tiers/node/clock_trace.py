"""A fixed sequence of two engines' operations on a small node index, and what the index answered: the record that
shows the pool without tenants evicts exactly as before tenants existed (test_tenants.py).

``clock_trace.json`` was recorded by running ``run`` on the index module of commit c38b672 (index version 3, before
tenants), loaded from its prebuilt ``.so``::

    python -m tests.tiers.node.clock_trace /path/to/old/_nodeindex.cpython-311-x86_64-linux-gnu.so
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

SLOTS, TABLE, UNIVERSE, OPS = 16, 32, 40, 600
RECORD = Path(__file__).with_name("clock_trace.json")


def run(module: Any, setup: Any = None) -> list[Any]:
    """The answers of ``module`` (a ``_nodeindex``) to the sequence; ``setup(buffer, fd, attachment)`` runs once
    after the engines attach (the test's control turns tenants on there)."""
    rng = random.Random(2026)
    buffer = bytearray(module.size(SLOTS, TABLE))
    module.init(buffer, SLOTS, 64, TABLE, bytes(16), 1 << 20, 1)
    keys = [i.to_bytes(2, "little") * 8 for i in range(UNIVERSE)]
    with tempfile.TemporaryFile() as lock_file:
        fd = lock_file.fileno()
        engines = [module.attach(buffer, fd, 100 + e, 1, 1) for e in range(2)]
        if setup is not None:
            setup(buffer, fd, engines[0])
        in_flight: list[list[tuple[int, int]]] = [[], []]
        pinned: list[list[tuple[int, int]]] = [[], []]
        answers: list[Any] = []
        for _ in range(OPS):
            e = rng.randrange(2)
            a, op = engines[e], rng.choice(["reserve", "reserve", "complete", "pin", "unpin", "touch", "lookup"])
            chosen = b"".join(rng.sample(keys, rng.randint(1, 5)))
            if op == "reserve":
                out = module.reserve(buffer, fd, a, chosen)
                if out is not None:
                    in_flight[e] += list(zip(out[1], out[2], strict=True))
                    out = [out[0], out[1], out[2], out[3].hex()]
                answers.append(["reserve", e, out])
            elif op == "complete" and in_flight[e]:
                done, in_flight[e] = in_flight[e], []
                module.complete(buffer, fd, a, [s for s, _ in done], [x for _, x in done], rng.random() < 0.85)
                answers.append(["complete", e])
            elif op == "pin":
                got = [tuple(p) for p in module.pin(buffer, fd, a, chosen) if p[0] >= 0]
                pinned[e] += got
                answers.append(["pin", e, got])
            elif op == "unpin" and pinned[e]:
                done, pinned[e] = pinned[e], []
                module.unpin(buffer, fd, a, [s for s, _ in done], [x for _, x in done], rng.random() < 0.2)
                answers.append(["unpin", e])
            elif op == "touch":
                module.touch(buffer, chosen)
            elif op == "lookup":
                answers.append(["lookup", e, list(module.lookup(buffer, fd, a, chosen))])
        answers.append(["stats", {k: v for k, v in module.stats(buffer).items() if k in ("used", "stores",
                                                                                         "evictions")}])
    return json.loads(json.dumps(answers))  # tuples as lists, as the record reads back


def load(path: str) -> ModuleType:
    """The index module in the ``.so`` at ``path``."""
    loader = importlib.machinery.ExtensionFileLoader("_nodeindex", path)
    spec = importlib.util.spec_from_file_location("_nodeindex", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


if __name__ == "__main__":
    RECORD.write_text(json.dumps(run(load(os.path.abspath(sys.argv[1]))), separators=(",", ":")) + "\n")
