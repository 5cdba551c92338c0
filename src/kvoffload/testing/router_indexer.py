"""NVIDIA Dynamo's standalone KV indexer as a real process on loopback, for checking what a KV-aware router learns
from an engine's KV events (issue 44).

``RouterIndexer`` starts ``python -m dynamo.indexer`` from its own venv (``.venv-dynamo``, built by ``make
setup-dynamo`` from requirements-dynamo.txt; ``KVOFFLOAD_DYNAMO_PYTHON`` names another interpreter), subscribed to
the given ``worker_id=endpoint`` ZMQ publishers, and answers what the indexer scores for a prompt (``score``), what
it holds (``dump``) and how many batches it could not decode (``decode_failures``). No kvoffload code needs this
module at serving time.

What Dynamo 1.6.1's indexer does with vLLM 0.32's events (measured; tests/testing/test_router_indexer.py asserts
each line):

- Wiring: a publisher must *bind* for the indexer (a subscriber that connects) to hear it. vLLM binds an endpoint
  holding ``*`` (``tcp://*:5557``) and *connects* to any other (``tcp://127.0.0.1:5557`` reaches nobody).
- Media (exact, case-sensitive strings): "GPU", "DEVICE" and ``None`` index on its device tier; "CPU" on host;
  "STORAGE" and "DISK" on disk; "REMOTE" on a tier it calls external. Any other string ("cpu", "HOST",
  "OBJECT", "foo") drops that event without a log line; the other events of its batch are indexed. No medium
  string makes a batch fail to decode. A ``BlockRemoved`` with such a medium removes nothing.
- ``/query`` counts per tier in tokens, cumulatively: ``gpu`` the prefix held on the device; ``cpu`` on device or
  host; ``disk`` on device, host, disk or external (REMOTE). ``longest_matched`` covers every tier.
- A batch fails to decode, whole (its valid events too: "Failed to decode KvEventBatch", then a sequence gap), when
  a block hash is not an integer: kvoffload's former 16-byte ``bytes`` keys. Any 64-bit integer, negative too,
  decodes (vLLM's publisher cannot encode a larger one: it logs and skips that batch).
- Blocks it will not index (a warning, the other blocks and events stay): ``token_ids`` shorter than
  ``block_size`` per block (the former empty lists), ``block_size`` unequal to its ``--block-size``, and a store
  whose ``parent_block_hash`` this worker does not hold (on any medium): skipped for good, a parent that arrives
  later does not bring it back. Announcements must therefore go parent first, from the prefix's first block.
- Tracking is per worker and per medium, not counted: storing a hash twice on one medium is harmless, but one
  ``BlockRemoved`` on that medium removes it. A "GPU" remove leaves the "CPU" and "STORAGE" entries of the same
  hash (and "CPU" the others); ``medium=None`` removes as "GPU". ``AllBlocksCleared`` clears the worker's every
  medium. A remove of a hash it does not hold only logs a warning.
- ``lora_name`` enters its hash (a query must name the same LoRA); ``extra_keys`` do not change what it scores.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

START_TIMEOUT_S = 20.0
HTTP_TIMEOUT_S = 5.0
POLL_S = 0.05
DYNAMO_PYTHON_ENV = "KVOFFLOAD_DYNAMO_PYTHON"
_REPO = Path(__file__).resolve().parents[3]
_DROPPED = re.compile(r"Failed to decode|Block not published|Failed to find parent block|\bERROR\b")
"""Log lines of an event or a whole batch the indexer dropped (not: removes of blocks it did not hold, harmless)."""
_WARNING = re.compile(r"\b(WARN|ERROR)\b")
_GAP = re.compile(r"Gap detected")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

T = TypeVar("T")


class IndexerUnavailable(RuntimeError):
    """No Python with ``dynamo.indexer`` (``make setup-dynamo`` builds .venv-dynamo; or set KVOFFLOAD_DYNAMO_PYTHON)."""


@dataclass(frozen=True)
class WorkerScore:
    """What the indexer scores for one worker and one prompt, in tokens (``block_size`` converts to blocks).

    ``gpu`` / ``cpu`` / ``disk`` are cumulative: the longest prefix held on the device; on the device or host; on
    any of the three.
    """

    worker_id: int
    block_size: int
    longest_matched: int
    gpu: int
    cpu: int
    disk: int

    @property
    def blocks(self) -> int:
        return self.longest_matched // self.block_size

    def tier_blocks(self) -> dict[str, int]:
        return {"gpu": self.gpu // self.block_size, "cpu": self.cpu // self.block_size,
                "disk": self.disk // self.block_size}


def dynamo_python() -> Path:
    """The interpreter that runs ``dynamo.indexer``.

    Raises:
        IndexerUnavailable: neither KVOFFLOAD_DYNAMO_PYTHON nor the repository's .venv-dynamo has one.
    """
    named = os.environ.get(DYNAMO_PYTHON_ENV)
    path = Path(named) if named else _REPO / ".venv-dynamo" / "bin" / "python"
    if not path.is_file() or not os.access(path, os.X_OK):
        origin = f"{DYNAMO_PYTHON_ENV}={named}" if named else str(path)
        raise IndexerUnavailable(f"Dynamo's indexer is not installed ({origin} is missing): run `make setup-dynamo`")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], T], timeout: float, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    Raises:
        TimeoutError: still falsy after ``timeout`` seconds (the message names ``what``).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {timeout:.1f} s")
        time.sleep(POLL_S)


class RouterIndexer:
    """One ``dynamo.indexer`` process following ZMQ publishers, on a free loopback HTTP port.

    Args:
        workers: worker id -> ZMQ endpoint the indexer connects to (the publisher binds it).
        block_size: the engine block size in tokens (``--block-size``).
    Raises:
        IndexerUnavailable: no Dynamo install (see ``dynamo_python``).
        RuntimeError: it did not answer within ``START_TIMEOUT_S``; the message holds its log.
    """

    def __init__(self, workers: Mapping[int, str], block_size: int, model_name: str = "default") -> None:
        python = dynamo_python()
        self.block_size = block_size
        self.model_name = model_name
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="kvoffload-indexer-")
        self.log_path = Path(self._dir.name) / "indexer.log"
        spec = ",".join(f"{worker}={endpoint}" for worker, endpoint in workers.items())
        cmd = [str(python), "-m", "dynamo.indexer", "--block-size", str(block_size), "--port", str(self.port),
               "--threads", "1", "--workers", spec, "--model-name", model_name]
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, env={**os.environ, "NO_COLOR": "1"})
        try:
            self.wait_ready(workers)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, workers: Mapping[int, str], timeout: float = START_TIMEOUT_S) -> None:
        """Until the HTTP server answers and every worker's ZMQ listener is active."""
        def ready() -> bool:
            if self._proc.poll() is not None:
                raise RuntimeError(f"dynamo.indexer exited with {self._proc.returncode}:\n{self.log()}")
            try:
                listed = self._get("/workers")
            except (OSError, urllib.error.URLError):
                return False
            active = {int(w["instance_id"]) for w in listed if w.get("status") == "active"}
            return set(workers) <= active
        try:
            wait_for(ready, timeout, "dynamo.indexer ready")
        except TimeoutError as e:
            raise RuntimeError(f"{e}:\n{self.log()}") from None

    # --- HTTP -------------------------------------------------------------------------------------------------
    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=HTTP_TIMEOUT_S) as r:
            return json.loads(r.read())

    def _post(self, path: str, body: object) -> Any:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as r:
            return json.loads(r.read())

    def workers(self) -> list[dict[str, Any]]:
        return list(self._get("/workers"))

    def dump(self) -> list[dict[str, Any]]:
        """Every indexed block of this model as the indexer's events (``worker_id``, ``storage_tier``, ``event``)."""
        groups = self._get("/dump")
        return [e for key, group in groups.items() if key.startswith(f"{self.model_name}:")
                for e in group.get("events", [])]

    def raw_score(self, token_ids: Sequence[int], lora_name: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"token_ids": list(token_ids), "model_name": self.model_name}
        if lora_name is not None:
            body["lora_name"] = lora_name
        return dict(self._post("/query", body))

    def score(self, token_ids: Sequence[int], lora_name: str | None = None) -> dict[int, WorkerScore]:
        """Per worker that holds any prefix of ``token_ids``: what it matches, in tokens (none: absent)."""
        instances = self.raw_score(token_ids, lora_name).get("instances", {})
        return {int(w): WorkerScore(worker_id=int(w), block_size=self.block_size,
                                    longest_matched=int(s.get("longest_matched", 0)), gpu=int(s.get("gpu", 0)),
                                    cpu=int(s.get("cpu", 0)), disk=int(s.get("disk", 0)))
                for w, s in instances.items()}

    def worker_score(self, token_ids: Sequence[int], worker_id: int, lora_name: str | None = None) -> WorkerScore:
        """``score`` for one worker; all zeros when it matches nothing."""
        return self.score(token_ids, lora_name).get(worker_id, WorkerScore(worker_id, self.block_size, 0, 0, 0, 0))

    # --- its log ----------------------------------------------------------------------------------------------
    def log(self) -> str:
        return _ANSI.sub("", self.log_path.read_text(errors="replace")) if self.log_path.exists() else ""

    def warning_lines(self) -> list[str]:
        """Every WARN / ERROR line of its log (dropped events, sequence gaps, removes of blocks it did not hold)."""
        return [line for line in self.log().splitlines() if _WARNING.search(line)]

    def dropped_lines(self) -> list[str]:
        """Lines saying it dropped a batch it could not decode, or a block it would not index (wrong block size,
        too few token ids, a parent it never saw), or any ERROR."""
        return [line for line in self.log().splitlines() if _DROPPED.search(line)]

    def decode_failures(self) -> int:
        """How many batches or blocks it dropped (``dropped_lines``); 0 when everything it heard was indexed."""
        return len(self.dropped_lines())

    def gaps(self) -> int:
        """Sequence gaps it saw: batches lost on the wire (a PUB socket drops what it sends before the subscriber
        connects) or ones vLLM's publisher could not encode; a batch that failed to decode counts as one too."""
        return sum(1 for line in self.log().splitlines() if _GAP.search(line))

    def wait_for(self, predicate: Callable[[], T], timeout: float = 10.0, what: str = "indexer condition") -> T:
        """``wait_for`` with the indexer's recent log in the timeout's message."""
        try:
            return wait_for(predicate, timeout, what)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; indexer log tail:\n" + "\n".join(self.log().splitlines()[-15:])) from None

    def wait_for_blocks(self, token_ids: Sequence[int], worker_id: int, blocks: int, tier: str = "longest_matched",
                        timeout: float = 10.0) -> WorkerScore:
        """Until ``worker_id`` scores exactly ``blocks`` blocks of ``token_ids`` on ``tier`` (a WorkerScore field)."""
        found: list[WorkerScore] = []

        def reached() -> bool:
            found.append(self.worker_score(token_ids, worker_id))
            return bool(getattr(found[-1], tier) == blocks * self.block_size)
        self.wait_for(reached, timeout, f"worker {worker_id} scoring {blocks} blocks on {tier}")
        return found[-1]

    # --- lifecycle --------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Kill its process group and wait for it; idempotent."""
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait(timeout=10)

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RouterIndexer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
